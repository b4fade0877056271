"""StockMoments (torch's multi-tensor kernels) against float64 NumPy, the Triton kernel's contract and
the torch wrapper with kernels="stock"."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from triaccel import TriAccelConfig  # noqa: E402
from triaccel.kernels import StockMoments, grad_moments, grad_moments_stock  # noqa: E402

SHAPES = [(1,), (7,), (1000, 37), (3, 5, 7, 9), (0,), (65537,)]


def _tensors(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    # a mean well away from zero in some tensors: the sum is not lost in the L1 norms' rounding
    return [(torch.randn(s, generator=g) * (1 + i) + (0.3 if i % 2 else 0.0)).to(dtype)
            for i, s in enumerate(SHAPES)]


def _ref64(tensors, inv_scale=1.0):
    rows = []
    for t in tensors:
        x = t.double().numpy().ravel() * np.float32(inv_scale)
        rows.append((x.sum(), (x * x).sum(), np.abs(x).sum()))
    return rows


def _check(m, tensors, inv_scale=1.0):
    for i, (s, q, a) in enumerate(_ref64(tensors, inv_scale)):
        assert abs(float(m.sum[i]) - s) <= 1e-5 * a + 1e-30, (i, float(m.sum[i]), s)
        assert float(m.sumsq[i]) == pytest.approx(q, rel=1e-5, abs=1e-30), i
        assert int(m.nonfinite[i]) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_odd_shapes_and_dtypes_match_float64(dtype):
    ts = _tensors(dtype)
    m = grad_moments_stock(ts)
    assert m.sum.dtype == m.sumsq.dtype == torch.float32 and m.nonfinite.dtype == torch.int32
    _check(m, ts)


def test_mixed_dtypes_one_call_and_the_same_numbers_as_the_kernel():
    ts = [t.to(d) for t, d in zip(_tensors(torch.float32, seed=3),
                                   [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float32,
                                    torch.float16])]
    m = grad_moments_stock(ts)
    _check(m, ts)
    k = grad_moments([t.clone() for t in ts], impl="reference")
    torch.testing.assert_close(m.sumsq, k.sumsq, rtol=1e-5, atol=1e-30)
    assert torch.equal(m.nonfinite, k.nonfinite)


def test_non_finite_tensors_flagged_zeroed_and_set_found_inf():
    ts = _tensors(torch.float32)
    ts[2].view(-1)[5] = float("nan")
    ts[3].view(-1)[0] = float("inf")
    ts[5].view(-1)[-1] = -float("inf")
    found = torch.zeros(1)
    m = StockMoments()(ts, found_inf=found)
    bad = [2, 3, 5]
    assert m.nonfinite.tolist() == [1 if i in bad else 0 for i in range(len(ts))]
    assert all(float(m.sum[i]) == 0.0 and float(m.sumsq[i]) == 0.0 for i in bad)
    _check(type(m)(*(v[[0, 1, 4]] for v in m)), [ts[0], ts[1], ts[4]])
    assert float(found) == 1.0
    # finite lists leave the flag as it was: set, never cleared
    clean = _tensors(torch.float32)
    StockMoments()(clean, found_inf=found)
    assert float(found) == 1.0
    found.zero_()
    StockMoments()(clean, found_inf=found)
    assert float(found) == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_inv_scale_unscales_in_place_as_the_reference(dtype, as_tensor):
    ts = _tensors(dtype, seed=1)
    ref = [t.clone() for t in ts]
    before = [t.clone() for t in ts]
    inv = torch.tensor([0.25]) if as_tensor else 0.25
    m = StockMoments()(ts, inv_scale=inv)
    grad_moments(ref, inv_scale=inv, impl="reference")
    for t, r in zip(ts, ref):
        assert torch.equal(t, r)
    _check(m, before, 0.25)


def test_inv_scale_overflow_sets_found_inf_through_the_unscaling_launch():
    ts = [torch.full((4,), 6.0e4, dtype=torch.float16), torch.ones(3)]
    ts[0][1] = float("inf")
    found = torch.zeros(1)
    m = StockMoments()(ts, inv_scale=torch.tensor([0.5]), found_inf=found)
    assert float(found) == 1.0 and m.nonfinite.tolist() == [1, 0]
    assert float(m.sumsq[1]) == pytest.approx(0.75)


def test_out_row_of_a_preallocated_ring_is_filled_and_returned():
    ts = _tensors(torch.float32)
    ring = torch.full((3, len(ts), 3), -1.0)
    res = StockMoments()(ts, out=ring[1])
    assert res.data_ptr() == ring[1].data_ptr()
    assert (ring[0] == -1).all() and (ring[2] == -1).all()
    m = grad_moments_stock(ts)
    torch.testing.assert_close(ring[1], torch.stack([m.sum, m.sumsq, m.nonfinite.float()], dim=1))


def test_rebinds_when_the_list_changes_length():
    sm = StockMoments()
    a = _tensors(torch.float32)
    sm(a)
    b = a[:3] + [torch.ones(2, dtype=torch.float64)]
    m = sm(b)
    assert m.sum.shape == (4,) and float(m.sum[3]) == 2.0


def test_errors_name_the_parameter():
    sm = StockMoments()
    with pytest.raises(ValueError, match="tensors: got an empty sequence"):
        sm([])
    with pytest.raises(TypeError, match=r"tensors\[1\]: need a floating-point torch tensor"):
        sm([torch.ones(2), torch.ones(2, dtype=torch.int64)])
    ts = [torch.ones(3), torch.ones(2)]
    with pytest.raises(ValueError, match=r"out: need a contiguous float32 tensor of shape \(2, 3\)"):
        sm(ts, out=torch.zeros(3, 3))
    with pytest.raises(ValueError, match="found_inf: need a 1-element float32 tensor"):
        sm(ts, found_inf=torch.zeros(2))
    with pytest.raises(ValueError, match="inv_scale=0.0: must be finite and > 0"):
        sm(ts, inv_scale=0.0)
    with pytest.raises(ValueError, match="inv_scale: need a 1-element float32 tensor"):
        sm(ts, inv_scale=torch.ones(1, dtype=torch.float64))


@pytest.mark.filterwarnings("ignore:MemoryProbe")
def test_torch_wrapper_with_stock_kernels_takes_the_reference_decisions():
    """The wrapper's statistics from StockMoments and from the reference reductions feed the same
    controller: the same losses, the same decisions and variance EMAs within the sums' rounding."""
    import torch.nn.functional as F
    from torch import nn

    from triaccel.backends.torch import wrap

    def run(kernels):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(),
                              nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(24, 4))
        cfg = TriAccelConfig(t_ctrl=4, warmup_steps=4, min_dwell=4, curvature="off", batch_init=16,
                             batch_min=8, batch_max=16, precision_law="variance", kernels=kernels)
        opt = wrap(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model, cfg)
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(64, 3, 8, 8, generator=g), torch.randint(0, 4, (64,), generator=g)
        losses, decisions = [], []
        for i in range(20):
            idx = torch.arange(i * 16, (i + 1) * 16) % 64
            with opt.autocast():
                loss = F.cross_entropy(model(x[idx]).float(), y[idx])
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
            decisions.append(tuple(p.short for p in opt.decision.precisions))
        return losses, decisions, opt.report()

    ref, stock = run("reference"), run("stock")
    assert len(set(ref[1])) > 1   # the variance law moved some layer: the statistics mattered
    np.testing.assert_allclose(stock[0], ref[0], rtol=1e-5)
    assert stock[1] == ref[1]
    for name, layer in ref[2]["layers"].items():
        assert stock[2]["layers"][name]["var_ema"] == pytest.approx(layer["var_ema"], rel=1e-4), name
