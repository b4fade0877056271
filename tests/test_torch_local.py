"""triaccel.backends.torch.local: units, measured table, cached == recomputed training, export."""

from __future__ import annotations

import gc
import json
import warnings

import numpy as np
import pytest
import torch

from triaccel.backends.torch.local import LocalTrainer, live_tensors, measure_layers, sequential_units
from triaccel.backends.torch.models import create_model
from triaccel.local_plan import BlockOutOfMemory, LocalPlanConfig, NonFinitePolicy, NonFiniteTraining, plan_local

N, K, S = 64, 4, 16


def _data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, 3, S, S, generator=g)
    y = torch.randint(0, K, (N,), generator=g)
    return x, y


def _plan(units, min_blocks: int = 3, block_inputs: str = "cache"):
    """A plan of the tiny ResNet with at least `min_blocks` blocks: the largest budget (of a fixed
    ladder) that splits it that far."""
    table = measure_layers(units, torch.randn(2, 3, S, S), autocast_dtype=None)
    for budget in [2 ** p for p in range(26, 14, -1)]:
        cfg = LocalPlanConfig(memory_budget=budget, batch_buckets=(8, 16), act_bytes=4, cache_bytes=4,
                              input_bytes=3 * S * S * 4, head_widths=(8, 16), max_blocks=4, block_inputs=block_inputs)
        try:
            plan = plan_local(table, cfg, num_samples=N, num_classes=K)
        except ValueError:
            continue
        if len(plan.blocks) >= min_blocks:
            return table, plan
    raise AssertionError("no budget of the ladder splits the tiny model")


def _model(seed: int = 0):
    return create_model("resnet18", num_classes=K, width=0.125, seed=seed)


def test_units_compose_to_the_model():
    model = _model().eval()
    units, clf = sequential_units(model)
    assert [n for n, _ in units] == ["stem"] + [f"layer{i}.{j}" for i in range(1, 5) for j in range(2)]
    x, _ = _data()
    h = x
    for _, m in units:
        h = m(h)
    assert torch.equal(clf(h), model(x))
    eff = create_model("efficientnet_b0", num_classes=K, width=0.25, seed=0).eval()
    units, clf = sequential_units(eff)
    assert [n for n, _ in units] == ["stem"] + [f"blocks.{j}" for j in range(16)] + ["head"]
    h = x
    for _, m in units:
        h = m(h)
    assert torch.equal(clf(h), eff(x))


def test_measured_table():
    model = _model()
    units, clf = sequential_units(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    table = measure_layers(units, torch.randn(2, 3, S, S), autocast_dtype=None)
    assert [t.name for t in table] == [n for n, _ in units]
    assert all(t.saved_bytes > 0 for t in table)
    assert table[0].out_shape == (8, S, S) and table[-1].out_shape == (64, S // 8, S // 8)
    assert sum(t.params for t in table) + sum(p.numel() for p in clf.parameters()) == \
        sum(p.numel() for p in model.parameters())
    # the stem (conv-BN-ReLU) keeps its input (conv), its conv output (BN) and its output (ReLU),
    # fp32, per sample: 3*S*S*4 + 8*S*S*4 + 8*S*S*4 bytes (BN's own saved stats are per channel)
    assert table[0].saved_bytes == (3 + 8 + 8) * S * S * 4
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())   # BN stats restored


def _tensors_alive() -> int:
    gc.collect()
    with warnings.catch_warnings():   # isinstance on deprecated module proxies warns
        warnings.simplefilter("ignore")
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


@pytest.mark.parametrize("autocast_dtype", [None, torch.bfloat16])
def test_measured_table_keeps_nothing_alive(autocast_dtype):
    # a pack hook that kept a saved output closed a cycle through autograd's C++ nodes: every unit's
    # activations and 16-bit weight copies stayed allocated (65 MiB of a 520 MiB budget on the H100)
    units, _ = sequential_units(_model())
    x = torch.randn(2, 3, S, S)
    before = _tensors_alive()
    measure_layers(units, x, autocast_dtype=autocast_dtype)
    # <=, not ==: in the full suite other tests' tensors may be collected meanwhile (CI saw 716 -> 644);
    # the leak kept 230 more alive for this model's 5 units on the CPU
    assert _tensors_alive() <= before


def _train(inputs: str, evaluate: bool = False, poison=None, nonfinite=None, epochs=2, device="cpu",
           cuda_graph=True, n=N, block_inputs="cache", noise=0.01, autocast_dtype=None, curvature=None):
    """Train the tiny model; evaluate: every exit so far after every epoch (as the demo does);
    poison(call, batch) -> batch: block 0's input at its call-th fetch."""
    model = _model()
    units, clf = sequential_units(model)
    _, plan = _plan(units, block_inputs=block_inputs)
    model.to(device)
    tr = LocalTrainer(units, clf, plan, num_classes=K, device=device, lr=0.05, lr_batch=16, autocast_dtype=autocast_dtype,
                      inputs=inputs, cache_dtype=torch.float32, seed=0, nonfinite=nonfinite,
                      lr_factor=lambda seen, total: 1.0 - seen / total, cuda_graph=cuda_graph, curvature=curvature)
    x, y = (t[:n].to(device) for t in _data())
    views = [torch.flip(x, dims=[3]), x + 0.1]        # two fixed "augmentations"
    gen = torch.Generator().manual_seed(1)
    calls = [0]

    def augment(xb):                                   # block 0: fresh noise every step
        calls[0] += 1
        out = xb + noise * torch.randn(xb.shape, generator=gen).to(xb.device) if noise else xb
        return out if poison is None else poison(calls[0], out)

    def on_epoch(b, e, loss, seconds):
        tr.evaluate_exits(x, y, lambda v: v, upto=b + 1)

    recs = tr.train(x, y, augment, views, lambda v: v, epochs=epochs, on_epoch=on_epoch if evaluate else None)
    return tr, plan, recs


@pytest.fixture(scope="module")
def cached():
    return _train(inputs="cache")


def test_cached_equals_recomputed_fp32(cached):
    a, plan, ra = cached
    b, _, rb = _train(inputs="recompute")
    assert len(plan.blocks) >= 3
    for ma, mb in zip([*a.units, *a.heads], [*b.units, *b.heads]):
        for (na, pa), (_, pb) in zip(ma.state_dict().items(), mb.state_dict().items()):
            torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6, msg=na)
    for x, y in zip(ra, rb):
        assert x.steps == y.steps and x.batch == y.batch
        assert x.epoch_losses == pytest.approx(y.epoch_losses, rel=1e-5)


def test_export_matches_trained_prefix(cached):
    tr, plan, _ = cached
    x, y = _data(1)
    params = tr.exit_params()
    for b, blk in enumerate(plan.blocks):
        exported = tr.export(b)
        assert exported.param_count == params[b]
        with torch.no_grad():
            h = x
            for m in tr.units[:blk.stop]:
                h = m.eval()(h)
            ref = tr.heads[b].eval()(h)
            torch.testing.assert_close(exported(x), ref, rtol=0, atol=0)
    assert params == sorted(params) or len(set(params)) == len(params)
    accs = tr.evaluate_exits(x, y, lambda v: v, batch=16)
    assert len(accs) == len(plan.blocks) and all(0.0 <= a <= 1.0 for a in accs)
    # the last block keeps the model's classifier: its exit is the whole model
    assert params[-1] == sum(p.numel() for m in tr.units for p in m.parameters()) + \
        sum(p.numel() for p in tr.heads[-1].parameters())


def _assert_same_state(a, b):
    for ma, mb in zip([*a.units, *a.heads], [*b.units, *b.heads]):
        for (na, pa), (_, pb) in zip(ma.state_dict().items(), mb.state_dict().items()):
            torch.testing.assert_close(pa, pb, rtol=0, atol=0, msg=na)


def test_evaluating_exits_between_epochs_changes_nothing(cached):
    """The demo evaluates each exit after each epoch; that left the block in eval mode, so its later
    epochs trained on BatchNorm running statistics (issue 18: block 0 diverged at peak LR)."""
    a, _, ra = cached
    b, _, rb = _train(inputs="cache", evaluate=True)
    _assert_same_state(a, b)
    assert [r.epoch_losses for r in ra] == [r.epoch_losses for r in rb]


def test_finished_blocks_hold_no_gradients(cached):
    tr, _, recs = cached
    assert all(p.grad is None for m in [*tr.units, *tr.heads] for p in m.parameters())
    assert all(r.skipped_steps == 0 for r in recs)


def test_nonfinite_step_skipped_and_statistics_restored():
    """A step whose input is NaN is skipped (weights and momentum untouched), its BatchNorm statistics
    restored at the next check; the run goes on, finite."""
    def poison(call, xb):
        return torch.full_like(xb, float("nan")) if call == 3 else xb

    tr, _, recs = _train(inputs="cache", poison=poison, nonfinite=NonFinitePolicy(patience=2, check_every=2), epochs=1)
    assert recs[0].skipped_steps == 1 and all(r.skipped_steps == 0 for r in recs[1:])
    for m in [*tr.units, *tr.heads]:
        for name, t in m.state_dict().items():
            assert torch.isfinite(t.float()).all(), name
    assert all(torch.isfinite(torch.tensor(r.epoch_losses)).all() for r in recs)


@pytest.mark.parametrize("promote, graph", [(True, False), (False, False), (True, True)])
def test_nonfinite_steps_promote_the_block_to_fp32(monkeypatch, promote, graph):
    """The precision lever per block: under bf16 autocast, the read that finds block 0's skipped step
    promotes block 0 (its steps, its frozen forward and its exit) to FP32: its convs compute in fp32
    from then on, and its CUDA graph (the CPU stand-in) is released and captured again at the new
    dtype; later blocks stay bf16. With promote=False every block keeps bf16."""
    import triaccel.backends.torch.local as tl

    if graph:
        monkeypatch.setattr(tl, "GraphedStep", _FlakyGraph)
        monkeypatch.setattr(_FlakyGraph, "oom_at", ())
        monkeypatch.setattr(_FlakyGraph, "short_oom_at", ())
        _FlakyGraph.instances = []
        orig = tl.LocalTrainer.__init__

        def init(self, *a, **k):
            orig(self, *a, **k)
            self.cuda_graph = True
        monkeypatch.setattr(tl.LocalTrainer, "__init__", init)

    seen: list[tuple[int, torch.dtype]] = []   # (conv, output dtype) in call order, from training's start on
    handles = []

    def hook(module, args, out):
        if isinstance(module, torch.nn.Conv2d):
            seen.append((id(module), out.dtype))

    def poison(call, xb):
        if call == 1:   # block 0's first fetch: training starts (the plan's measurements ran at fp32)
            handles.append(torch.nn.modules.module.register_module_forward_hook(hook))
        return torch.full_like(xb, float("nan")) if call == 3 else xb

    policy = NonFinitePolicy(patience=2, check_every=2, promote=promote)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tr, _, recs = _train(inputs="cache", poison=poison, nonfinite=policy, epochs=1,
                                 autocast_dtype=torch.bfloat16)
    finally:
        for h in handles:
            h.remove()
    promoted = [str(w.message) for w in caught if "compute precision" in str(w.message)]
    assert recs[0].skipped_steps == 1
    blk0 = tr.plan.blocks[0]
    convs0 = {id(m) for u in [*tr.units[blk0.start:blk0.stop], tr.heads[0]] for m in u.modules()
              if isinstance(m, torch.nn.Conv2d)}   # block 0's units and head
    dtypes0 = [d for i, d in seen if i in convs0]
    later = [d for i, d in seen if i not in convs0]
    assert dtypes0[0] == torch.bfloat16
    if promote:
        assert recs[0].precision == "fp32" and recs[0].promoted_at == 4 and tr.block_dtypes[0] is None
        assert promoted == ["block 0: non-finite gradients skipped by step 4: compute precision bf16 -> fp32 "
                            "for the rest of the block"]
        assert dtypes0[-1] == torch.float32 and torch.float32 in dtypes0   # its later steps and forwards
    else:
        assert recs[0].precision == "bf16" and recs[0].promoted_at is None and not promoted
        assert set(dtypes0) == {torch.bfloat16}
    if graph:
        g0 = _FlakyGraph.instances[0]
        assert g0.released == promote and g0.captures == (2 if promote else 1)
    assert all(r.precision == "bf16" and r.promoted_at is None for r in recs[1:])
    assert tr.block_dtypes[1:] == [torch.bfloat16] * (len(recs) - 1)
    assert later and set(later) == {torch.bfloat16}   # later blocks' convs under bf16 autocast throughout
    assert all(torch.isfinite(torch.tensor(r.epoch_losses)).all() for r in recs)


def test_persistent_nonfinite_fails_loudly():
    def poison(call, xb):
        return torch.full_like(xb, float("nan")) if call >= 2 else xb

    with pytest.raises(NonFiniteTraining, match=r"block 0: the last [23] optimizer steps \(steps 1\.\."):
        _train(inputs="cache", poison=poison, nonfinite=NonFinitePolicy(patience=2, check_every=1))


def test_oom_at_batch_one_names_the_block():
    def poison(call, xb):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    with pytest.raises(BlockOutOfMemory, match=r"block 0 \(stem\.\..*planned batch .*smallest allowed batch 1.*"
                       r"live tensors: \d+ storages"):
        _train(inputs="cache", poison=poison)
    assert "storages" in live_tensors("cpu")


def test_trainer_refuses_mismatched_units():
    model = _model()
    units, clf = sequential_units(model)
    _, plan = _plan(units)
    with pytest.raises(ValueError, match="units"):
        LocalTrainer(units[:-1], clf, plan, num_classes=K, device="cpu", lr=0.1)
    tr = LocalTrainer(units, clf, plan, num_classes=K, device="cpu", lr=0.1, autocast_dtype=None)
    x, y = _data()
    with pytest.raises(ValueError, match="epochs"):
        tr.train(x, y, lambda v: v, [x], lambda v: v, epochs=[1])
    with pytest.raises(ValueError, match="export|b="):
        tr.export(len(plan.blocks))


@pytest.mark.parametrize("block_inputs", ["cache", "fresh"])
def test_demo_local_loop(tmp_path, block_inputs):
    """examples.cifar local_loop on a tiny synthetic CIFAR: summary fields and plots."""
    from examples.cifar.local_loop import parse_local_budget
    from examples.cifar.plots import plot_run
    from local_demo import check_block_inputs, run_local_demo

    summary = run_local_demo(tmp_path, "torch", block_inputs)
    nb = len(summary["plan"]["blocks"])
    assert nb >= 2 and len(summary["exit_accs"]) == nb == len(summary["exit_params"]) == len(summary["blocks"])
    assert summary["exported_params"] == summary["exit_params"][summary["chosen_exit"]]
    assert summary["param_reduction"] == pytest.approx(summary["model_params"] / summary["exported_params"])
    assert summary["memory_budget_bytes"] == 6 * 2**20
    assert all(b["peak_bytes"] <= summary["plan"]["usable_bytes"] for b in summary["plan"]["blocks"])
    check_block_inputs(summary, block_inputs)
    names = {p.name for p in plot_run(tmp_path / "log.jsonl", tmp_path)}
    assert {"local_blocks.png", "local_exits.png"} <= names
    assert summary["unmodelled_fixed_bytes"] is None     # no end-to-end probe on the CPU
    with pytest.raises(ValueError, match="e2e"):
        parse_local_budget("e2e:0")
    assert parse_local_budget("e2e:32") == (None, 32) and parse_local_budget("1KiB") == (1024, None)
    if block_inputs == "fresh":   # --block-epochs: each block its own count; --exit-eval end; --block-curvature;
        per = tuple(range(1, nb + 1))   # --head-pool
        again = run_local_demo(tmp_path / "per-block", "torch", block_inputs, block_epochs=per, exit_eval="end",
                               block_curvature=1, head_pool=2)
        assert again["local_options"]["head_pool"] == 2
        assert tuple(len(b["epoch_seconds"]) for b in again["blocks"]) == per
        records = [json.loads(line) for line in (tmp_path / "per-block" / "log.jsonl").read_text().splitlines()]
        blocks = [r for r in records if r["type"] == "block"]
        assert [len(r["lr_scales"]) for r in blocks] == list(per) and blocks[0]["lr_scales"][0] == pytest.approx(0.5)
        assert all(r["precision"] == "bf16" and r["promoted_at"] is None for r in blocks)
        epochs = [r for r in records if r["type"] == "epoch"]
        assert len(epochs) == sum(per) and all(r["test_acc"] is None for r in epochs)   # no per-epoch evaluation
        assert len(again["exit_accs"]) == nb and again["exit_eval_seconds"] > 0     # every exit, once, at the end
        assert {"local_blocks.png", "local_exits.png"} <= {p.name for p in plot_run(tmp_path / "per-block" / "log.jsonl",
                                                                                    tmp_path / "per-block")}


def test_unmodelled_fixed_bytes_from_end_to_end_peaks():
    from examples.cifar.local_loop import unmodelled_fixed_bytes

    # the H100 run of issue 18: data 184.8 MB, ResNet-18's 11,173,962 parameters; the line through
    # the two largest batches that ran (16 and 32), not the smallest
    probe = {8: 452680192, 16: 470555136, 32: 509057536, 64: None}
    got = unmodelled_fixed_bytes(probe, 184_800_000, 11_173_962)
    # the probe trains a copy (14 bytes per parameter) beside the model's own fp32 weights (4)
    assert got == 2 * 470555136 - 509057536 - 184_800_000 - 18 * 11_173_962
    # e2e:B's uncapped pair (B, 2B), here EfficientNet-B0's on the H100: 2B ran, so it counts
    assert unmodelled_fixed_bytes({32: 346044928, 64: 397019136}, 0, 0) == 2 * 346044928 - 397019136
    assert unmodelled_fixed_bytes({8: 100, 16: None}, 0, 0) is None
    assert unmodelled_fixed_bytes({8: 1000, 16: 1800}, 500, 0) == 0       # intercept 200 < data: never negative


def test_fresh_inputs_equal_a_cache_of_the_same_images_fp32():
    # "fresh": blocks after the first run the frozen prefix on block 0's (here deterministic)
    # augmentation every step; with one view equal to that augmentation, a cache gives the same
    # inputs, so both train alike. The fresh plan keeps no cache and needs no views.
    x, y = _data()

    def aug(v):
        return torch.flip(v, dims=[3]) * 0.9

    def run(block_inputs):
        model = _model()
        units, clf = sequential_units(model)
        table, base = _plan(units)
        cfg = LocalPlanConfig(memory_budget=base.memory_budget, batch_buckets=(8, 16), act_bytes=4, cache_bytes=4,
                              input_bytes=3 * S * S * 4, head_widths=(8, 16), max_blocks=4, block_inputs=block_inputs)
        plan = plan_local(table, cfg, num_samples=N, num_classes=K)
        tr = LocalTrainer(units, clf, plan, num_classes=K, device="cpu", lr=0.05, lr_batch=16, autocast_dtype=None,
                          cache_dtype=torch.float32, seed=0)
        views = [] if block_inputs == "fresh" else [x]
        recs = tr.train(x, y, aug, views, aug, epochs=2)
        return tr, plan, recs

    a, pa, ra = run("cache")
    b, pb, rb = run("fresh")
    assert [(k.start, k.stop, k.batch, k.head_width) for k in pa.blocks] == \
        [(k.start, k.stop, k.batch, k.head_width) for k in pb.blocks]
    assert all(k.input_cache == "fresh" and k.cache_bytes == 0 for k in pb.blocks[1:])
    assert pb.cache_views == 0 and pb.host_peak_bytes == 0
    for ma, mb in zip([*a.units, *a.heads], [*b.units, *b.heads]):
        for (na, t), (_, u) in zip(ma.state_dict().items(), mb.state_dict().items()):
            torch.testing.assert_close(t, u, rtol=1e-5, atol=1e-6, msg=na)
    assert [r.epoch_losses for r in ra] == [pytest.approx(r.epoch_losses, rel=1e-5) for r in rb]
    assert all(r.cache_seconds in (None, 0, 0.0) for r in rb)


def test_host_cache_bytes_reads_mem_available(tmp_path):
    from examples.cifar.local_loop import host_cache_bytes

    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       131072000 kB\nMemFree:          1048576 kB\nMemAvailable:   100000000 kB\n")
    assert host_cache_bytes(str(info)) == 100000000 * 1024 // 2
    assert host_cache_bytes(str(tmp_path / "absent")) > 0      # falls back to sysconf (or 8 GiB)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


@cuda
@pytest.mark.parametrize("block_inputs", ["cache", "fresh"])
def test_cuda_graph_trains_like_eager(block_inputs):
    """Each block's full-batch step captured once and replayed (an epoch's short last batch eager):
    the same weights, statistics and losses as eager steps, fp32."""
    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    n = N - 5                                  # every epoch ends on a short batch
    g, _, rg = _train("cache", device="cuda", cuda_graph=True, epochs=3, n=n, block_inputs=block_inputs)
    e, _, re = _train("cache", device="cuda", cuda_graph=False, epochs=3, n=n, block_inputs=block_inputs)
    for ma, mb in zip([*g.units, *g.heads], [*e.units, *e.heads]):
        for (na, pa), (_, pb) in zip(ma.state_dict().items(), mb.state_dict().items()):
            torch.testing.assert_close(pa, pb, rtol=1e-4, atol=1e-5, msg=na)
    for a, b in zip(rg, re):
        assert a.steps == b.steps and not a.graph_note and a.graph_pool_bytes is not None and b.graph_pool_bytes is None
        assert a.graph_steps == a.steps - 3 - 3 and b.graph_steps == 0   # 3 warm-ups, 3 short batches
        assert a.epoch_losses == pytest.approx(b.epoch_losses, rel=1e-4)


@cuda
def test_cuda_graph_skips_a_nonfinite_replay():
    def poison(call, xb):
        return torch.full_like(xb, float("nan")) if call == 6 else xb   # a replayed step (3 warm-ups)

    tr, _, recs = _train(inputs="cache", poison=poison, nonfinite=NonFinitePolicy(patience=2, check_every=2),
                         epochs=2, device="cuda")
    assert recs[0].graph_steps > 0 and recs[0].skipped_steps == 1
    for m in [*tr.units, *tr.heads]:
        for name, t in m.state_dict().items():
            assert torch.isfinite(t.float()).all(), name


def test_graph_warmup_steps_start_without_gradients():
    """A warm-up step runs at the eager step's peak: the gradients a step zeroes in place
    (`zero_grad(set_to_none=False)`, which the capture needs) are dropped before each warm-up, not held
    through its forward (one gradient set above the eager peak ran every warm-up out of memory under
    issue 18's cap). The step itself still sees zeroed gradients: the same update as in place."""
    from triaccel.backends.torch.cuda_graph import GraphedStep

    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.1)
    seen = []

    def step(x):
        seen.append(w.grad is None)
        opt.zero_grad(set_to_none=False)
        (w * x).sum().backward()
        opt.step()

    g = GraphedStep(step, [w], warmup=3)
    for _ in range(3):
        g(torch.full((3,), 2.0))
    assert seen == [True, True, True] and w.grad is not None and g.calls == 3 and not g.captured
    assert torch.allclose(w.detach(), torch.full((3,), 1.0 - 3 * 0.1 * 2.0))


class _FlakyGraph:
    """Stands in for GraphedStep on the CPU: runs the step eagerly, "captures" at the 4th call, and
    raises torch's OOM at block 0's calls listed in `oom_at` (0-based, counting every call)."""

    instances: list = []
    oom_at: tuple = ()
    short_oom_at: tuple = ()   # block 0's short-batch (run_eager) calls that raise, 0-based

    def __init__(self, fn, params, warmup=3, stream=None):
        self.fn, self.warmup, self.calls, self.attempts, self.warmup_ooms = fn, warmup, 0, 0, 0
        self.short_attempts, self.captures = 0, 0
        self.captured, self.released, self.pool_bytes = False, False, 123
        _FlakyGraph.instances.append(self)

    def release(self):
        self.captured, self.calls, self.released = False, 0, True

    def run_eager(self, x, y):
        self.short_attempts += 1
        if self is _FlakyGraph.instances[0] and self.short_attempts - 1 in self.short_oom_at:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated, beside the pool)")
        self.fn(x, y)

    def __call__(self, x, y):
        self.attempts += 1
        if self is _FlakyGraph.instances[0] and self.attempts - 1 in self.oom_at:   # block 0's only
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        self.fn(x, y)
        self.calls += 1
        if not self.captured and self.calls > self.warmup:
            self.captured, self.captures = True, self.captures + 1


@pytest.mark.parametrize("oom_at, note, retries", [
    ((0, 1, 2), "", 0),                 # warm-up OOMs: the eager step, then the capture
    ((3,), "", 1),                      # a failed capture: warm up and capture again, half the micro-batch
    ((0, 1, 2, 3), "", 1),              # the WARMUP_OOMS+1-th warm-up OOM: the same
    ((6,), "", 1),                      # an OOM beside the captured graph: the same
    ((3, 7), "", 2),                    # the first retry fails too: a quarter of the batch
    (tuple(range(3, 10_000)), "step", 2)])   # every retry fails: eager steps for the block
def test_graph_fallbacks_lose_no_sample(monkeypatch, oom_at, note, retries):
    """Warm-up OOMs fall back to the eager step (up to WARMUP_OOMS), a failed capture or an OOM beside a
    captured graph releases it and, GRAPH_RETRIES times, warms up and captures again at half the
    micro-batch (gradients accumulated over the batch), then trains the block eagerly: every step
    still trains its whole batch once, a graphed one in micro-batches of the recorded size."""
    import triaccel.backends.torch.local as tl

    monkeypatch.setattr(tl, "GraphedStep", _FlakyGraph)
    monkeypatch.setattr(_FlakyGraph, "oom_at", ())
    _FlakyGraph.instances = []
    orig = tl.LocalTrainer.__init__

    def init(self, *a, **k):
        orig(self, *a, **k)
        self.cuda_graph = True          # the graph path on the CPU, through the stand-in
    monkeypatch.setattr(tl.LocalTrainer, "__init__", init)
    # deterministic block-0 inputs: a failed attempt's fetch would otherwise consume augmentation draws
    _, _, ref = _train("cache", epochs=2, n=N - 5, noise=0)     # the stand-in never failing: the reference
    monkeypatch.setattr(_FlakyGraph, "oom_at", oom_at)
    _FlakyGraph.instances = []
    seen: list[int] = []                # the batch sizes block 0's first unit ran forward on

    made = _model

    def hooked(seed: int = 0):
        model = made(seed)
        model.conv1.register_forward_pre_hook(lambda m, a: seen.append(int(a[0].shape[0])))
        return model
    monkeypatch.setitem(globals(), "_model", hooked)
    _, plan, recs = _train("cache", epochs=2, n=N - 5, noise=0)
    first, batch = recs[0], plan.blocks[0].batch
    assert [r.steps for r in recs] == [r.steps for r in ref]
    assert all(r.ooms == 0 for r in recs)            # the fallbacks never reached the elastic OOM path
    assert (note in first.graph_note) and (bool(first.graph_note) == bool(note))
    assert first.graph_retries == retries and _FlakyGraph.instances[0].released == bool(retries)
    assert first.graph_micro_batch == batch // 2 ** retries
    assert _FlakyGraph.instances[0].captured == (not note)
    if note:
        assert f"{note} at step" in first.graph_note and first.graph_steps == 0
    else:
        assert first.graph_steps > 0
        # every replayed step ran its full batch as batch / micro-batch forwards of the micro-batch
        assert seen.count(first.graph_micro_batch) >= first.graph_steps * (batch // first.graph_micro_batch)
    # every block but the first trained through the stand-in without failures, in whole batches
    assert all(not r.graph_note and r.graph_steps == r.steps - 3 - 2 and r.graph_pool_bytes == 123
               and r.graph_micro_batch == r.batch for r in recs[1:])
    if retries == 0:
        for a, b in zip(recs, ref):
            assert a.epoch_losses == pytest.approx(b.epoch_losses, rel=1e-5)
    else:   # BatchNorm normalises each micro-batch on its own statistics: close, not equal
        for a, b in zip(recs, ref):
            assert all(np.isfinite(a.epoch_losses)) and a.epoch_losses == pytest.approx(b.epoch_losses, rel=0.05)


def test_short_batch_oom_beside_the_graph_recaptures(monkeypatch):
    """An epoch's short last batch that runs out of memory beside the graph's pool: the graph is
    released for it (the elastic path trains it) and captured again from the next epoch's full
    batches; no sample lost, the same steps and losses, the block keeps its replays."""
    import triaccel.backends.torch.local as tl

    monkeypatch.setattr(tl, "GraphedStep", _FlakyGraph)
    orig = tl.LocalTrainer.__init__

    def init(self, *a, **k):
        orig(self, *a, **k)
        self.cuda_graph = True
    monkeypatch.setattr(tl.LocalTrainer, "__init__", init)
    monkeypatch.setattr(_FlakyGraph, "oom_at", ())
    monkeypatch.setattr(_FlakyGraph, "short_oom_at", ())
    _FlakyGraph.instances = []
    _, _, ref = _train("cache", epochs=3, n=N - 5, noise=0)
    monkeypatch.setattr(_FlakyGraph, "short_oom_at", (0,))   # epoch 1's short batch
    _FlakyGraph.instances = []
    _, _, recs = _train("cache", epochs=3, n=N - 5, noise=0)
    first, g = recs[0], _FlakyGraph.instances[0]
    assert not first.graph_note and first.graph_recaptures == 1 and g.captures == 2
    assert [r.steps for r in recs] == [r.steps for r in ref] and all(r.ooms == 0 for r in recs)
    # the 3 warm-up steps again after the release: 3 fewer replays than the reference
    assert first.graph_steps == ref[0].graph_steps - 3
    assert all(r.graph_recaptures == 0 for r in recs[1:])
    for a, b in zip(recs, ref):
        assert a.epoch_losses == pytest.approx(b.epoch_losses, rel=1e-5)


def test_curvature_lever_scales_each_block_lr():
    """The curvature lever per block: a measurement at each block's epoch ends, the block's LR scaled
    by the core's 1 / (1 + alpha * lambda_max), alpha calibrated at the run's first measurement
    (block 0's first scale is 1/2); block 0's first epoch, before any measurement, trains as without
    the lever, its second one at the scaled LR."""
    from triaccel.local_plan import BlockCurvature

    curv = BlockCurvature(every=1, samples=16)
    tr, _, recs = _train(inputs="cache", epochs=2)
    tc, _, rc = _train(inputs="cache", epochs=2, curvature=curv)
    assert [len(r.lr_scales) for r in rc] == [2] * len(rc)
    assert rc[0].lr_scales[0] == pytest.approx(0.5)
    assert all(0 < s <= 1 for r in rc for s in r.lr_scales)
    assert [len(v) for v in curv.lam_max.values()] == [2] * len(rc) and curv.alpha == 1 / curv.lam_max[0][0]
    # the first epoch of block 0 trains at scale 1: the same loss as without the lever; later ones differ
    assert rc[0].epoch_losses[0] == pytest.approx(recs[0].epoch_losses[0], rel=1e-6)
    assert rc[0].epoch_losses[1] != pytest.approx(recs[0].epoch_losses[1], rel=1e-6)
    assert all(r.lr_scales == [] for r in recs)


def test_curvature_measurement_halves_its_rows_on_oom(monkeypatch):
    """A curvature measurement that runs out of memory is repeated on the first half of its rows
    (halving_on_oom), and the core records what it read."""
    import triaccel.backends.torch.local as tl
    from triaccel.local_plan import BlockCurvature

    real = tl.CurvatureEstimator.__call__

    def small_only(self, batch):
        if batch[0].shape[0] > 4:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(self, batch)

    # The measurement's free_memory() after each simulated OOM, counted instead of run: nothing was
    # allocated to free, and its gc.collect() costs ~1 s a call in the full suite's heap (48 calls here)
    frees = [0]
    real_measure = BlockCurvature.measure

    def measure(self, block, eigvals_of, rows, *, is_oom, free_memory):
        assert free_memory is tl.free_memory   # the backend's own

        def counted():
            frees[0] += 1
        return real_measure(self, block, eigvals_of, rows, is_oom=is_oom, free_memory=counted)

    monkeypatch.setattr(BlockCurvature, "measure", measure)
    monkeypatch.setattr(tl.CurvatureEstimator, "__call__", small_only)
    curv = BlockCurvature(every=2, samples=16)
    _, _, recs = _train(inputs="cache", epochs=2, curvature=curv)
    assert all(len(r.lr_scales) == 1 for r in recs)
    assert curv.samples_used == {b: [4] for b in range(len(recs))}
    assert frees[0] == 2 * len(recs)   # after the OOMs at 16 and 8 rows

    def never(self, batch):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(tl.CurvatureEstimator, "__call__", never)   # not even one row fits: scale kept
    curv, frees[0] = BlockCurvature(every=1, samples=16), 0
    with pytest.warns(RuntimeWarning, match="block 0: curvature measurement out of memory at one row"):
        _, _, recs = _train(inputs="cache", epochs=2, curvature=curv)
    assert all(r.lr_scales == [1.0, 1.0] for r in recs) and curv.samples_used == {}
    assert frees[0] == 5 * 2 * len(recs)   # after the OOMs at 16, 8, 4 and 2 rows, and the one at 1



def test_memory_probes_leave_the_training_augmentations_alone():
    """The end-to-end probes augment with a generator of their own: training's augmented batches are
    the same whether or not (and however often) a probe ran before."""
    from examples.cifar.local_loop import augmenters

    x = torch.randint(0, 256, (8, 32, 32, 3), dtype=torch.uint8)
    prep = lambda xb: xb.float()   # noqa: E731
    train, probe = augmenters(prep, torch.device("cpu"), seed=3)
    first = train(x)
    train, probe = augmenters(prep, torch.device("cpu"), seed=3)
    for _ in range(5):
        probe(x)
    assert torch.equal(train(x), first)
    assert not torch.equal(probe(x), train(x))   # not the same stream either
