"""Fuzz of the control law: `Controller(config, layers)` fed arbitrary observation sequences.

Hypothesis draws a config (every lever and law), a layer list (with norm layers) and a sequence of
calls to the controller's public methods with any values, NaN, +-inf, zeros, subnormals and huge
values included: observe_grad_variance, observe_grad_moments, observe_curvature, observe_memory,
observe_oom, decide, and (where this version of the controller has them) observe_nonfinite,
observe_loss_scale, observe_gradient_noise. Every call either

* raises ValueError at the observation, with a message that names the offending argument, or
* leaves a valid decision in force: precisions are `Precision` members, norm layers FP32,
  lr_scales finite in (0, 1], lr_batch_scale finite > 0, batch_size within [batch_min, batch_max],
  on batch_buckets when given (else a multiple of batch_multiple), accumulation >= 1, and the
  logical batch covered by batch_size * accumulation.

An OOM raises `triaccel.OOMAtMinimumBatch` exactly when the batch is already the smallest allowed,
and otherwise shrinks the batch at once. The same inputs give the same decisions: every sequence is
run twice on fresh controllers and the two traces of `Decision.to_dict()` / errors must be equal.

The main fuzz keeps clear of three input regions that exposed defects (fixed since: memory limits
that are NaN/inf, curvature eigenvalues spanning more than float range allows, batch_buckets
starting above batch_min); the tests at the end of the file draw exactly those inputs.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from rel_util import FIELDS, rel_settings

from triaccel import Controller, LayerSpec, OOMAtMinimumBatch, Precision, TriAccelConfig

nan, inf = float("nan"), float("inf")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")   # numpy overflow notes on huge inputs

# Argument names a ValueError of each call may name (the public name or the internal one it maps to).
NAMES = {
    "var": ("var",),
    "moments": ("var", "sums", "sumsqs", "counts"),
    "curv": ("eigvals", "curvature"),
    "mem": ("used_bytes", "limit_bytes", "device_total", "memory_budget"),
    "nonfinite": ("counts",),
    "loss_scale": ("scale",),
    "noise": ("sizes", "micro_sqnorms", "total_sqnorm", "sq_small", "sq_big", "b_small", "b_big"),
}

SPECIAL = [0.0, -0.0, nan, inf, -inf, 5e-324, 1e-300, 1e-30, 1e300, 1.7e308, -1.0, -1e300, 1.0]
any_float = st.one_of(st.sampled_from(SPECIAL), st.floats(0, 10), st.floats(-10, 10),
                      st.floats(allow_nan=True, allow_infinity=True))
clean_float = st.one_of(st.floats(0, 1e3), st.sampled_from([0.0, 1e-30, 1e-8, 1.0, 1e30]))
# Eigenvalues kept within a range where 1/(1 + alpha*lambda) cannot overflow (the extremes: a test below),
# plus the non-finite values the controller must refuse.
eig_float = st.one_of(st.sampled_from([0.0, -1.0, -1e6, nan, inf, -inf]), st.floats(1e-6, 1e6),
                      st.floats(-1e6, 1e6))
clean_eig = st.one_of(st.just(0.0), st.floats(1e-6, 1e6), st.floats(-1e3, 1e3))


def lists(clean: Any, nasty: Any, n: int) -> Any:
    """Length-n lists, mostly of clean values (so that observations are accepted and decisions
    move), else with any value (NaN, inf, huge...)."""
    c, x = st.lists(clean, min_size=n, max_size=n), st.lists(nasty, min_size=n, max_size=n)
    return st.one_of(c, c, x)


@st.composite
def configs(draw: Any, buckets_from_min: bool = True) -> TriAccelConfig:
    m = draw(st.sampled_from([1, 4, 8]))
    bmin = m * draw(st.integers(1, 4))
    bmax = bmin + m * draw(st.integers(0, 16))
    binit = draw(st.sampled_from(list(range(bmin, bmax + 1, m))))
    buckets = None
    if draw(st.booleans()):
        grid = list(range(bmin, bmax + 1, m))
        chosen = set(draw(st.lists(st.sampled_from(grid), max_size=6))) | {binit}
        if buckets_from_min:
            chosen.add(bmin)
        buckets = tuple(sorted(chosen))
    t_ctrl = draw(st.integers(1, 4))
    kw: dict[str, Any] = dict(
        t_ctrl=t_ctrl, t_precision=draw(st.one_of(st.none(), st.integers(1, 3).map(lambda k: k * t_ctrl))),
        warmup_steps=draw(st.integers(0, 6)), min_dwell=draw(st.integers(0, 5)),
        hysteresis=draw(st.sampled_from([0.0, 0.1, 0.5])), beta=draw(st.sampled_from([0.0, 0.5, 0.9, 0.999])),
        base_precision=draw(st.sampled_from(["fp16", "bf16", "fp32"])),
        curvature=draw(st.sampled_from(["off", "fisher", "hessian"])), top_k=draw(st.integers(1, 3)),
        t_curv=draw(st.integers(1, 5)), alpha=draw(st.one_of(st.none(), st.floats(1e-3, 1e3))),
        tau_curv=draw(st.one_of(st.none(), st.floats(0, 100))),
        promotion_window=draw(st.one_of(st.none(), st.integers(1, 5))),
        batch_multiple=m, batch_min=bmin, batch_max=bmax, batch_init=binit, batch_buckets=buckets,
        delta_up=m * draw(st.integers(1, 3)), delta_down=m * draw(st.integers(1, 3)),
        rho_low=draw(st.sampled_from([0.3, 0.6])), rho_high=draw(st.sampled_from([0.7, 0.85, 1.0])),
        memory_budget=draw(st.one_of(st.none(), st.integers(1, 10**12))),
        oom_shrink=draw(st.sampled_from([0.1, 0.5, 0.75, 0.9])),
        oom_cooldown=draw(st.one_of(st.none(), st.integers(1, 5))),
        batch_hold_steps=draw(st.integers(0, 5)), lr_rule=draw(st.sampled_from(["linear", "sqrt", "none", "accumulate"])),
        lr_ramp_steps=draw(st.integers(0, 5)),
        adaptive_precision=draw(st.booleans()), elastic_batch=draw(st.booleans()),
    )
    if draw(st.booleans()):
        lo = draw(st.sampled_from([0.0, 1e-12, 1e-3, 1.0, 1e300]))
        kw["tau_low"], kw["tau_high"] = lo, lo * draw(st.sampled_from([1.0, 10.0, 1e3]))
    if "precision_law" in FIELDS:
        kw["precision_law"] = draw(st.sampled_from(["evidence", "variance"]))
    if "batch_law" in FIELDS:
        kw["batch_law"] = draw(st.sampled_from(["noise", "memory"]))
        kw["noise_scale_c"] = draw(st.sampled_from([1e-3, 1.0, 1e3]))
        kw["noise_beta"] = draw(st.sampled_from([0.0, 0.8]))
        kw["t_noise"] = draw(st.one_of(st.none(), st.integers(1, 3)))
    kw = {k: v for k, v in kw.items() if k in FIELDS}
    return TriAccelConfig(**kw)


@st.composite
def layer_lists(draw: Any) -> list:
    n = draw(st.integers(1, 4))
    kinds = draw(st.lists(st.sampled_from(["other", "norm"]), min_size=n, max_size=n))
    return [LayerSpec(f"l{i}", kind=k) for i, k in enumerate(kinds)]


def ops_for(L: int, k: int) -> Any:
    vec = lists(clean_float, any_float, L)
    counts = lists(st.integers(0, 10**6).map(float), st.one_of(st.sampled_from([0.0, 1.0, -1.0, nan]),
                                                               st.integers(-5, 10**6).map(float)), L)
    adv = st.integers(0, 3)
    ops = [
        st.tuples(st.just("var"), adv, vec),
        st.tuples(st.just("moments"), adv, st.tuples(vec, vec, counts)),
        st.tuples(st.just("curv"), adv, st.lists(lists(clean_eig, eig_float, k), min_size=L, max_size=L)),
        # used: any value; limit: positive or non-positive ints (NaN/inf limits: a test below)
        st.tuples(st.just("mem"), adv, st.tuples(st.one_of(st.integers(0, 10**13), any_float),
                                                 st.one_of(st.integers(1, 10**13), st.integers(-5, 0)))),
        st.tuples(st.just("oom"), adv, st.none()),
        st.tuples(st.just("decide"), adv, st.none()),
        st.tuples(st.just("decide"), adv, st.none()),
        st.tuples(st.just("nonfinite"), adv, counts),
        st.tuples(st.just("loss_scale"), adv, any_float),
        st.tuples(st.just("noise"), adv, st.integers(1, 3).flatmap(lambda kk: st.tuples(
            lists(st.sampled_from([1, 2, 4, 8, 16]), st.sampled_from([0, 1, 2, -1, 10**9]), kk),
            st.lists(lists(clean_float, any_float, L), min_size=kk, max_size=kk), vec))),
    ]
    return st.lists(st.one_of(ops), min_size=30, max_size=60)


def smallest_batch(c: TriAccelConfig) -> int:
    return c.batch_buckets[0] if c.batch_buckets else c.batch_min


def check_decision(ctl: Controller, d: Any) -> None:
    c, L = ctl.config, len(ctl.layers)
    assert len(d.precisions) == L and all(isinstance(p, Precision) for p in d.precisions), d
    for s, p in zip(ctl.layers, d.precisions):
        if s.kind == "norm":
            assert p is Precision.FP32, f"norm layer {s.name} at {p}"
    if not c.adaptive_precision:
        base = Precision.parse(c.base_precision)
        assert all(p is base for s, p in zip(ctl.layers, d.precisions) if s.kind != "norm")
    sc = np.asarray(d.lr_scales, dtype=np.float64)
    assert sc.shape == (L,) and np.isfinite(sc).all() and (sc > 0).all() and (sc <= 1).all(), f"lr_scales {sc}"
    assert isinstance(d.lr_batch_scale, float | int) and math.isfinite(d.lr_batch_scale) and d.lr_batch_scale > 0
    assert c.batch_min <= d.batch_size <= c.batch_max, f"batch {d.batch_size}"
    if c.batch_buckets:
        assert d.batch_size in c.batch_buckets, f"batch {d.batch_size} not in {c.batch_buckets}"
    else:
        assert d.batch_size % c.batch_multiple == 0
    assert isinstance(d.accumulation, int) and d.accumulation >= 1
    assert d.batch_size * d.accumulation >= d.logical_batch >= 1
    assert set(d.changed) <= {"precision", "lr", "batch"}


def run(config: TriAccelConfig, layers: list, ops: list, *, strict_oom: bool = True) -> list:
    """Apply `ops` to a fresh controller, checking every outcome; returns the trace."""
    ctl = Controller(config, layers)
    check_decision(ctl, ctl.decision)
    trace: list = []
    step = 0
    for name, adv, arg in ops:
        step += adv
        before = ctl.decision.batch_size
        if name in NAMES and not hasattr(ctl, {"nonfinite": "observe_nonfinite", "loss_scale": "observe_loss_scale",
                                               "noise": "observe_gradient_noise"}.get(name, "decide")):
            continue   # a method this version of the controller does not have
        try:
            if name == "var":
                out = ctl.observe_grad_variance(step, arg)
            elif name == "moments":
                out = ctl.observe_grad_moments(step, *arg)
            elif name == "curv":
                out = ctl.observe_curvature(step, arg)
            elif name == "mem":
                out = ctl.observe_memory(step, *arg)
            elif name == "nonfinite":
                out = ctl.observe_nonfinite(step, arg)
            elif name == "loss_scale":
                out = ctl.observe_loss_scale(step, arg)
            elif name == "noise":
                out = ctl.observe_gradient_noise(step, *arg)
            elif name == "oom":
                out = ctl.observe_oom(step)
                if strict_oom:
                    assert out.batch_size < before, f"OOM at batch {before} did not shrink it ({out.batch_size})"
            else:
                out = ctl.decide(step)
        except OOMAtMinimumBatch as e:
            assert name == "oom", f"{name} raised OOMAtMinimumBatch"
            if strict_oom:
                assert before == smallest_batch(config), f"OOMAtMinimumBatch at batch {before}"
            trace.append((name, step, "OOMAtMinimumBatch", str(e)))
        except ValueError as e:
            assert name in NAMES, f"{name}({arg!r}) raised ValueError: {e}"
            assert any(n in str(e) for n in NAMES[name]), (
                f"{name}({arg!r}) raised a ValueError that names none of {NAMES[name]}: {e}")
            trace.append((name, step, "ValueError", str(e)))
        else:
            if out is not None:
                check_decision(ctl, out)
                trace.append((name, step, json.dumps(out.to_dict(), sort_keys=True)))
        check_decision(ctl, ctl.decision)
    trace.append(("final", json.dumps(ctl.decision.to_dict(), sort_keys=True),
                  json.dumps(ctl.report(), sort_keys=True, default=str)))
    return trace


@st.composite
def scenarios(draw: Any, buckets_from_min: bool = True) -> tuple:
    cfg = draw(configs(buckets_from_min))
    layers = draw(layer_lists())
    ops = draw(ops_for(len(layers), cfg.top_k))
    return cfg, layers, ops


def _count(figures: dict, key: str, trace: list) -> None:
    fig = figures.setdefault(key, {"examples": 0, "value_errors": 0, "oom_at_min": 0, "decisions": 0,
                                   "changed_batch": 0, "changed_precision": 0, "changed_lr": 0})
    fig["examples"] += 1
    fig["value_errors"] += sum(1 for t in trace if len(t) == 4 and t[2] == "ValueError")
    fig["oom_at_min"] += sum(1 for t in trace if len(t) == 4 and t[2] == "OOMAtMinimumBatch")
    decisions = [json.loads(t[2]) for t in trace if len(t) == 3 and t[0] != "final"]
    fig["decisions"] += len(decisions)
    for what in ("batch", "precision", "lr"):
        fig["changed_" + what] += sum(1 for d in decisions if what in d["changed"])


@rel_settings(max_examples=100)
@given(scn=scenarios())
def test_any_observation_sequence_gives_valid_deterministic_decisions(scn: tuple, figures: dict) -> None:
    cfg, layers, ops = scn
    first = run(cfg, layers, ops)
    second = run(cfg, layers, ops)
    assert first == second, "same inputs gave different decisions"
    _count(figures, "controller_fuzz", first)


@rel_settings(max_examples=60)
@given(cfg=configs(), layers=layer_lists(), n_ooms=st.integers(1, 40), grow=st.booleans())
def test_oom_shrinks_at_once_and_raises_only_at_the_minimum(cfg: TriAccelConfig, layers: list, n_ooms: int,
                                                            grow: bool) -> None:
    ctl = Controller(cfg, layers)
    step, raised = 0, 0
    for _ in range(n_ooms):
        before = ctl.decision.batch_size
        if before == smallest_batch(cfg):
            with pytest.raises(OOMAtMinimumBatch, match="batch_min"):
                ctl.observe_oom(step)
            raised += 1
        else:
            d = ctl.observe_oom(step)
            assert d.batch_size < before and "batch" in d.changed and d.step == step
        check_decision(ctl, ctl.decision)
        step += 1
        if grow:   # plenty of memory between OOMs: the batch may grow back (after any cooldown)
            for _ in range(cfg.t_ctrl):
                ctl.observe_memory(step, 1, 10**13)
                ctl.decide(step)
                step += 1
    if not grow and n_ooms > 17:
        assert raised > 0   # each OOM moves at least one of the <= 17 grid steps down


# -- defects this suite found, fixed since ------------------------------------------------------

@pytest.mark.parametrize("limit", [nan, inf, -inf])
def test_memory_limit_not_finite(limit: float) -> None:
    ctl = Controller(TriAccelConfig(t_ctrl=1), ["a"])
    with pytest.raises(ValueError) as ei:
        ctl.observe_memory(0, 100, limit)
    assert "limit_bytes" in str(ei.value)


def test_curvature_scales_stay_in_range() -> None:
    failures = []
    for tiny in (5e-324, 1e-320, 1e-310, 1e-300):
        for big in (0.0, 1.0, 1e10, 1e300):
            cfg = TriAccelConfig(curvature="fisher", top_k=1, t_curv=1, t_ctrl=1, warmup_steps=0)
            ctl = Controller(cfg, ["a", "b"])
            try:
                for step, eig in enumerate([[[tiny], [0.0]], [[big], [tiny]]]):
                    ctl.observe_curvature(step, eig)
                    check_decision(ctl, ctl.decide(step))
            except AssertionError as e:
                failures.append(f"lambda {tiny} then {big}: {e}")
    assert not failures, "\n".join(failures)


def test_oom_at_smallest_bucket_above_batch_min() -> None:
    cfg = TriAccelConfig(batch_min=8, batch_max=160, batch_buckets=(16, 160), batch_init=160)
    ctl = Controller(cfg, ["a"])
    ctl.observe_oom(0)                     # 160 -> 16, the smallest bucket
    before = ctl.decision.batch_size
    assert before == cfg.batch_buckets[0]
    try:
        d = ctl.observe_oom(1)
    except OOMAtMinimumBatch:
        return
    assert d.batch_size < before, f"OOM at the smallest bucket {before}: neither raised nor shrank"
