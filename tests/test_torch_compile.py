"""torch.compile with the wrapper (CPU, dynamo's eager / aot_eager backends): no graph break, one
compilation per (batch shape, precision policy) visited, results as the uncompiled wrapped model."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from triaccel import Precision, TriAccelConfig
from triaccel.backends.torch import wrap
from triaccel.backends.torch.compile import compile_model, uncompiled

BF16, FP32 = Precision.BF16, Precision.FP32


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(4, 3))


def _wrapped(model: nn.Module, **cfg) -> object:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # CPU: the memory probe does not measure
        return wrap(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model,
                    TriAccelConfig(elastic_batch=False, **cfg))


def _batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 6, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def _policy(opt, fp32_layers: set[str]) -> list[Precision]:
    return [FP32 if layer.name in fp32_layers else BF16 for layer in opt.layers]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("dynamic_batch", [True, False])
def test_compiles_once_per_shape_and_policy_without_breaks(dynamic_batch: bool) -> None:
    model = _net()
    opt = _wrapped(model)
    cnt = CompileCounterWithBackend("eager")   # graphs, breaks and guards are dynamo's, whatever the backend
    cmodel = compile_model(model, opt, backend=cnt, dynamic_batch=dynamic_batch)
    # (batch, layers in FP32): policies change, come back, batches change and come back
    schedule = [(8, set()), (4, set()), (8, {"7"}), (8, {"0", "7"}), (4, {"7"}), (8, set()), (4, set())]
    visited: set[tuple[int, str]] = set()
    for i, (n, fp32) in enumerate(schedule):
        opt.plan.apply(_policy(opt, fp32))
        visited.add((n, opt.plan.key))
        x, y = _batch(n, i)
        with opt.autocast():
            out = cmodel(x)
            loss = F.cross_entropy(out, y)
        # the output layer's dtype follows the policy in force (a stale graph would not)
        assert out.dtype == (torch.float32 if "7" in fp32 else torch.bfloat16), (i, fp32)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
    assert dict(counters["graph_break"]) == {}
    policies = {key for _, key in visited}
    assert len(policies) == 3 and set(opt.plan.keys_seen) == policies
    expected = len(policies) if dynamic_batch else len(visited)
    assert cnt.frame_count == expected, (cnt.frame_count, sorted(visited))


def _train_step(opt, model_call, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One wrapped training step (autocast forward, backward, step, zero_grad); the loss."""
    with opt.autocast():
        loss = F.cross_entropy(model_call(x), y)
    opt.backward(loss)
    opt.step()
    opt.zero_grad()
    return loss


def test_static_batches_compile_each_listed_size_once_per_policy_and_run_others_eagerly() -> None:
    from triaccel.backends.torch.compile import BatchDispatch

    model = _net()
    opt = _wrapped(model)
    cnt = CompileCounterWithBackend("eager")
    cmodel = compile_model(model, opt, backend=cnt, static_batches=(4, 8))
    assert isinstance(cmodel, BatchDispatch) and uncompiled(cmodel) is model
    assert dict(cmodel.named_parameters()).keys() == {f"module.{k}" for k, _ in model.named_parameters()}
    # (batch, layers in FP32); 6 and 5 are off the list: eager, no compilation
    schedule = [(8, set()), (4, set()), (6, set()), (8, {"7"}), (5, {"7"}), (4, {"7"}), (8, set()), (6, set())]
    compiled_pairs: set[tuple[int, str]] = set()
    for i, (n, fp32) in enumerate(schedule):
        opt.plan.apply(_policy(opt, fp32))
        if n in (4, 8):
            compiled_pairs.add((n, opt.plan.key))
        x, y = _batch(n, i)
        with opt.autocast():
            out = cmodel(x)
            want = model(x)   # the wrapped model itself, uncompiled
        assert out.dtype == want.dtype == (torch.float32 if "7" in fp32 else torch.bfloat16), (i, fp32)
        torch.testing.assert_close(out, want)
        assert cnt.frame_count == len(compiled_pairs), (i, cnt.frame_count, sorted(compiled_pairs))
        _train_step(opt, cmodel, x, y)
    assert dict(counters["graph_break"]) == {}
    assert cnt.frame_count == len(compiled_pairs) == 4


def _train(model_call, opt, steps: int) -> list[float]:
    losses = []
    for i in range(steps):
        losses.append(_train_step(opt, model_call, *_batch(8, 100 + i)).item())
    return losses


def test_fp32_matches_uncompiled_wrapped_model() -> None:
    ref_model, model = _net(1), _net(1)
    ref_opt = _wrapped(ref_model, base_precision="fp32")
    opt = _wrapped(model, base_precision="fp32")
    cmodel = compile_model(model, opt, backend="aot_eager")
    ref = _train(ref_model, ref_opt, 3)
    got = _train(cmodel, opt, 3)
    assert got == pytest.approx(ref, rel=1e-5, abs=1e-6)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert dict(counters["graph_break"]) == {}


def test_mixed_policy_matches_uncompiled_wrapped_model() -> None:
    ref_model, model = _net(2), _net(2)
    ref_opt, opt = _wrapped(ref_model), _wrapped(model)
    for o in (ref_opt, opt):
        o.plan.apply(_policy(o, {"3"}))          # BF16 majority, the second conv in FP32
    cmodel = compile_model(model, opt, backend="aot_eager")
    x, _ = _batch(8, 7)
    with opt.autocast():
        got = cmodel(x)
    with ref_opt.autocast():
        ref = ref_model(x)
    assert got.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert dict(counters["graph_break"]) == {}


def test_plain_compiled_instance_of_same_class_does_not_capture_wrapped_graphs() -> None:
    cnt = CompileCounterWithBackend("eager")
    plain, model = _net(0), _net(1)
    x, _ = _batch(8, 0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert compile_model(plain, None, backend=cnt)(x).dtype == torch.bfloat16
    opt = _wrapped(model)
    opt.plan.apply(_policy(opt, {"7"}))
    cmodel = compile_model(model, opt, backend=cnt)
    with opt.autocast():
        assert cmodel(x).dtype == torch.float32      # its own graph, with the FP32 output layer
    assert cnt.frame_count == 2 and uncompiled(cmodel) is model


def test_wrap_accepts_compiled_model_and_keeps_names() -> None:
    model = _net()
    opt = _wrapped(torch.compile(model, backend="eager"))
    assert opt.model is model and uncompiled(opt.model) is model
    assert [layer.name for layer in opt.layers] == ["0", "1", "3", "7"]


def test_curvature_on_an_in_place_compiled_model_adds_no_compilation() -> None:
    model = _net()
    x, y = _batch(8, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        opt = wrap(torch.optim.SGD(model.parameters(), lr=0.05), model,
                   TriAccelConfig(elastic_batch=False, curvature="fisher", warmup_steps=0, t_ctrl=1, t_curv=1,
                                  b_curv=4), curvature_data=(x, y))
    cnt = CompileCounterWithBackend("eager")
    model.compile(backend=cnt)                  # nn.Module.compile: model(...) itself is compiled
    with opt.autocast():
        loss = F.cross_entropy(model(x), y)
    opt.backward(loss)
    opt.step()                                  # a curvature step: vmap(grad) over the model
    assert opt.last_eigvals is not None and cnt.frame_count == 1
    assert dict(counters["graph_break"]) == {}


def test_split_steps_keep_gradients_out_of_graph_memory() -> None:
    # The evidence law (16-bit base) measures gradient noise at step 0 when warm-up is 0: that step
    # runs as two micro-batches, so zero_grad allocates the gradient buffers before it.
    model = _net()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        opt = wrap(torch.optim.SGD(model.parameters(), lr=0.05), model,
                   TriAccelConfig(warmup_steps=0, t_ctrl=5, batch_init=8, batch_min=8, batch_max=16))
    assert opt.controller.is_noise_step(0)
    opt.zero_grad()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    x, y = _batch(8, 3)
    with opt.autocast():
        loss = F.cross_entropy(model(x), y)
    opt.backward(loss)
    opt.step()
    assert not opt.controller.is_noise_step(opt.step_count)
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_region_exit_clears_state_saved_by_a_raising_hooked_layer() -> None:
    # The post-hooks are not always_call (dynamo would guard on their ids): a layer that raises
    # leaves its pre-hook's saved state, which the region's exit drops.
    model = _net()
    opt = _wrapped(model)
    opt.plan.apply(_policy(opt, {"0"}))        # the first conv hooked to FP32 under a BF16 majority
    x, _ = _batch(4, 0)
    with pytest.raises(RuntimeError):
        with opt.autocast():
            model(x[:, :2])                    # wrong channel count: the hooked conv raises
    assert not torch.is_autocast_enabled("cpu") and all(not st for st in opt.plan._stacks)
    with opt.autocast():
        out = model(x)
        assert torch.is_autocast_enabled("cpu")
    assert out.dtype == torch.bfloat16 and all(not st for st in opt.plan._stacks)


@pytest.mark.parametrize("kwargs", [dict(mode="fast"), dict(max_variants=0), dict(dynamic=True),
                                    dict(dynamic_batch=1), dict(static_batches=()), dict(static_batches=(0, 8)),
                                    dict(static_batches=8), dict(static_batches="8"), dict(static_batches=(True,)),
                                    dict(static_batches=(8,), dynamic_batch=True)])
def test_compile_model_rejects_bad_options(kwargs) -> None:
    with pytest.raises(ValueError):
        compile_model(_net(), None, backend="eager", **kwargs)


def test_cudagraphs_backend_compiles_per_shape() -> None:
    """torch's 'cudagraphs' backend replays a recording at one batch size for another (pytorch#131009):
    compile_model gives it static shapes unless static_batches are listed, and refuses dynamic_batch=True."""
    with pytest.raises(ValueError, match="dynamic_batch=True with backend='cudagraphs'"):
        compile_model(_net(), None, backend="cudagraphs", dynamic_batch=True)
    model = compile_model(_net(), None, backend="cudagraphs")
    for b in (8, 6, 8):
        model(torch.randn(b, 3, 8, 8))
    assert counters["stats"]["unique_graphs"] == 2   # one per shape: 8 and 6, 8 reused


def test_compile_model_rejects_foreign_optimizer() -> None:
    opt = _wrapped(_net(0))
    with pytest.raises(ValueError, match="optimizer"):
        compile_model(_net(1), opt, backend="eager")


def test_compiles_the_inner_module_of_a_wrapped_ddp_model() -> None:
    """Data parallel: `wrap` gets the DDP module, the training forward runs its inner module
    (`Distributed.training_module()`); `compile_model` accepts that pair, and the compiled step
    equals the uncompiled one (one process, gloo)."""
    import socket

    import torch.distributed as dist

    from triaccel.backends.torch.distributed import Distributed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        outs = []
        for compiled in (False, True):
            dp = Distributed()
            ddp = dp.prepare(_net(0))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                opt = wrap(torch.optim.SGD(ddp.parameters(), lr=0.05), ddp,
                           TriAccelConfig(elastic_batch=False), distributed=dp)
            fwd = dp.training_module()
            assert fwd is ddp.module
            if compiled:
                fwd = compile_model(fwd, opt, backend="eager")
            x, y = _batch(8, 3)
            with opt.autocast():
                loss = F.cross_entropy(fwd(x), y)
            opt.backward(loss)
            dp.sync_gradients(list(ddp.parameters()), 8, 8, 0)
            opt.step()
            outs.append([p.detach().clone() for p in ddp.parameters()])
        assert all(torch.allclose(a, b) for a, b in zip(*outs))
        with pytest.raises(ValueError, match="optimizer"):
            compile_model(_net(1), opt, backend="eager")
    finally:
        dist.destroy_process_group()


def test_efficientnet_compiles_once_without_breaks() -> None:
    # EfficientNet-B0 (SE blocks, SiLU, depthwise convs) under the wrapper: one graph for every batch
    # size with a dynamic batch dimension, no break (issue 14's host-bound model, for --compile)
    from triaccel.backends.torch.models import create_model

    model = create_model("efficientnet_b0", num_classes=10, width=0.25, seed=0)
    opt = _wrapped(model)
    cnt = CompileCounterWithBackend("eager")
    cmodel = compile_model(model, opt, backend=cnt, dynamic_batch=True)
    for i, n in enumerate([8, 4, 8, 6]):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)
        _train_step(opt, cmodel, x, y)
    assert dict(counters["graph_break"]) == {}
    assert cnt.frame_count == len(opt.plan.keys_seen) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs (mode='reduce-overhead') need a GPU")
def test_cuda_graph_steps_of_several_micro_batches_sum_the_whole_batch_gradient() -> None:
    """Under cudagraph trees a backward hands gradients over in the graphs' pool, which the next
    replay overwrites: noise-measurement splits (after single-batch steps) and an OOM replay must
    still sum to the whole batch's gradient (on the H100 they raised "accessing tensor output of
    CUDAGraphs that has been overwritten" before `own_gradients`)."""
    from triaccel.backends.torch.data import ElasticLoader, elastic_step

    dev = torch.device("cuda")
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                              nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3)).to(dev)
        cfg = TriAccelConfig(batch_init=16, batch_min=8, batch_max=64, batch_buckets=(8, 16, 32, 64), t_ctrl=5,
                             warmup_steps=0, base_precision="fp32", curvature="off", adaptive_precision=False)
        opt = wrap(torch.optim.SGD(model.parameters(), lr=0.05), model, cfg)
        cmodel = compile_model(model, opt, mode="reduce-overhead")
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(400, 3, 8, 8, generator=g), torch.randint(0, 3, (400,), generator=g)
        loader = ElasticLoader(x, y, batch_size=16, seed=0)
        calls, seen, checked = [0], [], []

        def loss_fn(batch):
            calls[0] += 1
            # steps 0 and 5 are noise splits (calls 1-2, 7-8; step 5's follows single-batch steps,
            # whose gradients sit in the pool); step 6's first forward (call 9) runs out of memory
            if calls[0] == 9:
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")
            xb, yb = batch[0].to(dev), batch[1].to(dev)
            seen.append((xb, yb))
            with opt.autocast():
                return F.cross_entropy(cmodel(xb), yb)

        def step_and_check(decision):
            got = [p.grad.detach().clone() for p in model.parameters()]
            xs, ys = torch.cat([s[0] for s in seen]), torch.cat([s[1] for s in seen])
            ref = torch.autograd.grad(F.cross_entropy(model(xs), ys), list(model.parameters()))
            checked.append(all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(got, ref)))
            opt.step_accumulated()

        sizes = []
        for _ in range(8):
            seen.clear()
            res = elastic_step(loader, opt.controller, loss_fn, opt, opt.step_count, scaler=opt,
                               apply_lr_batch_scale=False, optimizer_step=step_and_check)
            sizes.append(res.micro_sizes)
        assert sizes[1:7] == [[16]] * 4 + [[8, 8], [8, 8]], sizes   # split after pool handovers, OOM replay
        assert all(checked), (sizes, checked)
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
