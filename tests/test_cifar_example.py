"""The CIFAR demo end to end on a few real images (CPU): both backends, all methods run and log."""

import json
from pathlib import Path

import numpy as np
import pytest

from examples.cifar import train

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "cifar10-jpeg"
pytestmark = pytest.mark.skipif(not DATA.exists(), reason=f"CIFAR-10 image folder not found at {DATA}")


def _run(tmp_path, *extra):
    args = ["--data", str(DATA), "--epochs", "1", "--train-subset", "192", "--test-subset", "64",
            "--batch", "32", "--width", "0.125", "--t-ctrl", "2", "--warmup-steps", "2", "--no-progress",
            "--device", "cpu", "--out", str(tmp_path / "run"), *extra]
    return train.run(train.parse_args(args)), tmp_path / "run"


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_triaccel_demo_runs_and_writes_log_and_plots(tmp_path, backend):
    # JAX: the ladder topped at 64 (the batch can still grow, 32 -> 64): fewer buckets up the ladder
    # compiled ahead in the background, each a ResNet-18 step compilation on the 2 CI cores
    top = ["--batch-max", "64"] if backend == "jax" else []
    summary, out = _run(tmp_path, "--backend", backend, "--method", "triaccel", "--set", "t_curv=3",
                        "--set", "b_curv=8", "--set", "min_dwell=0", "--set", "noise_beta=0",
                        "--levers", "precision,curvature,batch", *top)
    rows = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["type"] == "step"]
    assert 0.0 <= summary["final_acc"] <= 1.0 and summary["steps"] == len(steps)
    # the batch may grow; the noise is measured (JAX: a step's halves inside its update)
    half = [r for r in steps if r["samples"] == -(-r["batch_size"] // 2)]
    assert len(steps) - len(half) <= 6 and summary["report"]["noise_measurements"] >= 2
    assert sum(r["samples"] for r in steps) == 192                                     # every image once
    share = summary["flop_share"]        # curvature promotions move some layers to FP32 for a while
    assert "b_noise" in summary and sum(share.values()) == pytest.approx(1.0) and share["bf16"] > 0.5
    kinds = {r["type"] for r in rows}
    assert {"run", "layers", "step", "epoch", "decision"} <= kinds
    decisions = [r for r in rows if r["type"] == "decision"]
    layers = next(r for r in rows if r["type"] == "layers")["names"]
    assert all(len(d["precisions"]) == len(layers) for d in decisions)
    assert any(x is not None for d in decisions for x in d["lambda_max"])     # curvature observed
    assert {p.name for p in out.glob("*.png")} >= {"precision_heatmap.png", "batch_memory.png",
                                                   "loss_accuracy.png", "lambda_max.png", "flop_share.png"}
    assert json.loads((out / "summary.json").read_text())["options"]["backend"] == backend
    if backend == "jax":   # no pad floor on a CPU, so --bn-mask auto leaves every row in the statistics
        assert summary["pad_floor"] is None and summary["bn_masked"] is False


@pytest.mark.parametrize("method", ["amp", "triaccel"])
def test_torch_demo_with_the_cudagraphs_backend(tmp_path, method):
    """--compile cudagraphs: torch.compile's 'cudagraphs' backend (dynamo and AOT autograd, the model's
    own kernels; on a CPU the graphs are skipped, the compiled forward and backward still run): every
    image once, the compiled graphs counted."""
    extra = ["--budget", "4GiB", "--set", "min_dwell=0"] if method == "triaccel" else []
    summary, out = _run(tmp_path, "--backend", "torch", "--method", method, "--compile", "cudagraphs", *extra)
    steps = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines() if '"type": "step"' in x]
    assert sum(r["samples"] for r in steps) == 192 and summary["compiled_graphs"] >= 1
    assert 0.0 <= summary["final_acc"] <= 1.0


def test_torch_demo_with_shape_graphs_off_cuda_runs_eagerly(tmp_path):
    """--compile graphs (ShapeGraphs, one CUDA-graph capture per bucket; GPU-tested in
    test_torch_shape_graphs.py): on a CPU every step runs the module eagerly, every image once, no
    capture; --compile-shapes dynamic is refused."""
    summary, out = _run(tmp_path, "--backend", "torch", "--method", "triaccel", "--compile", "graphs",
                        "--budget", "4GiB", "--set", "min_dwell=0", "--set", "noise_split=halves")
    steps = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines() if '"type": "step"' in x]
    assert sum(r["samples"] for r in steps) == 192 and summary["compiled_graphs"] == 0
    assert summary["options"]["compile_shapes"] == "buckets"
    # the set-up's phases, seconds from its start, in order (no Triton thread off CUDA)
    ph = summary["setup_phases"]
    assert list(ph) == ["model", "arrays", "loader", "wrapped", "flops"]
    assert list(ph.values()) == sorted(ph.values()) and ph["flops"] <= summary["setup_seconds"]
    with pytest.raises(SystemExit):
        train.parse_args(["--data", str(DATA), "--compile", "graphs", "--compile-shapes", "dynamic"])
    # the default noise split (torch: "double", a noise step's micro-batches at the decided size): the
    # ladder from the first batch up alone, no half sizes (with torch's capture recipe here, 3 discarded
    # passes, instead of the default eager first step); as with --graph-halves off under "halves"
    off, _ = _run(tmp_path / "off", "--backend", "torch", "--method", "triaccel", "--compile", "graphs",
                  "--budget", "4GiB", "--set", "min_dwell=0", "--graph-warmup", "3")
    ladder = off["graphed_sizes"]
    assert ladder[0] == 32 and summary["graphed_sizes"] == sorted(set(ladder) | {-(-b // 2) for b in ladder})
    assert (off["options"]["graph_warmup"], summary["options"]["graph_warmup"]) == ("3", "eager")
    for only_graphed in (["--graph-halves", "off"], ["--graph-warmup", "1"]):
        with pytest.raises(SystemExit):   # only with --compile graphs
            train.parse_args(["--data", str(DATA), *only_graphed])
    # --triton-warmup (torch, triaccel, CUDA only: on a CPU no thread starts): auto unless set, which is
    # first-step where the first step is eager (--compile off / graphs), on otherwise
    assert train.parse_args(["--data", str(DATA)]).triton_warmup == "first-step"
    assert train.parse_args(["--data", str(DATA), "--compile", "graphs"]).triton_warmup == "first-step"
    assert train.parse_args(["--data", str(DATA), "--compile", "default"]).triton_warmup == "on"
    assert train.parse_args(["--data", str(DATA), "--triton-warmup", "on"]).triton_warmup == "on"
    assert train.parse_args(["--data", str(DATA), "--triton-warmup", "off"]).triton_warmup == "off"
    with pytest.raises(SystemExit):
        train.parse_args(["--data", str(DATA), "--triton-warmup", "runtime"])
    assert train.parse_args(["--data", str(DATA), "--compile", "graphs", "--triton-warmup",
                             "first-step"]).triton_warmup == "first-step"
    with pytest.raises(SystemExit):   # torch.compile may compile or capture in the first step
        train.parse_args(["--data", str(DATA), "--compile", "default", "--triton-warmup", "first-step"])


def test_xla_options_reach_the_jax_run_and_are_refused_elsewhere():
    """--xla-option KEY=VALUE (repeatable) becomes RunOptions.xla_options (SplitStep's
    compiler_options, tested in test_jax_compile_ahead.py); torch and the local method refuse it."""
    base = ["--data", str(DATA), "--device", "cpu"]
    opts = train.parse_args(base + ["--backend", "jax", "--xla-option", "xla_gpu_autotune_level=2",
                                    "--xla-option", "xla_gpu_enable_triton_gemm=false"])
    assert opts.xla_options == {"xla_gpu_autotune_level": 2, "xla_gpu_enable_triton_gemm": False}
    for extra in (["--backend", "torch"], ["--backend", "jax", "--method", "local"]):
        with pytest.raises(SystemExit):
            train.parse_args(base + extra + ["--xla-option", "xla_gpu_autotune_level=2"])
    with pytest.raises(SystemExit, match="--xla-option"):
        train.parse_args(base + ["--backend", "jax", "--xla-option", "xla_gpu_autotune_level"])


def test_jax_demo_with_a_pad_floor_and_compilations_after_the_loops(tmp_path):
    """--pad-floor largest --compile-ahead after run end to end, every image once, and are recorded in
    the summary, with BatchNorm statistics over the real rows only (--bn-mask auto: on where the floor
    pads; the floor's padding itself: the loader and SplitStep tests; the masked statistics:
    test_demo_parity.py)."""
    summary, out = _run(tmp_path, "--backend", "jax", "--method", "triaccel", "--pad-floor", "largest",
                        "--compile-ahead", "after", "--batch-max", "64", "--set", "min_dwell=0")
    steps = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    steps = [r for r in steps if r["type"] == "step"]
    assert sum(r["samples"] for r in steps) == 192 and 0.0 <= summary["final_acc"] <= 1.0
    assert summary["options"]["pad_floor"] == "largest" and summary["options"]["compile_ahead"] == "after"
    assert summary["options"]["bn_mask"] == "auto" and summary["bn_masked"] is True
    assert summary["pad_floor"] == 64   # the largest bucket <= --batch-max


def test_jax_demo_pads_by_default_only_on_a_gpu(tmp_path):
    """--pad-floor auto (the default): off on the CPU (compute, not compilation, dominates there);
    on a GPU the largest bucket <= batch_max, for a batch that can climb only."""
    from examples.cifar.jax_loop import pad_floor_size

    summary, _ = _run(tmp_path, "--backend", "jax", "--method", "triaccel")
    assert summary["options"]["pad_floor"] == "auto" and summary["pad_floor"] is None
    ladder = (12, 24, 48, 96, 192, 384, 512)   # the demo's from 96 with --batch-max 512
    assert pad_floor_size("auto", "gpu", True, ladder, 512) == 512
    assert pad_floor_size("auto", "gpu", False, ladder, 512) is None   # AMP's static batch
    assert pad_floor_size("auto", "cpu", True, ladder, 512) is None
    assert pad_floor_size("off", "gpu", True, ladder, 512) is None
    assert pad_floor_size("largest", "cpu", False, ladder, 100) == 96
    assert pad_floor_size("200", "cpu", False, ladder, 512) == 200


def test_jax_demo_freezes_long_lived_objects_and_unfreezes_them_after(tmp_path, monkeypatch):
    """--gc-freeze on (the default): gc.freeze after set-up and after each epoch, nothing left frozen
    after the run; off: never."""
    import gc

    frozen = []
    real = gc.freeze
    monkeypatch.setattr(gc, "freeze", lambda: (frozen.append(gc.get_freeze_count()), real())[-1])
    summary, _ = _run(tmp_path, "--backend", "jax", "--method", "amp")
    assert summary["options"]["gc_freeze"] == "on" and len(frozen) == 2   # set-up, the one epoch
    assert gc.get_freeze_count() == 0
    # the static run's evaluation compiled in the background after its step (as triaccel's), and taken
    evals = summary["compile_log"]["evals"][0]
    assert evals["critical"]["compiles"] == 0 and summary["compiled_ahead"] == 1
    assert summary["compiled_ahead_unused"] == []
    first = [r for r in summary["compile_log"]["records"] if r[0] == "compile"]
    step_done = next(r[4] for r in first if r[1] == "jit(train_body)" and not r[3])
    assert all(r[4] - r[2] >= step_done - 1e-3 for r in first if r[1] == "jit(eval_body)")   # began after it
    frozen.clear()
    _run(tmp_path, "--backend", "jax", "--method", "amp", "--gc-freeze", "off")
    assert frozen == [] and gc.get_freeze_count() == 0


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_trace_steps_profile_a_window_that_the_summary_reads(tmp_path, backend):
    """--trace-steps 2:4 writes the backend profiler's trace of steps 2-3; benchmarks/trace_summary.py
    finds it under the run's out and accounts the host's time; every step record has its host time."""
    import trace_summary   # benchmarks/ is on the path (conftest.py)

    summary, out = _run(tmp_path, "--backend", backend, "--method", "amp", "--trace-steps", "2:4")
    assert tuple(summary["options"]["trace_steps"]) == (2, 4)
    s = trace_summary.summarize(trace_summary.load_events(trace_summary.find_trace(str(out))), top=5)
    assert s["window_ms"] > 0 and s["gpu_share"] is None   # a CPU run: no device track
    assert trace_summary.traced_steps(str(out)) == 2
    assert s["tracks"][0]["busy_ms"] > 0 and 0 < s["tracks"][0]["share"] <= 1.0 + 1e-9
    marks = {e["name"] for e in trace_summary.load_events(trace_summary.find_trace(str(out)))
             if e.get("ph") == "X" and trace_summary.STEP_MARK.match(str(e.get("name", "")))}
    assert marks == {"step 2", "step 3"}   # each traced step's host span, for --gaps
    steps = [r for r in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if r["type"] == "step"]
    assert all(b["host_s"] > a["host_s"] > 0 for a, b in zip(steps, steps[1:]))


def test_trace_summary_unions_overlapping_events():
    import trace_summary   # benchmarks/ is on the path (conftest.py)

    ev = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
          {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
          {"ph": "X", "pid": 1, "tid": 7, "ts": 0, "dur": 10, "name": "k1"},
          {"ph": "X", "pid": 1, "tid": 7, "ts": 5, "dur": 10, "name": "k2"},     # overlaps k1: 15 us busy
          {"ph": "X", "pid": 1, "tid": 8, "ts": 30, "dur": 5, "name": "k1"},
          {"ph": "X", "pid": 2, "tid": 1, "ts": 0, "dur": 40, "name": "step"}]
    s = trace_summary.summarize(ev, top=3)
    assert s["window_ms"] == pytest.approx(0.040) and s["gpu_busy_ms"] == pytest.approx(0.020)
    assert s["gpu_share"] == pytest.approx(0.5) and s["gpu_events"] == 3
    assert s["tracks"][0]["process"] == "/host:CPU" and s["tracks"][0]["share"] == pytest.approx(1.0)


@pytest.mark.parametrize("method", ["fp32", "amp"])
def test_baselines_run(tmp_path, method):
    summary, out = _run(tmp_path, "--backend", "torch", "--method", method)
    assert summary["steps"] == 6 and summary["report"] is None


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_a_short_last_step_weighted_by_its_samples_trains_every_image_once(tmp_path, backend):
    # 192 = 4 x 40 + 32: the epoch ends with a 32-sample step, its gradient x 32/40 (JAX: in the fused step)
    summary, out = _run(tmp_path, "--backend", backend, "--method", "amp", "--batch", "40",
                        "--set", "short_step_lr=linear")
    steps = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    steps = [r for r in steps if r["type"] == "step"]
    assert [r["samples"] for r in steps] == [40, 40, 40, 40, 32] and summary["steps"] == 5
    assert np.isfinite(summary["final_acc"])


def test_static_methods_keep_a_plain_loops_short_step_unless_set():
    for method, rule in (("amp", "batch"), ("fp32", "batch"), ("triaccel", "linear")):
        assert train.parse_args(["--method", method]).triaccel_config().short_step_lr == rule
    assert train.parse_args(["--method", "amp", "--set", "short_step_lr=sqrt"]).triaccel_config().short_step_lr == "sqrt"


def test_bad_options_fail_before_loading_data(tmp_path):
    with pytest.raises(SystemExit):
        train.parse_args(["--levers", "precision,warp"])
    with pytest.raises(ValueError, match="batch_init"):
        train.parse_args(["--batch", "100", "--data", str(tmp_path)])
    with pytest.raises(SystemExit):   # the compilation cache is JAX's
        train.parse_args(["--backend", "torch", "--compile-cache", str(tmp_path)])
    assert train.parse_args(["--backend", "jax", "--compile-cache", str(tmp_path)]).compile_cache == str(tmp_path)
    assert train.parse_args(["--backend", "jax", "--fused-step", "off", "--in-flight", "off"]).fused_step == "off"
    assert train.parse_args(["--backend", "jax"]).fused_step == "auto"
    for bad in (["--backend", "torch", "--pad-floor", "384"], ["--backend", "jax", "--pad-floor", "0"],
                ["--backend", "jax", "--pad-floor", "big"], ["--backend", "jax", "--compile-ahead", "later"],
                ["--backend", "torch", "--batch-stats", "global"], ["--backend", "jax", "--batch-stats", "local"],
                ["--backend", "jax", "--gc-freeze", "maybe"], ["--backend", "torch", "--fused-step", "on"],
                ["--backend", "jax", "--fused-step", "on", "--in-flight", "off"],
                ["--backend", "jax", "--method", "local", "--fused-step", "off"], ["--backend", "jax", "--fused-step", "1"],
                ["--backend", "torch", "--bn-mask", "on"], ["--backend", "jax", "--method", "local", "--bn-mask", "on"],
                ["--backend", "jax", "--bn-mask", "yes"]):
        with pytest.raises(SystemExit):
            train.parse_args(bad)
    for bad in (["--trace-steps", "5"], ["--trace-steps", "4:4"], ["--trace-steps", "a:b"],
                ["--trace-steps", "-1:3"], ["--method", "local", "--budget", "e2e:32", "--trace-steps", "0:2"]):
        with pytest.raises(SystemExit):
            train.parse_args(bad)
    assert train.parse_args(["--trace-steps", "10:20"]).trace_steps == (10, 20)
    assert train.parse_args(["--backend", "torch"]).pad_floor == "auto"   # the default: off but for JAX on a GPU
    jax_opts = train.parse_args(["--backend", "jax", "--pad-floor", "largest", "--compile-ahead", "after"])
    assert jax_opts.pad_floor == "largest" and jax_opts.compile_ahead == "after" and jax_opts.batch_stats == "per-device"
    assert train.parse_args(["--backend", "jax", "--batch-stats", "global"]).batch_stats == "global"
    # torch's DDP normalises by each rank's batch: its summary says so, and "global" is refused
    assert train.parse_args(["--backend", "torch"]).batch_stats == "per-device"
    assert train.parse_args(["--backend", "torch", "--batch-stats", "per-device"]).batch_stats == "per-device"
    for bad in (["--backend", "torch", "--batch-stats", "global"], ["--method", "local", "--batch-stats", "global"],
                ["--backend", "jax", "--batch-stats", "auto"]):
        with pytest.raises(SystemExit):
            train.parse_args(bad)
    with pytest.raises(SystemExit):   # shapes of a compiled model only
        train.parse_args(["--compile-shapes", "buckets"])
    assert train.parse_args(["--compile", "reduce-overhead", "--compile-shapes", "buckets"]).compile_shapes == "buckets"
    for other in (["--backend", "jax", "--fuse-steps", "4"], ["--plan-headroom", "0.9"],
                  ["--exit-eval", "end"], ["--block-curvature", "1"], ["--head-pool", "8"]):   # local's options only
        with pytest.raises(SystemExit):
            train.parse_args(other)
    local = ["--method", "local", "--budget", "e2e:32"]
    for bad in (["--graph-reserve", "lots"], ["--graph-reserve", "64MiB", "--cuda-graph", "off"],
                ["--graph-reserve", "64MiB", "--backend", "jax"], ["--fuse-steps", "4"],
                ["--fuse-steps", "0", "--backend", "jax"], ["--plan-headroom", "0"], ["--plan-headroom", "1.2"],
                ["--block-curvature", "-1"], ["--head-pool", "0"]):
        with pytest.raises(SystemExit):
            train.parse_args([*local, *bad])
    assert train.parse_args([*local, "--graph-reserve", "64MiB"]).local["graph_reserve"] == 64 * 2 ** 20
    assert train.parse_args(local).local["graph_reserve"] == "auto"
    assert train.parse_args([*local, "--backend", "jax", "--fuse-steps", "4"]).local["fuse_steps"] == 4
    assert "fuse_steps" not in train.parse_args(local).local   # LOCAL_DEFAULTS' 16 on JAX
    assert train.parse_args([*local, "--plan-headroom", "0.95"]).local["headroom"] == 0.95
    assert train.parse_args([*local, "--exit-eval", "end"]).local["exit_eval"] == "end"
    assert "exit_eval" not in train.parse_args(local).local   # LOCAL_DEFAULTS' "epoch"
    assert train.parse_args([*local, "--block-curvature", "2"]).local["block_curvature"] == 2
    assert train.parse_args([*local, "--head-pool", "8"]).local["head_pool"] == 8
    assert "head_pool" not in train.parse_args(local).local   # LOCAL_DEFAULTS' 4
    from examples.cifar.local_loop import block_curvature
    assert block_curvature({"block_curvature": 0}) is None and block_curvature({"block_curvature": 2}).every == 2
    with pytest.raises(ValueError, match="block_curvature=-1: allowed integers >= 0"):
        block_curvature({"block_curvature": -1})
    from examples.cifar.local_loop import exit_eval_every_epoch
    assert exit_eval_every_epoch({"exit_eval": "epoch"}) and not exit_eval_every_epoch({"exit_eval": "end"})
    with pytest.raises(ValueError, match="exit_eval='epochs': allowed 'epoch', 'end'"):
        exit_eval_every_epoch({"exit_eval": "epochs"})
    assert train.parse_args([*local, "--graph-reserve", "0"]).local["graph_reserve"] == 0
    from examples.cifar.local_loop import AUTO_GRAPH_RESERVE, graph_reserve
    lo = {"graph_reserve": "auto", "cuda_graph": True}
    assert graph_reserve(lo, "cuda") == AUTO_GRAPH_RESERVE and graph_reserve(lo, "cpu") == 0
    assert graph_reserve({**lo, "cuda_graph": False}, "cuda") == 0 and graph_reserve(lo, "jax") == 0
    assert graph_reserve({**lo, "graph_reserve": 5}, "cuda") == 5
    with pytest.raises(SystemExit):
        train.parse_args([*local, "--block-epochs", "10,0"])
    assert train.parse_args([*local, "--block-epochs", "10,15,15"]).local["block_epochs"] == (10, 15, 15)


def test_block_epochs_one_per_planned_block():
    from types import SimpleNamespace

    from examples.cifar.local_loop import LOCAL_DEFAULTS, block_epochs

    plan = SimpleNamespace(blocks=[0, 1, 2])
    opts = SimpleNamespace(epochs=4)
    assert block_epochs(LOCAL_DEFAULTS, opts, plan) == (4, 4, 4)
    assert block_epochs({**LOCAL_DEFAULTS, "block_epochs": (2, 3, 5)}, opts, plan) == (2, 3, 5)
    assert block_epochs({**LOCAL_DEFAULTS, "block_epochs": (2, 3)}, opts, None) == (2, 3)   # before a plan exists
    with pytest.raises(ValueError, match="--block-epochs=2,3: 2 values, but the plan has 3 blocks"):
        block_epochs({**LOCAL_DEFAULTS, "block_epochs": (2, 3)}, opts, plan)


def test_memory_format_auto_keeps_efficientnet_contiguous_on_cuda(tmp_path):
    opts = train.parse_args(["--model", "efficientnet_b0", "--data", str(tmp_path)])
    assert opts.memory_format == "auto" and not opts.channels_last("cuda") and not opts.channels_last("cpu")
    opts = train.parse_args(["--model", "resnet18", "--data", str(tmp_path)])
    assert opts.channels_last("cuda") and not opts.channels_last("cpu")
    opts = train.parse_args(["--memory-format", "channels_last", "--data", str(tmp_path)])
    assert opts.channels_last("cpu")
    opts.memory_format = "nhwc"
    with pytest.raises(ValueError, match="memory_format='nhwc'"):
        opts.channels_last("cuda")


def test_channels_last_run_matches_contiguous_on_cpu(tmp_path):
    """The memory format is a layout, not a different computation: same steps, same data."""
    a, _ = _run(tmp_path / "a", "--backend", "torch", "--method", "fp32", "--memory-format", "channels_last")
    b, _ = _run(tmp_path / "b", "--backend", "torch", "--method", "fp32", "--memory-format", "contiguous")
    assert a["steps"] == b["steps"] == 6 and a["final_acc"] == pytest.approx(b["final_acc"], abs=2 / 64)


def test_plots_show_the_noise_scale_beside_the_batch_and_the_flop_share(tmp_path):
    """B_noise goes on the batch plot where it was estimated (finite, positive); the FLOP share per
    precision gets its own plot from the epoch records."""
    from examples.cifar.plots import noise_series, plot_run

    decisions = [{"step": 50 * i, "precisions": ["bf16"], "lambda_max": [None], "b_noise": b, "b_noise_warm": i > 2}
                 for i, b in enumerate([None, 120.0, -40.0, float("nan"), 300.0])]
    assert noise_series(decisions) == ([50, 200], [120.0, 300.0], [False, True])
    rows = [{"type": "run", "options": {"extra": {"noise_scale_c": 2.0}}}, {"type": "layers", "names": ["fc"]},
            *({"type": "decision", **d} for d in decisions),
            *({"type": "step", "step": i, "epoch": i // 100, "loss": 1.0, "batch_size": 96} for i in range(200)),
            *({"type": "epoch", "epoch": e, "train_loss": 1.0, "test_acc": 0.5, "seconds": 1.0,
               "flop_share": {"fp16": 0.0, "bf16": 0.95, "fp32": 0.05}} for e in (1, 2))]
    log = tmp_path / "log.jsonl"
    log.write_text("\n".join(json.dumps(r) for r in rows))
    names = {p.name for p in plot_run(log, tmp_path / "plots")}
    assert {"batch_memory.png", "flop_share.png", "precision_heatmap.png", "loss_accuracy.png"} <= names
    log.write_text("\n".join(json.dumps({k: v for k, v in r.items() if k != "flop_share"}) for r in rows))
    assert "flop_share.png" not in {p.name for p in plot_run(log, tmp_path / "plots2")}


def test_bucket_ladder_doubles_and_tops_out_at_the_batch_max():
    from examples.cifar.common import bucket_ladder, without_rung_below_top

    assert bucket_ladder(96, 8, 512) == (12, 24, 48, 96, 192, 384, 512)
    assert bucket_ladder(96, 8, 384) == (12, 24, 48, 96, 192, 384)      # the top is a doubling already
    assert bucket_ladder(96, 8, 96) == (12, 24, 48, 96)
    assert without_rung_below_top(bucket_ladder(96, 8, 512), 96) == (12, 24, 48, 96, 192, 512)
    assert without_rung_below_top(bucket_ladder(96, 8, 384), 96) == (12, 24, 48, 96, 192, 384)
    assert without_rung_below_top(bucket_ladder(32, 8, 512), 32) == (8, 16, 32, 64, 128, 256, 512)
    assert without_rung_below_top((76, 152, 304, 512), 304) == (76, 152, 304, 512)   # the first batch stays
    assert train.parse_args(["--batch", "304"]).triaccel_config().batch_buckets[-2:] == (304, 512)
    jax = ["--backend", "jax", "--batch", "96", "--batch-max", "1000"]
    assert train.parse_args(jax).triaccel_config().batch_buckets[-3:] == (384, 768, 1000)
    assert train.parse_args(jax[2:]).triaccel_config().batch_buckets[-3:] == (192, 384, 1000)


def test_torch_triaccel_visits_fewer_sizes_by_default():
    """torch, triaccel: no rung between batch_max/2 and batch_max, and the noise step's two micro-batches
    at the decided size (each size visited costs a first eager step, graphed a capture too); JAX keeps
    the doubling ladder and the library's noise split (a step's halves); the static methods keep the
    library's defaults; --set overrides both."""
    def cfg(*a):
        return train.parse_args(["--batch", "96", *a]).triaccel_config()

    torch_tri = cfg("--method", "triaccel")
    assert (torch_tri.batch_buckets, torch_tri.noise_split) == ((12, 24, 48, 96, 192, 512), "double")
    jax_tri = cfg("--backend", "jax", "--method", "triaccel")
    assert (jax_tri.batch_buckets, jax_tri.noise_split) == ((12, 24, 48, 96, 192, 384, 512), "halves")
    for amp in (cfg("--method", "amp"), cfg("--backend", "jax", "--method", "amp")):
        assert (amp.batch_buckets, amp.noise_split) == ((12, 24, 48, 96, 192, 384, 512), "halves")
    set_ = cfg("--method", "triaccel", "--set", "noise_split=halves", "--set", "batch_buckets=[96,384]")
    assert (set_.batch_buckets, set_.noise_split) == ((96, 384), "halves")


def test_the_ladder_keeps_the_rungs_that_split_across_ranks():
    """Data parallel: every bucket must divide by the ranks/devices (triaccel.distributed.check_world_divides);
    the default top rung 512 does not on 3 or 6, 12 not on 8: those rungs are left out, not refused."""
    from triaccel.distributed import check_world_divides

    opts = train.parse_args(["--method", "triaccel", "--batch", "96"])
    for shards, want in [(1, (12, 24, 48, 96, 192, 512)), (3, (12, 24, 48, 96, 192, 384)),
                         (8, (24, 48, 96, 192, 512))]:   # (torch triaccel: no rung between half the top and the top)
        cfg = opts.triaccel_config(shards)
        assert cfg.batch_buckets == want
        check_world_divides(cfg, shards)
    assert train.parse_args(["--batch", "96", "--set", "batch_buckets=[96,100]"]).triaccel_config(4).batch_buckets == (96, 100)
    with pytest.raises(ValueError, match="shards=0"):
        opts.triaccel_config(0)


def test_demo_memory_formats_are_the_models_rule():
    from triaccel.backends.torch.models import MEMORY_FORMATS

    assert train.MEMORY_FORMATS == MEMORY_FORMATS


def test_largest_fitting_binary_search():
    """The JAX local demo's end-to-end report: few compiled peaks, the same answer as trying every batch."""
    from examples.cifar.local_loop import largest_fitting

    batches = (8, 16, 32, 64, 128, 256, 512)
    for budget in (50, 100, 160, 330, 5000, 10_000):
        calls = []

        def peak(b):
            calls.append(b)
            return 10 * b + 5

        got = largest_fitting(batches, peak, budget)
        fit = [b for b, p in got.items() if p <= budget]
        assert max(fit, default=None) == max((b for b in batches if 10 * b + 5 <= budget), default=None)
        assert len(calls) <= 3 and len(set(calls)) == len(calls)
    # known peaks that bracket the answer (end-to-end's at 32 and 64 under e2e:32): nothing computed
    calls = []
    got = largest_fitting(batches, lambda b: calls.append(b) or 10 * b, 500, {32: 320, 64: 640})
    assert calls == [] and got == {32: 320, 64: 640}


def test_compiled_bucket_sizes_are_per_rank():
    from types import SimpleNamespace

    from examples.cifar.torch_loop import static_batches

    assert static_batches((24, 48, 96, 192)) == (24, 48, 96, 192)
    assert static_batches((24, 48, 96, 192), SimpleNamespace(world_size=4)) == (6, 12, 24, 48)
    assert static_batches((12, 24, 36), SimpleNamespace(world_size=8)) == (3,)
    assert static_batches((24, 48, 96, 192), smallest=96) == (96, 192)   # from the starting batch up


def test_torch_demo_under_torchrun_on_two_gloo_ranks(tmp_path):
    """The demo as a user launches it on several GPUs, here two CPU ranks: the ranks agree, every image
    trains once across them, and the summary holds the accuracy with the ranks' averaged BatchNorm
    statistics beside rank 0's own."""
    import subprocess
    import sys

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "examples.cifar.train", "--backend", "torch", "--method", "triaccel", "--data", str(DATA),
           "--epochs", "1", "--train-subset", "192", "--test-subset", "64", "--batch", "32", "--width", "0.125",
           "--t-ctrl", "2", "--warmup-steps", "2", "--no-progress", "--device", "cpu", "--out", str(out)]
    subprocess.run(cmd, check=True, timeout=300, cwd=Path(__file__).resolve().parents[1])
    s = json.loads((out / "summary.json").read_text())
    assert s["world_size"] == 2 and s["ranks_agree"] is True
    assert 0.0 <= s["final_acc"] <= 1.0 and 0.0 <= s["final_acc_rank0_buffers"] <= 1.0
    steps = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    assert sum(r["samples"] for r in steps if r["type"] == "step") == 192   # global samples, once


def test_bn_parts_normalise_each_slice_by_its_own_statistics(tmp_path):
    """--bn-parts K: one process computes the BatchNorm statistics K data-parallel ranks would, one per
    slice of the batch; the demo trains with it, every image once."""
    import torch

    from examples.cifar.torch_loop import parts_forward

    bn = torch.nn.BatchNorm1d(3).train()
    x = torch.randn(10, 3) * torch.arange(1, 11, dtype=torch.float32)[:, None]   # slices with unlike statistics
    got = parts_forward(bn, 3)(x)
    want = torch.cat([torch.nn.functional.batch_norm(c, None, None, training=True) for c in x.tensor_split(3)])
    torch.testing.assert_close(got, want)
    assert not torch.allclose(got, torch.nn.functional.batch_norm(x, None, None, training=True))
    assert parts_forward(bn, 1) is bn
    for bad in (["--bn-parts", "0"], ["--backend", "jax", "--bn-parts", "2"],
                ["--bn-parts", "2", "--compile", "default"], ["--method", "local", "--bn-parts", "2"],
                ["--backend", "jax", "--augment-rng", "sample"], ["--method", "local", "--augment-rng", "sample"]):
        with pytest.raises(SystemExit):
            train.parse_args(bad)
    summary, out = _run(tmp_path, "--backend", "torch", "--method", "triaccel", "--bn-parts", "2")
    steps = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    assert sum(r["samples"] for r in steps if r["type"] == "step") == 192 and summary["options"]["bn_parts"] == 2


def test_one_process_with_bn_parts_and_keyed_augmentation_trains_as_two_ranks(tmp_path):
    """--augment-rng sample gives every sample the same crops on any number of ranks, and --bn-parts 2
    the two ranks' BatchNorm statistics: one process then takes the two ranks' steps (the mean of their
    step losses, each rank's its own half's), to float rounding. One CPU thread each: oneDNN's
    convolutions sum in another order with two, which moved the step losses by up to 2.6e-3 within six steps."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    args = ["-m", "examples.cifar.train", "--backend", "torch", "--method", "fp32", "--data", str(DATA), "--epochs", "1",
            "--train-subset", "192", "--test-subset", "64", "--batch", "32", "--width", "0.125", "--no-progress",
            "--device", "cpu"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def step_losses(log):
        return np.array([r["loss"] for r in map(json.loads, log.read_text().splitlines()) if r["type"] == "step"])

    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args,
                    "--augment-rng", "sample", "--out", str(tmp_path / "ranks")], check=True, timeout=300, cwd=root, env=env)
    ranks = (step_losses(tmp_path / "ranks" / "log.jsonl") + step_losses(tmp_path / "ranks" / "log.rank1.jsonl")) / 2
    for aug, out in (("sample", "one"), ("stream", "stream")):
        subprocess.run([sys.executable, *args, "--bn-parts", "2", "--augment-rng", aug, "--out", str(tmp_path / out)],
                       check=True, timeout=300, cwd=root, env=env)
    assert len(ranks) == 6
    np.testing.assert_allclose(step_losses(tmp_path / "one" / "log.jsonl"), ranks, rtol=1e-6)
    assert not np.allclose(step_losses(tmp_path / "stream" / "log.jsonl"), ranks, rtol=1e-6)   # the test can fail


def test_first_update_waits_for_the_thread_once_and_records_the_wait():
    import threading
    import time

    from examples.cifar.torch_loop import _Ahead, joined_before

    gate, order, phases = threading.Event(), [], {}

    def work():
        gate.wait(5)
        order.append("thread")

    step = joined_before(_Ahead(work), lambda d: order.append(d), phases)
    threading.Timer(0.05, gate.set).start()   # the thread finishes while the update waits
    step("step0")
    step("step1")
    assert order == ["thread", "step0", "step1"] and phases["triton_wait"] > 0.0
    failing = joined_before(_Ahead(lambda: 1 / 0), lambda d: order.append(d), {})
    time.sleep(0.01)
    with pytest.raises(ZeroDivisionError):   # the thread's error, raised before the update
        failing("never")
    assert "never" not in order


def test_ahead_thread_runs_at_once_and_reraises_on_finish():
    """The demo's --triton-warmup jobs: started on construction, chained, errors raised by finish()."""
    from examples.cifar.torch_loop import _Ahead

    done = []
    first = _Ahead(lambda: done.append("runtime"))
    second = _Ahead(lambda: (first.finish(), done.append("kernels")))
    second.finish()
    assert done == ["runtime", "kernels"]
    failing = _Ahead(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        _Ahead(lambda: failing.finish()).finish()


def test_set_values_parse_as_json_or_as_words():
    """--set KEY=VALUE: JSON numbers, lists, objects, true/false/null; any other word stays a string
    (kernels=triton, precision_law=noise: words starting with t, f or n once failed as malformed JSON);
    malformed JSON is a clear error."""
    got = train._parse_set(["kernels=reference", "k2=triton", "law=noise", "a=true", "b=null", "c=1e-3", "d=[96, 192]",
                            "e={\"x\": 1}", "f=-2", "g=fast"])
    assert got == {"kernels": "reference", "k2": "triton", "law": "noise", "a": True, "b": None, "c": 1e-3,
                   "d": [96, 192], "e": {"x": 1}, "f": -2, "g": "fast"}
    with pytest.raises(SystemExit, match="not a JSON number, list or object"):
        train._parse_set(["d=[96,"])
    with pytest.raises(SystemExit, match="expected KEY=VALUE"):
        train._parse_set(["kernels"])


def test_set_refuses_fields_the_demo_sets_from_its_flags_and_unknown_names(capsys):
    """--set batch_max=64 once ended in a TypeError (two values for one keyword); now a parse error names the
    flag to use. batch_min (no flag of its own) goes through --set."""
    with pytest.raises(SystemExit):
        train.parse_args(["--set", "batch_max=64"])
    assert "the demo sets batch_max from --batch-max" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train.parse_args(["--set", "bogus=1"])
    assert "not a TriAccelConfig field" in capsys.readouterr().err
    opts = train.parse_args(["--set", "batch_min=16", "--set", "t_noise_warm=10", "--device", "cpu"])
    cfg = opts.triaccel_config()
    assert (cfg.batch_min, cfg.t_noise_warm) == (16, 10)


def test_trace_summary_gaps_name_the_step_and_the_host_event_of_each_device_idle():
    import trace_summary   # benchmarks/ is on the path (conftest.py)

    ev = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
          {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
          {"ph": "X", "pid": 1, "tid": 7, "ts": 0, "dur": 100, "name": "k", "cat": "kernel"},
          {"ph": "X", "pid": 1, "tid": 7, "ts": 110, "dur": 100, "name": "k", "cat": "kernel"},   # 10 us idle
          {"ph": "X", "pid": 1, "tid": 7, "ts": 250, "dur": 50, "name": "k", "cat": "kernel"},    # 40 us idle
          {"ph": "X", "pid": 1, "tid": 7, "ts": 0, "dur": 300, "name": "step 5", "cat": "gpu_user_annotation"},
          {"ph": "X", "pid": 2, "tid": 1, "ts": 0, "dur": 150, "name": "step 5"},
          {"ph": "X", "pid": 2, "tid": 1, "ts": 150, "dur": 150, "name": "step 6"},
          {"ph": "X", "pid": 2, "tid": 1, "ts": 200, "dur": 60, "name": "aten::copy_"},
          {"ph": "X", "pid": 2, "tid": 1, "ts": 205, "dur": 50, "name": "cudaMemcpyAsync"}]
    s = trace_summary.summarize(ev, top=3, gaps=2)
    g = s["gaps"]
    assert g["count"] == 2 and g["idle_ms"] == pytest.approx(0.050)
    assert g["longest"][0] == {"at_ms": 0.21, "ms": 0.04, "step": 6, "host": "cudaMemcpyAsync"}
    assert g["longest"][1] == {"at_ms": 0.1, "ms": 0.01, "step": 5, "host": None}   # marks are not host work
    assert g["per_step"] == [{"step": 6, "idle_ms": 0.04}, {"step": 5, "idle_ms": 0.01}]
    gpu_track = next(t for t in s["tracks"] if t["thread"] == "7")
    assert gpu_track["busy_ms"] == pytest.approx(0.25) and gpu_track["events"] == 3   # the mark is no work
    host_track = next(t for t in s["tracks"] if t["process"] == "/host:CPU")
    assert host_track["busy_ms"] == pytest.approx(0.06) and host_track["events"] == 2   # nor are the step marks
    assert "gaps" not in trace_summary.summarize(ev, top=3)


def test_jax_demo_two_programs_train_as_the_fused_step(tmp_path):
    """--fused-step off (the gradient program, then the update; a noise step's halves as two gradient
    calls the host measures) trains as the fused step (one program; the halves measured inside the
    update and fed at the next boundary): the same losses, batches, noise measurements and accuracy."""
    runs = {}
    for mode in ("on", "off"):
        summary, out = _run(tmp_path / mode, "--backend", "jax", "--method", "triaccel", "--budget", "4GiB",
                            "--batch-max", "32", "--set", "noise_beta=0", "--set", "min_dwell=0", "--fused-step", mode)
        rows = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
        runs[mode] = (summary, [r for r in rows if r["type"] == "step"],
                      [(r["step"], r["b_noise"]) for r in rows if r["type"] == "decision"])
    (on, on_steps, on_noise), (off, off_steps, off_noise) = runs["on"], runs["off"]
    assert (on["fused_step"], on["noise_in_update"]) == (True, True)
    assert (off["fused_step"], off["noise_in_update"]) == (False, False)
    assert off["report"]["noise_measurements"] == on["report"]["noise_measurements"] >= 2
    assert [r["samples"] for r in off_steps] == [r["samples"] for r in on_steps]
    assert sum(r["samples"] for r in off_steps) == 192
    assert [r["loss"] for r in off_steps] == pytest.approx([r["loss"] for r in on_steps], rel=1e-4)
    # t_ctrl 2: the fused run's halves, read at the next boundary, reach the same decisions
    assert [(s, b is None) for s, b in off_noise] == [(s, b is None) for s, b in on_noise]
    assert any(b is not None for _, b in on_noise)
    assert [b for _, b in off_noise if b is not None] == pytest.approx([b for _, b in on_noise if b is not None],
                                                                       rel=1e-4)
    assert off["final_acc"] == pytest.approx(on["final_acc"], abs=1 / 64)


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_demo_measures_the_noise_from_half_steps(tmp_path, backend):
    """--set noise_split=steps: the noise steps (every t_ctrl = 2 steps from step 2) run 16 of the
    32-sample batch as steps of their own; each with the full step after it is a noise measurement,
    taken from the statistics rows (JAX: no noise halves in the update); every image once."""
    top = ["--batch-max", "32"] if backend == "jax" else []   # no climb: one step size compiled
    summary, out = _run(tmp_path, "--backend", backend, "--method", "triaccel", "--budget", "4GiB",
                        "--set", "noise_split=steps", "--set", "noise_beta=0", "--set", "min_dwell=0", *top)
    steps = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines() if '"type": "step"' in x]
    assert sum(r["samples"] for r in steps) == 192
    assert [r["samples"] for r in steps][:4] == [32, 32, 16, 32]
    assert summary["report"]["noise_measurements"] >= 1
    if backend == "jax":
        assert summary["noise_in_update"] is False
