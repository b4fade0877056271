"""CIFAR augmentation on the device, batched, for JAX: random crop with zero padding and
horizontal flip on uint8 NHWC batches, then normalisation to float32 NHWC.

Constants come from :mod:`triaccel.data.cifar` (``normalization(dataset)``). Pure functions of
an explicit PRNG ``key`` (same key -> same batch); usable inside ``jax.jit``.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from triaccel.data.cifar import normalization

__all__ = ["random_crop_flip", "normalize", "augment"]

ArrayLike = jax.Array | np.ndarray | Sequence[float]


def _check_batch(x: jax.Array) -> None:
    if x.dtype != jnp.uint8 or x.ndim != 4 or x.shape[-1] != 3:
        raise ValueError(f"images must be a uint8 (N, H, W, 3) array, got {x.dtype} {tuple(x.shape)}")


@partial(jax.jit, static_argnames=("pad", "flip"))
def _crop_flip(images: jax.Array, key: jax.Array, pad: int, flip: bool) -> jax.Array:
    n, h, w, c = images.shape
    k_y, k_x, k_f = jax.random.split(key, 3)
    padded = jnp.pad(images, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    oy = jax.random.randint(k_y, (n,), 0, 2 * pad + 1)
    ox = jax.random.randint(k_x, (n,), 0, 2 * pad + 1)
    crop = jax.vmap(lambda img, y, x: jax.lax.dynamic_slice(img, (y, x, 0), (h, w, c)))(padded, oy, ox)
    if flip:
        mirrored = jax.random.bernoulli(k_f, 0.5, (n,))
        crop = jnp.where(mirrored[:, None, None, None], crop[:, :, ::-1, :], crop)
    return crop


def random_crop_flip(images: jax.Array, key: jax.Array, pad: int = 4, flip: bool = True) -> jax.Array:
    """Random ``H x W`` crops of the zero-padded (by ``pad`` pixels each side) images, each
    mirrored left-right with probability 1/2 (when ``flip``). uint8 (N, H, W, 3) -> same shape."""
    images = jnp.asarray(images)
    _check_batch(images)
    if key is None:
        raise ValueError("key must be a JAX PRNG key, got None")
    if isinstance(pad, bool) or not isinstance(pad, int) or pad < 0:
        raise ValueError(f"pad must be an integer >= 0, got {pad!r}")
    return _crop_flip(images, key, pad, bool(flip))


def _constant(name: str, v: ArrayLike) -> jax.Array:
    if not isinstance(v, jax.Array):  # host values: check them (device/traced ones: shape only)
        a = np.asarray(v, np.float64)
        if a.shape != (3,) or not np.all(np.isfinite(a)) or (name == "std" and not np.all(a > 0)):
            raise ValueError(f"{name} must be 3 finite values{' > 0' if name == 'std' else ''} (R, G, B), got {v!r}")
    t = jnp.asarray(v, jnp.float32)
    if t.shape != (3,):
        raise ValueError(f"{name} must have shape (3,), got {tuple(t.shape)}")
    return t


def normalize(images: jax.Array, mean: ArrayLike, std: ArrayLike) -> jax.Array:
    """uint8 (N, H, W, 3) -> float32 (N, H, W, 3): ``(x / 255 - mean) / std``, with ``mean``/``std``
    of shape (3,) in [0, 1] units (``triaccel.data.normalization(dataset)``)."""
    images = jnp.asarray(images)
    _check_batch(images)
    return (images.astype(jnp.float32) / 255.0 - _constant("mean", mean)) / _constant("std", std)


def augment(images: jax.Array, key: jax.Array | None, dataset: str = "cifar10", train: bool = True) -> jax.Array:
    """Training (``train=True``, needs ``key``): crop (pad 4) + flip, then normalise with
    ``dataset``'s constants; eval: normalise only. uint8 (N, H, W, 3) -> float32 (N, H, W, 3)."""
    mean, std = normalization(dataset)
    if train:
        images = random_crop_flip(images, key)
    return normalize(images, mean, std)
