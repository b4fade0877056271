"""StatePacking: a state's leaves as a few flat buffers, and SplitStep carrying its state packed."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from triaccel.backends.jax import SplitStep
from triaccel.backends.jax.packing import StatePacking


def _leaves():
    r = np.random.default_rng(0)
    return [jnp.asarray(r.normal(size=(3, 5)), jnp.float32), jnp.asarray(r.normal(size=(7,)), jnp.bfloat16),
            jnp.asarray(2, jnp.int32), jnp.asarray(r.normal(size=(1, 1, 3, 2)), jnp.float32),
            jax.random.key(1), jnp.asarray(r.normal(size=()), jnp.float32), jnp.asarray(r.normal(size=(4,)), jnp.bfloat16),
            jnp.asarray(0.5), jnp.zeros((0, 3), jnp.float32)]   # a weak scalar, an empty array


def test_pack_unpack_round_trip_over_odd_shapes_and_dtypes():
    leaves = _leaves()
    p = StatePacking(leaves)
    assert p.num_buffers == 2 + 3   # float32 (4 leaves) and bfloat16 (2); alone: int32, the key, the weak scalar
    bufs = p.pack_now(leaves)
    assert [b.shape for b in bufs[:2]] == [(15 + 6 + 1 + 0,), (11,)]
    back = p.unpack_now(bufs)
    for a, b in zip(leaves, back):
        assert a.dtype == b.dtype and a.shape == b.shape
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            np.testing.assert_array_equal(jax.random.key_data(a), jax.random.key_data(b))
        else:
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert [(a.shape, a.dtype) for a in p.abstract()] == [(b.shape, b.dtype) for b in bufs]
    assert StatePacking(back).signature == p.signature


def test_pack_refuses_a_changed_leaf():
    leaves = _leaves()
    p = StatePacking(leaves)
    with pytest.raises(ValueError, match=r"leaves\[1\]: float32\[7\]"):
        p.pack([leaves[0], leaves[1].astype(jnp.float32), *leaves[2:]])
    with pytest.raises(ValueError, match="expected 9 leaves"):
        p.pack(leaves[:-1])
    with pytest.raises(ValueError, match="expected 5"):
        p.unpack([])


def test_take_and_put_reach_some_leaves_without_unpacking_the_rest():
    leaves = _leaves()
    p = StatePacking(leaves)
    bufs = p.pack_now(leaves)
    idx = (3, 2, 6, 0)   # grouped and lone leaves, out of order
    for i, got in zip(idx, p.take_now(bufs, idx)):
        assert got.dtype == leaves[i].dtype and got.shape == leaves[i].shape
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(leaves[i], np.float32))
    new = [jnp.full((1, 1, 3, 2), 7.0, jnp.float32), jnp.asarray(9, jnp.int32), jnp.full((4,), -1.0, jnp.bfloat16),
           jnp.zeros((3, 5), jnp.float32)]
    back = p.unpack_now(p.put_now(bufs, idx, new))
    for i, a in enumerate(back):
        want = new[idx.index(i)] if i in idx else leaves[i]
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            np.testing.assert_array_equal(jax.random.key_data(a), jax.random.key_data(want))
        else:
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(want, np.float32))
    with pytest.raises(ValueError, match="values for leaf 3: float32\\[3\\]"):
        p.put(bufs, (3,), [jnp.zeros((3,), jnp.float32)])
    # compiled ahead: the same results from the stored executables
    p.compile_take_put(idx)
    assert set(p._ahead) == {("take", idx), ("put", idx)}
    for a, b in zip(p.take_now(bufs, idx), [leaves[i] for i in idx]):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    again = p.unpack_now(p.put_now(bufs, idx, new))
    for a, b in zip(again, back):
        if not jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def _model_and_opt():
    model = nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.BatchNorm(8, rngs=nnx.Rngs(1)),
                           nnx.Linear(8, 2, rngs=nnx.Rngs(2)))
    return model, nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)


def _train(model, opt, x, y):
    def lf(m):
        return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()

    loss, grads = nnx.value_and_grad(lf)(model)
    opt.update(model, grads)
    return loss


def test_split_step_carries_the_state_packed_and_trains_as_nnx_jit():
    r = np.random.default_rng(1)
    x, y = jnp.asarray(r.normal(size=(16, 4)), jnp.float32), jnp.asarray(r.integers(0, 2, 16), jnp.int32)
    ref_model, ref_opt = _model_and_opt()
    ref = nnx.jit(_train)
    model, opt = _model_and_opt()
    step = SplitStep(_train, model, opt, compile_ahead=False, compile_cache=False, donate_argnums=(), pack=True)
    n_leaves = len(jax.tree_util.tree_leaves(nnx.state((model, opt))))
    for _ in range(3):
        want = ref(ref_model, ref_opt, x, y)
        got = step(x, y)
        np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    treedef, packing, arrays = step.snapshot()
    assert packing is not None and len(arrays) == packing.num_buffers < n_leaves   # packed between calls
    step.sync()   # the host reads the state: unpacked once, then written into the objects
    assert step.snapshot()[1] is None and len(step.snapshot()[2]) == n_leaves
    for a, b in zip(jax.tree_util.tree_leaves(nnx.state(ref_model)), jax.tree_util.tree_leaves(nnx.state(model))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
    step.restore((treedef, packing, arrays))   # a packed snapshot taken before the read comes back
    np.testing.assert_allclose(float(step(x, y)), float(ref(ref_model, ref_opt, x, y)), rtol=1e-6)


def test_pack_auto_leaves_a_cpu_state_unpacked_and_bad_values_raise():
    model, opt = _model_and_opt()
    step = SplitStep(_train, model, opt, compile_ahead=False, compile_cache=False)   # pack="auto" on a CPU
    n_leaves = len(jax.tree_util.tree_leaves(nnx.state((model, opt))))
    assert step._packing.num_buffers == n_leaves and not step._packing.groups
    x, y = jnp.ones((4, 4), jnp.float32), jnp.zeros((4,), jnp.int32)
    step(x, y)
    assert len(step.snapshot()[2]) == n_leaves
    with pytest.raises(ValueError, match="pack='yes': allowed True, False or 'auto'"):
        SplitStep(_train, model, opt, pack="yes")


def test_a_control_boundary_moves_only_the_wrappers_leaves_of_a_packed_state():
    """At a boundary without curvature the wrapper's few leaves are sliced out of the packed state
    and put back (no program over every leaf); the run equals one whose state is not packed."""
    from triaccel import TriAccelConfig
    from triaccel.backends.jax import TriAccel

    r = np.random.default_rng(3)
    x, y = jnp.asarray(r.normal(size=(16, 4)), jnp.float32), jnp.asarray(r.integers(0, 2, 16), jnp.int32)
    cfg = TriAccelConfig(t_ctrl=2, warmup_steps=0, curvature="off", elastic_batch=False)
    runs = []
    for pack in (True, False):
        model = _model_and_opt()[0]
        ta = TriAccel(cfg, model)
        opt = nnx.Optimizer(model, ta.wrap(optax.sgd(0.1, momentum=0.9)), wrt=nnx.Param)
        step = SplitStep(_train, model, opt, ta=ta, compile_ahead=pack, compile_cache=False, donate_argnums=(),
                         pack=pack)
        losses = []
        puts = []
        for s in range(6):
            step.control(s)
            losses.append(float(step(x, y)))
            if s == 0 and pack:   # from now on a full unpack fails the test
                step._packing.unpack_now = lambda buffers: pytest.fail("a boundary unpacked the whole state")
                # the decisions change nothing: no boundary writes the leaves back
                put = step._packing.put_now
                step._packing.put_now = lambda *a: puts.append(1) or put(*a)
                step.ahead.wait()   # the boundary's slice and put programs, compiled ahead
                assert {k for k, _ in step._packing._ahead} == {"take", "put"}
        if pack:
            assert step.snapshot()[1] is not None   # still packed after the boundaries at 2 and 4
            assert puts == []
            del step._packing.unpack_now, step._packing.put_now
        report = ta.report(step)
        runs.append((losses, report["optimizer_step"], [np.asarray(a) for a in jax.tree_util.tree_leaves(
            nnx.state(model, nnx.Param))]))
    (l1, n1, p1), (l2, n2, p2) = runs
    assert n1 == n2 == 6
    np.testing.assert_allclose(l1, l2, rtol=1e-6)
    for a, b in zip(p1, p2):
        np.testing.assert_allclose(a, b, rtol=1e-6)
