"""Activation swap / recompute under a VRAM budget (issue 17): ResNet-152 at 224x224 on synthetic data.

One run, one process, ratios against baselines measured in the same run:

  measure   the cost table at two batches (`ActivationOffload.measure`: per-block CUDA-event times,
            saved-tensor bytes, pinned-host bandwidth) -> CostModel.
  plain     the largest batch B0 whose measured peak (torch.cuda.max_memory_allocated over a step,
            SGD-momentum included) stays within --budget without a plan.
            With --remeasure on (default), the cost tables are then measured again at B0/2 and B0:
            the model that plans extrapolates from where the GPU is busy, not from launch-bound 16/32.
  plan      the largest batch Bp that a plan (triaccel.swap_plan.plan_for_budget) fits into the
            budget; its measured peak is checked and the plan re-made with the budget lowered by the
            model's error until it fits (at most 3 tries, then one grid step down).
  same B    at Bp: no plan and no budget (the device's 80 GB), torch.autograd.graph.save_on_cpu(
            pin_memory=True), and every block under torch.utils.checkpoint (our recompute path):
            samples/s and peak for each.
  joint     triaccel.swap_plan.OffloadPlanner.decide (choose_batch, TriAccelConfig(offload="auto"),
            planning below the budget by the model error measured above): the modelled best of
            (B0, no plan) and (planned batches), measured.
  jax       (--jax) the same net in JAX (weights copied, triaccel.backends.jax.offload) at Bp under the
            torch plan's actions and with no plan: samples/s, compiled step footprint, peak in use.

Prints a table, writes JSON (default benchmarks/results/offload/offload-<device>.json).
GPU (lead):  python3 benchmarks/offload.py --budget 8GiB --jax --out $OUT/offload.json
CPU smoke (bottleneck net + JAX):
             python benchmarks/offload.py --device cpu --depths 1,1,1,1 --base-width 8 --image 32 \
               --classes 10 --budget 4MiB --steps 2 --max-batch 32 --measure-batches 4,8 --lr-batch 8 \
               --min-bytes 0 --jax --out /tmp/offload-b.json
CPU smoke (ResNet-18):
             python benchmarks/offload.py --device cpu --model resnet18 --width 0.125 --image 16 \
               --budget 4MiB --steps 2 --max-batch 32 --measure-batches 4,8 --lr-batch 8 --min-bytes 0 \
               --out /tmp/offload.json
On CPU, peaks are the live bytes of torch storages (`LiveBytes`; host copies of swapped tensors
excluded, as on a device), so the smoke test also runs the peak checks; every op is slower under it.
Progress (tables, each measured batch and peak, each run) is printed as it goes.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from triaccel import TriAccelConfig, parse_bytes
from triaccel.backends.torch.models import create_model
from triaccel.backends.torch.offload import ActivationOffload, CudaBytes, LiveBytes, measure_bandwidth
from triaccel.swap_plan import CostModel, CostTable, OffloadPlanner, SwapPlan, largest_fitting, plan_for_budget, simulate
from _results import write_json

ROOT = Path(__file__).resolve().parents[1]


class Bottleneck(nn.Module):
    """ImageNet ResNet bottleneck: 1x1 -> 3x3 (stride) -> 1x1 (x4), BN after each, projection shortcut."""

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * 4
        self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


class Stem(nn.Module):
    def __init__(self, cout: int = 64) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, cout, 7, 2, 3, bias=False), nn.BatchNorm2d(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.max_pool2d(F.relu(self.bn(self.conv(x))), 3, 2, 1)


class Head(nn.Module):
    def __init__(self, cin: int, classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(x.mean(dim=(2, 3)), 1))


RESNET152 = (3, 8, 36, 3)


def bottleneck_stages(depths: tuple[int, ...], base: int) -> list[tuple[int, int, int]]:
    """(cin, width, stride) of every bottleneck block, in order."""
    out, cin = [], base
    for s, n in enumerate(depths):
        width = base * 2**s
        for i in range(n):
            out.append((cin, width, 2 if (i == 0 and s > 0) else 1))
            cin = width * 4
    return out


def resnet152(classes: int = 1000, depths: tuple[int, ...] = RESNET152, base: int = 64) -> nn.Sequential:
    """ResNet-152 (He et al. 2016; stages 3, 8, 36, 3; 60.2M parameters) as a flat Sequential of
    stem, 50 bottleneck blocks and head: those 52 modules are the swap units. `depths` / `base`
    give smaller bottleneck nets of the same shape (CPU smoke tests)."""
    blocks = bottleneck_stages(depths, base)
    mods: list[nn.Module] = [Stem(base), *(Bottleneck(c, w, s) for c, w, s in blocks)]
    mods.append(Head(blocks[-1][1] * 4, classes))
    return nn.Sequential(*mods)


def jax_bottleneck_net(model: nn.Sequential) -> tuple[list[Callable[..., Any]], list[Any]]:
    """The torch bottleneck net as JAX unit functions fn(params, x) (NHWC, batch-statistics BN,
    activations tagged for offload) and their parameters, copied from the torch weights."""
    import jax.numpy as jnp
    from jax import lax

    from triaccel.backends.jax.offload import tag

    def conv(x: Any, w: Any, stride: int) -> Any:
        k = w.shape[0]
        pad = (k - 1) // 2
        return lax.conv_general_dilated(x, w, (stride, stride), [(pad, pad), (pad, pad)],
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))

    def bn(x: Any, p: tuple[Any, Any]) -> Any:
        m = x.mean((0, 1, 2))
        v = jnp.mean(jnp.square(x - m), (0, 1, 2))
        return (x - m) * lax.rsqrt(v + 1e-5) * p[0] + p[1]

    def w_of(c: nn.Conv2d) -> Any:
        return jnp.asarray(c.weight.detach().cpu().numpy().transpose(2, 3, 1, 0))  # OIHW -> HWIO

    def bn_of(b: nn.BatchNorm2d) -> tuple[Any, Any]:
        return jnp.asarray(b.weight.detach().cpu().numpy()), jnp.asarray(b.bias.detach().cpu().numpy())

    def stem(p: Any, x: Any) -> Any:
        h = jnp.maximum(bn(tag(conv(tag(x), p["w"], 2)), p["bn"]), 0)
        return lax.reduce_window(tag(h), -jnp.inf, lax.max, (1, 3, 3, 1), (1, 2, 2, 1),
                                 [(0, 0), (1, 1), (1, 1), (0, 0)])

    def block(stride: int) -> Callable[..., Any]:
        def f(p: Any, x: Any) -> Any:
            x = tag(x)
            h = tag(jnp.maximum(bn(tag(conv(x, p["w1"], 1)), p["bn1"]), 0))
            h = tag(jnp.maximum(bn(tag(conv(h, p["w2"], stride)), p["bn2"]), 0))
            h = bn(tag(conv(h, p["w3"], 1)), p["bn3"])
            sc = x if "wd" not in p else bn(tag(conv(x, p["wd"], stride)), p["bnd"])
            return jnp.maximum(h + sc, 0)
        return f

    def head(p: Any, x: Any) -> Any:
        return tag(x.mean((1, 2))) @ p["w"] + p["b"]

    units: list[Callable[..., Any]] = []
    params: list[Any] = []
    for m in model:
        if isinstance(m, Stem):
            units.append(stem)
            params.append({"w": w_of(m.conv), "bn": bn_of(m.bn)})
        elif isinstance(m, Bottleneck):
            p = {"w1": w_of(m.conv1), "bn1": bn_of(m.bn1), "w2": w_of(m.conv2), "bn2": bn_of(m.bn2),
                 "w3": w_of(m.conv3), "bn3": bn_of(m.bn3)}
            if m.downsample is not None:
                p["wd"], p["bnd"] = w_of(m.downsample[0]), bn_of(m.downsample[1])
            units.append(block(m.conv2.stride[0]))
            params.append(p)
        else:
            units.append(head)
            params.append({"w": jnp.asarray(m.fc.weight.detach().cpu().numpy().T),
                           "b": jnp.asarray(m.fc.bias.detach().cpu().numpy())})
    return units, params


def jax_runs(bench: "Bench", model: CostModel, grid: list[int], budget: int, cfg: TriAccelConfig,
             steps: int) -> dict[str, Any]:
    """JAX's own largest planned batch under `budget` (actions `--jax-actions`), then the
    same batch with no plan: samples/s (median step), the compiled step's device footprint
    (arguments + outputs + temporaries - aliased) and the device's peak bytes in use. The plan comes
    from the torch cost model; XLA's compiled footprint is its measured peak (before any step
    runs): over the budget, the planner's target drops by the miss and it replans (3 tries)."""
    import jax
    import jax.numpy as jnp

    from triaccel.backends.jax.offload import PlannedSequential

    units, params = jax_bottleneck_net(bench.model)
    seq = PlannedSequential(units, names=bench.off.units)
    acts = tuple(bench.args.jax_actions.split(","))
    planner = OffloadPlanner(cfg, model, budget, batches=grid)
    out: dict[str, Any] = {"jax": jax.__version__, "device": str(jax.devices()[0]), "tries": []}

    def compiled_step(p: SwapPlan | None, batch: int) -> tuple[Any, int | None, Any, Any]:
        f = seq.apply(p)

        def loss(ps: Any, xb: Any, yb: Any) -> Any:
            logp = jax.nn.log_softmax(f(ps, xb))
            return -jnp.mean(jnp.take_along_axis(logp, yb[:, None], axis=1))

        def sgd(ps: Any, mom: Any, xb: Any, yb: Any) -> Any:
            l, g = jax.value_and_grad(loss)(ps, xb, yb)
            mom = jax.tree_util.tree_map(lambda m, gi: 0.9 * m + gi, mom, g)
            return jax.tree_util.tree_map(lambda pi, m: pi - 0.01 * m, ps, mom), mom, l

        x = jax.random.normal(jax.random.PRNGKey(0), (batch, bench.args.image, bench.args.image, 3))
        y = jax.random.randint(jax.random.PRNGKey(1), (batch,), 0, bench.args.classes)
        ps = jax.tree_util.tree_map(jnp.array, params)
        compiled = jax.jit(sgd, donate_argnums=(0, 1)).lower(ps, ps, x, y).compile()
        ma = compiled.memory_analysis()
        footprint = (ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
                     - ma.alias_size_in_bytes) if ma is not None else None
        return compiled, footprint, x, y

    plan, step = None, None
    for _ in range(3):
        if planner.target <= 0:
            break
        j = largest_fitting(grid, lambda b: plan_for_budget(model.at(b), planner.target, actions=acts).fits)
        if j is None:
            break
        plan = plan_for_budget(model.at(grid[j]), planner.target, actions=acts)
        step = compiled_step(plan, plan.batch)
        fp = step[1]
        out["tries"].append({"batch": plan.batch, "target": planner.target, "modelled_peak": plan.peak_bytes,
                             "compiled_bytes": fp})
        log(f"  JAX bs {plan.batch} plan ({plan.describe()}): compiled {nbytes(fp)}, "
            f"modelled {nbytes(plan.peak_bytes)}")
        if fp is None or not planner.observe_peak(plan, int(fp)):
            break
        step = None
    if plan is None or step is None:
        why = (f"; XLA's footprint exceeded the model by the whole budget (target {nbytes(planner.target)})"
               if planner.target <= 0 else "")
        out["plan"] = {"error": f"no JAX plan within {nbytes(budget)} after {len(out['tries'])} tries{why}"}
        return out
    for name, p in (("plan", plan), ("nobudget", None)):
        try:
            compiled, footprint, x, y = step if name == "plan" else compiled_step(None, plan.batch)
            ps = jax.tree_util.tree_map(jnp.array, params)
            mom = jax.tree_util.tree_map(jnp.zeros_like, params)
            times = []
            for k in range(2 + steps):
                t0 = time.perf_counter()
                ps, mom, l = compiled(ps, mom, x, y)
                jax.block_until_ready(l)
                if k >= 2:
                    times.append(time.perf_counter() - t0)
        except Exception as e:  # XLA reports out-of-memory as a generic runtime error
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            continue
        med = statistics.median(times)
        stats = jax.devices()[0].memory_stats() or {}
        out[name] = {"batch": plan.batch, "step_s": med, "samples_per_s": plan.batch / med,
                     "compiled_bytes": footprint, "plan": p.describe() if p is not None else None,
                     "peak_bytes_in_use": stats.get("peak_bytes_in_use") if name == "plan" else None,
                     "plans_built": seq.plans_built}
    return out


def log(msg: str) -> None:
    print(msg, flush=True)


def nbytes(v: int | None) -> str:
    if v is None:
        return "n/a"
    return f"{v / 2**30:.2f} GiB" if v >= 2**30 else f"{v / 2**20:.2f} MiB"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


class Bench:
    """Runs timed SGD steps of one model at a batch under one memory mode."""

    def __init__(self, args: argparse.Namespace, device: torch.device, mem: LiveBytes | None = None) -> None:
        self.args, self.device = args, device
        torch.manual_seed(0)
        if args.model == "resnet152":
            self.model = resnet152(args.classes, args.depths, args.base_width)
        else:
            self.model = create_model("resnet18", num_classes=args.classes, width=args.width, seed=0)
        self.model.to(device)
        if args.channels_last:
            self.model.to(memory_format=torch.channels_last)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.off = ActivationOffload(self.model, min_bytes=args.min_bytes)
        self.cuda = device.type == "cuda"
        # the allocator's counters on CUDA; on CPU the live bytes of storages made under `mem`,
        # which main() enters before building the Bench (weights and optimizer state count)
        self.mem: Any = CudaBytes(device) if self.cuda else mem

    def data(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator(device="cpu").manual_seed(b)
        x = torch.randn(b, 3, self.args.image, self.args.image, generator=g).to(self.device)
        if self.args.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x, torch.randint(0, self.args.classes, (b,), generator=g).to(self.device)

    def loss_fn(self, x: torch.Tensor, y: torch.Tensor) -> Callable[[], torch.Tensor]:
        def f() -> torch.Tensor:
            with torch.autocast(self.device.type, torch.bfloat16, enabled=self.args.amp == "bf16"):
                return F.cross_entropy(self.model(x), y)
        return f

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def run(self, b: int, mode: str, steps: int, plan: SwapPlan | list[str] | None = None) -> dict[str, Any] | None:
        """`steps` timed steps (after 2 untimed) at batch b; mode: plain | plan | save_on_cpu |
        checkpoint. Returns samples/s (median step), peak allocated/reserved bytes, or None on OOM."""
        x, y = self.data(b)
        f = self.loss_fn(x, y)
        if mode == "plan":
            self.off.apply(plan)
        elif mode == "checkpoint":
            self.off.apply(["recompute"] * len(self.off.units))
        else:
            self.off.apply(["keep"] * len(self.off.units))

        def step() -> None:
            self.opt.zero_grad(set_to_none=True)
            if mode == "save_on_cpu":
                with torch.autograd.graph.save_on_cpu(pin_memory=self.cuda):
                    loss = f()
                    loss.backward()
            elif mode == "plan":
                with self.off:
                    loss = f()
                loss.backward()
            else:
                loss = f()
                loss.backward()
            self.opt.step()

        times: list[float] = []
        try:
            for _ in range(2):
                step()
            self.sync()
            self.mem.reset_peak()
            for _ in range(steps):
                t0 = time.perf_counter()
                step()
                self.sync()
                times.append(time.perf_counter() - t0)
        except torch.OutOfMemoryError:
            self.opt.zero_grad(set_to_none=True)
            log(f"  {mode} bs {b}: out of memory")
            return None
        finally:
            self.off.apply(["keep"] * len(self.off.units))
            del x, y, f
            if self.cuda:
                torch.cuda.empty_cache()
        med = statistics.median(times)
        out = {"batch": b, "mode": mode, "step_s": med, "samples_per_s": b / med, "peak_bytes": self.mem.peak()}
        if self.cuda:  # also holds blocks whose device->host copy is still running (record_stream)
            out["reserved_bytes"] = torch.cuda.max_memory_reserved(self.device)
        if steps > 1:
            log(f"  run {mode} bs {b}: {out['samples_per_s']:.1f} samples/s, peak {nbytes(out['peak_bytes'])}")
        return out

    def memory_trace(self, b: int, plan: SwapPlan | None) -> list[tuple[str, int, int]]:
        """(event, unit, bytes allocated) at every unit's forward start/end and backward start over
        one step at b (the last of run()'s three), with `plan` or none."""
        trace: list[tuple[str, int, int]] = []
        self.off.observer = lambda ev, i: trace.append((ev, i, self.mem.allocated()))
        try:
            self.run(b, "plan" if plan is not None else "plain", 1, plan)
        finally:
            self.off.observer = None
        # run() does two untimed steps and one timed one: keep the last step's events
        starts = [k for k, (ev, i, _) in enumerate(trace) if ev == "fwd_start" and i == 0]
        return trace[starts[-1]:] if starts else trace

    def peak(self, b: int, mode: str, plan: Any = None, model_peak: int | None = None) -> int | None:
        """Measured peak bytes of one step at b (None: out of memory); prints it beside `model_peak`."""
        r = self.run(b, mode, 1, plan)
        if r is None:
            return None
        what = "no plan" if plan is None else (f"plan ({plan.describe()})" if isinstance(plan, SwapPlan) else "plan")
        log(f"  peak bs {b:>4} {what}: measured {nbytes(r['peak_bytes'])}, modelled {nbytes(model_peak)}")
        return r["peak_bytes"]


def plot_traces(traces: dict[str, list[tuple[str, int, int]]], budget: int, path: Path | None) -> None:
    """Memory over one step (allocated GiB at each unit event), with and without the plan, as a PNG
    at `path` when matplotlib is installed (the JSON keeps the series either way)."""
    if path is None:
        return
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: memory traces are in the JSON only", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    for name, tr in traces.items():
        ax.plot([v / 2**30 for _, _, v in tr], label=name)
    ax.axhline(budget / 2**30, color="k", ls="--", lw=1, label="budget")
    ax.set_xlabel("unit event (forward starts/ends, then backward starts)")
    ax.set_ylabel("allocated GiB")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("resnet152", "resnet18"), default="resnet152")
    ap.add_argument("--width", type=float, default=1.0, help="resnet18 channel width factor")
    ap.add_argument("--depths", default="3,8,36,3", help="resnet152: blocks per stage (smaller for smoke tests)")
    ap.add_argument("--base-width", type=int, default=64, help="resnet152: stem/first-stage width")
    ap.add_argument("--jax", action="store_true",
                    help="also run the same bottleneck net in JAX at its largest planned batch (JAX's actions, "
                         "same target; resnet152 only), planned and unbudgeted")
    ap.add_argument("--jax-actions", default="keep,recompute",
                    help="actions the JAX plan may use (of PlannedSequential.ACTIONS). Default without swap: on an "
                         "H100 a JAX plan with 2 swapped units compiled to 23.74 GiB against 7.92 GiB modelled "
                         "(docs/results.md)")
    ap.add_argument("--image", type=int, default=224)
    ap.add_argument("--classes", type=int, default=1000)
    ap.add_argument("--budget", default="8GiB")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--amp", choices=("off", "bf16"), default="off", help="off: fp32 (TF32 convs, torch's default)")
    ap.add_argument("--channels-last", action="store_true")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--min-bytes", type=int, default=64 * 2**10, help="saved tensors below this stay on the device")
    ap.add_argument("--multiple", type=int, default=8, help="batch grid step")
    ap.add_argument("--max-batch", type=int, default=512)
    ap.add_argument("--measure-batches", default="16,32",
                    help="two batches for the first cost model (it finds B0); with --remeasure on, the model "
                         "that plans is measured again at B0/2 and B0")
    ap.add_argument("--remeasure", choices=("on", "off"), default="on",
                    help="on: once B0 is measured, the cost tables are taken again at B0/2 and B0 (rounded to "
                         "--multiple), where the step is as busy per sample as at the planned batches. At 16/32 "
                         "ResNet-152's step is launch-bound (bf16, H200, 2026-11-27: 60.4 / 59.3 ms fwd+bwd), "
                         "and a line through them modelled the plan's step at 160.5 ms against 243 ms measured")
    ap.add_argument("--calibrate", choices=("on", "off"), default="off",
                    help="on: each cost table's times scaled so that they sum to a step timed with no hook "
                         "(ActivationOffload.measure(calibrate=True)): the model from the hooked tables ran "
                         "1.30-1.84x the plain step at B0 (benchmarks/offload_model_check.py, 2026-12-07); with it 1.01x at B0, "
                         "still 26-40% under the measured steps at Bp (ResNet-152 bf16, H100, 2026-12-07)")
    ap.add_argument("--lr-batch", type=int, default=32,
                    help="batch the LR is set for (TriAccelConfig.batch_init): the joint choice's LR scale "
                         "is relative to it")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.depths = tuple(int(v) for v in args.depths.split(","))
    device = torch.device(args.device)
    budget = parse_bytes(args.budget, "--budget")
    mb = [int(v) for v in args.measure_batches.split(",")]
    if len(mb) != 2 or mb[0] == mb[1]:
        raise ValueError(f"--measure-batches={args.measure_batches!r}: allowed two distinct batches")
    grid = list(range(args.multiple, args.max_batch + 1, args.multiple))
    if device.type == "cuda":
        return bench_main(args, device, budget, mb, grid, None)
    mem = LiveBytes()
    with mem:  # before the model exists: weights, gradients and optimizer state count
        return bench_main(args, device, budget, mb, grid, mem)


def measure_tables(bench: Bench, batches: Sequence[int], bw: tuple[float, float], n_units: int,
                   calibrate: bool = False) -> list[CostTable]:
    """One cost table per batch (`ActivationOffload.measure`), each logged with its modelled no-plan peak."""
    tables = []
    for b in batches:
        x, y = bench.data(b)
        t = bench.off.measure(bench.loss_fn(x, y), b, bandwidth=bw, memory=bench.mem, calibrate=calibrate)
        tables.append(t)
        log(f"table bs {b}: static {nbytes(t.static_bytes)}, saved {nbytes(t.saved_bytes)} (resident "
            f"{nbytes(t.resident_bytes)}), transient {nbytes(t.transient_bytes)}, no-plan peak "
            f"{nbytes(simulate(t, ['keep'] * n_units).peak_bytes)}, fwd+bwd "
            f"{sum(u.forward_ms + u.backward_ms for u in t.layers):.1f} ms")
        bench.opt.zero_grad(set_to_none=True)
        del x, y
    return tables


def table_dict(t: CostTable) -> dict[str, Any]:
    return {"batch": t.batch, "static_bytes": t.static_bytes, "transient_bytes": t.transient_bytes,
            "other_ms": t.other_ms, "layers": [u.__dict__ for u in t.layers]}


def bench_main(args: argparse.Namespace, device: torch.device, budget: int, mb: list[int], grid: list[int],
        mem: LiveBytes | None) -> dict[str, Any]:
    """The benchmark proper (main's steps 1-4, table, JSON); mem: the CPU byte counter or None."""
    t_start = time.perf_counter()
    log(f"offload benchmark: {args.model} {args.image}x{args.image}, {args.amp}, budget {nbytes(budget)}, "
        f"{device_name(device)}")
    bench = Bench(args, device, mem)
    if mem is not None:
        mem.ignore = lambda: bench.off.host_copying  # a swap's host copy is not device memory
    L = len(bench.off.units)

    # 1. cost model from two measured batches
    bw = measure_bandwidth(device)
    log(f"bandwidth: d2h {bw[0] / 1e9:.1f} GB/s, h2d {bw[1] / 1e9:.1f} GB/s")
    bench.run(mb[0], "plain", 1)  # optimizer state exists before the tables count static bytes
    tables = measure_tables(bench, mb, bw, L, args.calibrate == "on")
    model = CostModel(tuple(tables))

    # 2. largest batch without a plan (modelled, then checked by measurement)
    keep = ["keep"] * L
    fit_model = [b for b in grid if simulate(model.at(b), keep).peak_bytes <= budget]
    b0 = fit_model[-1] if fit_model else grid[0]  # the model may be conservative: measure the smallest
    log(f"largest batch without a plan: modelled {fit_model[-1] if fit_model else None}; measuring")
    seen: dict[int, int | None] = {}

    def plain_peak(b: int) -> int | None:
        if b not in seen:
            seen[b] = bench.peak(b, "plain", model_peak=simulate(model.at(b), keep).peak_bytes)
        return seen[b]

    while b0 is not None:
        p = plain_peak(b0)
        if p is not None and p <= budget:
            nxt = b0 + args.multiple  # the model may be conservative: try one step up
            q = plain_peak(nxt) if nxt <= args.max_batch else None
            if q is not None and q <= budget:
                b0 = nxt
                continue
            break
        b0 = b0 - args.multiple if b0 > args.multiple else None
    log(f"B0 = {b0}")
    plain_b0 = bench.run(b0, "plain", args.steps) if b0 else None
    first_tables = tables
    if args.remeasure == "on" and b0 is not None:
        half = max(b0 // 2 // args.multiple * args.multiple, args.multiple)
        if half < b0 and half > max(mb):
            tables = measure_tables(bench, [half, b0], bw, L, args.calibrate == "on")
            model = CostModel(tuple(tables))
        else:
            log(f"cost tables kept: B0/2 = {half} is not above the first measurements' {max(mb)}")

    # 3. largest batch with a plan, checked by measurement
    cfg = TriAccelConfig(offload="auto", batch_init=args.lr_batch, batch_min=args.multiple, batch_max=args.max_batch,
                         batch_multiple=args.multiple)
    planner = OffloadPlanner(cfg, model, budget, batches=grid)

    def planned(b: int) -> tuple[SwapPlan, int | None, list[dict[str, Any]]]:
        """Plan b, run it, and replan below the budget while the measured peak breaks it (3 tries)."""
        tries: list[dict[str, Any]] = []
        for _ in range(3):
            plan = planner.plan(b)  # ValueError naming the peaks once the model misses by the budget
            if not plan.fits:
                log(f"  bs {b}: no plan fits target {nbytes(planner.target)}")
                return plan, None, tries
            p = bench.peak(b, "plan", plan, model_peak=plan.peak_bytes)
            tries.append({"target": planner.target, "modelled_peak": plan.peak_bytes, "measured_peak": p,
                          "swap": plan.count("swap"), "recompute": plan.count("recompute"),
                          "recompute_swap": plan.count("recompute_swap")})
            if p is None:
                return plan, None, tries
            if not planner.observe_peak(plan, p):
                return plan, p, tries
            log(f"  bs {b}: measured {nbytes(p)} > budget; the model missed by {nbytes(p - plan.peak_bytes)}: "
                f"planning for {nbytes(planner.target)}")
        return plan, None, tries

    top = largest_fitting(grid, lambda b: plan_for_budget(model.at(b), budget).fits)
    bp, plan_bp, peak_bp, replans = None, None, None, []
    log(f"largest batch with a plan: modelled {None if top is None else grid[top]}; measuring")
    i = top
    while i is not None and i >= 0:
        try:
            plan, p, tries = planned(grid[i])
        except ValueError as e:
            raise SystemExit(f"offload benchmark: {e}") from e
        replans.append({"batch": grid[i], "tries": tries})
        if p is not None:
            bp, plan_bp, peak_bp = grid[i], plan, p
            break
        i -= 1
    log(f"Bp = {bp}")
    rows: dict[str, Any] = {"plain_b0": plain_b0}
    if bp is not None:
        rows["plan_bp"] = bench.run(bp, "plan", args.steps, plan_bp)
        rows["nobudget_bp"] = bench.run(bp, "plain", args.steps)
        rows["save_on_cpu_bp"] = bench.run(bp, "save_on_cpu", args.steps)
        rows["checkpoint_bp"] = bench.run(bp, "checkpoint", args.steps)

    # 4. joint choice (modelled), measured at its batch
    try:
        choice = planner.decide()  # plans for the budget less the model error seen above
        rows["joint"] = bench.run(choice.batch, "plan" if choice.plan.active else "plain", args.steps, choice.plan)
    except ValueError as e:
        choice = None
        rows["joint"] = None
        print(f"joint choice: {e}", file=sys.stderr)

    traces: dict[str, Any] = {}
    if bp is not None:
        traces = {"plan_bp": bench.memory_trace(bp, plan_bp), "nobudget_bp": bench.memory_trace(bp, None)}
        plot_traces(traces, budget, Path(args.out).with_suffix(".png") if args.out else None)

    if args.jax and bp is not None and args.model == "resnet152":
        if bench.cuda:
            torch.cuda.empty_cache()
        # JAX has no recompute_swap: its own largest batch whose plan fits, from the same cost model
        rows["jax"] = jax_runs(bench, model, grid, budget, cfg, args.steps)

    # table
    def fmt(r: dict[str, Any] | None, base: dict[str, Any] | None) -> str:
        if r is None:
            return "OOM / none"
        pk = r.get("peak_bytes")
        ratio = f"{r['samples_per_s'] / base['samples_per_s']:.2f}x" if base else "-"
        return (f"bs {r['batch']:>4}  {r['samples_per_s']:8.1f} samples/s  {ratio:>6}  "
                f"peak {nbytes(pk)}")

    base = rows.get("nobudget_bp")
    print(f"\nResNet ({args.model}) {args.image}x{args.image}, {args.amp}, budget {nbytes(budget)}, "
          f"{device_name(device)}; d2h {bw[0] / 1e9:.1f} GB/s, h2d {bw[1] / 1e9:.1f} GB/s")
    print(f"largest batch without plan B0 = {b0}; with plan Bp = {bp}"
          + (f" ({bp / b0:.2f}x)" if bp and b0 else ""))
    if plan_bp is not None:
        print(f"plan at Bp: {plan_bp.describe()} of {L} units; modelled peak {nbytes(plan_bp.peak_bytes)}, "
              f"measured {nbytes(peak_bp)}; modelled step "
              f"{plan_bp.step_ms:.1f} ms (exposed {plan_bp.exposed_ms:.1f} ms)")
    print("ratios: samples/s against 'no budget' at Bp")
    for key, label in (("plain_b0", "no plan, B0"), ("plan_bp", "plan, Bp"), ("nobudget_bp", "no budget, Bp"),
                       ("save_on_cpu_bp", "save_on_cpu(pin), Bp"), ("checkpoint_bp", "checkpoint all, Bp"),
                       ("joint", "joint choice")):
        print(f"  {label:<22} {fmt(rows.get(key), base)}")
    if "jax" in rows:
        j, tp = rows["jax"], rows.get("plan_bp")
        for name, label in (("plan", "JAX plan"), ("nobudget", "JAX no budget")):
            r = j.get(name, {})
            if "error" in r or not r:
                print(f"  {label:<22} {r.get('error', 'not run')}")
                continue
            vs = (f"; JAX / torch samples/s (both planned, {r['batch']} vs {tp['batch']}) "
                  f"{r['samples_per_s'] / tp['samples_per_s']:.2f}x" if (tp and name == "plan") else "")
            print(f"  {label:<22} bs {r['batch']:>4}  {r['samples_per_s']:8.1f} samples/s  compiled "
                  f"{nbytes(r['compiled_bytes'])}, peak in use {nbytes(r['peak_bytes_in_use'])}{vs}")
    if choice is not None:
        print(f"joint choice: batch {choice.batch}, plan {'on' if choice.plan.active else 'off'}, "
              f"lr x{choice.lr_scale:.2f},"
              f" modelled {choice.goodput:.1f} samples/s (no-plan B0 modelled "
              f"{choice.baseline.samples_per_s if choice.baseline else float('nan'):.1f})")

    result = {
        "issue": 17, "benchmark": "offload", "model": args.model, "image": args.image, "amp": args.amp,
        "budget_bytes": budget, "device": device_name(device), "torch": torch.__version__,
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "bandwidth_bytes_per_s": {"d2h": bw[0], "h2d": bw[1]},
        "cost_tables": [table_dict(t) for t in tables],
        "first_cost_tables": [table_dict(t) for t in first_tables],
        "b0": b0, "bp": bp, "bp_over_b0": (bp / b0) if bp and b0 else None,
        "plan_bp": plan_bp.to_dict() if plan_bp else None, "measured_peak_bp": peak_bp, "replans": replans,
        "model_margin_bytes": planner.margin,
        "memory_traces": traces, "runs": rows, "joint": choice.to_dict() if choice else None,
        "peaks_are": "measured (max_memory_allocated)" if bench.cuda else "measured (LiveBytes: cpu storages)",
        "wall_s": time.perf_counter() - t_start,
    }
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / "offload" / (
        f"offload-{args.model}-{device_name(device).split(' ')[0].lower()}.json")
    write_json(result, out, indent=1)
    return result


if __name__ == "__main__":
    main()
