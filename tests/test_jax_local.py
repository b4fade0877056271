"""triaccel.backends.jax.local: same plan as torch, cached == recomputed training, export, torch parity;
and the core pieces both trainers share (triaccel.local_plan: block_runs, head_init, halving_on_oom)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
import numpy as np
import pytest
import torch

from triaccel.backends.jax import local as jl
from triaccel.backends.jax.models import create_model, to_canonical
from triaccel.backends.torch import local as tl
from triaccel.backends.torch.models import create_model as torch_model
from triaccel.local_plan import (BlockOutOfMemory, BlockRun, LocalPlanConfig, NonFinitePolicy, NonFiniteTraining,
                                 block_runs, halving_on_oom, head_init, micro_batches, plan_local)

N, K, S, WIDTH, EPOCHS = 32, 4, 8, 0.0625, 2


def _data(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((N, S, S, 3)).astype(np.float32), rng.integers(0, K, N).astype(np.int64)


def _nchw(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a.transpose(0, 3, 1, 2)))


@pytest.fixture(scope="module")
def torch_table():
    units, _ = tl.sequential_units(torch_model("resnet18", num_classes=K, width=WIDTH, seed=0))
    return tl.measure_layers(units, torch.randn(2, 3, S, S), autocast_dtype=None)


def _config(budget: int) -> LocalPlanConfig:
    return LocalPlanConfig(memory_budget=budget, batch_buckets=(8, 16), act_bytes=4, cache_bytes=4,
                           input_bytes=3 * S * S * 4, head_widths=(8, 16), max_blocks=4)


@pytest.fixture(scope="module")
def plan(torch_table):
    """The largest budget of a fixed ladder (steps of 2**(1/4)) that splits the tiny ResNet into >= 3 blocks."""
    for budget in [int(2 ** (p / 4)) for p in range(96, 48, -1)]:
        try:
            p = plan_local(torch_table, _config(budget), num_samples=N, num_classes=K)
        except ValueError:
            continue
        if len(p.blocks) >= 3:
            return p
    raise AssertionError("no budget of the ladder splits the tiny model into 3 blocks")


@pytest.fixture(scope="module")
def _xla_cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("xla-cache"))


@pytest.fixture(autouse=True)
def _compile_once(request, _xla_cache_dir):
    """Many tests here train the same tiny model through the same plan: each trainer jits its steps
    anew (fresh closures), so identical XLA programs were compiled again and again. JAX's persistent
    compilation cache in one folder per module loads them instead (the same executables, so the
    same numerics). Off for the demo tests, which set the cache themselves (and test that)."""
    from jax.experimental.compilation_cache import compilation_cache as cc

    keys = ("jax_enable_compilation_cache", "jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    old = {k: getattr(jax.config, k) for k in keys}
    if request.node.originalname == "test_demo_local_loop_jax":
        yield
        return
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    cc.set_cache_dir(_xla_cache_dir)
    cc.reset_cache()
    try:
        yield
    finally:
        for k, v in old.items():
            jax.config.update(k, v)
        cc.reset_cache()


# -- the core pieces ----------------------------------------------------------------------------------

def test_block_runs_and_helpers(plan):
    runs = block_runs(plan, [1, 2, 3][:len(plan.blocks)] + [1] * (len(plan.blocks) - 3), lr=0.1, lr_batch=16,
                      seed=5, inputs="cache")
    assert [r.source for r in runs] == ["data"] + ["cache"] * (len(runs) - 1)
    assert [r.cache_after for r in runs] == [b.input_cache for b in plan.blocks[1:]] + [None]
    assert all(r.lr == pytest.approx(0.1 * r.batch / 16) and r.seed == 5 + 1000 * r.index for r in runs)
    assert [r.source for r in block_runs(plan, 1, lr=0.1, lr_batch=16, seed=0, inputs="recompute")][1:] == \
        ["recompute"] * (len(runs) - 1)
    assert micro_batches(24) == (3, 6, 12, 24) and micro_batches(7) == (7,)
    assert [BlockRun.view(e, 3) for e in range(5)] == [0, 1, 2, 0, 1]
    cfg = runs[0].controller_config(plan.memory_budget)
    assert cfg.batch_init == runs[0].batch and cfg.batch_buckets == micro_batches(runs[0].batch)
    with pytest.raises(ValueError, match="epochs"):
        block_runs(plan, [1], lr=0.1, lr_batch=16, seed=0, inputs="cache")
    with pytest.raises(ValueError, match="lr="):
        block_runs(plan, 1, lr=0.0, lr_batch=16, seed=0, inputs="cache")
    # heads: seeded per (seed, block), the canonical layout of torch's AuxHead
    a, b = head_init(8, 16, K, seed=0, index=1), head_init(8, 16, K, seed=0, index=2)
    assert set(a) == set(tl.AuxHead(8, 16, K).state_dict())
    assert not np.array_equal(a["body.0.weight"], b["body.0.weight"])
    assert set(head_init(8, 0, K, seed=0, index=0)) == {"fc.weight", "fc.bias"}
    # an inference pass restarts at half the batch after an OOM, re-raises anything else
    tried = []

    def fn(bs):
        tried.append(bs)
        if bs > 4:
            raise MemoryError("oom")
    assert halving_on_oom(fn, 16, is_oom=lambda e: isinstance(e, MemoryError), free_memory=lambda: None) == 4
    assert tried == [16, 8, 4]
    with pytest.raises(KeyError):
        halving_on_oom(lambda bs: {}[bs], 8, is_oom=lambda e: False, free_memory=lambda: None)


# -- units, table, plan -------------------------------------------------------------------------------

def test_units_compose_and_table_matches_torch(torch_table, plan):
    model = create_model("resnet18", num_classes=K, width=WIDTH, seed=0)
    model.eval()
    units, clf = jl.sequential_units(model)
    assert [n for n, _ in units] == [t.name for t in torch_table]
    x = jnp.asarray(_data()[0])
    h = x
    for _, m in units:
        h = m(h)
    np.testing.assert_array_equal(np.asarray(clf(h)), np.asarray(model(x)))
    table = jl.measure_layers(units, jax.ShapeDtypeStruct((2, S, S, 3), jnp.float32))
    assert [(t.name, t.out_shape, t.params) for t in table] == [(t.name, t.out_shape, t.params) for t in torch_table]
    assert all(t.saved_bytes > 0 for t in table)
    # XLA keeps at least what torch's autograd saves minus the unit's input (an argument in JAX)
    assert table[0].saved_bytes >= torch_table[0].saved_bytes - 3 * S * S * 4
    # the same synthetic memory figures give the same plan from either backend's table
    synthetic = [dataclasses.replace(tj, saved_bytes=tt.saved_bytes) for tj, tt in zip(table, torch_table)]
    assert plan_local(synthetic, _config(plan.memory_budget), num_samples=N, num_classes=K).to_dict() == plan.to_dict()


# -- training ---------------------------------------------------------------------------------------

def _views(x: np.ndarray) -> list[np.ndarray]:
    return [x[:, :, ::-1].copy(), x + 0.1]          # two fixed "augmentations" (NHWC: flip W)


def _train_jax(plan, inputs: str, evaluate: bool = False, transform=None, nonfinite=None, steps_per_call=16,
               compute_dtype=None):
    """evaluate: every exit so far after every epoch (as the demo does); transform: block 0's."""
    model = create_model("resnet18", num_classes=K, width=WIDTH, seed=0)
    units, clf = jl.sequential_units(model)
    tr = jl.LocalTrainer(units, clf, plan, num_classes=K, lr=0.05, lr_batch=16, inputs=inputs,
                         cache_dtype=jnp.float32, seed=0, lr_factor=lambda seen, total: 1.0 - seen / total,
                         nonfinite=nonfinite, steps_per_call=steps_per_call, compute_dtype=compute_dtype)
    x, y = _data()

    def on_epoch(b, e, loss, seconds):
        tr.evaluate_exits(jnp.asarray(x), y, lambda v: v, upto=b + 1)

    recs = tr.train(jnp.asarray(x), y, transform or (lambda xb, key: xb * 0.9), _views(x), lambda v: v,
                    epochs=EPOCHS, on_epoch=on_epoch if evaluate else None)
    return model, tr, recs


@pytest.fixture(scope="module")
def cached(plan):
    return _train_jax(plan, inputs="cache")


def _state(model, tr) -> dict[str, np.ndarray]:
    out = to_canonical(model)
    for b, head in enumerate(tr.heads):
        if isinstance(head, jl.AuxHead):
            out.update({f"head{b}.{k}": v for k, v in head.to_canonical().items()})
    return out


def test_cached_equals_recomputed_fp32(plan, cached):
    model_a, a, ra = cached
    model_b, b, rb = _train_jax(plan, inputs="recompute")
    assert len(plan.blocks) >= 3 and {blk.input_cache for blk in plan.blocks[1:]} == {"host", "device"}
    sa, sb = _state(model_a, a), _state(model_b, b)
    assert sa.keys() == sb.keys()
    for k in sa:
        np.testing.assert_allclose(sa[k], sb[k], rtol=1e-5, atol=1e-6, err_msg=k)
    for x, y in zip(ra, rb):
        assert x.steps == y.steps and x.batch == y.batch
        assert x.epoch_losses == pytest.approx(y.epoch_losses, rel=1e-5)


def test_export_matches_trained_prefix(plan, cached):
    _, tr, _ = cached
    x, y = _data(1)
    x = jnp.asarray(x)
    params = tr.exit_params()
    for b, blk in enumerate(plan.blocks):
        exported = tr.export(b)
        assert exported.param_count == params[b] == \
            sum(l.params for l in plan.layers[:blk.stop]) + blk.head_params   # the plan's own count
        h = x
        for m in tr.units[:blk.stop]:
            m.eval()
            h = m(h)
        tr.heads[b].eval()
        np.testing.assert_array_equal(np.asarray(exported(x)), np.asarray(tr.heads[b](h)))
    accs = tr.evaluate_exits(x, y, lambda v: v, batch=24)    # 32 = 24 + a padded 8
    ref = [float(np.mean(np.asarray(tr.export(b)(x)).argmax(-1) == y)) for b in range(len(plan.blocks))]
    assert accs == pytest.approx(ref)
    assert tr.evaluate_exits(x, y, lambda v: v, upto=1) == pytest.approx(ref[:1])


def test_torch_and_jax_train_alike(plan, cached):
    """Same plan, same initial model (canonical init) and heads (head_init), same data order (the core
    loader), same schedule: the trained weights and losses agree to float tolerance."""
    model_j, tr_j, rec_j = cached
    model_t = torch_model("resnet18", num_classes=K, width=WIDTH, seed=0)
    units, clf = tl.sequential_units(model_t)
    tr_t = tl.LocalTrainer(units, clf, plan, num_classes=K, device="cpu", lr=0.05, lr_batch=16, autocast_dtype=None,
                           inputs="cache", cache_dtype=torch.float32, seed=0,
                           lr_factor=lambda seen, total: 1.0 - seen / total)
    x, y = _data()
    views = [_nchw(v) for v in _views(x)]
    rec_t = tr_t.train(_nchw(x), torch.from_numpy(y), lambda xb: xb * 0.9, views, lambda v: v, epochs=EPOCHS)
    assert tr_j.exit_params() == tr_t.exit_params()
    for rj, rt in zip(rec_j, rec_t):
        assert rj.steps == rt.steps and rj.batch == rt.batch
        assert rj.epoch_losses == pytest.approx(rt.epoch_losses, rel=1e-3)
    st = {k: v.numpy() for k, v in model_t.state_dict().items()}
    for b, head in enumerate(tr_t.heads):
        if isinstance(head, tl.AuxHead):
            st.update({f"head{b}.{k}": v.numpy() for k, v in head.state_dict().items()})
    sj = _state(model_j, tr_j)
    assert sj.keys() == st.keys()
    for k in sj:
        np.testing.assert_allclose(sj[k], st[k], rtol=2e-3, atol=2e-4, err_msg=k)


def _noisy_aug(xb, key):
    return xb * 0.9 + 0.05 * jax.random.normal(key, xb.shape)


@pytest.fixture(scope="module")
def fused_16(plan):
    """The reference of test_fused_steps_equal_elastic_steps (16 steps per call, the default), trained
    once for both of its cases. Later blocks: the prefix in the scan."""
    return _train_jax(plan, inputs="recompute", transform=_noisy_aug)


@pytest.mark.parametrize("steps_per_call", [1, 3])
def test_fused_steps_equal_elastic_steps(plan, cached, fused_16, steps_per_call):
    """Full batches run 16 per compiled scan (the default, the fixture), 3 per call (an epoch's last
    call with spare slots) or each through the elastic path (1): same augmentation keys, same lr per
    step, same weights and losses. Block 0's transform draws on its key, so a wrong key shows."""
    model_a, a, ra = fused_16
    model_b, b, rb = _train_jax(plan, inputs="recompute", transform=_noisy_aug, steps_per_call=steps_per_call)
    assert all(r.graph_steps == r.steps - EPOCHS * (N % r.batch > 0) for r in ra)
    assert all(r.graph_steps == (0 if steps_per_call == 1 else r.steps - EPOCHS * (N % r.batch > 0)) for r in rb)
    sa, sb = _state(model_a, a), _state(model_b, b)
    for k in sa:
        np.testing.assert_allclose(sa[k], sb[k], rtol=1e-5, atol=1e-6, err_msg=k)
    for x, y in zip(ra, rb):
        assert x.steps == y.steps and x.epoch_losses == pytest.approx(y.epoch_losses, rel=1e-5)


def test_fused_steps_per_call_bounded_by_host_rows():
    """A fused call copies its host rows up front: K shrinks so they stay within HOST_CALL_BYTES;
    device leaves are gathered inside the scan and do not count."""
    y = jnp.zeros(8, jnp.int32)
    cache = np.zeros((8, 32, 32, 64), np.float16)                   # 128 KiB a sample, 8 MiB a batch of 64
    n = 50000
    assert jl.HOST_CALL_BYTES == 16 * 2 ** 20
    assert jl._fused_steps(16, 64, [(cache, y)], n) == 2
    assert jl._fused_steps(16, 256, [(cache, y)], n) == 1                 # one batch over the cap: no fusing
    assert jl._fused_steps(16, 64, [(np.zeros((8, 32, 32, 3), np.uint8), y)], n) == 16   # raw views: 192 KiB
    assert jl._fused_steps(16, 64, [(jnp.asarray(cache), y)], n) == 16    # on the device
    assert jl._fused_steps(16, 64, [(jnp.asarray(cache), y)], 200) == 3   # at most an epoch's full batches
    assert jl._fused_steps(16, 64, [(cache, y), (jnp.asarray(cache), y)], n) == 1   # views in two places


def test_fused_call_out_of_memory_falls_back_to_elastic_steps(plan, cached, monkeypatch):
    """A fused call that runs out of memory loses no sample: its batches go back to the loader, the
    block's steps take the elastic path (same results as never fusing), the record says why."""
    def failing(*args, **kwargs):
        def call(*a, **k):
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory (simulated)")
        return call

    monkeypatch.setattr(jl, "_scan_steps", failing)
    with pytest.warns(RuntimeWarning, match="fused steps at step 0"):
        model_b, b, rb = _train_jax(plan, inputs="cache")
    model_a, a, ra = _train_jax(plan, inputs="cache", steps_per_call=1)
    assert all(r.graph_steps == 0 and r.graph_note.startswith("fused steps at step 0: JaxRuntimeError") for r in rb)
    sa, sb = _state(model_a, a), _state(model_b, b)
    for k in sa:
        np.testing.assert_array_equal(sa[k], sb[k], err_msg=k)
    assert [r.steps for r in ra] == [r.steps for r in rb]


def test_evaluating_exits_between_epochs_changes_nothing(plan, cached):
    model_a, a, ra = cached
    model_b, b, rb = _train_jax(plan, inputs="cache", evaluate=True)
    sa, sb = _state(model_a, a), _state(model_b, b)
    for k in sa:
        np.testing.assert_array_equal(sa[k], sb[k], err_msg=k)
    assert [r.epoch_losses for r in ra] == [r.epoch_losses for r in rb]
    assert all(r.skipped_steps == 0 for r in ra)


def _one_nan_image(xb, key):
    """Block 0's transform with training image 5 turned into NaNs (the views stay clean)."""
    x0 = _data()[0][:, 0, 0, 0]
    assert (x0 != 0).all()
    xb = xb.at[:, 0, 0, 0].set(jnp.where(xb[:, 0, 0, 0] == x0[5], 0.0, xb[:, 0, 0, 0]))
    return xb * 0.9 + jnp.where(xb[:, :1, :1, :1] == 0.0, jnp.nan, 0.0)


def test_nonfinite_steps_skipped_then_fail_loudly(plan):
    """One NaN training image (block 0 only; the views stay clean): the step holding it is skipped in
    each epoch, statistics restored, training goes on finite. All NaN: raises after `patience`."""
    model, tr, recs = _train_jax(plan, inputs="cache", transform=_one_nan_image,
                                 nonfinite=NonFinitePolicy(patience=3, check_every=1))
    assert recs[0].skipped_steps == EPOCHS and all(r.skipped_steps == 0 for r in recs[1:])
    assert all(np.isfinite(v).all() for v in _state(model, tr).values())
    assert all(np.isfinite(r.epoch_losses).all() for r in recs)
    with pytest.raises(NonFiniteTraining, match=r"block 0: the last 2 optimizer steps \(steps 0\.\.1"):
        _train_jax(plan, inputs="cache", transform=lambda xb, key: xb * jnp.nan,
                   nonfinite=NonFinitePolicy(patience=2, check_every=1))


@pytest.mark.parametrize("steps_per_call", [16, 1])
def test_nonfinite_steps_promote_the_block_to_fp32(plan, steps_per_call):
    """The precision lever per block, as in the torch twin: under bf16 compute, the first read that
    finds block 0's skipped step promotes block 0's convs and linears (head included) to FP32 and its
    steps (fused or not) compile again at it; later blocks stay bf16; training goes on finite."""
    import warnings

    # the dtypes of the convs each compiled step runs, from its graph definition: (params' structure, dtypes)
    log: list[tuple[object, set]] = []
    orig_grad, orig_scan = jl._grad, jl._scan_steps

    def dtypes(gd, params, rest):
        return {jnp.dtype(m.dtype) for _, m in nnx.iter_modules(nnx.merge(gd, params, rest)) if isinstance(m, nnx.Conv)}

    def spy_grad(gd, params, rest, *a):
        log.append((jax.tree_util.tree_structure(params), dtypes(gd, params, rest)))
        return orig_grad(gd, params, rest, *a)

    def spy_scan(gd, *a, **k):
        run = orig_scan(gd, *a, **k)

        def call(params, opt, rest, *b):
            log.append((jax.tree_util.tree_structure(params), dtypes(gd, params, rest)))
            return run(params, opt, rest, *b)
        return call

    mp = pytest.MonkeyPatch()
    mp.setattr(jl, "_grad", spy_grad)
    mp.setattr(jl, "_scan_steps", spy_scan)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model, tr, recs = _train_jax(plan, inputs="cache", transform=_one_nan_image, compute_dtype=jnp.bfloat16,
                                         nonfinite=NonFinitePolicy(patience=3, check_every=4, promote=True),
                                         steps_per_call=steps_per_call)
    finally:
        mp.undo()
    block0 = [d for t, d in log if t == log[0][0]]
    assert block0[0] == {jnp.dtype(jnp.bfloat16)} and block0[-1] == {jnp.dtype(jnp.float32)}   # the steps ran it
    promoted = [str(w.message) for w in caught if "compute precision" in str(w.message)]
    assert recs[0].skipped_steps == EPOCHS and recs[0].precision == "fp32" and recs[0].promoted_at is not None
    assert promoted == [f"block 0: non-finite gradients skipped by step {recs[0].promoted_at}: compute precision "
                        "bf16 -> fp32 for the rest of the block"]
    blk0 = plan.blocks[0]
    dtypes = {m.dtype for u in [*tr.units[blk0.start:blk0.stop], tr.heads[0]] for _, m in nnx.iter_modules(u)
              if isinstance(m, (nnx.Conv, nnx.Linear))}
    assert dtypes == {jnp.dtype(jnp.float32)}
    assert all(r.precision == "bf16" and r.promoted_at is None for r in recs[1:])
    assert all(np.isfinite(r.epoch_losses).all() for r in recs)
    if steps_per_call > 1:
        assert recs[0].graph_steps > 0


@pytest.mark.parametrize("check_every", [3, 4])
def test_fused_calls_end_at_nonfinite_checks(plan, check_every):
    """Fused calls stop at the policy's reads, so a skipped step restores the same statistics as
    step-by-step training would (a read every 3 steps falls inside a call of 16 otherwise)."""
    policy = NonFinitePolicy(patience=3, check_every=check_every)
    model_a, a, ra = _train_jax(plan, inputs="cache", transform=_one_nan_image, nonfinite=policy)
    model_b, b, rb = _train_jax(plan, inputs="cache", transform=_one_nan_image, nonfinite=policy, steps_per_call=1)
    assert [r.skipped_steps for r in ra] == [r.skipped_steps for r in rb] == [EPOCHS] + [0] * (len(ra) - 1)
    assert ra[0].graph_steps > 0
    sa, sb = _state(model_a, a), _state(model_b, b)
    for k in sa:
        np.testing.assert_allclose(sa[k], sb[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_oom_at_batch_one_names_the_block(plan):
    def oom(xb, key):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory (simulated)")

    with pytest.raises(BlockOutOfMemory, match=r"block 0 \(stem\.\..*smallest allowed batch 1"):
        _train_jax(plan, inputs="cache", transform=oom)


def test_trainer_refuses_bad_input(plan):
    model = create_model("resnet18", num_classes=K, width=WIDTH, seed=0)
    units, clf = jl.sequential_units(model)
    with pytest.raises(ValueError, match="units"):
        jl.LocalTrainer(units[:-1], clf, plan, num_classes=K, lr=0.1)
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match=r"steps_per_call=.*allowed integers >= 1"):
            jl.LocalTrainer(units, clf, plan, num_classes=K, lr=0.1, steps_per_call=bad)
    tr = jl.LocalTrainer(units, clf, plan, num_classes=K, lr=0.1)
    x, y = _data()
    with pytest.raises(ValueError, match="epochs"):
        tr.train(x, y, lambda v, k: v, [x], lambda v: v, epochs=[1])
    with pytest.raises(ValueError, match="b="):
        tr.export(len(plan.blocks))
    with pytest.raises(ValueError, match="model"):
        jl.sequential_units(units[0][1])


def test_fresh_inputs_equal_a_cache_of_the_same_images_fp32(plan, torch_table):
    # as the torch twin: with block 0's deterministic augmentation as the one cached view, a cache
    # and the fresh prefix give the later blocks the same inputs
    fresh = plan_local(torch_table, dataclasses.replace(_config(plan.memory_budget), block_inputs="fresh"),
                       num_samples=N, num_classes=K)
    assert [(k.start, k.stop, k.batch) for k in fresh.blocks] == [(k.start, k.stop, k.batch) for k in plan.blocks]
    assert all(k.input_cache == "fresh" for k in fresh.blocks[1:]) and fresh.cache_views == 0
    x, y = _data()
    out = []
    for p, views in ((plan, [x * 0.9]), (fresh, [])):
        model = create_model("resnet18", num_classes=K, width=WIDTH, seed=0)
        units, clf = jl.sequential_units(model)
        tr = jl.LocalTrainer(units, clf, p, num_classes=K, lr=0.05, lr_batch=16, cache_dtype=jnp.float32, seed=0)
        recs = tr.train(jnp.asarray(x), y, lambda xb, key: xb * 0.9, views, lambda v: v, epochs=1)
        out.append((_state(model, tr), recs))
    (sa, ra), (sb, rb) = out
    for k in sa:
        np.testing.assert_allclose(sa[k], sb[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert [r.epoch_losses for r in ra] == [pytest.approx(r.epoch_losses, rel=1e-5) for r in rb]


@pytest.mark.parametrize("block_inputs", ["cache", "fresh"])
def test_demo_local_loop_jax(tmp_path, block_inputs):
    """examples.cifar local_loop's JAX path on a tiny synthetic CIFAR: plan, training, exits, summary."""
    from local_demo import check_block_inputs, run_local_demo

    # the persistent compilation cache as the end-to-end loop's: a folder (the block programs written
    # there), or off
    from jax.experimental.compilation_cache import compilation_cache as cc

    cache = str(tmp_path / "xla-cache") if block_inputs == "cache" else "off"
    old_min = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    try:
        summary = run_local_demo(tmp_path, "jax", block_inputs, options={"compile_cache": cache})
        assert summary["compile_cache"] == (None if cache == "off" else cache)
        assert cache == "off" or any((tmp_path / "xla-cache").iterdir())
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", old_min)
        jax.config.update("jax_enable_compilation_cache", True)
        cc.set_cache_dir(None)
        cc.reset_cache()
    nb = len(summary["plan"]["blocks"])
    assert summary["graph_steps"] > 0 and summary["fuse_steps"] == 16   # the demo fuses full-batch steps
    assert nb >= 2 and len(summary["exit_accs"]) == nb == len(summary["blocks"])
    assert summary["exported_params"] == summary["exit_params"][summary["chosen_exit"]]
    check_block_inputs(summary, block_inputs)




def test_curvature_lever_matches_the_torch_twin(plan):
    """The curvature lever per block, as the torch twin: a measurement at each block's epoch end, the
    LR scaled by the core's law (block 0's first scale 1/2); from the same canonical weights, inputs
    and schedule both backends measure the same curvature (fp32 on the CPU)."""
    from triaccel.local_plan import BlockCurvature

    curv = BlockCurvature(every=1, samples=16)
    model = create_model("resnet18", num_classes=K, width=WIDTH, seed=0)
    units, clf = jl.sequential_units(model)
    tr = jl.LocalTrainer(units, clf, plan, num_classes=K, lr=0.05, lr_batch=16, inputs="cache",
                         cache_dtype=jnp.float32, seed=0, lr_factor=lambda seen, total: 1.0 - seen / total,
                         curvature=curv)
    x, y = _data()
    recs = tr.train(jnp.asarray(x), y, lambda xb, key: xb * 0.9, _views(x), lambda v: v, epochs=EPOCHS)
    assert [len(r.lr_scales) for r in recs] == [EPOCHS] * len(recs)
    assert recs[0].lr_scales[0] == pytest.approx(0.5) and all(0 < s <= 1 for r in recs for s in r.lr_scales)
    tcurv = BlockCurvature(every=1, samples=16)
    model_t = torch_model("resnet18", num_classes=K, width=WIDTH, seed=0)
    units_t, clf_t = tl.sequential_units(model_t)
    tr_t = tl.LocalTrainer(units_t, clf_t, plan, num_classes=K, device="cpu", lr=0.05, lr_batch=16, autocast_dtype=None,
                           inputs="cache", cache_dtype=torch.float32, seed=0,
                           lr_factor=lambda seen, total: 1.0 - seen / total, curvature=tcurv)
    rec_t = tr_t.train(_nchw(x), torch.from_numpy(y), lambda xb: xb * 0.9, [_nchw(v) for v in _views(x)],
                       lambda v: v, epochs=EPOCHS)
    assert curv.lam_max.keys() == tcurv.lam_max.keys()
    for b in curv.lam_max:
        assert curv.lam_max[b] == pytest.approx(tcurv.lam_max[b], rel=1e-2), b
    for rj, rt in zip(recs, rec_t):
        assert rj.lr_scales == pytest.approx(rt.lr_scales, rel=1e-2)
        assert rj.epoch_losses == pytest.approx(rt.epoch_losses, rel=1e-3)
