"""offload="auto" as one decision with the batch lever: the controller picks batch and swap plan
together from cost tables and memory; the torch wrapper measures, applies and trains under the plan."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from triaccel import Controller, TriAccelConfig
from triaccel.controller import Decision
from triaccel.swap_plan import CostModel, CostTable, LayerCost, choose_batch, simulate

MB = 10**6
LIMIT = int(1500 * MB / 0.85) + 1   # MemMax whose rho_high share (the plans' target) is 1500 MB


def table(batch, saved, fwd, bwd, bw=200e9, other=10.0, n=10, **kw):
    layers = [LayerCost(f"u{i}", saved, fwd, bwd, input_bytes=saved // 10, **kw) for i in range(n)]
    return CostTable(batch, layers, bw, bw, static_bytes=200 * MB, transient_bytes=batch * MB // 64 * 50,
                     other_ms=other)


def fast_link():
    """A fixed cost per unit: larger batches are more efficient; transfers hide behind compute."""
    return (table(32, 50 * MB, 1.5, 3.0), table(64, 100 * MB, 2.0, 4.0))


def slow_link():
    """The same compute, but a 0.1 GB/s link and recomputation 10x the forward: plans cost more
    than the larger batch gains."""
    return (table(32, 50 * MB, 1.5, 3.0, bw=1e8, recompute_ms=30.0),
            table(64, 100 * MB, 2.0, 4.0, bw=1e8, recompute_ms=40.0))


def config(**kw):
    base = dict(offload="auto", batch_law="memory", batch_init=64, batch_min=8, batch_max=512, warmup_steps=0,
                t_ctrl=10, adaptive_precision=False, lr_rule="linear")
    return TriAccelConfig(**{**base, **kw})


def controller(tables, **kw):
    c = Controller(config(**kw), ["a", "b"])
    c.observe_offload_costs(0, tables)
    c.observe_memory(0, 500 * MB, LIMIT)
    return c


def test_larger_batch_with_a_plan_when_the_model_says_faster():
    c = controller(fast_link())
    assert c.decision.offload_plan is None  # no decision taken on the tables yet
    d = c.decide(10)
    plan = c.offload_swap_plan
    assert d.offload_plan == plan.actions and plan.active and plan.fits
    ref = choose_batch(CostModel(fast_link()), 1500 * MB, c.config, batches=range(8, 513, 8))
    assert d.batch_size == ref.batch > ref.baseline.batch and d.offload_plan == ref.plan.actions
    assert d.lr_batch_scale == pytest.approx(ref.lr_scale) == pytest.approx(d.batch_size / 64)
    assert {"batch", "lr", "offload"} <= d.changed
    info = c.telemetry.records[-1]["offload"]
    assert info["baseline_batch"] == ref.baseline.batch and info["modelled_peak"] <= 1500 * MB


def test_smaller_batch_and_no_plan_when_the_plan_costs_more():
    c = controller(slow_link())
    d = c.decide(10)
    assert d.offload_plan == ("keep",) * 10 and not c.offload_swap_plan.active
    plain = [b for b in range(8, 513, 8)
             if simulate(CostModel(slow_link()).at(b), ["keep"] * 10, budget=1500 * MB).fits]
    assert d.batch_size == max(plain)  # the largest plain batch: per-unit overhead favours it
    # and a known, small noise scale keeps even the fast link's plan out (goodput, not throughput)
    fast = controller(fast_link(), batch_law="noise")
    assert fast.decide(10).batch_size == 64  # B_noise unknown under the noise law: no growth
    assert not fast.offload_swap_plan.active


def test_oom_shrinks_at_once_and_drops_the_plan():
    c = controller(fast_link(), oom_shrink=0.15)
    big = c.decide(10)
    assert c.offload_swap_plan.active
    d = c.observe_oom(12)
    assert d.batch_size < big.batch_size and {"batch", "offload"} <= d.changed
    assert d.offload_plan == ("keep",) * 10  # the smaller batch fits without a plan
    # the model under-estimated the peak: later plans aim lower, and never at the failed batch again
    assert c.telemetry.records[-1]["event"] == "oom"
    nxt = c.decide(20)
    assert c.offload_swap_plan.peak_bytes < 1500 * MB - (LIMIT - big_peak(c, big)) + 1
    assert nxt.batch_size < big.batch_size


def big_peak(c, d):
    return simulate(c._planner.model.at(d.batch_size), d.offload_plan).peak_bytes


def test_replans_when_memory_or_timings_move():
    c = controller(fast_link())
    first = c.decide(10)
    p = c.offload_swap_plan
    c.observe_memory(15, p.peak_bytes + 200 * MB, LIMIT)  # measured 200 MB over the model
    second = c.decide(20)
    assert c.offload_swap_plan.peak_bytes <= 1500 * MB - 200 * MB
    assert second.batch_size <= first.batch_size
    assert not c.wants_offload_costs(30)
    c.observe_step_time(25, 100.0)   # the reference under this batch and plan
    c.observe_step_time(28, 110.0)   # within the tolerance
    assert not c.wants_offload_costs(30)
    c.observe_step_time(29, 200.0)   # one window off: a one-off (an evaluation, say)
    assert not c.wants_offload_costs(30)
    c.observe_step_time(29, 100.0)
    c.observe_step_time(29, 200.0)
    c.observe_step_time(29, 190.0)   # two in a row: timings moved, new tables wanted
    assert c.wants_offload_costs(30) and not c.wants_offload_costs(31)
    c.observe_offload_costs(30, slow_link())
    assert not c.wants_offload_costs(30)
    assert c.decide(30).offload_plan == ("keep",) * 10


def test_same_observations_same_decisions_and_state_round_trip():
    def run(split_at=None):
        c = controller(fast_link())
        out = []
        for step in (10, 20, 30):
            if step == split_at:
                fresh = Controller(c.config, ["a", "b"])
                fresh.load_state_dict(c.state_dict())
                c = fresh
            c.observe_memory(step - 5, 900 * MB + step * MB, LIMIT)
            out.append(c.decide(step).to_dict())
            if step == 20:
                out.append(c.observe_oom(21).to_dict())
        return out, c.telemetry.records
    (a, tel_a), (b, tel_b), (resumed, tel_r) = run(), run(), run(split_at=20)
    assert a == b and tel_a == tel_b and a == resumed and tel_a == tel_r
    assert all(x["offload_plan"] is not None for x in a) and any("recompute" in x["offload_plan"] for x in a)
    d = Decision.from_dict(a[0])
    assert d.offload_plan == tuple(a[0]["offload_plan"]) and d.same_as(Decision.from_dict(a[0]))
    assert not d.same_as(Decision.from_dict({**a[0], "offload_plan": ["keep"] * 10}))


def test_offload_off_and_validation():
    c = Controller(TriAccelConfig(), ["a"])
    with pytest.raises(ValueError, match="offload"):
        c.observe_offload_costs(0, fast_link())
    assert not c.wants_offload_costs(100) and c.decide(0).offload_plan is None
    c = controller(fast_link())
    with pytest.raises(ValueError, match="units"):
        c.observe_offload_costs(1, (table(32, MB, 1.0, 1.0, n=3),))
    with pytest.raises(ValueError, match="ms_per_step"):
        c.observe_step_time(1, -1.0)


# -- torch wrapper ----------------------------------------------------------------------------

class _Probe:
    """A memory probe with a settable limit (CPU has no allocator statistics)."""

    def __init__(self, limit):
        self.limit = limit

    def read(self):
        from triaccel.backends.torch.memory import MemoryReading
        return MemoryReading(0, self.limit, self.limit, self.limit, 0, None)


def _setup():
    from triaccel.backends.torch.models import create_model
    model = create_model("resnet18", width=0.125, seed=0)
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(6, 8, 3, 16, 16, generator=g)
    ys = torch.randint(0, 10, (6, 8), generator=g)
    return model, xs, ys


def _grads(model, x, y, ctx):
    model.zero_grad(set_to_none=True)
    with ctx:
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_torch_wrapper_measures_applies_and_matches_the_plan_by_hand():
    from triaccel.backends.torch import wrap
    from triaccel.backends.torch.offload import ActivationOffload

    model, xs, ys = _setup()
    twin, _, _ = _setup()
    cfg = TriAccelConfig(offload="auto", batch_law="memory", elastic_batch=False, adaptive_precision=False,
                         base_precision="fp32", batch_init=8, batch_min=8, warmup_steps=2, t_ctrl=2)
    probe = _Probe(10**12)
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model, cfg, memory_probe=probe,
               offload_options=dict(min_bytes=0, bandwidth=(1e9, 1e9), repeats=1))
    drv = opt.offload
    state = {k: v.clone() for k, v in model.state_dict().items()}

    def train(i):
        with opt.autocast():
            loss = F.cross_entropy(model(xs[i]), ys[i])
        opt.backward(loss)
        opt.step()
        opt.zero_grad()

    train(0)
    train(1)  # boundary at step 2: tables measured on the last input, then decided: no plan needed
    assert drv.measurements == [{"step": 2, "batches": [4, 8]}]
    assert opt.decision.offload_plan == ("keep",) * len(drv.offload.units)
    # the measuring steps left no trace: parameters moved only by the two optimizer steps, BN
    # statistics as after two training forwards
    ref_opt = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9)
    twin.load_state_dict(state)
    for i in (0, 1):
        ref_opt.zero_grad()
        F.cross_entropy(twin(xs[i]), ys[i]).backward()
        ref_opt.step()
    for (n, a), b in zip(model.state_dict().items(), twin.state_dict().values()):
        assert torch.equal(a, b), n
    # a budget below the plain step: the next boundary takes a plan and the wrapper applies it
    tables = opt.controller._offload_model.tables
    keep = simulate(CostModel(tables).at(8), ["keep"] * len(tables[0].layers)).peak_bytes
    probe.limit = int(0.6 * keep / cfg.rho_high)
    train(2)
    train(3)
    plan = opt.decision.offload_plan
    assert "offload" in opt.decision.changed and any(a != "keep" for a in plan)
    print("plan taken:", plan)
    assert drv.offload.actions == plan and drv.plans[-1]["actions"] == list(plan)
    # fp32 gradients under the wrapper's plan == the same plan applied by hand == no plan
    twin.load_state_dict(model.state_dict())
    by_hand = ActivationOffload(twin, min_bytes=0)
    by_hand.apply(opt.controller.offload_swap_plan)
    g_wrapped = _grads(model, xs[4], ys[4], opt.autocast())
    g_hand = _grads(twin, xs[4], ys[4], by_hand)
    by_hand.apply(["keep"] * len(plan))
    g_plain = _grads(twin, xs[4], ys[4], by_hand)
    for n in g_plain:
        assert torch.equal(g_wrapped[n], g_hand[n]) and torch.equal(g_wrapped[n], g_plain[n]), n
    if "swap" in plan:
        assert drv.offload.swapped_bytes > 0
    # the budget lifted: the plan is dropped again at the next boundary
    model.zero_grad(set_to_none=True)
    probe.limit = 10**12
    train(4)
    train(5)
    assert opt.decision.offload_plan == ("keep",) * len(plan) and not drv.offload.plan_active
    assert [p["actions"] is None or not any(a != "keep" for a in p["actions"]) for p in drv.plans] == \
        [True, False, True]


def test_torch_wrapper_offload_validation():
    from triaccel.backends.torch import wrap
    model, _, _ = _setup()
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.1), model, TriAccelConfig())
    assert opt.offload is None
    with pytest.raises(ValueError, match="units"):
        wrap(torch.optim.SGD(model.parameters(), lr=0.1), model, TriAccelConfig(offload="auto"),
             offload_options=dict(units=["nope"]))


# -- JAX ----------------------------------------------------------------------------------------

def test_jax_planned_sequential_applies_the_controllers_plan_and_the_wrapper_refuses_auto():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    from triaccel.backends.jax.offload import PlannedSequential, tag
    from triaccel.backends.jax.transform import TriAccel

    def block(p, x):
        return x + jnp.tanh(tag(jnp.tanh(tag(x) @ p["w1"])) @ p["w2"])

    keys = jax.random.split(jax.random.PRNGKey(0), 9)
    params = [{"w1": jax.random.normal(keys[2 * i], (32, 32)) / 32**0.5,
               "w2": jax.random.normal(keys[2 * i + 1], (32, 32)) / 32**0.5} for i in range(4)]
    x = jax.random.normal(keys[-1], (8, 32))
    seq = PlannedSequential([block] * 4)
    tables = tuple(seq.measure(params, x[:n], repeats=1, bandwidth=(1e9, 1e9)) for n in (4, 8))
    cfg = TriAccelConfig(offload="auto", elastic_batch=False, adaptive_precision=False, batch_init=8, batch_min=8,
                         warmup_steps=0, t_ctrl=1)
    keep = simulate(CostModel(tables).at(8), ["keep"] * 4).peak_bytes
    c = Controller(cfg, ["w"])
    c.observe_offload_costs(0, tables)
    c.observe_memory(0, 0, int(0.6 * keep / cfg.rho_high))
    d = c.decide(1)
    assert d.batch_size == 8 and any(a != "keep" for a in d.offload_plan)
    loss = lambda f: (lambda p, x: jnp.sum(f(p, x) ** 2))  # noqa: E731
    ref = jax.grad(loss(seq.apply()))(params, x)
    got = jax.grad(loss(seq.apply(d.offload_plan)))(params, x)
    for a, b in zip(jax.tree_util.tree_leaves(ref), jax.tree_util.tree_leaves(got)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="offload='auto' is not supported by the JAX wrapper"):
        TriAccel(TriAccelConfig(offload="auto"))


def test_budget_stands_for_memmax_where_memory_cannot_be_read():
    c = Controller(config(memory_budget=LIMIT), ["a", "b"])
    c.observe_offload_costs(0, fast_link())
    d = c.decide(10)  # no observe_memory (a CPU device): the budget is MemMax
    assert d.offload_plan is not None and d.batch_size > 64
    assert c.telemetry.records[-1]["offload"]["target"] == int(0.85 * LIMIT)


def test_demo_option():
    from examples.cifar import train
    opts = train.parse_args(["--offload", "auto", "--budget", "2GiB", "--device", "cpu"])
    assert opts.triaccel_config().offload == "auto" and opts.triaccel_config().memory_budget == 2 * 2**30
    assert train.parse_args(["--device", "cpu"]).triaccel_config().offload == "off"
    for bad in (["--backend", "jax"], ["--method", "amp"], ["--compile", "default"]):
        with pytest.raises(SystemExit):
            train.parse_args(["--offload", "auto", "--device", "cpu", *bad])


def test_torch_curvature_pass_runs_without_the_plan():
    from triaccel.backends.torch import wrap
    model, xs, ys = _setup()
    cfg = TriAccelConfig(offload="auto", curvature="fisher", t_curv=1, warmup_steps=0, top_k=2, b_curv=4,
                         elastic_batch=False, adaptive_precision=False, base_precision="fp32", batch_init=8,
                         batch_min=8, t_ctrl=1)
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.05), model, cfg, memory_probe=_Probe(10**12),
               curvature_data=(xs[0], ys[0]), offload_options=dict(min_bytes=0, bandwidth=(1e9, 1e9), repeats=1))
    n = len(opt.offload.offload.units)
    opt.offload.offload.apply(["recompute"] * n)
    opt.offload.applied = ("recompute",) * n  # as if decided: the curvature step must lift it
    with opt.autocast():
        loss = F.cross_entropy(model(xs[1]), ys[1])
    opt.backward(loss)
    opt.step()
    assert opt.last_eigvals is not None and np.isfinite(opt.last_eigvals).all()


# -- how often the wrapper measures (#17: the demo's epochs ran ~5 s longer under offload="auto") --

def test_no_plan_in_force_step_times_never_ask_for_tables():
    c = controller(fast_link())
    c.observe_memory(0, 500 * MB, 10**13)  # room for everything: no plan
    c.decide(10)
    assert c.decision.offload_plan == ("keep",) * 10
    for k, ms in enumerate((100.0, 300.0, 320.0, 90.0, 400.0, 410.0)):  # evaluations, clocks, data...
        c.observe_step_time(11 + k, ms)
    assert not c.wants_offload_costs(20)


def test_a_model_missing_by_the_whole_budget_is_remeasured_once_not_at_every_boundary():
    c = controller(fast_link())
    c.decide(10)
    p = c.offload_swap_plan
    assert p.active
    c.observe_memory(15, p.peak_bytes + 2000 * MB, LIMIT)  # 2 GB over a 1.5 GB target
    with pytest.warns(RuntimeWarning, match=f"modelled at {p.peak_bytes} bytes peaked at {p.peak_bytes + 2000 * MB}"):
        c.decide(20)
    assert c.wants_offload_costs(30) and c.offload_swap_plan.actions == ("recompute",) * 10
    c.observe_offload_costs(30, fast_link())  # the same tables again: the margin stays
    measured = 0
    for step in range(30, 100, 10):
        measured += c.wants_offload_costs(step)
        c.decide(step)
    assert measured == 0 and c.telemetry.records[-1]["offload"]["target"] <= 0


def test_torch_wrapper_measures_once_and_adds_nothing_per_step_without_a_plan():
    import time

    from triaccel.backends.torch import wrap
    model, xs, ys = _setup()
    cfg = TriAccelConfig(offload="auto", batch_law="memory", elastic_batch=False, adaptive_precision=False,
                         base_precision="fp32", batch_init=8, batch_min=8, warmup_steps=2, t_ctrl=2)
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model, cfg, memory_probe=_Probe(10**12),
               offload_options=dict(min_bytes=0, bandwidth=(1e9, 1e9), repeats=1))
    drv = opt.offload
    unit = drv.offload.modules[3]
    for i in range(24):
        with opt.autocast():
            loss = F.cross_entropy(model(xs[i % 6]), ys[i % 6])
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        if i % 5 == 4:
            time.sleep(0.05 * (1 + i % 3))  # an "evaluation": windows far off each other
        if i >= 3:  # after the first boundary's measurement: no plan, no unit hooks
            assert opt.decision.offload_plan == ("keep",) * len(drv.offload.units)
            assert not drv.offload.hooked and not unit._forward_pre_hooks and not unit._forward_hooks
    assert drv.measurements == [{"step": 2, "batches": [4, 8]}]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="allocator statistics need CUDA")
def test_memory_probe_leaves_excluded_work_out_of_the_window_peak():
    from triaccel.backends.torch.memory import MemoryProbe
    probe = MemoryProbe("cuda")
    probe.read()
    a = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")  # the window's own 64 MiB
    del a
    with probe.excluded():   # an evaluation's 512 MiB
        b = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
        del b
    used = probe.read().used_bytes
    assert 64 * 2**20 <= used < 512 * 2**20
