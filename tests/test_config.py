import json

import pytest

from triaccel import TriAccelConfig, parse_bytes


def test_defaults():
    """The paper's constants where its levers are used; the defaults that measured best otherwise."""
    c = TriAccelConfig()
    assert (c.top_k, c.t_curv, c.b_curv, c.batch_init, c.batch_multiple) == (5, 200, 32, 96, 8)
    assert c.tau_low is None and c.tau_high is None
    assert (c.precision_law, c.batch_law, c.curvature) == ("evidence", "noise", "off")


@pytest.mark.parametrize("field,value", [
    ("precision_law", "fp32"), ("batch_law", "vram"), ("noise_scale_c", 0.0), ("noise_scale_c", float("inf")),
    ("noise_beta", 1.0), ("t_noise", 0), ("t_noise_warm", 0), ("rounding_noise_ratio", 0.0), ("rounding_noise_ratio", 1.0),
])
def test_new_fields_validated(field, value):
    with pytest.raises(ValueError, match=field):
        TriAccelConfig(**{field: value})


def test_dict_round_trip_is_json_safe():
    c = TriAccelConfig(memory_budget="4GiB", batch_buckets=(32, 64, 96, 128), tau_low=1e-6, tau_high=1e-3)
    d = json.loads(json.dumps(c.to_dict()))
    assert TriAccelConfig.from_dict(d) == c
    assert c.memory_budget == 4 * 2**30


def test_replace_validates():
    with pytest.raises(ValueError, match="beta"):
        TriAccelConfig().replace(beta=1.0)


def test_from_dict_rejects_unknown_keys():
    with pytest.raises(ValueError, match="unknown TriAccelConfig field.*'bogus'"):
        TriAccelConfig.from_dict({"bogus": 1})


@pytest.mark.parametrize("text,expected", [
    ("4GiB", 4 * 2**30), ("512 MiB", 512 * 2**20), ("3.5GB", 3_500_000_000), ("1e9", 10**9),
    (1024, 1024), ("2kb", 2000), ("7b", 7),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["four GiB", "4 parsecs", "-1GiB", "0", 0, -5, 1.5, True, None, "0.5B"])
def test_parse_bytes_rejects(bad):
    with pytest.raises(ValueError, match="memory_budget"):
        parse_bytes(bad)


# Every invalid field: (changes, field named in the message)
INVALID = [
    ({"beta": 1.0}, "beta"), ({"beta": -0.1}, "beta"), ({"beta": float("nan")}, "beta"),
    ({"tau_low": 2.0, "tau_high": 1.0}, "tau_low"), ({"tau_low": 1.0}, "tau_low"),
    ({"tau_low": -1.0, "tau_high": 1.0}, "tau_low"), ({"tau_high": float("inf"), "tau_low": 1.0}, "tau_high"),
    ({"calibration_quantiles": (0.9, 0.1)}, "calibration_quantiles"),
    ({"calibration_quantiles": (0.1, 1.5)}, "calibration_quantiles"),
    ({"recalibrate_every": 0}, "recalibrate_every"), ({"hysteresis": -0.1}, "hysteresis"), ({"hysteresis": 1.0}, "hysteresis"),
    ({"min_dwell": -1}, "min_dwell"), ({"min_dwell": 1.5}, "min_dwell"),
    ({"base_precision": "fp8"}, "base_precision"),
    ({"curvature": "kfac"}, "curvature"), ({"top_k": 0}, "top_k"), ({"t_curv": 0}, "t_curv"),
    ({"b_curv": 0}, "b_curv"), ({"alpha": -1.0}, "alpha"), ({"tau_curv": -1.0}, "tau_curv"),
    ({"promotion_window": 0}, "promotion_window"),
    ({"rho_low": 0.9, "rho_high": 0.8}, "rho_low"), ({"rho_low": 0.8, "rho_high": 0.8}, "rho_low"),
    ({"rho_low": 0.0}, "rho_low"), ({"rho_high": 1.2}, "rho_high"),
    ({"delta_up": 0}, "delta_up"), ({"delta_down": 12}, "delta_down"),
    ({"batch_min": 128, "batch_max": 64, "batch_init": 64}, "batch_min"),
    ({"batch_init": 2000}, "batch_init"), ({"batch_init": 100}, "batch_init"),
    ({"batch_min": 0}, "batch_min"), ({"batch_multiple": 0}, "batch_multiple"),
    ({"batch_buckets": (64, 32)}, "batch_buckets"), ({"batch_buckets": (32, 64)}, "batch_init"),
    ({"batch_buckets": (4, 96)}, "batch_buckets"),
    ({"memory_budget": "lots"}, "memory_budget"), ({"memory_budget": -1}, "memory_budget"),
    ({"oom_shrink": 1.0}, "oom_shrink"), ({"oom_shrink": 0.0}, "oom_shrink"),
    ({"oom_cooldown": 0}, "oom_cooldown"), ({"batch_hold_steps": -1}, "batch_hold_steps"),
    ({"lr_rule": "cubic"}, "lr_rule"), ({"t_ctrl": 0}, "t_ctrl"), ({"warmup_steps": -1}, "warmup_steps"),
    ({"adaptive_precision": "yes"}, "adaptive_precision"), ({"elastic_batch": 1}, "elastic_batch"),
]


@pytest.mark.parametrize("changes,field", INVALID, ids=[f"{f}-{i}" for i, (_, f) in enumerate(INVALID)])
def test_invalid_field_names_field_value_and_range(changes, field):
    with pytest.raises(ValueError) as e:
        TriAccelConfig(**changes)
    msg = str(e.value)
    assert field in msg
    assert "allowed" in msg or "must" in msg or "give both" in msg or "parse" in msg


def test_kernels_choice_is_checked():
    from triaccel import TriAccelConfig

    assert TriAccelConfig().kernels == "auto" and TriAccelConfig(kernels="reference").kernels == "reference"
    assert TriAccelConfig(kernels="xla").kernels == "xla"   # JAX only: the torch wrapper refuses it
    # "torch" (torch's own per-tensor reductions) and "stock" (torch's multi-tensor kernels) were removed:
    # 29x the kernel's GPU time, and 1284 us of host time per call against 18.6 us (H200, docs/results.md)
    for bad in ("cuda", "torch", "stock"):
        with pytest.raises(ValueError, match=f"kernels='{bad}' is invalid: allowed one of 'auto', 'triton', "
                                             "'reference', 'xla'"):
            TriAccelConfig(kernels=bad)
