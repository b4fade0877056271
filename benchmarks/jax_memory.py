"""How well the JAX memory probe predicts a step's device-memory peak.

XLA has no resettable peak, so the probe (`triaccel.backends.jax.memory.MemoryProbe`) reports
``bytes_in_use + footprint``, where the footprint of the jitted step comes from XLA's compiled
memory analysis (`CountingJit.footprint`). This script checks that estimate against the
allocator's own peak: Flax NNX ResNet-18 (CIFAR variant, synthetic 32x32 inputs on the device),
the wrapped SGD step at increasing batch sizes, so that each batch size sets a new allocator record.
For each batch size it reports, in bytes:

- ``compile_peak``: the allocator peak right after the first (compiling) call (autotuning scratch
  and that call's own execution);
- ``step_peak``: the allocator peak after N more steps (equal to compile_peak when the steps did not
  set a new record);
- ``estimate``: the probe's reading before those steps (in use + compiled footprint);
- the Fisher curvature pass's compiled footprint at b_curv (batch-independent).

    python benchmarks/jax_memory.py                         # GPU
    python benchmarks/jax_memory.py --tiny                  # CPU smoke check (no allocator stats there)

Writes benchmarks/results/jax_memory-<device>.json and prints a table with machine, date, command.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from triaccel import TriAccelConfig  # noqa: E402
from triaccel.backends.jax import CountingJit, FisherTopK, TriAccel, loss_scale, nnx_loss  # noqa: E402
from triaccel.backends.jax.models import create_model  # noqa: E402
from _results import device_tag, write_json


def ce_loss(model: Any, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(model(x).astype(jnp.float32), y).mean()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=None)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--b-curv", type=int, default=32)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke mode: width 1/8, 16x16 inputs, bs 8 16")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    width, image = (0.125, 16) if args.tiny else (1.0, 32)
    sizes = sorted(args.batch_sizes or ([8, 16] if args.tiny else [96, 192, 384, 768, 1536]))
    dev = jax.devices()[0]
    kind = device_tag(getattr(dev, "device_kind", dev.platform))

    def stats() -> dict[str, int]:
        return dict(dev.memory_stats() or {})

    model = create_model("resnet18", width=width, seed=0)
    cfg = TriAccelConfig(curvature="off", elastic_batch=False, adaptive_precision=False,
                         batch_init=sizes[0], batch_min=min(8, sizes[0]), batch_max=max(sizes))
    ta = TriAccel(cfg, model, loss_fn=ce_loss)
    opt = nnx.Optimizer(model, ta.wrap(optax.sgd(0.05, momentum=0.9)), wrt=nnx.Param)

    def step(x: jax.Array, y: jax.Array, model: Any, opt: Any) -> jax.Array:
        scale = loss_scale(opt.opt_state)
        loss, g = nnx.value_and_grad(lambda m: ce_loss(m, (x, y)) * scale)(model)
        opt.update(model, g)
        return loss / scale

    jstep: CountingJit = ta.jit(step)
    rows = []
    for bs in sizes:
        key = jax.random.PRNGKey(bs)
        x = jax.random.normal(key, (bs, image, image, 3), jnp.float32)
        y = jax.random.randint(key, (bs,), 0, 10)
        jax.block_until_ready(jstep(x, y, model, opt))
        compile_peak = stats().get("peak_bytes_in_use")
        in_use = stats().get("bytes_in_use")
        sample = ta.probe.read(batch=bs, footprint=ta.footprint(bs))
        for _ in range(args.steps):
            out = jstep(x, y, model, opt)
        jax.block_until_ready(out)
        step_peak = stats().get("peak_bytes_in_use")
        rows.append({"batch": bs, "in_use": in_use, "footprint": ta.footprint(bs),
                     "estimate": sample.used if sample else None, "source": sample.source if sample else None,
                     "compile_peak": compile_peak, "step_peak": step_peak,
                     "step_set_record": step_peak is not None and step_peak > (compile_peak or 0)})
    pure = nnx_loss(model, ce_loss)
    fisher = FisherTopK(pure.fn, ta.layers, 5)
    bc = args.b_curv
    batch = (jnp.zeros((bc, image, image, 3)), jnp.zeros((bc,), jnp.int32))
    before = stats().get("peak_bytes_in_use")
    jax.block_until_ready(fisher(pure.params, batch, pure.aux))
    curv = {"b_curv": bc, "peak_before": before, "peak_after": stats().get("peak_bytes_in_use"),
            "in_use": stats().get("bytes_in_use"),
            "footprint": fisher.footprint(pure.params, batch, pure.aux)}

    meta = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([os.path.basename(sys.executable), *sys.argv]), "device": str(dev),
            "device_kind": kind, "jax": jax.__version__, "width": width, "image": image,
            "xla_flags": os.environ.get("XLA_FLAGS", "")}
    out = args.out or Path(__file__).parent / "results" / f"jax_memory-{kind}{'-tiny' if args.tiny else ''}.json"
    write_json({"meta": meta, "rows": rows, "fisher": curv}, out)

    def gb(v: Any) -> str:
        return f"{v / 1e9:8.3f}" if isinstance(v, int) else f"{'-':>8}"

    print(f"# jax_memory  {meta['date']}  {dev} ({kind})  jax {jax.__version__}  XLA_FLAGS={meta['xla_flags']!r}")
    print(f"# {meta['command']}")
    print(f"{'bs':>6} {'in_use GB':>9} {'footprint':>9} {'estimate':>9} {'compile pk':>10} {'step pk':>9} {'est/step':>9}")
    for r in rows:
        ratio = (f"{r['estimate'] / r['step_peak']:9.3f}" if r["estimate"] and r["step_peak"] and r["step_set_record"]
                 else f"{'(no rec)':>9}")
        print(f"{r['batch']:>6} {gb(r['in_use'])} {gb(r['footprint'])} {gb(r['estimate'])} {gb(r['compile_peak']):>10} "
              f"{gb(r['step_peak'])} {ratio}")
    print(f"# fisher b_curv={bc}: footprint {gb(curv['footprint'])} GB, allocator peak before/after "
          f"{gb(curv['peak_before'])} / {gb(curv['peak_after'])} GB")
    print(f"# est/step: estimate over the allocator peak the steps set (only where they set a new record); written {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
