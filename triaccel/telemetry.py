"""Telemetry: one JSON-safe record per decision, writable as JSONL."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["Telemetry"]


class Telemetry:
    """Append-only list of decision records (dicts of JSON-safe values)."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def append(self, record: dict[str, Any]) -> None:
        self.records.append(record)

    def write_jsonl(self, path: str | Path) -> Path:
        """Write all records, one JSON object per line; returns the path."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        with p.open("w") as f:
            for r in self.records:
                f.write(json.dumps(r) + "\n")
        return p
