"""Cost of the CIFAR demo's harness and of the triaccel wrapper over a plain AMP loop (issue #15).

Variants, each in its own process, one after the other, same data, same model, same batch:

- plain:      a minimal eager AMP-bf16 loop (device-resident uint8 images, the demo's augmentation,
              SGD-nesterov, the same warm-up/cosine LambdaLR), no records, no elastic step;
- amp:        `python -m examples.cifar.train --method amp` (the demo's harness around the same loop);
- triaccel-fixed: the demo with `--method triaccel --levers precision` (batch fixed, wrapper on);
- triaccel:   the demo's defaults (`--levers precision,batch`: the batch grows; not the same batch,
              listed for its wall only);
- amp-compiled, triaccel-fixed-compiled: amp / triaccel-fixed with `--compile COMPILE --compile-shapes
              SHAPES` (default reduce-overhead, buckets): issue #15's compiled step against the eager
              plain loop (target <= 0.6).

`--backend jax`: the same variants but the compiled ones, on the JAX demo (`--backend jax`); its `plain`
is the JAX loop a user would write for speed: one `jax.jit` program per step (gradient and update,
state donated, graph split once with `nnx.split`), the demo's AMP precision policy, augmentation and
optimizer, the epoch's permutation on the device. `--model efficientnet_b0` in either backend.

Step cost = median seconds per epoch over epochs 2..E (epoch 1 holds cuDNN/Triton start-up), as a
ratio to `plain` at the same batch. `--profile` adds a cProfile of the triaccel-fixed run (top
functions by own time, to $OUT-style `--out` folder). Targets: amp/plain <= 1.05 (harness),
triaccel-fixed/amp <= 1.03 (wrapper).

    python benchmarks/harness.py --data <cifar10-jpeg> --epochs 3 --batch-sizes 96 384 --out results/harness
    python benchmarks/harness.py --data <cifar10-jpeg> --epochs 5 --batch-sizes 384 \
        --variants plain amp amp-compiled triaccel-fixed-compiled
    python benchmarks/harness.py --data <cifar10-jpeg> --device cpu --epochs 2 --train-subset 512 --width 0.25
    python benchmarks/harness.py --backend jax --data <cifar10-jpeg> --epochs 4 --batch-sizes 96 512 \
        --variants plain amp triaccel-fixed [--model efficientnet_b0]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("plain", "amp", "triaccel-fixed", "triaccel", "amp-compiled", "triaccel-fixed-compiled")


def plain_loop(a: argparse.Namespace) -> dict[str, Any]:
    """The minimal loop a user would write (same data path, model, optimizer and schedule as the demo)."""
    import torch
    import torch.nn.functional as F

    from examples.cifar.common import lr_factor
    from examples.cifar.datasets import load
    from triaccel.backends.torch import augment
    from triaccel.backends.torch.models import create_model, uses_channels_last

    dev = torch.device(a.device)
    data = load("cifar10", a.data, a.train_subset, 512, a.seed)
    torch.manual_seed(a.seed)
    model = create_model(a.model, num_classes=10, width=a.width, seed=a.seed).to(dev)
    channels_last = uses_channels_last(a.model, "auto", dev.type)  # the demo's default memory format
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    if dev.type == "cuda":
        torch.backends.cudnn.benchmark = False  # the demo's default
    lr = 0.1 * a.batch / 96
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=5e-4)
    x = torch.from_numpy(data.train_x).to(dev)
    y = torch.from_numpy(data.train_y).to(dev)
    mean, std = torch.tensor(data.mean, device=dev), torch.tensor(data.std, device=dev)
    gen = torch.Generator(device=dev).manual_seed(a.seed)
    n = len(x)
    total, warm = a.epochs * n, n
    seen = [0]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: lr_factor(seen[0], total, warm))
    times = []
    for _ in range(a.epochs):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        perm = torch.randperm(n, device=dev, generator=gen)
        for i in range(0, n, a.batch):
            idx = perm[i:i + a.batch]
            xb = augment.normalize(augment.random_crop_flip(x[idx], gen), mean, std, channels_last=channels_last)
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                loss = F.cross_entropy(model(xb), y[idx])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            seen[0] += len(idx)
            sched.step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
    return {"epoch_seconds": times}


def plain_loop_jax(a: argparse.Namespace) -> dict[str, Any]:
    """The JAX loop a careful user writes for speed: one jitted program per step, state donated, the LR
    schedule and the step counters computed on the device (no host value uploaded per step)."""
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    from examples.cifar.common import RunOptions
    from examples.cifar.datasets import load
    from examples.cifar.jax_loop import _sgd
    from triaccel import Precision
    from triaccel.backends.jax import augment, layer_map_from_model, precision_policy
    from triaccel.backends.jax.models import create_model

    data = load("cifar10", a.data, a.train_subset, 512, a.seed)
    model = create_model(a.model, num_classes=10, width=a.width, seed=a.seed)
    lm = layer_map_from_model(model)   # AMP as the demo's: bf16 everywhere but the norm layers
    precision_policy(model, [Precision.FP32 if sp.kind == "norm" else Precision.BF16 for sp in lm.specs], lm)
    lr = 0.1 * a.batch / 96
    opt = nnx.Optimizer(model, _sgd(lr, RunOptions()), wrt=nnx.Param)   # the demo's optimizer and its defaults
    graphdef, state = nnx.split((model, opt))
    x, y = jax.device_put(data.train_x), jax.device_put(data.train_y.astype(np.int32))
    mean, std = jnp.asarray(data.mean, jnp.float32), jnp.asarray(data.std, jnp.float32)
    n = len(data.train_x)

    total, warm = a.epochs * n, n

    def lr_at(seen: jax.Array) -> jax.Array:   # lr_factor in the program: no scalar uploaded per step
        s = seen.astype(jnp.float32)
        prog = jnp.clip((s - warm) / max(total - warm, 1), 0.0, 1.0)
        return lr * jnp.where(s < warm, (s + 1) / warm, 0.5 * (1.0 + jnp.cos(jnp.pi * prog)))

    # counters (step, samples seen, start in the epoch's permutation) live on the device; the data set
    # is an argument (a closed-over array would be a constant of the program)
    @functools.partial(jax.jit, static_argnums=(6,), donate_argnums=(0, 3))
    def step(state: Any, perm: jax.Array, key: jax.Array, ctr: jax.Array, x: jax.Array, y: jax.Array, size: int
             ) -> tuple[Any, jax.Array, jax.Array]:
        m, o = nnx.merge(graphdef, state)
        k, seen, start = ctr[0], ctr[1], ctr[2]
        idx = jax.lax.dynamic_slice(perm, (start,), (size,))
        xb = augment.normalize(augment.random_crop_flip(x[idx], jax.random.fold_in(key, k)), mean, std)

        def loss_of(mm: Any) -> jax.Array:
            return optax.softmax_cross_entropy_with_integer_labels(mm(xb).astype(jnp.float32), y[idx]).mean()

        loss, grads = nnx.value_and_grad(loss_of)(m)
        o.opt_state.hyperparams["learning_rate"].set_value(lr_at(seen))
        o.update(m, grads)
        return nnx.state((m, o)), loss, ctr + jnp.array([1, size, size], jnp.int32)

    key, rng = jax.random.key(a.seed), np.random.default_rng(a.seed)
    ctr = jax.device_put(np.zeros(3, np.int32))
    times = []
    for _ in range(a.epochs):
        t0 = time.perf_counter()
        perm = jax.device_put(rng.permutation(n).astype(np.int32))
        ctr = ctr.at[2].set(0)
        for i in range(0, n, a.batch):
            state, loss, ctr = step(state, perm, key, ctr, x, y, min(a.batch, n - i))
        jax.block_until_ready(loss)
        times.append(time.perf_counter() - t0)
    return {"epoch_seconds": times, "last_loss": float(loss)}


def demo_args(a: argparse.Namespace, variant: str, out: Path) -> list[str]:
    method = "amp" if variant.startswith("amp") else "triaccel"
    args = ["--method", method, "--epochs", str(a.epochs), "--batch", str(a.batch), "--seed", str(a.seed),
            "--width", str(a.width), "--device", a.device, "--no-progress", "--out", str(out),
            "--test-subset", "512", "--backend", a.backend, "--model", a.model]
    if a.data:
        args += ["--data", a.data]
    if a.train_subset:
        args += ["--train-subset", str(a.train_subset)]
    if variant.startswith("triaccel-fixed"):
        args += ["--levers", "precision"]
    if variant.endswith("-compiled"):
        args += ["--compile", a.compile, "--compile-shapes", a.compile_shapes]
    return args


def run_variant(a: argparse.Namespace, variant: str, batch: int, work: Path, profile: bool) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    sub = argparse.Namespace(**{**vars(a), "batch": batch})
    out = work / f"{variant}-bs{batch}"
    if variant == "plain":
        cmd = [sys.executable, str(Path(__file__).resolve()), "--_plain", json.dumps(vars(sub), default=str)]
    else:
        pre = ["-m", "cProfile", "-o", str(out) + ".prof"] if profile else []
        cmd = [sys.executable, *pre, "-m", "examples.cifar.train", *demo_args(sub, variant, out)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{variant} bs {batch} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    if variant == "plain":
        res = json.loads(proc.stdout.strip().splitlines()[-1])
    else:
        res = json.loads((out / "summary.json").read_text())
    ep = res["epoch_seconds"]
    steady = ep[1:] if len(ep) > 1 else ep
    return {"variant": variant, "batch": batch, "profiled": profile, "epoch_seconds": ep,
            "steady_s_per_epoch": statistics.median(steady), "process_wall_s": wall}


def profile_table(prof: Path, top: int) -> str:
    import io
    import pstats

    buf = io.StringIO()
    pstats.Stats(str(prof), stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="", help="CIFAR-10 image folder (default: resolved as the demo does)")
    ap.add_argument("--backend", choices=("torch", "jax"), default="torch")
    ap.add_argument("--model", choices=("resnet18", "efficientnet_b0"), default="resnet18")
    ap.add_argument("--device", default="cuda", help="torch device (the JAX runs take JAX's default device)")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[96, 384])
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--train-subset", type=int, default=None)
    ap.add_argument("--width", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compile", choices=("default", "reduce-overhead"), default="reduce-overhead",
                    help="the *-compiled variants' torch.compile mode")
    ap.add_argument("--compile-shapes", choices=("dynamic", "buckets"), default="buckets",
                    help="the *-compiled variants' --compile-shapes")
    ap.add_argument("--profile", action="store_true", help="also run triaccel-fixed under cProfile")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "harness")
    ap.add_argument("--_plain", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._plain is not None:
        sub = argparse.Namespace(**json.loads(a._plain))
        print(json.dumps((plain_loop_jax if sub.backend == "jax" else plain_loop)(sub)))
        return
    if a.epochs < 1:
        ap.error(f"--epochs={a.epochs}: allowed >= 1")
    compiled = [v for v in a.variants if v.endswith("-compiled")]
    if a.backend == "jax" and compiled:
        ap.error(f"--variants {' '.join(compiled)}: torch.compile variants, not with --backend jax (XLA compiles "
                 "every JAX variant)")
    a.out.mkdir(parents=True, exist_ok=True)
    work = a.out / "runs"
    rows = []
    for b in a.batch_sizes:
        for v in a.variants:
            rows.append(run_variant(a, v, b, work, profile=False))
            print(f"{v:>24} bs {b:4d}: epochs {[round(t, 2) for t in rows[-1]['epoch_seconds']]}", flush=True)
    prof_text = None
    if a.profile:
        b = a.batch_sizes[0]
        run_variant(a, "triaccel-fixed", b, work, profile=True)
        prof_text = profile_table(work / f"triaccel-fixed-bs{b}.prof", a.top)
        (a.out / "profile-triaccel-fixed.txt").write_text(prof_text)
    base = {(r["batch"]): r["steady_s_per_epoch"] for r in rows if r["variant"] == "plain"}
    amp = {(r["batch"]): r["steady_s_per_epoch"] for r in rows if r["variant"] == "amp"}
    for r in rows:
        r["ratio_to_plain"] = r["steady_s_per_epoch"] / base[r["batch"]] if r["batch"] in base else None
        r["ratio_to_amp"] = r["steady_s_per_epoch"] / amp[r["batch"]] if r["batch"] in amp else None
    dev_name = a.device
    if a.backend == "jax":
        import jax

        dev_name = jax.devices()[0].device_kind
    elif a.device.startswith("cuda"):
        import torch

        dev_name = torch.cuda.get_device_name(0)
    meta = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "device": dev_name,
            "backend": a.backend, "model": a.model,
            "host": platform.node(), "command": " ".join([os.path.basename(sys.executable), *sys.argv])}
    (a.out / "harness.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    if prof_text is not None:
        print("\n".join(prof_text.splitlines()[:a.top + 12]))
    print(f"\n{a.backend} {a.model}, {meta['device']}  {meta['date']}  steady = median s/epoch over epochs 2..{a.epochs}")
    print(f"{'variant':>24} {'batch':>5} {'s/epoch':>8} {'/plain':>7} {'/amp':>6}")
    for r in rows:
        rp = "" if r["ratio_to_plain"] is None else f"{r['ratio_to_plain']:.3f}"
        ra = "" if r["ratio_to_amp"] is None else f"{r['ratio_to_amp']:.3f}"
        print(f"{r['variant']:>24} {r['batch']:5d} {r['steady_s_per_epoch']:8.3f} {rp:>7} {ra:>6}")


if __name__ == "__main__":
    main()
