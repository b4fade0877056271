"""CIFAR-10 / CIFAR-100 readers (NumPy only; Pillow imported lazily for image files).

Two on-disk layouts are read:

* the official "python version":
  ``<root>/cifar-10-batches-py/{data_batch_1..5,test_batch}`` (keys ``b'data'``, ``b'labels'``) or
  ``<root>/cifar-100-python/{train,test}`` (keys ``b'data'``, ``b'fine_labels'``); ``root`` may also
  be that directory itself;
* an image-folder tree ``<root>/{train,test}/<class>/*.jpg|*.jpeg|*.png`` (classes sorted by name;
  label = index of the class directory; files sorted by name within a class).

Images are returned as uint8 ``(N, 32, 32, 3)`` (NHWC, RGB) and labels as int64 ``(N,)``.
Image folders are decoded once (in a process pool) and cached as ``.npz`` under ``cache_dir``
(default ``$TRIACCEL_CACHE`` or ``~/.cache/triaccel``), keyed by the root path and the name, size
and mtime of every file, so that any change to the tree invalidates the cache.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import tempfile
import warnings
import zipfile
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

__all__ = [
    "DATASETS",
    "NUM_CLASSES",
    "CIFAR_MEAN",
    "CIFAR_STD",
    "IMAGE_SHAPE",
    "ARCHIVES",
    "normalization",
    "default_cache_dir",
    "has_python_layout",
    "load_cifar",
]

DATASETS: tuple[str, ...] = ("cifar10", "cifar100")
SPLITS: tuple[str, ...] = ("train", "test")
NUM_CLASSES: dict[str, int] = {"cifar10": 10, "cifar100": 100}
IMAGE_SHAPE: tuple[int, int, int] = (32, 32, 3)

#: Per-channel (R, G, B) mean and standard deviation of the training set, in [0, 1] pixel units.
CIFAR_MEAN: dict[str, tuple[float, float, float]] = {
    "cifar10": (0.4914, 0.4822, 0.4465),
    "cifar100": (0.5071, 0.4865, 0.4409),
}
CIFAR_STD: dict[str, tuple[float, float, float]] = {
    "cifar10": (0.2470, 0.2435, 0.2616),
    "cifar100": (0.2673, 0.2564, 0.2762),
}

#: The official "python version" archive of each dataset: (URL, MD5 of the .tar.gz).
ARCHIVES: dict[str, tuple[str, str]] = {
    "cifar10": ("https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz", "c58f30108f718f92721af3b95e74349a"),
    "cifar100": ("https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz", "eb9058c3a382ffc7106e4002c42a8d85"),
}
_PY_DIRS = {"cifar10": "cifar-10-batches-py", "cifar100": "cifar-100-python"}
_PY_FILES = {
    ("cifar10", "train"): tuple(f"data_batch_{i}" for i in range(1, 6)),
    ("cifar10", "test"): ("test_batch",),
    ("cifar100", "train"): ("train",),
    ("cifar100", "test"): ("test",),
}
_LABEL_KEY = {"cifar10": b"labels", "cifar100": b"fine_labels"}
_IMAGE_EXTS = (".jpg", ".jpeg", ".png")
_CACHE_VERSION = "1"


def _check_name(name: str) -> None:
    if name not in DATASETS:
        raise ValueError(f"name must be one of {DATASETS}, got {name!r}")


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


def normalization(name: str) -> tuple[np.ndarray, np.ndarray]:
    """(mean, std) of ``name``'s training set: float32 arrays of shape (3,), RGB, [0, 1] units.
    Normalise as ``(pixel / 255 - mean) / std``."""
    _check_name(name)
    return np.asarray(CIFAR_MEAN[name], np.float32), np.asarray(CIFAR_STD[name], np.float32)


def default_cache_dir() -> Path:
    """``$TRIACCEL_CACHE`` if set (and non-empty), else ``~/.cache/triaccel``."""
    env = os.environ.get("TRIACCEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "triaccel"


def _how_to_get(name: str, root: Path, split: str) -> str:
    files = ", ".join(_PY_FILES[(name, split)])
    return (
        f"Expected {name} {split!r} data under {root} in one of two layouts:\n"
        f"  (a) the official python version: {root / _PY_DIRS[name]}/{{{files}}}\n"
        f"      (download {ARCHIVES[name][0]} and extract it into {root});\n"
        f"  (b) an image folder: {root / split}/<class>/*.jpg|*.jpeg|*.png with "
        f"{NUM_CLASSES[name]} class directories."
    )


# --------------------------------------------------------------------------------------------
# Official python format


class _SafeUnpickler(pickle.Unpickler):
    """Unpickles plain containers and NumPy arrays only: CIFAR batches need nothing else, and
    arbitrary pickles can run code."""

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy.core.numeric", "_frombuffer"),
        ("numpy._core.numeric", "_frombuffer"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),
    }

    def find_class(self, module: str, name: str) -> object:
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a CIFAR batch file")


def _read_batch(path: Path, name: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        with open(path, "rb") as f:
            d = _SafeUnpickler(f, encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError) as e:
        raise ValueError(f"{path}: not a readable CIFAR python batch ({e})") from e
    if not isinstance(d, dict):
        raise ValueError(f"{path}: expected a pickled dict, got {type(d).__name__}")
    label_key = _LABEL_KEY[name]
    for key in (b"data", label_key):
        if key not in d:
            raise ValueError(f"{path}: missing key {key!r} (keys: {sorted(map(repr, d))})")
    data = np.asarray(d[b"data"])
    labels = np.asarray(d[label_key])
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise ValueError(f"{path}: b'data' must be uint8 of shape (N, 3072), got {data.dtype} {data.shape}")
    if labels.ndim != 1 or labels.shape[0] != data.shape[0] or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(
            f"{path}: {label_key!r} must hold {data.shape[0]} integer labels, got {labels.dtype} {labels.shape}"
        )
    k = NUM_CLASSES[name]
    if labels.size and (labels.min() < 0 or labels.max() >= k):
        raise ValueError(f"{path}: labels must lie in [0, {k}), got range [{labels.min()}, {labels.max()}]")
    # Rows are 1024 R, 1024 G, 1024 B values of a 32x32 image: -> NHWC.
    images = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return np.ascontiguousarray(images), labels.astype(np.int64)


def _python_dir(name: str, root: Path, split: str) -> Path | None:
    for d in (root / _PY_DIRS[name], root):
        if all((d / f).is_file() for f in _PY_FILES[(name, split)]):
            return d
    return None


def has_python_layout(name: str, root: str | os.PathLike[str]) -> bool:
    """True when ``root`` (or ``root/<official folder>``) holds both splits in the official python layout."""
    _check_name(name)
    return all(_python_dir(name, Path(root), split) is not None for split in SPLITS)


def _load_python(name: str, d: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    parts = [_read_batch(d / f, name) for f in _PY_FILES[(name, split)]]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


# --------------------------------------------------------------------------------------------
# Image folder


def _list_folder(name: str, split_dir: Path) -> tuple[list[str], list[str], np.ndarray]:
    """Class names, image paths (strings: 60,000 Path objects cost seconds to build and hash) and
    labels of an image-folder split. Entries that are not images
    (other extensions, folders or broken links inside class folders, files beside them) are
    skipped and named in one warning, so a polluted or partly copied tree does not load silently."""
    entries = list(os.scandir(split_dir))
    classes = sorted(e.name for e in entries if e.is_dir())
    if len(classes) != NUM_CLASSES[name]:
        raise ValueError(
            f"{split_dir}: found {len(classes)} class directories, {name} needs {NUM_CLASSES[name]}: {classes}")
    skipped = sorted(e.name for e in entries if not e.is_dir())
    files: list[str] = []
    labels: list[int] = []
    for i, c in enumerate(classes):
        found = []
        for e in os.scandir(split_dir / c):
            if e.is_file() and e.name.lower().endswith(_IMAGE_EXTS):
                found.append(e.name)
            else:
                skipped.append(f"{c}/{e.name}")
        if not found:
            raise ValueError(f"{split_dir / c}: no image files (*.jpg, *.jpeg, *.png)")
        found.sort()
        cdir = os.path.join(split_dir, c)
        files += [os.path.join(cdir, f) for f in found]
        labels += [i] * len(found)
    if skipped:
        shown = ", ".join(skipped[:20]) + (", ..." if len(skipped) > 20 else "")
        warnings.warn(f"{split_dir}: skipped {len(skipped)} entries that are not image files: {shown}",
                      stacklevel=3)
    return classes, files, np.asarray(labels, np.int64)


def _decode_chunk(paths: Sequence[str]) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError  # lazy: only image folders need Pillow

    out = np.empty((len(paths), *IMAGE_SHAPE), np.uint8)
    for i, p in enumerate(paths):
        try:
            with Image.open(p) as im:
                a = np.asarray(im.convert("RGB"))
        except (UnidentifiedImageError, OSError) as e:
            raise ValueError(f"{p}: cannot decode image ({e})") from e
        if a.shape != IMAGE_SHAPE:
            raise ValueError(f"{p}: image is {a.shape[1]}x{a.shape[0]}, CIFAR images must be 32x32")
        out[i] = a
    return out


def _decode_all(files: Sequence[str], workers: int) -> np.ndarray:
    paths = list(files)
    if workers <= 1 or len(paths) < 2000:
        return _decode_chunk(paths)
    chunk = max(500, len(paths) // (4 * workers))
    chunks = [paths[i : i + chunk] for i in range(0, len(paths), chunk)]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return np.concatenate(list(pool.map(_decode_chunk, chunks)))


def _cache_key(name: str, split_dir: Path, files: Sequence[str], labels: np.ndarray) -> str:
    """Hash of the split's file names (relative to split_dir), sizes, mtimes and labels."""
    h = hashlib.sha256()
    h.update(f"v{_CACHE_VERSION}|{name}|{split_dir.resolve()}|".encode())
    cut = len(os.path.join(split_dir, ""))   # files are split_dir/<class>/<name> (_list_folder)
    for f in files:
        st = os.stat(f)
        h.update(f"{f[cut:]}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    h.update(labels.tobytes())
    return h.hexdigest()[:24]


def _read_cache(path: Path, n: int) -> tuple[np.ndarray, np.ndarray] | None:
    try:
        with np.load(path, allow_pickle=False) as z:
            images, labels = z["images"], z["labels"]
    except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile) as e:   # truncated / not a zip
        warnings.warn(f"ignoring unreadable cache {path} ({e}); decoding again", stacklevel=3)
        return None
    if images.shape != (n, *IMAGE_SHAPE) or images.dtype != np.uint8 or labels.shape != (n,):
        warnings.warn(f"ignoring cache {path} with unexpected shapes; decoding again", stacklevel=3)
        return None
    return images, labels.astype(np.int64)


def _write_cache(path: Path, images: np.ndarray, labels: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write beside the target and rename: a crash or a concurrent reader never sees half a file.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, images=images, labels=labels)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _load_folder(
    name: str, split_dir: Path, cache: bool, cache_dir: Path | None, workers: int
) -> tuple[np.ndarray, np.ndarray]:
    _, files, labels = _list_folder(name, split_dir)
    cache_path = None
    if cache:
        key = _cache_key(name, split_dir, files, labels)
        cache_path = (cache_dir or default_cache_dir()) / f"{name}-{split_dir.name}-{key}.npz"
        if cache_path.is_file():
            hit = _read_cache(cache_path, len(files))
            if hit is not None:
                return hit
    images = _decode_all(files, workers)
    if cache_path is not None:
        _write_cache(cache_path, images, labels)
    return images, labels


# --------------------------------------------------------------------------------------------


def load_cifar(
    name: str,
    root: str | os.PathLike[str],
    split: str,
    *,
    cache: bool = True,
    cache_dir: str | os.PathLike[str] | None = None,
    workers: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Load CIFAR-10/100 ``split`` ("train"|"test") from ``root``.

    Returns ``(images, labels)``: uint8 ``(N, 32, 32, 3)`` RGB and int64 ``(N,)``. The official
    python layout wins when both are present. Image folders are decoded with ``workers`` processes
    (default: the CPU count) and cached (``cache=False`` to skip; ``cache_dir`` overrides
    ``$TRIACCEL_CACHE`` / ``~/.cache/triaccel``). Subsets: slice the returned arrays.

    Raises FileNotFoundError (neither layout found, with where files are expected and where to
    download them) or ValueError (malformed files, wrong class count, non-32x32 images).
    """
    _check_name(name)
    _check_split(split)
    if workers is None:
        workers = os.cpu_count() or 1
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
    root = Path(root).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"CIFAR root {root} is not a directory.\n" + _how_to_get(name, root, split))
    py = _python_dir(name, root, split)
    if py is not None:
        return _load_python(name, py, split)
    py_dir = root / _PY_DIRS[name]
    if py_dir.is_dir():  # the official layout, but incomplete: say which file is missing
        missing = [f for f in _PY_FILES[(name, split)] if not (py_dir / f).is_file()]
        raise FileNotFoundError(f"{py_dir}: missing {missing}.\n" + _how_to_get(name, root, split))
    split_dir = root / split
    if split_dir.is_dir():
        return _load_folder(name, split_dir, cache, Path(cache_dir) if cache_dir is not None else None, workers)
    raise FileNotFoundError(f"No {name} {split!r} data found.\n" + _how_to_get(name, root, split))
