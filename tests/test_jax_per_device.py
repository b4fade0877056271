"""`sharding.per_device_value_and_grad` on a 2-device CPU mesh: torch DDP's data parallelism in JAX.

Each device's forward and backward run on its own half of the batch (BatchNorm normalises by the
half's statistics), so the result must equal two single-device computations on the halves, combined:
the summed losses and gradients over the total weight, the running statistics averaged. And it must
need fewer all-reduces than the automatic partitioning of the same loss, which reduces every
BatchNorm layer's statistics in both passes. Run in a subprocess (XLA's host device count is fixed
when jax starts), as tests/test_jax_sharding.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import two_devices


def _worker() -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    from triaccel.backends.jax.sharding import data_mesh, per_device_value_and_grad, shard_batch

    class Net(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.conv1, self.bn1 = nnx.Conv(3, 4, (3, 3), rngs=rngs), nnx.BatchNorm(4, rngs=rngs)
            self.conv2, self.bn2 = nnx.Conv(4, 4, (3, 3), rngs=rngs), nnx.BatchNorm(4, rngs=rngs)
            self.fc = nnx.Linear(4, 5, rngs=rngs)

        def __call__(self, x):
            h = jax.nn.relu(self.bn1(self.conv1(x)))
            return self.fc(jax.nn.relu(self.bn2(self.conv2(h))).mean(axis=(1, 2)))

    def ce_sum(m, x, y, mask):
        ce = optax.softmax_cross_entropy_with_integer_labels(m(x), y)
        return (ce * mask).sum(), mask.sum()

    mesh = data_mesh(2)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 6, 6, 3)).astype(np.float32)
    y = rng.integers(0, 5, 8).astype(np.int32)
    mask = np.array([1, 1, 1, 1, 1, 1, 1, 0], np.float32)   # one padded sample, masked out
    model, ref = Net(nnx.Rngs(0)), Net(nnx.Rngs(0))
    per_device = per_device_value_and_grad(ce_sum, mesh)
    loss, grads = nnx.jit(lambda m, *b: per_device(m, *b, scale=2.0))(model, *shard_batch((x, y, mask), mesh))

    total, parts, stats = 0.0, [], []
    for half in (slice(0, 4), slice(4, 8)):
        m = nnx.clone(ref)

        def lf(m):
            t, w = ce_sum(m, x[half], y[half], mask[half])
            return t, t

        (_, t), g = nnx.value_and_grad(lf, has_aux=True)(m)
        total += float(t)
        parts.append(g)
        stats.append(nnx.state(m, nnx.BatchStat))
    weight = float(mask.sum())
    expect = jax.tree_util.tree_map(lambda a, b: 2.0 * (a + b) / weight, *parts)
    mean_stats = jax.tree_util.tree_map(lambda a, b: (a + b) / 2, *stats)

    def max_diff(a, b):
        return max(float(jnp.abs(u - v).max()) for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))

    def all_reduces(loss_and_grad) -> int:
        graphdef, state = nnx.split(Net(nnx.Rngs(0)))

        def f(state, *b):
            return loss_and_grad(nnx.merge(graphdef, state), *b)

        return jax.jit(f).lower(state, *shard_batch((x, y, mask), mesh)).compile().as_text().count("all-reduce(")

    def global_loss(m, *b):
        def lf(m):
            t, w = ce_sum(m, *b)
            return t / w
        return nnx.value_and_grad(lf)(m)

    error = two_devices.value_error
    errors = {"mean_loss": error(lambda: nnx.jit(per_device_value_and_grad(
                  lambda m, x, y, mask: ce_sum(m, x, y, mask)[0] / 4, mesh))(Net(nnx.Rngs(0)), *shard_batch((x, y, mask), mesh))),
              "not_callable": error(lambda: per_device_value_and_grad("loss", mesh)),
              "not_a_mesh": error(lambda: per_device_value_and_grad(ce_sum, "data"))}
    return {"errors": errors, "loss": float(loss), "loss_expected": total / weight, "grad_diff": max_diff(grads, expect),
            "stat_diff": max_diff(nnx.state(model, nnx.BatchStat), mean_stats),
            "stats_moved": max_diff(nnx.state(model, nnx.BatchStat), nnx.state(ref, nnx.BatchStat)),
            "replicated": all(l.sharding.is_fully_replicated for l in jax.tree_util.tree_leaves(grads)),
            "all_reduce_per_device": all_reduces(per_device), "all_reduce_global": all_reduces(global_loss)}


@pytest.fixture(scope="module")
def result() -> dict:
    return two_devices.worker_result(__file__)


def test_equals_the_halves_computed_apart(result):
    assert result["loss"] == pytest.approx(result["loss_expected"], rel=1e-6)
    assert result["grad_diff"] < 1e-6 and result["replicated"]
    assert result["stats_moved"] > 1e-4 and result["stat_diff"] < 1e-7   # running statistics: the halves' mean


def test_bad_arguments_are_named(result):
    assert "fn: must return (loss_sum, weight)" in result["errors"]["mean_loss"]
    assert result["errors"]["not_callable"].startswith("fn=")
    assert "jax.sharding.Mesh" in result["errors"]["not_a_mesh"]


def test_fewer_all_reduces_than_global_statistics(result):
    # global: every BatchNorm layer's statistics reduced in the forward and the backward pass
    assert result["all_reduce_per_device"] < result["all_reduce_global"]
    assert result["all_reduce_global"] >= 4


DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "cifar10-jpeg"


@pytest.mark.skipif(not DATA.exists(), reason=f"CIFAR-10 image folder not found at {DATA}")
# per-device: 128 images, four steps of 32, the last one's OOM replayed in two micro-batches of 16 (each
# step size after it would be one more ~25 s compilation of the fused step on 2 CPU cores)
@pytest.mark.parametrize("stats, extra", [("per-device", ["--inject-oom-every", "4", "--train-subset", "128"]),   # an OOM in a fused step
                                          # the pad floor, as the demo's default sets it on GPUs
                                          ("global", ["--pad-floor", "largest", "--batch-max", "64",
                                                      "--train-subset", "192"])])
def test_demo_trains_on_two_devices(tmp_path, stats, extra):
    out = tmp_path / "run"
    args = ["--backend", "jax", "--devices", "2", "--batch-stats", stats, "--method", "triaccel", "--data", str(DATA),
            "--epochs", "1", "--test-subset", "64", "--batch", "32", "--width", "0.125",
            "--t-ctrl", "2", "--warmup-steps", "2", "--no-progress", "--device", "cpu", "--compile-cache", "off", *extra]
    images = int(extra[extra.index("--train-subset") + 1])
    two_devices.run_demo([*args, "--out", str(out)], timeout=600)
    summary = json.loads((out / "summary.json").read_text())
    steps = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    assert summary["devices"] == 2 and summary["options"]["batch_stats"] == stats
    assert summary["fused_step"] is True   # auto: one program per plain step over a mesh
    assert summary["pad_floor"] == (64 if stats == "global" else None)
    assert (summary["injected_ooms"] >= 1) == (stats == "per-device")
    assert sum(r["samples"] for r in steps if r["type"] == "step") == images   # every image once
    assert 0.0 <= summary["final_acc"] <= 1.0
    if stats == "per-device":   # the two programs per step train the same steps, the same losses
        two_devices.run_demo([*args, "--fused-step", "off", "--out", str(tmp_path / "off")], timeout=600)
        off = [json.loads(x) for x in (tmp_path / "off" / "log.jsonl").read_text().splitlines()]
        assert json.loads((tmp_path / "off" / "summary.json").read_text())["fused_step"] is False
        assert [r["loss"] for r in off if r["type"] == "step"] == \
            pytest.approx([r["loss"] for r in steps if r["type"] == "step"], rel=1e-4)


def test_dp_probe_smoke(tmp_path):
    """benchmarks/device/jax_dp_probe.py --smoke: one and two devices, both statistics, one row each."""
    env_out = {"OUT": str(tmp_path)}
    two_devices.run(["benchmarks/device/jax_dp_probe.py", "--smoke", "--per-device", "4", "--steps", "1",
                     "--width", "0.125"], env=env_out)
    rows = json.loads((tmp_path / "jax_dp_probe.json").read_text())
    assert [(r["loop"], r["devices"], r["stats"]) for r in rows] == [
        ("fused", 1, "global"), ("fused", 2, "global"), ("fused", 2, "per-device")]
    assert all(r["wall_ms"] > 0 and r["img_s"] > 0 for r in rows)


def test_dp_probe_loops_smoke(tmp_path):
    """jax_dp_probe.py --loops: every loop from one program to the demo's per-step pattern runs on one
    and two devices (the fed loops gather from a replicated dataset into the batch sharding). The
    compilation cache: fed, in-flight and waiting build the same two programs, fused-fed and fused-np
    the same one, compiled once per device count (each ResNet-18 compilation some seconds on 2 cores)."""
    two_devices.run(["benchmarks/device/jax_dp_probe.py", "--smoke", "--per-device", "4", "--steps", "2",
                     "--width", "0.125", "--stats", "global", "--loops", "split", "fed", "in-flight", "waiting",
                     "fused-fed", "fused-np", "--compile-cache", str(tmp_path / "jax-cache")],
                    env={"OUT": str(tmp_path)})
    rows = json.loads((tmp_path / "jax_dp_probe.json").read_text())
    assert [(r["loop"], r["devices"]) for r in rows] == [
        (loop, n) for loop in ("split", "fed", "in-flight", "waiting", "fused-fed", "fused-np") for n in (1, 2)]
    assert all(r["host_ms"] for r in rows)   # each part of each loop timed
    assert all(r["wall_ms"] > 0 and r["img_s"] > 0 for r in rows)


if __name__ == "__main__":
    print(json.dumps(_worker()))
