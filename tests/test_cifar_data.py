"""CIFAR readers: image-folder tree (real JPEGs), official python format (written here), cache, errors."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest

from triaccel.data import CIFAR_MEAN, CIFAR_STD, load_cifar, normalization
from triaccel.data.cifar import _decode_chunk

JPEG_ROOT = Path(__file__).resolve().parents[2] / "shared/data/cifar10-jpeg"
PER_CLASS = 3


@pytest.fixture(scope="module")
def small_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 10-class image-folder tree with the first PER_CLASS real JPEGs of each class (copied)."""
    if not (JPEG_ROOT / "train").is_dir():
        pytest.skip(f"real CIFAR-10 JPEGs not found at {JPEG_ROOT}")
    root = tmp_path_factory.mktemp("cifar10-small")
    for split in ("train", "test"):
        for cdir in sorted(p for p in (JPEG_ROOT / split).iterdir() if p.is_dir()):
            dst = root / split / cdir.name
            dst.mkdir(parents=True)
            for f in sorted(cdir.glob("*.jpg"))[:PER_CLASS]:
                shutil.copy2(f, dst / f.name)
    return root


def test_image_folder_reads_real_jpegs_in_order(small_tree: Path, tmp_path: Path) -> None:
    x, y = load_cifar("cifar10", small_tree, "train", cache_dir=tmp_path)
    assert x.shape == (10 * PER_CLASS, 32, 32, 3) and x.dtype == np.uint8
    assert y.dtype == np.int64 and y.tolist() == [c for c in range(10) for _ in range(PER_CLASS)]
    classes = sorted(p.name for p in (small_tree / "train").iterdir())
    from PIL import Image

    first = sorted((small_tree / "train" / classes[4]).glob("*.jpg"))[1]
    np.testing.assert_array_equal(x[4 * PER_CLASS + 1], np.asarray(Image.open(first).convert("RGB")))
    assert x.std() > 20  # real images, not blank
    xt, yt = load_cifar("cifar10", small_tree, "test", cache_dir=tmp_path)
    assert xt.shape[0] == 10 * PER_CLASS and not np.array_equal(xt, x)


def test_cache_is_used_and_invalidated(small_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRIACCEL_CACHE", str(tmp_path / "envcache"))
    x1, y1 = load_cifar("cifar10", small_tree, "train")
    files = list((tmp_path / "envcache").glob("cifar10-train-*.npz"))
    assert len(files) == 1

    import triaccel.data.cifar as cifar

    def no_decode(*a: object, **k: object) -> None:
        raise AssertionError("decoded although a valid cache exists")

    monkeypatch.setattr(cifar, "_decode_all", no_decode)
    x2, y2 = load_cifar("cifar10", small_tree, "train")
    np.testing.assert_array_equal(x1, x2)
    np.testing.assert_array_equal(y1, y2)
    monkeypatch.undo()

    # Changing the tree (a new file) changes the key: a second cache file appears.
    tree2 = tmp_path / "tree2"
    shutil.copytree(small_tree, tree2)
    extra = sorted((tree2 / "train" / "cat").glob("*.jpg"))[0]
    shutil.copy2(extra, extra.with_name("zzzz.jpg"))
    x3, y3 = load_cifar("cifar10", tree2, "train", cache_dir=tmp_path / "c2")
    x4, _ = load_cifar("cifar10", tree2, "train", cache_dir=tmp_path / "c2")
    assert x3.shape[0] == x1.shape[0] + 1 and np.array_equal(x3, x4)
    os.utime(extra, ns=(1, 1))  # touching a file also invalidates
    load_cifar("cifar10", tree2, "train", cache_dir=tmp_path / "c2")
    assert len(list((tmp_path / "c2").glob("*.npz"))) == 2

    # A corrupt cache file is reported and rebuilt, not trusted.
    bad = files[0]
    bad.write_bytes(b"not an npz")
    with pytest.warns(UserWarning, match="unreadable cache"):
        x5, _ = load_cifar("cifar10", small_tree, "train", cache_dir=tmp_path / "envcache")
    np.testing.assert_array_equal(x5, x1)


def test_process_pool_decodes_the_same(small_tree: Path) -> None:
    from triaccel.data.cifar import _decode_all, _list_folder

    _, files, _ = _list_folder("cifar10", small_tree / "train")
    files = (files * 70)[:2100]  # enough files to take the pool path
    np.testing.assert_array_equal(_decode_all(files, workers=2), _decode_chunk(files))


def _write_cifar10_py(root: Path, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    d = root / "cifar-10-batches-py"
    d.mkdir(parents=True)
    all_x, all_y = [], []
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        x = rng.integers(0, 256, size=(4, 32, 32, 3), dtype=np.uint8)
        y = rng.integers(0, 10, size=4)
        row = x.transpose(0, 3, 1, 2).reshape(4, 3072)  # official row layout: R plane, G, B
        with open(d / name, "wb") as f:
            pickle.dump({b"batch_label": name.encode(), b"labels": y.tolist(), b"data": row}, f, protocol=2)
        all_x.append(x)
        all_y.append(y)
    return np.concatenate(all_x), np.concatenate(all_y)


def test_python_format_cifar10(tmp_path: Path) -> None:
    x, y = _write_cifar10_py(tmp_path, np.random.default_rng(0))
    tx, ty = load_cifar("cifar10", tmp_path, "train")
    assert tx.shape == (20, 32, 32, 3) and tx.dtype == np.uint8 and ty.dtype == np.int64
    np.testing.assert_array_equal(tx, x[:20])
    np.testing.assert_array_equal(ty, y[:20])
    ex, ey = load_cifar("cifar10", tmp_path / "cifar-10-batches-py", "test")  # root = the dir itself
    np.testing.assert_array_equal(ex, x[20:])
    np.testing.assert_array_equal(ey, y[20:])


def test_python_format_cifar100(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    d = tmp_path / "cifar-100-python"
    d.mkdir()
    ref = {}
    for split, n in (("train", 6), ("test", 3)):
        x = rng.integers(0, 256, size=(n, 32, 32, 3), dtype=np.uint8)
        fine = rng.integers(0, 100, size=n)
        with open(d / split, "wb") as f:
            pickle.dump(
                {b"data": x.transpose(0, 3, 1, 2).reshape(n, 3072), b"fine_labels": fine.tolist(),
                 b"coarse_labels": (fine // 5).tolist()},
                f,
            )
        ref[split] = (x, fine)
    for split in ("train", "test"):
        x, y = load_cifar("cifar100", tmp_path, split)
        np.testing.assert_array_equal(x, ref[split][0])
        np.testing.assert_array_equal(y, ref[split][1])
    assert y.max() < 100


def test_missing_data_says_where_and_how(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as e:
        load_cifar("cifar10", tmp_path, "train")
    msg = str(e.value)
    assert "cifar-10-batches-py" in msg and "data_batch_1" in msg and "cifar-10-python.tar.gz" in msg
    assert str(tmp_path / "train") in msg and "<class>" in msg
    with pytest.raises(FileNotFoundError, match="cifar-100-python.tar.gz"):
        load_cifar("cifar100", tmp_path / "nope", "test")
    (tmp_path / "cifar-10-batches-py").mkdir()
    (tmp_path / "cifar-10-batches-py" / "data_batch_1").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="data_batch_2"):
        load_cifar("cifar10", tmp_path, "train")


def test_malformed_data_is_rejected(tmp_path: Path, small_tree: Path) -> None:
    _write_cifar10_py(tmp_path, np.random.default_rng(2))
    batch = tmp_path / "cifar-10-batches-py" / "test_batch"
    good = batch.read_bytes()
    cases = [
        ({b"labels": [1]}, r"missing key b'data'"),
        ({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}, r"shape \(N, 3072\)"),
        ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0]}, "integer labels"),
        ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]}, r"labels must lie in \[0, 10\)"),
    ]
    for content, msg in cases:
        batch.write_bytes(pickle.dumps(content, protocol=2))
        with pytest.raises(ValueError, match=msg):
            load_cifar("cifar10", tmp_path, "test")
    batch.write_bytes(b"garbage")
    with pytest.raises(ValueError, match="not a readable CIFAR python batch"):
        load_cifar("cifar10", tmp_path, "test")

    class Evil:
        def __reduce__(self) -> tuple:
            return (os.system, ("true",))

    batch.write_bytes(pickle.dumps({b"data": Evil()}))
    with pytest.raises(ValueError, match="not allowed"):
        load_cifar("cifar10", tmp_path, "test")
    batch.write_bytes(good)

    # Image folder: wrong class count, wrong image size, undecodable file, empty class.
    tree = tmp_path / "tree"
    shutil.copytree(small_tree, tree)
    with pytest.raises(ValueError, match="needs 100"):
        load_cifar("cifar100", tree, "train", cache=False)
    from PIL import Image

    big = tree / "train" / "dog" / "big.png"
    Image.new("RGB", (33, 32)).save(big)
    with pytest.raises(ValueError, match="big.png.*must be 32x32"):
        load_cifar("cifar10", tree, "train", cache=False)
    big.write_bytes(b"\x89PNG broken")
    with pytest.raises(ValueError, match="big.png: cannot decode"):
        load_cifar("cifar10", tree, "train", cache=False)
    big.unlink()
    for f in (tree / "train" / "frog").iterdir():
        f.unlink()
    with pytest.raises(ValueError, match="frog: no image files"):
        load_cifar("cifar10", tree, "train", cache=False)


def test_argument_validation_and_normalisation(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="name must be one of"):
        load_cifar("mnist", tmp_path, "train")
    with pytest.raises(ValueError, match="split must be one of"):
        load_cifar("cifar10", tmp_path, "val")
    with pytest.raises(ValueError, match="workers"):
        load_cifar("cifar10", tmp_path, "train", workers=0)
    for name in ("cifar10", "cifar100"):
        mean, std = normalization(name)
        assert mean.shape == std.shape == (3,) and mean.dtype == np.float32
        np.testing.assert_allclose(mean, CIFAR_MEAN[name])
        np.testing.assert_allclose(std, CIFAR_STD[name])
        assert np.all((0.4 < mean) & (mean < 0.52)) and np.all((0.24 < std) & (std < 0.28))


def test_png_and_grayscale_are_read_as_rgb(tmp_path: Path) -> None:
    from PIL import Image

    rng = np.random.default_rng(5)
    ref = []
    for c in range(10):
        d = tmp_path / "test" / f"class{c:02d}"
        d.mkdir(parents=True)
        a = rng.integers(0, 256, size=(32, 32), dtype=np.uint8)
        Image.fromarray(a, mode="L").save(d / "a.PNG")
        ref.append(np.repeat(a[..., None], 3, axis=2))
    x, y = load_cifar("cifar10", tmp_path, "test", cache=False)
    np.testing.assert_array_equal(x, np.stack(ref))
    assert y.tolist() == list(range(10))


def test_data_and_layout_import_no_framework() -> None:
    import subprocess
    import sys

    code = (
        "import sys, triaccel.data, triaccel.layout\n"
        "bad = [m for m in ('torch', 'jax', 'flax', 'PIL') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
