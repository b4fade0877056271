"""`StatePacking`: a train state's leaves carried between jitted calls as a few flat buffers.

An XLA program call costs the host time per buffer, most when the step cannot donate its state (a
step left in flight must leave the state it may be restored to, `data.InFlight`): a ResNet-18 train
state is ~200 arrays. On an H200 at batch 96 the call held the host 3.7 ms against 2.4 ms donated;
with the state as one flat buffer, unravelled and ravelled inside the program, 2.5 ms (`benchmarks/device/jax_dp_probe.py
--loops fused-fed fused-keep fused-flat`, 2026-11-27, docs/results.md). Packing the leaves of one
dtype and placement into one 1-D buffer gives that without changing what the program computes:
the slices and the concatenation are copies XLA fuses into the step's own reads and writes.

The slices lengthen XLA's compilation: on a 2-core CPU a width-0.25 EfficientNet-B0 step's first call
took 16.4 s packed against 8.2 s apart, for 82.5 against 83.0 ms per step (`python3
benchmarks/jax_packing.py`, 2026-11-27). On the GPU the packing's compile cost is not measured in
one run yet. So `SplitStep(pack="auto")` packs where the state lives on an accelerator.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .compile_ahead import abstract

__all__ = ["StatePacking"]


def _packable(x: Any) -> bool:
    """Leaves that can share a flat buffer: plain numeric arrays of a fixed dtype (not PRNG keys, not
    weakly typed scalars, whose type the buffer would make strong)."""
    if not isinstance(x, jax.Array) or jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return False
    return not x.aval.weak_type


class StatePacking:
    """The packing of a list of leaves (arrays): those of one (dtype, sharding) raveled into one 1-D
    buffer in leaf order, groups in order of first appearance, then every other leaf on its own.

    `pack(leaves) -> buffers` and `unpack(buffers) -> leaves` are pure jnp functions (trace them
    inside a program); `pack_now` / `unpack_now` run them as jitted programs. `signature`: hashable,
    equal for packings of the same leaf shapes, dtypes and placements. `abstract()`: the buffers as
    `jax.ShapeDtypeStruct`s (for compiling ahead without packing anything).
    """

    def __init__(self, leaves: Sequence[Any], group: bool = True) -> None:
        """group=False: every leaf travels alone (no buffers: `pack`/`unpack` return the leaves)."""
        self.n = len(leaves)
        groups: dict[tuple[Any, Any], list[int]] = {}
        alone: list[int] = []
        for i, x in enumerate(leaves):
            if group and _packable(x):
                groups.setdefault((np.dtype(x.dtype), getattr(x, "sharding", None)), []).append(i)
            else:
                alone.append(i)
        # a group of one gains nothing from a buffer of its own
        for key in [k for k, idx in groups.items() if len(idx) == 1]:
            alone.extend(groups.pop(key))
        self.alone = sorted(alone)
        self.shapes = [tuple(x.shape) for x in leaves]
        self.dtypes = [x.dtype for x in leaves]
        self.groups: list[tuple[np.dtype, Any, list[int], list[int]]] = []   # dtype, sharding, leaves, offsets
        for (dtype, sharding), idx in groups.items():
            sizes = [int(np.prod(self.shapes[i], dtype=np.int64)) for i in idx]
            self.groups.append((dtype, sharding, idx, [0, *np.cumsum(sizes).tolist()]))
        self._alone_abstract = [abstract(leaves[i]) for i in self.alone]
        self.signature = (self.n, tuple(self.shapes), tuple((str(d), s, tuple(i)) for d, s, i, _ in self.groups),
                          tuple(self.alone))
        self._pack_jit = jax.jit(self.pack)
        self._unpack_jit = jax.jit(self.unpack)
        self._take_jit = jax.jit(self.take, static_argnums=1)
        self._put_jit = jax.jit(self.put, static_argnums=1)
        self._ahead: dict[tuple[str, tuple[int, ...]], Any] = {}   # `compile_take_put`'s executables
        # leaf position -> (its buffer, its place in that buffer's group; None for a lone leaf)
        self._where: dict[int, tuple[int, int | None]] = {
            i: (g, j) for g, (_, _, idx, _) in enumerate(self.groups) for j, i in enumerate(idx)}
        self._where.update({i: (len(self.groups) + k, None) for k, i in enumerate(self.alone)})

    @property
    def num_buffers(self) -> int:
        return len(self.groups) + len(self.alone)

    def pack(self, leaves: Sequence[Any]) -> list[Any]:
        """The buffers of `leaves` (n leaves, as the packing's): one 1-D array per group, then the lone leaves."""
        if len(leaves) != self.n:
            raise ValueError(f"leaves: expected {self.n} leaves (the packing's), got {len(leaves)}")
        for i, x in enumerate(leaves):
            if tuple(x.shape) != self.shapes[i] or x.dtype != self.dtypes[i]:
                raise ValueError(f"leaves[{i}]: {x.dtype}{list(x.shape)}, the packing's {self.dtypes[i]}"
                                 f"{list(self.shapes[i])}: a step must keep each leaf's shape and dtype")
        out = [jnp.concatenate([jnp.ravel(leaves[i]) for i in idx]) for _, _, idx, _ in self.groups]
        return out + [leaves[i] for i in self.alone]

    def unpack(self, buffers: Sequence[Any]) -> list[Any]:
        """The n leaves of `buffers` (as `pack` returns them), in their original order and shapes."""
        if len(buffers) != self.num_buffers:
            raise ValueError(f"buffers: expected {self.num_buffers} (the packing's), got {len(buffers)}")
        return self.take(buffers, tuple(range(self.n)))

    def take(self, buffers: Sequence[Any], idx: tuple[int, ...]) -> list[Any]:
        """The leaves at positions `idx` of `buffers`, as `unpack(buffers)[i]` for i in idx."""
        out = []
        for i in idx:
            b, j = self._where[i]
            if j is None:
                out.append(buffers[b])
            else:
                off = self.groups[b][3]
                out.append(jax.lax.slice(buffers[b], (off[j],), (off[j + 1],)).reshape(self.shapes[i]))
        return out

    def put(self, buffers: Sequence[Any], idx: tuple[int, ...], values: Sequence[Any]) -> list[Any]:
        """`buffers` with the leaves at positions `idx` replaced by `values` (same shapes and dtypes),
        as `pack` of the unpacked leaves with those replaced."""
        out = list(buffers)
        for i, v in zip(idx, values):
            if tuple(v.shape) != self.shapes[i] or v.dtype != self.dtypes[i]:
                raise ValueError(f"values for leaf {i}: {v.dtype}{list(v.shape)}, the packing's {self.dtypes[i]}"
                                 f"{list(self.shapes[i])}")
            b, j = self._where[i]
            out[b] = v if j is None else jax.lax.dynamic_update_slice(out[b], jnp.ravel(v), (self.groups[b][3][j],))
        return out

    def take_now(self, buffers: Sequence[Any], idx: Sequence[int]) -> list[Any]:
        """`take` as one jitted program (compiled once per set of positions)."""
        if not self.groups:
            return [buffers[i] for i in idx]
        exe = self._ahead.get(("take", tuple(idx)))
        return list(exe(list(buffers)) if exe is not None else self._take_jit(list(buffers), tuple(idx)))

    def put_now(self, buffers: Sequence[Any], idx: Sequence[int], values: Sequence[Any]) -> list[Any]:
        """`put` as one jitted program (compiled once per set of positions)."""
        if not self.groups:
            out = list(buffers)
            for i, v in zip(idx, values):
                out[i] = v
            return out
        exe = self._ahead.get(("put", tuple(idx)))
        if exe is not None:
            return list(exe(list(buffers), list(values)))
        return list(self._put_jit(list(buffers), tuple(idx), list(values)))

    def compile_take_put(self, idx: Sequence[int]) -> None:
        """Compile `take_now` and `put_now` for the positions `idx` ahead of their first call (e.g. on a
        background thread: a control boundary's, compiled on the critical path otherwise), for
        buffers placed as `abstract()` says and values placed as their buffers."""
        if not self.groups:
            return
        idx = tuple(int(i) for i in idx)
        bufs = self.abstract()
        values = []
        for i in idx:
            b, j = self._where[i]
            values.append(bufs[b] if j is None else
                          jax.ShapeDtypeStruct(self.shapes[i], self.dtypes[i], sharding=bufs[b].sharding))
        take = self._take_jit.lower(bufs, idx).compile()
        put = self._put_jit.lower(bufs, idx, values).compile()
        self._ahead[("take", idx)], self._ahead[("put", idx)] = take, put

    def pack_now(self, leaves: Sequence[Any]) -> list[Any]:
        return list(self._pack_jit(list(leaves))) if self.groups else list(leaves)

    def unpack_now(self, buffers: Sequence[Any]) -> list[Any]:
        return list(self._unpack_jit(list(buffers))) if self.groups else list(buffers)

    def abstract(self) -> list[jax.ShapeDtypeStruct]:
        """The buffers' shapes, dtypes and placements."""
        out = [jax.ShapeDtypeStruct((off[-1],), dtype, sharding=sharding) for dtype, sharding, _, off in self.groups]
        return out + list(self._alone_abstract)
