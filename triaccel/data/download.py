"""Where a dataset is read from, and its official archive fetched on first use (standard library only).

`resolve_data(name, data)` picks the folder handed to `load_cifar`, first match wins:

1. ``data`` when given (the demo's ``--data``);
2. ``$TRIACCEL_DATA`` when set (used as it is, like ``--data``);
3. the user cache ``<cache>/<name>`` (``<cache>``: ``$TRIACCEL_CACHE``, else ``~/.cache/triaccel``,
   the root of the decoded-image cache too) when it holds the dataset in the official layout;
4. else the official archive is downloaded into that folder (`fetch_dataset`): streamed into a
   temporary file beside its target with a progress bar (tqdm when installed), its MD5 checked,
   renamed only when complete, extracted into a temporary folder, moved into place and deleted. A
   failed or interrupted download leaves no partial file behind.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import shutil
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

from triaccel.data.cifar import ARCHIVES, DATASETS, default_cache_dir, has_python_layout

__all__ = ["DownloadError", "fetch_dataset", "resolve_data"]

_CHUNK = 1 << 20  # bytes per read


class DownloadError(OSError):
    """The archive could not be fetched (unreachable URL, interrupted transfer, checksum mismatch)."""


def resolve_data(name: str, data: str | os.PathLike[str] | None = None, *, progress: bool = True,
                 timeout: float = 60.0) -> Path:
    """Folder to read dataset ``name`` ("cifar10" | "cifar100") from (see the module docstring);
    downloads the official archive into the user cache when nothing else holds the data.
    ``timeout``: seconds without network progress before a download fails. Raises DownloadError."""
    if name not in DATASETS:
        raise ValueError(f"name must be one of {DATASETS}, got {name!r}")
    if data:
        return Path(data).expanduser()
    env = os.environ.get("TRIACCEL_DATA")
    if env:
        return Path(env).expanduser()
    root = default_cache_dir() / name
    if has_python_layout(name, root):
        return root
    return fetch_dataset(name, root, progress=progress, timeout=timeout)


def fetch_dataset(name: str, dest: str | os.PathLike[str], *, progress: bool = True, timeout: float = 60.0) -> Path:
    """Download ``name``'s official archive (`ARCHIVES`), verify its MD5 and extract it into ``dest``
    (created); returns ``dest``. Raises DownloadError, naming the URL, the checksum and ``--data``."""
    url, md5 = ARCHIVES[name]
    dest = Path(dest).expanduser()
    dest.mkdir(parents=True, exist_ok=True)
    archive = _download(url, md5, dest / Path(urllib.parse.urlparse(url).path).name, progress, timeout)
    try:
        _extract(archive, dest)
    finally:
        archive.unlink(missing_ok=True)
    if not has_python_layout(name, dest):
        raise DownloadError(f"{url}: the archive (MD5 {md5}) did not extract into {name}'s python layout under "
                            f"{dest}")
    return dest


def _how_to(url: str, md5: str) -> str:
    return (f"Fetch {url} elsewhere, check that its MD5 is {md5}, extract it into a folder and pass that "
            "folder with --data DIR (or set $TRIACCEL_DATA=DIR).")


def _download(url: str, md5: str, path: Path, progress: bool, timeout: float) -> Path:
    """``url`` into ``path`` through a temporary file, renamed only once complete and MD5-verified."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".part")
    h = hashlib.md5(usedforsecurity=False)
    try:
        with os.fdopen(fd, "wb") as f, urllib.request.urlopen(url, timeout=timeout) as resp:
            total = int(resp.headers.get("Content-Length") or 0) or None
            bar = _progress_bar(url, path, total) if progress else None
            try:
                while chunk := resp.read(_CHUNK):
                    f.write(chunk)
                    h.update(chunk)
                    if bar is not None:
                        bar.update(len(chunk))
            finally:
                if bar is not None:
                    bar.close()
        if h.hexdigest() != md5:
            raise DownloadError(f"{url}: MD5 {h.hexdigest()}, expected {md5}: the download is corrupt or the "
                                f"file changed; nothing was kept. Retry, or: {_how_to(url, md5)}")
        os.replace(tmp, path)
    except DownloadError:
        Path(tmp).unlink(missing_ok=True)
        raise
    except (OSError, http.client.HTTPException) as e:  # URLError, refused/reset/cut connections, timeouts
        Path(tmp).unlink(missing_ok=True)
        raise DownloadError(f"cannot download {url} ({getattr(e, 'reason', e)}). Offline? "
                            f"{_how_to(url, md5)}") from e
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _progress_bar(url: str, path: Path, total: int | None):
    """A tqdm byte counter on stderr (None without tqdm: then one line says what is fetched)."""
    print(f"triaccel: downloading {url} -> {path}", file=sys.stderr)
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=path.name, file=sys.stderr,
                leave=False, dynamic_ncols=True)


def _extract(archive: Path, dest: Path) -> None:
    """Extract ``archive`` (.tar.gz) into a temporary folder in ``dest``, then move each top-level
    entry into ``dest`` (replacing a stale one): a half-extracted tree never sits in place."""
    tmp = Path(tempfile.mkdtemp(dir=dest, prefix=".extract-"))
    try:
        with tarfile.open(archive, "r:*") as tar:
            # The MD5 already vouches for the content; the "data" filter (Python >= 3.11.4) also
            # refuses absolute paths, links out of the folder and special files.
            tar.extractall(tmp, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        for entry in tmp.iterdir():
            target = dest / entry.name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            elif target.exists() or target.is_symlink():
                target.unlink()
            os.replace(entry, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
