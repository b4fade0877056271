"""Malformed data for the CIFAR readers (`triaccel.data.cifar.load_cifar`), built in tmp_path.

Each malformed input must give either an error that names the offending file (or folder), or a
documented skip that is counted and reported. Cases: corrupt JPEGs (random bytes, empty file,
truncated at every cut point of a sweep, damaged header), truncated official python batch files
(CIFAR-10 and CIFAR-100, a sweep of cut points plus hypothesis-drawn ones), empty class folders,
images of the wrong size (image folder and python batch), stray files and folders in the tree, and
a corrupt decode cache.

Not covered (not detectable by a reader): bytes flipped inside a JPEG's entropy-coded data decode
to a valid but wrong image.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import warnings
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from rel_util import rel_settings

from triaccel.data.cifar import load_cifar

Image = pytest.importorskip("PIL.Image")

CLASSES10 = [f"c{i}" for i in range(10)]
PER_CLASS = 2


def _jpeg(rng: np.random.Generator, size: tuple[int, int] = (32, 32)) -> bytes:
    a = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def make_tree(root: Path, seed: int = 0) -> Path:
    """root/train/<10 classes>/<2 JPEGs>; returns root."""
    rng = np.random.default_rng(seed)
    for c in CLASSES10:
        d = root / "train" / c
        d.mkdir(parents=True)
        for j in range(PER_CLASS):
            (d / f"{j:04d}.jpg").write_bytes(_jpeg(rng))
    return root


def make_python(root: Path, name: str = "cifar10", n: int = 4, seed: int = 0) -> Path:
    """The official python layout with n images per file; returns the batch directory."""
    rng = np.random.default_rng(seed)
    if name == "cifar10":
        d, files, key, k = root / "cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"], b"labels", 10
    else:
        d, files, key, k = root / "cifar-100-python", ["train", "test"], b"fine_labels", 100
    d.mkdir(parents=True)
    for f in files:
        blob = {b"batch_label": f.encode(), key: rng.integers(0, k, n).tolist(),
                b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8)}
        (d / f).write_bytes(pickle.dumps(blob, protocol=2))
    return d


def load(root: Path, name: str = "cifar10", split: str = "train", **kw: Any) -> Any:
    kw.setdefault("cache", False)
    return load_cifar(name, root, split, workers=1, **kw)


def expect_error_naming(path: Path, root: Path, name: str = "cifar10", split: str = "train") -> str:
    """load() must raise ValueError/FileNotFoundError whose message contains `path`."""
    with pytest.raises((ValueError, FileNotFoundError)) as ei:
        load(root, name, split)
    msg = str(ei.value)
    assert str(path) in msg, f"error does not name {path}: {msg!r}"
    return msg


def _fig(figures: dict, key: str, **kw: Any) -> None:
    fig = figures.setdefault("cifar_malformed", {})
    fig[key] = fig.get(key, 0) + kw.get("n", 1)


# -- image folder ----------------------------------------------------------------------------------
def test_corrupt_jpegs_are_errors_naming_the_file(tmp_path: Path, figures: dict) -> None:
    root = make_tree(tmp_path)
    images, labels = load(root)
    assert images.shape == (10 * PER_CLASS, 32, 32, 3) and labels.tolist() == sorted(labels.tolist())
    target = root / "train" / "c3" / "0001.jpg"
    good = target.read_bytes()
    rng = np.random.default_rng(1)
    bad_header = bytearray(good)
    bad_header[2:40] = bytes(38)                       # SOI kept, the segments after it zeroed
    cases = {"random bytes": rng.integers(0, 256, 700, dtype=np.uint8).tobytes(), "empty": b"",
             "SOI only": good[:2], "damaged header": bytes(bad_header), "text": b"not an image\n"}
    for what, blob in cases.items():
        target.write_bytes(blob)
        expect_error_naming(target, root)
        _fig(figures, "corrupt_jpeg_errors")
    # truncated at a sweep of cut points: an error naming the file, or (cut inside the trailer
    # only) the same pixels as the intact file
    ref = images[3 * PER_CLASS + 1]
    decoded_same = 0
    cuts = sorted(set(range(2, len(good), max(1, len(good) // 40))) | {len(good) - 1, len(good) - 2})
    for cut in cuts:
        target.write_bytes(good[:cut])
        try:
            got, _ = load(root)
        except ValueError as e:
            assert str(target) in str(e), f"cut {cut}: {e}"
            _fig(figures, "truncated_jpeg_errors")
        else:
            assert np.array_equal(got[3 * PER_CLASS + 1], ref), f"cut at {cut}/{len(good)} decoded to other pixels"
            decoded_same += 1
    assert decoded_same <= 2          # only cuts inside the end-of-image marker may decode
    _fig(figures, "truncated_jpeg_cuts", n=len(cuts))


@pytest.mark.parametrize("size", [(33, 32), (32, 31), (1, 1), (64, 64)])
def test_wrong_image_size_is_an_error_naming_the_file(tmp_path: Path, size: tuple[int, int], figures: dict) -> None:
    root = make_tree(tmp_path)
    target = root / "train" / "c9" / "0000.jpg"
    target.write_bytes(_jpeg(np.random.default_rng(2), size))
    msg = expect_error_naming(target, root)
    assert "32x32" in msg
    _fig(figures, "wrong_size_errors")


def test_empty_class_folder_is_an_error_naming_it(tmp_path: Path, figures: dict) -> None:
    root = make_tree(tmp_path)
    empty = root / "train" / "c5"
    for f in empty.iterdir():
        f.unlink()
    expect_error_naming(empty, root)
    (empty / "notes.txt").write_text("only a stray file")      # no image: the same error
    expect_error_naming(empty, root)
    _fig(figures, "empty_class_errors", n=2)


def test_stray_class_level_folder_is_an_error_naming_the_split(tmp_path: Path, figures: dict) -> None:
    root = make_tree(tmp_path)
    (root / "train" / ".ipynb_checkpoints").mkdir()
    msg = expect_error_naming(root / "train", root)
    assert "11 class directories" in msg and ".ipynb_checkpoints" in msg
    _fig(figures, "stray_folder_errors")


def test_stray_folder_sorting_last_is_named(tmp_path: Path) -> None:
    root = make_tree(tmp_path)
    (root / "train" / "zz_backup").mkdir()
    msg = expect_error_naming(root / "train", root)
    assert "zz_backup" in msg


STRAY = ["notes.txt", ".DS_Store", "Thumbs.db", "0000.jpg.bak"]


def test_stray_files_are_counted_and_reported(tmp_path: Path) -> None:
    root = make_tree(tmp_path)
    for i, name in enumerate(STRAY):
        (root / "train" / CLASSES10[i] / name).write_bytes(b"stray")
    (root / "train" / "c6" / "extra.jpg").mkdir()                    # a folder named like an image
    os.symlink(root / "missing.jpg", root / "train" / "c7" / "gone.jpg")   # a broken link
    (root / "train" / "README").write_text("beside the class folders")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        images, _ = load(root)
    assert images.shape[0] == 10 * PER_CLASS          # the real images are all read
    text = " ".join(str(x.message) for x in w)
    skipped = STRAY + ["extra.jpg", "gone.jpg", "README"]
    missing = [s for s in skipped if s not in text]
    assert not missing, f"skipped silently (no warning names them): {missing}"


def test_stray_files_in_the_official_folder_are_ignored_by_design(tmp_path: Path, figures: dict) -> None:
    """The official layout names its files; the archive itself ships batches.meta and readme.html."""
    d = make_python(tmp_path)
    ref = load(tmp_path)
    for name in ("batches.meta", "readme.html", "data_batch_1.bak", ".DS_Store"):
        (d / name).write_bytes(b"\x80\x02garbage")
    got = load(tmp_path)
    assert all(np.array_equal(a, b) for a, b in zip(got, ref))
    _fig(figures, "official_folder_stray_ignored", n=4)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_corrupt_cache_is_reported_and_rebuilt(tmp_path: Path, damage: str) -> None:
    root = make_tree(tmp_path / "data")
    cache = tmp_path / "cache"
    ref = load(root, cache=True, cache_dir=cache)
    (entry,) = list(cache.iterdir())
    blob = entry.read_bytes()
    entry.write_bytes({"garbage": b"PK\x03\x04 not a zip", "truncated": blob[: len(blob) // 2], "empty": b""}[damage])
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = load(root, cache=True, cache_dir=cache)
    assert any(str(entry) in str(x.message) for x in w), "no warning names the unreadable cache"
    assert all(np.array_equal(a, b) for a, b in zip(got, ref))


def test_cache_with_wrong_content_is_reported_and_rebuilt(tmp_path: Path, figures: dict) -> None:
    """A readable .npz with the wrong arrays: the documented warning, then a fresh decode."""
    root = make_tree(tmp_path / "data")
    cache = tmp_path / "cache"
    ref = load(root, cache=True, cache_dir=cache)
    (entry,) = list(cache.iterdir())
    with open(entry, "wb") as f:
        np.savez(f, images=np.zeros((3, 32, 32, 3), np.uint8), labels=np.zeros(3, np.int64))
    with pytest.warns(UserWarning, match=re.escape(str(entry))):
        got = load(root, cache=True, cache_dir=cache)
    assert all(np.array_equal(a, b) for a, b in zip(got, ref))
    _fig(figures, "wrong_cache_rebuilt")


# -- official python format --------------------------------------------------------------------------
@pytest.mark.parametrize("name,file,split", [("cifar10", "data_batch_3", "train"), ("cifar10", "test_batch", "test"),
                                             ("cifar100", "train", "train")])
def test_truncated_python_batch_is_an_error_naming_the_file(tmp_path: Path, name: str, file: str, split: str,
                                                           figures: dict) -> None:
    d = make_python(tmp_path, name)
    target = d / file
    good = target.read_bytes()
    cuts = sorted(set(range(0, len(good), max(1, len(good) // 60))) | {1, 2, len(good) - 2, len(good) - 1})
    for cut in cuts:
        target.write_bytes(good[:cut])
        expect_error_naming(target, tmp_path, name, split)
    _fig(figures, "truncated_python_batch_errors", n=len(cuts))


@rel_settings(max_examples=40)
@given(frac=st.floats(0.0, 1.0, exclude_max=True))
def test_truncated_python_batch_hypothesis(tmp_path_factory: Any, frac: float, figures: dict) -> None:
    root = tmp_path_factory.mktemp("py")
    d = make_python(root)
    target = d / "data_batch_5"
    good = target.read_bytes()
    target.write_bytes(good[:int(frac * len(good))])
    expect_error_naming(target, root)
    _fig(figures, "truncated_python_batch_errors_hypothesis")


@pytest.mark.parametrize("what", ["short rows", "long rows", "float data", "3-d data", "labels too few",
                                  "label out of range", "not a dict"])
def test_malformed_python_batch_is_an_error_naming_the_file(tmp_path: Path, what: str, figures: dict) -> None:
    d = make_python(tmp_path)
    target = d / "data_batch_2"
    data, labels = np.zeros((4, 3072), np.uint8), [0, 1, 2, 3]
    blob: Any
    if what == "short rows":
        data = np.zeros((4, 3000), np.uint8)
    elif what == "long rows":
        data = np.zeros((4, 3 * 33 * 32), np.uint8)
    elif what == "float data":
        data = np.zeros((4, 3072), np.float32)
    elif what == "3-d data":
        data = np.zeros((4, 32, 96), np.uint8)
    elif what == "labels too few":
        labels = [0, 1]
    elif what == "label out of range":
        labels = [0, 1, 2, 10]
    blob = [1, 2] if what == "not a dict" else {b"data": data, b"labels": labels}
    target.write_bytes(pickle.dumps(blob, protocol=2))
    expect_error_naming(target, tmp_path)
    _fig(figures, "malformed_python_batch_errors")
