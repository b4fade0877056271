"""Datasets (NumPy and the standard library only): CIFAR-10/100 readers with an on-disk cache, and
the official archives downloaded on first use."""

from triaccel.data.cifar import (
    ARCHIVES,
    CIFAR_MEAN,
    CIFAR_STD,
    DATASETS,
    IMAGE_SHAPE,
    NUM_CLASSES,
    default_cache_dir,
    has_python_layout,
    load_cifar,
    normalization,
)
from triaccel.data.download import DownloadError, fetch_dataset, resolve_data

__all__ = [
    "ARCHIVES",
    "CIFAR_MEAN",
    "CIFAR_STD",
    "DATASETS",
    "DownloadError",
    "IMAGE_SHAPE",
    "NUM_CLASSES",
    "default_cache_dir",
    "fetch_dataset",
    "has_python_layout",
    "load_cifar",
    "normalization",
    "resolve_data",
]
