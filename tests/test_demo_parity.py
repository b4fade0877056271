"""Demo-loop parity pieces between the torch and JAX CIFAR loops (CPU, fast).

1. The JAX ElasticLoader pads a short micro-batch with cyclic repeats of its own samples, so a
   train-mode BatchNorm model gives the real rows the same outputs, and the mask-weighted loss the
   same gradient, as the unpadded batch (what torch's loop computes on its short last step).
   Padding with copies of one sample did not (an epoch's last step at bucket 384 held 80 real
   samples and 304 copies of one image).
2. Both backends' augmentation: zero padding, crop offsets uniform over 0..2*pad, flip p = 1/2,
   drawn per sample.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx

from triaccel.backends.jax import augment as jaug
from triaccel.backends.jax.data import ElasticLoader
from triaccel.backends.jax.models import BatchNorm2d, batch_mask
from triaccel.backends.torch import augment as taug


class _ConvBN(nnx.Module):
    def __init__(self) -> None:
        rngs = nnx.Rngs(0)
        self.conv = nnx.Conv(3, 4, kernel_size=(3, 3), padding=((1, 1), (1, 1)), rngs=rngs)
        self.bn = BatchNorm2d(4, rngs=rngs)
        self.fc = nnx.Linear(4, 5, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc(jax.nn.relu(self.bn(self.conv(x))).mean(axis=(1, 2)))


def _loss_grad(model: _ConvBN, x: jax.Array, y: jax.Array, mask: jax.Array):
    def lf(m: _ConvBN) -> jax.Array:
        ce = optax.softmax_cross_entropy_with_integer_labels(m(x), y)
        return (ce * mask).sum() / mask.sum()

    return nnx.value_and_grad(lf)(model)


def test_loader_tail_padding_keeps_batchnorm_statistics_of_real_samples():
    rng = np.random.default_rng(0)
    n_total, bucket = 20, 16
    x = (rng.normal(size=(n_total, 6, 6, 3)) * np.arange(1, n_total + 1)[:, None, None, None]).astype(np.float32)
    y = rng.integers(0, 5, n_total).astype(np.int32)
    loader = ElasticLoader((x, y), batch_size=bucket, buckets=(bucket,), shuffle=False)
    (_, _), ((xb, yb), mask) = list(loader)          # 16 real, then 4 real padded to 16
    ids = np.arange(16, 20)
    assert xb.shape == (bucket, 6, 6, 3) and mask.tolist() == [1.0] * 4 + [0.0] * 12
    # padded rows repeat the real ones cyclically (16 = 4 x 4): no single sample dominates
    np.testing.assert_array_equal(np.asarray(xb), x[np.resize(ids, bucket)])

    model = _ConvBN()
    ref_model = nnx.clone(model)
    loss, grads = _loss_grad(model, xb, yb, mask)
    ref_loss, ref_grads = _loss_grad(ref_model, jnp.asarray(x[ids]), jnp.asarray(y[ids]), jnp.ones(4))
    assert abs(float(loss) - float(ref_loss)) < 1e-5 * max(1.0, abs(float(ref_loss)))
    for g, r in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-6)
    # BatchNorm's running mean moved by the real samples' batch mean (same as unpadded)
    np.testing.assert_allclose(np.asarray(model.bn.mean[...]), np.asarray(ref_model.bn.mean[...]), rtol=1e-5, atol=1e-7)

    # The old padding (copies of the first real sample) gives a different gradient: the check bites.
    bad = jnp.asarray(x[np.concatenate([ids, np.full(12, ids[0])])])
    bad_y = jnp.asarray(y[np.concatenate([ids, np.full(12, ids[0])])])
    _, bad_grads = _loss_grad(nnx.clone(ref_model), bad, bad_y, mask)
    diff = max(float(jnp.abs(g - r).max()) for g, r in zip(jax.tree_util.tree_leaves(bad_grads),
                                                            jax.tree_util.tree_leaves(ref_grads)))
    assert diff > 1e-3


def test_masked_batchnorm_statistics_make_a_padded_step_the_unpadded_one():
    """The demo's padding: copies augmented apart (here: other images) and repeated unequally (5 real
    rows padded to 16). With `batch_mask` the step's loss, gradients and running statistics are the
    unpadded step's; without it they are not."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(5, 6, 6, 3)).astype(np.float32) * 3.0
    y = rng.integers(0, 5, 5).astype(np.int32)
    pad = rng.normal(size=(11, 6, 6, 3)).astype(np.float32)   # what a copy's other crop and flip look like
    xp, yp = jnp.asarray(np.concatenate([x, pad])), jnp.asarray(np.concatenate([y, y, y, y[:1]]))
    mask = jnp.asarray([1.0] * 5 + [0.0] * 11)
    model = _ConvBN()
    ref, plain = nnx.clone(model), nnx.clone(model)
    with batch_mask(mask):
        loss, grads = _loss_grad(model, xp, yp, mask)
    ref_loss, ref_grads = _loss_grad(ref, jnp.asarray(x), jnp.asarray(y), jnp.ones(5))
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)
    for g, r in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-6)
    for name in ("mean", "var", "num_batches_tracked"):   # running statistics (var unbiased, over 5 x 36)
        np.testing.assert_allclose(np.asarray(getattr(model.bn, name)[...]), np.asarray(getattr(ref.bn, name)[...]),
                                   rtol=1e-5, atol=1e-7)
    _, unmasked = _loss_grad(plain, xp, yp, mask)
    assert max(float(jnp.abs(g - r).max()) for g, r in zip(jax.tree_util.tree_leaves(unmasked),
                                                             jax.tree_util.tree_leaves(ref_grads))) > 1e-3
    with pytest.raises(ValueError, match=r"mask must have shape \(16,\)"):
        model.bn(jnp.zeros((16, 6, 6, 4)), mask=jnp.ones((8,)))


def _position_image(n: int, h: int = 8, w: int = 8) -> np.ndarray:
    """uint8 (n, h, w, 3): channel 0 = row + 1, channel 1 = column + 1 (0 marks zero padding)."""
    img = np.zeros((n, h, w, 3), np.uint8)
    img[..., 0] = np.arange(1, h + 1)[None, :, None]
    img[..., 1] = np.arange(1, w + 1)[None, None, :]
    return img


def _offsets(out: np.ndarray, pad: int, w: int) -> np.ndarray:
    """Per sample (row offset, col offset, flipped) in padded coordinates, read back from a crop of
    `_position_image`: output pixel (i, j) holds source row oy + i - pad and column ox + j' - pad
    (j' = j, or w - 1 - j when mirrored)."""
    res = []
    for o in out:
        i, j = np.argwhere((o[..., 0] > 0) & (o[..., 1] > 0))[0]     # any pixel from the image
        oy = int(o[i, j, 0]) - 1 + pad - int(i)
        row = o[i, :, 1]
        valid = np.nonzero(row)[0]
        flipped = bool(row[valid[-1]] < row[valid[0]])
        jj = (w - 1 - int(j)) if flipped else int(j)
        ox = int(o[i, j, 1]) - 1 + pad - jj
        res.append((oy, ox, int(flipped)))
    return np.array(res)


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_augmentation_semantics_match(backend: str):
    n, pad, h, w = 4000, 4, 8, 8
    x = _position_image(n, h, w)
    if backend == "torch":
        out = taug.random_crop_flip(torch.from_numpy(x), torch.Generator().manual_seed(0), pad=pad).numpy()
    else:
        out = np.asarray(jaug.random_crop_flip(jnp.asarray(x), jax.random.key(0), pad=pad))
    assert out.shape == x.shape and out.dtype == np.uint8
    assert out[..., 2].max() == 0                        # channel 2 stays zero: zero padding, no wrap
    off = _offsets(out, pad, w)
    counts_y = np.bincount(off[:, 0], minlength=2 * pad + 1)
    counts_x = np.bincount(off[:, 1], minlength=2 * pad + 1)
    assert len(counts_y) == len(counts_x) == 2 * pad + 1  # offsets in [0, 2*pad]
    expect = n / (2 * pad + 1)
    # uniform offsets: each of the 9 values within 5 sigma of n/9
    sigma = np.sqrt(n * (1 / 9) * (8 / 9))
    assert np.all(np.abs(counts_y - expect) < 5 * sigma) and np.all(np.abs(counts_x - expect) < 5 * sigma)
    assert abs(off[:, 2].mean() - 0.5) < 5 * np.sqrt(0.25 / n)
    # per-sample randomness: offsets and flips vary inside one batch, independently
    assert abs(np.corrcoef(off[:, 0], off[:, 1])[0, 1]) < 0.1
    # zero padding: a sample shifted by pad-dy rows has that many all-zero rows
    for (oy, ox, _), o in zip(off[:50], out[:50]):
        assert (o[..., 0] == 0).all(axis=1).sum() == abs(int(oy) - pad)
        assert (o[..., 1] == 0).all(axis=0).sum() == abs(int(ox) - pad)
