"""Framework-free pieces of the CIFAR example: run options, the JSONL run log, the LR schedule."""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from triaccel import Controller, Precision, TriAccelConfig

LEVERS = ("precision", "curvature", "batch")
# The demo's default levers: the curvature LR scaling lowered accuracy in 3-seed ablations
# (docs/results.md), so it is opt-in (`--levers precision,curvature,batch`).
DEFAULT_LEVERS = ("precision", "batch")
# the choices of triaccel.backends.torch.models.uses_channels_last, here so that a JAX run's option
# parsing does not import torch
MEMORY_FORMATS = ("auto", "channels_last", "contiguous")


def bucket_ladder(batch: int, lo: int, hi: int) -> tuple[int, ...]:
    """Batch sizes batch * 2^i within [lo, hi], and `hi` itself: the elastic batch moves one rung per
    decision and can reach `hi` (--batch-max) when it is not a doubling of `batch` (96 -> 512).

    Doubling keeps the rungs few: under JAX every rung is one compilation of the step (seconds for
    ResNet-18 on an H200)."""
    down = [batch >> i for i in range(1, batch.bit_length()) if batch % (1 << i) == 0 and batch >> i >= lo]
    up = [batch << i for i in range(0, 32) if batch << i <= hi]
    return tuple(sorted({*down, *up, *([hi] if hi >= batch else [])}))


def without_rung_below_top(ladder: Sequence[int], start: int) -> tuple[int, ...]:
    """`ladder` (sorted) without the sizes above `start` (the first batch, kept) and strictly between
    half its top and its top (96/192/384/512 -> 96/192/512): a climb from `start` then visits one size
    fewer (`RunOptions.triaccel_config` says when the demo does)."""
    top = ladder[-1]
    return tuple(b for b in ladder if b <= start or b == top or 2 * b <= top)


# TriAccelConfig fields the demo sets from its own flags (--set refuses them)
FLAG_FIELDS = {"batch_init": "--batch", "batch_max": "--batch-max", "memory_budget": "--budget",
               "lr_rule": "--lr-rule", "curvature": "--curvature", "adaptive_precision": "--levers",
               "elastic_batch": "--levers", "base_precision": "--method", "t_ctrl": "--t-ctrl",
               "warmup_steps": "--warmup-steps", "offload": "--offload"}


@dataclass
class RunOptions:
    """Everything one training run needs (set by the command line; see train.py --help)."""

    backend: str = "torch"
    model: str = "resnet18"
    dataset: str = "cifar10"
    method: str = "triaccel"          # fp32 | amp | triaccel
    epochs: int = 10
    data: str = ""
    seed: int = 0
    batch: int = 96                   # initial (triaccel) or static (fp32/amp) batch, samples
    lr: float = 0.1                   # SGD lr at `batch` samples
    momentum: float = 0.9
    weight_decay: float = 5e-4
    width: float = 1.0
    image_size: int = 32              # EfficientNet-B0 also runs at the paper's 224
    train_subset: int | None = None   # first N train images (CPU runs)
    test_subset: int | None = None
    budget: str | None = None         # memory budget, e.g. "4GiB"
    offload: str = "off"              # triaccel: "auto" = batch + activation swap plan together (torch)
    batch_max: int = 512             # see train.py --batch-max
    lr_rule: str = "linear"
    curvature: str = "fisher"
    levers: tuple[str, ...] = DEFAULT_LEVERS  # triaccel ablations: which levers are on
    warmup_epochs: float = 1.0        # linear LR warm-up over this many epochs' samples, every method
    t_ctrl: int = 50
    warmup_steps: int = 100
    device: str = "auto"
    out: str = ""
    progress: bool = True
    compile_cache: str | None = None  # JAX: persistent compilation cache folder; None: <cache>/jax; "off"
    compile_ahead: bool | str = True     # JAX: compile the likely next step variants on a background thread (True; "after": not beside the loop's own compilations); not local
    in_flight: str = "on"             # JAX: on | off: one step left running while the host prepares the next (train.py)
    fused_step: str = "auto"          # JAX: auto | on | off: a plain step as one program, gradient and update (train.py)
    gc_freeze: str = "on"             # JAX: on | off: long-lived objects out of the garbage collector's scans (HeapFreeze)
    batch_stats: str = "per-device"   # several devices: per-device | global (JAX) BatchNorm statistics (train.py)
    bn_parts: int = 1                 # torch: BatchNorm statistics over this many slices of each micro-batch (train.py)
    bn_mask: str = "auto"             # JAX: on = BatchNorm statistics over the real samples only, not padding rows (train.py)
    augment_rng: str = "stream"       # torch: stream (a generator per rank) | sample (keyed by seed, epoch, index)
    pad_floor: str = "auto"           # JAX: auto | off | largest | N: pad micro-batches at least to this bucket (train.py)
    cudnn_benchmark: bool = False     # torch on CUDA: cuDNN autotuning (see train.py --cudnn-benchmark)
    memory_format: str = "auto"       # torch on CUDA: channels_last | contiguous | auto (see channels_last())
    compile: str = "off"              # torch: torch.compile of the model, off | default | reduce-overhead (modes) | cudagraphs (backend) | graphs (CUDA graphs per bucket, no compiler)
    graph_halves: str = "on"          # torch, --compile graphs, triaccel: on | off: noise measurements' half batches captured too
    graph_warmup: str = "eager"       # torch, --compile graphs: eager | 3 | 1: passes before each capture (eager: the shape's first step)
    triton_warmup: str = "on"         # torch, triaccel, CUDA: on | first-step | off: Triton's start-up and the kernel's compilation on a thread (the demo's --triton-warmup auto resolves to first-step with --compile off / graphs)
    compile_shapes: str = "dynamic"   # torch, compiled: dynamic (one graph per policy) | buckets (one per bucket)
    inject_oom_every: int = 0         # test-only (benchmarks/soak.py): see OOMInjector; 0 = off
    trace_steps: tuple[int, int] | None = None  # (start, stop): profile optimizer steps [start, stop) (StepTrace)
    extra: dict[str, Any] = field(default_factory=dict)
    xla_options: dict[str, Any] = field(default_factory=dict)   # JAX: XLA compiler options, every program

    def check_extra(self) -> None:
        """`extra` (--set) names TriAccelConfig fields the demo does not set from a flag of its own:
        ValueError naming the field and the flag to use (or that it is no field at all)."""
        fields = {f.name for f in dataclasses.fields(TriAccelConfig)}
        for key in self.extra:
            if key in FLAG_FIELDS:
                raise ValueError(f"--set {key}=...: the demo sets {key} from {FLAG_FIELDS[key]}; use that flag")
            if key not in fields:
                raise ValueError(f"--set {key}=...: not a TriAccelConfig field (allowed: "
                                 f"{', '.join(sorted(fields - set(FLAG_FIELDS)))})")

    def channels_last(self, device_type: str) -> bool:
        """torch: whether the model and its inputs use the channels_last memory format
        (`triaccel.backends.torch.models.uses_channels_last`; "auto": not for EfficientNet)."""
        from triaccel.backends.torch.models import uses_channels_last

        return uses_channels_last(self.model, self.memory_format, device_type)

    def triaccel_config(self, shards: int = 1) -> TriAccelConfig:
        """The controller's config for this run (all levers off for fp32/amp: a static batch).
        shards: the ranks or devices each batch is split across; the ladder keeps the rungs that
        split evenly (e.g. 512 is dropped on 3 GPUs). Buckets given with --set are kept as given."""
        if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
            raise ValueError(f"shards={shards!r}: allowed an integer >= 1 (ranks or devices)")
        on = set(self.levers) if self.method == "triaccel" else set()
        # Few precision decisions and few batch sizes (under JAX each new dtype assignment and
        # each new batch shape is a compilation).
        # Curvature on the same boundaries as precision: its promotions change the policy too.
        # A static method's short last step as a plain loop's ("batch": its samples' mean at the batch's LR):
        # the weighted one measured no better for AMP (EfficientNet-B0 bs 512, seeds 0-2, H200 2026-11-28:
        # 73.05% mean weighted, 73.53% plain; docs/results.md). --set short_step_lr=... overrides.
        static = {} if self.method == "triaccel" else {"short_step_lr": "batch"}
        # torch: every micro-batch size a run visits costs its first eager step (cuDNN's and the kernels'
        # set-up for the shape) and, graphed, a capture (EfficientNet-B0: 0.4-0.5 s per size); the
        # ladder without a rung between hi/2 and hi, and the noise step at two micro-batches of the
        # decided size ("double", no half sizes), visit 96/192/512 instead of 48/96/192/256/384/512:
        # EfficientNet-B0 1.06-1.14x AMP bs 512's wall against 1.13-1.23x, ResNet-18 0.98x AMP bs 192's
        # on the mean of six seeds against 1.02x (H200, graphed, 2026-12-02, docs/results.md). JAX keeps
        # the rung: under its pad floor every step runs at the top's program, a smaller
        # rung costs as much as the top and the climb through 192 to 512 is slower (ResNet-18 seed 0:
        # 1.21x AMP bs 192's wall against 1.11x, same call). JAX measures the noise as the library does,
        # from a step's two halves: "steps" (a half-batch step against the full steps around it, its default
        # from 2026-12-04) pairs norms whose BatchNorm statistics span different batches, which biases its
        # estimate on EfficientNet-B0 (CPU, benchmarks/noise_bn_bias.py: |G|^2 < 0 against the halves' 35),
        # and on the GPU it ended under AMP bs 512's accuracy on seed 0 (71.65% against 72.68%; the halves
        # 76.88% and 77.08% in two runs) at 1.027x / 1.138x its wall (the halves 1.032x / 1.079x); its
        # compilation is now no shorter (H100, 2026-12-07, docs/results.md). On ResNet-18 it was faster
        # (0.82-0.99x the halves' wall, same accuracy): --set noise_split=steps.
        fewer_sizes = self.method == "triaccel" and self.backend == "torch"
        split = "double" if self.method == "triaccel" and self.backend == "torch" else None
        sizes = {"noise_split": split} if split else {}
        self.check_extra()
        extra = {"batch_min": 8, "t_precision": 10 * self.t_ctrl, "t_curv": 10 * self.t_ctrl,
                 "offload": self.offload if self.method == "triaccel" else "off", **static, **sizes,
                 **self.extra}
        if "batch_buckets" not in extra:
            ladder = tuple(b for b in bucket_ladder(self.batch, extra["batch_min"], max(self.batch_max, self.batch))
                           if b % shards == 0)
            extra["batch_buckets"] = without_rung_below_top(ladder, self.batch) if fewer_sizes else ladder
        return TriAccelConfig(
            batch_init=self.batch, batch_max=max(self.batch_max, self.batch),
            memory_budget=self.budget, lr_rule=self.lr_rule if "batch" in on else "none",
            curvature=self.curvature if "curvature" in on else "off",
            adaptive_precision="precision" in on, elastic_batch="batch" in on,
            base_precision="fp32" if self.method == "fp32" else "bf16",
            t_ctrl=self.t_ctrl, warmup_steps=self.warmup_steps, **extra)


class OOMInjector:
    """Test-only fault injection (`--inject-oom-every N`, used by benchmarks/soak.py): the first
    micro-batch of every N-th optimizer step (steps N-1, 2N-1, ...) raises the framework's
    out-of-memory error before its forward pass, so that the elastic step has to survive it as it
    would a real one (shrink, replay the samples). `error(message)` builds that exception."""

    def __init__(self, every: int, error: Callable[[str], BaseException]) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(f"every={every!r}: allowed an integer >= 0 (optimizer steps; 0 = off)")
        self.every, self.error = every, error
        self.injected = 0
        self._armed = False

    def arm(self, step: int) -> None:
        """Call before optimizer step `step` (0-based): fire() raises once during it if chosen."""
        self._armed = self.every > 0 and (step + 1) % self.every == 0

    def fire(self) -> None:
        """Call at the start of each micro-batch's loss; raises on the first one of an armed step."""
        if self._armed:
            self._armed = False
            self.injected += 1
            raise self.error(f"RESOURCE_EXHAUSTED: out of memory injected by --inject-oom-every="
                             f"{self.every} (#{self.injected}, test-only)")


class StepTrace:
    """The backend's profiler over optimizer steps [start, stop) (`--trace-steps START:STOP`): call
    `at(step)` before each step and `close()` after the loop. `begin()` starts the profiler;
    `end()` waits for the device and writes the trace (under the run's out/trace). A run shorter
    than `stop` steps is ended by `close()`. annotate(step): an optional context manager that marks
    each traced step's host span in the trace, named "step N" (`benchmarks/trace_summary.py --gaps`
    attributes the device's idle time to steps by it); entered at `at(step)`, left at the next."""

    def __init__(self, steps: tuple[int, int] | None, begin: Callable[[], None], end: Callable[[], None],
                 annotate: Callable[[int], Any] | None = None) -> None:
        if steps is not None and not 0 <= steps[0] < steps[1]:
            raise ValueError(f"steps={steps!r}: allowed (start, stop) with 0 <= start < stop (optimizer steps)")
        self.steps, self._begin, self._end, self._annotate = steps, begin, end, annotate
        self.active = False
        self._mark: Any = None

    def at(self, step: int) -> None:
        if self.steps is None:
            return
        if step == self.steps[0]:
            self._begin()
            self.active = True
        elif step == self.steps[1] and self.active:
            self.close()
        if self.active and self._annotate is not None:
            self._leave()
            self._mark = self._annotate(step)
            self._mark.__enter__()

    def _leave(self) -> None:
        if self._mark is not None:
            mark, self._mark = self._mark, None
            mark.__exit__(None, None, None)

    def close(self) -> None:
        if self.active:
            self.active = False
            self._leave()
            self._end()


class HeapFreeze:
    """Keeps a training loop's long-lived Python objects (models, traced programs, compiled
    executables' wrappers: ~0.3-0.5 M objects in a JAX run) out of the cyclic garbage collector's
    full collections, which otherwise rescan all of them every few dozen steps: each step's
    arrays outlive a young collection (a step stays in flight), so full collections keep coming.
    Its gain is not on record (the session that built it measured the collector's time per step with
    benchmarks/device/jax_drift_probe.py, but its results were lost): `--gc-freeze on|off` is the A/B.

    `freeze()` (after set-up, after each epoch) collects once and moves every object alive then to
    the permanent generation (`gc.freeze`); leaving the `with` block unfreezes them, so the cycles
    among them that died meanwhile are collected then. Disabled: both do nothing.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def freeze(self) -> None:
        if self.enabled:
            gc.collect()
            gc.freeze()

    def __enter__(self) -> "HeapFreeze":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            gc.unfreeze()


def lr_factor(seen: int, total: int, warmup: int) -> float:
    """LR multiplier after `seen` of `total` samples: linear warm-up over the first `warmup` samples
    (from 1/warmup-of-a-sample, never 0), then cosine decay to 0 over the rest. Samples, not
    steps, so it does not depend on the (elastic) batch size."""
    if seen < warmup:
        return (seen + 1) / warmup
    progress = (seen - warmup) / max(total - warmup, 1)
    return 0.5 * (1.0 + math.cos(math.pi * min(max(progress, 0.0), 1.0)))


class RunLog:
    """JSON lines: one "run" header, "step" and "epoch" records, and the controller's "decision"s."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = self.path.open("w")
        self._decisions_written = 0
        self.t0 = time.perf_counter()

    def write(self, kind: str, **record: Any) -> None:
        self._f.write(json.dumps({"type": kind, **record}, default=_json_default) + "\n")

    def sync_decisions(self, ctl: Controller) -> None:
        """Append the controller's telemetry records not written yet."""
        recs = ctl.telemetry.records
        for r in recs[self._decisions_written:]:
            self.write("decision", **r)
        self._decisions_written = len(recs)
        self._f.flush()

    def end_epoch(self, ctl: Controller, epoch: int, records: list[dict[str, Any]], step_losses: list[float],
                  test_acc: float, seconds: float, steps: int, flop_share: dict[str, float] | None = None) -> None:
        """Write the epoch's step records (with their losses), its summary and new decisions; print it.
        flop_share: conv/linear FLOPs per precision so far (`triaccel.flops.FlopShare.shares`)."""
        for r, loss in zip(records, step_losses):
            self.write("step", loss=loss, **r)
        train_loss = sum(step_losses) / len(step_losses)
        batch = ctl.decision.batch_size
        self.write("epoch", epoch=epoch + 1, train_loss=train_loss, test_acc=test_acc, seconds=seconds,
                   steps=steps, batch_size=batch, b_noise=ctl.b_noise, flop_share=flop_share)
        self.sync_decisions(ctl)
        noise = f"  B_noise {ctl.b_noise:.0f}" if ctl.b_noise is not None else ""
        sixteen = f"  16-bit FLOPs {100 * (flop_share['fp16'] + flop_share['bf16']):.1f}%" if flop_share else ""
        print(f"epoch {epoch + 1}: loss {train_loss:.4f}  test acc {100 * test_acc:.2f}%  {seconds:.1f}s  "
              f"batch {batch}{noise}{sixteen}", flush=True)

    def close(self) -> None:
        self._f.close()


def _json_default(x: Any) -> Any:
    if isinstance(x, (np.integer, np.floating)):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"not JSON-serialisable: {type(x).__name__}")


def precision_record(method: str, specs: Any) -> tuple[Precision, ...]:
    """The fixed per-layer precisions of a plain run (for its FLOP share): FP32 everywhere under
    "fp32"; under "amp" bf16 for every layer but the norms (autocast runs them in FP32)."""
    if method == "fp32":
        return tuple(Precision.FP32 for _ in specs)
    return tuple(Precision.FP32 if s.kind == "norm" else Precision.BF16 for s in specs)


def options_record(opts: RunOptions) -> dict[str, Any]:
    d = asdict(opts)
    d["levers"] = list(opts.levers)
    return d


def median_last(xs: list[float], n: int = 5) -> float:
    """Median of the last n values (the paper's s/epoch)."""
    return float(np.median(xs[-n:])) if xs else float("nan")
