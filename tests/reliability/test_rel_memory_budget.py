"""Memory budget: with a faked memory reading, the decided batch keeps the modelled peak in budget.

The modelled peak of a step at batch B is `used(B) = fixed + per_sample * B` bytes. Both backends
feed the same core, so the core `Controller` is driven over long runs (hypothesis draws the model,
the budget and the batch knobs; both batch laws where the config has a choice): every step's
modelled peak stays at or below rho_high * memory_budget (so below the budget), and the batch
does not stall below what the law allows (it ends where growing one more step would cross
rho_high * budget, or at its upper bound). A step change of the per-sample cost mid-run (e.g.
larger inputs) is survived: over-budget steps become OOMs (the device holds only the budget),
the batch shrinks at once and stays in budget afterwards.

The torch wrapper is driven the same way through a fake `memory_probe` (the `MemoryProbe`
protocol: `read()` returning a `MemoryReading`), with a training loop that follows
`opt.decision.batch_size`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from rel_util import FIELDS, config, memory_law, rel_settings

from triaccel import Controller, OOMAtMinimumBatch

LAWS = ["memory", "noise"] if "batch_law" in FIELDS else ["memory"]


def next_up(c: Any, b: int, ceiling: int) -> int | None:
    """The batch one growth step above b (None at the top)."""
    if c.batch_buckets:
        up = [x for x in c.batch_buckets if x > b and x <= ceiling]
        return up[0] if up else None
    n = min(b + c.delta_up, ceiling)
    return n if n > b else None


def feed_noise(ctl: Controller, step: int) -> None:
    """A gradient-noise measurement with B_noise ~ 8e5 samples: the noise law always wants to grow."""
    L = len(ctl.layers)
    ctl.observe_gradient_noise(step, [8, 8], [[2.0] * L, [2.0] * L], [1.00001] * L)


def drive(ctl: Controller, steps: int, cost: Any, device: int, law: str) -> dict:
    """Run `steps` steps; cost(step, B) -> modelled peak bytes. Over `device` -> an OOM."""
    peaks, batches, ooms = [], [], 0
    for s in range(steps):
        d = ctl.decide(s)
        if law == "noise" and s % ctl.config.t_ctrl == 0:
            feed_noise(ctl, s)
        b = d.batch_size
        while cost(s, b) > device:        # the step does not fit: OOM, shrink at once, retry
            ooms += 1
            b = ctl.observe_oom(s).batch_size
        peaks.append(cost(s, b))
        batches.append(b)
        ctl.observe_memory(s, cost(s, b), device)
    return {"peaks": peaks, "batches": batches, "ooms": ooms}


@st.composite
def setups(draw: Any) -> tuple:
    m = draw(st.sampled_from([1, 8]))
    bmin = m * draw(st.integers(1, 4))
    bmax = bmin + m * draw(st.integers(4, 60))
    binit = bmin + m * draw(st.integers(0, 3))
    budget = draw(st.integers(10**6, 10**10))
    rho_low = draw(st.sampled_from([0.3, 0.6]))
    rho_high = draw(st.sampled_from([0.7, 0.85, 0.95]))
    # the model: fixed part below rho_low*budget, and batch_init fits under rho_high*budget
    fixed = int(budget * draw(st.floats(0.0, rho_low * 0.9)))
    room = rho_high * budget - fixed
    per_sample = max(1, int(room / binit * draw(st.floats(0.02, 0.99))))
    buckets = None
    if draw(st.booleans()):
        grid = list(range(bmin, bmax + 1, m))
        buckets = tuple(sorted(set(draw(st.lists(st.sampled_from(grid), min_size=1, max_size=8))) | {bmin, binit}))
    kw = dict(t_ctrl=draw(st.integers(1, 5)), batch_multiple=m, batch_min=bmin, batch_max=bmax, batch_init=binit,
              batch_buckets=buckets, delta_up=m * draw(st.integers(1, 4)), delta_down=m * draw(st.integers(1, 4)),
              rho_low=rho_low, rho_high=rho_high, memory_budget=budget, curvature="off", adaptive_precision=False,
              lr_rule=draw(st.sampled_from(["linear", "sqrt", "none"])), oom_cooldown=draw(st.sampled_from([None, 20])),
              batch_law=draw(st.sampled_from(LAWS)))
    return config(**kw), fixed, per_sample


@rel_settings(max_examples=120)
@given(setup=setups(), device_factor=st.sampled_from([1.0, 1.5, 4.0]))
def test_batch_keeps_modelled_peak_within_budget(setup: tuple, device_factor: float, figures: dict) -> None:
    c, fixed, per_sample = setup
    law = getattr(c, "batch_law", "memory")
    budget = c.memory_budget
    device = int(budget * device_factor)          # MemMax = min(device, budget) = budget
    ctl = Controller(c, ["a", "b"])
    steps = 400
    r = drive(ctl, steps, lambda s, b: fixed + per_sample * b, device, law)
    peaks = np.array(r["peaks"])
    assert r["ooms"] == 0
    assert (peaks <= c.rho_high * budget).all(), f"peak {peaks.max()} > rho_high*budget {c.rho_high * budget}"
    # not stalled: at the end, one more growth step would cross rho_high*budget (the law's guard),
    # or memory reads at least rho_low*budget (memory law), or the batch is at its upper bound
    b = r["batches"][-1]
    up = next_up(c, b, c.batch_max)
    used = fixed + per_sample * b
    assert (up is None or used * up / b > c.rho_high * budget
            or (law == "memory" and used >= c.rho_low * budget)), (b, up, used, budget)
    fig = figures.setdefault("memory_budget_core", {"runs": 0, "steps": 0, "max_peak_over_budget": 0.0,
                                                    "grew_runs": 0, "ooms": 0})
    fig["runs"] += 1
    fig["steps"] += steps
    fig["max_peak_over_budget"] = round(max(fig["max_peak_over_budget"], float(peaks.max() / budget)), 4)
    fig["grew_runs"] += int(max(r["batches"]) > c.batch_init)


@pytest.mark.parametrize("law", LAWS)
def test_per_sample_cost_doubling_mid_run(law: str, figures: dict) -> None:
    budget = 10**8
    c = config(t_ctrl=2, batch_min=8, batch_max=512, batch_init=32, batch_multiple=8, delta_up=16, delta_down=16,
               memory_budget=budget, curvature="off", adaptive_precision=False, oom_cooldown=50, batch_law=law)
    ctl = Controller(c, ["a", "b"])
    fixed, ps = 10**7, 150_000

    def cost(s: int, b: int) -> int:
        return fixed + (ps if s < 300 else 2 * ps) * b

    r = drive(ctl, 600, cost, budget, law)       # the device holds exactly the budget
    peaks, batches = np.array(r["peaks"]), r["batches"]
    before, after = batches[299], batches[-1]
    assert (peaks <= budget).all()                                  # over-budget steps were OOMs, retried smaller
    assert (peaks[320:] <= c.rho_high * budget).all()               # back under the shrink threshold
    assert after < before and fixed + 2 * ps * after <= c.rho_high * budget
    assert 1 <= r["ooms"] <= 3
    figures.setdefault("memory_budget_step_change", {})[law] = {
        "steps": 600, "batch_before": before, "batch_after": after, "ooms": r["ooms"],
        "max_peak_over_budget": round(float(peaks.max() / budget), 4)}


def test_oom_at_batch_min_when_even_the_smallest_batch_does_not_fit() -> None:
    c = config(t_ctrl=1, batch_min=8, batch_max=64, batch_init=16, batch_multiple=8, memory_budget=10**6,
               curvature="off", adaptive_precision=False, **memory_law())
    ctl = Controller(c, ["a"])
    with pytest.raises(OOMAtMinimumBatch, match="batch_min"):
        drive(ctl, 5, lambda s, b: 10**6 + 1, 10**6, "memory")


# -- the torch wrapper with a fake memory probe --------------------------------------------------
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_torch_wrapper_with_fake_memory_probe(figures: dict, monkeypatch: Any) -> None:
    torch = pytest.importorskip("torch")
    from torch.nn import functional as F

    from triaccel.backends.torch import MemoryReading, wrap
    from triaccel.kernels import _dispatch
    monkeypatch.setattr(_dispatch, "interpreter_enabled", lambda: False)   # statistics: torch reference
    budget, limit = 4 * 10**6, 8 * 10**6
    fixed, per_sample = 10**6, 30_000                 # 100 samples fit under 0.85 * budget
    c = config(t_ctrl=2, batch_min=8, batch_max=256, batch_init=16, batch_multiple=8, delta_up=8, delta_down=8,
               memory_budget=budget, curvature="off", adaptive_precision=False, base_precision="fp32",
               **memory_law())
    seen: list[int] = []            # batch sizes since the last read

    class FakeProbe:
        reads = 0

        def read(self) -> Any:
            FakeProbe.reads += 1
            used = fixed + per_sample * max(seen or [0])
            seen.clear()
            return MemoryReading(used_bytes=used, limit_bytes=limit, total_bytes=limit, free_bytes=limit - used,
                                 reserved_bytes=used, others_bytes=0)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.05), model, c, memory_probe=FakeProbe())
    x, y = torch.randn(512, 4), torch.randint(0, 3, (512,))
    peaks, batches = [], []
    for s in range(80):
        b = opt.decision.batch_size
        seen.append(b)
        batches.append(b)
        peaks.append(fixed + per_sample * b)
        with opt.autocast():
            loss = F.cross_entropy(model(x[:b]), y[:b])
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
    assert FakeProbe.reads >= 39                     # read at every control boundary
    assert max(peaks) <= c.rho_high * budget
    assert max(batches) > c.batch_init               # it grew ...
    last = batches[-1]
    assert fixed + per_sample * last >= c.rho_low * budget or \
        (fixed + per_sample * last) * (last + 8) / last > c.rho_high * budget   # ... as far as the law allows
    assert opt.report()["mem_limit"] == budget
    figures["memory_budget_torch_wrapper"] = {
        "steps": 80, "batch_init": c.batch_init, "batch_final": last, "max_peak_over_budget": max(peaks) / budget,
        "probe_reads": FakeProbe.reads}
