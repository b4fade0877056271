"""Overhead of the JAX backend vs a plain Flax bf16 step, compilations, and curvature cost.

Flax NNX ResNet-18 (CIFAR variant) on synthetic CIFAR-size inputs (32x32x3, 10 classes) resident on
the device, SGD-nesterov through `nnx.Optimizer`. For each batch size, in one process, interleaved
in rounds (A, B, A, B, ...):

- plain: every conv/linear layer computes in bf16 (BatchNorm fp32), `optax.sgd` unwrapped;
- triaccel: the same optimizer through `TriAccel.wrap` (device moments ring, per-layer LR
  multipliers, loss-scale state), `ta.control(step, ...)` called every step (reads the ring and
  probes memory at each control boundary, applies the per-layer precision policy), adaptive
  precision on, batch fixed (elastic_batch=False: the batch lever is benchmarked by elastic.py),
  curvature excluded from the timed steps (timed separately below);
- triaccel_bf16: the wrapper with its precision lever off (all layers bf16, as plain): the cost of
  the mechanism alone;
- plain_policy: the plain optimizer with the per-layer policy triaccel chose: the cost (or gain)
  of the decision alone.

The first four run as `nnx.jit` steps over the model and `nnx.Optimizer` objects, whose Python graph
traversal per call bounds small-batch steps; `plain_fn`, `triaccel_fn` and `triaccel_bf16_fn` are the same steps as
`jax.jit` over the `nnx.split` state (`SplitStep`: one jitted step per graph definition over the
state's flat leaves; split again only after `ta.control` applied a new policy), where per-call host
work is handing jit a list of arrays.

Reports samples/s of each and the ratios to plain (target for triaccel >= 0.95; median over rounds;
a round during which a step retraced for a new precision policy is timed again, since compilations
are reported on their own), the number of traces of each jitted step (compilations), each step's
compiled memory footprint, and for curvature one event (k=5, b_curv=32) timed after a cold
one, for "fisher" and "hessian" (warm-started, --hessian-iters), as the amortised fraction
t_event / (t_curv * t_step + t_event) at t_curv=200 (targets: fisher <= 2%, hessian <= 10%).

    python benchmarks/jax_overhead.py                       # GPU, full run
    python benchmarks/jax_overhead.py --steps 3 --tiny      # CPU smoke check of the script

Writes benchmarks/results/jax_overhead-<device>.json (with --tiny: jax_overhead-<device>-tiny.json)
and prints a table with machine, date and command.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from triaccel import TriAccelConfig  # noqa: E402
from triaccel.backends.jax import (CountingJit, FisherTopK, HessianTopK, SplitStep, TriAccel,  # noqa: E402
                                   layer_map, loss_scale, nnx_loss, precision_policy)
from triaccel.backends.jax.models import create_model  # noqa: E402
from _results import device_tag, write_json


def ce_loss(model: Any, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(model(x).astype(jnp.float32), y).mean()


def _inner() -> optax.GradientTransformation:
    return optax.sgd(0.05, momentum=0.9, nesterov=True)


def _plain_step(model: Any, opt: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    loss, g = nnx.value_and_grad(lambda m: ce_loss(m, (x, y)))(model)
    opt.update(model, g)
    return loss


def _wrapped_step(model: Any, opt: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    scale = loss_scale(opt.opt_state)
    loss, g = nnx.value_and_grad(lambda m: ce_loss(m, (x, y)) * scale)(model)
    opt.update(model, g)
    return loss / scale


def _plain(width: float, seed: int, functional: bool = False) -> tuple[Any, Any, Any]:
    model = create_model("resnet18", width=width, seed=seed)
    lm = layer_map(model)
    precision_policy(model, ["fp32" if s.kind == "norm" else "bf16" for s in lm.specs], lm)
    opt = nnx.Optimizer(model, _inner(), wrt=nnx.Param)
    if functional:
        return model, opt, SplitStep(_plain_step, model, opt)
    return model, opt, CountingJit(_plain_step, donate_argnums=(0, 1))


def _wrapped(width: float, seed: int, cfg: TriAccelConfig,
             functional: bool = False) -> tuple[Any, Any, TriAccel, Any]:
    model = create_model("resnet18", width=width, seed=seed)
    ta = TriAccel(cfg, model, loss_fn=ce_loss)
    opt = nnx.Optimizer(model, ta.wrap(_inner()), wrt=nnx.Param)
    if functional:
        return model, opt, ta, SplitStep(_wrapped_step, model, opt, ta=ta)
    return model, opt, ta, ta.jit(_wrapped_step, donate_argnums=(0, 1))


def _split_runner(step: SplitStep, x: jax.Array, y: jax.Array, control: bool) -> Callable[[], Any]:
    n = [0]

    def run() -> Any:
        if control:
            step.control(n[0])
            n[0] += 1
        return step(x, y)
    return run


def _time_chunk(fn: Callable[[], Any], n: int) -> tuple[float, float]:
    """(seconds per step, host seconds per call) over n steps, one device sync at the end (the steps
    pipeline as in training). The host time is the loop's time before that sync: when it is close
    to the step time, the host, not the device, bounds the step."""
    t = time.perf_counter()
    out = None
    for _ in range(n):
        out = fn()
    host = time.perf_counter() - t
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / n, host / n


def bench_batch(bs: int, args: argparse.Namespace) -> dict[str, Any]:
    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (bs, args.image, args.image, 3), jnp.float32)
    y = jax.random.randint(key, (bs,), 0, 10)
    cfg = TriAccelConfig(curvature="off", t_ctrl=args.t_ctrl, warmup_steps=args.t_ctrl, min_dwell=args.t_ctrl,
                         batch_init=bs, batch_min=min(8, bs), batch_max=max(bs, 8), elastic_batch=False)
    pm, popt, pstep = _plain(args.width, 0)
    wm, wopt, ta, wstep = _wrapped(args.width, 0, cfg)
    # The wrapper with its precision lever off (every layer at bf16, as plain): the mechanism's cost.
    fm, fopt, fta, fstep = _wrapped(args.width, 0, cfg.replace(adaptive_precision=False))
    counters = {"triaccel": 0, "triaccel_bf16": 0}

    def wrapped_runner(name: str, m: Any, opt: Any, t: TriAccel, step: CountingJit) -> Callable[[], Any]:
        def run() -> Any:
            t.control(counters[name], opt, m)
            counters[name] += 1
            return step(m, opt, x, y)
        return run

    # The functional forms (jax.jit over nnx.split state) of plain and of triaccel.
    _pfm, _pfopt, pfstep = _plain(args.width, 0, functional=True)
    _wfm, _wfopt, _tfa, wfstep = _wrapped(args.width, 0, cfg, functional=True)
    _bfm, _bfopt, _bta, bfstep = _wrapped(args.width, 0, cfg.replace(adaptive_precision=False), functional=True)
    runs: dict[str, tuple[Callable[[], Any], CountingJit | SplitStep]] = {
        "plain": (lambda: pstep(pm, popt, x, y), pstep),
        "triaccel": (wrapped_runner("triaccel", wm, wopt, ta, wstep), wstep),
        "triaccel_bf16": (wrapped_runner("triaccel_bf16", fm, fopt, fta, fstep), fstep),
        "plain_fn": (_split_runner(pfstep, x, y, control=False), pfstep),
        "triaccel_fn": (_split_runner(wfstep, x, y, control=True), wfstep),
        "triaccel_bf16_fn": (_split_runner(bfstep, x, y, control=True), bfstep),
    }
    for _ in range(args.warmup):  # compile, pass the first control boundaries
        for fn, _j in runs.values():
            jax.block_until_ready(fn())
    # The plain step with the policy triaccel chose: the cost of the decision, apart from the mechanism.
    qm, qopt, qstep = _plain(args.width, 0)
    precision_policy(qm, ta.decision, ta.layers)
    runs["plain_policy"] = (lambda: qstep(qm, qopt, x, y), qstep)
    jax.block_until_ready(runs["plain_policy"][0]())
    per = max(1, args.steps // args.rounds)
    times: dict[str, list[float]] = {k: [] for k in runs}
    host: dict[str, list[float]] = {k: [] for k in runs}
    retimed = 0
    for _ in range(args.rounds):
        for name, (fn, j) in runs.items():
            # A chunk during which a step retraced (a new precision policy at a boundary) measures
            # compilation, which is counted separately: time the chunk again (bounded).
            for attempt in range(4):
                before = j.traces
                t_chunk, t_host = _time_chunk(fn, per)
                if j.traces == before or attempt == 3:
                    break
                retimed += 1
            times[name].append(t_chunk)
            host[name].append(t_host)
    med = {k: statistics.median(v) for k, v in times.items()}
    tp, tw = med["plain"], med["triaccel"]
    res: dict[str, Any] = {
        "batch_size": bs, "steps_per_round": per, "rounds": args.rounds,
        "step_s": med, "host_s_per_call": {k: statistics.median(v) for k, v in host.items()},
        "samples_per_s": {k: bs / v for k, v in med.items()},
        "plain_step_s": tp, "triaccel_step_s": tw,
        "plain_samples_per_s": bs / tp, "triaccel_samples_per_s": bs / tw, "throughput_ratio": tp / tw,
        "ratio_vs_plain": {k: tp / v for k, v in med.items()},
        "functional_ratio": med["plain_fn"] / med["triaccel_fn"],
        "compilations": {k: j.traces for k, (_f, j) in runs.items()}, "retimed_rounds": retimed,
        "triaccel_steps": counters["triaccel"], "policy": list(p.short for p in ta.decision.precisions),
        "footprint_bytes": {"plain": pstep.footprint(bs), "triaccel": wstep.footprint(bs)},
    }
    # Curvature: one cold event (compile), then one timed event, per mode.
    bc = min(args.b_curv, bs)
    batch = (x[:bc], y[:bc])
    curv: dict[str, Any] = {}
    for mode in args.curvature:
        pure = nnx_loss(wm, ce_loss)
        est = (FisherTopK(pure.fn, ta.layers, args.top_k) if mode == "fisher"
               else HessianTopK(pure.fn, ta.layers, args.top_k, iters=args.hessian_iters,
                              layers_per_event=args.hessian_layers_per_event))
        t0 = time.perf_counter()
        est(pure.params, batch, pure.aux)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        eig = est(pure.params, batch, pure.aux)
        t_event = time.perf_counter() - t0
        curv[mode] = {"cold_s": cold, "event_s": t_event, "b_curv": bc, "top_k": args.top_k,
                      "amortised_fraction_at_t_curv": t_event / (args.t_curv * tw + t_event),
                      "t_curv": args.t_curv, "finite": bool(np.isfinite(eig).all())}
        if mode == "hessian":
            curv[mode].update(iters=args.hessian_iters, layers_per_event=args.hessian_layers_per_event,
                              refreshed_layers=len(est.refreshed), num_layers=ta.layers.num_layers)
    res["curvature"] = curv
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=None)
    ap.add_argument("--steps", type=int, default=200, help="timed steps per variant and batch size")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved A/B rounds (median reported)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps per variant (default: t_ctrl + 2)")
    ap.add_argument("--t-ctrl", type=int, default=50)
    ap.add_argument("--t-curv", type=int, default=200)
    ap.add_argument("--b-curv", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=5)
    ap.add_argument("--hessian-iters", type=int, default=3)
    ap.add_argument("--hessian-layers-per-event", type=int, default=None,
                    help="Hessian blocks refreshed per curvature event, round-robin (default: all)")
    ap.add_argument("--curvature", nargs="*", default=["fisher", "hessian"], choices=["fisher", "hessian"])
    ap.add_argument("--tiny", action="store_true", help="CPU smoke mode: width 1/8, 16x16 inputs, bs 8, k=2, b_curv=4")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    args.width, args.image = (0.125, 16) if args.tiny else (1.0, 32)
    if args.tiny:
        args.t_ctrl = min(args.t_ctrl, 2)
        args.b_curv = min(args.b_curv, 4)
        args.top_k = min(args.top_k, 2)
        args.rounds = min(args.rounds, args.steps)
    if args.batch_sizes is None:
        args.batch_sizes = [8] if args.tiny else [96, 512]
    if args.warmup is None:
        args.warmup = args.t_ctrl + 2
    if args.steps < 1 or args.rounds < 1:
        raise ValueError(f"--steps={args.steps}, --rounds={args.rounds}: must be >= 1")

    dev = jax.devices()[0]
    kind = device_tag(getattr(dev, "device_kind", dev.platform))
    warnings.filterwarnings("ignore", message="triaccel: device .* reports no memory")
    results = [bench_batch(bs, args) for bs in args.batch_sizes]
    meta = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([sys.executable, *sys.argv]), "device": str(dev), "device_kind": kind,
            "platform": platform.platform(), "python": platform.python_version(), "jax": jax.__version__,
            "flax": __import__("flax").__version__, "optax": optax.__version__, "tiny": args.tiny,
            "width": args.width, "image": args.image}
    out = args.out or Path(__file__).parent / "results" / f"jax_overhead-{kind}{'-tiny' if args.tiny else ''}.json"
    write_json({"meta": meta, "results": results}, out)

    print(f"# jax_overhead  {meta['date']}  {meta['device']} ({kind})  jax {jax.__version__}")
    print(f"# {meta['command']}")
    print(f"{'bs':>5} {'plain samp/s':>13} {'triaccel samp/s':>16} {'ratio':>6} {'ratio bf16-only':>16} "
          f"{'policy-only':>12} {'fn: plain ms':>13} {'triaccel ms':>12} {'ratio':>6} {'bf16-only':>10} {'compiles p/t':>13} "
          f"{'fisher %':>9} {'hessian %':>10}")
    for r in results:
        c, q = r["curvature"], r["ratio_vs_plain"]
        f = f"{100 * c['fisher']['amortised_fraction_at_t_curv']:.2f}" if "fisher" in c else "-"
        h = f"{100 * c['hessian']['amortised_fraction_at_t_curv']:.2f}" if "hessian" in c else "-"
        print(f"{r['batch_size']:>5} {r['plain_samples_per_s']:>13.1f} {r['triaccel_samples_per_s']:>16.1f} "
              f"{r['throughput_ratio']:>6.3f} {q['triaccel_bf16']:>16.3f} {q['plain_policy']:>12.3f} "
              f"{1e3 * r['step_s']['plain_fn']:>13.2f} {1e3 * r['step_s']['triaccel_fn']:>12.2f} "
              f"{r['functional_ratio']:>6.3f} {r['step_s']['plain_fn'] / r['step_s']['triaccel_bf16_fn']:>10.3f} "
              f"{r['compilations']['plain']:>6}/{r['compilations']['triaccel']:<6} {f:>9} {h:>10}")
    for r in results:
        print(f"# bs {r['batch_size']} host ms per call (loop time before the sync; close to the step time = "
              "host-bound): " + ", ".join(f"{k} {1e3 * v:.2f}/{1e3 * r['step_s'][k]:.2f}"
                                          for k, v in r["host_s_per_call"].items()))
    print("# ratio = plain step time / variant step time (>1: faster than plain bf16); bf16-only: the wrapper with "
          "its precision lever off; policy-only: plain optimizer with triaccel's final per-layer policy; "
          "fn: both steps as jax.jit over nnx.split state (no nnx.jit graph traversal per call)")
    print(f"# written {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
