"""Real device out-of-memory errors with a step in flight (`triaccel.backends.jax.data.InFlight`), GPU.

    python3 benchmarks/device/jax_in_flight_oom.py      # GPU machine, after prep.sh

A step whose temporaries grow with the batch (a sort over per-sample outer products), the device
filled but for --free MiB, the paper's memory batch law told that memory is always free, so the batch
climbs one bucket per step until the device runs out. The same two epochs run twice from the same
weights: waiting for every step (an OOM surfaces inside the step) and with a step in flight (the OOM
surfaces at the next step's start: state restored, samples replayed). Prints, for both, the OOMs
seen, the samples per epoch, and whether the final weights are equal.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # benchmarks/: the shared helpers
from _results import write_to_out  # noqa: E402
import numpy as np

from triaccel import Controller, TriAccelConfig
from triaccel.backends.jax.data import ElasticLoader, InFlight, elastic_step

N, D = 4096, 256
BUCKETS = (64, 128, 256, 512, 1024, 2048)


def loss_of(params, batch, mask):
    h = batch["x"] @ params["w"]
    outer = jnp.einsum("bi,bj->bij", h, h).reshape(h.shape[0], -1)    # B x 256 KiB, materialised by the sort
    top = jnp.sort(outer, axis=1)[:, -4:].sum(axis=1)
    return jnp.sum(jnp.tanh(top) * mask) / jnp.maximum(mask.sum(), 1.0)


_vg = jax.jit(jax.value_and_grad(loss_of))
_upd = jax.jit(lambda p, g: jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, p, g))


def warm() -> None:
    """Compile every bucket's step before the device is filled (a compilation's own scratch would
    run out of memory at the call, the case `elastic_step` already handles)."""
    p = {"w": jnp.eye(D, dtype=jnp.float32)}
    for b in BUCKETS:
        g = _vg(p, {"x": jnp.zeros((b, D), jnp.float32), "id": jnp.zeros((b,), jnp.int32)}, jnp.ones((b,), jnp.float32))[1]
        jax.block_until_ready(_upd(p, g))


def train(arrays: dict, in_flight: bool, epochs: int) -> dict:
    cfg = TriAccelConfig(batch_law="memory", t_ctrl=1, batch_init=64, batch_min=64, batch_max=2048,
                         batch_multiple=8, batch_buckets=BUCKETS, rho_low=0.6, rho_high=0.85,
                         curvature="off", adaptive_precision=False, oom_shrink=0.5, lr_rule="none",
                         oom_cooldown=None)
    ctl = Controller(cfg, ["fc"])
    loader = ElasticLoader(arrays, batch_size=64, seed=3)
    state = {"params": {"w": jnp.eye(D, dtype=jnp.float32) * 0.1}}
    def update(grads, decision):
        state["params"] = _upd(state["params"], grads)

    def restore(p):
        state["params"] = p

    pipe = InFlight(lambda: state["params"], restore) if in_flight else None
    sizes, step, per_epoch = [], 0, {}
    while True:
        res = elastic_step(loader, ctl, lambda b, m: _vg(state["params"], b, m), step,
                           probe=lambda: (0, 80 * 2**30), update_fn=update, in_flight=pipe)
        per_epoch[res.epoch] = per_epoch.get(res.epoch, 0) + res.samples
        sizes.append(res.decision.batch_size)
        step += 1
        if res.end_of_epoch and res.epoch == epochs - 1:
            break
    if pipe is not None:
        pipe.settle()
    w = np.asarray(state["params"]["w"])
    return {"ooms": loader.stats["ooms"], "late_ooms": pipe.lagged_ooms if pipe else 0,
            "samples_per_epoch": per_epoch, "batches": sizes, "steps": step, "w": w}


def fill(free_mib: int) -> list:
    """Hold all device memory but about `free_mib` MiB: blocks of 1 GiB, then of 32 MiB, until an
    allocation fails, then release 32 MiB blocks (one allocation of the whole would need one free
    region that large)."""
    held: list = []
    for size in (2**30, 32 * 2**20):
        while True:
            try:
                held.append(jnp.ones((size // 4,), jnp.float32).block_until_ready())
            except Exception:  # the allocator's RESOURCE_EXHAUSTED
                break
            if size == 2**30 and len(held) > 200:
                break
    for _ in range(max(1, free_mib // 32)):
        held.pop()
    return held


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--free", type=int, default=160, help="MiB left free on the device")
    ap.add_argument("--epochs", type=int, default=2)
    a = ap.parse_args()
    dev = jax.devices()[0]
    rng = np.random.default_rng(0)
    arrays = {"x": jax.device_put(rng.normal(size=(N, D)).astype(np.float32)),
              "id": jax.device_put(np.arange(N, dtype=np.int32))}
    warm()
    held = fill(a.free)
    rows = {name: train(arrays, name == "in flight", a.epochs) for name in ("waiting", "in flight")}
    del held
    same = bool(np.array_equal(rows["waiting"]["w"], rows["in flight"]["w"]))
    print(f"# {dev.device_kind}, jax {jax.__version__}, {a.free} MiB free, {N} samples x {a.epochs} epochs")
    for name, r in rows.items():
        print(f"{name:<10} OOMs {r['ooms']} (late {r['late_ooms']}), samples per epoch {r['samples_per_epoch']}, "
              f"steps {r['steps']}, batches {r['batches'][:12]}...")
    print(f"final weights equal: {same}")
    write_to_out("jax_in_flight_oom.json", {"device": dev.device_kind, "jax": jax.__version__, "free_mib": a.free,
                                            "weights_equal": same,
                                            "rows": {k: {kk: vv for kk, vv in v.items() if kk != "w"}
                                                     for k, v in rows.items()}})


if __name__ == "__main__":
    main()
