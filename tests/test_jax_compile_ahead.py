"""Compilations off the critical path (SplitStep + AheadCompiler), the persistent compilation cache,
the bounded precision policies (core `precision_groups`, `Controller.likely_next`), the compile log,
and the padding that keeps the noise halves and short steps at the full step's shape."""

import os
import threading
import time

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


def _split(compile_ahead=True, compile_cache=False, foresee_policies=False, **cfg_kw):
    from triaccel.backends.jax import SplitStep, TriAccel

    cfg = TriAccelConfig(**{**dict(curvature="off", t_ctrl=2, warmup_steps=2, batch_init=8, batch_min=4,
                                   batch_max=16, batch_buckets=(4, 8, 16), batch_multiple=4), **cfg_kw})
    model = Net()
    ta = TriAccel(cfg, model)
    opt = nnx.Optimizer(model, ta.wrap(optax.sgd(0.1)), wrt=nnx.Param)
    return model, ta, SplitStep(_body, model, opt, ta=ta, compile_ahead=compile_ahead, compile_cache=compile_cache,
                                foresee_policies=foresee_policies)


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

    for bad in ("yes", 1, "AFTER"):
        with pytest.raises(ValueError, match="compile_ahead"):
            SplitStep(_body, Net(), None, compile_ahead=bad)


def test_hold_keeps_queued_compilations_from_starting():
    """Inside hold() (nested too) a queued job does not start; it runs when the last hold ends."""
    from triaccel.backends.jax.compile_ahead import AheadCompiler

    ahead = AheadCompiler(nice=0)
    ran = threading.Event()
    try:
        with ahead.hold():
            with ahead.hold():
                ahead.submit("k", lambda: ran.set() or "k done")
            assert not ran.wait(0.2)                   # the outer hold still holds it
        assert ahead.take("k") == "k done" and ran.is_set()
    finally:
        ahead.close()


def test_ungated_job_runs_until_it_waits_for_the_hold():
    """gated=False: the job starts inside a hold (its lowering, say) and stops at wait_open()
    until the hold ends (its XLA compilation)."""
    from triaccel.backends.jax.compile_ahead import AheadCompiler

    ahead = AheadCompiler(nice=0)
    lowered, compiled = threading.Event(), threading.Event()

    def job():
        lowered.set()
        ahead.wait_open()
        compiled.set()
        return "exe"

    try:
        with ahead.hold():
            ahead.submit("k", job, gated=False)
            assert lowered.wait(5) and not compiled.wait(0.2)
        assert ahead.take("k") == "exe" and compiled.is_set()
    finally:
        ahead.close()


@pytest.mark.parametrize("pack", [False, True])
def test_compile_ahead_after_gives_the_same_steps_and_uses_the_background(pack):
    """compile_ahead="after": the step's first compilation holds the queue; the variants it queued
    are then compiled in the background and taken, with the losses of compile_ahead=True."""
    from triaccel.backends.jax import SplitStep, TriAccel

    cfg = TriAccelConfig(curvature="off", t_ctrl=2, warmup_steps=2, batch_init=8, batch_min=4,
                         batch_max=16, batch_buckets=(4, 8, 16), batch_multiple=4)
    losses = {}
    for mode in (True, "after"):
        model = Net()
        ta = TriAccel(cfg, model)
        opt = nnx.Optimizer(model, ta.wrap(optax.sgd(0.1)), wrt=nnx.Param)
        split = SplitStep(_body, model, opt, ta=ta, compile_ahead=mode, compile_cache=False, pack=pack)
        split.control(0)
        first = float(split(XS[0]))
        split.wait_compiled()
        losses[mode] = [first] + [float(split(x)) for x in XS[1:]]
        assert split.compiled_ahead == 2 and split.traces == 3   # 4 and 16 from the background
    assert losses["after"] == pytest.approx(losses[True], rel=1e-6)


def test_take_cancels_a_queued_job():
    from triaccel.backends.jax.compile_ahead import AheadCompiler

    ahead = AheadCompiler(nice=0)
    gate = threading.Event()
    try:
        ahead.submit("busy", lambda: gate.wait(10) and "busy done")   # holds the one thread
        ahead.submit("a", lambda: "a done")
        assert ahead.take("a") is None                 # still queued: cancelled, the caller compiles
        gate.set()
        assert ahead.take("busy") == "busy done" and ahead.compiled_ahead == 1
    finally:
        gate.set()
        ahead.close()


def test_close_cancels_the_queue_and_lets_the_running_job_finish():
    """close() (SplitStep.close at a run's end): a queued job never runs, the running one finishes, take()
    of a cancelled job answers None (the caller compiles it itself), and the thread exits without
    waiting for the queue."""
    from triaccel.backends.jax.compile_ahead import AheadCompiler

    ahead = AheadCompiler(nice=0)
    gate, started, ran = threading.Event(), threading.Event(), []
    ahead.submit("busy", lambda: started.set() or gate.wait(10) and "busy done")
    ahead.submit("queued", lambda: ran.append("queued") or "queued done")
    assert started.wait(5)
    ahead.close()
    gate.set()
    assert ahead.take("busy") == "busy done"
    assert ahead.take("queued") is None and ran == []
    ahead._pool.shutdown(wait=True)   # the pool's thread is gone, the queued job still not run
    assert ran == []


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


def test_likely_next_reach_lists_the_ladder_ascending():
    cfg = TriAccelConfig(batch_init=16, batch_min=4, batch_max=64, batch_buckets=(4, 8, 16, 32, 64), batch_multiple=4)
    ctl = Controller(cfg, _specs(["other"]))
    assert ctl.likely_next(0)[1] == (8, 32)
    assert ctl.likely_next(0, reach=4)[1] == (4, 8, 32, 64)
    jump = Controller(cfg.replace(batch_growth="jump"), _specs(["other"]))
    assert jump.likely_next(0)[1] == (8, 32, 64)          # a jump may reach any larger rung
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="reach"):
            ctl.likely_next(0, reach=bad)


# -- what the background compiler is given, and when --------------------------------------------

class _Recorder:
    """Stands in for the AheadCompiler: records what is queued, compiles nothing."""

    compiled_ahead = 0

    def __init__(self):
        self.names, self.keys = [], set()

    def submit(self, key, fn, name="", gated=True, stores=False):
        self.names.append(name)
        self.keys.add(key)

    def wait_open(self):
        pass

    def pending(self, key):
        return key in self.keys

    def take(self, key):
        return None


@pytest.mark.parametrize("pad", [False, True])
def test_prepare_queues_every_bucket_up_the_ladder_nearest_first(pad):
    """Once the step is first lowered: a bound function with example shapes, the jobs queued with
    compile_in_background, a function bound with soon=False, the noise half batch (unless the
    loader pads it to the full batch), then each larger bucket up to batch_max; not the buckets
    below."""
    from triaccel.backends.jax import SplitStep, TriAccel

    cfg = TriAccelConfig(curvature="off", t_ctrl=2, warmup_steps=2, batch_init=8, batch_min=4, batch_max=32,
                         batch_buckets=(4, 8, 16, 32), batch_multiple=4)
    model = Net()
    ta = TriAccel(cfg, model)
    opt = nnx.Optimizer(model, ta.wrap(optax.sgd(0.1)), wrt=nnx.Param)
    # True: no hold around the caller's compilations (the recorder stands in for the compiler)
    split = SplitStep(_body, model, opt, ta=ta, compile_ahead=True, compile_cache=False, pad_to_batch=pad)
    rec = split.ahead = _Recorder()

    def probe(m, x):
        return m(x).sum()

    def later(m, x):
        return m(x).mean()

    split.bind(later, model, example_args=(jnp.ones((5, 4)),), soon=False)   # bound first, queued after
    split.bind(probe, model, example_args=(jnp.ones((3, 4)),))
    assert split.compile_in_background("extra", lambda: None)
    split.control(0)
    assert rec.names == []                          # all wait for the step's first lowering
    split(jnp.ones((8, 4)))
    want = ["_body@16", "_body@32"] if pad else ["_body@4", "_body@16", "_body@32"]   # 4: the half
    assert rec.names == ["probe@3", "extra", "later@5", *want]
    split.control(2)
    assert len(rec.names) == 3 + len(want)          # nothing new at the next boundary
    split.compile_in_background("later", lambda: None)
    assert rec.names[-1] == "later"


def test_prepare_compiles_nothing_below_the_loaders_pad_floor():
    """A loader padding every micro-batch to 32 (pad_floor) -> the first call runs at 32 and no
    variant is queued: every size the ladder climbs to is padded to the one compiled shape."""
    from triaccel.backends.jax import SplitStep, TriAccel
    from triaccel.backends.jax.data import ElasticLoader

    cfg = TriAccelConfig(curvature="off", t_ctrl=2, warmup_steps=2, batch_init=8, batch_min=4, batch_max=32,
                         batch_buckets=(4, 8, 16, 32), batch_multiple=4)
    model = Net()
    ta = TriAccel(cfg, model)
    opt = nnx.Optimizer(model, ta.wrap(optax.sgd(0.1)), wrt=nnx.Param)
    loader = ElasticLoader({"x": np.ones((64, 4), np.float32)}, batch_size=8, buckets=cfg.batch_buckets,
                           pad_to_batch=True, pad_floor=32)
    split = SplitStep(_body, model, opt, ta=ta, compile_ahead=True, compile_cache=False, pad_to_batch=True,
                      loader=loader)
    rec = split.ahead = _Recorder()
    split.control(0)
    batch, _ = loader.fetch(np.arange(8))
    split(batch["x"])
    assert batch["x"].shape == (32, 4) and rec.names == []
    loader.pad_floor = None                         # dropped (an OOM): the ladder's own sizes again
    split.prepare(2)
    assert rec.names == ["_body@8", "_body@16"]     # 32: the shape already compiled


def test_foreseen_policy_compiled_ahead_only_when_asked(monkeypatch):
    """By default a policy the controller foresees for the next boundary compiles when it comes (the
    sizes and the bound functions under the current policy ahead); foresee_policies=True queues it."""
    for foresee, want in ((False, 3), (True, 6)):   # step at 8, its half 4, probe; x 2 under fp32
        model, ta, split = _split(foresee_policies=foresee)
        split.bind(lambda m, x: m(x).sum(), model, example_args=(jax.ShapeDtypeStruct((3, 4), jnp.float32),))
        fp32 = tuple([Precision.FP32] * ta.layers.num_layers)
        monkeypatch.setattr(ta.controller, "likely_next", lambda step, reach=1: (fp32, ()))
        split.control(0)
        split(XS[0])
        split.wait_compiled()
        assert split.traces == want
        split.close()
    with pytest.raises(ValueError, match="foresee_policies"):
        _split(foresee_policies="yes")


def test_bound_function_compiled_ahead_under_current_and_likely_policy(monkeypatch):
    """bind(example_args=...) -> compiled in the background once the step is lowered, taken at its
    first call with no trace; with foresee_policies, under the policy the controller expects next
    as well."""
    from triaccel.backends.jax import precision_policy

    model, ta, split = _split(foresee_policies=True)
    x = jnp.full((3, 4), 0.5)

    def probe(m, x):
        return m(x).sum()

    evaluate = split.bind(probe, model, example_args=(jax.ShapeDtypeStruct(x.shape, x.dtype),))
    fp32 = tuple([Precision.FP32] * ta.layers.num_layers)
    monkeypatch.setattr(ta.controller, "likely_next", lambda step, reach=1: (fp32, ()))
    split.control(0)
    split(XS[0])                                    # queues the probe and the step's variants
    split.wait_compiled()
    traces, ahead = split.traces, split.compiled_ahead
    assert traces == 6    # step at 8; probe x 2 policies; step at its half 4, and at 8 and 4 under fp32
    got = float(evaluate(x))
    assert split.traces == traces and split.compiled_ahead == ahead + 1
    split.sync()
    assert got == pytest.approx(float(model(x).sum()), rel=2e-2)     # bf16 compute under the policy
    precision_policy(model, fp32, ta.layers)
    split.resplit()
    assert float(evaluate(x)) == pytest.approx(float(model(x).sum()), rel=1e-6)
    assert split.traces == traces and split.compiled_ahead == ahead + 2


def test_static_step_compiles_its_bound_functions_ahead():
    """Without a TriAccel (a static baseline's step): the bound functions with known shapes are
    compiled in the background once the step is first lowered, and taken at their first call with
    no trace, as beside a TriAccel; nothing is queued before that call, nothing again after it."""
    from triaccel.backends.jax import SplitStep

    model = Net()
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    split = SplitStep(_body, model, opt, compile_ahead=True, compile_cache=False)
    x = jnp.full((3, 4), 0.5)
    evaluate = split.bind(lambda m, x: m(x).sum(), model, example_args=(jax.ShapeDtypeStruct(x.shape, x.dtype),),
                          soon=False)
    assert split.traces == 0
    split(XS[0])
    split.wait_compiled()
    assert split.traces == 2                        # the step on the caller's thread, the evaluation ahead
    assert split.never_taken == ["<lambda>@3"]      # compiled, not called yet
    done: list[str] = []
    assert split.compile_in_background("side", lambda: done.append("side"))   # keeps its own result
    split.wait_compiled()
    assert done == ["side"] and split.never_taken == ["<lambda>@3"]
    got = float(evaluate(x))
    assert split.never_taken == []
    assert split.traces == 2 and split.compiled_ahead == 1
    split.sync()
    assert got == pytest.approx(float(model(x).sum()), rel=1e-6)
    assert split.prepare(5) == 0                    # queued once: a later prepare finds it compiled
    split(XS[0])
    assert split.traces == 2


def test_never_taken_lists_finished_background_compilations_no_call_took():
    """A job taken, a job finished and never taken, a job that failed, a job still queued behind a
    hold: only the finished, untaken one is listed."""
    from triaccel.backends.jax.compile_ahead import AheadCompiler

    ahead = AheadCompiler(nice=0)

    def fail():
        raise RuntimeError("no")

    ahead.submit("a", lambda: 1, name="used")
    ahead.submit("b", lambda: 2, name="unused")
    ahead.submit("c", fail, name="failed")
    ahead.wait()
    assert ahead.take("a") == 1
    with ahead.hold():
        ahead.submit("d", lambda: 4, name="queued")
        time.sleep(0.05)
        assert sorted(ahead.never_taken()) == ["unused"]
    ahead.wait()
    assert sorted(ahead.never_taken()) == ["queued", "unused"]
    gate = threading.Event()
    ahead.submit("e", gate.wait, name="slow")
    while "slow (unfinished)" not in ahead.never_taken():   # running: listed as such
        time.sleep(0.01)
    gate.set()
    ahead.wait()
    assert sorted(ahead.never_taken()) == ["queued", "slow", "unused"]
    kept: list[int] = []
    ahead.submit("f", lambda: kept.append(6), name="stored", stores=True)   # its result kept by fn itself
    ahead.wait()
    assert kept == [6] and sorted(ahead.never_taken()) == ["queued", "slow", "unused"]
    ahead.close()


def test_static_step_without_compile_ahead_compiles_at_first_call():
    from triaccel.backends.jax import SplitStep

    model = Net()
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    split = SplitStep(_body, model, opt, compile_ahead=False, compile_cache=False)
    x = jnp.full((3, 4), 0.5)
    evaluate = split.bind(lambda m, x: m(x).sum(), model, example_args=(x,))
    split(XS[0])
    assert split.traces == 1 and split.prepare(1) == 0
    float(evaluate(x))
    assert split.traces == 2 and split.compiled_ahead == 0


def test_example_args_checked():
    _m, _ta, split = _split()
    with pytest.raises(ValueError, match="example_args"):
        split.bind(lambda m, x: x, _m, example_args=jnp.ones(3))


def test_applied_policy_restores_the_exact_dtypes():
    from triaccel.backends.jax.policy import applied_policy

    model, ta, _split_ = _split()
    graphdef = nnx.split(model)[0]
    assert model.fc1.dtype is None
    with applied_policy(model, [Precision.FP16] * ta.layers.num_layers, ta.layers):
        assert model.fc1.dtype == jnp.float16
    assert model.fc1.dtype is None and nnx.split(model)[0] == graphdef


# -- the compile log ----------------------------------------------------------------------------

def test_compile_log_splits_critical_path_and_background():
    from triaccel.backends.jax.compile_log import BACKGROUND_THREAD_PREFIX, CompileLog, describe, note_wait

    f = jax.jit(lambda x: x * 3 + 1)
    g = jax.jit(lambda x: x - 2)
    x, y = jnp.ones(5), jnp.ones(6)
    with CompileLog() as log:
        f(x)
        t = threading.Thread(target=lambda: g.lower(jax.ShapeDtypeStruct((5,), jnp.float32)).compile(),
                             name=BACKGROUND_THREAD_PREFIX + "-test")
        t.start()
        t.join()
        note_wait("g@5", 0.25)
        first = log.window()
        g(x)                                        # compiled ahead: nothing new
        second = log.window()
    n = len(log.records)
    f(y)                                            # after stop: not recorded
    assert len(log.records) == n
    assert first["critical"]["compiles"] == 1 and first["background"]["compiles"] == 1
    assert first["critical"]["by_kind"]["wait"] == 0.25
    assert {"trace", "lower", "compile"} <= set(first["background"]["by_kind"])
    assert second["critical"]["compiles"] == 0 and second["background"]["compiles"] == 0
    assert log.summary()["critical"]["compiles"] == 1
    assert "1 on the critical path" in describe(first) and "waited 0.2s" in describe(first)


# -- padding to the decided batch: one shape per decided size -----------------------------------

def _noise_setup(pad):
    from triaccel.backends.jax.data import ElasticLoader
    from triaccel.backends.jax.layers import layer_map_from_params

    rng = np.random.default_rng(0)
    params = {"fc1": {"kernel": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32),
                      "bias": jnp.zeros((4,), jnp.float32)},
              "fc2": {"kernel": jnp.asarray(rng.normal(size=(4, 1)), jnp.float32),
                      "bias": jnp.zeros((1,), jnp.float32)}}
    lm = layer_map_from_params(params)
    cfg = TriAccelConfig(t_ctrl=1, warmup_steps=0, batch_init=16, batch_min=8, batch_max=32,
                         batch_buckets=(8, 16, 32), adaptive_precision=False)
    ctl = Controller(cfg, lm.specs)
    arrays = {"x": rng.normal(size=(40, 3)).astype(np.float32), "t": rng.normal(size=(40,)).astype(np.float32)}
    loader = ElasticLoader(arrays, batch_size=16, seed=3, pad_to_batch=pad)

    def loss(p, b, m):
        h = jnp.tanh(b["x"] @ p["fc1"]["kernel"] + p["fc1"]["bias"])
        return jnp.sum(((h @ p["fc2"]["kernel"] + p["fc2"]["bias"])[:, 0] - b["t"]) ** 2 * m) / jnp.sum(m)

    return params, lm, ctl, loader, jax.jit(jax.value_and_grad(loss))


def test_pad_to_batch_runs_noise_halves_and_short_step_at_the_full_shape():
    """40 samples at 16, every step a noise step: halves of 8 and the short last step of 8 (halves
    of 4) all run at 16 with pad_to_batch, and give the same gradients and measurements."""
    from triaccel.backends.jax.data import elastic_step

    runs = {}
    for pad in (False, True):
        params, lm, ctl, loader, vg = _noise_setup(pad)
        shapes, grads, sizes = [], [], []
        spy = ctl.observe_gradient_noise

        def observe(step, s, micro, total, spy=spy):
            sizes.append(list(s))
            spy(step, s, micro, total)

        ctl.observe_gradient_noise = observe

        def grad_fn(batch, mask, params=params, vg=vg, shapes=shapes):
            shapes.append(int(mask.shape[0]))
            return vg(params, batch, mask)

        for step in range(3):
            res = elastic_step(loader, ctl, grad_fn, step, tensor_layer=lm)
            grads.append(res.grads)
        assert res.end_of_epoch and ctl.decision.batch_size == 16
        runs[pad] = shapes, grads, sizes
    assert runs[False][0] == [8, 8, 8, 8, 8, 8]     # halves of 16, then halves of the short step (4 -> 8)
    assert runs[True][0] == [16] * 6
    assert runs[True][2] == runs[False][2] == [[8, 8], [8, 8], [4, 4]]
    for a, b in zip(runs[False][1], runs[True][1]):
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)


def test_fetch_pad_to():
    from triaccel.backends.jax.data import ElasticLoader

    loader = ElasticLoader({"id": np.arange(20, dtype=np.int32)}, batch_size=16, buckets=(8, 16), shuffle=False)
    batch, mask = loader.fetch(np.arange(3), pad_to=16)
    assert mask.shape == (16,) and float(mask.sum()) == 3
    assert np.asarray(batch["id"]).tolist() == [0, 1, 2] * 5 + [0]   # the real samples again
    assert loader.fetch(np.arange(3))[1].shape == (8,)
    with pytest.raises(ValueError, match="pad_to"):
        loader.fetch(np.arange(3), pad_to=0)
    with pytest.raises(ValueError, match="bucket"):
        loader.fetch(np.arange(3), pad_to=32)
    with pytest.raises(ValueError, match="pad_to_batch"):
        ElasticLoader({"id": np.arange(4)}, batch_size=2, pad_to_batch=1)


def test_pad_floor_runs_every_micro_batch_at_the_floor_with_the_same_gradients():
    """pad_floor=32 over a batch of 16 (noise halves of 8, a short last step): every micro-batch
    runs at 32, with the gradients and noise measurements of the unpadded run."""
    from triaccel.backends.jax.data import elastic_step

    runs = {}
    for floor in (None, 32):
        params, lm, ctl, loader, vg = _noise_setup(True)
        loader.set_buckets((8, 16, 32))
        loader.pad_floor = floor
        shapes, grads = [], []

        def grad_fn(batch, mask, params=params, vg=vg, shapes=shapes):
            shapes.append(int(mask.shape[0]))
            return vg(params, batch, mask)

        for step in range(3):
            grads.append(elastic_step(loader, ctl, grad_fn, step, tensor_layer=lm).grads)
        runs[floor] = shapes, grads, ctl.b_noise
    assert runs[None][0] == [16] * 6 and runs[32][0] == [32] * 6
    assert runs[32][2] == pytest.approx(runs[None][2], rel=1e-5)
    for a, b in zip(runs[None][1], runs[32][1]):
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)


def test_pad_floor_is_dropped_when_a_padded_micro_batch_runs_out_of_memory():
    from triaccel.backends.jax.data import elastic_step

    params, lm, ctl, loader, vg = _noise_setup(True)
    loader.set_buckets((8, 16, 32))
    loader.pad_floor = 32
    shapes = []

    def grad_fn(batch, mask):
        shapes.append(int(mask.shape[0]))
        if mask.shape[0] == 32:
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory (simulated)")
        return vg(params, batch, mask)

    with pytest.warns(RuntimeWarning, match="pad_floor=32"):
        res = elastic_step(loader, ctl, grad_fn, 0, tensor_layer=lm)
    assert loader.pad_floor is None and shapes[0] == 32 and max(shapes[1:]) <= 16
    assert res.ooms == 1 and res.samples == 16     # the step's samples replayed, none lost


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, 64])
def test_pad_floor_rejects_bad_values(bad):
    from triaccel.backends.jax.data import ElasticLoader

    with pytest.raises(ValueError, match="pad_floor"):
        ElasticLoader({"id": np.arange(40)}, batch_size=8, buckets=(8, 16, 32), pad_floor=bad)
    loader = ElasticLoader({"id": np.arange(40)}, batch_size=8, pad_floor=64)   # no buckets yet
    with pytest.raises(ValueError, match="pad_floor=64"):
        loader.set_buckets((8, 16, 32))    # e.g. the controller's, taken by elastic_step
    assert loader.buckets is None                  # left as it was


def test_noise_step_compiled_ahead_leaves_nothing_to_compile_for_the_caller():
    """`noise_step_compilations` on a background thread -> a noise step compiles none of the
    weighting, accumulation and norm functions on the caller's thread."""
    from triaccel.backends.jax.compile_log import BACKGROUND_THREAD_PREFIX, CompileLog
    from triaccel.backends.jax.data import elastic_step, noise_step_compilations

    params, lm, ctl, loader, vg = _noise_setup(True)
    grad_fn = lambda b, m: vg(params, b, m)   # noqa: E731
    jobs = noise_step_compilations(params)
    assert [n for n, _ in jobs] == ["noise:scale", "noise:add", "noise:sqnorms", "noise:rows", "noise:loss"]
    t = threading.Thread(target=lambda: [job() for _, job in jobs], name=BACKGROUND_THREAD_PREFIX + "-test")
    t.start()
    t.join()
    assert ctl.is_noise_step(0)
    grad_fn(*loader.fetch(np.arange(8), pad_to=16))   # the step's own function compiles here
    with CompileLog() as log:
        res = elastic_step(loader, ctl, grad_fn, 0, tensor_layer=lm)
    assert len(res.micro_sizes) == 2
    # the losses' weighting too: eager, its multiply and adds compiled here, on the caller's thread
    assert not [r.name for r in log.records if r.kind == "compile"]
    with pytest.raises(ValueError, match="grads_like"):
        noise_step_compilations({})


@pytest.mark.parametrize("ahead", [True, False])
def test_noise_step_compiles_the_loss_weighting_of_a_loss_shaped_as_loss_like(ahead):
    """A loss that is not the default float32 scalar (here bfloat16): `loss_like` gives its shape and
    type, and the two halves' weighting is then compiled ahead; without it, on the caller's thread."""
    from triaccel.backends.jax.compile_log import CompileLog
    from triaccel.backends.jax.data import elastic_step, noise_step_compilations

    jax.clear_caches()   # jit caches are per process: the other case's compilation would be found
    params, lm, ctl, loader, vg = _noise_setup(True)
    to_bf16 = jax.jit(lambda loss: loss.astype(jnp.bfloat16))

    def grad_fn(b, m):
        loss, grads = vg(params, b, m)
        return to_bf16(loss), grads

    loss_like = jax.ShapeDtypeStruct((), jnp.bfloat16) if ahead else None
    for _, job in noise_step_compilations(params, loss_like=loss_like):
        job()
    grad_fn(*loader.fetch(np.arange(8), pad_to=16))   # the step's own functions compile here
    with CompileLog() as log:
        res = elastic_step(loader, ctl, grad_fn, 0, tensor_layer=lm)
    assert len(res.micro_sizes) == 2 and res.loss.dtype == jnp.bfloat16
    compiled = [r.name for r in log.records if r.kind == "compile"]
    assert compiled == [] if ahead else any("_weighted_losses" in n for n in compiled)


def test_gather_compiled_ahead_leaves_nothing_to_compile_for_the_caller():
    from triaccel.backends.jax.compile_log import BACKGROUND_THREAD_PREFIX, CompileLog
    from triaccel.backends.jax.data import ElasticLoader

    arrays = (jax.device_put(np.arange(60, dtype=np.float32).reshape(20, 3), jax.devices()[0]),
              jax.device_put(np.arange(20, dtype=np.int32), jax.devices()[0]))
    loader = ElasticLoader(arrays, batch_size=4, buckets=(4, 8, 16), shuffle=False)
    jobs = loader.gather_compilations([5, 8, 16])          # 5 -> bucket 8: one job per array and bucket
    assert [n for n, _ in jobs] == ["gather:0@8", "gather:1@8", "gather:0@16", "gather:1@16"]
    t = threading.Thread(target=lambda: [job() for _, job in jobs], name=BACKGROUND_THREAD_PREFIX + "-test")
    t.start()
    t.join()
    with CompileLog() as log:
        (x, y), mask = loader.fetch(np.arange(10, 16))
    assert x.shape == (8, 3) and np.asarray(y)[:6].tolist() == list(range(10, 16))
    assert "jit(_gather)" not in {r.name for r in log.records if r.kind == "compile"}
    assert ElasticLoader({"x": np.ones((4, 2))}, batch_size=2).gather_compilations([2]) == []   # host arrays


def test_quiet_waits_for_a_running_compilation_and_holds_the_rest():
    from triaccel.backends.jax.compile_ahead import AheadCompiler

    ahead = AheadCompiler(nice=0)
    events = []
    started = threading.Event()

    def compiling():
        started.set()
        time.sleep(0.3)
        events.append("first done")
        return 1

    def lowering_then_compiling():   # gated=False: lowers freely, stops at wait_open under a hold
        events.append("second lowering")
        ahead.wait_open()
        events.append("second compiling")
        return 2

    ahead.submit("first", compiling)
    assert started.wait(5)
    ahead.submit("second", lowering_then_compiling, gated=False)
    with ahead.quiet():
        events.append("quiet")
        time.sleep(0.2)
    assert events.index("first done") < events.index("quiet")   # the running compilation finished first
    assert ahead.take("second") == 2
    assert events.index("second compiling") > events.index("quiet")
    with ahead.quiet():   # nothing running: enters at once
        pass
    ahead.close()


def test_compiler_options_reach_the_step_and_its_bound_functions():
    """SplitStep(compiler_options=...) is jax.jit's compiler_options for the step and every bound
    function: a known XLA option compiles and trains as without it; an unknown one fails at the
    first compilation of either, naming it; a non-mapping is refused up front."""
    from triaccel.backends.jax import SplitStep

    def fresh(options):
        model = Net()
        opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        return model, SplitStep(_body, model, opt, compile_ahead=False, compile_cache=False, compiler_options=options)

    _, plain = fresh(None)
    _, tuned = fresh({"xla_gpu_autotune_level": 2})   # an XLA debug option; ignored by the CPU compiler
    assert [float(plain(x)) for x in XS] == [float(tuned(x)) for x in XS]
    model, bad = fresh({"no_such_option": 1})
    with pytest.raises(Exception, match="no_such_option"):
        bad(XS[0])
    probe = bad.bind(lambda m, x: m(x).sum(), model)
    with pytest.raises(Exception, match="no_such_option"):
        probe(XS[0])
    with pytest.raises(ValueError, match="compiler_options"):
        fresh([("xla_gpu_autotune_level", 2)])


def test_variant_key_hashes_its_graph_once_and_compares_as_the_tuple():
    from triaccel.backends.jax.split_step import VariantKey

    class Graph:
        """A graph definition whose hash costs: counts its calls."""
        hashes = 0

        def __init__(self, name: str) -> None:
            self.name = name

        def __hash__(self) -> int:
            Graph.hashes += 1
            return hash(self.name)

        def __eq__(self, other: object) -> bool:
            return isinstance(other, Graph) and other.name == self.name

    a, a2, b = VariantKey(Graph("a"), "tree", 1), VariantKey(Graph("a"), "tree", 1), VariantKey(Graph("b"), "tree", 1)
    made = Graph.hashes
    assert made == 3   # one hash each, when made
    table = {a: "exes"}
    for _ in range(20):   # a control boundary's lookups
        assert table.get(a) == "exes" and table.get(a2) == "exes" and (7, a, "sig") in {(7, a2, "sig")}
        assert b not in table and a != b and not a == b and a == a2
    assert Graph.hashes == made
    # the same hash and equality as the plain tuple it replaced
    plain = (a[0], "tree", 1)
    assert hash(a) == hash(plain) and a == plain and plain == a and table[plain] == "exes"
    assert a != "tree" and not (a == 3)
    g, t, s = a
    assert (g.name, t, s) == ("a", "tree", 1)
    import copy
    import pickle

    for c in (copy.deepcopy(a), pickle.loads(pickle.dumps(VariantKey("g", ("t",), 2)))):
        assert type(c) is VariantKey and c == tuple(c) and hash(c) == hash(tuple(c))
