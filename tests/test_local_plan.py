"""triaccel.local_plan: partition under a budget, head widths, per-block batches, caches, exits."""

from __future__ import annotations

import pytest

from triaccel.local_plan import (BlockOutOfMemory, LayerMemory, LocalPlanConfig, NonFinitePolicy,
                                 NonFiniteTraining, _Model, head_cost, plan_local, select_exit)

KIB = 1024
MIB = 1024 * KIB

# A ResNet-like table: early units hold large activations and few parameters, late ones the reverse.
TABLE = [
    LayerMemory("stem", 96 * KIB, (16, 32, 32), 500),
    LayerMemory("s1a", 128 * KIB, (16, 32, 32), 5_000),
    LayerMemory("s1b", 128 * KIB, (16, 32, 32), 5_000),
    LayerMemory("s2a", 48 * KIB, (32, 16, 16), 20_000),
    LayerMemory("s2b", 48 * KIB, (32, 16, 16), 20_000),
    LayerMemory("s3a", 16 * KIB, (64, 8, 8), 80_000),
    LayerMemory("s3b", 16 * KIB, (64, 8, 8), 80_000),
]
N, K = 10_000, 10


def make(budget, **kw):
    cfg = LocalPlanConfig(memory_budget=budget, **kw)
    return cfg, plan_local(TABLE, cfg, num_samples=N, num_classes=K)


def test_head_cost_by_hand():
    assert head_cost((16, 8, 8), 0, 10, 2) == head_cost((16, 1, 1), 0, 10, 2)
    assert head_cost((16, 8, 8), 0, 10, 2).params == 16 * 10 + 10
    h = head_cost((16, 8, 8), 32, 10, 2, pool=8)
    assert h.params == 9 * 16 * 32 + 2 * 32 + 32 * 10 + 10
    assert h.saved_bytes == (64 * (16 + 64) + 32) * 2
    pooled = head_cost((16, 8, 8), 32, 10, 2, pool=4)          # pools 8x8 -> 4x4 before the conv
    assert pooled.params == h.params and pooled.saved_bytes == (16 * (16 + 64) + 32) * 2
    assert head_cost((16, 2, 2), 32, 10, 2, pool=4).saved_bytes == (4 * (16 + 64) + 32) * 2


def test_train_peak_by_hand():
    cfg = LocalPlanConfig(memory_budget=MIB, act_bytes=2, cache_bytes=2, input_bytes=100,
                          state_bytes_per_param=10, resident_bytes=1000)
    layers = [LayerMemory("a", 50, (2, 2, 2), 3), LayerMemory("b", 30, (1, 2, 2), 7)]
    m = _Model(layers, cfg, 10, 4)
    # unit b alone, width 0: fixed 1000 + 10*(7 + 1*10+10) + unit a's fp32 weights 4*3;
    # per sample: input 8*2 + 30 + 1*2 + 2*8*2
    assert m.train_peak(1, 2, 0, 3) == 1000 + 10 * 27 + 4 * 3 + 3 * (16 + 30 + 2 + 32)
    # inference holds every unit's weights: 1000 + 4*10 + caches 5 + B*(100 + 3*8*2)
    assert m.infer_peak(1, 3, 5) == 1000 + 40 + 5 + 3 * (100 + 48)
    # its input cache: 4 samples x 8 elements x 2 bytes
    assert m.train_peak(1, 2, 0, 3, device_cache=True) == m.train_peak(1, 2, 0, 3) + 64
    # a CUDA graph's reserve adds to every training step, not to inference
    g = _Model(layers, LocalPlanConfig(memory_budget=MIB, act_bytes=2, cache_bytes=2, input_bytes=100,
                                       state_bytes_per_param=10, resident_bytes=1000, graph_reserve_bytes="1KiB"), 10, 4)
    assert g.train_peak(1, 2, 0, 3) == m.train_peak(1, 2, 0, 3) + 1024 and g.infer_peak(1, 3, 5) == m.infer_peak(1, 3, 5)


def test_graph_reserve_shrinks_batches_within_the_same_budget():
    _, plain = make(96 * MIB)
    cfg, graphed = make(96 * MIB, graph_reserve_bytes=24 * MIB)
    m = _Model(TABLE, cfg, K, N)
    assert all(m.train_peak(b.start, b.stop, b.head_width, b.batch) <= cfg.usable_bytes for b in graphed.blocks)
    assert (len(graphed.blocks), [b.batch for b in graphed.blocks]) != (len(plain.blocks), [b.batch for b in plain.blocks])
    with pytest.raises(ValueError, match="graph_reserve_bytes"):
        LocalPlanConfig(memory_budget=MIB, graph_reserve_bytes=-1)


@pytest.mark.parametrize("budget", [48 * MIB, 64 * MIB, 96 * MIB, 160 * MIB, 512 * MIB])
def test_partition_respects_budget_and_covers(budget):
    cfg, plan = make(budget)
    m = _Model(TABLE, cfg, K, N)
    assert [b.start for b in plan.blocks][0] == 0 and plan.blocks[-1].stop == len(TABLE)
    for a, b in zip(plan.blocks, plan.blocks[1:]):
        assert a.stop == b.start
    assert len(plan.blocks) <= cfg.max_blocks
    for blk in plan.blocks:
        assert blk.peak_bytes <= cfg.usable_bytes
        assert blk.peak_bytes == m.train_peak(blk.start, blk.stop, blk.head_width, blk.batch,
                                              device_cache=blk.input_cache == "device")
        assert blk.batch >= plan.target_batch
        # the batch is the largest bucket that fits
        up = [bb for bb in cfg.batch_buckets if bb > blk.batch]
        if up:
            assert m.train_peak(blk.start, blk.stop, blk.head_width, up[0]) > cfg.usable_bytes
    # the fewest blocks at the target: adding the next unit to a block breaks the budget
    for blk in plan.blocks[:-1]:
        assert m.train_peak(blk.start, blk.stop + 1, m.min_width(blk.stop + 1), plan.target_batch) > cfg.usable_bytes


def test_tighter_budget_more_blocks_and_larger_late_batches():
    _, loose = make(512 * MIB)
    _, tight = make(48 * MIB)
    assert len(loose.blocks) == 1 and loose.blocks[0].batch == 512 and loose.e2e_batch == 512
    assert len(tight.blocks) > 1
    assert tight.e2e_batch is None or tight.e2e_batch < tight.blocks[-1].batch
    batches = [b.batch for b in tight.blocks]
    assert batches[-1] > batches[0]           # late blocks (small activations) train at larger batches


def test_target_is_largest_bucket_within_max_blocks():
    cfg4, p4 = make(64 * MIB, max_blocks=4)
    cfg2, p2 = make(64 * MIB, max_blocks=2)
    assert len(p2.blocks) <= 2 and p2.target_batch <= p4.target_batch
    m = _Model(TABLE, cfg2, K, N)
    bigger = [bb for bb in cfg2.batch_buckets if bb > p2.target_batch]
    for bb in bigger:
        part = m.greedy(bb)
        assert part is None or len(part) > 2


def test_target_batch_caps_the_partition():
    _, free = make(160 * MIB)
    _, capped = make(160 * MIB, target_batch=128)
    assert capped.target_batch == 128 < free.target_batch
    assert len(capped.blocks) <= len(free.blocks)


def test_head_width_widest_that_fits():
    cfg, plan = make(64 * MIB)
    m = _Model(TABLE, cfg, K, N)
    for blk in plan.blocks[:-1]:
        wider = [w for w in cfg.head_widths if w > blk.head_width]
        assert m.fits(m.train_peak(blk.start, blk.stop, blk.head_width, plan.target_batch))
        if wider:
            assert not m.fits(m.train_peak(blk.start, blk.stop, wider[0], plan.target_batch))
    assert plan.blocks[-1].head_width == 0    # last_head_width: the model's own classifier
    _, chosen = make(64 * MIB, last_head_width=None)
    assert chosen.blocks[-1].head_width >= 0


def test_cache_placement():
    _, roomy = make(2048 * MIB, max_blocks=1, batch_buckets=(8, 16))
    assert len(roomy.blocks) == 1 and roomy.blocks[0].input_cache == "data"
    _, two = make(48 * MIB, cache_views=1)
    assert two.blocks[0].input_cache == "data" and two.blocks[0].cache_bytes == 0
    for blk in two.blocks[1:]:
        assert blk.cache_bytes == N * TABLE[blk.start - 1].out_elements * 2
    # 20 views of the first cache cannot sit beside anything under 48 MiB
    _, many = make(48 * MIB, cache_views=20)
    assert all(b.input_cache == "host" for b in many.blocks[1:])
    # a small training set: the same tight budget keeps the caches on the device
    cfg = LocalPlanConfig(memory_budget=48 * MIB)
    dev = plan_local(TABLE, cfg, num_samples=10, num_classes=K)
    m = _Model(TABLE, cfg, K, 10)
    assert sum(b.input_cache == "device" for b in dev.blocks) >= 1
    for blk in dev.blocks[1:]:    # host only when the cache does not fit beside the block at its batch
        beside = m.train_peak(blk.start, blk.stop, blk.head_width, blk.batch, device_cache=True)
        assert (blk.input_cache == "host") == (beside > cfg.usable_bytes)
    assert all(b.peak_bytes <= cfg.usable_bytes for b in dev.blocks)


def test_deterministic():
    assert make(64 * MIB)[1].to_dict() == make(64 * MIB)[1].to_dict()


def test_errors():
    with pytest.raises(ValueError, match="memory_budget"):
        make(1 * MIB)
    with pytest.raises(ValueError, match="max_blocks"):
        make(16 * MIB, max_blocks=1, batch_buckets=(32, 64))
    with pytest.raises(ValueError, match="target_batch"):
        LocalPlanConfig(memory_budget=MIB, batch_buckets=(32, 64), target_batch=16)
    with pytest.raises(ValueError, match="batch_buckets"):
        LocalPlanConfig(memory_budget=MIB, batch_buckets=(64, 32))
    with pytest.raises(ValueError, match="headroom"):
        LocalPlanConfig(memory_budget=MIB, headroom=1.5)
    with pytest.raises(ValueError, match="memory_budget"):
        LocalPlanConfig(memory_budget="lots")
    with pytest.raises(ValueError, match="saved_bytes"):
        LayerMemory("x", -1, (1, 1, 1), 0)
    with pytest.raises(ValueError, match="out_shape"):
        LayerMemory("x", 1, (1, 1), 0)
    with pytest.raises(ValueError, match="layers"):
        plan_local([], LocalPlanConfig(memory_budget=MIB), num_samples=1, num_classes=2)


def test_select_exit():
    assert select_exit([0.50, 0.80, 0.86, 0.87], 0.01) == 2
    assert select_exit([0.50, 0.80, 0.86, 0.87], 0.0) == 3
    assert select_exit([0.50, 0.80, 0.86, 0.87], 0.5) == 0
    assert select_exit([0.9, 0.7], 0.0) == 0          # the best may be early
    assert select_exit([0.86, 0.87], 0.01) == 0       # exactly at the tolerance counts
    with pytest.raises(ValueError, match="tolerance"):
        select_exit([0.5], -0.1)
    with pytest.raises(ValueError, match="accuracies"):
        select_exit([], 0.1)
    with pytest.raises(ValueError, match="accuracies"):
        select_exit([1.5], 0.1)


def test_nonfinite_policy():
    pol = NonFinitePolicy(patience=3, check_every=5)
    assert [s for s in range(1, 16) if pol.due(s)] == [5, 10, 15]
    assert [pol.until_due(s) for s in (0, 3, 4, 5, 9)] == [5, 2, 1, 5, 1]   # steps to the next read
    assert pol.check(0, steps=5, skipped=0, consecutive=0, skipped_before=0) is False
    assert pol.check(0, steps=10, skipped=2, consecutive=0, skipped_before=0) is True    # restore stats
    assert pol.check(0, steps=15, skipped=4, consecutive=2, skipped_before=2) is True
    with pytest.raises(NonFiniteTraining, match=r"block 2: the last 3 optimizer steps \(steps 17\.\.19"):
        pol.check(2, steps=20, skipped=7, consecutive=3, skipped_before=4)
    with pytest.raises(ValueError, match="consecutive"):
        pol.check(0, steps=5, skipped=1, consecutive=2, skipped_before=0)
    for kw in ({"patience": 0}, {"check_every": 0}, {"promote": 1}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            NonFinitePolicy(**kw)


def test_nonfinite_policy_promotes_to_fp32():
    """The per-block precision lever: new skips at a read promote to FP32 (any start precision, any
    spelling Precision.parse reads); no new skips, or promote=False, keep the current precision."""
    from triaccel.precision import Precision

    assert NonFinitePolicy().promote is False   # off by default (see its docstring)
    pol = NonFinitePolicy(promote=True)
    assert [pol.precision_after(True, p) for p in ("fp16", "bf16", "float32", Precision.BF16)] == [Precision.FP32] * 4
    assert [pol.precision_after(False, p) for p in ("fp16", "bf16", "fp32")] == [Precision.FP16, Precision.BF16,
                                                                                 Precision.FP32]
    assert NonFinitePolicy(promote=False).precision_after(True, "bf16") == Precision.BF16
    with pytest.raises(ValueError, match="current"):
        pol.precision_after(True, "fp8")


def test_oom_message_names_block_and_plan():
    _, plan = make(64 * MIB)
    b = len(plan.blocks) - 1
    msg = BlockOutOfMemory.message(plan, b, 7, "out of memory at batch 1", "12 bytes in use")
    blk = plan.blocks[b]
    assert msg.startswith(f"block {b} ({blk.names[0]}..{blk.names[-1]}, planned batch {blk.batch}")
    assert "step 7" in msg and "12 bytes in use" in msg and str(plan.memory_budget) in msg


def _host_bytes(plan, views):
    """The plan's host peak by hand: raw views + the largest pair of consecutive host caches."""
    on_host = [b.cache_bytes if b.input_cache == "host" else 0 for b in plan.blocks] + [0]
    return views * N * 3 * 32 * 32 + max(a + b for a, b in zip(on_host, on_host[1:]))


def test_cache_views_auto_takes_the_most_views_that_fit_the_host():
    fixed = {v: make(48 * MIB, cache_views=v)[1] for v in range(1, 9)}
    for v, plan in fixed.items():
        assert plan.cache_views == v and plan.host_peak_bytes == _host_bytes(plan, v)
    assert fixed[8].host_peak_bytes > fixed[1].host_peak_bytes
    # a host budget between 5 and 6 views' needs: auto takes 5, capped by max_cache_views
    host = (fixed[5].host_peak_bytes + fixed[6].host_peak_bytes) // 2
    _, auto = make(48 * MIB, cache_views="auto", max_cache_views=8, host_cache_bytes=host)
    assert auto.cache_views == 5 and auto.host_peak_bytes == fixed[5].host_peak_bytes <= host
    assert auto.blocks == fixed[5].blocks and auto.to_dict()["cache_views"] == 5
    _, capped = make(48 * MIB, cache_views="auto", max_cache_views=3, host_cache_bytes="1TiB")
    assert capped.cache_views == 3
    with pytest.raises(ValueError, match="host_cache_bytes"):
        make(48 * MIB, cache_views="auto", max_cache_views=8, host_cache_bytes=fixed[1].host_peak_bytes - 1)
    with pytest.raises(ValueError, match="host_cache_bytes=None"):
        LocalPlanConfig(memory_budget=48 * MIB, cache_views="auto")
    for bad in (0, "all", 1.5):
        with pytest.raises(ValueError, match="cache_views"):
            LocalPlanConfig(memory_budget=48 * MIB, cache_views=bad)
    with pytest.raises(ValueError, match="max_cache_views"):
        LocalPlanConfig(memory_budget=48 * MIB, max_cache_views=0)


def test_block_curvature_law():
    """The curvature lever per block: due every `every` epochs, the same rows each measurement, LR
    scale 1 / (1 + alpha * lambda_max) over the block's layers, alpha calibrated at the run's first
    positive measurement (scale 1/2 there) and kept for later blocks; bad input names its parameter."""
    from triaccel.local_plan import BlockCurvature

    c = BlockCurvature(every=2, samples=4)
    assert [e for e in range(6) if c.due(e)] == [1, 3, 5]
    assert c.rows(10, 7).tolist() == c.rows(10, 7).tolist() and len(c.rows(3, 7)) == 3
    assert c.observe(0, [[0.0], [0.0]]) == 1.0 and c.alpha is None        # nothing to calibrate on yet
    assert c.observe(0, [[1.0], [4.0]]) == pytest.approx(0.5) and c.alpha == 0.25
    assert c.observe(1, [2.0, 0.5]) == pytest.approx(1 / 1.5)
    assert c.lam_max == {0: [0.0, 4.0], 1: [2.0]} and c.samples_used == {0: [4, 4], 1: [4]}
    c.observe(1, [1.0], samples=2)
    assert c.samples_used[1] == [4, 2]
    with pytest.raises(ValueError, match="samples"):
        c.observe(1, [1.0], samples=0)
    assert BlockCurvature(alpha=1.0).observe(3, [1.0]) == pytest.approx(0.5)
    for kw, name in (({"every": 0}, "every"), ({"samples": 1}, "samples"), ({"alpha": 0.0}, "alpha"),
                     ({"alpha": float("inf")}, "alpha")):
        with pytest.raises(ValueError, match=name):
            BlockCurvature(**kw)
    with pytest.raises(ValueError, match="eigvals"):
        c.observe(0, [])
    with pytest.warns(RuntimeWarning, match="block 1: curvature measurement on 4 rows gave non-finite"):
        assert c.observe(1, [float("nan"), 1.0]) == pytest.approx(0.8)   # block 1's scale in force, kept
    assert c.lam_max[1][-1] != c.lam_max[1][-1] and c.scales == {0: pytest.approx(0.5), 1: pytest.approx(0.8)}
    # the trainers' argument check (both backends call it)
    assert BlockCurvature.checked(c) is c and BlockCurvature.checked(None) is None
    with pytest.raises(ValueError, match="curvature: expected a triaccel.local_plan.BlockCurvature or None, got int"):
        BlockCurvature.checked(5)


def test_block_curvature_measure_halves_then_keeps_the_scale():
    """BlockCurvature.measure: an OOM repeats the measurement on half the rows; one at a single row
    keeps the block's scale (warning); other errors propagate."""
    from triaccel.local_plan import BlockCurvature

    class OOM(Exception):
        pass

    freed = []
    c = BlockCurvature(samples=8)

    def fits_4(k):
        if k > 4:
            raise OOM
        return [[2.0], [1.0]]

    assert c.measure(0, fits_4, 8, is_oom=lambda e: isinstance(e, OOM), free_memory=lambda: freed.append(1)) == 0.5
    assert c.samples_used == {0: [4]} and freed == [1]

    def never(k):
        raise OOM

    with pytest.warns(RuntimeWarning, match="block 0: curvature measurement out of memory at one row"):
        assert c.measure(0, never, 8, is_oom=lambda e: isinstance(e, OOM), free_memory=lambda: None) == 0.5
    assert c.samples_used == {0: [4]}

    def broken(k):
        raise KeyError("not an OOM")

    with pytest.raises(KeyError):
        c.measure(1, broken, 8, is_oom=lambda e: isinstance(e, OOM), free_memory=lambda: None)
