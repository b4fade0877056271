"""torch: the elastic step's gradient-noise measurement, evidence from non-finite values, FLOP shares."""

import copy

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from triaccel import Precision, TriAccelConfig
from triaccel.backends.torch import wrap
from triaccel.backends.torch.data import ElasticLoader, elastic_step
from triaccel.backends.torch.flops import layer_flops
from triaccel.flops import FlopShare


def _setup(**kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    cfg = TriAccelConfig(**{**dict(batch_init=16, batch_min=8, batch_max=64, batch_buckets=(8, 16, 32, 64),
                                    t_ctrl=5, warmup_steps=0, base_precision="fp32"), **kw})
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model, cfg)
    x, y = torch.randn(400, 6), torch.randint(0, 3, (400,))
    loader = ElasticLoader(x, y, batch_size=16, seed=0)
    return model, opt, loader


def _per_layer_sq(model, batches):
    """Squared per-layer norms of the mean-loss gradient over `batches` (list of (x, y))."""
    n = sum(len(b[1]) for b in batches)
    loss = sum(F.cross_entropy(model(xb), yb, reduction="sum") for xb, yb in batches) / n
    grads = torch.autograd.grad(loss, list(model.parameters()))
    sq = [float(g.double().square().sum()) for g in grads]
    return np.array([sq[0] + sq[1], sq[2] + sq[3]])  # (weight, bias) per Linear


def test_noise_step_measures_the_halves_exactly():
    model, opt, loader = _setup()
    seen, calls = [], []
    orig = opt.controller.observe_gradient_noise

    def capture(step, sizes, micro, total):
        calls.append((step, list(sizes), np.array(micro), np.array(total)))
        orig(step, sizes, micro, total)

    opt.controller.observe_gradient_noise = capture

    def loss_fn(batch):
        seen.append((batch[0].clone(), batch[1].clone()))
        with opt.autocast():
            return F.cross_entropy(model(batch[0]), batch[1])

    measured = {}
    for step in range(7):
        before = copy.deepcopy(model)
        seen.clear()
        res = elastic_step(loader, opt.controller, loss_fn, opt, opt.step_count, scaler=opt,
                           apply_lr_batch_scale=False, optimizer_step=lambda d: opt.step_accumulated())
        if step in (0, 5):
            assert res.micro_sizes == [8, 8]
            measured[step] = (before, list(seen))
        else:
            assert res.micro_sizes == [16]
        # the measurement is copied without a wait and fed at the next flush: step 0's at the end of
        # step 4 (the boundary before step 5's decision), step 5's not yet
        assert [c[0] for c in calls] == ([] if step < 4 else [0])
    opt.report()   # reads what is pending: step 5's measurement
    assert [c[0] for c in calls] == [0, 5]
    for s, sizes, micro, total in calls:
        before, batches = measured[s]
        assert sizes == [8, 8]
        np.testing.assert_allclose(micro, [_per_layer_sq(before, [b]) for b in batches], rtol=1e-4)
        np.testing.assert_allclose(total, _per_layer_sq(before, batches), rtol=1e-4)
    assert opt.controller._noise.count == 2


def test_doubled_noise_step_takes_two_batches_and_weighs_their_mean():
    """noise_split="double": a noise step takes 2B samples as two micro-batches of B (no half-size
    shape), measures them as the halves would be, and updates with their mean gradient at B's LR;
    every sample is still trained once per epoch."""
    model, opt, loader = _setup(noise_split="double", short_step_lr="linear")
    lr0 = opt.param_groups[0]["lr"]
    calls = []
    orig = opt.controller.observe_gradient_noise
    opt.controller.observe_gradient_noise = lambda st, sizes, m, t: (calls.append((st, list(sizes), np.array(m),
                                                                                   np.array(t))), orig(st, sizes, m, t))
    seen = []

    def loss_fn(batch):
        seen.append((batch[0].clone(), batch[1].clone()))
        with opt.autocast():
            return F.cross_entropy(model(batch[0]), batch[1])

    before = copy.deepcopy(model)
    res = elastic_step(loader, opt.controller, loss_fn, opt, opt.step_count, scaler=opt,
                       apply_lr_batch_scale=False, optimizer_step=lambda d: opt.step_accumulated())
    assert res.micro_sizes == [16, 16] and res.samples == 32 and res.decision.batch_size == 16
    # plain SGD's first step (momentum buffer = gradient): w - lr * mean gradient of the 32 samples
    grads = torch.autograd.grad(sum(F.cross_entropy(before(xb), yb, reduction="sum") for xb, yb in seen) / 32,
                                list(before.parameters()))
    for p, q, g in zip(model.parameters(), before.parameters(), grads):
        torch.testing.assert_close(p, q - lr0 * g, rtol=1e-4, atol=1e-6)
    opt.report()   # feeds the deferred measurement
    (st, sizes, micro, total), = calls
    assert st == 0 and sizes == [16, 16]
    np.testing.assert_allclose(micro, [_per_layer_sq(before, [b]) for b in seen], rtol=1e-4)
    np.testing.assert_allclose(total, _per_layer_sq(before, seen), rtol=1e-4)
    # the rest of the epoch (another doubled noise step at step 5): every sample exactly once
    steps = 1
    while not res.end_of_epoch:
        res = elastic_step(loader, opt.controller, loss_fn, opt, opt.step_count, scaler=opt,
                           apply_lr_batch_scale=False, optimizer_step=lambda d: opt.step_accumulated())
        steps += 1
    assert loader.stats["samples"] == 400 and steps < 400 // 16 + 1


def _noise_run(defer: bool, steps: int = 23, save_at: int | None = None):
    """Decisions and controller state of a run whose noise steps are fed deferred or at once."""
    model, opt, loader = _setup(base_precision="bf16", t_noise=2, t_noise_warm=1, noise_beta=0.5, batch_max=64,
                                noise_scale_c=4.0)
    if not defer:
        opt.defer_noise = None   # elastic_step then reads at the step, as with a plain optimizer

    def loss_fn(batch):
        with opt.autocast():
            return F.cross_entropy(model(batch[0]), batch[1])

    decisions, saved = [], None
    for step in range(steps):
        res = elastic_step(loader, opt.controller, loss_fn, opt, opt.step_count, scaler=opt,
                           apply_lr_batch_scale=False, optimizer_step=lambda d: opt.step_accumulated())
        decisions.append((res.micro_sizes, opt.decision.batch_size, tuple(opt.decision.precisions)))
        if step == save_at:
            saved = opt.state_dict()
    opt.report()
    return decisions, opt.controller.state_dict(), saved


def test_deferred_noise_reads_leave_every_decision_as_an_immediate_read_does():
    now, state_now, _ = _noise_run(defer=False)
    later, state_later, _ = _noise_run(defer=True)
    assert later == now and len({d[1] for d in now}) > 1   # the batch moved on the measurements
    assert state_later["noise"] == state_now["noise"] and state_later["noise"]["count"] >= 5


def test_a_checkpoint_holds_the_deferred_measurements():
    _, _, saved = _noise_run(defer=True, steps=8, save_at=6)   # step 6 measured, not yet fed
    _, _, immediate = _noise_run(defer=False, steps=8, save_at=6)
    assert saved["controller"]["noise"] == immediate["controller"]["noise"]


def test_nonfinite_layer_goes_fp32_under_the_evidence_law_and_report_is_current():
    model, opt, loader = _setup(base_precision="bf16", min_dwell=5, elastic_batch=False)
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    for step in range(5):
        with opt.autocast():
            loss = F.cross_entropy(model(x), y)
        opt.backward(loss)
        if step == 2:
            model[2].weight.grad[0, 0] = float("nan")
        opt.step()
        opt.zero_grad()
        if step == 2:
            assert opt.report()["skipped_steps"] == 1   # current at read time, before any boundary
    assert opt.decision.precisions[0] == Precision.BF16
    assert opt.decision.precisions[1] == Precision.FP32
    assert torch.isfinite(model[2].weight).all()


def test_flop_share_counts_conv_and_linear_by_precision():
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 8 * 8, 5))
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.1), model, TriAccelConfig())
    f = layer_flops(model, opt.layers, torch.randn(1, 3, 8, 8))
    names = [layer.name for layer in opt.layers]
    assert dict(zip(names, f)) == {"0": 2 * 4 * 3 * 9 * 64, "1": 0.0, "3": 2 * 256 * 5}
    share = FlopShare(f)
    P = Precision
    share.add([P.BF16 if n != "1" else P.FP32 for n in names], 10)
    share.add([P.FP32, P.FP32, P.FP16], 30)
    conv, fc = f[0], f[2]
    total = 40 * (conv + fc)
    assert share.shares() == pytest.approx({"fp16": 30 * fc / total, "bf16": 10 * (conv + fc) / total,
                                            "fp32": 30 * conv / total})
    with pytest.raises(ValueError, match="sample"):
        layer_flops(model, opt.layers, torch.randn(2, 3, 8, 8))
