"""What `SplitStep(pack=...)` costs and saves: a plain train step (SGD with momentum, state not
donated, as the demo's) over a model, its state packed into flat buffers or left as one buffer per
leaf, each form in its own process (no shared compilation caches): the first call's seconds
(tracing and XLA's compilation) and the median step after it. `--update triaccel`: the SGD wrapped by
`TriAccel` with the default config (its state, statistics ring and counters, travel with the step).

    python3 benchmarks/jax_packing.py --model efficientnet_b0 --width 0.25 --batch 32 [--update triaccel]

Prints a table and writes benchmarks/results/jax_packing-<device>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import device_tag, fresh_process_row, run_meta, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def one(model_name: str, width: float, batch: int, pack: bool, steps: int, update: str = "plain") -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from triaccel import TriAccelConfig
    from triaccel.backends.jax import SplitStep, TriAccel
    from triaccel.backends.jax.models import create_model

    model = create_model(model_name, num_classes=10, width=width, seed=0)
    tx = optax.sgd(0.1, momentum=0.9)
    if update == "triaccel":
        tx = TriAccel(TriAccelConfig(), model).wrap(tx)
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

    def step(m: Any, o: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        def lf(mm: Any) -> jax.Array:
            return optax.softmax_cross_entropy_with_integer_labels(mm(x).astype(jnp.float32), y).mean()

        loss, g = nnx.value_and_grad(lf)(m)
        o.update(m, g)
        return loss

    s = SplitStep(step, model, opt, compile_ahead=False, compile_cache=False, donate_argnums=(), pack=pack)
    x, y = jnp.zeros((batch, 32, 32, 3), jnp.float32), jnp.zeros((batch,), jnp.int32)
    t = time.perf_counter()
    jax.block_until_ready(s(x, y))
    first = time.perf_counter() - t
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        jax.block_until_ready(s(x, y))
        times.append(time.perf_counter() - t)
    p = s._packing
    return {"pack": pack, "update": update, "leaves": p.n, "buffers": p.num_buffers, "first_call_s": first,
            "step_ms": statistics.median(times) * 1e3, "device": jax.devices()[0].device_kind}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("resnet18", "efficientnet_b0"), default="efficientnet_b0")
    ap.add_argument("--width", type=float, default=0.25)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--update", choices=("plain", "triaccel"), default="plain")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--_one", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.width <= 0:
        ap.error(f"--width={a.width}: allowed > 0")
    for name, v in (("--batch", a.batch), ("--steps", a.steps)):
        if v < 1:
            ap.error(f"{name}={v}: allowed >= 1")
    if a._one is not None:
        print(json.dumps(one(a.model, a.width, a.batch, a._one == "packed", a.steps, a.update)))
        return
    rows = [fresh_process_row([sys.executable, __file__, "--model", a.model, "--width", str(a.width), "--batch",
                               str(a.batch), "--steps", str(a.steps), "--update", a.update, "--_one", form], form)
            for form in ("apart", "packed")]
    dev = rows[0]["device"]
    meta = run_meta(dev)
    suffix = "" if a.update == "plain" else f"-{a.update}"
    write_json({"meta": meta, "rows": rows}, a.out / f"jax_packing-{device_tag(dev)}{suffix}.json")
    print(f"\n{a.model} width {a.width} batch {a.batch}, update {a.update}, {dev}  {meta['date']}")
    print(f"{'state':>7} {'leaves':>6} {'buffers':>7} {'first call s':>12} {'step ms':>8} {'/apart':>7}")
    for r in rows:
        print(f"{'packed' if r['pack'] else 'apart':>7} {r['leaves']:6d} {r['buffers']:7d} {r['first_call_s']:12.1f} "
              f"{r['step_ms']:8.1f} {r['first_call_s'] / rows[0]['first_call_s']:7.2f}")


if __name__ == "__main__":
    main()
