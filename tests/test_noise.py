"""Gradient noise scale: the estimator, the noise batch law and the evidence precision law."""

import json

import numpy as np
import pytest

from triaccel import Controller, Precision, TriAccelConfig
from triaccel.noise import GradientNoise, split_measurement


def _sample_grads(rng, G, sigma, b):
    """Mean of b per-sample gradients G + sigma * N(0, I): tr(Sigma) = sigma^2 * dim."""
    return G + sigma * rng.standard_normal((b, G.size)).mean(axis=0)


def test_estimator_recovers_the_noise_scale():
    rng = np.random.default_rng(0)
    dim, sigma = 400, 0.5
    G = rng.standard_normal(dim) * 0.05
    truth = sigma**2 * dim / float(G @ G)          # tr(Sigma) / |G|^2
    est = GradientNoise(1, beta=0.99)
    for _ in range(3000):
        halves = [_sample_grads(rng, G, sigma, 32) for _ in range(2)]
        big = (halves[0] + halves[1]) / 2
        b_s, s, b_b, g = split_measurement([32, 32], [[h @ h] for h in halves], [big @ big], 1)
        est.observe(b_s, s, b_b, g)
    assert est.b_noise() == pytest.approx(truth, rel=0.1)
    assert est.trace[0] == pytest.approx(sigma**2 * dim, rel=0.1)


def test_split_measurement_uses_the_harmonic_mean_and_checks_shapes():
    b_s, small, b_b, big = split_measurement([10, 30], [[1.0, 2.0], [3.0, 4.0]], [0.5, 0.5], 2)
    assert b_s == pytest.approx(15.0) and b_b == 40.0
    np.testing.assert_allclose(small, [2.0, 3.0])
    with pytest.raises(ValueError, match="micro_sqnorms"):
        split_measurement([10, 30], [[1.0], [3.0]], [0.5, 0.5], 2)
    with pytest.raises(ValueError, match="sizes"):
        split_measurement([10], [[1.0, 2.0]], [0.5, 0.5], 2)


def test_estimator_refuses_non_finite_and_waits_for_a_usable_estimate():
    est = GradientNoise(2, beta=0.5)
    assert est.b_noise() is None
    with pytest.raises(ValueError, match="finite"):
        est.observe(8, np.array([np.nan, 1.0]), 16, np.array([1.0, 1.0]))
    est.observe(8, np.array([1.0, 1.0]), 16, np.array([2.0, 2.0]))  # big > small: negative trace
    assert est.b_noise() is None


def _cfg(**kw):
    base = dict(batch_init=32, batch_min=8, batch_max=256, batch_buckets=(32, 64, 128, 256), t_ctrl=10,
                warmup_steps=0, noise_scale_c=1.0, noise_beta=0.0)
    return TriAccelConfig(**{**base, **kw})


def _measure(ctl, step, b_noise, batch, g2=1.0):
    """Feed one exact measurement with the given noise scale (sampling noise tr = b_noise * g2)."""
    tr = b_noise * g2
    half = batch / 2
    L = len(ctl.layers)
    small = np.full(L, (g2 + tr / half) / L)
    big = np.full(L, (g2 + tr / batch) / L)
    ctl.observe_gradient_noise(step, [int(half)] * 2, np.stack([small, small]), big)


def test_noise_law_grows_one_bucket_while_below_c_times_b_noise():
    ctl = Controller(_cfg(), ["a", "b"])
    assert ctl.is_noise_step(0) and not ctl.is_noise_step(5)
    ctl.decide(0)
    _measure(ctl, 0, b_noise=100.0, batch=32)
    assert ctl.b_noise == pytest.approx(100.0)
    assert ctl.decide(10).batch_size == 64        # 64 <= 100
    _measure(ctl, 10, b_noise=100.0, batch=64)
    assert ctl.decide(20).batch_size == 64        # 128 > 100: held
    _measure(ctl, 20, b_noise=300.0, batch=64)
    assert ctl.decide(30).batch_size == 128
    assert ctl.decide(40).batch_size == 256       # estimate still 300 >= 256
    assert ctl.is_noise_step(50)                  # at the top, still measured for the precision law
    top = Controller(_cfg(adaptive_precision=False), ["a"])
    top.decide(0)
    _measure(top, 0, b_noise=1e4, batch=32)
    for s in (10, 20, 30):
        top.decide(s)
    assert top.decision.batch_size == 256 and not top.is_noise_step(40)   # nothing left to measure for


def test_noise_law_memory_is_the_ceiling():
    ctl = Controller(_cfg(memory_budget=1000, batch_buckets=(8, 16, 32, 64, 128, 256)), ["a"])
    ctl.decide(0)
    _measure(ctl, 0, b_noise=1e6, batch=32)
    ctl.observe_memory(5, 600, 10_000)           # x2 would reach 1200 > 0.85 * 1000
    assert ctl.decide(10).batch_size == 32
    ctl.observe_memory(15, 900, 10_000)          # above rho_high: shrink
    assert ctl.decide(20).batch_size == 16
    ctl.observe_memory(25, 100, 10_000)
    assert ctl.decide(30).batch_size == 32          # room again: grows, the noise still allows it


def test_a_modelled_peak_at_the_grown_batch_replaces_the_proportional_guess():
    """A backend that pads micro-batches to a floor runs a larger batch below it with the same
    program: its modelled peak there (at_batch) lets the batch grow where used x 2 would not."""
    cfg = _cfg(memory_budget=1000, batch_buckets=(8, 16, 32, 64, 128, 256))
    ctl = Controller(cfg, ["a"])
    ctl.decide(0)
    _measure(ctl, 0, b_noise=1e6, batch=32)
    ctl.observe_memory(5, 600, 10_000, at_batch={64: 600, 128: 600})
    assert ctl.decide(10).batch_size == 64                 # 600 <= 0.85 * 1000, not 1200
    ctl.observe_memory(15, 600, 10_000, at_batch={128: 900})
    ctl.observe_memory(16, 500, 10_000, at_batch={128: 700})   # the interval's largest counts
    assert ctl.decide(20).batch_size == 64                 # 900 > 850: held
    ctl.observe_memory(25, 300, 10_000)                    # no model this interval: 300 x 2 = 600
    assert ctl.decide(30).batch_size == 128
    restored = Controller(cfg, ["a"])
    ctl.observe_memory(35, 300, 10_000, at_batch={256: 400})
    restored.load_state_dict(json.loads(json.dumps(ctl.state_dict())))
    assert restored.decide(40).batch_size == ctl.decide(40).batch_size == 256
    for bad, match in (({0: 5}, "key 0"), ({True: 5}, "key True"), ({64: -1}, r"at_batch\[64\]"),
                       ({64: float("nan")}, r"at_batch\[64\]")):
        with pytest.raises(ValueError, match=match):
            ctl.observe_memory(45, 300, 10_000, at_batch=bad)


def test_noise_law_without_estimate_does_not_grow_and_c_scales_the_bound():
    ctl = Controller(_cfg(), ["a"])
    ctl.observe_memory(5, 1, 10_000)
    assert ctl.decide(10).batch_size == 32
    ctl2 = Controller(_cfg(noise_scale_c=4.0), ["a"])
    ctl2.decide(0)
    _measure(ctl2, 0, b_noise=40.0, batch=32)
    assert ctl2.decide(10).batch_size == 64      # 64 <= 4 * 40


def test_memory_law_still_available():
    ctl = Controller(_cfg(batch_law="memory"), ["a"])
    assert not ctl.is_noise_step(0)
    ctl.observe_memory(5, 1, 10_000)
    assert ctl.decide(10).batch_size == 64


def _evidence_ctl(**kw):
    from triaccel.layers import LayerSpec

    layers = [LayerSpec("conv", "other"), LayerSpec("bn", "norm"), LayerSpec("fc", "other")]
    return Controller(_cfg(t_precision=10, min_dwell=20, elastic_batch=False, **kw), layers)


def test_evidence_law_stays_16_bit_whatever_the_variance():
    ctl = _evidence_ctl()
    for step in range(0, 200, 10):
        ctl.observe_grad_variance(step, [1e9 * (step + 1), 1.0, 1e-12])
        d = ctl.decide(step)
        assert d.precisions == (Precision.BF16, Precision.FP32, Precision.BF16)


def test_evidence_law_nonfinite_promotes_then_returns_after_dwell():
    ctl = _evidence_ctl()
    ctl.decide(0)
    ctl.observe_nonfinite(3, [0, 0, 5])
    assert ctl.decide(10).precisions[2] == Precision.FP32
    assert ctl.decide(20).precisions[2] == Precision.FP32     # evidence lasts min_dwell past step 3
    assert ctl.decide(30).precisions[2] == Precision.BF16     # gone at 23, dwell since 10 done
    assert ctl.decide(30).precisions[0] == Precision.BF16


def test_evidence_law_ignores_loss_scaled_fp16_overflow_until_the_scale_collapses():
    ctl = _evidence_ctl(base_precision="fp16")
    ctl.decide(0)
    ctl.observe_nonfinite(3, [4, 0, 0], loss_scaled=True)
    assert ctl.decide(10).precisions[0] == Precision.FP16
    ctl.observe_loss_scale(12, 2.0**10)
    assert ctl.decide(20).precisions[0] == Precision.FP16
    ctl.observe_loss_scale(22, 0.5)
    assert ctl.decide(30).precisions == (Precision.FP32, Precision.FP32, Precision.FP32)
    with pytest.raises(ValueError, match="scale"):
        ctl.observe_loss_scale(31, float("nan"))


def test_evidence_law_rounding_error_against_sampling_noise():
    ctl = _evidence_ctl()
    ctl.decide(0)
    # Layer 0: almost noise-free gradient at this batch (rounding dominates); layer 2: noisy.
    u2 = (2.0**-8) ** 2
    batch, half = 32, 16
    g2 = np.array([1.0, 1.0, 1.0])
    tr = np.array([u2 * batch * 0.1, 1.0, 100.0])  # layer 0: u^2 |G|^2 / (tr/B) = 10 >> 0.01
    small = g2 + tr / half
    big = g2 + tr / batch
    ctl.observe_gradient_noise(5, [half, half], np.stack([small, small]), big)
    d = ctl.decide(10)
    assert d.precisions == (Precision.FP32, Precision.FP32, Precision.BF16)


def test_decisions_are_deterministic_and_resume():
    def run(ctl, steps):
        out = []
        for s in steps:
            if ctl.is_noise_step(s):
                _measure(ctl, s, b_noise=50.0 + s, batch=ctl.decision.batch_size)
            ctl.observe_memory(s, 10, 10_000)
            out.append(ctl.decide(s).to_dict())
        return out

    a = Controller(_cfg(), ["x", "y"])
    b = Controller(_cfg(), ["x", "y"])
    assert run(a, range(0, 200, 10)) == run(b, range(0, 200, 10))
    c = Controller(_cfg(), ["x", "y"])
    c.load_state_dict(a.state_dict())
    assert run(a, range(200, 400, 10)) == run(c, range(200, 400, 10))


def test_noise_law_waits_for_warm_up_and_a_filled_ema():
    ctl = Controller(_cfg(noise_beta=0.5, warmup_steps=20), ["a"])
    assert not ctl.is_noise_step(10) and ctl.is_noise_step(20)
    ctl.decide(20)
    _measure(ctl, 20, b_noise=1e4, batch=32)
    assert ctl.decide(30).batch_size == 32        # one measurement: EMA horizon (2) not filled
    _measure(ctl, 30, b_noise=1e4, batch=32)
    assert ctl.decide(40).batch_size == 64


def test_warm_schedule_measures_densely_until_the_ema_is_warm_then_every_t_noise():
    from triaccel.noise import is_noise_schedule_step, max_noise_steps_per_window, warm_count

    assert [warm_count(b) for b in (0.0, 0.5, 0.7, 0.8)] == [1, 2, 4, 5]
    steps = [s for s in range(0, 260) if is_noise_schedule_step(s, 100, 50, 10, 0.8)]
    assert steps == [100, 110, 120, 130, 140, 150, 200, 250]
    assert [s for s in range(260) if is_noise_schedule_step(s, 100, 50, None, 0.8)] == [100, 150, 200, 250]
    assert [s for s in range(40) if is_noise_schedule_step(s, 5, 50, 10, 0.5)] == [5, 15]   # warm after 2
    # the ring bound covers every window of t_ctrl steps, with and without the dense phase
    for start, t_noise, t_warm, beta, t_ctrl in ((100, 50, 10, 0.8, 50), (3, 7, 2, 0.8, 10), (0, 5, None, 0.5, 12),
                                                 (1, 50, 1, 0.9, 50)):
        marks = [is_noise_schedule_step(s, start, t_noise, t_warm, beta) for s in range(600)]
        most = max(sum(marks[k:k + t_ctrl]) for k in range(600 - t_ctrl))
        assert most <= max_noise_steps_per_window(t_ctrl, t_noise, t_warm, beta)


def test_t_noise_warm_lets_the_noise_law_grow_sooner_and_is_validated():
    ctl = Controller(_cfg(noise_beta=0.5, warmup_steps=20, t_ctrl=50, t_noise=50, t_noise_warm=5), ["a"])
    assert [s for s in range(101) if ctl.is_noise_step(s)] == [20, 25, 50, 100]
    for s in (20, 25):
        _measure(ctl, s, b_noise=1e4, batch=32)
    assert ctl.decide(50).batch_size == 64        # warm after steps 20 and 25: grows at the first boundary
    plain = Controller(_cfg(noise_beta=0.5, warmup_steps=20, t_ctrl=50, t_noise=50), ["a"])
    _measure(plain, 50, b_noise=1e4, batch=32)
    assert plain.decide(50).batch_size == 32      # t_noise alone: one measurement by step 50
    with pytest.raises(ValueError, match="t_noise_warm"):
        TriAccelConfig(t_noise_warm=0)


def _steps_controller(**kw):
    from triaccel import Controller, TriAccelConfig

    cfg = TriAccelConfig(**{**dict(batch_init=16, batch_min=8, batch_max=64, t_ctrl=4, warmup_steps=0,
                                   noise_split="steps", short_step_lr="linear", noise_beta=0.0,
                                   memory_budget=None), **kw})
    return Controller(cfg, ["a", "b"])


def test_half_step_pairs_recover_the_noise_terms_across_boundaries():
    """noise_split="steps": a noise step's row (8 of a 16-sample batch, weight 1/2 under "linear": its
    gradient as applied is half its mean gradient) and the mean of the 4 full steps' rows before it
    and the 4 after it are one measurement: E|g_b|^2 = |G|^2 + tr(Sigma)/b gives back |G|^2 and
    tr(Sigma) exactly under a linear drift of the rows along the run (rows after the step alone
    would read the large batch 2.5% high here), also when a boundary falls among the rows and when
    the run resumes from a state_dict taken there."""
    g2, tr = np.array([2.0, 0.5]), np.array([40.0, 8.0])
    ctl = _steps_controller()
    sq = {8: g2 + tr / 8, 16: g2 + tr / 16}
    drift = {t: 1 + 0.01 * (t - 4) for t in range(9)}   # the noise step (4) at the drift's centre
    for t in range(-2, 9):
        ctl.observe_step_samples(t, 8 if t == 4 else 16, 16, t == 4)
    rows = {t: sq[16] * drift[t] for t in range(9) if t != 4}
    rows[4], rows[-2], rows[-1] = 0.25 * sq[8], sq[16] * 5, sq[16] * 5   # -2, -1: beyond the 4 nearest
    first = list(range(-2, 6))
    ctl.observe_noise_rows(first, np.stack([rows[t] for t in first]), np.ones(len(first), bool))
    assert ctl.report()["noise_measurements"] == 0            # gathering the full steps' rows after it
    state = ctl.state_dict()
    rest = [6, 7, 8]
    ctl.observe_noise_rows(rest, np.stack([rows[t] for t in rest]), np.ones(3, bool))
    assert ctl.report()["noise_measurements"] == 1
    np.testing.assert_allclose(ctl._noise.g2, g2, rtol=1e-12)
    np.testing.assert_allclose(ctl._noise.trace, tr, rtol=1e-12)
    assert ctl.b_noise == pytest.approx(tr.sum() / g2.sum())
    again = _steps_controller()   # resumed among the rows: the same measurement
    again.load_state_dict(json.loads(json.dumps(state)))
    again.observe_noise_rows(rest, np.stack([rows[t] for t in rest]), np.ones(3, bool))
    assert again.b_noise == pytest.approx(ctl.b_noise)


def test_half_step_pairs_take_as_many_rows_after_as_before():
    """The rows after the noise step end early at the next noise step, a non-finite row or a
    missing one, and stop at as many as there were before it: n rows on each side, the nearest."""
    ctl = _steps_controller()
    for t, n, noise in ((0, 16, False), (1, 8, True), (2, 16, False), (3, 16, False), (4, 8, True)):
        ctl.observe_step_samples(t, n, 16, noise)
    ctl.observe_noise_rows(np.arange(5), np.stack([np.full(2, 1.0), np.full(2, 0.25 * 3.0), np.full(2, 2.0),
                                                   np.full(2, 7.0), np.full(2, 1.0)]), np.ones(5, bool))
    assert ctl.report()["noise_measurements"] == 1   # 1 against the mean of 0 and 2; 4 opens the next one
    np.testing.assert_allclose(ctl._noise.trace, (3.0 - 1.5) / (1 / 8 - 1 / 16))
    assert ctl._pairs._open is not None and len(ctl._pairs._open["before"]) == 2   # steps 2-3


@pytest.mark.parametrize("case", ["nonfinite", "short", "gap", "none before", "other size before"])
def test_half_step_pairs_measure_nothing_from_a_broken_pair(case):
    """A non-finite next row, a next step no larger than the half (an epoch's short last step), a
    missing row, or no full step of the noise step's batch right before it measure nothing; nothing
    is held after them."""
    ctl = _steps_controller()
    before = {"none before": 8, "other size before": 8}.get(case, 16)   # 8: a short step, or a batch of 8
    ctl.observe_step_samples(0, before, 8 if case == "other size before" else 16, False)
    ctl.observe_step_samples(1, 8, 16, True)
    ctl.observe_step_samples(2, 8 if case == "short" else 16, 16, False)
    rows = np.ones((3, 2))
    if case == "gap":
        ctl.observe_noise_rows([0, 1, 3], rows, np.ones(3, bool))
        ctl.observe_noise_rows([2], rows[:1], np.array([True]))
    else:
        ctl.observe_noise_rows([0, 1, 2], rows, np.array([True, True, case != "nonfinite"]))
    assert ctl.report()["noise_measurements"] == 0 and ctl._pairs._open is None and not ctl._pairs._ran


def test_half_step_pairs_resume_from_an_after_only_state():
    """A state_dict written by the earlier after-only pairing (no rows before) loads: its open
    measurement is dropped, the next noise step measures."""
    ctl = _steps_controller()
    ctl.load_state_dict({**ctl.state_dict(), "noise_pairs": {
        "ran": [[5, 16, 16, 0]], "open": {"small": 8, "small_sq": [1.0, 1.0], "big": 16, "big_sq": [1.0, 1.0],
                                          "n": 1, "last": 4}}})
    assert ctl._pairs._open is None and ctl._pairs._prev == []


def test_half_step_pairs_are_off_for_the_other_splits():
    ctl = _steps_controller(noise_split="halves")
    ctl.observe_step_samples(0, 8, 16, True)
    ctl.observe_noise_rows([0], np.ones((1, 2)), np.array([True]))
    assert ctl._pairs is None and ctl.report()["noise_measurements"] == 0
