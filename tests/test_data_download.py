"""Finding and downloading the data: a fake official archive served from this machine (file:// and
an http.server on 127.0.0.1), no network."""

from __future__ import annotations

import functools
import hashlib
import http.server
import pickle
import socket
import tarfile
import threading
from pathlib import Path

import numpy as np
import pytest

from triaccel.data import ARCHIVES, DownloadError, fetch_dataset, load_cifar, resolve_data

FILES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
BAD_MD5 = "0" * 32


def _write_python_layout(root: Path, seed: int = 0) -> np.ndarray:
    """cifar-10-batches-py with 2 images per batch file; returns the test images (N, 32, 32, 3)."""
    d = root / "cifar-10-batches-py"
    d.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    for name in FILES:
        x = rng.integers(0, 256, size=(2, 32, 32, 3), dtype=np.uint8)
        row = x.transpose(0, 3, 1, 2).reshape(2, 3072)
        with open(d / name, "wb") as f:
            pickle.dump({b"labels": [1, 2], b"data": row}, f, protocol=2)
    return x


@pytest.fixture()
def archive(tmp_path: Path) -> tuple[Path, str, np.ndarray]:
    """(path of a fake cifar-10-python.tar.gz, its MD5, the test images it holds)."""
    test_x = _write_python_layout(tmp_path / "src")
    path = tmp_path / "served" / "cifar-10-python.tar.gz"
    path.parent.mkdir()
    with tarfile.open(path, "w:gz") as tar:
        tar.add(tmp_path / "src" / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    return path, hashlib.md5(path.read_bytes()).hexdigest(), test_x


@pytest.fixture()
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty user cache ($TRIACCEL_CACHE) and no $TRIACCEL_DATA; returns the cache root."""
    monkeypatch.setenv("TRIACCEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TRIACCEL_DATA", raising=False)
    return tmp_path / "cache"


@pytest.fixture()
def server(archive: tuple[Path, str, np.ndarray]):
    """An http.server on 127.0.0.1 serving the archive's folder; yields (base URL, list of GET paths)."""
    hits: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def do_GET(self) -> None:
            hits.append(self.path)
            super().do_GET()

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                            functools.partial(Handler, directory=str(archive[0].parent)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", hits
    finally:
        httpd.shutdown()
        httpd.server_close()


def _closed_port_url() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}/cifar-10-python.tar.gz"


def test_download_extracts_into_the_cache_and_is_reused(archive, env, server, monkeypatch, capsys):
    path, md5, test_x = archive
    base, hits = server
    monkeypatch.setitem(ARCHIVES, "cifar10", (f"{base}/{path.name}", md5))
    root = resolve_data("cifar10")
    assert root == env / "cifar10" and hits == [f"/{path.name}"]
    assert "downloading" in capsys.readouterr().err
    assert sorted(p.name for p in root.iterdir()) == ["cifar-10-batches-py"]  # no archive, no temporary left
    x, y = load_cifar("cifar10", root, "test")
    np.testing.assert_array_equal(x, test_x)
    assert y.tolist() == [1, 2]
    # Second call: found in the cache, nothing fetched (an unreachable URL would fail).
    monkeypatch.setitem(ARCHIVES, "cifar10", (_closed_port_url(), md5))
    assert resolve_data("cifar10") == root and len(hits) == 1


def test_checksum_mismatch_is_an_error_and_leaves_no_file(archive, env, monkeypatch):
    path, md5, _ = archive
    url = path.as_uri()
    monkeypatch.setitem(ARCHIVES, "cifar10", (url, BAD_MD5))
    with pytest.raises(DownloadError, match=f"{url}: MD5 {md5}, expected {BAD_MD5}") as e:
        resolve_data("cifar10", progress=False)
    assert "--data" in str(e.value)
    assert list((env / "cifar10").iterdir()) == []


def test_offline_error_names_url_checksum_and_data_option(env, monkeypatch):
    url = _closed_port_url()
    monkeypatch.setitem(ARCHIVES, "cifar10", (url, ARCHIVES["cifar10"][1]))
    with pytest.raises(DownloadError) as e:
        fetch_dataset("cifar10", env / "cifar10", progress=False, timeout=5)
    msg = str(e.value)
    assert f"cannot download {url}" in msg and "c58f30108f718f92721af3b95e74349a" in msg and "--data DIR" in msg
    assert list((env / "cifar10").iterdir()) == []


def test_precedence_data_then_env_then_cache(archive, env, tmp_path, monkeypatch):
    path, md5, _ = archive
    monkeypatch.setitem(ARCHIVES, "cifar10", (_closed_port_url(), md5))  # any download attempt fails
    _write_python_layout(env / "cifar10")
    assert resolve_data("cifar10") == env / "cifar10"
    monkeypatch.setenv("TRIACCEL_DATA", str(tmp_path / "mine"))
    assert resolve_data("cifar10") == tmp_path / "mine"  # $TRIACCEL_DATA wins over the cache
    assert resolve_data("cifar10", tmp_path / "explicit") == tmp_path / "explicit"  # --data wins over both
    with pytest.raises(ValueError, match="name must be one of"):
        resolve_data("mnist")


def test_demo_loader_reads_from_triaccel_data(tmp_path, env, monkeypatch):
    from examples.cifar import datasets, train

    test_x = _write_python_layout(tmp_path / "mine")
    monkeypatch.setenv("TRIACCEL_DATA", str(tmp_path / "mine"))
    opts = train.parse_args(["--device", "cpu"])
    assert opts.data == ""  # no --data: resolved when loading
    arrays = datasets.load("cifar10", opts.data, None, None, 0)
    np.testing.assert_array_equal(arrays.test_x, test_x)
    assert arrays.train_x.shape == (10, 32, 32, 3)
