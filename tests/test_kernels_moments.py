"""grad_moments: Triton (interpreter) and references against float64 NumPy."""

import importlib
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from triaccel.kernels import (  # noqa: E402
    grad_moments,
    grad_moments_flat,
    moments_reference_jnp,
    moments_reference_jnp_tree,
    moments_reference_torch,
)

# The CPU-tensor tests need the interpreter (conftest turns it on); on a GPU machine the file still collects
# without it, so a GPU command line may name it with `-k`.
assert os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available(), "TRITON_INTERPRET=1 off a GPU"

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# small launch config so that multi-chunk segments show up at test sizes
CFG = dict(block=1024, iters=4)


def ref64(tensors, inv_scale=1.0):
    rows = []
    for t in tensors:
        x = t.float().numpy().astype(np.float64).ravel() * np.float32(inv_scale)
        fin = np.isfinite(x)
        xf = np.where(fin, x, 0.0)
        rows.append((xf.sum(), (xf * xf).sum(), int((~fin).sum()), np.abs(xf).sum()))
    return rows


def check(m, tensors, inv_scale=1.0, rtol=2e-6):
    for i, (s, q, nf, a) in enumerate(ref64(tensors, inv_scale)):
        n = max(tensors[i].numel(), 1)
        assert abs(float(m.sum[i]) - s) <= rtol * (a + 1e-30) * np.sqrt(n) + 1e-30, (i, float(m.sum[i]), s)
        assert abs(float(m.sumsq[i]) - q) <= rtol * q * np.sqrt(n) + 1e-30, (i, float(m.sumsq[i]), q)
        assert int(m.nonfinite[i]) == nf


def make(sizes, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=g) * 3 + 0.5).to(dtype) for n in sizes]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_odd_sizes(dtype, impl):
    ts = make([1, 7, 1023, 0, 65537, 1, 1024, 1025], dtype)
    m = grad_moments(ts, impl=impl, **CFG)
    assert m.sum.dtype == torch.float32 and m.sumsq.dtype == torch.float32
    assert m.nonfinite.dtype == torch.int32 and m.sum.shape == (8,)
    check(m, ts)


def test_mixed_dtypes_shapes_and_layouts_one_call():
    g = torch.Generator().manual_seed(1)
    conv = torch.randn(8, 3, 5, 5, generator=g).to(memory_format=torch.channels_last)
    ts = [conv, torch.randn(33, 17, generator=g).half(), torch.randn(4097, generator=g).bfloat16(),
          torch.randn(5, generator=g).double()]
    check(grad_moments(ts, **CFG), ts)
    moved = [t.clone() * 3 for t in ts]   # same layout at new addresses: the plan re-based
    check(grad_moments(moved, **CFG), moved)


def test_many_segments():
    rng = np.random.default_rng(2)
    sizes = rng.integers(0, 40, size=60).tolist()
    ts = make(sizes, torch.float32, seed=3)
    check(grad_moments(ts, **CFG), ts)


def test_nonfinite_counted_and_excluded():
    x = torch.tensor([1.0, float("nan"), -2.0, float("inf"), float("-inf"), 3.0])
    y = torch.full((2000,), float("nan"), dtype=torch.float16)
    z = torch.tensor([float("inf")], dtype=torch.bfloat16)
    m = grad_moments([x, y, z], **CFG)
    assert m.sum.tolist() == [2.0, 0.0, 0.0]
    assert m.sumsq.tolist() == [14.0, 0.0, 0.0]
    assert m.nonfinite.tolist() == [3, 2000, 1]


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # 3e38**2 in FP32, on purpose
def test_huge_and_subnormal_values():
    huge = torch.tensor([1e18, -1e18, 3e18, 3.0e38])
    sub = torch.tensor([1e-40, -3e-42, 1e-45, 2e-39])
    m = grad_moments([huge, sub], **CFG)
    assert float(m.sum[0]) == pytest.approx(3.0e38, rel=1e-6)
    assert m.sumsq[0].item() == float("inf") and int(m.nonfinite[0]) == 0  # FP32 sumsq overflow
    assert float(m.sum[1]) == pytest.approx(float(sub.double().sum()), rel=1e-5, abs=1e-45)
    assert float(m.sumsq[1]) == 0.0  # squares of subnormals underflow in FP32
    big = torch.tensor([1e18, -1e18, 3e18])
    check(grad_moments([big], **CFG), [big])


@pytest.mark.parametrize("dtype", DTYPES)
def test_inv_scale_float_and_tensor_unscale_in_place(dtype):
    base = make([7, 5000], dtype, seed=4)
    base[1][17] = float("inf")
    for inv in (0.125, torch.tensor([1.0 / 1024.0])):
        ts = [t.clone() for t in base]
        exp = [t.clone() for t in base]
        moments_reference_torch(exp, inv)
        scale = float(inv) if isinstance(inv, float) else float(inv.item())
        m = grad_moments(ts, inv_scale=inv, **CFG)
        check(m, base, scale)
        for t, e in zip(ts, exp):
            if dtype == torch.bfloat16:  # interpreter truncates FP32 -> BF16 on store
                assert torch.allclose(t.float(), e.float(), rtol=2 ** -7, equal_nan=True)
            else:
                assert torch.equal(t.float().nan_to_num(0.0), e.float().nan_to_num(0.0))
        assert bool(torch.isinf(ts[1][17]))


def test_out_row_of_preallocated_buffer_and_flat_entry():
    sizes = [5, 0, 3000, 1]
    ts = make(sizes, torch.float32, seed=5)
    buf = torch.full((4, len(sizes), 3), -7.0)
    res = grad_moments(ts, out=buf[2], **CFG)
    assert res.data_ptr() == buf[2].data_ptr()
    assert torch.all(buf[1] == -7.0) and torch.all(buf[3] == -7.0)
    flat = torch.cat([t.ravel() for t in ts])
    off = np.concatenate([[0], np.cumsum(sizes)])
    m = grad_moments_flat(flat, off, **CFG)
    check(m, ts)
    assert torch.allclose(buf[2][:, 0], m.sum, rtol=1e-6, atol=1e-6)
    assert torch.equal(buf[2][:, 2].to(torch.int32), m.nonfinite)
    # flat unscale in place
    m2 = grad_moments_flat(flat, off.tolist(), inv_scale=0.5, **CFG)
    assert torch.equal(flat, torch.cat([t.ravel() for t in ts]) * 0.5)
    check(m2, ts, 0.5)


def test_jax_list_pytree_and_flat():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    rng = np.random.default_rng(6)
    leaves = {"a": rng.standard_normal((3, 7)).astype(np.float32),
              "b": [rng.standard_normal(1023).astype(np.float16), np.float32([np.nan, 2.0])]}
    tree = jax.tree_util.tree_map(jnp.asarray, leaves)
    m = grad_moments(tree)
    ts = [torch.from_numpy(np.array(x)) for x in jax.tree_util.tree_leaves(tree)]
    check(m, ts)
    assert m.nonfinite.dtype == jnp.int32
    m2, un = grad_moments(tree, inv_scale=0.25)
    check(m2, ts, 0.25)
    assert jax.tree_util.tree_structure(un) == jax.tree_util.tree_structure(tree)
    assert un["b"][0].dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(un["a"]), leaves["a"] * np.float32(0.25))
    flat = jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in jax.tree_util.tree_leaves(tree)])
    m3 = grad_moments_flat(flat, [0, 21, 1044, 1046])
    np.testing.assert_allclose(np.asarray(m3.sum), np.asarray(m.sum), rtol=1e-5)


def test_jax_xla_impl_matches_the_flat_reference_in_and_out_of_jit():
    """impl="xla" (each array reduced on its own), JAX only: the statistics of the flat reference and
    of the float64 oracle over odd shapes, every dtype, an empty array, NaN/Inf and a scale, and the unscaled arrays in their
    own dtypes, eager and jitted; torch tensors refuse them."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    impl = "xla"
    ts = make([1, 7, 0, 1023, 4097], torch.float32, seed=8)
    ts[1][3], ts[3][0], ts[3][9] = float("nan"), float("inf"), float("-inf")
    dtypes = [jnp.float32, jnp.float16, jnp.bfloat16, jnp.float32, jnp.bfloat16]
    leaves = [jnp.asarray(t.numpy()).astype(d) for t, d in zip(ts, dtypes)]
    exact = [torch.from_numpy(np.asarray(a.astype(jnp.float32))) for a in leaves]
    for scale in (None, 0.25, jnp.full((1,), 0.25, jnp.float32)):
        for fn in (lambda: grad_moments(leaves, inv_scale=scale, impl=impl),
                   lambda: jax.jit(lambda ls: grad_moments(ls, inv_scale=scale, impl=impl))(leaves)):
            got = fn()
            m, un = (got, None) if scale is None else got
            check(m, exact, 1.0 if scale is None else 0.25, rtol=4e-6)
            if un is not None:
                assert [u.dtype for u in un] == dtypes and [u.shape for u in un] == [a.shape for a in leaves]
                for u, a in zip(un, leaves):
                    np.testing.assert_array_equal(np.asarray(u.astype(jnp.float32)),
                                                  np.asarray((a.astype(jnp.float32) * 0.25).astype(a.dtype).astype(jnp.float32)))
    flat = jnp.concatenate([a.astype(jnp.float32) for a in leaves])
    off = np.concatenate([[0], np.cumsum([a.size for a in leaves])])
    want, _ = moments_reference_jnp(flat, off)
    got, parts = moments_reference_jnp_tree(leaves)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5)
    assert parts is None and moments_reference_jnp_tree([])[0].shape == (0, 3)
    assert np.asarray(moments_reference_jnp_tree([jnp.zeros(0)])[0]).tolist() == [[0.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match="JAX arrays only"):
        grad_moments([torch.ones(3)], impl=impl)
    with pytest.raises(ValueError, match=f"impl='{impl}'"):
        grad_moments_flat(flat, off, impl=impl)
    allowed = r"impl='cuda': allowed values for JAX arrays are \('auto', 'triton', 'reference', 'xla'\)"
    with pytest.raises(ValueError, match=allowed):   # an unknown impl: named, with the allowed values
        grad_moments(leaves, impl="cuda")
    with pytest.raises(ValueError, match=allowed):
        grad_moments_flat(flat, off, impl="cuda")


def test_xla_tree_stacks_small_arrays_by_length():
    """Arrays up to `small_max` elements are reduced per power-of-two length: the same statistics as one
    reduction per array, in far fewer reductions (a launch-bound step pays per kernel)."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    sizes = [64, 64, 100, 128, 7, 1, 0, 3000, 70000, 2, 2**16]
    ts = make(sizes, torch.float32, seed=11)
    ts[2][5], ts[4][0], ts[8][9] = float("nan"), float("inf"), float("-inf")
    dtypes = [jnp.float32, jnp.bfloat16, jnp.float32, jnp.float16, jnp.float32, jnp.float32, jnp.float32,
              jnp.bfloat16, jnp.float32, jnp.float32, jnp.float32]
    leaves = [jnp.asarray(t.numpy()).astype(d) for t, d in zip(ts, dtypes)]
    for scale in (None, 0.5):
        alone, parts_alone = moments_reference_jnp_tree(leaves, scale, small_max=0)
        got, parts = moments_reference_jnp_tree(leaves, scale)
        np.testing.assert_allclose(np.asarray(got), np.asarray(alone), rtol=2e-6, atol=1e-6)
        assert np.asarray(got)[:, 2].tolist() == [0, 0, 1, 0, 1, 0, 0, 0, 1, 0, 0]
        if scale is not None:
            for u, w in zip(parts, parts_alone):
                assert u.dtype == w.dtype
                np.testing.assert_array_equal(np.asarray(u.astype(jnp.float32)), np.asarray(w.astype(jnp.float32)))

    def reductions(small_max, row=0):
        jaxpr = jax.make_jaxpr(lambda ls: moments_reference_jnp_tree(ls, small_max=small_max, row=row)[0])(leaves)
        return sum(e.primitive.name.startswith("reduce_") for e in jaxpr.jaxpr.eqns)

    # lengths 64 (two arrays), 128 (100 and 128), 16 (7, 1, 2), 4096, 2**16; 0 and 70000 alone
    assert reductions(0) == 3 * len(sizes) and reductions(2**16) == 3 * 7
    # up to 3000 elements: lengths 64, 128, 16, 4096; 0 alone; 70000 and 2**16 per row of 1024, then
    # their rows' three sums together in one
    assert reductions(3000, row=1024) == 3 * (4 + 1 + 2) + 1
    with pytest.raises(ValueError, match="small_max=-1"):
        moments_reference_jnp_tree(leaves, small_max=-1)
    with pytest.raises(ValueError, match="row=-1"):
        moments_reference_jnp_tree(leaves, row=-1)


def test_stacked_form_holds_each_array_and_dots_it_as_the_moments_group_it():
    """`stacked_zeros` / `stacked_dot` / `unstacked`: a companion in the moments' stacked form (odd sizes,
    empty, large, mixed dtypes) gives per array the dot product of one reduction per array, the arrays
    come back from their stacked form unscaled as the moments unscale them."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    from triaccel.kernels.grad_moments import stack_layout, stacked_dot, stacked_zeros, unstacked

    rng = np.random.default_rng(3)
    shapes = [(3, 3, 4, 8), (7,), (0,), (70001,), (1,), (5, 13), (17,), (300, 300)]
    dtypes = [jnp.float32, jnp.bfloat16, jnp.float32, jnp.float32, jnp.float16, jnp.float32, jnp.float32, jnp.bfloat16]
    leaves = [jnp.asarray(rng.standard_normal(s).astype(np.float32)).astype(d) for s, d in zip(shapes, dtypes)]
    layout = stack_layout(leaves)
    assert layout.whole == (2, 3, 7) and sorted(layout.slot) == [0, 1, 4, 5, 6]
    zeros = stacked_zeros(leaves)
    assert all(z.dtype == np.float32 and not z.any() for z in zeros) and len(zeros) == len(layout.groups) + 3
    comp = [jnp.asarray(rng.standard_normal(z.shape).astype(np.float32)) for z in zeros]
    dots, stacks = stacked_dot(leaves, comp, inv_scale=0.5)
    parts = unstacked(comp, leaves)
    assert [p.shape for p in parts] == [a.shape for a in leaves]
    want = [float(jnp.sum(p * a.astype(jnp.float32))) / 2 for p, a in zip(parts, leaves)]
    np.testing.assert_allclose(np.asarray(dots), want, rtol=2e-5, atol=1e-4)
    back = unstacked(stacks, leaves)
    for b, a in zip(back, leaves):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a.astype(jnp.float32) * 0.5))
    with pytest.raises(ValueError, match="companion: 2 arrays"):
        stacked_dot(leaves, comp[:2])


def test_xla_tree_reduces_large_arrays_in_rows():
    """A large array is reduced per row of `row` elements (zero-padded), all large arrays' rows in one more
    reduction: the statistics of one whole reduction each, non-finite values counted, in each
    accumulation dtype apart, whatever the shapes."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    rng = np.random.default_rng(5)
    shapes = [(3, 3, 64, 129), (70001,), (1025,), (1024,), (2, 1023), (5000, 3), (17,)]
    dtypes = [jnp.float32, jnp.bfloat16, jnp.float16, jnp.float32, jnp.float32, jnp.bfloat16, jnp.float32]
    leaves = [jnp.asarray(rng.standard_normal(s).astype(np.float32)).astype(d) for s, d in zip(shapes, dtypes)]
    leaves[1] = leaves[1].at[7].set(jnp.nan).at[70000].set(-jnp.inf)
    leaves[4] = leaves[4].at[1, 1022].set(jnp.inf)
    for scale in (None, 0.25):
        whole, parts_whole = moments_reference_jnp_tree(leaves, scale, small_max=16, row=0)
        for row in (16, 1000, 1024, 4096):
            got, parts = moments_reference_jnp_tree(leaves, scale, small_max=16, row=row)
            np.testing.assert_allclose(np.asarray(got), np.asarray(whole), rtol=3e-6, atol=1e-4)
            assert np.asarray(got)[:, 2].tolist() == [0, 2, 0, 0, 1, 0, 0]
            if scale is not None:
                assert all(u.dtype == w.dtype and u.shape == w.shape for u, w in zip(parts, parts_whole))
    jitted = jax.jit(lambda ls: moments_reference_jnp_tree(ls, 0.5, row=1024)[0])(leaves)
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(moments_reference_jnp_tree(leaves, 0.5, row=0)[0]),
                               rtol=3e-6, atol=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_torch_and_jnp_references_agree(dtype):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    ts = make([1, 7, 1023, 0, 4097], getattr(torch, dtype), seed=7)
    ts[2][5] = float("nan")
    rt = moments_reference_torch([t.clone() for t in ts], 0.5)
    flat = jnp.concatenate([jnp.asarray(t.float().numpy()).astype(getattr(jnp, dtype)) for t in ts])
    off = np.concatenate([[0], np.cumsum([t.numel() for t in ts])])
    rj, un = moments_reference_jnp(flat, off, 0.5)
    np.testing.assert_allclose(np.asarray(rj), rt.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(un.astype(jnp.float32)),
                                  np.concatenate([t.float().numpy().ravel() * 0.5 for t in ts]))


def test_errors():
    jax = pytest.importorskip("jax")
    with pytest.raises(TypeError, match="mixed frameworks"):
        grad_moments([torch.zeros(3), jax.numpy.zeros(3)])
    with pytest.raises(TypeError, match="tensors\\[1\\]"):
        grad_moments([torch.zeros(3), torch.zeros(3, dtype=torch.int32)])
    with pytest.raises(TypeError, match="torch.Tensor or a jax.Array"):
        grad_moments([np.zeros(3)])
    with pytest.raises(ValueError, match="empty"):
        grad_moments([])
    with pytest.raises(ValueError, match="inv_scale"):
        grad_moments([torch.zeros(3)], inv_scale=-1.0)
    with pytest.raises(ValueError, match="inv_scale"):
        grad_moments([torch.zeros(3)], inv_scale=torch.ones(2))
    with pytest.raises(ValueError, match="out"):
        grad_moments([torch.zeros(3)], out=torch.zeros(2, 3))
    with pytest.raises(ValueError, match="offsets"):
        grad_moments_flat(torch.zeros(5), [0, 3, 2, 5])
    with pytest.raises(ValueError, match="offsets"):
        grad_moments_flat(torch.zeros(5), [0, 3])
    with pytest.raises(ValueError, match=r"impl='cuda': allowed values for torch tensors are \('auto', 'triton', 'reference'\)"):
        grad_moments([torch.zeros(3)], impl="cuda")
    with pytest.raises(ValueError, match="dense"):
        grad_moments([torch.zeros(4, 4)[:, ::2]], impl="triton")


@pytest.mark.parametrize("chunk,unit", [(64, 64), (48, 16), (4096, 1024)])
def test_segment_rows_cover_segments_exactly_once(chunk, unit):
    from triaccel.kernels._dispatch import ALIGN, segment_rows

    rng = np.random.default_rng(8)
    sizes = np.concatenate([rng.integers(0, 300, size=40), [0, 1, 15, 16, 17, 10000]])
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]) + 5
    seg, start, length, nrows = segment_rows(sizes, starts, chunk, unit)
    for s, n in enumerate(sizes):
        rows = np.flatnonzero(seg == s)
        assert rows.size == nrows[rows[0]] >= 1  # every segment, empty ones too, has its rows
        cover = np.zeros(n, dtype=int)
        for k, r in enumerate(rows):
            lo = start[r] - starts[s]
            cover[lo:lo + length[r]] += 1
            if k > 0:  # later rows start aligned, hold whole steps but for the last
                assert start[r] % ALIGN == 0 and length[r] > 0
                if k < rows.size - 1:
                    assert length[r] % unit == 0
            if n > 0:
                assert length[r] > 0
            assert length[r] <= max(chunk, unit) + ALIGN
        assert np.all(cover == 1)
    assert nrows.max() > 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_misaligned_views_full_and_masked_chunks(dtype):
    # views at odd element offsets of one buffer: unaligned heads, aligned full chunks, tails;
    # reference tensors sit after some of the others (negative relative offsets)
    buf = (torch.randn(30000, generator=torch.Generator().manual_seed(9)) * 2).to(dtype)
    ts = [buf[20001:29000], buf[3:9000], buf[9001:9002], buf[9005:20000]]
    buf[5000] = float("nan")
    orig = [t.clone() for t in ts]
    m = grad_moments(ts, inv_scale=0.5, block=256, iters=4)
    check(m, orig, 0.5)
    for t, o in zip(ts, orig):
        exp = (o.float() * 0.5).to(dtype)
        assert torch.equal(t.float().nan_to_num(0.0), exp.float().nan_to_num(0.0))
    flat = buf[1:].clone()
    off = [0, 7, 7, 12345, 29999]
    mf = grad_moments_flat(flat, off, block=256, iters=4)
    check(mf, [flat[a:b] for a, b in zip(off[:-1], off[1:])])


def test_bad_launch_config():
    with pytest.raises(ValueError, match="block"):
        grad_moments([torch.zeros(3)], block=100)
    with pytest.raises(ValueError, match="iters"):
        grad_moments([torch.zeros(3)], iters=0)


def test_layout_cache_rechecks_changed_tensors():
    # same address and numel, other shape/strides: the cached table must not be reused blindly
    t = torch.arange(8, dtype=torch.float32)
    m = grad_moments([t[:6].view(2, 3)], **CFG)
    assert float(m.sum[0]) == 15.0
    with pytest.raises(ValueError, match="dense"):
        grad_moments([t.as_strided((3, 2), (3, 1))], **CFG)
    with pytest.raises(TypeError, match="tensors\\[0\\]"):
        grad_moments([t[:6].view(torch.int32)], **CFG)


def _plans():
    import importlib

    return importlib.import_module("triaccel.kernels.grad_moments")._PLANS.data


def test_address_sets_cycle_without_uploads_and_evict_the_oldest(monkeypatch):
    """Gradients re-allocated each step cycle through a few address sets: a set seen before reuses
    its device offsets (no upload); past ADDRESS_SETS the oldest buffer is overwritten, values right."""
    import importlib

    mod = importlib.import_module("triaccel.kernels.grad_moments")
    dispatch = importlib.import_module("triaccel.kernels._dispatch")
    _plans().clear()
    sets = [make([5000, 7, 9000], torch.float32, seed=20 + k) for k in range(mod.ADDRESS_SETS + 1)]
    uploads = []
    real = dispatch.upload
    monkeypatch.setattr(dispatch, "upload", lambda dst, host: (uploads.append(1), real(dst, host))[1])
    for ts in sets[:2]:
        check(grad_moments(ts, **CFG), ts)
    first = len(uploads)
    for _ in range(3):   # ping-pong between two sets seen before: no upload, right values
        for ts in sets[:2]:
            check(grad_moments(ts, **CFG), ts)
    assert len(uploads) == first
    for ts in sets:   # ADDRESS_SETS + 1 distinct sets: the oldest is evicted, values stay right
        check(grad_moments(ts, **CFG), ts)
    (p,) = [v for v in _plans().values() if getattr(v, "bases", None)]
    assert len(p.bases) == mod.ADDRESS_SETS
    check(grad_moments(sets[0], **CFG), sets[0])   # evicted earlier: uploaded again, right values


def test_launch_plan_cache_hit_and_invalidation():
    plans = _plans()
    plans.clear()   # earlier tests may have filled the bounded cache (then a new plan evicts one)
    ts = make([5000, 7, 9000], torch.float32, seed=11)
    m1 = grad_moments(ts, **CFG)
    n0 = len(plans)
    m2 = grad_moments(ts, **CFG)  # hit: no new plan; the accumulator was reset by the first call
    assert len(plans) == n0
    assert torch.equal(m1.sumsq, m2.sumsq) and torch.equal(m1.nonfinite, m2.nonfinite)
    check(m2, ts)
    moved = [t.clone() * 2 for t in ts]  # tensors moved: same plan re-based, right values
    m3 = grad_moments(moved, **CFG)
    assert len(plans) == n0
    check(m3, moved)
    check(grad_moments(ts, **CFG), ts)   # and back to the first addresses
    # a segment moved off its alignment (residue mod 16 elements): rows re-laid, right values
    store = torch.randn(20000, generator=torch.Generator().manual_seed(13))
    odd = [store[3:5003], store[6000:6007], store[8001:17001]]
    m4 = grad_moments(odd, **CFG)
    check(m4, odd)
    assert len(plans) == n0
    check(grad_moments(ts, **CFG), ts)
    # same address, other shape / dtype: a different layout, never the cached plan
    buf = torch.randn(64, generator=torch.Generator().manual_seed(12))
    check(grad_moments([buf[:48]], **CFG), [buf[:48]])
    check(grad_moments([buf[:48].view(6, 8)], **CFG), [buf[:48].view(6, 8)])
    check(grad_moments([buf[:32]], **CFG), [buf[:32]])
    half = buf.view(torch.float16)[:64]
    m = grad_moments([half], **CFG)
    assert int(m.nonfinite[0]) == int((~torch.isfinite(half.float())).sum())
    check(m, [half])


def test_launcher_reuses_compiled_kernel_with_constexprs_last(monkeypatch):
    import triaccel.kernels._dispatch as D

    calls = []

    class Compiled:
        function = object()

        def __getitem__(self, grid):
            return lambda *a: calls.append(("fast", grid, a))

    class Fn:
        def __getitem__(self, grid):
            def launch(*a, **kw):
                calls.append(("jit", grid, a, kw))
                return Compiled()
            return launch

    monkeypatch.setattr(D, "interpreter_enabled", lambda: False)
    la = D.Launcher(Fn(), 7, dict(MODE=1, BLOCK=64, num_warps=4))
    la("spec", "x", "y")
    la("spec", "x2", "y2")
    la("other", "x3", "y3")  # another specialisation: through Triton again
    assert calls[0] == ("jit", (7, 1, 1), ("x", "y"), dict(MODE=1, BLOCK=64, num_warps=4))
    assert calls[1] == ("fast", (7, 1, 1), ("x2", "y2", 1, 64))
    assert calls[2][0] == "jit"


def test_fast_launch_gets_the_pointers_of_the_bound_launch():
    """The prebuilt launcher (GPU only; the interpreter always binds through Triton) is called with
    plain addresses from the plan: they must be those of the tensors the bound launch passes, also
    after the plan was re-based to moved tensors."""
    mod = importlib.import_module("triaccel.kernels.grad_moments")
    mod._PLANS.data.clear()
    ts = make([5000, 7, 9000], torch.float32, seed=21)
    out = torch.empty(3, 3)
    grad_moments(ts, out=out, **CFG)
    (p,) = mod._PLANS.data.values()
    found = torch.zeros(4)[1:2]
    la, laf = p.launcher(0, False, False), p.launcher(0, False, True)
    calls = []

    class Every(dict):
        def get(self, key, default=None):
            return lambda *a: calls.append(a)

    la.runners = laf.runners = Every()
    for group in (ts, [t.clone() for t in ts]):
        for flag, launcher in ((None, la), (found, laf)):
            grad_moments(group, out=out, found_inf=flag, **CFG)
            args = calls[-1]
            ref = group[p.ref_idx[0]].data_ptr()
            tab = p.table.data_ptr()   # the placeholder of absent references (fp16 / bf16, found_inf)
            assert p.ref_idx[1:] == [-1, -1]
            assert args[:11] == (ref, tab, tab, p.table.data_ptr(), p.base.data_ptr(), 1.0,
                                 p.acc.data_ptr(), p.cnt.data_ptr(), tab if flag is None else found.data_ptr(),
                                 out.data_ptr(), p.table.data_ptr())
            assert args[11:] == launcher.tail and launcher.meta["FOUND"] == (flag is not None)
        # the base array holds each tensor's element offset from the reference (its residue in the rows)
        rel = [(t.data_ptr() - ref) // 4 for t in group]
        assert (p.base + torch.from_numpy(p.res)).tolist() == rel


def test_fixed_layout_reads_only_addresses_when_seen_and_checks_new_ones(monkeypatch):
    """FixedMoments: the same values as grad_moments; calls at remembered addresses skip the layout
    key; new addresses, another length or bad input take the full path (every check)."""
    from triaccel.kernels import FixedMoments
    import triaccel.kernels._dispatch as D

    _plans().clear()
    fm = FixedMoments(**CFG)
    a = make([5000, 7, 9000], torch.float32, seed=40)
    b = [t.clone() * 2 for t in a]   # the same layout at other addresses (the next step's gradients)
    keys = []
    real = D.torch_shape_key
    monkeypatch.setattr(D, "torch_shape_key", lambda ts: (keys.append(1), real(ts))[1])
    check(fm(a), a)
    check(fm(b), b)
    assert len(keys) == 2   # two address sets, each validated in full once
    out = torch.full((3, 3), float("nan"))
    for _ in range(3):
        for ts in (a, b):
            res = fm(ts, out=out)
            assert res is out
            want = grad_moments(ts, **CFG)
            check(want, ts)
            torch.testing.assert_close(out, torch.stack(list(want), 1).float())
    assert len(keys) == 2 + 6   # only the grad_moments calls above built keys
    keys.clear()
    scale = torch.tensor([0.5])
    c = [t.clone() for t in a]
    m = fm(c, inv_scale=scale)   # new addresses: validated, unscaled in place
    check(m, a, inv_scale=0.5)
    torch.testing.assert_close(c[2], a[2] * 0.5)
    assert len(keys) == 1
    check(fm(a[:2]), a[:2])   # another length: the full path
    with pytest.raises(ValueError, match="dense"):   # checked at new addresses
        fm([a[0], a[1], torch.zeros(90, 200)[:, ::2]])
    with pytest.raises(TypeError, match="tensors"):
        fm([a[0], 3, a[2]])
    with pytest.raises(ValueError, match="inv_scale"):   # still checked on the short path
        fm(a, inv_scale=-1.0)
    with pytest.raises(ValueError, match="impl="):
        FixedMoments(impl="cuda")
    with pytest.raises(ValueError, match="block="):
        FixedMoments(block=1000)


def test_fixed_layout_reference_and_fp64_paths():
    from triaccel.kernels import FixedMoments

    mixed = make([300, 50], torch.float32, seed=41) + [torch.randn(70, dtype=torch.float64)]
    for impl in ("reference", "auto"):
        fm = FixedMoments(impl=impl, **CFG)
        for _ in range(2):
            check(fm(mixed), mixed)


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_found_inf_set_in_the_same_launch_and_never_cleared(impl):
    """found_inf: 1.0 when any value is non-finite (single- and multi-row segments, FP64 rows, the
    flat entry and FixedMoments' short path), left as it was otherwise."""
    from triaccel.kernels import FixedMoments

    clean = make([5000, 7, 9000], torch.float32, seed=42)
    found = torch.zeros(1)
    grad_moments(clean, found_inf=found, impl=impl, **CFG)
    assert float(found) == 0.0
    for bad_at in (1, 2):   # a one-row segment, then a segment of several rows
        bad = [t.clone() for t in clean]
        bad[bad_at].view(-1)[-1] = float("inf")
        found = torch.zeros(1)
        m = grad_moments(bad, found_inf=found, impl=impl, **CFG)
        assert float(found) == 1.0 and int(m.nonfinite[bad_at]) == 1
    ones = torch.ones(1)
    grad_moments(clean, found_inf=ones, impl=impl, **CFG)   # never cleared by the call
    assert float(ones) == 1.0
    wide = clean + [torch.tensor([1.0, float("nan")], dtype=torch.float64)]
    found = torch.zeros(1)
    grad_moments(wide, found_inf=found, impl=impl, **CFG)
    assert float(found) == 1.0
    flat = torch.cat([t.reshape(-1) for t in clean])
    off = [0, 5000, 5007, 14007]
    found = torch.zeros(1)
    grad_moments_flat(flat, off, found_inf=found, impl=impl, **CFG)
    assert float(found) == 0.0
    flat[6000] = float("nan")
    grad_moments_flat(flat, off, found_inf=found, impl=impl, **CFG)
    assert float(found) == 1.0
    fm = FixedMoments(impl=impl, **CFG)
    bad = [t.clone() for t in clean]
    for _ in range(2):   # the first call binds, the second takes the short path
        found = torch.zeros(1)
        fm(clean, found_inf=found)
        assert float(found) == 0.0
    bad[2].view(-1)[3] = float("-inf")
    fm(bad, found_inf=found)    # new addresses: full path
    fm(bad, found_inf=found)    # short path
    assert float(found) == 1.0
    found = torch.zeros(1)
    fm(bad, found_inf=found)
    assert float(found) == 1.0


def test_found_inf_errors():
    ts = make([10], torch.float32)
    for bad in (torch.zeros(2), torch.zeros(1, dtype=torch.float64), [0.0]):
        with pytest.raises(ValueError, match="found_inf"):
            grad_moments(ts, found_inf=bad, **CFG)
    jnp = pytest.importorskip("jax.numpy")
    with pytest.raises(TypeError, match="found_inf: only supported for torch"):
        grad_moments([jnp.ones(3)], found_inf=torch.zeros(1))


def test_jax_triton_outputs_are_the_kernels_last_pointers():
    """jax-triton passes the inputs, then appends the outputs (out, y): they must be the kernel's
    last runtime parameters (a pointer after them would receive an output's address on the GPU)."""
    import inspect

    import triton.language as tl

    mod = importlib.import_module("triaccel.kernels.grad_moments")
    sig = inspect.signature(getattr(mod._moments_kernel, "fn", mod._moments_kernel))
    names = [n for n, p in sig.parameters.items() if p.annotation not in ("tl.constexpr", tl.constexpr)]
    assert names[-2:] == ["out_ptr", "y_ptr"]
    assert len(names) == 2 + 9   # _jax_flat passes nine inputs


def test_jax_layout_table_is_cached_eagerly_and_made_per_trace():
    """`_dispatch.jax_table`: eager calls share one cached device table (no upload per call); a traced
    call gets an array made inside its own trace, never the cached one (a later trace would close
    over it: jax 0.11 then compiled ahead an executable expecting one argument more)."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from triaccel.kernels import _dispatch as D

    cache, built = D.LRU(4), []

    def build():
        built.append(1)
        return np.arange(6, dtype=np.int32), "extra"

    x = jnp.ones(3)
    first, extra = D.jax_table(cache, "k", build, x)
    again, _ = D.jax_table(cache, "k", build, x)
    assert again is first and extra == "extra" and len(built) == 1
    seen = []

    @jax.jit
    def f(v):
        tab, _ = D.jax_table(cache, "k", build, v)
        seen.append(tab)
        return v.sum() + tab.sum()

    assert float(f(x)) == 3.0 + 15.0 and len(built) == 1
    assert seen and seen[0] is not first
    np.testing.assert_array_equal(np.asarray(first), np.arange(6))


def test_prepare_triton_runtime_reports_no_driver_without_a_gpu():
    """The start-up the demo's --triton-warmup runs on a thread: on a machine without a GPU it finds no
    active driver and says so (False), raising nothing; with one, True."""
    import torch

    from triaccel.kernels._dispatch import prepare_triton_runtime

    assert prepare_triton_runtime() is torch.cuda.is_available()
