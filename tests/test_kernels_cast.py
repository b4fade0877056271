"""cast_to / cast_flat: Triton (interpreter) and references against NumPy casts."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from triaccel.kernels import cast_flat, cast_reference_jnp, cast_reference_torch, cast_to  # noqa: E402

CFG = dict(block=1024, iters=4)


@pytest.fixture(autouse=True)
def _ignore_fp16_overflow():
    with np.errstate(over="ignore"):  # expected FP32 -> FP16 overflows to Inf in the NumPy ground truth
        yield


def bf16_bits_rne(x: np.ndarray) -> np.ndarray:
    """FP32 -> BF16 bit patterns with round-to-nearest-even, in NumPy (NaN kept NaN)."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    r[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return r.view(np.int16)


def values(n, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 10.0 ** rng.integers(-6, 6, n)).astype(np.float32)
    special = np.float32([0.0, -0.0, np.inf, -np.inf, 65504.0, 70000.0, 1e-8, 3e38, 1.0 + 2 ** -8])
    x[: min(n, special.size)] = special[: min(n, special.size)]
    return x


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_cast_list_mixed_precisions(impl):
    import triaccel.kernels._dispatch as D

    sizes = [1, 7, 1023, 0, 65537, 5]
    xs = [values(n, i) for i, n in enumerate(sizes)]
    ts = [torch.from_numpy(x.copy()) for x in xs]
    ts[2] = ts[2].reshape(31, 33)
    precs = ["fp16", "bf16", "bf16", "fp16", "fp16", "fp32"]
    out = cast_to(ts, precs, impl=impl, **CFG)
    assert out[5] is ts[5]
    assert out[2].shape == (31, 33) and out[2].dtype == torch.bfloat16
    for x, o, p in zip(xs, out, precs):
        if p == "fp16":
            np.testing.assert_array_equal(o.view(torch.int16).numpy().ravel(), x.astype(np.float16).view(np.int16))
        elif p == "bf16":
            got = o.reshape(-1).view(torch.int16).numpy().astype(np.int32)
            exp = bf16_bits_rne(x).astype(np.int32)
            if impl == "triton" and D.interpreter_enabled():
                assert np.all(np.abs(got - exp) <= 1)  # the interpreter truncates
            else:
                np.testing.assert_array_equal(got, exp)
    # FP16 and BF16 outputs share one 16-bit buffer
    ptrs = {o.untyped_storage().data_ptr() for o, p in zip(out, precs) if p != "fp32"}
    assert len(ptrs) == 1


def test_cast_precision_enum_like_and_channels_last():
    class FakePrecision(int):  # stands in for triaccel.Precision (IntEnum with .short)
        short = "bf16"

    w = torch.randn(4, 3, 3, 3).to(memory_format=torch.channels_last)
    (o,) = cast_to([w], [FakePrecision(1)], **CFG)
    assert o.stride() == w.stride()
    assert torch.allclose(o.float(), w, rtol=2 ** -7)


def test_cast_flat_and_out_reuse():
    x = torch.from_numpy(values(3000, 9))
    off = [0, 1000, 1001, 3000]
    buf, parts = cast_flat(x, off, ["fp16", "fp32", "fp16"], **CFG)
    assert buf.dtype == torch.int16 and buf.numel() == 2999
    assert parts[1].data_ptr() == x[1000:1001].data_ptr()
    np.testing.assert_array_equal(parts[2].view(torch.int16).numpy(), x[1001:].numpy().astype(np.float16).view(np.int16))
    buf2, _ = cast_flat(x, off, ["fp16", "fp32", "fp16"], out=buf, **CFG)
    assert buf2 is buf


def test_jax_cast_matches_numpy():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    xs = [values(n, 10 + n) for n in (7, 1023)]
    arrs = [jnp.asarray(x) for x in xs]
    out = cast_to(arrs, ["bf16", "fp16"])
    np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(out[0], jnp.int16)), bf16_bits_rne(xs[0]))
    np.testing.assert_array_equal(np.asarray(out[1]).view(np.int16), xs[1].astype(np.float16).view(np.int16))
    assert cast_to(arrs, ["fp32", "fp32"])[0] is arrs[0]
    _, parts = cast_flat(jnp.concatenate(arrs), [0, 7, 1030], ["fp16", "bf16"])
    assert parts[1].dtype == jnp.bfloat16 and parts[1].shape == (1023,)


def test_torch_and_jnp_references_agree():
    jax = pytest.importorskip("jax")
    xs = [values(n, 20 + n) for n in (1, 1023, 4097)]
    codes = [0, 1, 2]
    rt = cast_reference_torch([torch.from_numpy(x) for x in xs], codes)
    rj = cast_reference_jnp([jax.numpy.asarray(x) for x in xs], codes)
    for a, b in zip(rt, rj):
        np.testing.assert_array_equal(a.float().numpy(), np.asarray(b.astype(jax.numpy.float32)))


def test_cast_errors():
    jax = pytest.importorskip("jax")
    with pytest.raises(ValueError, match="lengths must match"):
        cast_to([torch.zeros(3), torch.zeros(2)], ["fp16"])
    with pytest.raises(ValueError, match="dtypes\\[0\\]"):
        cast_to([torch.zeros(3)], ["int8"])
    with pytest.raises(TypeError, match="float32 master"):
        cast_to([torch.zeros(3, dtype=torch.float16)], ["fp16"])
    with pytest.raises(TypeError, match="mixed frameworks"):
        cast_to([torch.zeros(3), jax.numpy.zeros(3)], ["fp16", "fp16"])
    with pytest.raises(TypeError, match="dtypes"):
        cast_to([torch.zeros(3)], "fp16")


def test_cast_plan_and_views_cached_per_out_buffer():
    import importlib

    plans = importlib.import_module("triaccel.kernels.cast")._TABLES.data
    ts = [torch.from_numpy(values(n, 30 + n)) for n in (1000, 7, 33)]
    ts[0] = ts[0].reshape(10, 100)
    precs = ["fp16", "fp32", "bf16"]
    out = torch.empty(1033, dtype=torch.int16)
    o1 = cast_to(ts, precs, out=out, **CFG)
    n0 = len(plans)
    o2 = cast_to(ts, precs, out=out, **CFG)
    assert len(plans) == n0 and o2[0] is o1[0] and o2[1] is ts[1]  # plan and views reused
    assert o2[0].shape == (10, 100) and o2[0].data_ptr() == out.data_ptr()
    out2 = torch.empty_like(out)
    o3 = cast_to(ts, precs, out=out2, **CFG)
    assert o3[0].data_ptr() == out2.data_ptr() and torch.equal(o3[0], o1[0])
    moved = [t.clone() + 1 for t in ts]  # new addresses: a new plan, the moved values
    o4 = cast_to(moved, precs, out=out, **CFG)
    assert len(plans) == n0 + 1
    np.testing.assert_array_equal(o4[0].view(torch.int16).numpy(),
                                  moved[0].numpy().astype(np.float16).view(np.int16))
    assert o4[1] is moved[1]


def test_fixed_cast_reads_only_addresses_when_unchanged(monkeypatch):
    import triaccel.kernels._dispatch as D
    from triaccel.kernels import FixedCast

    ts = [torch.from_numpy(values(n, 50 + n)) for n in (1000, 7, 33)]
    precs = ["fp16", "fp32", "bf16"]
    fc = FixedCast(**CFG)
    keys = []
    real = D.torch_layout_key
    monkeypatch.setattr(D, "torch_layout_key", lambda t: (keys.append(1), real(t))[1])
    out = torch.empty(1033, dtype=torch.int16)
    first = fc(ts, precs, out=out)
    assert len(keys) == 1
    ts[0].mul_(2)   # new values in place (an optimizer step): same addresses, no new plan
    again = fc(ts, precs, out=out)
    assert len(keys) == 1 and again[1] is ts[1] and again[0].data_ptr() == first[0].data_ptr()
    for got, want in zip(again, cast_to(ts, precs, **CFG)):
        assert torch.equal(got.view(torch.int16) if got.dtype != torch.float32 else got,
                           want.view(torch.int16) if want.dtype != torch.float32 else want)
    assert len(fc(ts, precs)) == 3   # out allocated on the short path
    n = len(keys)
    fc(ts, ["bf16", "fp32", "bf16"], out=out)   # other precisions: full path
    moved = [t.clone() for t in ts]
    res = fc(moved, precs)   # other addresses: full path, moved values
    assert len(keys) == n + 2
    assert res[1] is moved[1]
    with pytest.raises(TypeError, match="float32 master"):
        fc([ts[0].half(), ts[1], ts[2]], precs)
    with pytest.raises(ValueError, match="lengths must match"):
        fc(ts, precs[:2])
