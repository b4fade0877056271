"""Shared by the benchmark scripts: file-name tags for devices and writing a result as JSON.

The scripts run as `python benchmarks/<name>.py`, so this folder is first on sys.path and they
import it as `_results` (tests add the folder to sys.path, tests/conftest.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any


def device_tag(name: str, empty: str = "cpu") -> str:
    """`name` (a device name) lower-cased with every run of other characters than letters and digits
    as one "-", for file names; `empty` when nothing is left."""
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower() or empty


def write_json(obj: Any, path: str | Path, indent: int = 2) -> Path:
    """Write `obj` as JSON to `path` (folders made; values JSON cannot hold written as str), say so
    on stdout, and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=indent, default=str) + "\n")
    print(f"wrote {path}")
    return path
