"""Datasets (NumPy only): CIFAR-10/100 readers with an on-disk cache."""

from triaccel.data.cifar import (
    CIFAR_MEAN,
    CIFAR_STD,
    DATASETS,
    IMAGE_SHAPE,
    NUM_CLASSES,
    default_cache_dir,
    load_cifar,
    normalization,
)

__all__ = [
    "CIFAR_MEAN",
    "CIFAR_STD",
    "DATASETS",
    "IMAGE_SHAPE",
    "NUM_CLASSES",
    "default_cache_dir",
    "load_cifar",
    "normalization",
]
