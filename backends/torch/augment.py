"""CIFAR augmentation on the device, batched, for torch: random crop with zero padding and
horizontal flip on uint8 NHWC batches, then normalisation to float32 NCHW.

Constants come from :mod:`triaccel.data.cifar` (``normalization(dataset)``). Randomness comes
only from the ``generator`` passed in (it must live on the batch's device, e.g.
``torch.Generator(device="cuda")``), so a seeded generator gives the same batches.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from triaccel.data.cifar import normalization

__all__ = ["random_crop_flip", "keyed_crop_flip", "normalize", "augment"]

ArrayLike = torch.Tensor | np.ndarray | Sequence[float]


def _check_batch(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype != torch.uint8 or x.ndim != 4 or x.shape[-1] != 3:
        got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"images must be a uint8 (N, H, W, 3) tensor, got {got}")


def _check_pad(pad: int) -> None:
    if isinstance(pad, bool) or not isinstance(pad, int) or pad < 0:
        raise ValueError(f"pad must be an integer >= 0, got {pad!r}")


def _crop_flip(images: torch.Tensor, oy: torch.Tensor, ox: torch.Tensor, mirrored: torch.Tensor | None,
               pad: int) -> torch.Tensor:
    """Crops at offsets (oy, ox) (N,) of the zero-padded images, mirrored where `mirrored` (N,)."""
    n, h, w, _ = images.shape
    dev = images.device
    padded = torch.nn.functional.pad(images, (0, 0, pad, pad, pad, pad))  # (N, H+2p, W+2p, 3)
    cols = torch.arange(w, device=dev).expand(n, w)
    if mirrored is not None:
        cols = torch.where(mirrored[:, None], (w - 1) - cols, cols)
    rows = oy[:, None] + torch.arange(h, device=dev)  # (N, H)
    cols = ox[:, None] + cols  # (N, W)
    idx = torch.arange(n, device=dev)[:, None, None]
    return padded[idx, rows[:, :, None], cols[:, None, :]]


def random_crop_flip(
    images: torch.Tensor, generator: torch.Generator | None = None, pad: int = 4, flip: bool = True
) -> torch.Tensor:
    """Random ``H x W`` crops of the zero-padded (by ``pad`` pixels each side) images, each
    mirrored left-right with probability 1/2 (when ``flip``). uint8 (N, H, W, 3) -> same shape,
    on the same device; one gather for the whole batch, no host sync."""
    _check_batch(images)
    _check_pad(pad)
    n, dev = images.shape[0], images.device
    oy = torch.randint(0, 2 * pad + 1, (n,), generator=generator, device=dev)
    ox = torch.randint(0, 2 * pad + 1, (n,), generator=generator, device=dev)
    mirrored = torch.randint(0, 2, (n,), generator=generator, device=dev).bool() if flip else None
    return _crop_flip(images, oy, ox, mirrored, pad)


_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32) (int64), without int64 overflow."""
    return ((x * (c & 0xFFFF)) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (lowbias32, C. Wellons) of int64 values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def keyed_crop_flip(images: torch.Tensor, keys: torch.Tensor, pad: int = 4, flip: bool = True) -> torch.Tensor:
    """`random_crop_flip` whose crop offsets and flip come from a hash of each image's key
    (int64 (N,), on the images' device), not from a generator: an image gets the same crop
    whatever else is in its batch, so a key of (seed, epoch, sample index) gives every sample the
    same augmentation on any number of data-parallel ranks, in any micro-batching, on a replay."""
    _check_batch(images)
    _check_pad(pad)
    if not isinstance(keys, torch.Tensor) or keys.dtype != torch.int64 or keys.shape != images.shape[:1]:
        got = f"{keys.dtype} {tuple(keys.shape)}" if isinstance(keys, torch.Tensor) else type(keys).__name__
        raise ValueError(f"keys must be an int64 tensor of shape ({images.shape[0]},), got {got}")
    k = _hash32((keys & _M32) ^ _hash32((keys >> 32) & _M32))
    h1 = _hash32(k ^ 0x9E3779B9)
    h2 = _hash32(h1 ^ 0x85EBCA6B)
    n_off = 2 * pad + 1
    mirrored = ((_hash32(h2 ^ 0xC2B2AE35) & 1) == 1) if flip else None
    return _crop_flip(images, h1 % n_off, h2 % n_off, mirrored, pad)


def _constant(name: str, v: ArrayLike, device: torch.device) -> torch.Tensor:
    if not isinstance(v, torch.Tensor):
        a = np.asarray(v, np.float64)
        if a.shape != (3,) or not np.all(np.isfinite(a)) or (name == "std" and not np.all(a > 0)):
            raise ValueError(f"{name} must be 3 finite values{' > 0' if name == 'std' else ''} (R, G, B), got {v!r}")
    t = torch.as_tensor(v, dtype=torch.float32, device=device)
    if t.shape != (3,):  # device tensors: shape only (checking values would sync with the host)
        raise ValueError(f"{name} must have shape (3,), got {tuple(t.shape)}")
    return t


def normalize(
    images: torch.Tensor, mean: ArrayLike, std: ArrayLike, channels_last: bool = False
) -> torch.Tensor:
    """uint8 (N, H, W, 3) -> float32 (N, 3, H, W): ``(x / 255 - mean) / std``, with ``mean``/``std``
    of shape (3,) in [0, 1] units (``triaccel.data.normalization(dataset)``; pass device tensors
    to avoid a copy per call). ``channels_last`` returns the channels_last memory format."""
    _check_batch(images)
    m = _constant("mean", mean, images.device)
    s = _constant("std", std, images.device)
    x = (images.to(torch.float32) / 255.0 - m) / s  # NHWC: broadcast over the last axis
    x = x.permute(0, 3, 1, 2)  # an NCHW view of NHWC memory, i.e. channels_last already
    return x.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


def augment(
    images: torch.Tensor,
    generator: torch.Generator | None = None,
    dataset: str = "cifar10",
    train: bool = True,
    channels_last: bool = False,
) -> torch.Tensor:
    """Training (``train=True``): crop (pad 4) + flip, then normalise with ``dataset``'s constants;
    eval: normalise only. uint8 (N, H, W, 3) -> float32 (N, 3, H, W)."""
    mean, std = normalization(dataset)
    if train:
        images = random_crop_flip(images, generator)
    return normalize(images, mean, std, channels_last)
