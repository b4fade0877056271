"""The torch `wrap` optimizer on a small CNN (CPU): training, precision, LR, state, non-finite, ablations."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from paper import paper_config
from triaccel import Decision, Precision, TriAccelConfig
from triaccel.backends.torch import MemoryProbe, MemoryReading, wrap
from triaccel.backends.torch.layers import discover_layers
from triaccel.backends.torch.precision import PrecisionPlan

pytestmark = pytest.mark.filterwarnings("ignore:MemoryProbe")


@pytest.fixture(autouse=True)
def _one_thread():
    # tiny models: thread start-up and oversubscription on the 2-core CI machine cost more than they give
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc1 = nn.Linear(8 * 4, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.adaptive_avg_pool2d(F.relu(self.conv2(x)), 2).flatten(1)
        return self.fc2(F.relu(self.fc1(x)))


def _data(n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 4, (n,), generator=g)
    x = torch.randn(n, 3, 8, 8, generator=g) * 0.5
    x[:, 0] += y.view(-1, 1, 1).float()  # learnable signal
    return x, y


CFG = paper_config(t_ctrl=4, warmup_steps=8, min_dwell=4, t_curv=8, top_k=2, b_curv=8,
                     batch_init=16, batch_min=8, batch_max=64)


def _train(opt, model, x, y, steps: int, bs: int = 16, sched=None, record=None) -> list[float]:
    losses = []
    for i in range(steps):
        idx = torch.arange(i * bs, (i + 1) * bs) % x.shape[0]
        with opt.autocast():
            loss = F.cross_entropy(model(x[idx]), y[idx])
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        if record is not None:
            record.append(opt.decision.to_dict())
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("make", [lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
                                  lambda p: torch.optim.AdamW(p, lr=1e-2)], ids=["sgd", "adamw"])
def test_loss_falls_with_all_levers(make) -> None:
    torch.manual_seed(0)
    model = SmallCNN()
    x, y = _data()
    opt = wrap(make(model.parameters()), model, CFG, curvature_data=(x[:8], y[:8]))
    losses = _train(opt, model, x, y, 28)
    assert np.mean(losses[-4:]) < 0.7 * np.mean(losses[:4])
    rep = opt.report()
    assert rep["optimizer_step"] == 28 and rep["skipped_steps"] == 0
    assert all(v["eigvals"] is not None for v in rep["layers"].values())
    assert all(p.isfinite().all() for p in model.parameters())


def _observe_dtypes(model: nn.Module, layers):
    seen: dict[str, torch.dtype] = {}
    handles = [l.module.register_forward_hook(
        lambda mod, args, out, n=l.name: seen.__setitem__(n, out.dtype), prepend=True) for l in layers]
    return seen, handles


@pytest.mark.parametrize("assign", [
    {"conv1": "bf16", "conv2": "fp16", "fc1": "fp32", "fc2": "bf16"},   # 16-bit majority + exceptions
    {"conv1": "fp32", "conv2": "fp32", "fc1": "bf16", "fc2": "fp16"},   # FP32 majority + exceptions
    {"conv1": "fp16", "conv2": "fp16", "fc1": "fp16", "fc2": "fp16"},   # uniform: no hook at all
])
def test_module_compute_dtype_equals_plan(assign) -> None:
    model = SmallCNN()
    layers = discover_layers(model)
    plan = PrecisionPlan(layers, "cpu")
    precs = [Precision.FP32 if l.spec.kind == "norm" else Precision.parse(assign[l.name]) for l in layers]
    plan.apply(precs)
    seen, handles = _observe_dtypes(model, layers)
    x, y = _data(8)
    with plan.region():
        out = model(x)
    F.cross_entropy(out.float(), y).backward()
    for l, p in zip(layers, precs):
        if l.spec.kind == "norm":
            assert all(q.dtype == torch.float32 for _, q in l.params)
        else:
            assert seen[l.name] == {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[p.short], l.name
    if len(set(assign.values())) == 1:
        assert plan.hooked == ()
    # outside the region the same model computes in FP32
    seen.clear()
    model(x)
    assert set(seen.values()) == {torch.float32}
    for h in handles:
        h.remove()


def test_xla_kernels_are_jax_only() -> None:
    model = nn.Linear(4, 2)
    with pytest.raises(ValueError, match="kernels='xla': JAX only"):
        wrap(torch.optim.SGD(model.parameters(), lr=0.1), model, TriAccelConfig(kernels="xla"))


def test_statistics_ring_rows_and_flags_start_16_byte_aligned() -> None:
    """The statistics kernel is specialised on its output pointers' alignment: every ring row and
    every row's non-finite flag starts on a 16-byte boundary (one compilation, not one per offset),
    and the rows stay (n_tensors, 3) contiguous views of the ring."""
    model = SmallCNN()
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.1), model, CFG.replace(t_ctrl=7))
    n = len(list(model.parameters()))
    assert n % 4 != 0   # rows of 3 x n floats would not all be aligned without padding
    rows, flags = opt._buf_rows, opt._found_slots
    assert len(rows) == len(flags) == 7 and opt._buf.shape == (7, n, 3)
    assert all(r.shape == (n, 3) and r.is_contiguous() and r.data_ptr() % 16 == 0 for r in rows)
    assert all(f.shape == (1,) and f.data_ptr() % 16 == 0 for f in flags)
    assert all(z.dim() == 0 and z.data_ptr() == f.data_ptr() for z, f in zip(opt._found_0d, flags))


@pytest.mark.parametrize("base", ["bf16", "fp16"])
def test_prepare_kernels_leaves_state_and_training_as_they_were(base: str) -> None:
    """prepare_kernels() launches the statistics once over the parameters (FP16: over copies, as an
    unscaling launch writes back) and changes nothing: parameters, ring, counters; training after it
    equals training without it."""
    x, y = _data()
    runs = []
    for prepare in (False, True):
        torch.manual_seed(0)
        model = SmallCNN()
        opt = wrap(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model,
                   CFG.replace(curvature="off", base_precision=base))
        if prepare:
            before = [p.detach().clone() for p in model.parameters()]
            ring = opt._buf.clone()
            opt.prepare_kernels()
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
            assert torch.equal(opt._buf, ring) and opt.step_count == 0 and opt._rows == []
            assert float(opt._found_ring.sum()) == 0.0
        runs.append((_train(opt, model, x, y, 6), [p.detach().clone() for p in model.parameters()]))
    (l0, p0), (l1, p1) = runs
    assert l0 == l1 and all(torch.equal(a, b) for a, b in zip(p0, p1))


def test_strict_norm_runs_norms_in_fp32() -> None:
    model = SmallCNN()
    layers = discover_layers(model)
    plan = PrecisionPlan(layers, "cpu", strict_norm=True)
    plan.apply([Precision.FP32 if l.spec.kind == "norm" else Precision.BF16 for l in layers])
    seen, handles = _observe_dtypes(model, layers)
    with plan.region():
        model(_data(4)[0])
    assert seen["bn1"] == torch.float32 and seen["conv1"] == torch.bfloat16
    assert plan.hooked == ("bn1",)
    for h in handles:
        h.remove()


def test_wrapper_dtypes_follow_decisions_during_training() -> None:
    torch.manual_seed(0)
    model = SmallCNN()
    x, y = _data()
    cfg = CFG.replace(curvature="off", calibration_quantiles=(0.3, 0.7), hysteresis=0.0, min_dwell=0)
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.05), model, cfg)
    seen, handles = _observe_dtypes(model, opt.layers)
    dts = {Precision.FP16: torch.float16, Precision.BF16: torch.bfloat16, Precision.FP32: torch.float32}
    mixed = False
    for i in range(16):
        idx = torch.arange(i * 16, (i + 1) * 16) % 64
        d = opt.decision
        with opt.autocast():
            loss = F.cross_entropy(model(x[idx]), y[idx])
        for l, p in zip(opt.layers, d.precisions):
            if l.spec.kind != "norm":
                assert seen[l.name] == dts[p], (i, l.name)
        mixed |= len({p for l, p in zip(opt.layers, d.precisions) if l.spec.kind != "norm"}) > 1
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
    assert mixed, "the calibrated thresholds should give a mixed assignment on this model"
    for h in handles:
        h.remove()


def _fixed_decision(opt, mults: np.ndarray) -> Decision:
    d = opt.decision
    return Decision(step=d.step, precisions=d.precisions, lr_scales=np.asarray(mults, dtype=np.float64),
                    lr_batch_scale=1.0, batch_size=d.batch_size, accumulation=1, logical_batch=d.batch_size)


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_per_layer_multipliers_scale_scheduler_lr(kind: str) -> None:
    """Update scaling == an optimizer with one group per layer at lr = scheduler lr * multiplier."""
    torch.manual_seed(0)
    model = SmallCNN()
    ref_model = copy.deepcopy(model)
    x, y = _data()
    cfg = CFG.replace(curvature="off", adaptive_precision=False, base_precision="fp32", elastic_batch=False)
    layers = discover_layers(model)
    mults = np.linspace(0.2, 1.0, len(layers))

    def make(params):
        if kind == "sgd":
            return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3, nesterov=True)
        # eps large enough that Adam does not blow up round-off in ~zero gradients (conv1.bias sits
        # before a BatchNorm) into full-size steps: the comparison is about the lr path
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=1e-2, eps=1e-3)

    opt = wrap(make(model.parameters()), model, cfg)
    fixed = _fixed_decision(opt, mults)
    opt.controller.decide = lambda step: fixed  # a fixed per-layer decision: tests the application path
    opt._apply(fixed)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ref_layers = discover_layers(ref_model)
    base_lr = 0.1 if kind == "sgd" else 1e-2
    ref = make([{"params": [p for _, p in l.params], "lr": base_lr * m} for l, m in zip(ref_layers, mults)])
    ref_sched = torch.optim.lr_scheduler.StepLR(ref, step_size=2, gamma=0.5)
    for i in range(6):
        idx = torch.arange(i * 16, (i + 1) * 16) % 64
        for mdl, o in ((model, opt), (ref_model, ref)):
            loss = F.cross_entropy(mdl(x[idx]), y[idx])
            loss.backward()
            o.step()
            o.zero_grad()
        sched.step()
        ref_sched.step()
        # the user's group keeps the scheduler's lr (multipliers are not written into it)
        assert opt.param_groups[0]["lr"] == pytest.approx(base_lr * 0.5 ** ((i + 1) // 2))
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_uniform_multiplier_scales_lr_around_step() -> None:
    torch.manual_seed(0)
    model = SmallCNN()
    ref_model = copy.deepcopy(model)
    x, y = _data()
    cfg = CFG.replace(curvature="off", adaptive_precision=False, base_precision="fp32")
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model, cfg)
    fixed = _fixed_decision(opt, np.full(len(opt.layers), 0.25))
    opt.controller.decide = lambda step: fixed
    opt._apply(fixed)
    ref = torch.optim.SGD(ref_model.parameters(), lr=0.025, momentum=0.9)
    for mdl, o in ((model, opt), (ref_model, ref)):
        for i in range(3):
            F.cross_entropy(mdl(x[:16]), y[:16]).backward()
            o.step()
            o.zero_grad()
    assert opt.param_groups[0]["lr"] == 0.1
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q)


def test_state_dict_round_trip_resumes_identically() -> None:
    torch.manual_seed(0)
    x, y = _data()
    cfg = CFG.replace(curvature="hessian", t_ctrl=2, t_curv=4, warmup_steps=4, min_dwell=2)

    def build(model):
        opt = wrap(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model, cfg,
                   curvature_data=(x[:8], y[:8]), hessian_iters=1, hessian_iters_cold=3)
        return opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=40)

    model = SmallCNN()
    opt, sched = build(model)
    _train(opt, model, x, y, 7, sched=sched)   # stops between boundaries: pending statistics rows
    assert opt._rows, "the checkpoint should carry statistics not yet fed to the controller"
    ckpt = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()})
    rec_a: list = []
    _train(opt, model, x, y, 8, sched=sched, record=rec_a)

    model_b = SmallCNN()
    opt_b, sched_b = build(model_b)
    model_b.load_state_dict(ckpt["model"])
    opt_b.load_state_dict(ckpt["opt"])
    sched_b.load_state_dict(ckpt["sched"])
    rec_b: list = []
    _train(opt_b, model_b, x, y, 8, sched=sched_b, record=rec_b)
    # Identical decisions; LR scales to round-off (the Hessian estimator's warm start is restored
    # bit for bit, but its eigen-solves on the resumed run may differ in the last bits).
    for a, b in zip(rec_a, rec_b):
        sa, sb = a.pop("lr_scales"), b.pop("lr_scales")
        assert a == b and np.allclose(sa, sb, rtol=1e-9, atol=0), (a["step"], sa, sb)
    for p, q in zip(model.parameters(), model_b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    da, db = opt.controller.state_dict()["decision"], opt_b.controller.state_dict()["decision"]
    assert np.allclose(da.pop("lr_scales"), db.pop("lr_scales"), rtol=1e-9, atol=0) and da == db


def _poison_step(opt, model, x, y) -> None:
    with opt.autocast():
        loss = F.cross_entropy(model(x[:16]), y[:16])
    opt.backward(loss)
    model.conv2.weight.grad[0, 0, 0, 0] = float("nan")
    model.fc1.bias.grad[1] = float("inf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("base,optim,host_check", [
    ("fp32", "rmsprop", True),    # host check asked for: one sync per step
    ("fp16", "rmsprop", False),   # FP16 active, non-fused optimizer: host check (GradScaler-like)
    ("fp16", "fused", False),     # fused: skipped on the device, no sync
    ("fp32", "fused", False),
    ("fp16", "sgd", False),       # plain SGD: stepped with the fused SGD kernel, device skip
], ids=["fp32-hostcheck", "fp16-rmsprop", "fp16-fused", "fp32-fused", "fp16-sgd"])
def test_nonfinite_gradients_skip_the_step(base: str, optim: str, host_check: bool) -> None:
    torch.manual_seed(0)
    model = SmallCNN()
    x, y = _data()
    cfg = CFG.replace(curvature="off", adaptive_precision=False, base_precision=base)
    if optim == "rmsprop":
        inner = torch.optim.RMSprop(model.parameters(), lr=1e-3, momentum=0.9)
    else:
        inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, fused=optim == "fused" or None)
    opt = wrap(inner, model, cfg, host_check=host_check)
    fused = optim != "rmsprop"
    assert opt._device_guard == fused
    _train(opt, model, x, y, 2)
    before = [p.detach().clone() for p in model.parameters()]
    state_before = {k: {n: t.clone() for n, t in v.items()} for k, v in opt.state.items()}
    scale_before = opt.scaler.scale
    _poison_step(opt, model, x, y)
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p, q) and p.isfinite().all()
    for k, v in opt.state.items():
        assert all(torch.equal(t, state_before[k][n]) for n, t in v.items())
    assert opt.step_count == 3
    if base == "fp16":
        assert opt.fp16_active and opt.scaler.scale == scale_before * 0.5
    if fused:
        assert opt._rows[-1][1] == 3 - 1  # _ROW_DEVICE: counted at the next flush, no sync now
        assert float(opt._found_ring[len(opt._rows) - 1]) == 1.0   # set by the statistics launch
        opt._flush()
        assert float(opt._found_ring.abs().sum()) == 0.0   # zeroed for the ring's next cycle
    assert opt.skipped_steps == 1 and opt.nonfinite_steps == 0
    # training continues and the skipped step's statistics never reach the controller
    _train(opt, model, x, y, 6)
    assert all(p.isfinite().all() for p in model.parameters())
    ema = [v["var_ema"] for v in opt.report()["layers"].values()]
    assert all(e is not None and np.isfinite(e) for e in ema)
    assert opt.skipped_steps == 1


def test_aborted_nonfinite_step_leaves_no_flag_to_its_replay(monkeypatch) -> None:
    """The statistics launch sets a ring row's non-finite flag and never clears it: a step aborted
    after it (an OOM in the inner step) must not leave 1.0 to the replay that reuses the row."""
    torch.manual_seed(0)
    model = SmallCNN()
    x, y = _data()
    cfg = CFG.replace(curvature="off", adaptive_precision=False, base_precision="fp32")
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, fused=True), model, cfg)
    _train(opt, model, x, y, 2)
    real = opt._inner_step

    def oom() -> None:
        raise torch.OutOfMemoryError("simulated")

    monkeypatch.setattr(opt, "_inner_step", oom)
    slot = len(opt._rows)
    with pytest.raises(torch.OutOfMemoryError):
        _poison_step(opt, model, x, y)
    assert float(opt._found_ring[slot]) == 0.0 and len(opt._rows) == slot
    monkeypatch.setattr(opt, "_inner_step", real)
    opt.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    _train(opt, model, x, y, 1)   # the replay, finite: it must update the weights
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    opt._flush()
    assert opt.skipped_steps == 0


def test_fused_first_step_is_checked_on_host() -> None:
    """A fused SGD skipped on its first step would keep uninitialised momentum: checked on the host."""
    torch.manual_seed(0)
    model = SmallCNN()
    x, y = _data()
    cfg = CFG.replace(curvature="off", adaptive_precision=False, base_precision="fp32")
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model, cfg)   # SGD: fused kernel
    before = [p.detach().clone() for p in model.parameters()]
    _poison_step(opt, model, x, y)
    assert opt.skipped_steps == 1 and not opt._device_guard_ready and len(opt.state) == 0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    _train(opt, model, x, y, 3)
    assert opt._device_guard_ready
    assert all(v["momentum_buffer"].isfinite().all() for v in opt.state.values())


def test_unguarded_nonfinite_is_reported_at_flush() -> None:
    """No FP16, non-fused, no host_check: AMP-bf16 semantics (no per-step sync), found at the flush."""
    torch.manual_seed(0)
    model = SmallCNN()
    x, y = _data()
    cfg = CFG.replace(curvature="off", adaptive_precision=False, base_precision="bf16")
    opt = wrap(torch.optim.Adam(model.parameters(), lr=1e-3), model, cfg)   # non-fused: no guard
    observed: list[int] = []
    feed = opt.controller.observe_grad_moments_rows
    opt.controller.observe_grad_moments_rows = lambda steps, *a: (observed.extend(steps), feed(steps, *a))
    _train(opt, model, x, y, 2)
    _poison_step(opt, model, x, y)
    assert not model.conv2.weight.isfinite().all()   # not protected: as under AMP-bf16
    assert opt.nonfinite_steps == 0 and opt._rows[-1][1] == 3
    with pytest.warns(RuntimeWarning, match="reached the weights"):
        opt._flush()
    assert opt.nonfinite_steps == 1 and opt.skipped_steps == 0
    with torch.no_grad():   # repair by hand; the poisoned step's statistics were not observed
        for p in model.parameters():
            p.nan_to_num_(0.0, 0.0, 0.0)
        for st in opt.state.values():
            for t in st.values():
                t.nan_to_num_(0.0, 0.0, 0.0)
    _train(opt, model, x, y, 4)
    opt._flush()
    assert observed == [0, 1, 3, 4, 5, 6]   # step 2 (non-finite) never reached the controller
    ema = [v["var_ema"] for v in opt.report()["layers"].values()]
    assert all(e is not None and np.isfinite(e) for e in ema)


class FakeProbe(MemoryProbe):
    """Reports a fixed fraction of a 1 GiB device as this process's peak."""

    def __init__(self, frac: float) -> None:
        self.frac, self.available, self.reads = frac, True, 0

    def read(self) -> MemoryReading:
        self.reads += 1
        total = 2**30
        return MemoryReading(int(self.frac * total), total, total, total // 10, 0, None)


def test_memory_drives_batch_and_accumulation() -> None:
    torch.manual_seed(0)
    model = SmallCNN()
    x, y = _data()
    cfg = CFG.replace(curvature="off", lr_rule="accumulate", batch_min=8, delta_down=8)
    probe = FakeProbe(0.95)
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.05), model, cfg, memory_probe=probe)
    _train(opt, model, x, y, 5)
    assert probe.reads >= 1
    while opt.micro_count:  # finish the accumulation in progress
        _train(opt, model, x, y, 1, bs=opt.decision.batch_size)
    d = opt.decision
    assert d.batch_size < cfg.batch_init and d.accumulation > 1
    assert d.logical_batch >= cfg.batch_init
    # the optimizer steps once per `accumulation` micro-batches, gradients accumulate in between
    steps = opt.step_count
    w = model.fc2.weight.detach().clone()
    for i in range(d.accumulation - 1):
        with opt.autocast():
            loss = F.cross_entropy(model(x[: d.batch_size]), y[: d.batch_size])
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        assert opt.step_count == steps and torch.equal(model.fc2.weight, w)
        assert model.fc2.weight.grad is not None and model.fc2.weight.grad.abs().sum() > 0
    with opt.autocast():
        loss = F.cross_entropy(model(x[: d.batch_size]), y[: d.batch_size])
    opt.backward(loss)
    opt.step()
    assert opt.step_count == steps + 1 and not torch.equal(model.fc2.weight, w)


def test_ablation_switches_turn_levers_off() -> None:
    torch.manual_seed(0)
    x, y = _data()
    cfg = CFG.replace(curvature="off", adaptive_precision=False, elastic_batch=False, base_precision="bf16")
    model = SmallCNN()
    probe = FakeProbe(0.99)
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.05), model, cfg, memory_probe=probe,
               curvature_data=(x[:8], y[:8]))
    _train(opt, model, x, y, 10)
    d = opt.decision
    assert opt.curvature is None and opt.last_eigvals is None
    assert np.all(d.lr_multipliers == 1.0)
    assert d.batch_size == cfg.batch_init and d.accumulation == 1
    assert all(p == (Precision.FP32 if l.spec.kind == "norm" else Precision.BF16)
               for l, p in zip(opt.layers, d.precisions))
    assert opt.plan.hooked == ()


def test_memory_probe_on_cpu_warns_once() -> None:
    with pytest.warns(RuntimeWarning, match="not a CUDA device") as rec:
        probe = MemoryProbe("cpu")
        assert probe.read() is None and probe.read() is None
    assert len([w for w in rec if "MemoryProbe" in str(w.message)]) == 1


def test_bad_inputs() -> None:
    model = SmallCNN()
    with pytest.raises(ValueError, match="optimizer"):
        wrap(torch.optim.LBFGS(model.parameters()), model, CFG)
    with pytest.raises(ValueError, match="not parameters of `model`"):
        wrap(torch.optim.SGD(list(model.parameters()) + [nn.Parameter(torch.zeros(2))], lr=0.1), model, CFG)
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.1), model, CFG)
    with pytest.raises(ValueError, match="add_param_group"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    with pytest.raises(ValueError, match="inputs, targets"):
        opt.curvature_batch(torch.zeros(3))


def test_zero_grad_modes() -> None:
    torch.manual_seed(0)
    model = SmallCNN()
    x, y = _data()
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.05), model, CFG.replace(curvature="off"))
    _train(opt, model, x, y, 1)
    assert all(p.grad is None for p in model.parameters())      # default: set_to_none=True, as torch
    with opt.autocast():
        loss = F.cross_entropy(model(x[:16]), y[:16])
    opt.backward(loss)
    grads = [p.grad for p in model.parameters()]
    opt.step()
    opt.zero_grad(set_to_none=False)                             # one foreach launch, buffers kept
    for p, g in zip(model.parameters(), grads):
        assert p.grad is g and not g.requires_grad and torch.count_nonzero(g) == 0


def test_plain_sgd_through_fused_kernel_matches_sgd() -> None:
    """The device guard steps a non-fused SGD with the fused kernel: same trajectory as plain SGD."""
    torch.manual_seed(0)
    model = SmallCNN()
    ref_model = copy.deepcopy(model)
    x, y = _data()
    cfg = CFG.replace(curvature="off", adaptive_precision=False, base_precision="fp32", elastic_batch=False)
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
               model, cfg)
    ref = torch.optim.SGD(ref_model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)
    for i in range(5):
        idx = torch.arange(i * 16, (i + 1) * 16) % 64
        for mdl, o in ((model, opt), (ref_model, ref)):
            F.cross_entropy(mdl(x[idx]), y[idx]).backward()
            o.step()
            o.zero_grad()
    assert opt._device_guard_ready and opt.param_groups[0]["fused"] is None   # flags restored
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_curvature_promotion_mid_step_keeps_this_steps_unscale() -> None:
    """A curvature step promotes every FP16 layer to BF16 inside step(), after a backward that ran
    loss-scaled: that step's gradients must still be unscaled (found on an H200: a 2^16x update)."""
    torch.manual_seed(0)
    x, y = _data()
    cfg = CFG.replace(tau_low=1e9, tau_high=1e10, warmup_steps=0, min_dwell=0, t_ctrl=1, t_curv=2,
                      tau_curv=0.0, alpha=1e-12, curvature="fisher")     # all FP16; any lambda promotes
    model = SmallCNN()
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.05), model, cfg, curvature_data=(x[:8], y[:8]))
    deltas = []
    for i in range(3):
        before = [p.detach().clone() for p in model.parameters()]
        was_fp16 = opt.fp16_active
        _train(opt, model, x[16 * i:], y[16 * i:], 1)
        deltas.append(sum(float((p - b).norm()) for p, b in zip(model.parameters(), before)))
        if i == 2:
            assert was_fp16 and not opt.fp16_active   # promoted inside this step
    assert all(np.isfinite(deltas)) and deltas[2] < 10 * max(deltas[:2]), deltas
