"""Compilations off the critical path (SplitStep + AheadCompiler), the persistent compilation cache,
and the bounded precision policies (core `precision_groups`, `Controller.likely_next`)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from triaccel import Controller, Precision, TriAccelConfig
from triaccel.layers import LayerSpec
from triaccel.variants import group_precisions, precision_groups


class Net(nnx.Module):
    def __init__(self):
        self.fc1 = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
        self.fc2 = nnx.Linear(8, 2, rngs=nnx.Rngs(1))

    def __call__(self, x):
        return self.fc2(jnp.tanh(self.fc1(x)))


def _body(m, o, x):
    loss, g = nnx.value_and_grad(lambda m: (m(x) ** 2).mean())(m)
    o.update(m, g)
    return loss


def _split(compile_ahead=True, compile_cache=False, **cfg_kw):
    from triaccel.backends.jax import SplitStep, TriAccel

    cfg = TriAccelConfig(**{**dict(curvature="off", t_ctrl=2, warmup_steps=2, batch_init=8, batch_min=4,
                                   batch_max=16, batch_buckets=(4, 8, 16), batch_multiple=4), **cfg_kw})
    model = Net()
    ta = TriAccel(cfg, model)
    opt = nnx.Optimizer(model, ta.wrap(optax.sgd(0.1)), wrt=nnx.Param)
    return model, ta, SplitStep(_body, model, opt, ta=ta, compile_ahead=compile_ahead, compile_cache=compile_cache)


XS = [jnp.full((8, 4), 0.5), jnp.full((16, 4), -0.25), jnp.full((4, 4), 1.0)]


@pytest.fixture(scope="module")
def ahead_run():
    """One run with compile-ahead on: the first call at 8 queues the likely next sizes (4: the
    noise half batch and the bucket down, 16: the bucket up); then a precision policy compiled
    ahead and applied. Trace counts at each stage."""
    from triaccel.backends.jax import precision_policy

    model, ta, split = _split()
    split.control(0)
    out = {"losses": [float(split(XS[0]))]}
    split.wait_compiled()
    out["traces_after_wait"] = split.traces
    out["losses"] += [float(split(x)) for x in XS[1:]]
    out["traces_after_switch"], out["ahead_after_switch"] = split.traces, split.compiled_ahead
    fp32 = [Precision.FP32] * ta.layers.num_layers
    out["queued_policy"] = split.compile_ahead([], policies=[fp32])   # the current size, new policy
    split.wait_compiled()
    out["traces_policy_ready"] = split.traces
    split.sync()
    precision_policy(model, fp32, ta.layers)
    split.resplit()
    split(XS[2])
    out["traces_policy_used"], out["ahead_policy_used"] = split.traces, split.compiled_ahead
    out["queued_again"] = split.compile_ahead([], policies=[fp32])
    return out


def test_background_compile_is_used_without_a_new_trace(ahead_run):
    assert ahead_run["traces_after_wait"] == 3     # 8 on the caller's thread, 4 and 16 in the background
    assert ahead_run["traces_after_switch"] == 3 and ahead_run["ahead_after_switch"] == 2
    assert all(np.isfinite(ahead_run["losses"]))


def test_ahead_executable_computes_what_a_foreground_one_does(ahead_run):
    _m, _ta, split = _split(compile_ahead=False)
    split.control(0)
    losses = [float(split(x)) for x in XS]
    assert ahead_run["losses"] == pytest.approx(losses, rel=1e-6)
    assert split.compiled_ahead == 0 and split.traces == 3   # off switch: each variant at its first call


def test_next_policy_compiled_ahead_is_taken_when_applied(ahead_run):
    assert ahead_run["queued_policy"] == 1
    assert ahead_run["traces_policy_ready"] == 4
    assert ahead_run["traces_policy_used"] == 4 and ahead_run["ahead_policy_used"] == 3
    assert ahead_run["queued_again"] == 0           # nothing left to compile for it


def test_compile_ahead_needs_a_first_call_and_checks_sizes():
    _m, _ta, split = _split()
    assert split.compile_ahead([16]) is None               # no argument shapes known yet
    with pytest.raises(ValueError, match="batches"):
        split.compile_ahead([0])


def test_compile_cache_folder_honoured_and_off_switch(tmp_path):
    from jax.experimental.compilation_cache import compilation_cache as cc

    old_min = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    try:
        folder = tmp_path / "cache"
        _m, _ta, split = _split(compile_ahead=False, compile_cache=folder)
        assert split.compile_cache == str(folder)
        split(jnp.ones((8, 4)))
        assert any(folder.iterdir())                        # the step's executable was written there
        _m, _ta, off = _split(compile_ahead=False, compile_cache=False)
        assert off.compile_cache is None and not jax.config.jax_enable_compilation_cache
        before = set(folder.iterdir())
        off(jnp.ones((12, 4)))                              # a new variant, not written
        assert set(folder.iterdir()) == before
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", old_min)
        jax.config.update("jax_enable_compilation_cache", True)
        cc.set_cache_dir(None)
        cc.reset_cache()


def test_default_cache_folder_follows_triaccel_cache(monkeypatch, tmp_path):
    from triaccel.backends.jax.compile_ahead import default_compile_cache_dir

    monkeypatch.setenv("TRIACCEL_CACHE", str(tmp_path))
    assert default_compile_cache_dir() == tmp_path / "jax"


def test_compile_ahead_argument_checked():
    from triaccel.backends.jax import SplitStep

    with pytest.raises(ValueError, match="compile_ahead"):
        SplitStep(_body, Net(), None, compile_ahead="yes")


# -- core: bounded policies and the likely next decision ----------------------------------------

def _specs(kinds):
    return [LayerSpec(f"l{i}", k) for i, k in enumerate(kinds)]


def test_precision_groups_partition_free_layers_in_order():
    g = precision_groups(np.array([False, True, False, False, False]), 2)
    assert g.tolist() == [0, -1, 0, 1, 1]
    P = Precision
    out = group_precisions([P.BF16, P.FP32, P.FP32, P.BF16, P.BF16], g)
    assert out == (P.FP32, P.FP32, P.FP32, P.BF16, P.BF16)   # the norm layer keeps its FP32
    assert precision_groups([False], None) is None
    with pytest.raises(ValueError, match="groups"):
        precision_groups([False], 0)


def test_config_precision_groups_validated():
    assert TriAccelConfig(precision_groups=3).precision_groups == 3
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="precision_groups"):
            TriAccelConfig(precision_groups=bad)


def test_grouped_controller_bounds_the_policies():
    """Evidence on one layer moves its whole group; 4 groups -> at most 2^4 policies whatever the
    evidence pattern (random per-layer evidence over many decisions)."""
    cfg = TriAccelConfig(precision_groups=4, t_ctrl=1, warmup_steps=0, min_dwell=1, elastic_batch=False)
    kinds = ["other", "norm"] * 10
    ctl = Controller(cfg, _specs(kinds))
    rng = np.random.default_rng(0)
    seen = set()
    for step in range(200):
        ctl.observe_nonfinite(step, (rng.random(len(kinds)) < 0.1).astype(float))
        seen.add(ctl.decide(step).precisions)
    assert 2 < len(seen) <= 2 ** 4
    for p in seen:
        free = [x for x, k in zip(p, kinds) if k == "other"]
        assert all(len(set(free[i:i + 3] if i < 6 else free[i:i + 2])) == 1 for i in (0, 3, 6, 8))


def test_likely_next_predicts_expiring_evidence_and_neighbour_buckets():
    cfg = TriAccelConfig(t_ctrl=10, warmup_steps=0, min_dwell=20, batch_init=16, batch_min=8, batch_max=64,
                         batch_buckets=(8, 16, 32, 64))
    ctl = Controller(cfg, _specs(["other", "other"]))
    ctl.observe_nonfinite(0, [3.0, 0.0])                   # evidence on layer 0 until step 20
    d = ctl.decide(0)
    assert d.precisions == (Precision.FP32, Precision.BF16)
    prec, near = ctl.likely_next(0)
    assert prec == (Precision.FP32, Precision.BF16)       # still in force at step 10
    assert near == (8, 32)
    assert ctl.decide(10).precisions == prec
    prec, _ = ctl.likely_next(10)
    assert prec == (Precision.BF16, Precision.BF16)       # expired by step 20, and dwell is over
    assert ctl.decide(20).precisions == prec
    assert ctl.likely_next(20)[0] == prec                  # nothing changed in the controller itself
