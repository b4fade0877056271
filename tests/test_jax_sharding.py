"""JAX data parallelism (backends/jax/sharding.py): a 2-device mesh gives what one device gives on the
same global batch, decisions included.

JAX fixes its device count when it starts and this pytest process may have started it already, so
the runs happen in one subprocess (this file run as a script) with
``XLA_FLAGS=--xla_force_host_platform_device_count=2`` set before jax is imported: the same training
loop as the CIFAR demo (SplitStep with compile-ahead, a bound optimizer update, ElasticLoader,
elastic_step) once on one device without a mesh and once on a mesh of both, for a few steps with
precision decisions, gradient-noise split steps and an injected OOM (a batch change); plus the
errors for bad device counts and batch sizes.
"""

from __future__ import annotations

import json
import os

import pytest

import two_devices

STEPS = 6             # FP32 runs: losses and parameters compared tightly
OOM_CALL = 5          # the micro-batch call that raises RESOURCE_EXHAUSTED (in both FP32 runs: step 3)
STEPS_16 = 4          # runs with the precision lever on (16-bit rounding: decisions compared)


def _worker() -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    from triaccel import TriAccelConfig
    from triaccel.backends.jax import SplitStep, TriAccel, loss_scale
    from triaccel.backends.jax.data import ElasticLoader, InFlight, elastic_step
    from triaccel.backends.jax.sharding import (batch_sharding, check_divides, data_mesh, num_shards, replicate,
                                                shard_batch)

    assert len(jax.devices()) == 2, jax.devices()

    class Net(nnx.Module):
        def __init__(self) -> None:
            self.conv = nnx.Conv(3, 8, (3, 3), use_bias=False, rngs=nnx.Rngs(0))  # BN follows
            self.bn = nnx.BatchNorm(8, rngs=nnx.Rngs(1))
            self.fc1 = nnx.Linear(8, 16, rngs=nnx.Rngs(2))
            self.fc2 = nnx.Linear(16, 4, rngs=nnx.Rngs(3))

        def __call__(self, x: jax.Array) -> jax.Array:
            # smooth (no ReLU kink): a one-ulp difference between the two programs stays one ulp
            h = jax.nn.gelu(self.bn(self.conv(x))).mean(axis=(1, 2))
            return self.fc2(jnp.tanh(self.fc1(h)))

    def config(**kw: object) -> TriAccelConfig:
        base = dict(precision_law="variance", min_dwell=0, warmup_steps=2, t_ctrl=2, base_precision="bf16",
                    batch_law="noise", t_noise=1, noise_beta=0.0, batch_init=16, batch_min=8, batch_max=32,
                    batch_multiple=8, batch_buckets=(8, 16, 32), lr_rule="linear", curvature="off")
        return TriAccelConfig(**{**base, **kw})

    rng = np.random.default_rng(0)
    xs = rng.normal(size=(120, 6, 6, 3)).astype(np.float32)
    ys = rng.integers(0, 4, size=120).astype(np.int32)

    def run(mesh: object, compile_ahead: bool, steps: int, oom_call: int | None, in_update: bool = False,
            **cfg_kw: object) -> dict:
        """in_update: every step one program with a step in flight, the noise halves measured in the
        wrapped update (TriAccel(noise_in_update=True), elastic_step(noise_step_fn=...)), as the demo."""
        cfg = config(**cfg_kw)
        model = Net()
        ta = TriAccel(cfg, model, mesh=mesh, noise_in_update=in_update)
        opt = nnx.Optimizer(model, ta.wrap(optax.sgd(0.05, momentum=0.9)), wrt=nnx.Param)

        def grad_body(m, o, x, y, mask):
            scale = loss_scale(o.opt_state)

            def lf(m):
                ce = optax.softmax_cross_entropy_with_integer_labels(m(x).astype(jnp.float32), y)
                loss = (ce * mask).sum() / jnp.maximum(mask.sum(), 1.0)
                return loss * scale, loss

            (_, loss), grads = nnx.value_and_grad(lf, has_aux=True)(m)
            return loss, grads, scale

        def update_body(params, o, grads, **noise):
            o.update(params, grads, **noise)

        def train_body(m, o, x, y, mask, part):
            loss, grads, _ = grad_body(m, o, x, y, mask)
            update_body(m, o, grads, noise_part=part, noise_samples=mask.sum())
            return loss

        # packed (as on GPUs; host devices default to unpacked): the buffers replicated on the mesh
        split = SplitStep(train_body if in_update else grad_body, model, opt, ta=ta, donate_argnums=(),
                          compile_cache=False, compile_ahead=compile_ahead, pack=True)
        update = split.bind(update_body, nnx.state(model, nnx.Param), opt)
        grads_of = split.bind(grad_body, model, opt) if in_update else split
        in_flight = InFlight(split.snapshot, split.restore) if in_update else None
        if mesh is None:
            dev = jax.devices()[0]
            arrays, place = (jax.device_put(xs, dev), jax.device_put(ys, dev)), None
        else:
            arrays, place = replicate((xs, ys), mesh), batch_sharding(mesh)
        loader = ElasticLoader(arrays, batch_size=cfg.batch_init, seed=3, buckets=cfg.batch_buckets, device=place)
        calls, scale = [0], [1.0]
        noise: list = []   # what the noise measurement fed the controller: sizes and squared norms
        observe = ta.controller.observe_gradient_noise

        def spy(step, sizes, micro_sq, total_sq):
            noise.append([step, [int(n) for n in sizes], np.ravel(micro_sq).tolist(), np.ravel(total_sq).tolist()])
            observe(step, sizes, micro_sq, total_sq)

        ta.controller.observe_gradient_noise = spy
        placements: set = set()

        def micro(batch, mask):
            calls[0] += 1
            if calls[0] == oom_call:
                raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory (injected)")
            if mesh is not None:
                placements.add("split" if batch[0].sharding == batch_sharding(mesh) else str(batch[0].sharding))
            loss, grads, scale[0] = grads_of(batch[0], batch[1], mask)
            return loss, grads

        def fused(batch, mask, part):
            if mesh is not None:
                placements.add("split" if batch[0].sharding == batch_sharding(mesh) else str(batch[0].sharding))
            return split(batch[0], batch[1], mask, jnp.int32(part))

        losses, batches = [], []
        for step in range(steps):
            if in_flight is not None and ta.controller.is_control_step(step):
                in_flight.settle()
            split.control(step)
            res = elastic_step(loader, ta.controller, micro, step, update_fn=lambda g, d: update(g),
                               tensor_layer=ta.layers, grad_scale=lambda: scale[0], in_flight=in_flight,
                               step_fn=(lambda b, m, d, w: fused(b, m, 0)) if in_update else None,
                               noise_step_fn=(lambda b, m, d, p, w: fused(b, m, p)) if in_update else None)
            losses.append(float(res.loss))
            batches.append(res.decision.batch_size)
        if in_flight is not None:
            in_flight.settle()
        split.wait_compiled()
        split.sync()
        params = jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))
        bstats = jax.tree_util.tree_leaves(nnx.state(model, nnx.BatchStat))
        tel = [{k: r[k] for k in ("event", "step", "batch_size", "precisions", "lr_batch_scale", "var_ema",
                                  "b_noise", "ooms")} for r in ta.controller.telemetry.records]
        rep = ta.report(split)
        param_sharding = {str(p.sharding) for p in params}
        # the partitioned programs of the train step (every variant): data parallel means gradients
        # all-reduced and no all-gather (of the batch: each device computes on its own part)
        hlo = [exe.as_text() for v in split._main.exes.values() for exe in v.values()]
        collectives = {op: sum(t.count(op + "(") for t in hlo) for op in ("all-reduce", "all-gather")}
        return {"losses": losses, "batches": batches, "params": [np.asarray(p).ravel().tolist() for p in params],
                "batch_stats": [np.asarray(b).ravel().tolist() for b in bstats], "telemetry": tel,
                "policies": sorted({tuple(r["precisions"]) for r in tel}), "placements": sorted(placements),
                "param_replicated": all(p.sharding.is_fully_replicated for p in params),
                "param_sharding": sorted(param_sharding), "ooms": rep["ooms"],
                "skipped": rep["skipped_steps"], "optimizer_step": rep["optimizer_step"],
                "traces": split.traces, "compiled_ahead": split.compiled_ahead, "noise": noise,
                "collectives": collectives}

    error = two_devices.value_error
    mesh = data_mesh()
    fp32 = dict(base_precision="fp32", adaptive_precision=False)
    out = {"shards": num_shards(mesh), "one": run(None, False, STEPS, OOM_CALL, **fp32),
           "two": run(mesh, True, STEPS, OOM_CALL, **fp32),
           "one16": run(None, False, STEPS_16, None, elastic_batch=False),
           "two16": run(mesh, False, STEPS_16, None, elastic_batch=False),
           "two_host": run(mesh, False, STEPS, None, **fp32), "two_in": run(mesh, False, STEPS, None, True, **fp32)}
    out["errors"] = {
        "too_many_devices": error(lambda: data_mesh(3)),
        "zero_devices": error(lambda: data_mesh(0)),
        "odd_bucket": error(lambda: TriAccel(config(batch_multiple=3, batch_min=3, batch_init=9, batch_max=18,
                                                    batch_buckets=(3, 9, 18), delta_up=3, delta_down=3), Net(), mesh=mesh)),
        "no_buckets": error(lambda: TriAccel(config(batch_buckets=None), Net(), mesh=mesh)),
        "odd_batch": error(lambda: shard_batch(np.zeros((5, 2)), mesh)),
        "odd_loader_bucket": error(lambda: ElasticLoader(replicate((xs,), mesh), batch_size=3, buckets=(3,),
                                                         device=batch_sharding(mesh)).fetch(np.arange(3))),
    }
    out["per_device"] = check_divides(32, mesh)
    return out


@pytest.fixture(scope="module")
def result() -> dict:
    return two_devices.worker_result(__file__)


def test_the_two_device_run_is_sharded(result):
    assert result["shards"] == 2 and result["per_device"] == 16
    assert result["two"]["placements"] == ["split"]   # every micro-batch split
    assert result["two"]["param_replicated"]
    assert result["two"]["collectives"]["all-reduce"] >= 1 and result["two"]["collectives"]["all-gather"] == 0
    assert result["one"]["collectives"] == {"all-reduce": 0, "all-gather": 0}
    assert result["two"]["compiled_ahead"] >= 1   # the background compiler served the mesh's variants


def _same_trajectory(one: dict, two: dict, rel: float) -> None:
    assert one["batches"] == two["batches"]
    assert [r["event"] for r in one["telemetry"]] == [r["event"] for r in two["telemetry"]]
    for a, b in zip(one["telemetry"], two["telemetry"]):
        assert (a["step"], a["batch_size"], a["precisions"], a["ooms"], a["lr_batch_scale"]) == \
               (b["step"], b["batch_size"], b["precisions"], b["ooms"], b["lr_batch_scale"])
        # the statistics the decisions came from, global on both: the gradient moments (variance EMA)
        assert [x or 0.0 for x in b["var_ema"]] == pytest.approx([x or 0.0 for x in a["var_ema"]], rel=rel)
    assert one["ooms"] == two["ooms"] and one["skipped"] == two["skipped"]
    assert one["optimizer_step"] == two["optimizer_step"] == len(one["losses"])


def test_same_decisions_as_one_device_with_a_batch_change(result):
    one, two = result["one"], result["two"]
    assert len(set(one["batches"])) >= 2 and one["ooms"] == 1   # the injected OOM shrank the batch
    _same_trajectory(one, two, rel=1e-5)
    # the gradient-noise measurements (split steps): same sizes, same squared norms of the global
    # micro-batch gradients
    assert len(one["noise"]) >= 2 and [n[:2] for n in one["noise"]] == [n[:2] for n in two["noise"]]
    for a, b in zip(one["noise"], two["noise"]):
        assert b[2] == pytest.approx(a[2], rel=1e-4) and b[3] == pytest.approx(a[3], rel=1e-4)


def test_same_precision_decisions_as_one_device(result):
    one, two = result["one16"], result["two16"]
    assert len(one["policies"]) >= 2    # the variance law changed the precision policy
    # 16-bit compute summed in another order: statistics within rounding, decisions identical
    _same_trajectory(one, two, rel=5e-3)
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-3)


def test_same_losses_and_parameters_as_one_device(result):
    one, two = result["one"], result["two"]
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert len(one["params"]) == len(two["params"]) and len(one["batch_stats"]) == len(two["batch_stats"]) == 2
    for a, b in zip(one["params"] + one["batch_stats"], two["params"] + two["batch_stats"]):
        assert b == pytest.approx(a, rel=1e-4, abs=1e-6)


def test_noise_measured_in_the_update_on_two_devices_as_on_the_host(result):
    """The demo's path on a mesh (one program per step, the noise halves accumulated and measured in
    the wrapped update, read at the next boundary) against the host-side measurement, same mesh."""
    host, inside = result["two_host"], result["two_in"]
    assert inside["placements"] == ["split"] and inside["param_replicated"]
    assert len(host["noise"]) >= 2 and [n[:2] for n in inside["noise"]] == [n[:2] for n in host["noise"]]
    for a, b in zip(host["noise"], inside["noise"]):
        assert b[2] == pytest.approx(a[2], rel=1e-4) and b[3] == pytest.approx(a[3], rel=1e-4)
    _same_trajectory(host, inside, rel=1e-5)
    assert inside["losses"] == pytest.approx(host["losses"], rel=1e-5)
    for a, b in zip(host["params"] + host["batch_stats"], inside["params"] + inside["batch_stats"]):
        assert b == pytest.approx(a, rel=1e-4, abs=1e-6)


def test_bad_device_counts_and_batches_raise(result):
    err = result["errors"]
    assert "devices=3" in err["too_many_devices"] and "[1, 2]" in err["too_many_devices"]
    assert "devices=0" in err["zero_devices"]
    assert "batch_init=9" in err["odd_bucket"] and "multiple of the world size 2" in err["odd_bucket"]
    assert err["no_buckets"].startswith("batch_buckets=None")
    assert err["odd_batch"].startswith("batch=5") and "2 data shards" in err["odd_batch"]
    assert "padded to bucket=3" in err["odd_loader_bucket"]


def test_demo_devices_option():
    from examples.cifar import train

    assert train.parse_args(["--backend", "jax", "--devices", "2"]).devices == 2
    assert train.parse_args(["--backend", "jax"]).devices is None          # every device
    for bad in (["--backend", "torch", "--devices", "2"], ["--backend", "jax", "--devices", "0"]):
        with pytest.raises(SystemExit):
            train.parse_args(bad)


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    print(json.dumps(_worker()))
