"""JAX elastic loader + elastic_step: buckets and masks, real JaxRuntimeError OOMs, several epochs."""

from __future__ import annotations

import json
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from triaccel import Controller, TriAccelConfig
from triaccel.backends.jax import data as jdata
from triaccel.backends.jax.data import ElasticLoader, elastic_step

N = 150
LIMIT = 1000
BUCKETS = (8, 16, 24, 32, 48, 64)


def make_cfg(**kw):
    base = dict(t_ctrl=1, batch_init=16, batch_min=8, batch_max=64, batch_multiple=8,
                batch_buckets=BUCKETS, rho_low=0.6, rho_high=0.85, curvature="off",
                adaptive_precision=False, oom_shrink=0.5, lr_rule="linear",
                batch_law="memory")  # the paper's memory law: these tests drive the batch by memory
    return TriAccelConfig(**(base | kw))


def oom_error():
    return jax.errors.JaxRuntimeError(
        "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 20971520 bytes. (injected)")


def make_arrays(n=N):
    x = np.random.default_rng(0).normal(size=(n, 3)).astype(np.float32)
    return {"x": x, "id": np.arange(n, dtype=np.int32)}


def loss_of(params, batch, mask):
    pred = batch["x"] @ params["w"] + params["b"]
    return jnp.sum(pred ** 2 * mask) / jnp.sum(mask)


_vg = jax.jit(jax.value_and_grad(loss_of))


class Harness:
    def __init__(self, cfg, oom_calls=(), mem_per_sample=10):
        self.params = {"w": jnp.ones(3), "b": jnp.zeros(())}
        self.ctl = Controller(cfg, ["fc"])
        self.loader = ElasticLoader(make_arrays(), batch_size=cfg.batch_init, seed=5)
        self.calls, self.oom_calls = 0, set(oom_calls)
        self.seen: list[int] = []
        self.shapes: set[int] = set()
        self.mem_per_sample, self.largest = mem_per_sample, 0

    def grad_fn(self, batch, mask):
        self.calls += 1
        if self.calls in self.oom_calls:
            raise oom_error()
        self.shapes.add(int(mask.shape[0]))
        real = np.asarray(batch["id"])[np.asarray(mask) > 0]
        self.largest = max(self.largest, len(real))
        self.seen.extend(real.tolist())
        return _vg(self.params, batch, mask)

    def probe(self):
        used, self.largest = self.largest * self.mem_per_sample, 0
        return used, LIMIT

    def update(self, grads, decision):
        self.params = jax.tree_util.tree_map(lambda p, g: p - 0.01 * decision.lr_batch_scale * g,
                                             self.params, grads)
        return self.params

    def step(self, step):
        return elastic_step(self.loader, self.ctl, self.grad_fn, step, probe=self.probe,
                            update_fn=self.update)


def test_exactly_once_buckets_and_law_over_epochs():
    cfg = make_cfg()
    h = Harness(cfg, oom_calls={4, 11, 12}, mem_per_sample=1)
    per_epoch: dict[int, Counter] = {}
    trace = []
    step = 0
    while True:
        start = len(h.seen)
        res = h.step(step)
        per_epoch.setdefault(res.epoch, Counter()).update(h.seen[start:])
        trace.append((res.decision.batch_size, res.ooms, h.ctl.decision.batch_size))
        step += 1
        if res.end_of_epoch and res.epoch == 2:
            break
    assert h.loader.stats["ooms"] == 3
    for e in range(3):
        assert sorted(per_epoch[e]) == list(range(N)) and set(per_epoch[e].values()) == {1}
    assert h.shapes <= set(BUCKETS)                       # compiled shapes bounded by the buckets
    assert h.loader.shapes_served <= set(BUCKETS)
    for b, ooms, after in trace:
        assert b in BUCKETS and after in BUCKETS
        if ooms:
            assert after < b
    # memory always low: one bucket up per control step until an OOM caps it
    assert [t[0] for t in trace[:3]] == [16, 24, 32]


def test_memory_pressure_moves_one_bucket_down():
    h = Harness(make_cfg(), mem_per_sample=1)
    bs = [h.step(s).decision.batch_size for s in range(4)]
    assert bs == [16, 24, 32, 48]
    h.mem_per_sample = 30   # 48 * 30 > 850
    after = [h.step(s).decision.batch_size for s in range(4, 7)]
    assert after[0] == 64 and after[1] == 48 and after[2] == 32


def test_final_short_batch_padded_with_mask():
    loader = ElasticLoader(make_arrays(20), batch_size=16, buckets=(8, 16), shuffle=False)
    batches = list(loader)
    (b1, m1), (b2, m2) = batches
    assert m1.shape == (16,) and float(m1.sum()) == 16
    assert b2["x"].shape == (8, 3) and m2.tolist() == [1, 1, 1, 1, 0, 0, 0, 0]
    assert np.asarray(b2["id"])[:4].tolist() == [16, 17, 18, 19]


def test_accumulate_equals_full_batch_gradient():
    cfg = make_cfg(lr_rule="accumulate", batch_init=32, batch_max=32, batch_buckets=(8, 16, 24, 32))
    ctl = Controller(cfg, ["fc"])
    loader = ElasticLoader(make_arrays(), batch_size=32, seed=2)
    params = {"w": jnp.array([0.5, -1.0, 2.0]), "b": jnp.array(0.3)}
    calls = [0]

    def grad_fn(batch, mask):
        calls[0] += 1
        if calls[0] == 1:
            raise oom_error()      # 32 -> 16: two micro-batches of 16 for the logical 32
        return _vg(params, batch, mask)
    first = loader.sampler.permutation(0)[:32]
    res = elastic_step(loader, ctl, grad_fn, 0)
    assert res.samples == 32 and res.micro_sizes == [16, 16] and res.ooms == 1
    d = ctl.decision
    assert (d.batch_size, d.accumulation, d.logical_batch) == (16, 2, 32)
    arr = make_arrays()
    full = {"x": jnp.asarray(arr["x"][first]), "id": jnp.asarray(arr["id"][first])}
    ref = jax.grad(loss_of)(params, full, jnp.ones(32))
    for k in ref:
        np.testing.assert_allclose(res.grads[k], ref[k], rtol=1e-5, atol=1e-6)
    # the tail micro-batch of a short logical batch is padded but weighted by its real samples
    res2 = elastic_step(loader, ctl, lambda b, m: _vg(params, b, m), 1)
    assert sum(res2.micro_sizes) == 32


def test_state_dict_resume_exact_order():
    cfg = make_cfg()
    a = Harness(cfg, oom_calls={6})
    for s in range(3):
        a.step(s)
    sd = json.loads(json.dumps({"loader": a.loader.state_dict(), "ctl": a.ctl.state_dict(),
                                "calls": a.calls}))
    assert 0 < sd["loader"]["sampler"]["cursor"] < N and a.calls < 6
    n0 = len(a.seen)
    cont = [a.step(s).micro_sizes for s in range(3, 12)]
    b = Harness(cfg, oom_calls={6})
    b.calls = sd["calls"]
    b.loader.load_state_dict(sd["loader"])
    b.ctl.load_state_dict(sd["ctl"])
    assert [b.step(s).micro_sizes for s in range(3, 12)] == cont
    assert b.seen == a.seen[n0:]


def test_is_oom_and_other_errors_propagate():
    assert jdata.is_oom(oom_error())
    assert not jdata.is_oom(jax.errors.JaxRuntimeError("INTERNAL: something else"))
    assert not jdata.is_oom(MemoryError("RESOURCE_EXHAUSTED"))
    h = Harness(make_cfg())

    def bad(batch, mask):
        raise jax.errors.JaxRuntimeError("INTERNAL: not an OOM")
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
        elastic_step(h.loader, h.ctl, bad, 0)
    assert h.loader.sampler.in_flight == 0 and h.loader.sampler.remaining == N


def test_transform_gets_deterministic_key():
    keys = []

    def tf(batch, key):
        keys.append(np.asarray(jax.random.key_data(key)) if hasattr(jax.random, "key_data") else key)
        return {**batch, "x": batch["x"] * 2}
    a = ElasticLoader(make_arrays(), batch_size=8, buckets=(8,), seed=1, transform=tf)
    (b, _) = next(iter(a))
    first = keys[-1]
    c = ElasticLoader(make_arrays(), batch_size=8, buckets=(8,), seed=1, transform=tf)
    next(iter(c))
    np.testing.assert_array_equal(keys[-1], first)
    ids = np.asarray(b["id"])
    np.testing.assert_allclose(np.asarray(b["x"]), 2 * make_arrays()["x"][ids])


def test_device_arrays_gathered_on_device():
    arr = {k: jnp.asarray(v) for k, v in make_arrays(30).items()}
    loader = ElasticLoader(arr, batch_size=16, buckets=(16,), seed=0)
    got = [np.asarray(b["id"])[np.asarray(m) > 0] for b, m in loader]
    assert sorted(np.concatenate(got).tolist()) == list(range(30))


def test_bad_input():
    with pytest.raises(ValueError, match="batch_size=0"):
        ElasticLoader(make_arrays(), batch_size=0)
    with pytest.raises(ValueError, match="buckets"):
        ElasticLoader(make_arrays(), batch_size=8, buckets=(16, 8))
    with pytest.raises(ValueError, match="batch_size=32"):
        ElasticLoader(make_arrays(), batch_size=32, buckets=(8, 16))
    with pytest.raises(ValueError, match="leading sample axis"):
        ElasticLoader({"x": np.zeros((4, 2)), "y": np.zeros(5)}, batch_size=2)
    loader = ElasticLoader(make_arrays(), batch_size=8, buckets=(8, 16))
    with pytest.raises(ValueError, match="n=17"):
        loader.bucket_for(17)
    with pytest.raises(ValueError, match="buckets"):
        elastic_step(loader, Controller(make_cfg(), ["fc"]), lambda b, m: None, 0)
    small = ElasticLoader(make_arrays(6), batch_size=8)
    with pytest.raises(ValueError, match="batch_min=8"):
        elastic_step(small, Controller(make_cfg(), ["fc"]), lambda b, m: None, 0)


def test_fetch_reuses_its_mask_per_size_and_uploads_a_donated_one_again():
    x = jnp.arange(40.0).reshape(20, 2)
    y = jnp.arange(20)
    loader = ElasticLoader((x, y), batch_size=8, buckets=(8, 16), shuffle=False)
    (xb, yb), m1 = loader.fetch(np.arange(5))
    assert m1.tolist() == [1.0] * 5 + [0.0] * 3 and yb.tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert xb.tolist() == x[jnp.array([0, 1, 2, 3, 4, 0, 1, 2])].tolist()
    _, m2 = loader.fetch(np.arange(5, 10))
    assert m2 is m1   # the same (samples, bucket): no new upload
    _, m3 = loader.fetch(np.arange(10, 19))
    assert m3.tolist() == [1.0] * 9 + [0.0] * 7 and m3 is not m1
    m1.delete()   # as a jitted step that donates its mask argument would
    _, m4 = loader.fetch(np.arange(5))
    assert not m4.is_deleted() and m4.tolist() == [1.0] * 5 + [0.0] * 3
