"""Where a JAX data-parallel step spends its time: ResNet-18 (AMP-bf16 policy, SGD-nesterov) on 1 and N
devices of one host at a fixed batch per device, through `SplitStep` (as the demo), the BatchNorm
statistics global or per device (`sharding.per_device_value_and_grad`), and the loop built up from one
program to the demo's per-step pattern (`--loops`), so that one call shows which part stops scaling:

  fused      one program per step (gradient and update), fixed inputs
  split      the gradient and the update as two programs (the demo binds the update apart, so that a
             precision policy does not recompile it), fixed inputs
  fed        split, and per step what the demo's loop adds: the indices uploaded to the batch sharding
             and the images and labels gathered from a dataset replicated on every device
             (`sharding.take`), an eager key split (a random flip inside the gradient program), the LR
             uploaded to every device
  in-flight  fed, each step waiting for the previous one once its own gradient program is queued
             (`data.InFlight`, the demo's default)
  waiting    fed, each step waiting for its own results (the demo with --in-flight off)
  fused-fed  one program per step that also gathers its images and labels by the uploaded indices and
             draws its flip from a key folded with the step number; the per-step host work is one
             upload of the indices and one of the scalars (LR, step number)
  fused-np   fused-fed with the scalars passed as a numpy array (JAX uploads them inside the call)
  fused-keep fused-fed with the state not donated (the demo's SplitStep(donate_argnums=()), which
             `data.InFlight` needs to restore a failed step)
  fused-wait fused-keep, each step waiting for the previous one once queued (`data.InFlight`), and
             reading the device's memory statistics (the demo's step records)
  fused-flat fused-keep with the state as one flat float32 buffer (`ravel_pytree`) unravelled and
             ravelled inside the program: how much of fused-keep's cost is per state buffer
Every `SplitStep` here keeps its leaves apart (pack=False), as when these loops were first measured;
fused-flat is the packed form (`SplitStep(pack="auto")` packs on a GPU, `packing.StatePacking`).

Per configuration also the host's milliseconds per step in each part of the loop (timed in a second
pass, without the profiler): a part whose host time nears the step's wall is where the host waits.

    python3 benchmarks/device/jax_dp_probe.py --per-device 1024 --devices 1 2 4   # GPU machine, after prep.sh

Per configuration: wall ms per step (steps dispatched back to back, synchronised at both ends), then the
same steps under CUPTI (torch.profiler sees the kernels JAX launches): per device, the time covered
by kernels (union of intervals; busy), the sum of the NCCL kernels, and the largest gap between
kernels. A step whose busy time is well under its wall is held by the host or by waits between the
devices; one whose busy time grows with N by its collectives. CPU (smoke test, 2 host devices by
XLA_FLAGS, no CUPTI): `--smoke`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from triaccel import Precision
from triaccel.backends.jax import SplitStep, layer_map_from_model, precision_policy
from triaccel.backends.jax.models import create_model
from triaccel.backends.jax.sharding import (batch_sharding, data_mesh, per_device_value_and_grad, replicated,
                                            shard_batch, shard_indices, take)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # benchmarks/: the shared helpers
from _results import write_to_out  # noqa: E402


def _ce_sum(m: Any, x: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
    ce = optax.softmax_cross_entropy_with_integer_labels(m(x).astype(jnp.float32), y)
    return ce.sum(), jnp.asarray(y.shape[0], jnp.float32)


def _flip(x: jax.Array, k: jax.Array) -> jax.Array:
    """A random horizontal flip per sample (NHWC), as the demo's augmentation."""
    return jnp.where(jax.random.bernoulli(k, 0.5, (x.shape[0], 1, 1, 1)), x[:, :, ::-1], x)


LOOPS = ("fused", "split", "fed", "in-flight", "waiting", "fused-fed", "fused-np", "fused-keep", "fused-wait", "fused-flat")


class Parts:
    """Host seconds per named part of a step, summed over the calls while `on`."""

    def __init__(self) -> None:
        self.on, self.s = False, {}

    def __call__(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        if not self.on:
            return fn(*args)
        t = time.perf_counter()
        out = fn(*args)
        self.s[name] = self.s.get(name, 0.0) + time.perf_counter() - t
        return out


def build(n: int, per_device: int, stats: str, width: float, loop: str = "fused",
          parts: Parts | None = None, compile_cache: str | bool = False) -> Callable[[], Any]:
    """A closure running one training step of `loop` (LOOPS) on the first n devices; it returns
    what the step left to wait for. parts: times the host's parts of each step. compile_cache: the
    SplitSteps' persistent compilation cache (a folder; False: off)."""
    part = parts if parts is not None else Parts()
    mesh = data_mesh(n) if n > 1 else None
    model = create_model("resnet18", num_classes=10, width=width, seed=0)
    lm = layer_map_from_model(model)
    precision_policy(model, [Precision.FP32 if s.kind == "norm" else Precision.BF16 for s in lm.specs], lm)
    opt = nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9, nesterov=True), wrt=nnx.Param)
    local = per_device_value_and_grad(_ce_sum, mesh) if mesh is not None and stats == "per-device" else None

    def grads_of(model: Any, x: jax.Array, y: jax.Array) -> tuple[jax.Array, Any]:
        if local is not None:
            return local(model, x, y)

        def lf(m: Any) -> jax.Array:
            total, count = _ce_sum(m, x, y)
            return total / count
        return nnx.value_and_grad(lf)(model)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(n * per_device, 32, 32, 3)).astype(np.float32)
    y = rng.integers(0, 10, n * per_device).astype(np.int32)
    fixed = shard_batch((x, y), mesh) if mesh is not None else (jax.device_put(x), jax.device_put(y))
    if loop == "fused":
        def body(model: Any, opt: Any, x: jax.Array, y: jax.Array) -> jax.Array:
            loss, grads = grads_of(model, x, y)
            opt.update(model, grads)
            return loss

        step = SplitStep(body, model, opt, compile_ahead=False, compile_cache=compile_cache, mesh=mesh, pack=False)
        xb, yb = fixed
        return lambda: part("step", step, xb, yb)

    place = replicated(mesh) if mesh is not None else jax.devices()[0]
    # a dataset of 4 batches' images (uint8, as the demo's) on every device; index sets drawn ahead,
    # as the demo slices an epoch's permutation (no shuffle inside the timing)
    data_x = jax.device_put((rng.integers(0, 256, (4 * n * per_device, 32, 32, 3))).astype(np.uint8), place)
    data_y = jax.device_put(rng.integers(0, 10, 4 * n * per_device).astype(np.int32), place)
    index_sets = [rng.permutation(data_y.shape[0])[: n * per_device].astype(np.int32) for _ in range(8)]
    turn = [0]
    bsh = batch_sharding(mesh) if mesh is not None else jax.devices()[0]

    def next_indices() -> np.ndarray:
        turn[0] += 1
        return index_sets[turn[0] % len(index_sets)]

    if loop in ("fused-fed", "fused-np", "fused-keep", "fused-wait", "fused-flat"):
        base = jax.random.key(0)

        def fed_body(model: Any, opt: Any, dx: jax.Array, dy: jax.Array, idx: jax.Array, sc: jax.Array) -> jax.Array:
            x = jnp.take(dx, idx, axis=0).astype(jnp.float32)
            y = jnp.take(dy, idx, axis=0)
            if mesh is not None:
                x = jax.lax.with_sharding_constraint(x, batch_sharding(mesh))
                y = jax.lax.with_sharding_constraint(y, batch_sharding(mesh))
            x = _flip(x, jax.random.fold_in(base, sc[1].astype(jnp.uint32)))
            loss, grads = grads_of(model, x, y)
            opt.update(model, jax.tree_util.tree_map(lambda g: g * sc[0], grads))
            return loss

        if loop == "fused-flat":
            from jax.flatten_util import ravel_pytree

            graphdef, state = nnx.split((model, opt))
            flat, unravel = ravel_pytree(state)   # the integer leaves as float32: a timing probe only

            @jax.jit
            def flat_step(flat: jax.Array, dx: jax.Array, dy: jax.Array, idx: jax.Array, sc: jax.Array) -> Any:
                m, o = nnx.merge(graphdef, unravel(flat))
                loss = fed_body(m, o, dx, dy, idx, sc)
                return loss, ravel_pytree(nnx.state((m, o)))[0]

            held = [flat]
            nflat = [0]

            def fused_flat() -> Any:
                nflat[0] += 1
                sc = part("scalars", jax.device_put, np.array([0.1, nflat[0]], np.float32), place)
                i = part("indices", jax.device_put, next_indices(), bsh)
                loss, held[0] = part("step", flat_step, held[0], data_x, data_y, i, sc)
                return loss
            return fused_flat
        keep = loop in ("fused-keep", "fused-wait")
        fstep = SplitStep(fed_body, model, opt, compile_ahead=False, compile_cache=compile_cache, mesh=mesh, pack=False,
                          **({"donate_argnums": ()} if keep else {}))
        count = [0]
        waiting: list[Any] = []
        dev = jax.devices()[0]

        def fused_fed() -> Any:
            count[0] += 1
            sc = np.array([0.1, count[0]], np.float32)
            if loop != "fused-np":
                sc = part("scalars", jax.device_put, sc, place)
            i = part("indices", jax.device_put, next_indices(), bsh)
            loss = part("step", fstep, data_x, data_y, i, sc)
            if loop == "fused-wait":
                if waiting:
                    part("wait", jax.block_until_ready, waiting.pop())
                waiting.append(loss)
                part("memory_stats", dev.memory_stats)
            return loss
        return fused_fed

    def grad_body(model: Any, opt: Any, x: jax.Array, y: jax.Array, k: jax.Array) -> tuple[jax.Array, Any]:
        x = x.astype(jnp.float32)
        if loop != "split":
            x = _flip(x, k)
        return grads_of(model, x, y)

    def update_body(params: Any, opt: Any, grads: Any, lr: jax.Array) -> None:
        opt.update(params, jax.tree_util.tree_map(lambda g: g * lr, grads))

    split = SplitStep(grad_body, model, opt, compile_ahead=False, compile_cache=compile_cache, mesh=mesh, pack=False)
    update = split.bind(update_body, nnx.state(model, nnx.Param), opt)
    if loop == "split":
        xb, yb = fixed
        k, lr = jax.device_put(jax.random.key(0), place), jax.device_put(np.float32(0.1), place)

        def split_step() -> Any:
            loss, grads = part("grad", split, xb, yb, k)
            part("update", update, grads, lr)
            return loss
        return split_step

    # fed: a new index set per step, its images and labels gathered from the dataset on every device
    key = [jax.device_put(jax.random.key(0), place)]
    pending: list[Any] = []

    def fetch() -> tuple[jax.Array, jax.Array]:
        idx = next_indices()
        if mesh is None:
            i = part("indices", jax.device_put, idx)
            return part("take", lambda: (jnp.take(data_x, i, axis=0), jnp.take(data_y, i, axis=0)))
        i = part("indices", shard_indices, idx, batch_sharding(mesh))
        return part("take", lambda: (take(data_x, i, batch_sharding(mesh)), take(data_y, i, batch_sharding(mesh))))

    def fed_step() -> Any:
        lr = part("lr", jax.device_put, np.float32(0.1), place)
        key[0], k = part("key", jax.random.split, key[0])
        x, y = fetch()
        loss, grads = part("grad", split, x, y, k)
        if loop == "in-flight" and pending:
            part("wait", jax.block_until_ready, pending.pop())   # the previous step, once this one is queued
        elif loop == "waiting":
            part("wait", jax.block_until_ready, (loss, grads))
        part("update", update, grads, lr)
        if loop == "in-flight":
            pending.append(loss)
        return loss
    return fed_step


def kernel_times(run: Any, steps: int) -> dict[str, Any]:
    """Per device (CUPTI): busy ms per step (union of kernel intervals), NCCL ms per step, largest gap ms."""
    from _cupti import cuda_trace_events

    events = cuda_trace_events(run)
    per: dict[int, list[tuple[float, float, bool]]] = {}
    for e in events:
        if e.get("cat") == "kernel" and "dur" in e:
            dev = int(e.get("args", {}).get("device", 0))
            per.setdefault(dev, []).append((float(e["ts"]), float(e["ts"]) + float(e["dur"]), "nccl" in e["name"].lower()))
    out = {}
    for dev, ks in sorted(per.items()):
        ks.sort()
        busy, gap, end = 0.0, 0.0, None
        for s, e, _ in ks:
            if end is None or s > end:
                gap = max(gap, s - end) if end is not None else gap
                busy += e - s
                end = e
            elif e > end:
                busy += e - end
                end = e
        out[dev] = {"busy_ms": busy / steps / 1e3, "nccl_ms": sum(e - s for s, e, c in ks if c) / steps / 1e3,
                    "max_gap_ms": gap / 1e3, "kernels": len(ks) / steps}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-device", type=int, default=1024)
    ap.add_argument("--devices", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--stats", nargs="+", choices=["global", "per-device"], default=["global", "per-device"])
    ap.add_argument("--loops", nargs="+", choices=LOOPS, default=["fused"], help="the step loops to time (above)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--width", type=float, default=1.0)
    ap.add_argument("--smoke", action="store_true", help="CPU: no CUPTI")
    ap.add_argument("--compile-cache", default=None, metavar="DIR",
                    help="JAX's persistent compilation cache in DIR (created), so that the loops building the "
                         "same programs (fed, in-flight and waiting; fused-fed and fused-np) compile them once "
                         "per device count (default: off, every configuration compiles its own)")
    args = ap.parse_args()
    rows = []
    for loop in args.loops:
        for n in args.devices:
            for stats in (args.stats if n > 1 else ["global"]):
                parts = Parts()
                step = build(n, args.per_device, stats, args.width, loop, parts, args.compile_cache or False)
                for _ in range(5):
                    out = step()
                jax.block_until_ready(out)

                def run() -> None:
                    out = None
                    for _ in range(args.steps):
                        out = step()
                    jax.block_until_ready(out)

                t0 = time.perf_counter()
                run()
                wall = (time.perf_counter() - t0) / args.steps * 1e3
                parts.on = True
                run()
                parts.on = False
                kt = {} if args.smoke else kernel_times(run, args.steps)
                rows.append({"loop": loop, "devices": n, "stats": stats, "wall_ms": wall,
                             "img_s": n * args.per_device / wall * 1e3, "per_device": kt,
                             "host_ms": {k: v / args.steps * 1e3 for k, v in parts.s.items()}})
    print(f"# ResNet-18 bf16, {args.per_device} per device, {args.steps} steps, {jax.devices()[0].device_kind}")
    print(f"{'loop':>9} {'devices':>7} {'stats':>10} {'wall ms':>8} {'img/s':>9} {'eff.':>5}  "
          "per device: busy ms, nccl ms, max gap ms, kernels")
    for r in rows:
        base = next((b["img_s"] for b in rows if b["loop"] == r["loop"] and b["devices"] == 1), None)
        eff = r["img_s"] / (r["devices"] * base) if base else float("nan")
        pd = "; ".join(f"d{d}: {v['busy_ms']:.2f}, {v['nccl_ms']:.2f}, {v['max_gap_ms']:.2f}, {v['kernels']:.0f}"
                       for d, v in r["per_device"].items())
        print(f"{r['loop']:>9} {r['devices']:>7} {r['stats']:>10} {r['wall_ms']:>8.2f} {r['img_s']:>9.0f} {eff:>5.2f}  {pd}")
    print("host ms per step in each part (timed apart, without the profiler):")
    for r in rows:
        if r["host_ms"]:
            print(f"{r['loop']:>9} {r['devices']:>7} {r['stats']:>10}  "
                  + ", ".join(f"{k} {v:.2f}" for k, v in r["host_ms"].items()))
    write_to_out("jax_dp_probe.json", rows)


if __name__ == "__main__":
    main()
