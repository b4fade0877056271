"""Gradient-noise halves measured inside the wrapped update (`TriAccel(noise_in_update=True)`).

(a) Two halves through the update equal one update over the whole batch, and the first half changes
nothing but the noise fields; (b) the logged squared norms are those of jax.grad on each half and
on the whole batch, and reach the controller at the next boundary with the halves' sizes; (c) a
non-finite half logs nothing and the step is skipped; (d) bad use fails clearly; (e) through
`elastic_step(noise_step_fn=...)`, a run measures the same noise scale and trains the same
parameters as the host-side measurement, each noise step as two fused calls.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from triaccel import TriAccelConfig
from triaccel.backends.jax import SplitStep, TriAccel, find_state
from triaccel.backends.jax.data import ElasticLoader, InFlight, elastic_step

pytestmark = pytest.mark.filterwarnings("ignore:triaccel. device:RuntimeWarning")


class _MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, inputs: int = 5, hidden: int = 7) -> None:
        self.fc1 = nnx.Linear(inputs, hidden, rngs=rngs)
        self.fc2 = nnx.Linear(hidden, 3, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(jax.nn.relu(self.fc1(x)))


def _cfg(**kw) -> TriAccelConfig:
    return TriAccelConfig(**{**dict(t_ctrl=4, warmup_steps=0, batch_init=16, batch_min=8, batch_max=64,
                                    batch_buckets=(8, 16, 32, 64), adaptive_precision=False), **kw})


def _build(flag: bool, cfg: TriAccelConfig | None = None, inputs: int = 5, hidden: int = 7):
    model = _MLP(nnx.Rngs(0), inputs, hidden)
    ta = TriAccel(cfg or _cfg(), model, noise_in_update=flag)
    return model, ta, nnx.Optimizer(model, ta.wrap(optax.sgd(0.1, momentum=0.9)), wrt=nnx.Param)


def _data(n: int = 10, inputs: int = 5):
    r = np.random.default_rng(2)
    return jnp.asarray(r.normal(size=(n, inputs)), jnp.float32), jnp.asarray(r.integers(0, 3, n), jnp.int32)


def _loss(m, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()


def _sq(tree) -> np.ndarray:
    return np.array([float(jnp.sum(jnp.square(a))) for a in jax.tree_util.tree_leaves(tree)])


def _leaves(tree) -> list[np.ndarray]:
    return [np.asarray(a) for a in jax.tree_util.tree_leaves(tree)]


def _half(opt, model, x, y, part, n):
    opt.update(model, nnx.grad(_loss)(model, x, y), noise_part=jnp.int32(part), noise_samples=jnp.float32(n))


# the small arrays only (stacked with the moments' groups), and a first layer of 300 x 256 = 76,800 weights:
# over the moments' small_max (65,536), held and combined as a whole array
@pytest.mark.parametrize("inputs, hidden", [(5, 7), (300, 256)])
def test_two_halves_update_as_the_whole_batch_and_log_their_norms(inputs, hidden):
    x, y = _data(inputs=inputs)
    model, ta, opt = _build(True, inputs=inputs, hidden=hidden)
    g1, g2 = nnx.grad(_loss)(model, x[:4], y[:4]), nnx.grad(_loss)(model, x[4:], y[4:])
    before = _leaves(nnx.state(model, nnx.Param))
    inner_before = _leaves(find_state(opt.opt_state).inner)
    _half(opt, model, x[:4], y[:4], 1, 4)
    ts = find_state(opt.opt_state)
    for a, b in zip(_leaves(nnx.state(model, nnx.Param)), before):   # the first half: no update
        np.testing.assert_array_equal(a, b)
    for a, b in zip(_leaves(ts.inner), inner_before):
        np.testing.assert_array_equal(a, b)
    assert int(ts.count[...]) == 0 and int(ts.noise_count[...]) == 0 and int(ts.row_step[...].max()) == -1
    _half(opt, model, x[4:], y[4:], 2, 6)

    ref_model, _, ref_opt = _build(False, inputs=inputs, hidden=hidden)
    g = nnx.grad(_loss)(ref_model, x, y)
    ref_opt.update(ref_model, g)
    for a, b in zip(_leaves(nnx.state(model, nnx.Param)), _leaves(nnx.state(ref_model, nnx.Param))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    ts = find_state(opt.opt_state)
    assert int(ts.count[...]) == 1 and int(ts.noise_count[...]) == 1
    assert ts.noise_steps[...].tolist() == [0, -1]   # ceil(t_ctrl / t_noise) + 1 = 2 slots
    t = len(jax.tree_util.tree_leaves(g))
    row = np.asarray(ts.noise_rows[...][0], np.float64)
    np.testing.assert_allclose(row[:t], _sq(g1), rtol=1e-5)
    np.testing.assert_allclose(row[t:2 * t], _sq(g2), rtol=1e-5)
    np.testing.assert_allclose(row[2 * t:3 * t], _sq(g), rtol=1e-5)
    assert row[-2:].tolist() == [4.0, 6.0]
    np.testing.assert_allclose(np.asarray(ts.moments[...][0, :, 1]), _sq(g), rtol=1e-5)  # the step's own row
    sums = np.array([float(jnp.sum(a)) for a in jax.tree_util.tree_leaves(g)])
    # (the last bias sums to ~0: softmax gradients over the classes cancel, so an absolute tolerance)
    np.testing.assert_allclose(np.asarray(ts.moments[...][0, :, 0]), sums, rtol=1e-4, atol=1e-5)
    assert not np.asarray(ts.moments[...][0, :, 2]).any()

    seen = []
    observe = ta.controller.observe_gradient_noise
    ta.controller.observe_gradient_noise = lambda *a: (seen.append(a), observe(*a))
    ta.control(4, opt)   # the next boundary feeds it, once
    ta.control(8, opt)
    assert len(seen) == 1 and ta.last_noise_fed == 0 and ta.report(opt)["noise_lost"] == 0
    step, sizes, micro, total = seen[0]
    lm = ta.layers
    per_layer = lambda v: np.bincount(lm.tensor_layer_of(g), weights=v, minlength=lm.num_layers)
    assert step == 0 and sizes == [4, 6]
    np.testing.assert_allclose(micro[0], per_layer(_sq(g1)), rtol=1e-5)
    np.testing.assert_allclose(total, per_layer(_sq(g)), rtol=1e-5)


def test_a_nonfinite_half_logs_nothing_and_the_step_is_skipped():
    x, y = _data()
    model, ta, opt = _build(True)
    before = _leaves(nnx.state(model, nnx.Param))
    bad = jax.tree_util.tree_map(lambda a: a.at[(0,) * a.ndim].set(jnp.nan), nnx.grad(_loss)(model, x[:4], y[:4]))
    opt.update(model, bad, noise_part=jnp.int32(1), noise_samples=jnp.float32(4))
    _half(opt, model, x[4:], y[4:], 2, 6)
    ts = find_state(opt.opt_state)
    assert int(ts.noise_count[...]) == 0 and int(ts.skipped[...]) == 1 and int(ts.count[...]) == 1
    for a, b in zip(_leaves(nnx.state(model, nnx.Param)), before):
        np.testing.assert_array_equal(a, b)
    ta.control(4, opt)
    assert ta.controller._noise.count == 0 and ta.rows_skipped == 1


def test_bad_use_fails_clearly_and_a_full_ring_warns():
    x, y = _data()
    model, ta, opt = _build(False)
    with pytest.raises(ValueError, match="noise_in_update=True"):
        _half(opt, model, x[:4], y[:4], 1, 4)
    with pytest.raises(ValueError, match="noise_in_update"):
        TriAccel(_cfg(), _MLP(nnx.Rngs(0)), noise_in_update=1)
    with pytest.raises(ValueError, match="noise_split='steps'.*pass noise_in_update=False"):
        TriAccel(_cfg(noise_split="steps"), _MLP(nnx.Rngs(0)), noise_in_update=True)
    model, ta, opt = _build(True, _cfg(t_noise=2))   # two noise steps per boundary: 3 slots
    for _ in range(4):
        _half(opt, model, x[:4], y[:4], 1, 4)
        _half(opt, model, x[4:], y[4:], 2, 6)
    with pytest.warns(RuntimeWarning, match="1 gradient-noise measurement"):
        ta.control(4, opt)
    assert ta.noise_lost == 1 and ta.controller._noise.count == 3 and ta.last_noise_fed == 3
    sd = ta.state_dict()
    assert (sd["last_noise_fed"], sd["noise_logged"], sd["noise_lost"]) == (3, 4, 1)



def test_the_ring_holds_the_dense_warm_up_measurements_too():
    x, y = _data()
    cfg = _cfg(t_noise=2, t_noise_warm=1, noise_beta=0.5)   # 2 warm-up steps 1 apart: 3 + 2 slots
    model, ta, opt = _build(True, cfg)
    assert find_state(opt.opt_state).noise_steps[...].shape == (5,)
    for _ in range(4):
        _half(opt, model, x[:4], y[:4], 1, 4)
        _half(opt, model, x[4:], y[4:], 2, 6)
    ta.control(4, opt)
    assert ta.noise_lost == 0 and ta.controller._noise.count == 4 and ta.last_noise_fed == 3

def _run(in_update: bool, steps: int, **cfg_kw):
    """A TriAccel-wrapped MLP trained through elastic_step with a step in flight, fused steps, and
    noise steps measured inside the update (in_update) or on the host from the halves' gradients."""
    cfg = _cfg(t_ctrl=2, t_noise=2, batch_init=16, **cfg_kw)
    model = _MLP(nnx.Rngs(0))
    ta = TriAccel(cfg, model, noise_in_update=in_update)
    opt = nnx.Optimizer(model, ta.wrap(optax.sgd(0.05, momentum=0.9)), wrt=nnx.Param)
    x, y = _data(96)
    loader = ElasticLoader((np.asarray(x), np.asarray(y)), batch_size=cfg.batch_init, seed=3, pad_to_batch=True,
                           buckets=cfg.batch_buckets)

    def loss_of(m, b, mask):
        ce = optax.softmax_cross_entropy_with_integer_labels(m(b[0]), b[1])
        return (ce * mask).sum() / jnp.maximum(mask.sum(), 1.0)

    def grad_body(m, o, b, mask):
        return nnx.value_and_grad(loss_of)(m, b, mask)

    def train_body(m, o, b, mask, *part):
        loss, grads = grad_body(m, o, b, mask)
        o.update(m, grads, **({"noise_part": part[0], "noise_samples": mask.sum()} if part else {}))
        return loss

    split = SplitStep(train_body, model, opt, ta=ta, donate_argnums=(), compile_ahead=False, compile_cache=False,
                      pad_to_batch=True, loader=loader)
    assert [split.run_size(b) for b in (8, 12, 40)] == [8, 16, 64]   # its bucket (no pad floor here)
    grads_of = split.bind(grad_body, model, opt)
    update = split.bind(lambda p, o, g: o.update(p, g), nnx.state(model, nnx.Param), opt)
    in_flight = InFlight(split.snapshot, split.restore)
    sizes = []
    for s in range(steps):
        if ta.controller.is_control_step(s):
            in_flight.settle()
        split.control(s)
        res = elastic_step(loader, ta.controller, lambda b, m: grads_of(b, m), s, update_fn=lambda g, d: update(g),
                           tensor_layer=ta.layers, in_flight=in_flight, step_fn=lambda b, m, d, w: split(b, m, *(
                               (jnp.int32(0),) if in_update else ())),
                           noise_step_fn=(lambda b, m, d, part, w: split(b, m, jnp.int32(part))) if in_update else None)
        sizes.append(res.micro_sizes)
    in_flight.settle()
    report = ta.report(split)
    split.sync()
    return sizes, report, _leaves(nnx.state(model, nnx.Param))


def test_a_run_measures_and_trains_as_with_the_host_side_measurement():
    steps = 9   # noise steps 0, 2, 4, 6, 8: the last one read by report()
    (s_in, r_in, p_in), (s_host, r_host, p_host) = _run(True, steps), _run(False, steps)
    assert s_in == s_host and sum(len(s) == 2 for s in s_in) == 5
    assert r_in["b_noise"] == pytest.approx(r_host["b_noise"], rel=1e-4) and r_in["b_noise"] is not None
    assert r_in["batch_size"] == r_host["batch_size"] and r_in["noise_lost"] == 0
    for a, b in zip(p_in, p_host):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_doubled_noise_steps_measure_and_train_alike_in_update_and_on_the_host():
    """noise_split="double": a noise step runs two batches of the decided size (16 + 16 here, not
    8 + 8), inside the update's programs or on the host, with the same measurement and training."""
    steps = 9
    (s_in, r_in, p_in), (s_host, r_host, p_host) = (_run(True, steps, noise_split="double"),
                                                    _run(False, steps, noise_split="double"))
    assert s_in == s_host
    noise = [s for s in s_in if len(s) == 2]
    assert len(noise) == 5 and noise[0] == [16, 16] and all(max(s) <= 16 for s in s_in)
    assert r_in["b_noise"] == pytest.approx(r_host["b_noise"], rel=1e-4) and r_in["b_noise"] is not None
    for a, b in zip(p_in, p_host):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    s_halves = _run(False, steps)[0]
    assert [s for s in s_halves if len(s) == 2][0] == [8, 8]


def test_noise_step_fn_needs_a_step_in_flight():
    loader = ElasticLoader((np.zeros((16, 2), np.float32),), batch_size=8)
    _, ta, _ = _build(True)
    with pytest.raises(ValueError, match="noise_step_fn: needs in_flight"):
        elastic_step(loader, ta.controller, lambda b, m: (0.0, {}), 0, update_fn=lambda g, d: None,
                     noise_step_fn=lambda b, m, d, p, w: 0.0)
