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

    for step in range(7):
        before = copy.deepcopy(model)
        seen.clear()
        res = elastic_step(loader, opt.controller, loss_fn, opt, opt.step_count, scaler=opt,
                           apply_lr_batch_scale=False, optimizer_step=lambda d: opt.step_accumulated())
        if step in (0, 5):
            assert res.micro_sizes == [8, 8]
            s, sizes, micro, total = calls[-1]
            assert s == step and sizes == [8, 8]
            np.testing.assert_allclose(micro, [_per_layer_sq(before, [b]) for b in seen], rtol=1e-4)
            np.testing.assert_allclose(total, _per_layer_sq(before, seen), rtol=1e-4)
        else:
            assert res.micro_sizes == [16]
    assert [c[0] for c in calls] == [0, 5]
    assert opt.controller._noise.count == 2


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
