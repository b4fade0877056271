import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paper import paper_config
from triaccel import Controller, LayerSpec, Precision, TriAccelConfig

LAYERS = ["conv1", LayerSpec("bn1", "norm"), "layer1.0.conv1", "fc"]
MiB = 2**20


def drive(ctl, steps, start=0, seed=0, oom_at=()):
    """Feed a deterministic synthetic run; return the decisions taken."""
    rng = np.random.default_rng(seed)
    out = []
    L = len(ctl.layers)
    for step in range(start, start + steps):
        ctl.observe_grad_variance(step, 10.0 ** rng.uniform(-8, -2, size=L))
        ctl.observe_memory(step, int(rng.uniform(0.2, 1.0) * 1000 * MiB), 1000 * MiB)
        if ctl.is_curvature_step(step):
            ctl.observe_curvature(step, rng.uniform(0, 50, size=(L, ctl.config.top_k)))
        if step in oom_at:
            out.append(ctl.observe_oom(step))
        out.append(ctl.decide(step))
    return out


def summary(decisions):
    return [d.to_dict() for d in decisions]


def test_boundaries_only():
    cfg = paper_config(t_ctrl=10, t_curv=30, warmup_steps=0, min_dwell=0)
    ctl = Controller(cfg, LAYERS)
    ds = drive(ctl, 61)
    steps_decided = sorted({d.step for d in ds})
    assert steps_decided == [0, 10, 20, 30, 40, 50, 60]
    assert ds[5] is ds[0]                                  # between boundaries: the decision in force


def test_precision_decided_every_t_precision_only():
    cfg = paper_config(t_ctrl=10, t_precision=30, warmup_steps=0, min_dwell=0, curvature="off",
                         elastic_batch=False, beta=0.0, tau_low=1.0, tau_high=100.0)
    ctl = Controller(cfg, ["a"])
    seen = {}
    for step in range(61):
        ctl.observe_grad_variance(step, [0.1 if (step // 10) % 2 else 500.0])
        seen[step] = ctl.decide(step).precisions[0]
    changes = [s for s in range(1, 61) if seen[s] != seen[s - 1]]
    assert changes and all(s % 30 == 0 for s in changes)


def test_oom_is_immediate():
    ctl = Controller(paper_config(t_ctrl=10, curvature="off"), LAYERS)
    drive(ctl, 3)
    before = ctl.decision.batch_size
    d = ctl.observe_oom(3)
    assert d.step == 3 and d.batch_size == before // 2 and "batch" in d.changed
    assert ctl.telemetry.records[-1]["event"] == "oom"


def test_norm_layer_pinned_and_decision_fields():
    ctl = Controller(paper_config(t_ctrl=1, warmup_steps=0, min_dwell=0, curvature="off"), LAYERS)
    d = drive(ctl, 5)[-1]
    assert d.precisions[1] is Precision.FP32
    np.testing.assert_allclose(d.lr_multipliers, d.lr_scales * d.lr_batch_scale)
    assert set(ctl.report()["layers"]) == {"conv1", "bn1", "layer1.0.conv1", "fc"}


def test_levers_off():
    cfg = paper_config(t_ctrl=5, t_curv=5, warmup_steps=0, adaptive_precision=False, elastic_batch=False,
                         curvature="off")
    ctl = Controller(cfg, LAYERS)
    for d in drive(ctl, 50):
        assert d.precisions == (Precision.BF16, Precision.FP32, Precision.BF16, Precision.BF16)
        assert d.batch_size == 96 and np.all(d.lr_scales == 1.0)
    with pytest.raises(ValueError, match="curvature"):
        ctl.observe_curvature(0, np.zeros((4, 5)))


def test_observation_errors_name_the_argument():
    ctl = Controller(paper_config(), LAYERS)
    with pytest.raises(ValueError, match=r"var: expected shape \(4,\)"):
        ctl.observe_grad_variance(0, [1.0, 2.0])
    with pytest.raises(ValueError, match="finite"):
        ctl.observe_grad_variance(0, [1.0, np.nan, 1.0, 1.0])
    with pytest.raises(ValueError, match="used_bytes"):
        ctl.observe_memory(0, -1, 10)
    with pytest.raises(ValueError, match="memory_budget"):
        Controller(paper_config(memory_budget="2GiB"), LAYERS).observe_memory(0, 1, 2**30)
    with pytest.raises(ValueError, match="layers"):
        Controller(paper_config(), [])


def test_moment_rows_fold_as_single_calls_bit_for_bit():
    """A boundary's block of rows gives the EMA (and every later decision) that as many single
    calls give, to the bit; bad shapes and non-finite rows are refused by name."""
    rng = np.random.default_rng(3)
    n, L = 50, len(LAYERS)
    counts = rng.integers(1, 5000, size=L).astype(float)
    sums = rng.normal(0, 1e-2, size=(n, L)) * counts
    sumsqs = sums**2 / counts + rng.uniform(1e-8, 1e-3, size=(n, L)) * counts
    one, block = Controller(paper_config(), LAYERS), Controller(paper_config(), LAYERS)
    for step in range(n):
        one.observe_grad_moments(step, sums[step], sumsqs[step], counts)
    block.observe_grad_moments_rows(list(range(n)), sums, sumsqs, counts)
    assert np.array_equal(one._precision.ema, block._precision.ema)
    assert summary(drive(one, 120, start=n)) == summary(drive(block, 120, start=n))
    with pytest.raises(ValueError, match=r"sums, sumsqs: expected shape \(2, 4\)"):
        block.observe_grad_moments_rows([0, 1], sums[:3], sumsqs[:3], counts)
    with pytest.raises(ValueError, match="counts"):
        block.observe_grad_moments_rows([0], sums[:1], sumsqs[:1], counts[:2])
    bad = sumsqs[:2].copy()
    bad[1, 2] = np.inf
    with pytest.raises(ValueError, match="finite"):
        block.observe_grad_moments_rows([0, 1], sums[:2], bad, counts)


def test_telemetry_jsonl(tmp_path):
    ctl = Controller(paper_config(t_ctrl=5, t_curv=10, warmup_steps=5), LAYERS)
    drive(ctl, 30)
    path = ctl.telemetry.write_jsonl(tmp_path / "t.jsonl")
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 5, 10, 15, 20, 25]
    assert {"precisions", "lr_scales", "lambda_max", "var_ema", "batch_size", "mem_used"} <= set(rows[0])


# -- properties --------------------------------------------------------------------------------
configs = st.builds(
    TriAccelConfig,
    beta=st.floats(0, 0.99), hysteresis=st.floats(0, 0.5), min_dwell=st.integers(0, 30),
    t_ctrl=st.integers(1, 7), t_curv=st.integers(1, 20), warmup_steps=st.integers(0, 20),
    curvature=st.sampled_from(["fisher", "hessian", "off"]),
    lr_rule=st.sampled_from(["linear", "sqrt", "none", "accumulate"]),
    delta_up=st.sampled_from([8, 16, 64]), delta_down=st.sampled_from([8, 32]),
    batch_min=st.sampled_from([8, 16]), batch_max=st.sampled_from([96, 256]),
    oom_shrink=st.floats(0.1, 0.9),
)


@settings(max_examples=60, deadline=None)
@given(cfg=configs, seed=st.integers(0, 10**6), ooms=st.sets(st.integers(1, 59), max_size=3))
def test_invariants(cfg, seed, ooms):
    ctl = Controller(cfg, LAYERS)
    try:
        ds = drive(ctl, 60, seed=seed, oom_at=ooms)
    except RuntimeError:   # OOMAtMinimumBatch is allowed when OOMs pile up at batch_min
        return
    for d in ds:
        assert cfg.batch_min <= d.batch_size <= cfg.batch_max and d.batch_size % cfg.batch_multiple == 0
        assert np.all((d.lr_scales > 0) & (d.lr_scales <= 1))
        assert set(d.precisions) <= set(Precision) and len(d.precisions) == 4
        assert d.batch_size * d.accumulation >= d.logical_batch
        if cfg.lr_rule == "accumulate":
            assert d.logical_batch == cfg.batch_init


@settings(max_examples=40, deadline=None)
@given(cfg=configs, seed=st.integers(0, 10**6))
def test_identical_inputs_identical_decisions(cfg, seed):
    a = summary(drive(Controller(cfg, LAYERS), 40, seed=seed))
    b = summary(drive(Controller(cfg, LAYERS), 40, seed=seed))
    assert a == b


@settings(max_examples=40, deadline=None)
@given(cfg=configs, seed=st.integers(0, 10**6), cut=st.integers(1, 39))
def test_state_round_trip_gives_identical_future(cfg, seed, cut):
    ref = Controller(cfg, LAYERS)
    drive(ref, cut, seed=seed)
    sd = json.loads(json.dumps(ref.state_dict()))       # JSON-safe
    resumed = Controller(TriAccelConfig.from_dict(sd["config"]), LAYERS)
    resumed.load_state_dict(sd)
    assert summary(drive(ref, 30, start=cut, seed=seed + 1)) == summary(drive(resumed, 30, start=cut, seed=seed + 1))
    assert ref.telemetry.records == resumed.telemetry.records


def test_load_state_dict_rejects_other_config_or_layers():
    sd = Controller(paper_config(), LAYERS).state_dict()
    with pytest.raises(ValueError, match="different TriAccelConfig"):
        Controller(paper_config(beta=0.5), LAYERS).load_state_dict(sd)
    with pytest.raises(ValueError, match="different layers"):
        Controller(paper_config(), ["a", "b", "c", "d"]).load_state_dict(sd)


@settings(max_examples=30, deadline=None)
@given(amp=st.floats(0.02, 0.5), period=st.integers(1, 4), seed=st.integers(0, 1000))
def test_no_flapping_with_hysteresis(amp, period, seed):
    """Variance oscillating inside the hysteresis band around a threshold never flips the level."""
    cfg = paper_config(tau_low=1.0, tau_high=100.0, hysteresis=0.6, beta=0.0, t_ctrl=1, warmup_steps=0,
                         min_dwell=0, curvature="off", elastic_batch=False)
    ctl = Controller(cfg, ["a"])
    levels = []
    for step in range(60):
        v = 1.0 + amp * (1 if (step // period) % 2 == 0 else -1)   # within (0.4, 1.6)
        ctl.observe_grad_variance(step, [v])
        levels.append(ctl.decide(step).precisions[0])
    assert len(set(levels[1:])) == 1


def test_dwell_limits_changes_under_oscillation():
    cfg = paper_config(tau_low=1.0, tau_high=100.0, hysteresis=0.0, beta=0.0, t_ctrl=1, warmup_steps=0,
                         min_dwell=10, curvature="off", elastic_batch=False)
    ctl = Controller(cfg, ["a"])
    changes = 0
    for step in range(100):
        ctl.observe_grad_variance(step, [0.1 if step % 2 else 10.0])
        changes += "precision" in ctl.decide(step).changed
    assert changes <= 100 // 10 + 1


def test_core_imports_without_torch_or_jax():
    code = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] in ('torch', 'jax', 'jaxlib', 'flax', 'optax', 'triton'):
                    raise ImportError('blocked: ' + name)
        sys.meta_path.insert(0, Block())
        import triaccel
        from triaccel import Controller, TriAccelConfig
        ctl = Controller(TriAccelConfig(), ['a', 'b'])
        ctl.observe_grad_variance(0, [1.0, 2.0])
        print(ctl.decide(0).batch_size)
        assert not any(m.split('.')[0] in ('torch', 'jax') for m in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "96"


def test_no_curvature_step_during_warm_up():
    ctl = Controller(paper_config(t_ctrl=10, t_curv=20, warmup_steps=30), ["a", "b"])
    assert [s for s in range(0, 101) if ctl.is_curvature_step(s)] == [40, 60, 80, 100]
    off = Controller(paper_config(curvature="off", warmup_steps=0), ["a"])
    assert not any(off.is_curvature_step(s) for s in range(0, 1000, 100))
