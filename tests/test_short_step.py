"""A short step (an epoch's last, fewer samples than its logical batch) under config short_step_lr:
the core weight, and both backends' elastic_step applying it to the gradient before the update."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from triaccel import Controller, TriAccelConfig
from triaccel.batching import short_step_weight
from triaccel.backends.jax.data import ElasticLoader as JaxLoader, InFlight, elastic_step as jax_step
from triaccel.backends.torch.data import ElasticLoader as TorchLoader, elastic_step as torch_step
from triaccel.elastic import step_weight

N, B = 200, 64   # three full steps of 64, then a short one of 8 samples


def cfg(rule: str, **kw) -> TriAccelConfig:
    # a static batch (no memory reading reaches the controller): the last step is short
    base = dict(batch_init=B, batch_min=8, batch_max=B, batch_buckets=(8, 16, 32, B), curvature="off",
                adaptive_precision=False, elastic_batch=False, lr_rule="none", short_step_lr=rule)
    return TriAccelConfig(**(base | kw))


def test_weight_per_rule_and_full_steps_untouched():
    assert short_step_weight("batch", 16, 512) == 1.0
    assert short_step_weight("linear", 16, 512) == 16 / 512
    assert short_step_weight("sqrt", 16, 512) == math.sqrt(16 / 512)
    for rule in ("batch", "linear", "sqrt"):
        assert short_step_weight(rule, 512, 512) == 1.0


@pytest.mark.parametrize("args, name", [(("linear", 0, 8), "samples"), (("linear", 9, 8), "samples"),
                                        (("linear", 4, 0), "logical_batch"), (("linear", 2.0, 8), "samples"),
                                        (("half", 4, 8), "short_step_lr")])
def test_weight_rejects_bad_input_by_name(args, name):
    with pytest.raises(ValueError, match=name):
        short_step_weight(*args)


def test_config_names_the_allowed_rules():
    with pytest.raises(ValueError, match="short_step_lr"):
        TriAccelConfig(short_step_lr="samples")
    assert TriAccelConfig().short_step_lr == "linear"


def test_step_weight_against_the_decision_logical_batch():
    ctl = Controller(cfg("linear", lr_rule="accumulate"), ["fc"])
    d = ctl.decide(0)
    assert step_weight(ctl, 8, d) == 8 / d.logical_batch
    assert step_weight(Controller(cfg("batch"), ["fc"]), 8, d) == 1.0
    assert step_weight(object(), 8, d) == 1.0   # a controller without a config


# -- torch ---------------------------------------------------------------------------------------
def _torch_epoch(rule: str, momentum: float) -> list[tuple[int, list[torch.Tensor], list[torch.Tensor]]]:
    """One epoch of elastic steps on a linear model: per step (samples, parameters after it, the
    momentum buffers after it)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)
    x = torch.randn(N, 5, generator=torch.Generator().manual_seed(1))
    loader = TorchLoader(x, torch.arange(N), batch_size=B, seed=3)
    ctl = Controller(cfg(rule), ["fc"])
    out = []
    for step in range(4):
        res = torch_step(loader, ctl, lambda b: (model(b[0]).squeeze(1) - 1.0).pow(2).mean(), opt, step)
        bufs = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()] if momentum else []
        out.append((res.samples, [p.detach().clone() for p in model.parameters()], bufs))
    assert loader.end_of_epoch
    return out


@pytest.mark.parametrize("rule", ["linear", "sqrt"])
def test_torch_short_step_update_is_the_full_rule_times_the_weight(rule):
    plain, short = _torch_epoch("batch", 0.0), _torch_epoch(rule, 0.0)
    assert [s for s, *_ in short] == [64, 64, 64, 8]
    for (_, a, _), (_, b, _) in zip(plain[:3], short[:3]):   # full steps: the same updates
        for pa, pb in zip(a, b):
            torch.testing.assert_close(pa, pb, rtol=0, atol=0)
    w = short_step_weight(rule, 8, B)
    for before, pa, pb in zip(plain[2][1], plain[3][1], short[3][1]):
        torch.testing.assert_close(pb - before, w * (pa - before), rtol=1e-5, atol=1e-7)


def test_torch_short_step_weight_enters_the_momentum_buffer():
    # on the gradient, not the LR: buf3 = 0.9 buf2 + w g3, so the weighted gradient stays in the
    # buffer the following steps apply (an LR factor would leave the full g3 there)
    plain, short = _torch_epoch("batch", 0.9), _torch_epoch("linear", 0.9)
    for b2, pa, pb in zip(plain[2][2], plain[3][2], short[3][2]):
        torch.testing.assert_close(pb - 0.9 * b2, (8 / B) * (pa - 0.9 * b2), rtol=1e-5, atol=1e-7)


# -- JAX -----------------------------------------------------------------------------------------
def _loss(params, batch, mask):
    pred = batch["x"] @ params["w"] + params["b"]
    return jnp.sum((pred - 1.0) ** 2 * mask) / jnp.sum(mask)


_vg = jax.jit(jax.value_and_grad(_loss))


class _JaxRun:
    """One epoch of JAX elastic steps, unfused (grad_fn + update_fn) or fused (step_fn + in_flight)."""

    def __init__(self, rule: str) -> None:
        x = np.random.default_rng(1).normal(size=(N, 3)).astype(np.float32)
        self.loader = JaxLoader({"x": x}, batch_size=B, seed=3)
        self.ctl = Controller(cfg(rule), ["fc"])
        self.params = {"w": jnp.array([0.5, -1.0, 2.0]), "b": jnp.array(0.3)}
        self.weights: list[float] = []

    def update(self, grads, decision):
        self.params = jax.tree_util.tree_map(lambda p, g: p - 0.05 * g, self.params, grads)
        return self.params

    def fused(self, batch, mask, decision, weight):
        self.weights.append(weight)
        loss, grads = _vg(self.params, batch, mask)
        self.update(jax.tree_util.tree_map(lambda g: g * weight, grads), decision)
        return loss

    def epoch(self, fused: bool) -> list[tuple[int, dict]]:
        in_flight = InFlight(lambda: self.params, lambda s: setattr(self, "params", s)) if fused else None
        out = []
        for step in range(4):
            if in_flight is not None:
                in_flight.settle()
            res = jax_step(self.loader, self.ctl, lambda b, m: _vg(self.params, b, m), step, update_fn=self.update,
                           in_flight=in_flight, step_fn=self.fused if fused else None)
            if in_flight is not None:
                in_flight.settle()
            out.append((res.samples, dict(self.params)))
        assert self.loader.end_of_epoch
        return out


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("rule", ["linear", "sqrt"])
def test_jax_short_step_update_is_the_full_rule_times_the_weight(rule, fused):
    plain, run = _JaxRun("batch").epoch(fused), _JaxRun(rule)
    short = run.epoch(fused)
    assert [s for s, _ in short] == [64, 64, 64, 8]
    w = short_step_weight(rule, 8, B)
    if fused:   # the step's program gets the weight: 1 on full steps
        assert run.weights == [1.0, 1.0, 1.0, w]
    for k in plain[2][1]:
        np.testing.assert_array_equal(plain[2][1][k], short[2][1][k])
        before = plain[2][1][k]
        np.testing.assert_allclose(short[3][1][k] - before, w * (plain[3][1][k] - before), rtol=1e-5, atol=1e-7)
