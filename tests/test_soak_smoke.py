"""benchmarks/soak.py's instrumentation: the per-epoch index counts and the OOM count it bases its
verdict on, over the real elastic steps of both backends with the demo's OOM injector (a tiny model,
no demo run: the full CPU smoke command takes minutes and is documented in the script)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from examples.cifar.common import OOMInjector
from triaccel import Controller, TriAccelConfig

_path = Path(__file__).resolve().parents[1] / "benchmarks" / "soak.py"
_spec = importlib.util.spec_from_file_location("soak", _path)
soak = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(soak)

N = 60
# The memory law with a low reading and a one-step cooldown: the batch grows back after each OOM,
# so that injections do not walk it down to batch_min.
CFG = dict(t_ctrl=1, batch_init=16, batch_min=2, batch_max=16, batch_multiple=2, delta_up=8, delta_down=8,
           curvature="off", adaptive_precision=False, elastic_batch=True, oom_shrink=0.5, lr_rule="linear",
           batch_law="memory", oom_cooldown=1)


def _low_memory() -> tuple[int, int]:
    return 1, 1000


def _torch_epochs(epochs: int, inject: OOMInjector, fetch_oom_at: int | None = None) -> tuple[int, int]:
    from triaccel.backends.torch.data import ElasticLoader, elastic_step

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ctl = Controller(TriAccelConfig(**CFG), ["fc"])
    fetches = [0]

    def transform(x: torch.Tensor) -> torch.Tensor:
        fetches[0] += 1
        if fetches[0] == fetch_oom_at:   # a "real" OOM inside fetch (augmentation on the device)
            raise torch.OutOfMemoryError("CUDA out of memory (in the transform)")
        return x

    loader = ElasticLoader(torch.randn(N, 3), torch.zeros(N), batch_size=16, seed=0, transform=transform)

    def loss_fn(batch):
        inject.fire()
        x, y = batch
        return ((model(x).squeeze(1) - y) ** 2).mean()

    step = 0
    for _ in range(epochs):
        while True:
            inject.arm(step)
            res = elastic_step(loader, ctl, loss_fn, opt, step, probe=_low_memory)
            step += 1
            if res.end_of_epoch:
                break
    return step, loader.stats["ooms"]


def test_recorder_counts_each_index_once_per_epoch_torch() -> None:
    inject = OOMInjector(4, torch.OutOfMemoryError)
    rec = soak.IndexRecorder()
    with rec.installed("torch"):
        steps, survived = _torch_epochs(2, inject, fetch_oom_at=2)
    assert inject.injected >= 2
    assert rec.ooms_seen == survived == inject.injected + 1   # the transform's OOM too
    assert rec.step_mismatches == 0 and rec.steps == steps
    assert sorted(rec.counts) == [0, 1]
    assert all((c == 1).all() for c in rec.counts.values())


def test_recorder_restores_the_loader() -> None:
    from triaccel.backends.torch import data as tdata

    fetch, is_oom = tdata.ElasticLoader.fetch, tdata.is_oom
    with soak.IndexRecorder().installed("torch"):
        assert tdata.ElasticLoader.fetch is not fetch and tdata.is_oom is not is_oom
    assert tdata.ElasticLoader.fetch is fetch and tdata.is_oom is is_oom
    assert "complete" not in vars(tdata.ElasticLoader)


def test_recorder_counts_each_index_once_per_epoch_jax() -> None:
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from triaccel.backends.jax.data import OOM_ERROR_TYPES, ElasticLoader, elastic_step, is_oom

    inject = OOMInjector(3, OOM_ERROR_TYPES[0])
    assert is_oom(OOM_ERROR_TYPES[0]("RESOURCE_EXHAUSTED: x"))   # the demo's injected error is an OOM

    @jax.jit
    def vg(w, batch, mask):
        def loss(w):
            return jnp.sum((batch["x"] @ w) ** 2 * mask) / jnp.sum(mask)
        return jax.value_and_grad(loss)(w)

    w = jnp.ones(3)
    ctl = Controller(TriAccelConfig(**CFG, batch_buckets=(2, 4, 8, 16)), ["fc"])
    loader = ElasticLoader({"x": np.ones((N, 3), np.float32)}, batch_size=16, seed=0)
    rec = soak.IndexRecorder()

    def grad_fn(batch, mask):
        inject.fire()
        return vg(w, batch, mask)

    step = 0
    with rec.installed("jax"):
        for _ in range(2):
            while True:
                inject.arm(step)
                res = elastic_step(loader, ctl, grad_fn, step, probe=_low_memory)
                step += 1
                if res.end_of_epoch:
                    break
    assert inject.injected >= 2 and rec.ooms_seen == inject.injected == loader.stats["ooms"]
    assert rec.step_mismatches == 0 and sorted(rec.counts) == [0, 1]
    assert all((c == 1).all() for c in rec.counts.values())


def _result(**kw):
    base = dict(error=None, epochs_done=2, epochs_requested=2, samples_per_epoch_counted=[N, N],
                samples_per_epoch_log=[N, N], exactly_once_per_epoch=[True, True], step_mismatches=0,
                train_images=N, peak_alloc_bytes=None, ooms_injected=3, ooms_seen=3, ooms_in_step_records=3)
    return base | kw


def test_checks_flag_lost_or_repeated_samples_extra_ooms_and_peak() -> None:
    clean = _result(ooms_injected=0, ooms_seen=0, ooms_in_step_records=0)
    assert soak.checks(clean, "clean", 100, None) == {"finish": True, "samples": True, "peak": None, "ooms": True}
    assert soak.checks(_result(), "inject", 100, clean)["samples"]
    assert not soak.checks(_result(exactly_once_per_epoch=[True, False]), "inject", 100, clean)["samples"]
    assert not soak.checks(_result(samples_per_epoch_counted=[N, N - 1]), "inject", 100, clean)["samples"]
    assert not soak.checks(_result(ooms_seen=4), "inject", 100, clean)["ooms"]       # a real OOM too
    assert not soak.checks(_result(ooms_injected=0, ooms_seen=0, ooms_in_step_records=0), "inject", 100,
                           clean)["ooms"]                                             # nothing injected
    assert soak.checks(_result(peak_alloc_bytes=101), "inject", 100, clean)["peak"] is False
    failed = soak.checks(_result(error="OOMAtMinimumBatch: ...", epochs_done=1), "inject", 100, clean)
    assert failed["finish"] is False and failed["samples"] is False
