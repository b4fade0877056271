"""The swap planner's choices on synthetic cost tables, and TriAccelConfig.offload."""

import math

import pytest

from triaccel import TriAccelConfig
from triaccel.swap_plan import (ACTIONS, CostModel, CostTable, LayerCost, OffloadPlanner, choose_batch, plan_for_budget,
                                scale_plan, simulate, throughput_bound)

MB = 10**6


def table(n=10, saved=100 * MB, fwd=2.0, bwd=4.0, bw=100e9, batch=64, static=200 * MB, transient=50 * MB,
          other=1.0, inputs=10 * MB, **kw):
    layers = [LayerCost(f"u{i}", saved, fwd, bwd, input_bytes=inputs, **kw) for i in range(n)]
    return CostTable(batch, layers, bw, bw, static_bytes=static, transient_bytes=transient, other_ms=other)


def test_config_offload_validated():
    assert TriAccelConfig().offload == "off"
    assert TriAccelConfig(offload="auto").to_dict()["offload"] == "auto"
    with pytest.raises(ValueError, match="offload"):
        TriAccelConfig(offload="on")


@pytest.mark.parametrize("kwargs,name", [
    (dict(saved_bytes=-1), "saved_bytes"), (dict(forward_ms=math.nan), "forward_ms"),
    (dict(backward_ms=-1.0), "backward_ms"), (dict(transfer_bytes=1.5), "transfer_bytes"),
])
def test_layer_cost_validation_names_the_field(kwargs, name):
    base = dict(name="u", saved_bytes=1, forward_ms=1.0, backward_ms=1.0)
    with pytest.raises(ValueError, match=name):
        LayerCost(**{**base, **kwargs})


def test_table_and_plan_validation():
    with pytest.raises(ValueError, match="d2h_bytes_per_s"):
        CostTable(8, [LayerCost("u", 1, 1.0, 1.0)], 0.0, 1e9)
    with pytest.raises(ValueError, match="layers"):
        CostTable(8, [], 1e9, 1e9)
    t = table(n=3)
    with pytest.raises(ValueError, match="actions"):
        simulate(t, ["keep", "swap"])
    with pytest.raises(ValueError, match="prefetch_at"):
        simulate(t, ["swap", "keep", "keep"], prefetch_at=[None, None, None])
    with pytest.raises(ValueError, match="budget"):
        plan_for_budget(t, 0)


def test_keep_all_is_the_plain_step():
    t = table()
    p = simulate(t, ["keep"] * 10)
    assert p.step_ms == pytest.approx(10 * (2.0 + 4.0) + 1.0)
    assert p.exposed_ms == 0.0
    assert p.peak_bytes == 200 * MB + 10 * 100 * MB + 50 * MB
    assert not p.active


def test_fast_link_swaps_hidden_and_frees_memory():
    # 100 MB over 100 GB/s = 1 ms per copy, under the 2 ms forward: every early swap hides
    t = table(bw=100e9)
    p = plan_for_budget(t, 900 * MB)
    assert p.fits and p.peak_bytes <= 900 * MB
    assert set(p.actions) <= {"keep", "swap"} and p.count("swap") >= 4
    assert p.exposed_ms == pytest.approx(0.0)
    assert p.step_ms == pytest.approx(simulate(t, ["keep"] * 10).step_ms)
    # the last unit's copy could not end before its own backward: it is never worth swapping
    assert p.actions[-1] == "keep"
    # each prefetch is issued at a later unit's backward start (ahead of use), not on demand
    assert all(p.prefetch_at[i] > i for i, a in enumerate(p.actions) if a == "swap")


def test_slow_link_recomputes_instead():
    # 100 MB over 1 GB/s = 100 ms a copy against a 2 ms recompute: the model picks recompute
    t = table(bw=1e9)
    p = plan_for_budget(t, 900 * MB)
    recomputed = p.count("recompute") + p.count("recompute_swap")
    assert p.fits and p.count("swap") == 0 and recomputed >= 4
    # the 10 MB inputs of a recomputed unit do cross in time (10 ms, copied out when its forward
    # starts, back long before its recompute): swapping them costs nothing, so it is taken too
    assert p.exposed_ms == pytest.approx(2.0 * recomputed)


def test_most_memory_per_exposed_ms_first():
    # all copies hide; the budget needs 150 MB freed, which "mid" alone would do: the first (and
    # only) move is still the unit that frees the most per exposed millisecond, "big"
    layers = [LayerCost("big", 400 * MB, 5.0, 10.0), LayerCost("mid", 200 * MB, 5.0, 10.0),
              LayerCost("small", 50 * MB, 5.0, 10.0), LayerCost("t1", 100 * MB, 5.0, 10.0),
              LayerCost("t2", 100 * MB, 5.0, 10.0)]
    t = CostTable(32, layers, 400e9, 400e9)
    p = plan_for_budget(t, 850 * MB - 150 * MB)
    assert p.actions == ("swap", "keep", "keep", "keep", "keep")
    # a recompute (5 ms exposed) is not taken while a hidden transfer frees as much
    assert p.exposed_ms == 0.0
    # the new peak: big prefetched back while mid is still resident
    assert p.peak_bytes == 600 * MB


def test_swap_exposes_time_when_transfer_outlasts_compute():
    # u0 swapped: its device->host copy (10 ms) runs 2..12; the backward reaches u0 at 14. On demand
    # the copy back runs 14..24 (10 ms exposed); issued ahead (as early as possible: at the backward
    # start, 6) it can only start when the first copy ends, 12..22 (8 ms exposed)
    t = table(n=3, bw=10e9)
    on_demand = simulate(t, ["swap", "keep", "keep"], prefetch_at=[0, None, None])
    ahead = simulate(t, ["swap", "keep", "keep"])
    assert on_demand.exposed_ms == pytest.approx(10.0)
    assert ahead.prefetch_at == (2, None, None)
    assert ahead.exposed_ms == pytest.approx(8.0)


def test_infeasible_budget_reports_not_fitting():
    t = table()
    p = plan_for_budget(t, 100 * MB)  # below the static bytes: nothing can fit
    assert p.fits is False


def test_cost_model_scales_bytes_and_fits_affine_times():
    a = table(batch=32, saved=50 * MB, fwd=2.0, bwd=4.0, other=3.0)
    b = table(batch=64, saved=100 * MB, fwd=3.0, bwd=6.0, other=3.0)
    m = CostModel((a, b))
    t = m.at(128)
    assert t.layers[0].saved_bytes == 200 * MB and t.transient_bytes == 100 * MB
    assert t.layers[0].forward_ms == pytest.approx(5.0) and t.layers[0].backward_ms == pytest.approx(10.0)
    assert t.other_ms == pytest.approx(3.0)
    one = CostModel((b,)).at(128)
    assert one.layers[0].forward_ms == pytest.approx(6.0)
    with pytest.raises(ValueError, match="tables"):
        CostModel((a, a))
    with pytest.raises(ValueError, match="batch"):
        m.at(0)


def _model_with_overhead():
    # 10 ms of per-step overhead: larger batches are more efficient per sample
    a = table(batch=32, saved=50 * MB, fwd=1.5, bwd=3.0, other=10.0, bw=200e9, inputs=5 * MB)
    b = table(batch=64, saved=100 * MB, fwd=2.0, bwd=4.0, other=10.0, bw=200e9, inputs=10 * MB)
    return CostModel((a, b))


def test_choose_batch_takes_a_larger_planned_batch_when_faster():
    m = _model_with_overhead()
    cfg = TriAccelConfig(offload="auto", batch_init=64, batch_min=8, batch_max=512, lr_rule="linear")
    c = choose_batch(m, 1500 * MB, cfg)
    assert c.baseline is not None and not c.baseline.active
    assert c.batch > c.baseline.batch and c.plan.active and c.plan.fits
    assert c.goodput > c.baseline.samples_per_s
    assert c.lr_scale == pytest.approx(c.batch / 64)
    assert c.plan.peak_bytes <= 1500 * MB
    sq = choose_batch(m, 1500 * MB, cfg.replace(lr_rule="sqrt"))
    assert sq.lr_scale == pytest.approx(math.sqrt(sq.batch / 64))


def test_choose_batch_off_and_noise_scale_keep_the_plain_batch():
    m = _model_with_overhead()
    off = choose_batch(m, 1500 * MB, TriAccelConfig(offload="off", batch_max=512))
    assert not off.plan.active and off.batch == off.baseline.batch
    # a tiny noise scale: larger batches waste samples, the plain batch wins on goodput
    small = choose_batch(m, 1500 * MB, TriAccelConfig(offload="auto", batch_max=512), b_noise=8.0)
    assert not small.plan.active
    with pytest.raises(ValueError, match="budget"):
        choose_batch(m, 10 * MB, TriAccelConfig(offload="auto"))


def test_scale_plan_remodels_actions_on_new_timings():
    t = table(bw=100e9)
    p = plan_for_budget(t, 900 * MB)
    slower = table(bw=5e9)
    q = scale_plan(p, slower, budget=900 * MB)
    assert q.actions == p.actions and q.exposed_ms > p.exposed_ms


def test_offload_planner_replans_below_a_broken_budget():
    m = _model_with_overhead()
    cfg = TriAccelConfig(offload="auto", batch_init=64, batch_max=512)
    planner = OffloadPlanner(cfg, m, 1500 * MB)
    first = planner.decide()
    assert first.plan.peak_bytes <= 1500 * MB
    # the step measured 100 MB over the budget: the model under-estimated by err bytes, so the
    # next plans aim err bytes lower
    err = 1600 * MB - first.plan.peak_bytes
    assert planner.observe_peak(first.plan, 1600 * MB)
    assert planner.target == 1500 * MB - err
    second = planner.decide()
    assert second.plan.peak_bytes <= 1500 * MB - err and second.batch <= first.batch
    assert not planner.observe_peak(second.plan, 1400 * MB)  # within budget: nothing changes
    assert planner.target == 1500 * MB - err
    p = planner.plan(second.batch)
    assert planner.observe_step(p, p.step_ms * 1.1) is False
    assert planner.observe_step(p, p.step_ms * 2.0) is True and planner.timings_moved
    planner.observe_tables(m.tables)
    assert not planner.timings_moved
    with pytest.raises(ValueError, match="tolerance"):
        OffloadPlanner(cfg, m, 1500 * MB, tolerance=1.5)


def test_plan_fits_wherever_recomputing_every_unit_fits():
    # the greedy may swap first and find later that a swapped unit, prefetched back beside others,
    # holds the peak (it can turn that swap into a recompute, or fall back to recompute-only moves)
    import random
    rng = random.Random(0)
    checked = 0
    for _ in range(40):
        n = rng.randint(3, 12)
        layers = [LayerCost(f"u{i}", rng.randint(10, 400) * MB, rng.uniform(0.5, 5), rng.uniform(1, 10),
                            input_bytes=rng.randint(1, 80) * MB) for i in range(n)]
        t = CostTable(32, layers, rng.uniform(1e9, 100e9), rng.uniform(1e9, 100e9))
        everything = simulate(t, ["recompute"] * n)
        budget = everything.peak_bytes + rng.randint(0, 50) * MB
        if budget >= simulate(t, ["keep"] * n).peak_bytes:
            continue
        p = plan_for_budget(t, budget)
        assert p.fits, (layers, budget)
        checked += 1
    assert checked >= 20


def test_a_tensor_two_units_save_is_freed_only_when_neither_holds_it():
    # u1's input (100 MB) is u0's output, saved by both: 300 MB private to u0, 100 MB shared,
    # 200 MB private to u1; the last unit keeps everything resident at the backward start
    layers = [LayerCost("u0", 400 * MB, 5.0, 10.0, input_bytes=10 * MB),
              LayerCost("u1", 300 * MB, 5.0, 10.0, input_bytes=100 * MB, shared_bytes=100 * MB),
              LayerCost("u2", 50 * MB, 5.0, 10.0, input_bytes=10 * MB)]
    t = CostTable(32, layers, 400e9, 400e9)
    assert simulate(t, ["keep"] * 3).peak_bytes == 650 * MB  # the shared 100 MB counted once
    # swapping u0 frees only its private 300 MB: u1 still holds the shared input
    assert simulate(t, ["swap", "keep", "keep"]).backward_start_bytes == 350 * MB
    # swapping both frees the shared bytes too (until the prefetches bring them back)
    assert simulate(t, ["swap", "swap", "keep"]).backward_start_bytes == 50 * MB
    # recomputing u1 after a kept u0: its input is the shared tensor, not 100 MB more
    assert simulate(t, ["keep", "recompute", "keep"]).backward_start_bytes == 450 * MB
    with pytest.raises(ValueError, match="shared_bytes"):
        CostTable(32, [LayerCost("u0", 10, 1.0, 1.0, input_bytes=5, shared_bytes=5)], 1e9, 1e9)
    with pytest.raises(ValueError, match="shared_bytes"):
        CostTable(32, [layers[0], LayerCost("u1", 300 * MB, 5.0, 10.0, input_bytes=50 * MB,
                                            shared_bytes=100 * MB)], 1e9, 1e9)


def test_choose_batch_under_accumulation_keeps_micro_batches_within_the_logical_batch():
    m = _model_with_overhead()
    cfg = TriAccelConfig(offload="auto", batch_init=96, batch_max=512, lr_rule="accumulate")
    c = choose_batch(m, 1500 * MB, cfg)
    assert c.batch <= 96 and c.lr_scale == 1.0
    assert all(b <= 96 for b, _, _ in c.candidates)


def test_hopeless_budget_is_reported_at_once_and_no_plan_beats_the_bound():
    t = table()
    # one unit's saved bytes (100 MB) must be on the device during its own backward
    hopeless = 200 * MB + 50 * MB + 100 * MB - 1
    p = plan_for_budget(t, hopeless)
    assert p.fits is False and p.actions == ("recompute",) * 10


def test_transient_from_a_measured_peak_counts_shared_bytes_once():
    # the no-plan model of a table must give back the peak it was measured from (#17: the shared
    # input of u1 was subtracted twice and modelled peaks fell short by it)
    layers = [LayerCost("u0", 400 * MB, 5.0, 10.0, input_bytes=10 * MB),
              LayerCost("u1", 300 * MB, 5.0, 10.0, input_bytes=100 * MB, shared_bytes=100 * MB),
              LayerCost("u2", 50 * MB, 5.0, 10.0, input_bytes=10 * MB)]
    peak, static = 1000 * MB, 200 * MB
    tr = CostTable.transient_from_peak(peak, static, layers)
    t = CostTable(32, layers, 400e9, 400e9, static_bytes=static, transient_bytes=tr)
    assert t.resident_bytes == 650 * MB and tr == 150 * MB
    assert simulate(t, ["keep"] * 3).peak_bytes == peak


def test_offload_planner_refuses_to_plan_once_the_model_misses_the_whole_budget():
    # #17 (H100, ResNet-152): a measured peak ~29 GB over its plan's modelled peak took an 8 GiB
    # target below 0 and plan_for_budget failed on "budget=-21116792832"; the planner now says why
    m = _model_with_overhead()
    cfg = TriAccelConfig(offload="auto", batch_init=64, batch_max=512)
    planner = OffloadPlanner(cfg, m, 1500 * MB)
    p = planner.plan(128)
    assert not planner.observe_peak(p, 1500 * MB) and planner.last_breach is None
    measured = p.peak_bytes + 1600 * MB
    assert planner.observe_peak(p, measured) and planner.target < 0
    assert planner.last_breach == (128, measured, p.peak_bytes)
    msg = f"batch 128 under a plan modelled at {p.peak_bytes} bytes peaked at {measured} bytes"
    for call in (lambda: planner.plan(128), planner.decide):
        with pytest.raises(ValueError, match=msg):
            call()


def _deep_inputs_table(bw=50e9):
    # a ResNet-152-like stack: the inputs a recompute keeps (100 MB x 12) dominate once every unit
    # is recomputed; the forward (12 x 4 ms) has time to copy most of them out
    layers = [LayerCost(f"u{i}", 400 * MB, 4.0, 8.0, input_bytes=100 * MB) for i in range(12)]
    return CostTable(32, layers, bw, bw, static_bytes=200 * MB)


def test_recompute_swap_fits_where_kept_inputs_break_the_budget():
    t = _deep_inputs_table()
    everything = simulate(t, ["recompute"] * 12)
    budget = everything.peak_bytes - 600 * MB
    without = plan_for_budget(t, budget, actions=("keep", "swap", "recompute"))
    assert not without.fits and "recompute_swap" not in without.actions
    p = plan_for_budget(t, budget)
    # 600 MB more to free than recomputing every unit does: inputs of at least five units go to host
    assert p.fits and p.count("recompute_swap") >= 5
    # the inputs' copies (2 ms each way) hide behind the forward and the later units' backward: the
    # step costs at most what recomputing every unit costs
    assert p.step_ms <= everything.step_ms and p.exposed_ms <= everything.exposed_ms
    assert all(p.prefetch_at[i] is not None and p.prefetch_at[i] >= i
               for i, a in enumerate(p.actions) if a == "recompute_swap")


def test_recompute_swap_timeline_and_memory():
    # u0 recompute_swap: its 100 MB input is copied out from t=0 (its forward start) for 10 ms over
    # 10 GB/s; the device holds it until the copy ends, past u0's 4 ms forward
    t = CostTable(32, [LayerCost(f"u{i}", 400 * MB, 4.0, 8.0, input_bytes=100 * MB) for i in range(3)], 10e9, 10e9)
    rs = simulate(t, ["recompute_swap", "keep", "keep"], prefetch_at=[0, None, None])
    rc = simulate(t, ["recompute", "keep", "keep"])
    # on demand: the copy back (10 ms) starts at u0's backward start (12 + 16 = 28): 10 ms exposed
    # plus u0's 4 ms recompute
    assert rs.exposed_ms == pytest.approx(14.0) and rc.exposed_ms == pytest.approx(4.0)
    # at the end of the forward (t=12) u0's input is on the host: 100 MB fewer than recompute
    assert rc.backward_start_bytes - rs.backward_start_bytes == 100 * MB
    # prefetched at u1's backward start (t=20): back by t=30, 2 ms after u0's backward would start
    ahead = simulate(t, ["recompute_swap", "keep", "keep"], prefetch_at=[1, None, None])
    assert ahead.exposed_ms == pytest.approx(6.0)


def test_plan_actions_are_validated():
    t = table()
    for bad in (("keep", "swap"), ("keep", "recompute", "teleport"), "keep,recompute"):
        with pytest.raises(ValueError, match="actions="):
            plan_for_budget(t, 900 * MB, actions=bad)
    p = plan_for_budget(t, 900 * MB, actions=["keep", "recompute"])
    assert p.fits and set(p.actions) <= {"keep", "recompute"}


def test_largest_fitting_bisects_a_monotone_feasibility():
    from triaccel.swap_plan import largest_fitting

    grid = [8, 16, 32, 64, 128]
    asked = []
    assert largest_fitting(grid, lambda b: asked.append(b) or b <= 40) == 2 and len(asked) <= 3
    assert largest_fitting(grid, lambda b: True) == 4
    assert largest_fitting(grid, lambda b: False) is None and largest_fitting([], lambda b: True) is None


def test_throughput_bound_by_hand_and_validated():
    """10 units of 100 MB saved (10 MB inputs), 2 ms forward each: room 500 MB leaves 500 MB over;
    at 10 GB/s 200 MB leave during the 20 ms forward, the other 300 MB cost 300/90 units' recompute."""
    t = table(bw=10e9)                       # static 200 MB, transient 50 MB
    b = throughput_bound(t, 750 * MB)
    assert (b.over_bytes, b.copy_bytes, b.recompute_bytes) == (500 * MB, 200 * MB, 300 * MB)
    assert b.recompute_ms == pytest.approx(2.0 * 300 / 90)
    assert b.ratio == pytest.approx(61.0 / (61.0 + 2.0 * 300 / 90))
    assert throughput_bound(t, 2000 * MB).ratio == 1.0                    # fits as it is
    assert throughput_bound(table(bw=1e15), 750 * MB).ratio == 1.0        # an instant link hides it all
    assert throughput_bound(table(bw=1.0), 300 * MB).ratio == 0.0         # not even recomputing all fits
    assert throughput_bound(t, 750 * MB).to_dict()["batch"] == 64
    with pytest.raises(ValueError, match="budget"):
        throughput_bound(t, 0)


@pytest.mark.parametrize("seed", range(6))
def test_no_plan_beats_the_throughput_bound(seed):
    """The bound relaxes the model the planner plans in: on random tables and budgets, every plan that
    fits stays at or under it."""
    import random
    rng = random.Random(seed)
    for _ in range(8):
        layers = [LayerCost(f"u{i}", rng.randint(20, 200) * MB, rng.uniform(0.5, 4), rng.uniform(1, 8),
                            input_bytes=rng.randint(1, 15) * MB, recompute_ms=rng.choice([None, rng.uniform(0.2, 3)]))
                  for i in range(rng.randint(3, 12))]
        t = CostTable(64, layers, rng.uniform(1e9, 60e9), rng.uniform(1e9, 60e9), static_bytes=100 * MB,
                      transient_bytes=40 * MB, other_ms=1.0)
        budget = int(t.static_bytes + t.transient_bytes + t.resident_bytes * rng.uniform(0.15, 0.9))
        plan, bound = plan_for_budget(t, budget), throughput_bound(t, budget)
        plain = simulate(t, ["keep"] * len(layers))
        assert bound.step_ms == pytest.approx(plain.step_ms)
        if plan.fits:
            assert plan.samples_per_s <= plain.samples_per_s * bound.ratio * (1 + 1e-9)


@pytest.mark.parametrize("seed", range(4))
def test_planned_step_cannot_be_shortened_by_keeping_or_swapping_one_unit(seed):
    """After the greedy the planner takes back what it no longer needs: no unit of a fitting plan can be
    kept or swapped instead and leave a fitting, faster plan (the JAX action set too)."""
    import random
    rng = random.Random(100 + seed)
    for allowed in (ACTIONS, ("keep", "recompute")):
        layers = [LayerCost(f"u{i}", rng.randint(20, 200) * MB, rng.uniform(0.5, 4), rng.uniform(1, 8),
                            input_bytes=rng.randint(1, 15) * MB) for i in range(rng.randint(4, 14))]
        t = CostTable(64, layers, rng.uniform(2e9, 40e9), rng.uniform(2e9, 40e9), static_bytes=100 * MB,
                      transient_bytes=40 * MB, other_ms=1.0)
        budget = int(t.static_bytes + t.transient_bytes + t.resident_bytes * rng.uniform(0.3, 0.8))
        plan = plan_for_budget(t, budget, actions=allowed)
        if not plan.fits:
            continue
        assert set(plan.actions) <= set(allowed)
        for i, a in enumerate(plan.actions):
            for lighter in ("keep", "swap"):
                if lighter in allowed and a not in ("keep", lighter):
                    trial = simulate(t, plan.actions[:i] + (lighter,) + plan.actions[i + 1:], budget=budget)
                    assert not (trial.fits and trial.step_ms < plan.step_ms)
