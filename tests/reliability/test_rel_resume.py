"""Mid-epoch save and resume, both backends: bit-identical to an uninterrupted run.

One run trains N+M steps. Another trains N steps, saves everything to a file in a safe format,
throws every object away, builds all of them fresh (from a *different* seed, so nothing survives by
accident), loads the file and trains M more steps. Parameters must be bit-identical.

What the checkpoint carries: the model, the wrapped optimizer (inner optimizer state, controller,
loss scale, pending statistics, curvature warm starts), the elastic loader (epoch, position,
counters), the random state (torch's global generator, used by dropout and the data transform; the
JAX PRNG key its dropout draws from) and the test's own OOM-injection counter. The run exercises every lever on CPU:
precision law, curvature (torch: Hessian every 5 steps), the elastic batch (a fake memory reading
lets the batch grow), an injected OOM before the save, an LR ramp; variants with base precision
fp32 (the "uninterrupted fp32 CPU run" of the issue) and fp16 (the loss scale is then live).

Bit-identical needs deterministic kernels: tests/conftest.py sets MKL_CBWR=COMPATIBLE, MKL's
reproducible mode (torch's CPU BLAS otherwise differs by 1 ulp-scale amounts between buffers on some
CPUs; a user resuming on such a machine gets the same run to within that rounding).

Formats: torch: `torch.save`, then `torch.load(weights_only=True)`: the state dicts must load
without unpickling arbitrary objects. JAX: `flax.serialization.to_bytes` (msgpack) for the arrays
and JSON for the host state; no pickle.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from rel_util import config, memory_law

N_SAMPLES, D = 400, 4
N_STEPS, M_STEPS = 7, 9
OOM_CALL = 4    # the 4th forward call raises an out-of-memory error (before the save)


def cfg(base: str, **kw: Any) -> Any:
    return config(base_precision=base, t_ctrl=2, warmup_steps=2, min_dwell=2, batch_init=16, batch_min=8,
                  batch_max=64, batch_multiple=8, delta_up=8, delta_down=8, oom_shrink=0.5, oom_cooldown=3,
                  lr_rule="linear", lr_ramp_steps=3, memory_budget=10**6, **memory_law(), **kw)


def used_bytes(batch: int) -> int:
    return 100_000 + 5_000 * batch      # modelled peak: fixed + per-sample


# -- torch ------------------------------------------------------------------------------------------
class TorchTrainer:
    def __init__(self, base: str, init_seed: int) -> None:
        import torch

        from triaccel.backends.torch import MemoryReading, wrap
        from triaccel.backends.torch.data import ElasticLoader
        self.torch = torch
        g = torch.Generator().manual_seed(123)
        self.x = torch.randn(N_SAMPLES, D, generator=g)
        self.y = torch.randint(0, 3, (N_SAMPLES,), generator=g)
        torch.manual_seed(init_seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(D, 16), torch.nn.Dropout(0.2), torch.nn.Tanh(),
                                         torch.nn.Linear(16, 3))
        inner = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4)

        trainer = self

        class FakeProbe:        # the MemoryProbe protocol: read() -> MemoryReading | None
            def read(self) -> Any:
                u = used_bytes(trainer.loader.batch_size)
                return MemoryReading(used_bytes=u, limit_bytes=2 * 10**6, total_bytes=2 * 10**6,
                                     free_bytes=2 * 10**6 - u, reserved_bytes=u, others_bytes=0)

        cg = torch.Generator().manual_seed(7)
        curv = (torch.randn(16, D, generator=cg), torch.randint(0, 3, (16,), generator=cg))
        self.opt = wrap(inner, self.model, cfg(base, curvature="hessian", t_curv=5, top_k=2, b_curv=16),
                        curvature_data=curv, memory_probe=FakeProbe())
        self.loader = ElasticLoader(self.x, self.y, batch_size=16, seed=5,
                                    transform=lambda t: t + 0.01 * torch.randn_like(t))   # global RNG
        self.calls = 0

    def loss_fn(self, batch: Any) -> Any:
        from torch.nn import functional as F
        self.calls += 1
        if self.calls == OOM_CALL:
            raise self.torch.OutOfMemoryError("CUDA out of memory (injected)")
        xb, yb = batch
        with self.opt.autocast():
            return F.cross_entropy(self.model(xb), yb)

    def train(self, steps: int) -> None:
        from triaccel.backends.torch.data import elastic_step
        for _ in range(steps):
            elastic_step(self.loader, self.opt.controller, self.loss_fn, self.opt, self.opt.step_count,
                         scaler=self.opt, apply_lr_batch_scale=False,
                         optimizer_step=lambda d: self.opt.step_accumulated())

    def save(self, path: Any) -> None:
        self.torch.save({"model": self.model.state_dict(), "opt": self.opt.state_dict(),
                         "loader": self.loader.state_dict(), "rng": self.torch.get_rng_state(),
                         "calls": self.calls}, path)

    def load(self, path: Any) -> None:
        ck = self.torch.load(path, weights_only=True)      # safe unpickler: tensors and plain containers
        self.model.load_state_dict(ck["model"])
        self.opt.load_state_dict(ck["opt"])
        self.loader.load_state_dict(ck["loader"])
        self.torch.set_rng_state(ck["rng"])
        self.calls = ck["calls"]

    def params_list(self) -> list[np.ndarray]:
        return [p.detach().numpy().copy() for p in self.model.parameters()]

    def summary(self) -> dict:
        rep = self.opt.report()
        return {"steps": self.opt.step_count, "batch": self.opt.decision.batch_size,
                "ooms": rep["ooms"], "epoch": self.loader.epoch,
                "cursor": self.loader.sampler.state_dict()["cursor"]}


# -- JAX --------------------------------------------------------------------------------------------
_JAX_FNS: dict = {}


def _jax_fns() -> dict:
    """Module-level jitted loss/grad (shared by every trainer, so it compiles once per shape)."""
    if not _JAX_FNS:
        import jax
        import jax.numpy as jnp

        def loss(p: Any, batch: Any, mask: Any, key: Any) -> Any:
            h = jnp.tanh(batch["x"] @ p["l1"]["kernel"] + p["l1"]["bias"])
            keep = jax.random.bernoulli(key, 0.8, h.shape)          # dropout: the PRNG key matters
            h = jnp.where(keep, h / 0.8, 0.0)
            logits = h @ p["l2"]["kernel"] + p["l2"]["bias"]
            nll = -(jax.nn.one_hot(batch["y"], 3) * jax.nn.log_softmax(logits)).sum(-1)
            return jnp.sum(nll * mask) / jnp.sum(mask)

        _JAX_FNS["vg"] = jax.jit(lambda p, b, m, k, s: jax.value_and_grad(lambda q: loss(q, b, m, k) * s)(p))
    return _JAX_FNS


class JaxTrainer:
    BUCKETS = (8, 16, 32, 64)   # few shapes: each is an XLA compilation

    def __init__(self, base: str, init_seed: int) -> None:
        import jax
        import jax.numpy as jnp
        import optax

        from triaccel.backends.jax import wrap
        from triaccel.backends.jax.data import ElasticLoader
        self.jax, self.jnp, self.optax = jax, jnp, optax
        rng = np.random.default_rng(123)
        arrays = {"x": rng.normal(size=(N_SAMPLES, D)).astype(np.float32),
                  "y": rng.integers(0, 3, N_SAMPLES).astype(np.int32)}
        r = np.random.default_rng(init_seed)
        self.params = {"l1": {"kernel": jnp.asarray(r.normal(size=(D, 16)) / 2, jnp.float32), "bias": jnp.zeros(16)},
                       "l2": {"kernel": jnp.asarray(r.normal(size=(16, 3)) / 4, jnp.float32), "bias": jnp.zeros(3)}}
        self.key = jax.random.PRNGKey(init_seed)
        self.tx = wrap(optax.chain(optax.add_decayed_weights(1e-4), optax.sgd(0.05, momentum=0.9, nesterov=True)),
                       cfg(base, batch_buckets=self.BUCKETS))
        self.ta = self.tx.host
        self.state = self.tx.init(self.params)
        self.upd = jax.jit(self.tx.update)
        self.loader = ElasticLoader(arrays, batch_size=16, seed=5)
        self.calls = 0
        self.step_count = 0

    def train(self, steps: int) -> None:
        from triaccel.backends.jax import loss_scale
        from triaccel.backends.jax.data import OOM_ERROR_TYPES, elastic_step
        vg = _jax_fns()["vg"]
        for _ in range(steps):
            s = self.step_count
            self.state = self.tx.control(s, self.state)
            self.key, sub = self.jax.random.split(self.key)
            scale = loss_scale(self.state)

            def grad_fn(batch: Any, mask: Any) -> Any:
                self.calls += 1
                if self.calls == OOM_CALL:
                    raise OOM_ERROR_TYPES[0]("RESOURCE_EXHAUSTED: out of memory (injected)")
                loss, g = vg(self.params, batch, mask, sub, scale)
                return loss / scale, g

            def update_fn(grads: Any, decision: Any) -> Any:
                updates, self.state = self.upd(grads, self.state, self.params)
                self.params = self.optax.apply_updates(self.params, updates)

            elastic_step(self.loader, self.ta.controller, grad_fn, s, update_fn=update_fn,
                         probe=lambda: (used_bytes(self.loader.batch_size), 2 * 10**6))
            self.step_count += 1

    def save(self, path: Any) -> None:
        from flax import serialization
        path.with_suffix(".msgpack").write_bytes(serialization.to_bytes(
            {"params": self.params, "opt_state": self.state, "key": self.key}))
        path.with_suffix(".json").write_text(json.dumps(
            {"ta": self.ta.state_dict(), "loader": self.loader.state_dict(), "calls": self.calls,
             "step": self.step_count}, allow_nan=False))

    def load(self, path: Any) -> None:
        from flax import serialization
        arrays = serialization.from_bytes({"params": self.params, "opt_state": self.state, "key": self.key},
                                          path.with_suffix(".msgpack").read_bytes())
        self.params, self.state, self.key = arrays["params"], arrays["opt_state"], arrays["key"]
        host = json.loads(path.with_suffix(".json").read_text())
        self.ta.load_state_dict(host["ta"])
        self.loader.load_state_dict(host["loader"])
        self.calls, self.step_count = host["calls"], host["step"]

    def params_list(self) -> list[np.ndarray]:
        return [np.asarray(v) for v in self.jax.tree_util.tree_leaves(self.params)]

    def summary(self) -> dict:
        d = self.ta.controller.decision
        return {"steps": self.step_count, "batch": d.batch_size, "ooms": self.ta.controller.report()["ooms"],
                "epoch": self.loader.epoch, "cursor": self.loader.sampler.state_dict()["cursor"]}


TRAINERS = {"torch": TorchTrainer, "jax": JaxTrainer}


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("base", ["fp32", "fp16"])
@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_mid_epoch_resume_is_bit_identical(backend: str, base: str, tmp_path: Any, figures: dict,
                                           monkeypatch: Any) -> None:
    pytest.importorskip("torch" if backend == "torch" else "flax")
    if backend == "torch":   # the statistics kernel's torch reference (the interpreter: 0.1-0.4 s/step)
        from triaccel.kernels import _dispatch
        monkeypatch.setattr(_dispatch, "interpreter_enabled", lambda: False)
    import importlib   # free_memory is a full gc.collect() (0.2-0.3 s here); the OOM path is tested in test_rel_oom
    monkeypatch.setattr(importlib.import_module(f"triaccel.backends.{backend}.data"), "free_memory", lambda: None)
    T = TRAINERS[backend]
    ref = T(base, init_seed=0)
    ref.train(N_STEPS + M_STEPS)
    want = ref.params_list()

    a = T(base, init_seed=0)
    a.train(N_STEPS)
    mid = a.summary()
    assert 0 < mid["cursor"] < N_SAMPLES and mid["ooms"] == 1     # saved mid-epoch, after the OOM
    a.save(tmp_path / "ckpt")
    del a
    b = T(base, init_seed=99)          # different initial weights and RNG: all state comes from the file
    b.load(tmp_path / "ckpt")
    b.train(M_STEPS)
    got = b.params_list()
    end = b.summary()
    assert end == ref.summary()
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and np.array_equal(g, w), f"max |diff| {np.max(np.abs(g - w))}"
    figures.setdefault("resume", {})[f"{backend}/{base}"] = (
        f"{N_STEPS}+{M_STEPS} steps, saved at sample {mid['cursor']}/{N_SAMPLES} of epoch {mid['epoch']} "
        f"(batch {mid['batch']}, 1 OOM before), final batch {end['batch']}: bit-identical")
