"""Does a noise split's pair of gradient norms share its BatchNorm batch? The bias that a split whose two
sizes normalise over different batches puts into B_noise, at fixed parameters (no training in between).

`TriAccelConfig.noise_split="steps"` pairs the squared norm of a step of b = B/2 samples (BatchNorm statistics
over b) with that of steps of B samples (statistics over B); "halves" pairs the mean of two halves' squared norms
with the squared norm of their mean, every gradient normalised over b. McCandlish et al.'s estimator,
|G|^2 = (B|g_B|^2 - b|g_b|^2) / (B - b), assumes the two sizes sample one gradient distribution; with BatchNorm
a gradient normalised over fewer samples is a different one, and that difference lands in |G|^2 and tr(Sigma).

Here, per batch k of B samples (one fixed order, the demo's JAX model in training mode at its initial
parameters, or after --train-steps of SGD): g_B (statistics over B), g_1 and g_2 (its halves, statistics over
b each). Over K batches: E|g_B|^2, E|g_1|^2 (the steps split's two sizes, here on the same samples, which
takes the drift between steps out and leaves the BatchNorm difference), E|(g_1+g_2)/2|^2 (the halves' large
size). Prints |G|^2, tr(Sigma) and B_noise for both pairings, and the ratio E|g_B|^2 / E|(g_1+g_2)/2|^2 (1 where
BatchNorm does not care about its batch) with the ratio of the medians (the squared norms can be heavy-tailed). Writes benchmarks/results/noise_bn_bias-<model>-t<train steps>-<device>.json.

    python3 benchmarks/noise_bn_bias.py --model resnet18 --width 0.25 --batch 128 --batches 48 --data ../shared/data/cifar10-jpeg
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import device_tag, print_table, run_meta, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def estimate(b_small: float, small: float, b_big: float, big: float) -> dict[str, float]:
    """McCandlish et al.'s two-size estimate from mean squared norms at b_small < b_big samples, as the
    controller folds one measurement (`triaccel.noise.GradientNoise`); B_noise inf where |G|^2 <= 0."""
    from triaccel.noise import GradientNoise

    one = GradientNoise(1, beta=0.0)
    one.observe(b_small, np.array([small]), b_big, np.array([big]))
    g2, trace = float(one.g2[0]), float(one.trace[0])
    return {"g2": g2, "trace": trace, "b_noise": trace / g2 if g2 > 0 else float("inf")}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="resnet18", choices=["resnet18", "efficientnet_b0"])
    ap.add_argument("--width", type=float, default=0.25)
    ap.add_argument("--batch", type=int, default=128, help="B (even); the halves and the small size are B/2")
    ap.add_argument("--batches", type=int, default=48, help="K batches of B samples averaged over")
    ap.add_argument("--train-steps", type=int, default=0,
                    help="SGD-momentum steps at bs B before measuring, the LR rising linearly to --train-lr over them")
    ap.add_argument("--train-lr", type=float, default=0.05)
    ap.add_argument("--data", default=None, help="CIFAR-10 root (default: $TRIACCEL_DATA or the user cache)")
    ap.add_argument("--skip", action="append", default=[], metavar="TEXT",
                    help="leave out the parameters whose path holds TEXT (e.g. fc: the classifier, whose gradient "
                         "can dominate the network's norm); repeatable")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.batch < 4 or a.batch % 2:
        ap.error(f"--batch={a.batch}: allowed an even integer >= 4")
    if a.batches < 2:
        ap.error(f"--batches={a.batches}: allowed an integer >= 2")

    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    sys.path.insert(0, str(ROOT))
    from examples.cifar.datasets import load
    from triaccel.backends.jax.models import create_model

    data = load("cifar10", a.data, a.batch * (a.batches + max(a.train_steps, 0)), 10, a.seed)
    mean, std = np.asarray(data.mean, np.float32), np.asarray(data.std, np.float32)
    xs = (data.train_x.astype(np.float32) / 255.0 - mean) / std
    ys = data.train_y.astype(np.int32)
    model = create_model(a.model, num_classes=10, width=a.width, seed=a.seed)
    model.train()   # batch statistics: what this measures

    def loss(m: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        return optax.softmax_cross_entropy_with_integer_labels(m(x).astype(jnp.float32), y).mean()

    @nnx.jit
    def grad(m: Any, x: jax.Array, y: jax.Array) -> Any:
        return nnx.grad(loss)(m, x, y)

    def sqnorm(t: Any) -> float:
        return float(sum(jnp.vdot(v, v).real for path, v in jax.tree_util.tree_leaves_with_path(t)
                         if not any(x in jax.tree_util.keystr(path) for x in a.skip)))

    b, B = a.batch // 2, a.batch
    t0 = time.perf_counter()
    if a.train_steps:
        lr = optax.linear_schedule(0.0, a.train_lr, a.train_steps)
        opt = nnx.Optimizer(model, optax.sgd(lr, momentum=0.9), wrt=nnx.Param)

        @nnx.jit
        def train(m: Any, o: Any, x: jax.Array, y: jax.Array) -> jax.Array:
            value, g = nnx.value_and_grad(loss)(m, x, y)
            o.update(m, g)
            return value

        for k in range(a.train_steps):
            sl = slice((a.batches + k) * B, (a.batches + k + 1) * B)
            last = train(model, opt, xs[sl], ys[sl])
            if k == 0 or k + 1 == a.train_steps:
                print(f"training step {k + 1}: loss {float(last):.4f}", flush=True)
    big, half1, mean_h = [], [], []
    for k in range(a.batches):
        x, y = xs[k * B:(k + 1) * B], ys[k * B:(k + 1) * B]
        gB = grad(model, x, y)
        g1 = grad(model, x[:b], y[:b])
        g2 = grad(model, x[b:], y[b:])
        big.append(sqnorm(gB))
        half1.append(0.5 * (sqnorm(g1) + sqnorm(g2)))
        mean_h.append(sqnorm(jax.tree_util.tree_map(lambda u, v: 0.5 * (u + v), g1, g2)))
    seconds = time.perf_counter() - t0
    eb, eh, em = float(np.mean(big)), float(np.mean(half1)), float(np.mean(mean_h))
    sem = lambda v: float(np.std(v, ddof=1) / np.sqrt(len(v)))  # noqa: E731
    steps = estimate(b, eh, B, eb)
    halves = estimate(b, eh, B, em)
    rows = [
        {"pairing": "steps (b over b, B over B)", "small": eh, "big": eb, **steps},
        {"pairing": "halves (both over b)", "small": eh, "big": em, **halves},
    ]
    dev = jax.devices()[0]
    device = getattr(dev, "device_kind", dev.platform)
    skipped = f", without {'/'.join(a.skip)}" if a.skip else ""
    print_table(f"{a.model} width {a.width}{skipped}, B {B}, b {b}, {a.batches} batches, after {a.train_steps} SGD "
                f"steps, {seconds:.1f} s on {device}", rows,
                [("pairing", "pairing", "<28"), ("E small", "small", ">10.5g"), ("E big", "big", ">10.5g"),
                 ("|G|^2", "g2", ">11.4g"), ("tr(Sigma)", "trace", ">11.4g"), ("B_noise", "b_noise", ">9.1f")])
    ratio = eb / em
    med = float(np.median(big) / np.median(mean_h))
    print(f"E|g_B|^2 (statistics over B) / E|(g_1+g_2)/2|^2 (over b each) = {ratio:.4f} "
          f"(standard errors {sem(big):.4g}, {sem(mean_h):.4g} of {eb:.4g}, {em:.4g}); medians' ratio {med:.4f}")
    out = {**run_meta(device), "model": a.model, "width": a.width, "batch": B, "batches": a.batches,
           "train_steps": a.train_steps, "train_lr": a.train_lr, "skip": a.skip, "rows": rows, "ratio_big": ratio,
           "median_ratio_big": med, "sq_big": big, "sq_small": half1, "sq_mean_halves": mean_h}
    without = "".join("-no-" + device_tag(x) for x in a.skip)
    write_json(out, ROOT / "benchmarks" / "results" /
               f"noise_bn_bias-{a.model}-t{a.train_steps}{without}-{device_tag(device)}.json")
    return out


if __name__ == "__main__":
    main()
