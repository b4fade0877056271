"""The JAX memory probe: compiled footprints, and allocator peak records between (XLA has no peak reset)."""

import jax
import jax.numpy as jnp
import pytest

from triaccel.backends.jax.memory import MemoryProbe
from triaccel.backends.jax.policy import CountingJit


class FakeDevice:
    platform = "gpu"

    def __init__(self):
        self.stats = {"bytes_in_use": 0, "peak_bytes_in_use": 0, "bytes_limit": 10_000}

    def memory_stats(self):
        return dict(self.stats)


def test_step_peak_estimated_from_the_last_record_scaled_by_batch():
    dev = FakeDevice()
    probe = MemoryProbe(dev)
    dev.stats.update(bytes_in_use=1000, peak_bytes_in_use=5000)      # batch 100: a new record
    assert probe.read(batch=100).used == 5000
    dev.stats.update(bytes_in_use=1000)                                # batch 50: peak not seen
    assert probe.read(batch=50).used == 1000 + 4000 * 50 // 100        # 3000, not the 1000 in use
    assert probe.read(batch=200).used == 9000                          # scaled up before it happens
    dev.stats.update(bytes_in_use=1200, peak_bytes_in_use=9500)       # a new record at batch 200
    assert probe.read(batch=200).used == 9500
    assert probe.read().used == 1200                                   # no batch: bytes in use now
    assert probe.read(batch=100).limit == 10_000


def test_a_pool_capped_at_the_budget_reports_the_device_limit(monkeypatch):
    """After limit_device_memory the XLA pool sits a few MiB under the budget: the probe reports
    the device's total so that the controller's budget check (budget <= device) still holds."""
    from triaccel import Controller, TriAccelConfig
    from triaccel.backends.jax import memory as M

    dev = FakeDevice()
    dev.stats.update(bytes_in_use=100, peak_bytes_in_use=100, bytes_limit=9_990)   # budget 10_000
    monkeypatch.setattr(M, "nvml_total_bytes", lambda d: 80_000)
    assert MemoryProbe(dev).read().limit == 9_990                 # uncapped: the pool is the limit
    monkeypatch.setattr(M, "_POOL_CAPPED", True)
    s = MemoryProbe(dev).read()
    assert s.limit == 80_000
    ctl = Controller(TriAccelConfig(memory_budget=10_000), ["a"])
    ctl.observe_memory(0, s.used, s.limit)                        # raised "exceeds the device's" before


def test_compiled_footprint_gives_the_step_peak_before_it_happens():
    dev = FakeDevice()
    probe = MemoryProbe(dev)
    dev.stats.update(bytes_in_use=1000, peak_bytes_in_use=9000)        # a record from compile scratch
    s = probe.read(batch=100, footprint=2500)
    assert (s.used, s.source) == (3500, "compiled")                    # in use + footprint, not the record
    assert probe.read(batch=100).source == "memory_stats"               # no footprint: the fallback
    with pytest.raises(ValueError, match="footprint=-1"):
        probe.read(batch=100, footprint=-1)


def test_counting_jit_records_a_footprint_per_batch_without_extra_traces():
    j = CountingJit(lambda x, w: jnp.tanh(x @ w).sum(0), use_nnx=False)   # batch: first array argument
    w = jnp.ones((16, 32))
    for n in (8, 64, 8):
        j(jnp.ones((n, 16)), w)
    assert j.traces == 2                                                # lowering for the analysis is cached
    assert set(j.footprints) == {8, 64}
    assert j.footprint(8) > 0 and j.footprint(64) >= j.footprint(8)    # (64, 32) temporaries vs (8, 32)
    assert j.footprint(16) is None                                       # never compiled at 16


def test_batch_free_footprint_applies_to_every_batch():
    j = CountingJit(lambda p: jax.tree_util.tree_map(lambda a: a * 2, p), use_nnx=False)
    j({"a": jnp.ones((4, 4))})                                          # no positional array: key None
    assert set(j.footprints) == {None} and j.footprint(123) == j.footprints[None]


def _probed_net(cfg, loss_fn=None):
    """A one-layer NNX net wrapped by TriAccel(cfg) with a fake device (1000 bytes in use), its
    `ta.jit` step, and a list collecting the controller's memory observations (step, used)."""
    import optax
    from flax import nnx

    from triaccel.backends.jax import TriAccel

    class Net(nnx.Module):
        def __init__(self):
            self.fc = nnx.Linear(4, 2, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return self.fc(x)

    model = Net()
    ta = TriAccel(cfg, model, loss_fn=loss_fn)
    opt = nnx.Optimizer(model, ta.wrap(optax.sgd(0.1)), wrt=nnx.Param)
    dev = FakeDevice()
    dev.stats.update(bytes_in_use=1000, peak_bytes_in_use=1000)
    ta.probe = MemoryProbe(dev)

    @ta.jit
    def step(x, model, opt):
        g = nnx.grad(lambda m: (m(x) ** 2).mean())(model)
        opt.update(model, g)

    seen = []
    ta.controller.observe_memory = lambda s, used, limit, at_batch=None: seen.append((s, used))
    return model, ta, opt, dev, step, seen


def test_control_feeds_the_controller_in_use_plus_the_compiled_footprint():
    import optax
    from flax import nnx

    from triaccel import TriAccelConfig
    from triaccel.backends.jax import TriAccel

    cfg = TriAccelConfig(curvature="off", t_ctrl=2, warmup_steps=2, batch_init=8, batch_min=8, batch_max=64)
    model, ta, opt, dev, step, seen = _probed_net(cfg)
    for s in range(3):
        ta.control(s, opt, model)
        step(jnp.ones((8, 4)), model, opt)
    fp = ta.footprint(8)
    assert fp is not None and fp > 0
    assert seen == [(2, 1000 + fp)]   # no reading at step 0: no step's peak in memory yet
    assert ta.probe.read(batch=8, footprint=fp).limit == 10_000

    # Resume in a "new process": the first boundary (step 4) comes before any step of it ran.
    step(jnp.ones((8, 4)), model, opt)        # step 3
    resumed = TriAccel(cfg, model)
    opt2 = nnx.Optimizer(model, resumed.wrap(optax.sgd(0.1)), wrt=nnx.Param)
    nnx.update(opt2, nnx.state(opt))          # the checkpointed optimizer state
    resumed.load_state_dict(ta.state_dict())
    resumed.probe = MemoryProbe(dev)
    resumed.controller.observe_memory = lambda s, used, limit, at_batch=None: seen.append((s, used))
    rstep = resumed.jit(step.fn)
    seen.clear()
    for s in range(4, 7):
        resumed.control(s, opt2, model)
        rstep(jnp.ones((8, 4)), model, opt2)
    assert [s for s, _u in seen] == [6]


def test_padded_steps_are_read_at_their_run_size_and_every_bucket_below_modelled():
    """A loader padding to a floor of 32 runs batch 8 as the 32-sample program: the reading takes
    that program's footprint, and the buckets that run it (8-32) are modelled at the same peak."""
    from triaccel import TriAccelConfig

    cfg = TriAccelConfig(curvature="off", t_ctrl=2, warmup_steps=2, batch_init=8, batch_min=8, batch_max=64,
                         batch_buckets=(8, 16, 32, 64))
    model, ta, opt, _dev, step, _seen = _probed_net(cfg)
    seen = []
    ta.controller.observe_memory = lambda s, used, limit, at_batch=None: seen.append((s, used, at_batch))
    for s in range(3):
        ta.control(s, opt, model, run_size=lambda b: max(b, 32))
        step(jnp.ones((32, 4)), model, opt)
    fp = ta.footprint(32)
    assert ta.footprint(8) is None and fp is not None
    assert seen == [(2, 1000 + fp, {8: 1000 + fp, 16: 1000 + fp, 32: 1000 + fp})]   # 64: not compiled


@pytest.mark.parametrize("curvature", ["fisher", "hessian"])
def test_reading_after_a_curvature_pass_covers_its_footprint_once(curvature):
    """As torch's peak counter: the reading after a curvature pass sees max(step, curvature pass)
    footprints; the one after that the step's alone."""
    from triaccel import TriAccelConfig

    def loss_fn(m, batch):
        return (m(batch[0]) ** 2).mean()

    cfg = TriAccelConfig(curvature=curvature, t_ctrl=2, t_curv=4, warmup_steps=2, top_k=1, b_curv=64,
                         batch_init=8, batch_min=8, batch_max=64)
    model, ta, opt, _dev, step, seen = _probed_net(cfg, loss_fn)
    curv_batch = (jnp.ones((64, 4)), jnp.zeros((64,), jnp.int32))
    for s in range(9):
        ta.control(s, opt, model, batch=curv_batch)
        step(jnp.ones((8, 4)), model, opt)
    curv_fp, step_fp = ta._curv_footprint, ta.footprint(8)
    assert curv_fp is not None and curv_fp > step_fp       # 64 samples vs 8
    # Curvature at steps 4 and 8 (after the reading of the same boundary): only the reading at 6
    # follows a pass.
    assert seen == [(2, 1000 + step_fp), (4, 1000 + step_fp), (6, 1000 + curv_fp), (8, 1000 + step_fp)]


# -- the budget held: pool cap, decided batch and curvature batch ------------------------------

def test_limit_device_memory_sets_the_pool_fraction(monkeypatch):
    from jax._src import xla_bridge

    from triaccel.backends.jax import memory as M
    from triaccel.backends.jax.memory import limit_device_memory

    monkeypatch.setattr(M, "_POOL_CAPPED", False)   # restored after the test: the cap is process state
    for var in ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE"):
        monkeypatch.delenv(var, raising=False)
    import jax.numpy as jnp

    jnp.zeros(1).block_until_ready()   # JAX's backend runs in this process from here on
    with pytest.raises(RuntimeError, match="already running"):
        limit_device_memory("4GiB", device_total=80 * 2**30)
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    assert limit_device_memory("4GiB", device_total=80 * 2**30) == pytest.approx(0.05)
    import os

    from triaccel.backends.jax.memory import _mem_fraction_var

    name = _mem_fraction_var()   # jaxlib refuses both names at once: exactly one is set
    assert float(os.environ[name]) == pytest.approx(0.05)
    assert [v for v in ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION") if os.environ.get(v)] == [name]
    assert os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    monkeypatch.delenv(name)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.01")      # the user's smaller cap stays, by its name
    assert limit_device_memory("4GiB", device_total=80 * 2**30) == pytest.approx(0.01)
    assert not os.environ.get("XLA_CLIENT_MEM_FRACTION")
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.5")
    with pytest.raises(ValueError, match="both set"):
        limit_device_memory("4GiB", device_total=80 * 2**30)
    monkeypatch.delenv("XLA_CLIENT_MEM_FRACTION")
    with pytest.raises(ValueError, match="exceeds the device"):
        limit_device_memory("100GiB", device_total=80 * 2**30)


def test_fit_batch_halves_until_the_modelled_peak_fits():
    from triaccel.backends.jax.memory import fit_batch

    table = {64: 900, 32: 500, 16: 260, 8: 140, 4: 80, 2: 50}
    fp = table.get
    assert fit_batch(64, fp, in_use=100, budget=1000) == 64
    assert fit_batch(64, fp, in_use=100, budget=700) == 32
    assert fit_batch(64, fp, in_use=100, budget=300) == 8       # 100 + 140 <= 300
    assert fit_batch(64, fp, in_use=100, budget=100) == 1         # none fits: the caller reports it
    assert fit_batch(64, lambda n: None, in_use=100, budget=100) == 64   # unknown footprint: as asked
    with pytest.raises(ValueError, match="size=0"):
        fit_batch(0, fp, 0, 1)


def _wide_net(cfg, loss_fn=None):
    """`_probed_net`'s set-up with a net whose activations grow with the batch (4 -> 4096 -> 2), the
    fake allocator holding nothing and a large device."""
    import optax
    from flax import nnx

    from triaccel.backends.jax import TriAccel

    class Net(nnx.Module):
        def __init__(self):
            self.fc1 = nnx.Linear(4, 4096, rngs=nnx.Rngs(0))
            self.fc2 = nnx.Linear(4096, 2, rngs=nnx.Rngs(1))

        def __call__(self, x):
            return self.fc2(jnp.tanh(self.fc1(x)))

    model = Net()
    ta = TriAccel(cfg, model, loss_fn=loss_fn)
    opt = nnx.Optimizer(model, ta.wrap(optax.sgd(1e-4)), wrt=nnx.Param)
    dev = FakeDevice()
    dev.stats.update(bytes_in_use=0, peak_bytes_in_use=0, bytes_limit=10**12)
    ta.probe = MemoryProbe(dev)

    @ta.jit
    def step(x, model, opt):
        g = nnx.grad(lambda m: (m(x) ** 2).mean())(model)
        opt.update(model, g)

    return model, ta, opt, step


def test_decided_batch_keeps_the_modelled_peak_under_the_budget():
    """Fake allocator reading: the budget lies just below the step's footprint at batch 64. The
    memory law grows the batch from 8 and every decided batch's modelled peak (in use + its
    compiled footprint) stays within the budget: 64 is never taken."""
    from triaccel import TriAccelConfig

    base = dict(curvature="off", t_ctrl=2, warmup_steps=2, batch_init=8, batch_min=8, batch_max=64,
                batch_buckets=(8, 16, 32, 64), batch_law="memory", rho_low=0.9, rho_high=0.95)
    model, ta, opt, step = _wide_net(TriAccelConfig(**base))
    for n in (8, 16, 32, 64):
        step(jnp.ones((n, 4)), model, opt)
    fp = {n: ta.footprint(n) for n in (8, 16, 32, 64)}
    assert fp[8] < fp[16] < fp[32] < fp[64]
    budget = fp[64] - 1
    model, ta, opt, step = _wide_net(TriAccelConfig(**base, memory_budget=budget))
    batches = []
    with pytest.warns(RuntimeWarning, match="allocator may use"):   # the fake pool is not capped
        for s in range(16):
            ta.control(s, opt, model)
            batches.append(ta.decision.batch_size)
            step(jnp.full((batches[-1], 4), 0.01), model, opt)
    assert 8 < max(batches) < 64                                   # grown, and held below the budget
    assert all(fp[b] <= budget for b in batches), (batches, fp, budget)


def test_curvature_batch_keeps_the_modelled_peak_under_the_budget():
    """The Fisher pass over b_curv=64 would exceed the budget: it runs on the largest halving of the
    batch whose compiled footprint fits, with a warning naming the size."""
    from triaccel import TriAccelConfig
    from triaccel.backends.jax import FisherTopK, nnx_loss

    def loss_fn(m, batch):
        return (m(batch[0]) ** 2).mean()

    base = dict(curvature="fisher", t_ctrl=2, t_curv=2, warmup_steps=2, top_k=1, b_curv=64, batch_init=8,
                batch_min=8, batch_max=8, elastic_batch=False)
    model, ta, opt, step = _wide_net(TriAccelConfig(**base), loss_fn)
    pure = nnx_loss(model, loss_fn)
    fisher = FisherTopK(pure.fn, ta.layers, 1)
    curv = {n: fisher.footprint(pure.params, (jnp.ones((n, 4)), jnp.zeros((n,), jnp.int32)), pure.aux)
            for n in (16, 32, 64)}
    assert curv[16] < curv[32] < curv[64]
    budget = curv[32] - 1                                          # 16 fits, 32 and 64 do not
    model, ta, opt, step = _wide_net(TriAccelConfig(**base, memory_budget=budget), loss_fn)
    batch = (jnp.ones((64, 4)), jnp.zeros((64,), jnp.int32))
    with pytest.warns(RuntimeWarning, match="curvature pass over b_curv=64 .* runs on 16 samples"):
        for s in range(5):
            ta.control(s, opt, model, batch=batch)
            step(jnp.full((8, 4), 0.01), model, opt)
    assert ta.curvature_batch == 16 and curv[16] <= budget
