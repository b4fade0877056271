"""Helpers shared by the reliability tests (imported as `rel_util`; pytest puts this folder on
sys.path since it has no __init__.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

from hypothesis import HealthCheck, settings

from triaccel import TriAccelConfig

FIELDS = {f.name for f in dataclasses.fields(TriAccelConfig)}

# Derandomized (the same examples on every run and machine) and no deadline (slow shared CI).
settings.register_profile(
    "reliability",
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


def rel_settings(max_examples: int, **kw: Any) -> settings:
    """Per-test hypothesis settings whose parent is the "reliability" profile (conftest.py):
    derandomized, no deadline. The global profile is left alone."""
    return settings(settings.get_profile("reliability"), max_examples=max_examples, **kw)


def config(**kw: Any) -> TriAccelConfig:
    """TriAccelConfig(**kw), where `batch_law` / `precision_law` are dropped when this version of the
    config has no such field (others add fields to the config during the day)."""
    optional = ("batch_law", "precision_law")
    return TriAccelConfig(**{k: v for k, v in kw.items() if k in FIELDS or k not in optional})


def memory_law() -> dict[str, Any]:
    """The knobs that select the paper's memory-driven batch law, where the config has a choice."""
    return {"batch_law": "memory"} if "batch_law" in FIELDS else {}
