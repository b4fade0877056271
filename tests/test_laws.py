"""Each law against hand-computed cases from the formulas in DESIGN.md."""

import math

import numpy as np
import pytest

from paper import paper_config
from triaccel import OOMAtMinimumBatch, Precision, TriAccelConfig, resolve_memory_limit
from triaccel.batching import BatchLaw
from triaccel.curvature import CurvatureLaw, fisher_topk_from_gram, lr_scales_from_eigs, ritz
from triaccel.layers import LayerSpec, order_layers
from triaccel.precision import PrecisionLaw
from triaccel.stats import group_by_layer, variance_from_moments

F16, B16, F32 = Precision.FP16, Precision.BF16, Precision.FP32


def law(n=1, **kw):
    args = dict(beta=0.5, tau_low=1.0, tau_high=10.0, quantiles=(0.25, 0.9), hysteresis=0.0,
                min_dwell=0, base=B16)
    args.update(kw)
    return PrecisionLaw(n, np.zeros(n, bool), **args)


# -- precision ---------------------------------------------------------------------------------
def test_precision_parse_and_names():
    assert Precision.parse("bf16") is B16 and Precision.parse("float16") is F16 and Precision.parse(2) is F32
    assert F16 < B16 < F32 and B16.short == "bf16" and B16.dtype_name == "bfloat16"
    with pytest.raises(ValueError, match="precision"):
        Precision.parse("fp8")


def test_ema_starts_at_first_value_then_follows_beta():
    p = law()
    p.observe(np.array([4.0]))
    assert p.ema[0] == 4.0
    p.observe(np.array([2.0]))
    assert p.ema[0] == pytest.approx(0.5 * 4 + 0.5 * 2)  # v = beta*v + (1-beta)*Var = 3


@pytest.mark.parametrize("v,expected", [(0.5, F16), (1.0, B16), (5.0, B16), (10.0, F32), (20.0, F32)])
def test_thresholds(v, expected):
    p = law()
    p.observe(np.array([v]))
    p.update_levels(step=0, warm=True)
    assert p.effective(0) == (expected,)


def test_hysteresis_band():
    p = law(hysteresis=0.1, beta=0.0)  # beta 0: the EMA is the last value
    seq = [(1.5, B16), (0.95, B16), (0.85, F16), (1.05, F16), (1.15, B16), (10.5, B16), (11.5, F32),
           (9.5, F32), (8.9, B16)]
    for step, (v, expected) in enumerate(seq):
        p.observe(np.array([v]))
        p.update_levels(step, warm=True)
        assert p.effective(step) == (expected,), (step, v)


def test_min_dwell_holds_level():
    p = law(beta=0.0, min_dwell=10)
    p.observe(np.array([0.5]))
    p.update_levels(0, warm=True)          # leaving warm-up: free change to FP16
    p.observe(np.array([50.0]))
    p.update_levels(5, warm=True)
    assert p.effective(5) == (F16,)        # 5 steps since the last change < 10
    p.update_levels(10, warm=True)
    assert p.effective(10) == (F32,)


def test_warmup_keeps_base_and_calibrates_after():
    p = law(n=4, tau_low=None, tau_high=None, quantiles=(0.25, 0.75))
    p.observe(np.array([1.0, 2.0, 3.0, 4.0]))
    p.update_levels(0, warm=False)
    assert p.effective(0) == (B16,) * 4 and not p.calibrated
    p.update_levels(1, warm=True)
    assert p.tau_low == pytest.approx(np.quantile([1, 2, 3, 4], 0.25))   # 1.75
    assert p.tau_high == pytest.approx(np.quantile([1, 2, 3, 4], 0.75))  # 3.25
    assert p.effective(1) == (F16, B16, B16, F32)


def test_recalibration_follows_drift_when_asked():
    p = law(n=4, tau_low=None, tau_high=None, quantiles=(0.25, 0.75), beta=0.0, recalibrate_every=100)
    p.observe(np.array([1.0, 2.0, 3.0, 4.0]))
    p.update_levels(0, warm=True)
    assert p.effective(0) == (F16, B16, B16, F32)
    p.observe(np.array([10.0, 20.0, 30.0, 40.0]))       # every variance grew tenfold
    p.update_levels(50, warm=True)
    assert p.effective(50) == (F32,) * 4                 # fixed thresholds: all FP32
    p.update_levels(100, warm=True)                      # re-calibrated: the same shares as before
    assert p.tau_low == pytest.approx(17.5) and p.effective(100) == (F16, B16, B16, F32)
    given = law(n=4, tau_low=1.0, tau_high=2.0, recalibrate_every=1)
    assert given.recalibrate_every is None               # user thresholds are never re-calibrated


def test_promotion_window_and_pinned():
    p = PrecisionLaw(2, np.array([False, True]), beta=0.5, tau_low=1.0, tau_high=10.0, quantiles=(0.25, 0.9),
                     hysteresis=0.0, min_dwell=0, base=B16)
    p.observe(np.array([0.5, 0.5]))
    p.update_levels(0, warm=True)
    assert p.effective(0) == (F16, F32)    # norm layer pinned FP32
    p.promote(100, np.array([True, True]), window=50)
    assert p.effective(100) == (B16, F32) and p.effective(149) == (B16, F32) and p.effective(150) == (F16, F32)


# -- curvature ---------------------------------------------------------------------------------
def test_lr_scale_formula():
    s = lr_scales_from_eigs(np.array([0.0, 1.0, 4.0, -3.0]), alpha=0.5)
    np.testing.assert_allclose(s, [1.0, 1 / 1.5, 1 / 3.0, 1.0])


def test_curvature_law_calibrates_alpha_and_tau():
    c = CurvatureLaw(3, 2, alpha=None, tau_curv=None)
    promote = c.observe(np.array([[4.0, 1.0], [2.0, 0.0], [1.0, 0.5]]))
    assert c.alpha == pytest.approx(0.25)                    # largest lambda_max gets scale 1/2
    np.testing.assert_allclose(c.scales, [0.5, 1 / 1.5, 1 / 1.25])
    assert c.tau_curv == pytest.approx(np.quantile([4.0, 2.0, 1.0], 0.9))
    assert promote.tolist() == [True, False, False]
    with pytest.raises(ValueError, match="eigvals.*shape"):
        c.observe(np.zeros((3, 3)))
    with pytest.raises(ValueError, match="finite"):
        c.observe(np.full((3, 2), np.nan))


def test_fisher_topk_from_gram_matches_explicit_fisher():
    rng = np.random.default_rng(0)
    g = rng.normal(size=(6, 20))                   # 6 per-sample gradients of a 20-parameter layer
    fisher = g.T @ g / 6
    expected = np.sort(np.linalg.eigvalsh(fisher))[::-1][:3]
    np.testing.assert_allclose(fisher_topk_from_gram(g @ g.T, 3), expected, rtol=1e-10)
    assert np.isnan(fisher_topk_from_gram(np.full((3, 3), np.inf), 2)).all()
    padded = fisher_topk_from_gram(g[:2] @ g[:2].T, 4)     # rank 2: the rest are zero
    assert padded[2:].tolist() == [0.0, 0.0] and padded[0] > 0


def test_ritz_recovers_eigenpairs():
    rng = np.random.default_rng(1)
    q, _ = np.linalg.qr(rng.normal(size=(8, 8)))
    h = q @ np.diag(np.arange(8.0)) @ q.T
    v = q[:, [7, 6, 5]] @ np.linalg.qr(rng.normal(size=(3, 3)))[0]   # a rotated basis of the top-3 space
    vals, rot = ritz(v.T @ h @ v)
    np.testing.assert_allclose(vals, [7, 6, 5], atol=1e-10)
    ritz_vecs = v @ rot
    np.testing.assert_allclose(np.abs(ritz_vecs.T @ q[:, [7, 6, 5]]), np.eye(3), atol=1e-10)


# -- batch -------------------------------------------------------------------------------------
CFG = paper_config(batch_init=96, batch_min=32, batch_max=160, delta_up=32, delta_down=16,
                     rho_low=0.5, rho_high=0.8)


def test_batch_law_grow_hold_shrink_and_bounds():
    b = BatchLaw(CFG)
    assert b.update(used=40, mem_max=100, step=0) == 128      # 40 < 50: +32
    assert b.update(used=60, mem_max=100, step=0) == 128      # within [50, 80]: hold
    assert b.update(used=10, mem_max=100, step=0) == 160
    assert b.update(used=10, mem_max=100, step=0) == 160      # batch_max
    assert b.update(used=90, mem_max=100, step=0) == 144      # 90 > 80: -16
    for _ in range(20):
        b.update(used=99, mem_max=100, step=0)
    assert b.batch == 32                              # batch_min


def test_growth_held_when_predicted_memory_overshoots():
    b = BatchLaw(CFG)
    assert b.update(used=49, mem_max=100, step=0) == 128     # 49 * 128/96 = 65 <= 80: grow
    b2 = BatchLaw(CFG.replace(batch_init=32, batch_min=32))
    assert b2.update(used=49, mem_max=100, step=0) == 32     # 49 * 64/32 = 98 > 80: hold


def test_growth_held_before_batch_hold_steps_but_shrink_is_not():
    b = BatchLaw(CFG.replace(batch_hold_steps=100))
    assert b.update(used=10, mem_max=100, step=50) == 96      # room to grow, but held
    assert b.update(used=90, mem_max=100, step=60) == 80      # memory pressure: shrinks at once
    assert b.update(used=10, mem_max=100, step=100) == 112    # hold over: grows


def test_oom_shrinks_at_once_and_caps_growth():
    b = BatchLaw(CFG)
    b.update(10, 100, 0)                                 # 128
    assert b.oom(0) == 64                              # floor(128 * 0.5)
    assert b.ceiling == 120
    for _ in range(5):
        b.update(0, 100, 0)
    assert b.batch == 120                             # never back to the size that failed
    b.batch = 32
    with pytest.raises(OOMAtMinimumBatch, match="batch_min=32"):
        b.oom(0)


def test_oom_cooldown_lifts_the_cap():
    b = BatchLaw(CFG.replace(oom_cooldown=100))
    b.update(10, 100, step=0)                         # 128
    b.oom(step=10)                                    # 64, ceiling 120
    b.update(0, 100, step=50)
    assert b.batch == 96 and b.ceiling == 120         # still capped
    b.update(0, 100, step=110)                        # 100 steps without OOM: cap lifted
    assert b.ceiling == 160 and b.batch == 128


def test_lr_rules_and_accumulation():
    for rule, expected in [("linear", 128 / 96), ("sqrt", math.sqrt(128 / 96)), ("none", 1.0)]:
        b = BatchLaw(CFG.replace(lr_rule=rule))
        b.update(0, 100, 0)
        assert b.lr_scale(0) == pytest.approx(expected) and b.accumulation() == 1 and b.logical_batch() == 128
    acc = BatchLaw(CFG.replace(lr_rule="accumulate"))
    acc.update(0, 100, 0)
    assert acc.batch == 96                            # micro-batch capped at the logical batch
    acc.oom(0)
    assert (acc.batch, acc.accumulation(), acc.logical_batch(), acc.lr_scale(0)) == (48, 2, 96, 1.0)
    acc.batch = 40
    assert acc.accumulation() == 3                    # 40 + 40 + 16 = 96


def test_lr_ramp_up_in_steps_down_at_once():
    b = BatchLaw(CFG.replace(lr_rule="linear", lr_ramp_steps=100))
    b.update(0, 100, step=50)                         # 96 -> 128: ramp 1 -> 4/3 over steps 50..150
    assert [b.lr_scale(s) for s in (50, 100, 150, 400)] == pytest.approx([1.0, 7 / 6, 4 / 3, 4 / 3])
    b.update(0, 100, step=100)                        # 128 -> 160 mid-ramp: starts from 7/6
    assert b.lr_scale(100) == pytest.approx(7 / 6)
    assert b.lr_scale(150) == pytest.approx(7 / 6 + (160 / 96 - 7 / 6) / 2)
    b.oom(step=160)                                   # 160 -> 80: lower at once
    assert b.lr_scale(160) == pytest.approx(80 / 96)
    restored = BatchLaw(b.cfg)
    restored.load_state_dict(b.state_dict())
    assert restored.lr_scale(170) == b.lr_scale(170)
    with pytest.raises(ValueError, match="lr_ramp_steps"):
        CFG.replace(lr_ramp_steps=-1)


def test_buckets_move_one_bucket():
    b = BatchLaw(paper_config(batch_init=64, batch_min=16, batch_max=256, batch_buckets=(16, 32, 64, 128, 256)))
    assert b.update(0, 100, 0) == 128 and b.update(0, 100, 0) == 256 and b.update(99, 100, 0) == 128
    assert b.oom(0) == 64 and b.ceiling == 64


def test_jump_growth_takes_the_largest_allowed_rung_at_once():
    """batch_growth="jump": one decision grows to the largest bucket (or B + k*delta_up) that every
    hold allows (noise bound, memory, batch_hold_steps); shrinking stays one rung; "rung" moves one."""
    buckets = (96, 192, 384, 512)
    cfg = TriAccelConfig(batch_init=96, batch_min=96, batch_max=512, batch_buckets=buckets, noise_scale_c=2.0)
    rung, jump = BatchLaw(cfg), BatchLaw(cfg.replace(batch_growth="jump"))
    assert rung.update(None, None, 0, b_noise=300.0) == 192                   # one rung
    assert jump.update(None, None, 0, b_noise=300.0) == 512                   # 2 x 300 >= 512
    jump2 = BatchLaw(cfg.replace(batch_growth="jump"))
    assert jump2.update(None, None, 0, b_noise=200.0) == 384                  # 512 > 2 x 200
    assert jump2.update(None, None, 50, b_noise=100.0) == 384                 # nothing above allowed: stays
    assert jump2.update(10, 100, 100, b_noise=1e6) == 512                      # 10 x 512/384 = 13 <= 85: grows
    mem = BatchLaw(cfg.replace(batch_growth="jump"))
    assert mem.update(20, 100, 0, b_noise=1e6) == 384                         # 20 x 4 = 80 <= 85; x 5.3 > 85
    assert mem.update(90, 100, 50, b_noise=1e6) == 192                        # pressure: one rung down
    held = BatchLaw(cfg.replace(batch_growth="jump", batch_hold_steps=100))
    assert held.update(None, None, 50, b_noise=1e6) == 96
    assert held.update(None, None, 100, b_noise=1e6) == 512
    # without buckets: B + k*delta_up on the grid, up to the ceiling
    free = BatchLaw(CFG.replace(batch_growth="jump"))
    assert free.update(used=10, mem_max=100, step=0) == 160                   # memory law: to batch_max
    free2 = BatchLaw(CFG.replace(batch_growth="jump"))
    assert free2.update(used=49, mem_max=100, step=0) == 128                  # 49 x 160/96 = 82 > 80
    with pytest.raises(ValueError, match="batch_growth"):
        cfg.replace(batch_growth="leap")


def test_resolve_memory_limit():
    assert resolve_memory_limit(None, 80) == 80 and resolve_memory_limit(40, 80) == 40
    assert resolve_memory_limit(40, None) == 40 and resolve_memory_limit(None, None) is None
    with pytest.raises(ValueError, match="memory_budget=100 bytes exceeds"):
        resolve_memory_limit(100, 80)


# -- stats and layers --------------------------------------------------------------------------
def test_moments_to_variance_and_grouping():
    rng = np.random.default_rng(2)
    tensors = [rng.normal(size=n) for n in (5, 3, 7)]
    mom = np.array([[t.sum(), (t * t).sum(), t.size] for t in tensors]).T   # (3, n_tensors)
    per_layer = group_by_layer(mom, np.array([0, 0, 1]), 2)
    var = variance_from_moments(*per_layer)
    np.testing.assert_allclose(var, [np.concatenate(tensors[:2]).var(), tensors[2].var()], rtol=1e-12)
    with pytest.raises(ValueError, match="counts"):
        variance_from_moments([1.0], [1.0], [0])
    with pytest.raises(ValueError, match="tensor_layer"):
        group_by_layer(mom, np.array([0, 5, 1]), 2)


@pytest.mark.parametrize("lead", [(), (1,), (7,), (5, 3), (0, 3)])
def test_group_by_layer_sums_as_add_at_bit_for_bit(lead):
    """Odd leading shapes, unsorted and repeated layer indices, a layer with no tensor, NaN/Inf: the
    same float64 sums as np.add.at (its order), which the boundary's statistics once ran through."""
    rng = np.random.default_rng(len(lead))
    idx = np.array([3, 0, 0, 2, 3, 3, 0])   # layer 1 has no tensor
    v = rng.normal(size=(*lead, idx.size)) * 10.0 ** rng.integers(-8, 8, size=(*lead, idx.size))
    if v.size:
        v.reshape(-1)[[0, -1]] = [np.nan, np.inf]
    want = np.zeros((*lead, 4))
    np.add.at(want, (..., idx), v)
    got = group_by_layer(v, idx, 4)
    assert got.shape == want.shape and got.dtype == np.float64
    np.testing.assert_array_equal(got, want)
    assert np.array_equal(np.signbit(got), np.signbit(want))


def test_layer_order_is_natural_and_unique():
    names = ["layer2.10.conv", "layer2.9.conv", "fc", "conv1", "layer10.0", "layer2.9.bn"]
    assert [s.name for s in order_layers(names)] == [
        "conv1", "fc", "layer2.9.bn", "layer2.9.conv", "layer2.10.conv", "layer10.0"]
    with pytest.raises(ValueError, match="duplicate"):
        order_layers(["a", "a"])
    with pytest.raises(ValueError, match="kind"):
        LayerSpec("a", "conv")
