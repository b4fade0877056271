"""Fuzz of `TriAccelConfig`: every field, wrong types and out-of-range values.

The fields are read from `dataclasses.fields(TriAccelConfig)` at collection time, so a field added
to the config is fuzzed without editing this file. For every field and every value drawn, the
config either

* constructs a *valid* config: every field still has the type its annotation promises (bools are
  not numbers here, floats are finite), the config round-trips through `to_dict`/JSON/`from_dict`,
  and a `Controller` built from it takes its first decisions; or
* raises `ValueError`/`TypeError` whose message names the field.

`TriAccelConfig.from_dict` with unknown keys must name every unknown key.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from rel_util import rel_settings

from triaccel import Controller, LayerSpec, TriAccelConfig

FIELD_NAMES = [f.name for f in dataclasses.fields(TriAccelConfig)]
HINTS = typing.get_type_hints(TriAccelConfig)
nan, inf = float("nan"), float("inf")

# Wrong types and out-of-range values, for every field.
NASTY: list[Any] = [
    "", "abc", "1", "0.5", "nan", "inf", "-1", "fp16", "4GiB", " ", "None", "True",
    [], [1, 2], [0.5, 0.5], [8, 16, 96], (1,), (0.5,), (), {}, {"a": 1}, set(), b"", b"ab",
    None, True, False,
    0, 1, -1, 2, 7, 8, 96, 2**31, 10**30, -10**30, 10**400, -10**400,
    0.0, -0.0, 0.5, 1.0, -0.5, 1.5, 1e-320, 1e308, -1e308, nan, inf, -inf,
    np.float64(nan), np.float64(0.5), np.float32(0.5), np.int64(8), np.bool_(True), np.array([1.0]),
    (True, False), (False, True), (nan, 0.5), (0.5, nan), (0.0, inf), (8, 16), (16, 8), (8, 96),
    (8, 8), (0.1, 0.2, 0.3), ("a", "b"), (None, None),
    object(), 1 + 2j, float,
]


def _ids(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 24 else r[:21] + "..."


# -- what "valid" means --------------------------------------------------------------------------
def _is_real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, (bool, np.bool_)) and math.isfinite(v)


def conforms(value: Any, hint: Any) -> bool:
    """`value` has the type of the (resolved) annotation `hint`; floats finite, bools not numbers."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(conforms(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return _is_real(value)
    if hint is str:
        return isinstance(value, str)
    if origin is tuple:
        args = typing.get_args(hint)
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(conforms(x, args[0]) for x in value)
        return len(args) == len(value) and all(conforms(x, a) for x, a in zip(value, args))
    if hint is Any:
        return True
    return isinstance(value, hint) if isinstance(hint, type) else True


SMOKE_MAX_INT = 2**16


def assert_valid(c: TriAccelConfig) -> None:
    """Types as annotated, JSON/dict round trip, and (for integer knobs up to SMOKE_MAX_INT) a
    Controller built from it decides within its bounds."""
    for f in dataclasses.fields(c):
        v = getattr(c, f.name)
        assert conforms(v, HINTS[f.name]), f"accepted {f.name}={v!r}, not a {HINTS[f.name]}"
    d = c.to_dict()
    assert TriAccelConfig.from_dict(d) == c
    assert TriAccelConfig.from_dict(json.loads(json.dumps(d, allow_nan=False))) == c
    ints = [getattr(c, f.name) for f in dataclasses.fields(c) if f.name != "memory_budget"]
    ints += list(c.batch_buckets or ())
    if any(isinstance(v, int) and abs(v) > SMOKE_MAX_INT for v in ints):
        return   # the controller's arrays are sized by these knobs: not built from absurd ones
    ctl = Controller(c, ["a", LayerSpec("n", kind="norm"), "b"])
    for step in (0, 1, c.t_ctrl):
        d = ctl.decide(step)
        assert c.batch_min <= d.batch_size <= c.batch_max and d.accumulation >= 1
        assert np.isfinite(d.lr_scales).all() and np.isfinite(d.lr_batch_scale)


def check_one(changes: dict[str, Any]) -> str:
    """'valid' or 'rejected' for TriAccelConfig(**changes); fails on anything else."""
    try:
        c = TriAccelConfig(**changes)
    except (ValueError, TypeError) as e:
        msg = str(e)
        assert any(name in msg for name in changes), (
            f"TriAccelConfig(**{changes!r}) raised {type(e).__name__} without naming the field: {msg!r}")
        return "rejected"
    except Exception as e:  # noqa: BLE001 - anything else is a defect
        raise AssertionError(
            f"TriAccelConfig(**{changes!r}) raised {type(e).__name__} (not ValueError/TypeError): {e}") from e
    assert_valid(c)
    return "valid"


def _not_iterable(field: str, value: Any) -> bool:
    if field not in ("calibration_quantiles", "batch_buckets") or (field == "batch_buckets" and value is None):
        return False
    try:
        tuple(value)
    except TypeError:
        return True
    return False


def _huge_int_for_real(field: str, value: Any) -> bool:
    hint = HINTS[field]
    return (isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**308
            and (hint is float or float in typing.get_args(hint) or field == "memory_budget"))


def _bool_quantiles(field: str, value: Any) -> bool:
    return (field == "calibration_quantiles" and isinstance(value, tuple) and len(value) == 2
            and all(isinstance(x, bool) for x in value) and value[0] <= value[1])


@pytest.mark.parametrize("field", FIELD_NAMES)
def test_every_field_rejects_or_accepts_each_nasty_value(field: str, figures: dict) -> None:
    fig = figures.setdefault("config_fuzz_fixed", {"fields": len(FIELD_NAMES), "nasty_values": len(NASTY),
                                                   "valid": 0, "rejected": 0})
    failures = []
    for value in NASTY:
        try:
            fig[check_one({field: value})] += 1
        except AssertionError as e:
            failures.append(str(e).splitlines()[0])
    assert not failures, "\n".join(failures)


def _cases(pred) -> list[tuple[str, Any]]:
    return [(f, v) for f in FIELD_NAMES for v in NASTY if pred(f, v)]


def _check_all(cases: list[tuple[str, Any]]) -> None:
    assert cases, "no case left: the defect's predicate no longer matches any field"
    failures = []
    for f, v in cases:
        try:
            check_one({f: v})
        except AssertionError as e:
            failures.append(str(e).splitlines()[0])
    assert not failures, f"{len(failures)} of {len(cases)} cases:\n" + "\n".join(failures)


def test_non_iterable_tuple_fields() -> None:
    _check_all(_cases(_not_iterable))


def test_huge_int_in_real_fields() -> None:
    _check_all(_cases(_huge_int_for_real))


def test_bool_quantiles() -> None:
    _check_all(_cases(_bool_quantiles))


# Values hypothesis draws on top of the fixed list: any scalar, container or string.
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(-10, 2048),
    st.floats(allow_nan=True, allow_infinity=True), st.floats(-2.0, 2.0), st.text(max_size=6),
    st.sampled_from(["fp16", "bf16", "fp32", "fisher", "hessian", "off", "linear", "sqrt", "none",
                     "accumulate", "1GiB", "512 MiB", "3.5GB", "evidence", "variance", "noise", "memory"]),
)
values = st.one_of(scalars, st.lists(scalars, max_size=4), st.lists(scalars, max_size=4).map(tuple),
                   st.lists(st.integers(1, 2048), max_size=5).map(lambda x: tuple(sorted(set(x)))))
@rel_settings(max_examples=400)
@given(changes=st.dictionaries(st.sampled_from(FIELD_NAMES), values, min_size=1, max_size=3))
def test_random_field_combinations(changes: dict[str, Any], figures: dict) -> None:
    outcome = check_one(changes)
    fig = figures.setdefault("config_fuzz_hypothesis", {"examples": 0, "valid": 0, "rejected": 0})
    fig["examples"] += 1
    fig[outcome] += 1


@rel_settings(max_examples=60)
@given(unknown=st.lists(st.text(min_size=1, max_size=12).filter(lambda s: s not in FIELD_NAMES),
                        min_size=1, max_size=4, unique=True),
       known=st.dictionaries(st.sampled_from(FIELD_NAMES), st.just(None), max_size=2))
def test_from_dict_names_every_unknown_key(unknown: list[str], known: dict) -> None:
    d = TriAccelConfig().to_dict()
    d.update({k: 1 for k in unknown})
    with pytest.raises(ValueError) as ei:
        TriAccelConfig.from_dict(d)
    msg = str(ei.value)
    for k in unknown:
        assert repr(k) in msg or k in msg, f"unknown key {k!r} not named in {msg!r}"


def test_defaults_are_valid_and_every_field_is_covered(figures: dict) -> None:
    assert_valid(TriAccelConfig())
    assert set(HINTS) >= set(FIELD_NAMES)   # every field has an annotation the validity check reads
    figures.setdefault("config_fields", sorted(FIELD_NAMES))
