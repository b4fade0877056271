"""`InFlight`: a JAX elastic step left running on the device, checked at the next call; a late
out-of-memory error restores the state and replays the step's samples, as an OOM inside the step."""

from __future__ import annotations

import contextlib
import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from triaccel.backends.jax import SplitStep
from triaccel.batching import OOMAtMinimumBatch
from triaccel.backends.jax.data import InFlight, elastic_step
from test_elastic_jax import Harness, make_cfg, oom_error


class _Failed:
    """A result whose computation failed on the device: waiting for it raises (jax 0.11 reports a
    device OOM at the wait, not at the call; benchmarks/device/jax_oom_probe.py)."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def block_until_ready(self):
        # a new error per wait, as the runtime raises: one kept and re-raised would keep the frames
        # of every raise alive through its traceback
        raise type(self.error)(*self.error.args)


class _Ready:
    """A finished result (the harness's state keeps one leaf per program output)."""

    def block_until_ready(self):
        return self


class Lagged(Harness):
    """Harness whose steps ending with grad call number in `late_calls` fail on the device: the step
    returns, and its update leaves in the state a result that raises when waited for."""

    def __init__(self, cfg, late_calls=(), late_error=None, quiet=None, **kw):
        super().__init__(cfg, **kw)
        self.late_calls, self.late_error = set(late_calls), late_error or oom_error()
        self.failed = _Ready()
        self.quiet = quiet
        self.in_flight = InFlight(lambda: (self.params, self.failed), self._restore)

    def _restore(self, snap):
        self.params, self.failed = snap

    def update(self, grads, decision):
        out = super().update(grads, decision)
        if self.calls in self.late_calls:   # the step's programs failed: their outputs raise when waited for
            self.failed = _Failed(self.late_error)
        return out

    def step(self, step):
        return elastic_step(self.loader, self.ctl, self.grad_fn, step, update_fn=self.update,
                            in_flight=self.in_flight, quiet=self.quiet)


class Fused(Lagged):
    """`Lagged` whose whole-batch steps run as one call, gradient and update (`step_fn`), e.g. one
    jitted program: each counts as a grad call, so `late_calls` fails them as the two programs."""

    def __init__(self, cfg, **kw):
        super().__init__(cfg, **kw)
        self.fused_calls = 0

    def fused(self, batch, mask, decision, weight):
        self.fused_calls += 1
        loss, grads = self.grad_fn(batch, mask)
        self.update(jax.tree_util.tree_map(lambda g: g * weight, grads), decision)
        return loss

    def step(self, step):
        return elastic_step(self.loader, self.ctl, self.grad_fn, step, update_fn=self.update,
                            in_flight=self.in_flight, quiet=self.quiet, step_fn=self.fused)



def run(h, steps):
    return [h.step(s) for s in range(steps)]


def run_settled(steps, *harnesses):
    """Each harness run for `steps` steps, its last step settled: their traces."""
    traces = [run(h, steps) for h in harnesses]
    for h in harnesses:
        h.in_flight.settle()
    return traces


def _accumulating(**kw):
    # the logical batch stays 32 whatever micro-batch an OOM leaves: the same samples make each step
    # whether the OOM surfaced inside the step or at the next one
    return make_cfg(lr_rule="accumulate", batch_init=32, batch_max=32, batch_buckets=(8, 16, 24, 32),
                    t_ctrl=1000, **kw)


def _close(a, b):
    for k in b:
        np.testing.assert_allclose(np.asarray(a[k]), np.asarray(b[k]), rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("harness", [Lagged, Fused])
def test_late_oom_trains_the_same_steps_as_an_oom_inside_the_step(harness):
    cfg = _accumulating()
    sync = Harness(cfg, oom_calls={4})
    sync_trace = [elastic_step(sync.loader, sync.ctl, sync.grad_fn, s, update_fn=sync.update) for s in range(8)]
    late = harness(cfg, late_calls={4})
    late_trace = run(late, 8)
    late.in_flight.settle()   # (after the shrink every step runs as two micro-batches: waited for)
    assert not late.in_flight.pending and late.in_flight.lagged_ooms == 1
    assert isinstance(late.failed, _Ready)
    _close(late.params, sync.params)   # the failed step was undone, its samples trained once
    # the failed step (index 3) reports what its replay ran, as the step with the OOM inside does
    assert late_trace[3].micro_sizes == sync_trace[3].micro_sizes == [16, 16]
    assert late_trace[3].ooms == sync_trace[3].ooms == 1
    assert late_trace[3].replayed == sync_trace[3].replayed == 32
    np.testing.assert_allclose(float(late_trace[3].loss), float(sync_trace[3].loss), rtol=1e-5)
    # the step that found it ran its micro-batch again from the restored state, at the new size
    assert late.ctl.decision.batch_size == sync.ctl.decision.batch_size == 16
    assert [r.samples for r in late_trace] == [r.samples for r in sync_trace]
    for key in ("samples", "replayed", "ooms", "steps"):
        assert late.loader.stats[key] == sync.loader.stats[key]
    if harness is Fused:   # fused until the failure surfaced (steps 0-4: step 4's own call ran from the
        assert late.fused_calls == 5   # failed state and again as micro-batches), then two micro-batches each


def test_every_sample_once_per_epoch_with_late_ooms():
    cfg = _accumulating()
    h = Lagged(cfg, late_calls={5})   # the epoch's 5th step (150 samples: 5 steps of 32, the last short)
    ref = Harness(cfg, oom_calls={5})
    step = 0
    while True:
        res = h.step(step)
        r2 = elastic_step(ref.loader, ref.ctl, ref.grad_fn, step, update_fn=ref.update)
        assert (res.epoch, res.samples) == (r2.epoch, r2.samples)
        step += 1
        if res.end_of_epoch and res.epoch == 1:
            break
    h.in_flight.settle()
    assert h.in_flight.lagged_ooms == 1 and h.loader.stats["ooms"] == ref.loader.stats["ooms"] == 1
    assert h.loader.stats["samples"] == ref.loader.stats["samples"] == 2 * 150
    _close(h.params, ref.params)


def test_with_quiet_the_replay_first_tries_the_same_size():
    """An OOM beside a background compilation may be transient: in `quiet` (no compilation beside
    it) the step is replayed at its own size, and the batch shrinks only if that fails again."""
    cfg = _accumulating()
    entered = []

    @contextlib.contextmanager
    def quiet():
        entered.append(True)
        yield

    h = Lagged(cfg, late_calls={4}, quiet=quiet)
    trace = run(h, 6)
    h.in_flight.settle()
    assert entered == [True] and h.in_flight.lagged_ooms == 1
    assert trace[3].ooms == 1 and trace[3].micro_sizes == [32] and h.ctl.decision.batch_size == 32
    ref = Harness(cfg)   # no OOM at all: the same steps
    for s in range(6):
        elastic_step(ref.loader, ref.ctl, ref.grad_fn, s, update_fn=ref.update)
    _close(h.params, ref.params)
    # failing again at the same size, it shrinks as without quiet
    h2 = Lagged(cfg, late_calls={4}, oom_calls={6}, quiet=quiet)
    trace2 = run(h2, 6)
    h2.in_flight.settle()
    assert trace2[3].micro_sizes == [16, 16] and trace2[3].ooms == 2 and h2.ctl.decision.batch_size == 16


def test_waiting_step_retries_inside_quiet_after_an_oom():
    events = []

    @contextlib.contextmanager
    def quiet():
        events.append("enter")
        yield
        events.append("exit")

    cfg = _accumulating()
    h = Harness(cfg, oom_calls={2, 3})   # two OOMs in step 1: quiet entered once, left at its end
    r0 = elastic_step(h.loader, h.ctl, h.grad_fn, 0, update_fn=h.update, quiet=quiet)
    assert r0.ooms == 0 and events == []
    r1 = elastic_step(h.loader, h.ctl, h.grad_fn, 1, update_fn=h.update, quiet=quiet)
    assert r1.ooms == 2 and events == ["enter", "exit"]
    r2 = elastic_step(h.loader, h.ctl, h.grad_fn, 2, update_fn=h.update, quiet=quiet)
    assert r2.ooms == 0 and events == ["enter", "exit"]


def test_quiet_contexts_balanced_with_in_flight_and_a_late_oom():
    depth, entered = [0], [0]

    @contextlib.contextmanager
    def quiet():
        depth[0] += 1
        entered[0] += 1
        yield
        depth[0] -= 1

    cfg = _accumulating()
    h = Lagged(cfg, late_calls={2}, oom_calls={5}, quiet=quiet)   # a late OOM, then one inside a step
    for s in range(5):
        elastic_step(h.loader, h.ctl, h.grad_fn, s, update_fn=h.update, in_flight=h.in_flight, quiet=quiet)
    h.in_flight.settle()
    assert h.in_flight.lagged_ooms == 1 and h.loader.stats["ooms"] == 2
    assert entered[0] == 2 and depth[0] == 0   # each entered once and left


def test_no_oom_same_as_waiting_and_split_steps_wait():
    cfg = make_cfg(batch_init=32, t_ctrl=1000)
    ref = Harness(cfg)
    for s in range(5):
        elastic_step(ref.loader, ref.ctl, ref.grad_fn, s, update_fn=ref.update)
    h = Lagged(cfg)
    run(h, 5)
    assert h.in_flight.pending
    h.in_flight.settle()
    h.in_flight.settle()   # nothing in flight: no-op
    for k in ref.params:
        np.testing.assert_array_equal(np.asarray(h.params[k]), np.asarray(ref.params[k]))
    # a step that survived an OOM inside it ran as several micro-batches, each waited for
    h2 = Lagged(cfg, oom_calls={1})
    res = h2.step(0)
    assert res.ooms == 1 and len(res.micro_sizes) == 2 and not h2.in_flight.pending


def test_other_errors_propagate_and_bad_input():
    cfg = make_cfg(batch_init=32, t_ctrl=1000)
    h = Lagged(cfg, late_calls={1}, late_error=RuntimeError("INTERNAL: device lost"))
    h.step(0)
    with pytest.raises(RuntimeError, match="device lost"):
        h.step(1)
    with pytest.raises(ValueError, match="snapshot, restore"):
        InFlight(None, lambda s: None)
    with pytest.raises(ValueError, match="update_fn"):
        elastic_step(h.loader, h.ctl, h.grad_fn, 2, in_flight=h.in_flight)


@pytest.mark.parametrize("pack", [False, True])
def test_split_step_snapshot_restore(pack):
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    def body(m, o, x):
        loss, g = nnx.value_and_grad(lambda mm: jnp.sum(mm(x) ** 2))(m)
        o.update(m, g)
        return loss

    split = SplitStep(body, model, opt, compile_ahead=False, compile_cache=False, donate_argnums=(), pack=pack)
    x = jnp.ones((4, 3))
    split(x)
    snap = split.snapshot()
    l1 = float(split(x))
    split.restore(snap)
    assert float(split(x)) == l1            # the same step again from the restored state
    split.resplit()
    with pytest.raises(ValueError, match="split again"):
        split.restore(snap)
    donating = SplitStep(body, model, opt, compile_ahead=False, compile_cache=False, pack=pack)
    donating(x)
    old = donating.snapshot()
    donating(x)
    with pytest.raises(ValueError, match="donated"):
        donating.restore(old)


@contextlib.contextmanager
def _cycles_saved():
    """gc off and every unreachable cycle kept in `gc.garbage` (yielded): what a step leaves there
    would live on a GPU until Python's cyclic collector happened to run."""
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield gc.garbage
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


@pytest.mark.parametrize("path", ["plain", "oom-retry", "noise", "in-flight-late-oom"])
def test_a_dropped_step_frees_its_arrays_at_once(path):
    """A step's gradients and the state before it are freed when the caller drops its result (and,
    in flight, when the next step has settled it), by reference counting: no step leaves a reference
    cycle. A recursive closure of elastic_step once made one and kept every step's gradients alive
    until a cyclic collection (hundreds of MB per step of ResNet-18 on a GPU: 4 GiB budgets failed)."""
    cfg = (_accumulating() if path != "noise" else   # a batch that can grow: noise steps every 2
           make_cfg(batch_law="noise", t_noise=2, warmup_steps=0, batch_init=32, t_ctrl=1000))
    h = Lagged(cfg, late_calls={4} if path == "in-flight-late-oom" else (),
               oom_calls={3} if path == "oom-retry" else ())
    in_flight = h.in_flight if path == "in-flight-late-oom" else None
    with _cycles_saved() as garbage:
        refs, splits = [], []
        for s in range(6):
            res = elastic_step(h.loader, h.ctl, h.grad_fn, s, update_fn=h.update, in_flight=in_flight,
                               tensor_layer=np.zeros(2, np.int64))
            refs.append(weakref.ref(jax.tree_util.tree_leaves(res.grads)[0]))
            splits.append(len(res.micro_sizes))
            del res
        if in_flight is not None:
            in_flight.settle()
            assert in_flight.lagged_ooms == 1
        if path == "oom-retry":
            assert h.loader.stats["ooms"] == 1
        if path == "noise":
            assert splits[0] == 2   # a measured step: two micro-batches
        gc.collect()
        assert [type(o).__name__ for o in garbage if isinstance(o, jax.Array)] == []
        alive = [i for i, r in enumerate(refs) if r() is not None]
        assert alive == [], f"gradients of steps {alive} still alive"


def test_waiting_step_after_a_failed_update_names_the_cause():
    """Without an InFlight nobody waits for the update's program: if it ran out of memory, every
    later micro-batch is computed from its failed outputs and fails at any size. The error at the
    minimum batch then says so and names the remedy."""
    cfg = _accumulating()

    class Poisoned(Harness):
        failed = False

        def grad_fn(self, batch, mask):
            if self.failed:   # computed from the failed update's outputs
                raise oom_error()
            return super().grad_fn(batch, mask)

        def update(self, grads, decision):
            out = super().update(grads, decision)
            self.failed = self.calls == 2   # the second step's update program failed on the device
            return out

    h = Poisoned(cfg)
    for s in range(2):
        elastic_step(h.loader, h.ctl, h.grad_fn, s, update_fn=h.update)
    with pytest.raises(OOMAtMinimumBatch, match="in_flight=InFlight"):
        elastic_step(h.loader, h.ctl, h.grad_fn, 2, update_fn=h.update)
    plain = Poisoned(cfg)   # no update_fn: the plain message
    plain.failed = True
    with pytest.raises(OOMAtMinimumBatch) as err:
        elastic_step(plain.loader, plain.ctl, plain.grad_fn, 0)
    assert "in_flight" not in str(err.value)


def test_a_fused_step_trains_as_its_two_programs():
    cfg = _accumulating()
    two, one = Lagged(cfg), Fused(cfg)
    a, b = run_settled(6, two, one)
    assert one.fused_calls == 6 and one.calls == two.calls == 6
    _close(one.params, two.params)
    assert [float(r.loss) for r in b] == pytest.approx([float(r.loss) for r in a], rel=1e-6)
    assert all(r.grads is None and r.updated is None for r in b)   # no gradients leave the program
    assert [r.micro_sizes for r in b] == [r.micro_sizes for r in a] == [[32]] * 4 + [[22], [32]]   # 150 per epoch


def test_noise_steps_run_as_two_programs_beside_fused_steps():
    cfg = make_cfg(batch_law="noise", t_noise=2, warmup_steps=0, batch_init=16, batch_max=32,
                   batch_buckets=(8, 16, 24, 32), t_ctrl=1000)
    two, one = Lagged(cfg), Fused(cfg)
    a, b = run_settled(6, two, one)
    measured = sum(len(r.micro_sizes) == 2 for r in b)
    assert measured >= 2 and one.fused_calls == 6 - measured   # the measured steps split, through grad_fn
    assert [r.micro_sizes for r in b] == [r.micro_sizes for r in a]
    assert one.ctl.b_noise == pytest.approx(two.ctl.b_noise, rel=1e-5)
    _close(one.params, two.params)


def test_step_fn_needs_a_step_in_flight():
    h = Harness(_accumulating())
    with pytest.raises(ValueError, match="step_fn: needs in_flight"):
        elastic_step(h.loader, h.ctl, h.grad_fn, 0, update_fn=h.update, step_fn=lambda b, m, d, w: 0.0)


class FusedNoise(Fused):
    """`Fused` whose noise steps run as two calls (`noise_step_fn`), as the TriAccel wrapper's
    in-update halves: part 1 holds its gradient x samples, part 2 updates with the halves' mean."""

    def __init__(self, cfg, **kw):
        super().__init__(cfg, **kw)
        self.halves, self.held = 0, None

    def noise(self, batch, mask, decision, part, weight):
        self.halves += 1
        loss, grads = self.grad_fn(batch, mask)
        n = float(np.asarray(mask).sum())
        if part == 1:
            self.held = (n, jax.tree_util.tree_map(lambda g: g * n, grads))
            if self.calls in self.late_calls:   # this program failed on the device: its held output raises
                self.failed = _Failed(self.late_error)
        else:
            n1, acc = self.held
            self.update(jax.tree_util.tree_map(lambda a, g: weight * (a + g * n) / (n1 + n), acc, grads), decision)
        return loss

    def step(self, step):
        return elastic_step(self.loader, self.ctl, self.grad_fn, step, update_fn=self.update,
                            in_flight=self.in_flight, quiet=self.quiet, step_fn=self.fused, noise_step_fn=self.noise)


def _noise_cfg():
    # decisions at step 0 only (t_ctrl): the batch stays 32, which can grow, so every 2nd step measures
    return make_cfg(batch_law="noise", t_noise=2, warmup_steps=0, batch_init=32, batch_max=64,
                    batch_buckets=(8, 16, 24, 32, 48, 64), t_ctrl=1000)


def test_noise_halves_in_the_step_train_as_the_host_measured_steps():
    cfg = _noise_cfg()
    host, halves = Lagged(cfg), FusedNoise(cfg)
    a, b = run_settled(8, host, halves)
    assert [r.micro_sizes for r in b] == [r.micro_sizes for r in a]   # a noise step reports its halves
    assert sum(len(r.micro_sizes) == 2 for r in b) == 4 and halves.halves == 8
    assert halves.fused_calls == 4 and all(r.grads is None for r in b)
    _close(halves.params, host.params)
    assert [float(r.loss) for r in b] == pytest.approx([float(r.loss) for r in a], rel=1e-6)


@pytest.mark.parametrize("where", ["first half", "second half"])
def test_an_oom_in_a_noise_half_replays_the_step_and_loses_no_sample(where):
    """A synchronous OOM in a half: the step runs again through grad_fn and update_fn at the shrunken
    size (the first half's held gradient is dropped); a late one: restored and replayed. Either way
    every sample of the epoch is trained once."""
    cfg = _noise_cfg()
    call = 1 if where == "first half" else 2   # step 0 is a noise step: its halves are calls 1 and 2
    for h in (FusedNoise(cfg, oom_calls={call}), FusedNoise(cfg, late_calls={call})):
        step = 0
        while True:
            res = h.step(step)
            step += 1
            if res.end_of_epoch:
                break
        h.in_flight.settle()
        assert h.in_flight.lagged_ooms == (1 if h.late_calls else 0)
        assert h.loader.stats["ooms"] == 1 and h.loader.stats["samples"] == 150
        assert h.loader.sampler.epoch_done and h.loader.sampler.in_flight == 0
        assert h.ctl.decision.batch_size == 16   # shrunk once
        assert all(np.isfinite(np.asarray(v)).all() for v in jax.tree_util.tree_leaves(h.params))
