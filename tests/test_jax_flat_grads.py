"""FlatLayout: gradient arrays as one zero-padded vector (the JAX update's noise halves,
``TriAccel(noise_layout="flat")``): round trip, per-array statistics against float64 NumPy over odd
sizes, empty arrays, non-finite values and mixed dtypes; bad input named."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from triaccel.backends.jax.flat_grads import FlatLayout


def _arrays():
    r = np.random.default_rng(0)
    shapes = [(3, 5), (1,), (0,), (1023,), (1024,), (1025,), (7, 11, 13), (2, 2049)]
    dts = [jnp.float32, jnp.bfloat16, jnp.float32, jnp.float16, jnp.float32, jnp.bfloat16, jnp.float32, jnp.float32]
    return [jnp.asarray(r.normal(size=s) * 3, d) for s, d in zip(shapes, dts)]


def test_round_trip_and_moments_against_float64():
    xs = _arrays()
    xs[3] = xs[3].at[5].set(jnp.inf).at[9].set(jnp.nan)
    lay = FlatLayout([x.size for x in xs], chunk=64)
    flat = lay.flatten(xs)
    assert flat.dtype == jnp.float32 and flat.shape == (lay.size,) and lay.size % 64 == 0
    for a, b in zip(lay.unflatten(flat, xs), xs):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    got = np.asarray(lay.moments(flat))
    for i, x in enumerate(xs):
        v = np.asarray(x, np.float64).ravel()
        fin = np.isfinite(v)
        scale = np.abs(v[fin]).sum() + 1e-30   # a sum's float32 error is relative to the magnitudes summed
        assert abs(got[i, 0] - v[fin].sum()) <= 2e-6 * scale, i
        np.testing.assert_allclose(got[i, 1], (v[fin] ** 2).sum(), rtol=2e-6, atol=1e-30, err_msg=str(i))
        assert got[i, 2] == (~fin).sum(), i
    assert got[3, 2] == 2 and got[2].tolist() == [0.0, 0.0, 0.0]


def test_the_layout_is_cached_and_bad_input_is_named():
    assert FlatLayout.of((3, 4)) is FlatLayout.of((3, 4))
    assert FlatLayout.of((3, 4)).offsets == (0, 1024) and FlatLayout.of(()).size == 0
    with pytest.raises(ValueError, match="chunk=0: allowed integers >= 1"):
        FlatLayout([3], chunk=0)
    with pytest.raises(ValueError, match="sizes"):
        FlatLayout([3, -1])
    with pytest.raises(ValueError, match=r"leaves: sizes \(4,\) do not match the layout's \(3,\)"):
        FlatLayout([3]).flatten([jnp.zeros(4)])
