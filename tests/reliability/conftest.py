"""Shared pieces of the reliability suite (tests/reliability, issue #19 item 4).

* A hypothesis settings profile, "reliability": derandomized (the same examples on every run and
  machine), no deadline (CI machines are slow and shared). It is registered (rel_util.py, imported
  here first) and used as the
  *parent* of each test's own `settings(...)` (`rel_util.rel_settings(max_examples=N)`), so that
  it does not change the settings of the rest of the test suite.
* `figures`: a session-wide dict the tests put their measured figures in (samples lost, OOMs
  injected, steps, peaks...). They are printed in pytest's terminal summary under
  "triaccel reliability figures", so that docs/reliability.md quotes numbers a run printed.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import pytest
import rel_util  # noqa: F401  (registers the hypothesis profile "reliability")


_FIGURES: dict[str, Any] = {}
_T0 = time.perf_counter()


@pytest.fixture(scope="session")
def figures() -> dict[str, Any]:
    """Session-wide {name: figures} printed in the terminal summary (and written to
    $TRIACCEL_RELIABILITY_JSON when that variable names a file)."""
    return _FIGURES


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: Any) -> None:
    if not _FIGURES:
        return
    tr = terminalreporter
    tr.write_sep("=", "triaccel reliability figures")
    for name in sorted(_FIGURES):
        tr.write_line(f"{name}: {json.dumps(_FIGURES[name], sort_keys=True, default=str)}")
    tr.write_line(f"reliability suite wall time (first collection to summary): {time.perf_counter() - _T0:.1f} s")
    out = os.environ.get("TRIACCEL_RELIABILITY_JSON")
    if out:
        with open(out, "w") as f:
            json.dump(_FIGURES, f, indent=1, sort_keys=True, default=str)
