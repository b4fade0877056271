"""100 injected out-of-memory errors within one epoch, in both backends: no sample lost or repeated.

torch: `triaccel.backends.torch.data.ElasticLoader` + `elastic_step`, `torch.OutOfMemoryError`
raised by loss_fn on chosen calls. JAX: `triaccel.backends.jax.data.ElasticLoader` + `elastic_step`,
a runtime error of `OOM_ERROR_TYPES` with RESOURCE_EXHAUSTED in its message (`is_oom` is true for
it) raised by grad_fn on chosen calls. Data: 2,000 samples of 4 features, a linear model. The
controller's memory law grows the batch whenever memory reads low (it always does here), and
`oom_cooldown` lifts the cap an OOM puts on growth, so the batch grows back between OOMs.

Every sample index a completed step used is counted (the ids of the micro-batches whose forward
pass returned, kept only when the step completes): over the epoch each of the 2,000 indices must be
used exactly once. An OOM at the smallest batch raises `OOMAtMinimumBatch` with a clear message;
the samples of the steps completed before it stay completed in the loader's state, the failed
step's samples go back to the front of the queue, and the epoch still ends with every sample used
exactly once.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
from rel_util import config, memory_law

from triaccel import Controller, OOMAtMinimumBatch

N, D = 2000, 4
N_OOMS = 100
BUCKETS = (8, 16, 24, 32, 48, 64, 96, 128)


def cfg_for(backend: str, **kw: Any):
    base = dict(t_ctrl=1, batch_init=64, batch_min=8, batch_max=128, batch_multiple=8, delta_up=32,
                delta_down=8, oom_shrink=0.75, oom_cooldown=1, curvature="off", adaptive_precision=False,
                lr_rule="linear", **memory_law())
    base |= kw
    if backend == "jax":
        base["batch_buckets"] = tuple(b for b in BUCKETS if b <= base["batch_max"])
    return config(**base)


class Injector:
    """Decides which forward calls raise: every `period`-th call while the batch in force is above
    batch_min (so that these OOMs are survivable), until `budget` OOMs were raised; or, when
    `calls` is a set, exactly the calls it lists, whatever the batch."""

    def __init__(self, ctl: Controller, budget: int = N_OOMS, period: int = 1, calls: set[int] | None = None):
        self.ctl, self.budget, self.period, self.calls = ctl, budget, period, calls
        self.n_calls = self.injected = 0
        self.batch_at_oom: list[int] = []

    def fire(self) -> bool:
        self.n_calls += 1
        b = self.ctl.decision.batch_size
        if self.calls is not None:
            hit = self.n_calls in self.calls
        else:
            hit = self.injected < self.budget and b > self.ctl.config.batch_min and self.n_calls % self.period == 0
        if hit:
            self.injected += 1
            self.batch_at_oom.append(b)
        return hit


# -- backends ---------------------------------------------------------------------------------------
class TorchRun:
    def __init__(self, cfg: Any, seed: int = 0) -> None:
        import torch

        from triaccel.backends.torch.data import ElasticLoader
        self.torch = torch
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(N, D, generator=g)
        self.y = self.x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1 * torch.randn(N, generator=g)
        torch.manual_seed(seed)
        self.model = torch.nn.Linear(D, 1)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.ctl = Controller(cfg, ["fc"])
        self.loader = ElasticLoader(torch.arange(N), batch_size=cfg.batch_init, seed=seed)
        self.inj = Injector(self.ctl)
        self.step_ids: list[int] = []

    def loss_fn(self, ids: Any) -> Any:
        if self.inj.fire():
            raise self.torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        self.step_ids.extend(ids.tolist())
        pred = self.model(self.x[ids]).squeeze(1)
        return ((pred - self.y[ids]) ** 2).mean()

    def step(self, step: int) -> Any:
        from triaccel.backends.torch.data import elastic_step
        self.step_ids = []
        res = elastic_step(self.loader, self.ctl, self.loss_fn, self.opt, step, probe=lambda: (1, 10**9))
        res.loss = float(res.loss)
        return res

    def finite(self) -> bool:
        return all(bool(p.isfinite().all()) for p in self.model.parameters())


class JaxRun:
    def __init__(self, cfg: Any, seed: int = 0) -> None:
        import jax
        import jax.numpy as jnp

        from triaccel.backends.jax.data import ElasticLoader
        self.jax, self.jnp = jax, jnp
        rng = np.random.default_rng(seed)
        x = rng.normal(size=(N, D)).astype(np.float32)
        y = (x @ np.array([1.0, -2.0, 0.5, 3.0], np.float32) + 0.1 * rng.normal(size=N)).astype(np.float32)
        self.params = {"w": jnp.zeros(D), "b": jnp.zeros(())}
        self.ctl = Controller(cfg, ["fc"])
        self.loader = ElasticLoader({"x": x, "y": y, "id": np.arange(N, dtype=np.int32)},
                                    batch_size=cfg.batch_init, seed=seed)
        self.inj = Injector(self.ctl)
        self.step_ids: list[int] = []

        def loss(p: Any, batch: Any, mask: Any) -> Any:
            pred = batch["x"] @ p["w"] + p["b"]
            return jnp.sum((pred - batch["y"]) ** 2 * mask) / jnp.sum(mask)
        self._vg = jax.jit(jax.value_and_grad(loss))

    @staticmethod
    def oom_error() -> BaseException:
        from triaccel.backends.jax.data import OOM_ERROR_TYPES, is_oom
        err = OOM_ERROR_TYPES[0]("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 2147483648 "
                                 "bytes. (injected)")
        assert is_oom(err)
        return err

    def grad_fn(self, batch: Any, mask: Any) -> Any:
        if self.inj.fire():
            raise self.oom_error()
        self.step_ids.extend(np.asarray(batch["id"])[np.asarray(mask) > 0].tolist())
        return self._vg(self.params, batch, mask)

    def update(self, grads: Any, decision: Any) -> Any:
        lr = 0.05 * decision.lr_batch_scale
        self.params = self.jax.tree_util.tree_map(lambda p, g: p - lr * g, self.params, grads)
        return self.params

    def step(self, step: int) -> Any:
        from triaccel.backends.jax.data import elastic_step
        self.step_ids = []
        res = elastic_step(self.loader, self.ctl, self.grad_fn, step, probe=lambda: (1, 10**9),
                           update_fn=self.update)
        res.loss = float(res.loss)
        return res

    def finite(self) -> bool:
        return all(bool(np.isfinite(np.asarray(v)).all()) for v in self.jax.tree_util.tree_leaves(self.params))


RUNS = {"torch": TorchRun, "jax": JaxRun}


def _backend(name: str, monkeypatch: Any) -> list[int]:
    """Skip without the framework; replace the backend's free_memory (a full gc.collect(), 0.2-0.3 s
    per call in a process that has imported torch and JAX: 100 OOMs would cost half a minute) by a
    counting stub. Returns the list whose length is the number of free_memory calls."""
    pytest.importorskip("torch" if name == "torch" else "jax")
    import importlib
    mod = importlib.import_module(f"triaccel.backends.{name}.data")
    calls: list[int] = []
    monkeypatch.setattr(mod, "free_memory", lambda: calls.append(1))
    return calls


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_100_ooms_in_one_epoch_no_sample_lost_or_repeated(backend: str, figures: dict, monkeypatch: Any) -> None:
    freed = _backend(backend, monkeypatch)
    cfg = cfg_for(backend)
    r = RUNS[backend](cfg)
    used: Counter = Counter()
    sizes, ooms_per_step, losses = [], [], []
    step = 0
    while True:
        res = r.step(step)
        assert res.epoch == 0
        assert len(r.step_ids) == res.samples     # ids of the micro-batches that ran, replays included once
        used.update(r.step_ids)
        sizes.append(res.decision.batch_size)
        ooms_per_step.append(res.ooms)
        losses.append(res.loss)
        step += 1
        if res.end_of_epoch:
            break
    lost = N - len(used)
    repeated = sum(c - 1 for c in used.values() if c > 1)
    assert sorted(used) == list(range(N)) and lost == 0 and repeated == 0
    assert r.inj.injected == N_OOMS == sum(ooms_per_step) == r.loader.stats["ooms"] == r.ctl.report()["ooms"]
    assert r.loader.stats["samples"] == N and r.loader.sampler.in_flight == 0
    assert len(freed) == N_OOMS                     # memory released once per OOM
    # the batch grows back after OOMs (cooldown) and an OOM never hit the minimum
    last_oom = max(i for i, o in enumerate(ooms_per_step) if o)
    assert min(r.inj.batch_at_oom) > cfg.batch_min
    assert max(sizes) == cfg.batch_max and any(b > cfg.batch_min for b in sizes[last_oom + 1:] or [cfg.batch_max])
    # training continues: a second epoch without OOMs, finite parameters, a lower loss
    first_epoch_steps = step
    while True:
        res = r.step(step)
        step += 1
        if res.end_of_epoch:
            break
    assert res.epoch == 1 and r.finite() and np.isfinite(losses).all()
    assert res.loss < losses[0]
    figures[f"oom_{backend}"] = {
        "samples": N, "ooms_injected": r.inj.injected, "samples_lost": lost, "samples_repeated": repeated,
        "steps_epoch0": first_epoch_steps, "steps_with_oom": sum(1 for o in ooms_per_step if o),
        "max_ooms_in_one_step": max(ooms_per_step), "samples_replayed": r.loader.stats["replayed"],
        "batch_sizes_seen": sorted(set(sizes)), "epoch1_completed": True}


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_oom_at_smallest_batch_is_a_clear_error_and_keeps_completed_samples(backend: str, figures: dict,
                                                                          monkeypatch: Any) -> None:
    _backend(backend, monkeypatch)
    cfg = cfg_for(backend, batch_init=16, batch_max=16, oom_cooldown=None)
    r = RUNS[backend](cfg)
    r.inj.calls = set()                         # no OOM but the two scripted below
    used: Counter = Counter()
    for step in range(5):                       # 5 steps at 16 complete (80 samples)
        r.step(step)
        used.update(r.step_ids)
    completed_before = r.loader.sampler.completed
    assert completed_before == 80
    # the next call fails (16 -> 8), and so does its replay at batch_min = 8
    r.inj.calls = {r.inj.n_calls + 1, r.inj.n_calls + 2}
    with pytest.raises(OOMAtMinimumBatch) as ei:
        r.step(5)
    msg = str(ei.value)
    assert "batch_min" in msg and "8" in msg
    assert r.loader.sampler.completed == completed_before and r.loader.sampler.in_flight == 0
    assert r.loader.stats["samples"] == completed_before
    failed = r.loader.sampler.state_dict()["pending"]
    assert len(failed) == 16 and not set(failed) & set(used)     # put back, to be replayed first
    # training goes on at batch_min; the epoch ends with every sample used exactly once
    step = 6
    first_after = None
    while True:
        res = r.step(step)
        if first_after is None:
            first_after = list(r.step_ids)
        used.update(r.step_ids)
        step += 1
        if res.end_of_epoch:
            break
    assert first_after == failed[:len(first_after)]              # the failed samples come first
    assert sorted(used) == list(range(N)) and set(used.values()) == {1}
    figures[f"oom_at_min_{backend}"] = {
        "error": type(ei.value).__name__, "completed_kept": completed_before, "put_back": len(failed),
        "samples_lost": N - len(used), "samples_repeated": sum(c - 1 for c in used.values())}
