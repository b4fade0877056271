"""Torch elastic loader + elastic_step: scripted memory, real torch.OutOfMemoryError, several epochs."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch

from paper import paper_config
from triaccel import Controller, OOMAtMinimumBatch, TriAccelConfig
from triaccel.backends.torch import data as tdata
from triaccel.backends.torch.data import ElasticLoader, elastic_step

N = 200
LIMIT = 1000


def make_cfg(**kw):
    base = dict(t_ctrl=1, batch_init=16, batch_min=8, batch_max=96, batch_multiple=8, delta_up=8,
                delta_down=8, rho_low=0.6, rho_high=0.85, curvature="off", adaptive_precision=False,
                oom_shrink=0.5, lr_rule="linear")
    return paper_config(**(base | kw))


def make_data(n=N, d=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    ids = torch.arange(n)
    return x, ids


class Harness:
    """A linear model whose loss_fn records sample ids, with a scripted memory probe and OOM injection."""

    def __init__(self, cfg, oom_calls=(), mem_per_sample=10, seed=0):
        torch.manual_seed(seed)
        self.model = torch.nn.Linear(5, 1)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.ctl = Controller(cfg, ["fc"])
        x, ids = make_data()
        self.loader = ElasticLoader(x, ids, batch_size=cfg.batch_init, seed=seed)
        self.calls, self.oom_calls = 0, set(oom_calls)
        self.seen: list[int] = []          # ids that contributed to a completed micro-batch
        self.mem_per_sample = mem_per_sample
        self.largest = 0

    def loss_fn(self, batch):
        x, ids = batch
        self.calls += 1
        if self.calls in self.oom_calls:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB (injected)")
        self.largest = max(self.largest, len(ids))
        self.pending = ids.tolist()
        return (self.model(x).squeeze(1) ** 2).mean()

    def probe(self):
        used, self.largest = self.largest * self.mem_per_sample, 0
        return used, LIMIT

    def step(self, step):
        before = len(self.seen)
        res = elastic_step(self.loader, self.ctl, self._recording_loss, self.opt, step, probe=self.probe)
        assert len(self.seen) - before == res.samples
        return res

    def _recording_loss(self, batch):
        loss = self.loss_fn(batch)
        self.seen.extend(self.pending)   # ids of micro-batches whose forward returned
        return loss


def test_each_sample_exactly_once_per_epoch_with_ooms_and_law():
    # memory always low (growth every control step up to the ceiling); OOMs at chosen calls, two
    # of them back to back (the replay itself fails). The law lowers its ceiling below each size
    # that failed, so the injections are spaced to keep the batch above batch_min.
    cfg = make_cfg(batch_init=64, batch_max=64, oom_shrink=0.75)
    h = Harness(cfg, oom_calls={2, 3, 9, 15, 22, 30}, mem_per_sample=1)
    per_epoch: dict[int, Counter] = {}
    sizes, ooms = [], 0
    step = 0
    while h.loader.epoch < 3 or not h.loader.end_of_epoch:
        start = len(h.seen)
        res = h.step(step)
        per_epoch.setdefault(res.epoch, Counter()).update(h.seen[start:])
        sizes.append((step, res.decision.batch_size, res.ooms, h.ctl.decision.batch_size))
        ooms += res.ooms
        step += 1
        if res.end_of_epoch and res.epoch == 3:
            break
    assert ooms == 6 and h.loader.stats["ooms"] == 6
    for e in range(4):
        c = per_epoch[e]
        assert sorted(c) == list(range(N)) and set(c.values()) == {1}, f"epoch {e}"
    for _, b, _, after in sizes:
        assert cfg.batch_min <= b <= cfg.batch_max and b % 8 == 0
        assert cfg.batch_min <= after <= cfg.batch_max
    # an OOM step ends with a smaller batch than it started with (immediate shrink)
    assert all(after < b for _, b, o, after in sizes if o)


def test_batch_follows_memory_law():
    # used = 10 bytes/sample of the largest micro-batch since the last read, limit 1000:
    # grows below 600, shrinks above 850, holds between (short end-of-epoch batches read low)
    cfg = make_cfg(batch_max=128)
    h = Harness(cfg)
    trace = []   # (memory observed after the step, batch of the step, batch of the next step)
    probe = h.probe

    def recording_probe():
        used, limit = probe()
        trace.append(used)
        return used, limit
    h.probe = recording_probe
    bs = [h.step(step).decision.batch_size for step in range(20)]
    h.mem_per_sample = 14                             # pressure: 64*14 = 896 > 850 -> shrink
    bs += [h.step(step).decision.batch_size for step in range(20, 30)]
    assert bs[:3] == [16, 24, 32]
    kinds = set()
    for used, b, nxt in zip(trace, bs, bs[1:]):
        if used < 0.6 * LIMIT:
            assert nxt == min(b + 8, cfg.batch_max)
            kinds.add("grow")
        elif used > 0.85 * LIMIT:
            assert nxt == max(b - 8, cfg.batch_min)
            kinds.add("shrink")
        else:
            assert nxt == b
            kinds.add("hold")
        assert cfg.batch_min <= nxt <= cfg.batch_max and nxt % 8 == 0
    assert kinds == {"grow", "shrink", "hold"}
    assert bs[-1] < max(bs)


def test_state_dict_resume_mid_epoch_exact_order():
    cfg = make_cfg()
    a = Harness(cfg, oom_calls={5})
    for step in range(4):
        a.step(step)
    sd = json.loads(json.dumps({"loader": a.loader.state_dict(), "ctl": a.ctl.state_dict(),
                                "largest": a.largest, "calls": a.calls}))
    assert 0 < sd["loader"]["sampler"]["cursor"] < N
    assert a.calls < 5
    cont = [a.step(step).micro_sizes for step in range(4, 20)]
    tail_a = a.seen[-sum(map(sum, cont)):]

    b = Harness(cfg, oom_calls={5})   # the same OOM schedule (call 5 comes after the save)
    b.calls = sd["calls"]
    b.loader.load_state_dict(sd["loader"])
    b.ctl.load_state_dict(sd["ctl"])
    b.largest = sd["largest"]
    cont_b = [b.step(step).micro_sizes for step in range(4, 20)]
    assert cont_b == cont and b.seen == tail_a


def _linear_grad(model, x):
    model.zero_grad()
    (model(x).squeeze(1) ** 2).mean().backward()
    return [p.grad.clone() for p in model.parameters()]


class _FailBackward(torch.autograd.Function):
    """Identity whose backward raises a real torch.OutOfMemoryError when armed."""
    armed = [False]

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if _FailBackward.armed[0]:
            _FailBackward.armed[0] = False
            raise torch.OutOfMemoryError("CUDA out of memory (injected in backward)")
        return g


@pytest.mark.parametrize("fail_in", ["forward", "backward"])
def test_accumulate_keeps_logical_batch_and_gradient(fail_in):
    # logical batch 24 at micro 12; an OOM in the 2nd micro-batch shrinks it to 4 (oom_shrink 0.5)
    cfg = make_cfg(lr_rule="accumulate", batch_init=24, batch_max=24, batch_min=4, batch_multiple=4,
                   delta_up=4, delta_down=4)
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 1)
    # one weight only feeds through the failing identity, so the partial-backward case is real
    x, ids = make_data()
    loader = ElasticLoader(x, ids, batch_size=24, seed=1, shuffle=True)
    ctl = Controller(cfg, ["fc"])
    ctl.observe_oom(0)   # micro 12, logical 24, accumulation 2 from the start
    d = ctl.decide(0)
    assert (d.batch_size, d.accumulation, d.logical_batch) == (12, 2, 24)
    ctl2_calls = [0]
    grads_at_step = {}

    def loss_fn(batch):
        xb, _ = batch
        ctl2_calls[0] += 1
        if fail_in == "forward" and ctl2_calls[0] == 2:
            raise torch.OutOfMemoryError("CUDA out of memory (injected in forward)")
        if fail_in == "backward" and ctl2_calls[0] == 2:
            _FailBackward.armed[0] = True
        out = model.bias + _FailBackward.apply(xb @ model.weight.t()).squeeze(1)
        return (out ** 2).mean()

    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def capture(decision):
        grads_at_step["g"] = [p.grad.clone() for p in model.parameters()]

    idx_expected = loader.sampler.permutation(0)[:24]
    res = elastic_step(loader, ctl, loss_fn, opt, 0, optimizer_step=capture)
    assert res.samples == 24 and res.micro_sizes == [12, 4, 4, 4] and res.ooms == 1
    ref = _linear_grad(model, x[torch.as_tensor(idx_expected)])
    for g, r in zip(grads_at_step["g"], ref):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
    assert ctl.decision.logical_batch == 24


def test_oom_at_minimum_raises_and_loses_nothing():
    cfg = make_cfg(batch_init=8)
    h = Harness(cfg, oom_calls={1})
    with pytest.raises(OOMAtMinimumBatch):
        h.step(0)
    # the step's samples were put back: the next step replays them first
    assert h.loader.sampler.in_flight == 0 and h.loader.sampler.remaining == N
    assert all(p.grad is None for p in h.model.parameters())


def test_other_errors_propagate_and_put_back():
    cfg = make_cfg()
    h = Harness(cfg)
    first = h.loader.sampler.permutation(0)[:16].tolist()

    def bad(batch):
        raise ValueError("user bug")
    with pytest.raises(ValueError, match="user bug"):
        elastic_step(h.loader, h.ctl, bad, h.opt, 0)
    res = h.step(0)
    assert h.seen == first and res.ooms == 0


def test_lr_batch_scale_applied_for_step_only():
    cfg = make_cfg(batch_init=16)
    h = Harness(cfg, oom_calls={1})
    seen_lr = []
    res = elastic_step(h.loader, h.ctl, h._recording_loss, h.opt, 0,
                       optimizer_step=lambda d: seen_lr.append(h.opt.param_groups[0]["lr"]))
    assert res.ooms == 1 and res.decision.lr_batch_scale == 1.0 and seen_lr == [0.1]
    h.ctl.observe_memory(1, 0, LIMIT)
    res = elastic_step(h.loader, h.ctl, h._recording_loss, h.opt, 1,
                       optimizer_step=lambda d: seen_lr.append(h.opt.param_groups[0]["lr"]))
    # after the OOM the batch is 8 (then grows to 16 on low memory): lr * B / batch_init
    assert seen_lr[1] == pytest.approx(0.1 * res.decision.batch_size / 16)
    assert h.opt.param_groups[0]["lr"] == 0.1


class IdDataset(torch.utils.data.Dataset):
    def __init__(self, n):
        self.x, self.ids = make_data(n)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return self.x[i], int(self.ids[i])


@pytest.mark.parametrize("workers", [0, 2])
def test_dataset_path_exactly_once(workers):
    cfg = make_cfg(batch_max=48)
    ds = IdDataset(90)
    loader = ElasticLoader.from_dataset(ds, batch_size=16, seed=3, num_workers=workers,
                                        transform=lambda x: x * 1.0)
    model = torch.nn.Linear(5, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ctl = Controller(cfg, ["fc"])
    seen, calls = [], [0]

    def loss_fn(batch):
        x, ids = batch
        calls[0] += 1
        if calls[0] in (2, 9):
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        seen.extend(ids.tolist())
        return (model(x) ** 2).mean()
    step = 0
    while True:
        res = elastic_step(loader, ctl, loss_fn, opt, step, probe=lambda: (0, LIMIT))
        step += 1
        if res.end_of_epoch and res.epoch == 1:
            break
    c = Counter(seen)
    assert sorted(c) == list(range(90)) and set(c.values()) == {2}
    assert loader.stats["ooms"] == 2


def test_plain_iteration_and_transform():
    x, ids = make_data(10)
    loader = ElasticLoader(x, ids, batch_size=4, seed=0, transform=lambda t: t * 2)
    got = list(loader)
    assert [len(b[1]) for b in got] == [4, 4, 2]
    assert sorted(torch.cat([b[1] for b in got]).tolist()) == list(range(10))
    torch.testing.assert_close(got[0][0], 2 * x[got[0][1]])
    assert loader.sampler.epoch_done


def test_index_transform_gets_each_batch_sample_indices():
    x, ids = make_data(10)
    loader = ElasticLoader(x, ids, batch_size=4, seed=0, index_transform=lambda t, i: t + i[:, None].to(t.dtype))
    for xb, yb in loader:   # ids are the samples' indices: the transform saw the same ones
        torch.testing.assert_close(xb, x[yb] + yb[:, None].to(x.dtype))
    idx = np.array([7, 2, 9])   # a replay's arbitrary indices (not a slice of the epoch order)
    xb, yb = loader.fetch(idx)
    assert yb.tolist() == [7, 2, 9]
    torch.testing.assert_close(xb, x[idx] + torch.tensor([[7.0], [2.0], [9.0]], dtype=x.dtype))
    with pytest.raises(ValueError, match="transform, index_transform"):
        ElasticLoader(x, ids, batch_size=4, transform=lambda t: t, index_transform=lambda t, i: t)


def test_bad_input():
    x, ids = make_data(20)
    with pytest.raises(ValueError, match="batch_size=0"):
        ElasticLoader(x, ids, batch_size=0)
    with pytest.raises(ValueError, match="targets"):
        ElasticLoader(x, ids[:5], batch_size=4)
    loader = ElasticLoader(x, ids, batch_size=8)
    with pytest.raises(ValueError, match="batch_size=-8"):
        loader.set_batch_size(-8)
    cfg = make_cfg(batch_min=32, batch_init=32)
    model = torch.nn.Linear(5, 1)
    with pytest.raises(ValueError, match="batch_min=32"):
        elastic_step(loader, Controller(cfg, ["fc"]), lambda b: model(b[0]).mean(),
                     torch.optim.SGD(model.parameters(), lr=0.1), 0)
    with pytest.raises(ValueError, match="num_workers"):
        ElasticLoader.from_dataset(IdDataset(4), batch_size=2, num_workers=-1)


def test_enforce_memory_budget(monkeypatch):
    calls = []

    class Props:
        total_memory = 80 * 2**30
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: Props())
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: calls.append(f))
    assert tdata.enforce_memory_budget("4GiB") == pytest.approx(4 / 80) and calls == [4 / 80]
    with pytest.raises(ValueError, match="memory_budget"):
        tdata.enforce_memory_budget("100GiB")


def test_is_oom_only_oom():
    assert tdata.is_oom(torch.OutOfMemoryError("x"))
    assert not tdata.is_oom(RuntimeError("CUDA out of memory"))


def test_gather_to_rows_in_order():
    # rows in the given order, repeats kept, dtype and trailing shape kept (CPU: plain index_select)
    import numpy as np

    src = torch.arange(5 * 2 * 3, dtype=torch.bfloat16).reshape(5, 2, 3)
    idx = np.array([4, 0, 4, 2])
    got = tdata.gather_to(src, idx, torch.device("cpu"))
    assert got.dtype == torch.bfloat16 and got.shape == (4, 2, 3)
    assert torch.equal(got, src[torch.as_tensor(idx)])
    assert torch.equal(tdata.indices_to(idx, torch.device("cpu")), torch.as_tensor(idx, dtype=torch.int64))


class _Pooled(torch.autograd.Function):
    """Identity whose backward hands its gradient over in one buffer per key, overwritten by the
    next backward: how a backward replayed as a CUDA graph (torch.compile mode="reduce-overhead")
    hands over gradients in its pool (autograd then keeps that very tensor as `.grad`)."""
    pools: dict = {}

    @staticmethod
    def forward(ctx, w, key):
        ctx.key = key
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):
        buf = _Pooled.pools.setdefault(ctx.key, torch.empty_like(g))
        buf.copy_(g)
        return buf.view_as(buf), None


class _PooledLinear(torch.nn.Linear):
    def forward(self, x):
        return torch.nn.functional.linear(x, _Pooled.apply(self.weight, "w"), _Pooled.apply(self.bias, "b"))


def _pooled_setup(cfg_kw, wrapped):
    from triaccel.backends.torch import wrap

    _Pooled.pools.clear()
    torch.manual_seed(0)
    model = _PooledLinear(5, 1)
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    cfg = make_cfg(**cfg_kw)
    if wrapped:
        opt = wrap(inner, model, TriAccelConfig(**cfg_kw))
        ctl = opt.controller
    else:
        opt, ctl = inner, Controller(cfg, ["fc"])
    x, ids = make_data()
    return model, opt, ctl, ElasticLoader(x, ids, batch_size=cfg_kw["batch_init"], seed=1), x


@pytest.mark.parametrize("case", ["plain-accumulate", "plain-oom-replay", "wrapped-noise-split",
                                  "wrapped-oom-replay"])
def test_split_steps_keep_gradients_that_backward_handed_over_in_a_pool(case):
    # a step of several micro-batches whose first backward hands over pooled gradients: the sum
    # over the step must still be the full batch's gradient (before the fix: the first micro-batch's
    # gradients were overwritten by the second's backward)
    wrapped = case.startswith("wrapped")
    if wrapped:
        kw = dict(batch_init=16, batch_min=8, batch_max=64, batch_buckets=(8, 16, 32, 64), t_ctrl=5, warmup_steps=0,
                  base_precision="fp32", curvature="off", adaptive_precision=False)
    elif case == "plain-accumulate":
        kw = dict(lr_rule="accumulate", batch_init=24, batch_max=24, batch_min=4, batch_multiple=4,
                  delta_up=4, delta_down=4)
    else:
        kw = dict(batch_init=24, batch_max=24, batch_min=12, batch_multiple=4, delta_up=4, delta_down=4)
    model, opt, ctl, loader, x = _pooled_setup(kw, wrapped)
    if case == "plain-accumulate":
        ctl.observe_oom(0)   # micro 12, logical 24: two micro-batches from the start
    calls, seen, checked = [0], [], []
    oom_at = {"plain-oom-replay": 1, "wrapped-oom-replay": 3}.get(case)   # wrapped: step 1's first forward

    def loss_fn(batch):
        xb, ids = batch
        calls[0] += 1
        if calls[0] == oom_at:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        seen.append(ids.clone())
        return (model(xb).squeeze(1) ** 2).mean()

    def capture(decision):
        got = [p.grad.clone() for p in model.parameters()]
        checked.append((list(seen), got, [p.detach().clone() for p in model.parameters()]))
        if wrapped:
            opt.step_accumulated()

    steps = 7 if wrapped else 1
    sizes = []
    for step in range(steps):
        seen.clear()
        ctl_step = opt.step_count if wrapped else step
        res = elastic_step(loader, ctl, loss_fn, opt, ctl_step, optimizer_step=capture,
                           apply_lr_batch_scale=False, **({"scaler": opt} if wrapped else {}))
        sizes.append(res.micro_sizes)
    split = [i for i, s in enumerate(sizes) if len(s) > 1]
    if case == "wrapped-noise-split":
        assert split == [0, 5]   # step 5 follows single-batch steps: their gradients were handed over
    elif case == "wrapped-oom-replay":
        assert 1 in split and sizes[1] == [8, 8]
    else:
        assert sizes == [[12, 12]]
    for i in split:
        ids, got, params = checked[i]
        w, b = (p.clone().requires_grad_() for p in params)
        xs = x[torch.cat(ids)]
        ref = torch.autograd.grad(((xs @ w.t() + b).squeeze(1) ** 2).mean(), [w, b])
        for g, r in zip(got, ref):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def test_fetch_from_the_epoch_order_equals_fetch_from_uploaded_indices():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(50, 3, generator=g), torch.arange(50)
    loader = ElasticLoader(x, y, batch_size=8, seed=2)
    orders = []
    for _ in range(2 * 7):   # two epochs of 6 x 8 + 2 samples; each epoch its own order
        idx = loader.next_indices()
        assert loader.sampler.order_span(idx) is not None
        for part in (idx, idx[1:5], idx.copy()):   # spans, and a copy (uploaded)
            xb, yb = loader.fetch(part)
            assert yb.tolist() == part.tolist() and torch.equal(xb, x[yb])
        loader.complete(idx)
        orders.append(loader._order[1])
    assert orders[0] is orders[6] and orders[7] is not orders[6]
    assert orders[7].tolist() == loader.sampler.order.tolist() != orders[0].tolist()
