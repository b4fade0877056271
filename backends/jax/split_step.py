"""`SplitStep`: an NNX train step run as `jax.jit` over the split state of its objects.

`nnx.jit` walks the model's and the optimizer's object graph on every call; for a ResNet-18 that
host work was ~5.5 ms per step on an H200 host (docs/benchmarks.md), more than the device's step at
batch 96. `SplitStep` splits (model, optimizer) once into a static graph definition and a state
pytree, and calls one `jax.jit` per graph definition with the state's leaves as a flat list: per
call the host hands jit a list of arrays (flattened in C++) and rebuilds no `nnx.Variable`; the
state's tree is rebuilt inside the trace only. On an accelerator the list is packed (`pack`,
`packing.StatePacking`: one flat buffer per dtype and placement), as a call costs the host time per
buffer. The graph definition changes only when a static attribute
does (a new precision policy at a control boundary); each one seen keeps its compiled step, found
by identity, so a policy seen before is not recompiled. `SplitStep.bind` runs further functions
over part of the same state (e.g. an optimizer update over the parameters' state and the optimizer,
which a new precision policy then does not recompile).

Compilations off the critical path (`compile_ahead`, on by default): each variant (graph
definition x argument shapes) runs as an ahead-of-time executable (`jax.jit(...).lower(...).compile()`);
from the first step on, at each control boundary, the variants the controller may ask for
(`Controller.likely_next`: every batch bucket up to the ceiling, the gradient-noise
half batches unless the loader pads them to the full batch, and with ``foresee_policies`` the
precision policy the next decision would take) and the bound functions with known argument shapes (e.g. an evaluation, compiled per
policy) are queued, nearest first, on a background thread from abstract shapes; the step takes them
when the controller switches, with no trace. A step without a TriAccel (a static baseline) queues its
bound functions' known shapes once, when its first compilation is done. `compile_log.CompileLog` shows what still compiles on
the critical path. The persistent compilation cache is on by default (`compile_cache`, see
`enable_compilation_cache`).
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from .compile_ahead import AheadCompiler, abstract, enable_compilation_cache
from .packing import StatePacking
from .policy import CountingJit, applied_policy, commit, policy_names

__all__ = ["SplitStep"]


class SplitStep:
    """`fn(model, optimizer, *args) -> out` as a pure jitted function of the objects' state.

    Between `sync()` calls the objects hold stale (donated) arrays: the current values live in
    ``state`` (an `nnx.State`, rebuilt on each read from the flat leaves the step carries). Call
    `sync()` before reading or changing the objects outside the step (evaluation, checkpoints), and
    `resplit()` after changing their structure or static attributes; `control` moves what
    `TriAccel.control` needs itself.

    fn: the train step; it may update the objects in place, as under `nnx.jit`. ta: the `TriAccel`
    whose `control` runs at boundaries; its `jit` counts each variant's compilation and memory
    footprint (the micro-batch is the leading axis of the first array in ``args``).
    compile_ahead: True (default): compile the likely next variants on a background thread at
    control boundaries (module docstring), beside the caller's own compilations; without ``ta``
    only the bound functions' known shapes, once the step's first call is compiled.
    "after": the same, but no background XLA compilation runs while the caller's thread compiles
    (the step's variants and bound functions are traced and lowered meanwhile): two XLA
    compilations at once end later than one after the other, the one the loop waits for took
    1.6-2.3x its time alone (ResNet-18 step and evaluation, H100, 2026-11-25, once 52-54 s instead
    of ~17 s), yet in five cold demo runs against "after" (2026-11-27/28, ResNet-18 seeds 0 and 2,
    EfficientNet-B0 seeds 2 and 1, seed 2 with ~4.5 s of cached kernel in its favour; docs/results.md)
    True finished 2.1-22.6 s sooner: the evaluation's compilation is off the loop's path. False: each
    variant compiles at its first call.
    pad_to_batch: the loader pads every micro-batch to the bucket of the decided batch
    (`ElasticLoader(pad_to_batch=True)`), so the gradient-noise half batches and the epoch's short
    last step need no variants of their own: only the decided sizes are compiled ahead.
    loader: optional, the `ElasticLoader` that feeds the step: sizes compiled ahead are padded as
    its ``pad_floor`` (read at each preparation) pads the micro-batches, so no variant below the
    floor is compiled.
    compile_cache: JAX's persistent compilation cache: True (default) -> ``<cache>/jax`` unless
    the user set a folder, a folder, or False/None -> off (`enable_compilation_cache`).
    pack: carry the state between calls as a few flat buffers (`packing.StatePacking`: a call costs
    the host time per buffer, most where the state is not donated); "auto" (default): where the
    state lives on an accelerator, not on a CPU (where the packing's slices doubled a step's first
    call and saved under 1% per step: `benchmarks/jax_packing.py`).
    mesh: data parallelism (`sharding.data_mesh`; default: ``ta.mesh``): the state is replicated
    on the mesh, the batch arguments are expected split along its data axis (`sharding.shard_batch`,
    an `ElasticLoader` with ``device=batch_sharding(mesh)``), other arguments replicated or
    uncommitted; outputs are replicated unless ``out_shardings`` is given. One SPMD program per
    variant: the gradients and statistics inside are the global batch's.
    compiler_options: XLA options for every program this step and its bound functions compile
    (`jax.jit`'s ``compiler_options``, e.g. ``{"xla_gpu_autotune_level": 2}``); None: XLA's defaults.
    An option XLA does not know fails at the first compilation, naming it.
    foresee_policies: also compile ahead the step and the bound functions under the precision policy
    `Controller.likely_next` foresees for the next boundary (False, default: the batch sizes only).
    That policy is one control interval away (50 steps, 0.2-0.6 s of training), less than its
    compilation takes (15-85 s: one on time saves at most the interval), and when the foresight is
    wrong the compilation shares the CPU with training for nothing: on JAX EfficientNet-B0 (H100,
    2026-12-07) one ran 21.6 s beside epochs 2-10 and the policy never came, in both runs that
    foresaw one; in the 49 committed JAX triaccel runs with decision records the policy never changed.
    jit_kwargs: passed to `jax.jit` (the state, argument 0, is donated unless ``donate_argnums``
    is given).
    """

    def __init__(self, fn: Callable[..., Any], model: Any, optimizer: Any, *, ta: Any = None,
                 compile_ahead: bool | str = True, compile_cache: str | Path | bool | None = True,
                 mesh: Any = None, pad_to_batch: bool = False, loader: Any = None,
                 pack: bool | str = "auto", compiler_options: Mapping[str, Any] | None = None,
                 foresee_policies: bool = False,
                 **jit_kwargs: Any) -> None:
        import jax
        from flax import nnx

        if not (isinstance(compile_ahead, bool) or (isinstance(compile_ahead, str) and compile_ahead == "after")):
            raise ValueError(f"compile_ahead={compile_ahead!r}: allowed True, False or 'after'")
        self._hold_ahead = compile_ahead == "after"
        if not isinstance(pad_to_batch, bool):
            raise ValueError(f"pad_to_batch={pad_to_batch!r}: allowed True or False")
        if not (isinstance(pack, bool) or pack == "auto"):
            raise ValueError(f"pack={pack!r}: allowed True, False or 'auto'")
        self._pack = pack
        if not isinstance(foresee_policies, bool):
            raise ValueError(f"foresee_policies={foresee_policies!r}: allowed True or False")
        self.foresee_policies = foresee_policies
        self.pad_to_batch = pad_to_batch
        self.loader = loader
        self._nnx, self._tree_util = nnx, jax.tree_util
        self.objects, self.ta = (model, optimizer), ta
        self.compile_cache = enable_compilation_cache(compile_cache)
        self.ahead: AheadCompiler | None = AheadCompiler() if compile_ahead else None
        # with a TriAccel its first `control` asks for this; without one the first call's end does (`prepare`)
        self._prepare_after_first_call = self.ahead is not None and ta is None
        self._also: list[tuple[str, Callable[[], Any]]] = []   # compile_in_background before the first call
        self.mesh = mesh if mesh is not None else getattr(ta, "mesh", None)
        self._place: Callable[[Any], Any] = commit
        self._jit_defaults: dict[str, Any] = {}   # for this step and the bound functions
        if compiler_options is not None:
            if not isinstance(compiler_options, Mapping) or not all(isinstance(k, str) for k in compiler_options):
                raise ValueError(f"compiler_options={compiler_options!r}: allowed None or a mapping of XLA option "
                                 "names (str) to values")
            self._jit_defaults["compiler_options"] = dict(compiler_options)
        if self.mesh is not None:
            from .sharding import replicate, replicated

            self._place = functools.partial(replicate, mesh=self.mesh)
            self._jit_defaults["out_shardings"] = replicated(self.mesh)
        jit_kwargs = {**self._jit_defaults, **jit_kwargs}
        self._main = _Bound(self, fn, self.objects, {"donate_argnums": 0, **jit_kwargs}, everything=True)
        self._bound: list[_Bound] = [self._main]
        self.resplit()

    @property
    def state(self) -> Any:
        """The objects' current state (`nnx.State`), as the step last left it."""
        return self._tree_util.tree_unflatten(self._treedef, self._leaves)

    # The state lives as its flat leaves (after a split, or once the host has read or written them)
    # or as the packed buffers the programs take and return (`packing.StatePacking`: a few buffers
    # instead of one per leaf, which costs the host per call); each form is made from the other
    # when needed, and only one is kept.
    @property
    def _leaves(self) -> list[Any]:
        if self._flat is None:
            self._flat, self._buffers = self._packing.unpack_now(self._buffers), None
        return self._flat

    @_leaves.setter
    def _leaves(self, leaves: list[Any]) -> None:
        self._flat, self._buffers = list(leaves), None

    def _packed(self) -> list[Any]:
        if self._buffers is None:
            self._buffers, self._flat = self._packing.pack_now(self._flat), None
        return self._buffers

    def resplit(self) -> None:
        """Split the objects again (after a change to their structure or static attributes); the
        graph definition is hashed and compared once, at the next call, not on every call."""
        nnx = self._nnx
        self._graphdef, state = nnx.split(self.objects)
        # committed: the placement the step's outputs will have (see `commit`; replicated on a mesh)
        self._leaves, self._treedef = self._tree_util.tree_flatten(self._place(state))
        pack = self._pack
        if pack == "auto":
            first = next((x for x in self._flat if hasattr(x, "sharding")), None)
            pack = first is not None and all(d.platform != "cpu" for d in first.sharding.device_set)
        self._packing = StatePacking(self._flat, group=pack)
        variables = self._variable_leaves(state)
        # The objects' Variables in leaf order (one array each): values move between them and the
        # flat leaves without walking the graph. Otherwise (a Variable holding a tree) the slow path.
        ok = len(variables) == len(self._leaves) and all(isinstance(v, nnx.Variable) for v in variables)
        self._variables = variables if ok else None
        self._pos = {id(v): i for i, v in enumerate(variables)} if ok else {}  # Variable -> leaf index
        # Positions of the TriAccelState's own Variables (not the inner optimizer's, nor its
        # parameter-sized accumulators): all a control boundary without curvature reads and writes,
        # so only these move there.
        self._ctl_idx: list[int] | None = None
        if ok and self.ta is not None:
            from .transform import find_state

            try:
                ts = find_state(self.objects[1])
            except ValueError:  # an optimizer without the wrapper: `control` has nothing to read
                ts = None
            if ts is not None:
                own = self._variable_leaves(ts._replace(inner=(), acc=(), noise_acc=()))
                if all(id(v) in self._pos for v in own):
                    self._ctl_idx = [self._pos[id(v)] for v in own]
        for b in self._bound:
            b.locate()

    def snapshot(self) -> tuple[Any, Any, list[Any]]:
        """The current state as it is (its structure, its packing or None, and its packed buffers or
        flat leaves; no copy): `restore` takes it back while the arrays are alive and not donated
        (`data.InFlight` uses the pair)."""
        if self._buffers is not None:
            return self._treedef, self._packing, self._buffers
        return self._treedef, None, self._flat

    def restore(self, snapshot: tuple[Any, Any, list[Any]]) -> None:
        """Put back a `snapshot` of this step's state (same structure: no re-split since)."""
        treedef, packing, arrays = snapshot
        if treedef is not self._treedef or (packing is not None and packing is not self._packing):
            raise ValueError("snapshot: the state was split again since it was taken (a new precision policy "
                             "or structure); settle steps in flight before a control boundary")
        if any(getattr(a, "is_deleted", lambda: False)() for a in arrays):
            raise ValueError("snapshot: some of its arrays were donated to a later call; build the step with "
                             "donate_argnums=() to restore its state")
        if packing is None:
            self._leaves = arrays
        else:
            self._buffers, self._flat = list(arrays), None

    def _variable_leaves(self, tree: Any) -> list[Any]:
        """The `nnx.Variable`s of `tree` (an `nnx.State` or a pytree holding Variables), in leaf order."""
        nnx = self._nnx
        return self._tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))

    def sync(self) -> None:
        """Write the current state into the objects."""
        if self._variables is None:
            self._nnx.update(self.objects, self.state)
        else:
            self._sync(range(self._packing.n))

    def _sync(self, idx: Any) -> dict[int, Any]:
        """Write the state's leaves at positions `idx` into the objects; returns {position: array set}."""
        idx = list(idx)
        if self._flat is None and 2 * len(idx) < self._packing.n:
            # packed, and only some leaves asked for (a control boundary's): those are sliced out,
            # the state stays packed (unpacking all of it was a program of every leaf, compiled on
            # the critical path at the first boundary, and packing it again one more)
            values = self._packing.take_now(self._buffers, idx)
        else:
            values = [self._leaves[i] for i in idx]
        for i, v in zip(idx, values):
            self._variables[i].set_value(v)
        return dict(zip(idx, values))

    def _refresh(self, idx: Any, synced: dict[int, Any] | None = None) -> None:
        """Take the objects' values at positions `idx` back (after a change to values only); nothing
        to do when every one is still the array `_sync` set (`synced`: a boundary that wrote nothing)."""
        idx = list(idx)
        current = [self._variables[i].get_value() for i in idx]
        if synced is not None and all(v is synced.get(i) for i, v in zip(idx, current)):
            return
        values = [self._place(v) for v in current]
        if self._flat is None:
            self._buffers = self._packing.put_now(self._buffers, idx, values)
            return
        leaves = list(self._leaves)
        for i, v in zip(idx, values):
            leaves[i] = v
        self._leaves = leaves

    def __call__(self, *args: Any) -> Any:
        return self._main(*args)

    def bind(self, fn: Callable[..., Any], *objects: Any, example_args: tuple[Any, ...] | None = None,
             soon: bool = True, **jit_kwargs: Any) -> Callable[..., Any]:
        """`fn(*objects, *args) -> out` jitted over the leaves of `objects` only, sharing this step's
        state: `objects` are graph nodes or `nnx.State`s whose Variables all belong to this step's
        objects (e.g. ``nnx.state(model, nnx.Param)`` and the optimizer). Its compiled variants are
        keyed by the graph definition of `objects` alone: an update bound over the parameters' state
        does not compile again when a precision policy changes the model's graph.
        example_args: the arguments of a call to come (arrays or `jax.ShapeDtypeStruct`s, placed as
        the call's will be): with compile-ahead on, that variant is compiled in the background at
        the next `prepare` (control boundary) under the current policy and the likely next one,
        before its first call (e.g. an evaluation at each epoch's end). soon: queued first (e.g. the
        update every step needs at once); False: after the `compile_in_background` jobs (e.g. an
        evaluation needed at an epoch's end: in cold demo runs the gradient-noise programs, queued
        behind it, were needed first and compiled on the critical path beside it, 2.1-3.0 s on an
        H100, 2026-11-25), still before the step's other sizes. jit_kwargs: passed to
        `jax.jit` (no donation unless given; on a mesh, outputs replicated unless out_shardings is
        given)."""
        if self._variables is None:
            raise ValueError("bind: the objects hold Variables whose values are trees; only the whole "
                             "step (SplitStep(fn, ...)) can run over them")
        if example_args is not None and not isinstance(example_args, tuple):
            raise ValueError(f"example_args: a tuple of the call's arguments, got {type(example_args).__name__}")
        b = _Bound(self, fn, objects, {**self._jit_defaults, **jit_kwargs})
        b.soon = bool(soon)
        b.locate()
        if example_args is not None:
            args = _abstract_tree(example_args)
            b.templates[_signature(args)] = args
        self._bound.append(b)
        return b

    def control(self, step: int, batch: Any = None) -> None:
        """`TriAccel.control` for `step` on the objects, at control and curvature steps only; elsewhere
        nothing happens (as in `TriAccel.control`). Before it, the values it reads are written into
        the objects (the wrapper's state; everything at a curvature step); after it, the objects are
        re-split when it applied a new precision policy, else the values it may have written are
        taken back. The model and the inner optimizer state are not synced by it: call `sync()` to
        read them."""
        ta = self.ta
        if ta is None:
            raise ValueError("control: SplitStep was built without ta=TriAccel(...)")
        ctl = ta.controller
        if ctl is None:
            raise ValueError("control: no layers yet; build the optimizer (tx.init) first")
        curv = ctl.is_curvature_step(step)
        if not (curv or ctl.is_control_step(step)):
            return
        # The curvature pass reads the model's parameters: everything moves; else the TriAccelState only.
        partial = not curv and self._ctl_idx is not None
        part = self._ctl_idx if partial else range(self._packing.n)
        synced = None
        if self._variables is None:
            self.sync()
        else:
            synced = self._sync(part)
        model, optimizer = self.objects
        version = ta.policy_version
        ta.control(step, optimizer, model, batch=batch, run_size=self.run_size)
        if ta.policy_version != version or self._variables is None:
            if partial:  # the values not moved yet (the control's own writes stay), then re-split
                self._sync(sorted(set(range(self._packing.n)) - set(part)))
            self.resplit()
        else:
            self._refresh(part, synced)
        if self.ahead is not None and ctl.is_control_step(step):
            self.prepare(step)

    def run_size(self, batch: int) -> int:
        """The micro-batch size a step of `batch` samples runs at: its bucket, at least the loader's
        pad floor's bucket (as `ElasticLoader.fetch` pads it)."""
        ctl = getattr(self.ta, "controller", None)
        floor = getattr(self.loader, "pad_floor", None) or 0
        return _bucket(max(batch, floor), ctl.config.batch_buckets if ctl is not None else None)

    # -- compilations ahead ------------------------------------------------------------------
    def prepare(self, step: int) -> int:
        """Queue, in the order they are likely needed, the variants the controller may ask for after
        `step` (`Controller.likely_next`): under the current policy the gradient-noise half batch
        (unless ``pad_to_batch``), then every larger batch bucket up to the ceiling (the batch law
        climbs one per decision, or jumps under batch_growth="jump", and the ladder is short) with its half (not the buckets below:
        those compile when the batch shrinks); with ``foresee_policies``, under the policy the next
        precision decision would take, the current size (and its half); and the bound functions that
        know their argument shapes (`bind(example_args=...)`, or a call) under the current policy
        (and that one): those bound with soon=True
        first, then the `compile_in_background` jobs, then those bound with soon=False. Returns the number queued
        (the step's own sizes wait for its first call, which then triggers this again)."""
        if self.ahead is None or (self.ta is not None and self.ta.controller is None):
            return 0
        if self._main.last_sig is None:
            # Before the step's first call: everything waits for its lowering (`_obtain`), so that
            # background tracing (which holds the GIL) does not slow the step's own trace.
            self._prepare_after_first_call = True
            return 0
        if self.ta is None:
            # No controller, so no sizes or policies to foresee: the bound functions' known shapes
            # (an evaluation at the epoch's end) compile in the background, as beside a TriAccel, so
            # that a static baseline run through this step does not pay them on its critical path.
            self._prepare_after_first_call = False
            return self._queue_bound((), soon=True) + self._queue_bound((), soon=False)
        ctl = self.ta.controller
        cfg, d = ctl.config, ctl.decision
        buckets = cfg.batch_buckets
        likely, near = ctl.likely_next(step, reach=max(len(buckets or ()), 1))
        # noise_split="double": a noise step's halves are batches of the decided size, no shape of their own;
        # "steps": the noise step is a step of the first half's size
        halves = (cfg.elastic_batch and cfg.batch_law == "noise" and not self.pad_to_batch
                  and cfg.noise_split in ("halves", "steps"))
        cur = d.batch_size

        def with_half(n: int) -> list[int]:
            return [n, -(-n // 2)] if halves and n >= 2 else [n]

        sizes: list[int] = []
        # Not the buckets below: the batch shrinks on memory pressure or an OOM only, rarely, and a
        # background compilation slows the steps beside it (H100 demo: bs-96 epochs of 16 s beside
        # one, 5.5 s without).
        for n in (*with_half(cur), *(m for u in near if u > cur for m in with_half(u))):
            b = self.run_size(n)
            if b not in sizes:
                sizes.append(b)
        policies = [likely] if self.foresee_policies and policy_names(likely) != policy_names(d) else []
        queued = self._queue_bound(policies, soon=True)
        also, self._also = self._also, []
        if self._ctl_idx is not None and self._packing.groups:   # what the next boundary runs, first
            self.ahead.submit(("control", self._packing), functools.partial(self._packing.compile_take_put,
                                                                            self._ctl_idx), name="control:take-put", stores=True)
        for name, fn in also:
            self.ahead.submit(("also", name), fn, name=name, stores=True)
        queued += len(also) + self._queue_bound(policies, soon=False)
        # under the likely policy: the current size and its half (sizes[:2] with halves)
        main = self.compile_ahead(sizes, policies, policy_batches=len(with_half(cur)))
        self._prepare_after_first_call = main is None
        return queued + (main or 0)

    def _decided_step(self) -> int:
        """The step of the controller's current decision (0 without a TriAccel)."""
        ctl = getattr(self.ta, "controller", None)
        return ctl.decision.step if ctl is not None else 0

    def compile_ahead(self, batches: Iterable[int] = (), policies: Sequence[Any] = (),
                      policy_batches: int | None = None) -> int | None:
        """Queue background compilations of the step, size by size in the order given: at each
        micro-batch size in `batches` under the current precision policy, and at the current size
        and the first `policy_batches` of `batches` (None: all) under each of `policies`
        (Decisions or per-layer precision sequences, in the wrapper's layer order). The argument
        shapes are those of the last call with the leading (micro-batch) axis changed. Returns
        the number queued; None before the first call (no shapes known yet)."""
        if self.ahead is None:
            return 0
        batches = [int(b) for b in batches]
        if any(b < 1 for b in batches):
            raise ValueError(f"batches={batches}: micro-batch sizes must be >= 1")
        if policy_batches is not None and policy_batches < 0:
            raise ValueError(f"policy_batches={policy_batches}: allowed None or an integer >= 0")
        main = self._main
        if main.last_sig is None:
            return None
        template = main.templates[main.last_sig]
        batched = next((a for a in template if hasattr(a, "shape") and len(a.shape) > 0), None)
        cur = int(batched.shape[0]) if batched is not None else None
        with_policy = set(([cur] if cur is not None else []) +
                          (batches if policy_batches is None else batches[:policy_batches]))
        pkeys = list(dict.fromkeys(k for policy in policies for k in self._keys_for(policy, [main])
                                   if k is not None and k != main.key))
        queued = 0
        for n in dict.fromkeys(([cur] if cur is not None else []) + batches):
            args = tuple(abstract(a, cur, n) for a in template)
            sig = _signature(args)
            for key in [main.key, *(pkeys if n in with_policy else [])]:
                if key == main.key and sig == main.last_sig:
                    continue   # compiled, or compiling on the caller's thread (its first call)
                queued += self._submit(main, key, sig, args)
        return queued

    def _queue_bound(self, policies: Sequence[Any], soon: bool) -> int:
        """Queue the variants of the bound functions bound with `soon` at the argument shapes they
        know (`bind`'s example_args, their calls), under the current policy and each of `policies`."""
        bound = [b for b in self._bound[1:] if b.templates and b.soon == soon]
        keys = [[b.key] for b in bound]
        for policy in policies:
            for ks, k in zip(keys, self._keys_for(policy, bound)):
                if k is not None and k not in ks:
                    ks.append(k)
        queued = 0
        for b, ks in zip(bound, keys):
            for key in ks:
                for sig, args in list(b.templates.items()):
                    queued += self._submit(b, key, sig, args)
        return queued

    def _submit(self, b: "_Bound", key: Any, sig: Any, args: tuple[Any, ...]) -> int:
        """Queue the variant `sig` of `b` under `key` unless it is compiled or queued; 1 if queued."""
        job = (id(b), key, sig)
        if sig in b.exes.get(key, {}) or self.ahead.pending(job):
            return 0
        leaves = self._packing.abstract()
        batched = next((a for a in args if hasattr(a, "shape") and len(a.shape) > 0), None)
        name = f"{b.name}@{batched.shape[0]}" if batched is not None else b.name
        # lowered at once (Python: it overlaps a caller's XLA compilation well), compiled outside a hold
        self.ahead.submit(job, functools.partial(b.step_for(key).compile, leaves, *args,
                                                 after_lowering=self.ahead.wait_open), name=name, gated=False)
        return 1

    def _keys_for(self, policy: Any, bound: Sequence["_Bound"]) -> list[Any]:
        """The variant family (graph definition, treedef) of each of `bound` under `policy` (set on
        the model, split, and set back: the model's dtypes are static graph attributes); Nones
        without a TriAccel that knows its layers."""
        ta = self.ta
        if ta is None or ta.layers is None:
            return [None] * len(bound)
        with applied_policy(self.objects[0], policy, ta.layers):
            return [VariantKey(self._nnx.split(self.objects)[0], self._treedef, self._packing.signature)
                    if b.everything else VariantKey(self._nnx.split(b.objects)[0], b.key[1], b.key[2]) for b in bound]

    def compile_in_background(self, name: str, fn: Callable[[], Any]) -> bool:
        """Queue another compilation on this step's background compiler: ``fn()`` (e.g. a
        ``jax.jit(f).lower(...).compile()``, whose result jax.jit's caches keep for later calls).
        With a TriAccel, before the step's first lowering it waits, queued then after the bound
        functions bound with soon=True (e.g. the update the first step needs at once), before those
        bound with soon=False and the other step variants; otherwise it joins the queue's end. Returns False (nothing queued) when compile-ahead is off."""
        if self.ahead is None:
            return False
        if self._main.last_sig is None and self.ta is not None:   # `prepare` will queue it
            self._also.append((name, fn))
        else:
            self.ahead.submit(("also", name), fn, name=name, stores=True)
        return True

    def quiet(self) -> Any:
        """A context in which no background XLA compilation runs (`AheadCompiler.quiet`: a running
        one is waited for, queued ones wait): its autotuning takes device memory from the pool the
        step allocates from. `data.elastic_step(quiet=...)` retries a step that ran out of memory in it."""
        return self.ahead.quiet() if self.ahead is not None else contextlib.nullcontext()

    def wait_compiled(self) -> None:
        """Block until the queued background compilations are done (tests, benchmarks)."""
        if self.ahead is not None:
            self.ahead.wait()

    def close(self) -> None:
        """Cancel the background compilations still queued: a run that has ended needs none of them, and
        its process would otherwise wait for each at exit (the pool's thread is joined then; on a CPU a
        queued step variant is a 10-25 s compilation). One already compiling finishes on its thread. A
        cancelled variant the step still needs is compiled on the caller's thread; nothing can be queued
        after it (`compile_ahead` then raises)."""
        if self.ahead is not None:
            self.ahead.close()

    @property
    def compiled_ahead(self) -> int:
        """Variants the step took from the background compiler (no compilation on the critical path)."""
        return self.ahead.compiled_ahead if self.ahead is not None else 0

    @property
    def never_taken(self) -> list[str]:
        """Variants compiled in the background that no call took (`AheadCompiler.never_taken`)."""
        return self.ahead.never_taken() if self.ahead is not None else []

    @property
    def traces(self) -> int:
        """Compilations of the step and of the bound functions over all graph definitions seen."""
        return sum(j.traces for b in self._bound for j in b.steps.values())


class VariantKey(tuple):
    """A variant family's key, (graph definition, treedef, packing signature), hashed once.

    An nnx GraphDef hashes by walking the module graph (ResNet-18: ~0.2 ms per hash on a CPU), and a
    control boundary looks the variants up ~20 times (`SplitStep.prepare`): with plain tuples that was
    ~4 ms of a JAX boundary's host time (2026-11-28, `benchmarks/device/jax_boundary_profile.py`).
    Equal keys compare equal and hash alike, as the tuples did."""

    _hash: int

    def __new__(cls, graphdef: Any, treedef: Any, signature: Any) -> "VariantKey":
        key = super().__new__(cls, (graphdef, treedef, signature))
        key._hash = hash((graphdef, treedef, signature))
        return key

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return VariantKey, tuple(self)   # rebuilt, so hashed again (a hash is per process)

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, tuple):
            return NotImplemented
        if isinstance(other, VariantKey) and other._hash != self._hash:
            return False   # without comparing the graphs
        return tuple.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq


class _Bound:
    """One function of a `SplitStep` over the leaves of some of its objects (all of them for the
    step itself): one jitted variant per (graph definition, treedef) of those objects."""

    def __init__(self, owner: SplitStep, fn: Callable[..., Any], objects: tuple[Any, ...],
                 jit_kwargs: dict[str, Any], everything: bool = False) -> None:
        self.owner, self.fn, self.objects, self.jit_kwargs = owner, fn, objects, jit_kwargs
        self.everything = everything
        self.soon = True   # queued before the background jobs (`SplitStep.bind`)
        self.name = getattr(fn, "__name__", "fn")   # how compile logs and XLA name its variants
        self.steps: dict[Any, CountingJit] = {}   # (graph definition, treedef) -> its jitted function
        # (graph definition, treedef) -> argument signature -> its executable (`jax.stages.Compiled`)
        self.exes: dict[Any, dict[Any, Any]] = {}
        self.templates: dict[Any, tuple[Any, ...]] = {}   # signature -> abstract arguments
        self.last_sig: Any = None
        self.pos: list[int] | None = None         # positions of its leaves in the owner's (None: all)
        self._cur: dict[Any, Any] | None = None   # exes of the current key (hashed once per re-split)

    def locate(self) -> None:
        """Find the objects' structure and leaf positions again (after the owner re-split)."""
        o = self.owner
        self._cur = None  # looked up at the next call
        if self.everything:
            self.key = VariantKey(o._graphdef, o._treedef, o._packing.signature)
            return
        self.graphdef, state = o._nnx.split(self.objects)
        variables = o._variable_leaves(state)
        pos = o._pos
        missing = [v for v in variables if id(v) not in pos]
        if missing:
            raise ValueError(f"objects: {len(missing)} of their Variables are not in the SplitStep's "
                             "objects; bind only parts of the model and optimizer it was built with")
        self.pos = [pos[id(v)] for v in variables]
        self.key = VariantKey(self.graphdef, o._tree_util.tree_structure(state), o._packing.signature)

    def step_for(self, key: Any) -> CountingJit:
        """The jitted function of the variant family `key` (graph definition, treedef)."""
        step = self.steps.get(key)
        if step is None:
            step = self.steps[key] = self._jit(key)
        return step

    def _jit(self, key: Any) -> CountingJit:
        o, fn = self.owner, self.fn
        nnx, tree_util = o._nnx, o._tree_util
        graphdef, treedef, _ = key
        packing, pos = o._packing, self.pos   # the packing the key's signature names

        def pure(buffers: list[Any], *args: Any) -> tuple[Any, list[Any]]:
            leaves = packing.unpack(buffers)
            mine = leaves if pos is None else [leaves[i] for i in pos]
            objects = nnx.merge(graphdef, tree_util.tree_unflatten(treedef, mine))
            out = fn(*objects, *args)
            new, new_def = tree_util.tree_flatten(nnx.state(objects))
            if new_def != treedef:
                raise ValueError("fn: the step changed the structure of the objects' state (added or "
                                 "removed a Variable); SplitStep needs the same structure after each call")
            if pos is not None:
                for i, a in zip(pos, new):
                    leaves[i] = a
                new = leaves
            return out, packing.pack(new)

        pure.__name__ = pure.__qualname__ = self.name
        if o.ta is not None:
            return o.ta.jit(pure, use_nnx=False, **self.jit_kwargs)
        return CountingJit(pure, use_nnx=False, **self.jit_kwargs)

    def _obtain(self, sig: Any, leaves: list[Any], args: tuple[Any, ...]) -> Any:
        """The executable for `sig` under the current key: from the background compiler when it
        compiled it, else compiled now. The step's first compilation queues the variants ahead
        (`SplitStep.prepare`) once it is lowered, while XLA compiles it."""
        o = self.owner
        self.templates[sig] = _abstract_tree(args)
        exe = o.ahead.take((id(self), self.key, sig)) if o.ahead is not None else None
        if exe is None:
            hook = None
            # with a TriAccel the variants queue at the first lowering, to compile beside it; without
            # one the bound functions queue once the call returns (below): an evaluation compiled
            # beside a static step's first compilation took 14-15 s instead of 3.2 s and held that
            # compilation 15 -> 20.5 s (JAX ResNet-18 bs 192, H100, 2026-12-07, s53 call 3)
            if self.everything and o._prepare_after_first_call and o.ta is not None:
                def hook() -> None:
                    self.last_sig = sig
                    o.prepare(o._decided_step())
            with o.ahead.hold() if o.ahead is not None and o._hold_ahead else contextlib.nullcontext():
                exe = self.step_for(self.key).compile(leaves, *args, after_lowering=hook)
        return exe

    def __call__(self, *args: Any) -> Any:
        cur = self._cur
        if cur is None:
            cur = self._cur = self.exes.setdefault(self.key, {})
        o = self.owner
        sig = _signature(args)
        buffers = o._packed()
        exe = cur.get(sig)
        if exe is None:
            exe = cur[sig] = self._obtain(sig, buffers, args)
        self.last_sig = sig
        if self.everything and o._prepare_after_first_call:
            o.prepare(o._decided_step())
        out, new = exe(buffers, *args)
        o._buffers, o._flat = list(new), None
        return out


def _abstract_tree(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """`args` with every array, also inside pytrees, replaced by its `abstract` shape (a template
    keeps no device buffer alive)."""
    import jax

    return tuple(jax.tree_util.tree_map(abstract, a) for a in args)


def _signature(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """What selects a variant among calls of one graph definition: each array's (shape, dtype),
    the tree structure of anything else."""
    import jax

    return tuple((tuple(a.shape), a.dtype) if isinstance(a, (jax.Array, jax.ShapeDtypeStruct))
                 else jax.tree_util.tree_structure(a) for a in args)


def _bucket(n: int, buckets: Sequence[int] | None) -> int:
    """The padded size of a micro-batch of `n` samples: the smallest bucket >= n (n without buckets
    or above them all), as `ElasticLoader.bucket_for`."""
    if buckets:
        for b in buckets:
            if b >= n:
                return int(b)
    return int(n)
