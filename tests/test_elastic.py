"""Framework-free elastic batching: the epoch sampler and the OOM-retry step driver."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from triaccel.elastic import (
    ElasticIndexLoader,
    ElasticSampler,
    OOMAtMinimumBatch,
    run_elastic_step,
    split_indices,
    validate_batch_bounds,
)


class FakeOOM(RuntimeError):
    pass


def drain(sampler: ElasticSampler, sizes):
    """Take/complete batches of the given sizes (cycled) until the epoch is done."""
    seen, i = [], 0
    while not sampler.epoch_done:
        idx = sampler.take(sizes[i % len(sizes)])
        sampler.complete(idx)
        seen.extend(idx.tolist())
        i += 1
    return seen


def test_permutation_seeded_and_per_epoch():
    a, b = ElasticSampler(50, seed=3), ElasticSampler(50, seed=3)
    assert np.array_equal(a.permutation(0), b.permutation(0))
    assert not np.array_equal(a.permutation(0), a.permutation(1))
    assert not np.array_equal(a.permutation(0), ElasticSampler(50, seed=4).permutation(0))
    assert sorted(a.permutation(2).tolist()) == list(range(50))
    assert ElasticSampler(7, shuffle=False).take(7).tolist() == list(range(7))


def test_last_batch_short_nothing_dropped():
    s = ElasticSampler(10, seed=0)
    got = [s.take(4) for _ in range(3)]
    assert [len(g) for g in got] == [4, 4, 2]
    assert len(s.take(4)) == 0
    for g in got:
        s.complete(g)
    assert s.epoch_done
    assert sorted(np.concatenate(got).tolist()) == list(range(10))


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 60), seed=st.integers(0, 2**31),
       sizes=st.lists(st.integers(1, 17), min_size=1, max_size=6))
def test_every_index_exactly_once_per_epoch_any_batch_sizes(n, seed, sizes):
    s = ElasticSampler(n, seed=seed)
    for epoch in range(3):
        seen = drain(s, sizes)
        assert sorted(seen) == list(range(n))
        assert seen == s.permutation(epoch).tolist()  # sizes do not change the order
        s.next_epoch()


def test_put_back_replays_first_in_order():
    s = ElasticSampler(20, seed=1)
    perm = s.permutation(0).tolist()
    a = s.take(6)
    s.put_back(a[2:])
    assert s.take(3).tolist() == perm[2:5]
    assert s.take(3).tolist() == [perm[5]] + perm[6:8]


def test_put_back_and_complete_only_in_flight():
    s = ElasticSampler(10, seed=0)
    a = s.take(4)
    s.complete(a[:2])
    with pytest.raises(ValueError, match="in flight"):
        s.complete(a[:1])  # already completed: would count twice
    with pytest.raises(ValueError, match="in flight"):
        s.put_back([int(s.permutation(0)[9])])  # never taken
    with pytest.raises(ValueError, match="not finished"):
        s.next_epoch()


@pytest.mark.parametrize("bad", [[-1], [10], [3.0e9], "repeat", "mixed"])
def test_a_refused_retirement_changes_nothing(bad):
    s = ElasticSampler(10, seed=0)
    a = s.take(4)
    if bad == "repeat":
        bad = [int(a[0]), int(a[1]), int(a[0])]
    elif bad == "mixed":   # in flight, then one that is not
        bad = [int(a[0]), int(s.permutation(0)[9])]
    with pytest.raises(ValueError, match="in flight|repeated"):
        s.complete(bad)
    with pytest.raises(ValueError, match="in flight|repeated"):
        s.put_back(bad)
    assert s.in_flight == 4 and s.completed == 0 and s.remaining == 6
    s.complete(a)   # the whole take still retires once
    assert s.in_flight == 0 and s.completed == 4
    assert s.state_dict()["pending"] == []


@pytest.mark.parametrize("cut", [0, 3, 7])
def test_state_dict_resumes_exact_order_mid_epoch(cut):
    ref = ElasticSampler(40, seed=9)
    order_ref = drain(ref, [5, 3]) + (ref.next_epoch() or drain(ref, [5, 3]))
    s = ElasticSampler(40, seed=9)
    order = []
    for k in range(cut):
        idx = s.take([5, 3][k % 2])
        s.complete(idx)
        order += idx.tolist()
    # a put-back mid-epoch and an in-flight chunk survive the round trip through JSON
    held = s.take(4)
    s.put_back(held[2:])
    sd = json.loads(json.dumps(s.state_dict()))
    r = ElasticSampler(40, seed=9)
    r.load_state_dict(sd)
    assert r.epoch == 0 and r.remaining == s.remaining + 2
    rest = []
    while not r.epoch_done:
        idx = r.take(6)
        r.complete(idx)
        rest += idx.tolist()
    assert sorted(order + rest) == list(range(40))
    # continuation: in-flight (sorted), then the put-back ones, then the permutation
    assert rest[:4] == sorted(held[:2].tolist()) + held[2:].tolist()
    r.next_epoch()
    assert drain(r, [5, 3]) == order_ref[40:]


def test_state_dict_mismatch_rejected():
    sd = ElasticSampler(10, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed"):
        ElasticSampler(10, seed=2).load_state_dict(sd)
    with pytest.raises(ValueError, match="num_samples"):
        ElasticSampler(11, seed=1).load_state_dict(sd)


@pytest.mark.parametrize("kw", [dict(num_samples=0), dict(num_samples=-3), dict(seed=-1),
                                dict(seed=1.5)])
def test_sampler_bad_input(kw):
    args = dict(num_samples=10, seed=0) | kw
    name = next(iter(kw))
    with pytest.raises(ValueError, match=name):
        ElasticSampler(**args)


def test_take_bad_n():
    with pytest.raises(ValueError, match="n=0"):
        ElasticSampler(5).take(0)


def test_validate_batch_bounds():
    validate_batch_bounds(100, 8, 64)
    with pytest.raises(ValueError, match="batch_min=128"):
        validate_batch_bounds(100, 128)
    with pytest.raises(ValueError, match="batch_min=0"):
        validate_batch_bounds(100, 0)
    with pytest.raises(ValueError, match="batch_max=4"):
        validate_batch_bounds(100, 8, 4)


def test_split_indices():
    parts = split_indices(np.arange(10), 4)
    assert [p.tolist() for p in parts] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


# ---- driver ------------------------------------------------------------------------------------

class Script:
    """A micro-step that raises FakeOOM when asked to run more than `cap` samples, or on chosen calls."""

    def __init__(self, cap=10**9, fail_calls=()):
        self.cap, self.fail_calls, self.calls, self.done, self.weights = cap, set(fail_calls), 0, [], []

    def __call__(self, chunk, w):
        self.calls += 1
        if self.calls in self.fail_calls or len(chunk) > self.cap:
            raise FakeOOM("CUDA out of memory (scripted)")
        self.done.extend(chunk.tolist())
        self.weights.append(w)
        return float(len(chunk))


def shrinker(sizes):
    it = iter(sizes)
    return lambda: next(it)


def test_driver_splits_and_weights():
    s = Script()
    rep = run_elastic_step(np.arange(10), micro_batch=4, run_micro=s,
                           is_oom=lambda e: isinstance(e, FakeOOM), on_oom=shrinker([]))
    assert rep.sizes == [4, 4, 2] and s.done == list(range(10))
    assert rep.weights == [0.4, 0.4, 0.2] and rep.ooms == 0
    assert rep.mean_loss() == pytest.approx(0.4 * 4 + 0.4 * 4 + 0.2 * 2)


def test_driver_oom_replays_failed_chunk_keeps_done():
    s = Script(fail_calls={2})
    freed = []
    rep = run_elastic_step(np.arange(12), micro_batch=4, run_micro=s,
                           is_oom=lambda e: isinstance(e, FakeOOM), on_oom=shrinker([3]),
                           free_memory=lambda: freed.append(1))
    assert s.done == list(range(12))          # order kept, each once
    assert rep.sizes == [4, 3, 3, 2] and rep.ooms == 1 and rep.replayed == 4
    assert sum(rep.weights) == pytest.approx(1.0) and freed == [1]
    assert rep.micro_batch == 3


def test_driver_repeated_ooms_shrink_until_fit():
    s = Script(cap=5)
    rep = run_elastic_step(np.arange(30), micro_batch=16, run_micro=s,
                           is_oom=lambda e: isinstance(e, FakeOOM), on_oom=shrinker([8, 4]))
    assert s.done == list(range(30)) and rep.ooms == 2
    assert max(rep.sizes) == 4 and sum(rep.sizes) == 30


def test_driver_other_errors_propagate():
    def boom(chunk, w):
        raise KeyError("not an oom")
    with pytest.raises(KeyError):
        run_elastic_step(np.arange(4), micro_batch=2, run_micro=boom,
                         is_oom=lambda e: isinstance(e, FakeOOM), on_oom=shrinker([1]))


def test_driver_frees_memory_outside_except_block():
    import sys
    state = {}

    def free():
        state["exc"] = sys.exc_info()[1]
    run_elastic_step(np.arange(4), micro_batch=4, run_micro=Script(fail_calls={1}),
                     is_oom=lambda e: isinstance(e, FakeOOM), on_oom=shrinker([2]), free_memory=free)
    assert state["exc"] is None


def test_driver_at_minimum_raises_clear_error():
    with pytest.raises(OOMAtMinimumBatch, match="cannot shrink"):
        run_elastic_step(np.arange(8), micro_batch=4, run_micro=Script(cap=1),
                         is_oom=lambda e: isinstance(e, FakeOOM), on_oom=shrinker([2, 2]))


def test_driver_bad_input():
    with pytest.raises(ValueError, match="micro_batch=0"):
        run_elastic_step(np.arange(4), micro_batch=0, run_micro=Script(),
                         is_oom=lambda e: False, on_oom=shrinker([]))
    with pytest.raises(ValueError, match="indices"):
        run_elastic_step([], micro_batch=2, run_micro=Script(), is_oom=lambda e: False,
                         on_oom=shrinker([]))


def test_left_for_next_counts_the_epoch_the_next_step_draws_from():
    loader = ElasticIndexLoader(10, batch_size=4, seed=0)
    assert loader.left_for_next == 10                     # nothing taken yet
    a = loader.next_indices()
    assert loader.left_for_next == 6                      # in flight: not left
    loader.put_back(a)
    assert loader.left_for_next == 10                     # put back: left again
    for _ in range(3):
        loader.complete(loader.next_indices())
    assert loader.sampler.epoch_done and loader.left_for_next == 10   # the next epoch, whole


def test_order_span_recognises_views_of_the_epoch_order_only():
    s = ElasticSampler(20, seed=3)
    a = s.take(6)
    assert s.order_span(a) == (0, 6) and s.order_span(a[2:5]) == (2, 5)
    s.complete(a[:1])
    with pytest.raises(ValueError, match="in flight"):   # a span with a retired index: refused whole
        s.complete(a[:3])
    assert s.in_flight == 5 and s.completed == 1
    s.put_back(a[1:3])   # put back, then taken again as a new array (below)
    assert s.take(2).tolist() == a[1:3].tolist()
    assert s.order_span(a.copy()) is None and s.order_span(a[::2]) is None and s.order_span([1, 2]) is None
    assert not a.flags.writeable   # a view of the order: callers cannot change the epoch's order
    s.put_back(a[3:])
    b = s.take(5)   # put-back indices first: a new array, not a view
    assert b.tolist() == s.order[3:8].tolist() and s.order_span(b) is None
    c = s.take(4)
    assert s.order_span(c) == (8, 12)
    s.complete(b)
    s.complete(c)
    s.complete(a[1:3])
    while not s.epoch_done:
        s.complete(s.take(8))
    old = s.order
    s.next_epoch()
    assert s.order is not old and s.order_span(a) is None   # last epoch's views do not match


class _IndexLoader(ElasticIndexLoader):
    def fetch(self, indices):
        return indices


@pytest.mark.parametrize("split,expected", [(2, [16, 16]), (1, [32])])
def test_controlled_step_takes_two_batches_for_a_doubled_noise_step(split, expected):
    """noise_split="double": a noise step takes 2B indices, as two micro-batches of B (split 2, the
    torch step), or as one of 2B that the backend halves inside its own program (split 1); its
    samples weigh as one step of 2B (`step_weight(take=2)`); plain steps take B."""
    from triaccel import Controller, TriAccelConfig
    from triaccel.elastic import controlled_step, noise_split, noise_take, step_weight

    cfg = TriAccelConfig(batch_init=16, batch_min=8, batch_max=64, t_ctrl=5, warmup_steps=0,
                         noise_split="double", short_step_lr="linear", memory_budget=None)
    ctl = Controller(cfg, ["a", "b"])
    loader = _IndexLoader(40, batch_size=16)
    assert noise_split(ctl, 0) == 2 and noise_take(ctl, 2) == 2 and noise_take(ctl, 1) == 1
    runs = []

    def finish(decision, report):
        return report, step_weight(ctl, report.num_samples, decision, 2)

    report, w = controlled_step(loader, ctl, 0, run_micro=lambda c, w: runs.append(len(c)) or 0.0, finish=finish,
                                is_oom=lambda e: False, free_memory=lambda: None, split=split, take=2)
    assert runs == expected and report.num_samples == 32 and w == 1.0
    # the epoch's last 8 samples under take=2: a short step of a 32-sample logical batch
    report, w = controlled_step(loader, ctl, 1, run_micro=lambda c, w: 0.0, finish=finish,
                                is_oom=lambda e: False, free_memory=lambda: None, split=split, take=2)
    assert report.num_samples == 8 and w == 8 / 32 and loader.end_of_epoch
    with pytest.raises(ValueError, match="take=0: allowed 1"):
        controlled_step(loader, ctl, 2, run_micro=lambda c, w: 0.0, finish=finish,
                        is_oom=lambda e: False, free_memory=lambda: None, take=0)
    assert loader.sampler.in_flight == 0   # the refused step took nothing
    assert TriAccelConfig().noise_split == "halves"
    with pytest.raises(ValueError, match="noise_split='thirds' is invalid: allowed one of 'halves', 'double', 'steps'"):
        TriAccelConfig(noise_split="thirds")


def test_controlled_step_runs_a_noise_step_as_half_a_batch_under_steps():
    """noise_split="steps": a noise step takes half the decided batch (rounded up) as one micro-batch
    of a step of its own (short-step weight 1/2), the next step the whole batch; each step reports what
    it ran, and every sample is still taken once per epoch."""
    from triaccel import Controller, TriAccelConfig
    from triaccel.elastic import controlled_step, noise_samples, noise_split, step_weight

    cfg = TriAccelConfig(batch_init=15, batch_min=1, batch_max=60, batch_multiple=1, t_ctrl=3, warmup_steps=0,
                         noise_split="steps", short_step_lr="linear", memory_budget=None)
    ctl = Controller(cfg, ["a", "b"])
    loader = _IndexLoader(45, batch_size=15)
    assert ctl.is_noise_step(0) and noise_split(ctl, 0) == 1 and noise_samples(ctl, 0) == 8
    assert noise_samples(ctl, 1) is None
    seen, runs, weights = [], [], []

    def finish(decision, report):
        weights.append(step_weight(ctl, report.num_samples, decision))
        return report

    step = 0
    while not (loader.end_of_epoch and step):
        controlled_step(loader, ctl, step, run_micro=lambda c, w: seen.extend(c) or runs.append(len(c)) or 0.0,
                        finish=finish, is_oom=lambda e: False, free_memory=lambda: None)
        step += 1
    assert runs == [8, 15, 15, 7] and weights == [8 / 15, 1.0, 1.0, 7 / 15]   # step 3: a noise step again
    assert sorted(seen) == list(range(45))
    assert ctl._pairs._ran == {0: (8, 15, True), 1: (15, 15, False), 2: (15, 15, False), 3: (7, 15, True)}
