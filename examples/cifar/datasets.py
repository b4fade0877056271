"""The example's data: CIFAR arrays from `triaccel.data.cifar`, optionally subset (CPU runs)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from triaccel.data import NUM_CLASSES, load_cifar, normalization, resolve_data


@dataclass(frozen=True)
class CifarArrays:
    """uint8 images (N, 32, 32, 3), int64 labels (N,), and the dataset's per-channel mean/std."""

    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    num_classes: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]


def _subset(x: np.ndarray, y: np.ndarray, n: int | None, seed: int) -> tuple[np.ndarray, np.ndarray]:
    if n is None or n >= len(x):
        return x, y
    idx = np.sort(np.random.default_rng(seed).choice(len(x), n, replace=False))
    return x[idx], y[idx]


def load(dataset: str, root: str | Path | None, train_subset: int | None, test_subset: int | None,
         seed: int) -> CifarArrays:
    """Both splits (a seeded random subset of each when asked). root: the data folder; empty or None:
    $TRIACCEL_DATA, else the user cache, downloading the official archive there on first use
    (`triaccel.data.resolve_data`)."""
    root = resolve_data(dataset, root)
    trx, try_ = _subset(*load_cifar(dataset, root, "train"), train_subset, seed)
    tex, tey = _subset(*load_cifar(dataset, root, "test"), test_subset, seed + 1)
    mean, std = normalization(dataset)
    return CifarArrays(trx, try_, tex, tey, NUM_CLASSES[dataset], tuple(map(float, mean)), tuple(map(float, std)))
