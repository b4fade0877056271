"""`ShapeGraphs`: the forward and backward as CUDA graphs per batch size, no compiler. The CPU tests
check the arguments and the eager paths; the GPU tests (skipped without CUDA, run on the device)
check that graphed training equals eager training, BatchNorm statistics included."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from triaccel.backends.torch.cuda_graph import ShapeGraphs

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.SiLU(),
                         nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))


@pytest.mark.parametrize("kw, match", [({"sizes": []}, "sizes"), ({"sizes": [0]}, "sizes"), ({"sizes": "8"}, "sizes"),
                                       ({"sizes": [8], "max_graphs": 0}, "max_graphs"),
                                       ({"sizes": [8], "warmup": 0, "eager_first": 0}, "warmup"),
                                       ({"sizes": [8], "warmup": -1, "eager_first": 1}, "warmup"),
                                       ({"sizes": [8], "eager_first": -1}, "eager_first"),
                                       ({"sizes": [8], "eager_first": True}, "eager_first"),
                                       ({"sizes": [True]}, "sizes")])
def test_bad_arguments_name_the_parameter(kw, match) -> None:
    with pytest.raises(ValueError, match=match):
        ShapeGraphs(_net(), **kw)


def test_off_cuda_every_call_runs_the_module() -> None:
    """On a CPU (and in eval mode, under no_grad, at sizes off the list) the module runs as is."""
    net = _net()
    g = ShapeGraphs(net, [4])
    x = torch.randn(4, 3, 6, 6)
    torch.testing.assert_close(g(x), copy.deepcopy(net)(x), rtol=0, atol=0)
    assert g.captures == 0 and g.graphs == 0
    assert dict(g.named_parameters()).keys() == {"module." + k for k, _ in net.named_parameters()}


def _train(model: nn.Module, fwd, batches, *, autocast: bool) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x, y in batches:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = F.cross_entropy(fwd(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _batches(sizes, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [(torch.randn(n, 3, 8, 8, device="cuda", generator=g), torch.randint(0, 5, (n,), device="cuda", generator=g))
            for n in sizes]


@cuda
@pytest.mark.parametrize("autocast, warmup, eager_first",
                         [(False, 0, 1), (True, 0, 1), (False, 3, 0), (True, 3, 0), (True, 1, 0), (True, 1, 1)])
def test_graphed_training_equals_eager_training(autocast: bool, warmup: int, eager_first: int) -> None:
    """Steps at graphed sizes (16, 32), a size off the list (12: eager) and back: the same losses,
    weights and BatchNorm statistics as eager steps (the warm-up passes leave no trace in the
    running statistics); one capture per (size, autocast state); with each size's first step eager
    and no warm-up pass (the default), torch's 3 warm-up passes, one, and an eager step then one pass
    (the variants benchmarks/device/capture_cost.py times)."""
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    sizes = [16, 16, 32, 12, 16, 32, 32]
    eager = _net().cuda()
    graphed_net = _net().cuda()
    g = ShapeGraphs(graphed_net, [16, 32], max_graphs=4, warmup=warmup, eager_first=eager_first)
    want = _train(eager, eager, _batches(sizes), autocast=autocast)
    got = _train(graphed_net, g, _batches(sizes), autocast=autocast)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for (k, a), b in zip(eager.state_dict().items(), graphed_net.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=k)
    assert g.captures == 2 and g.graphs == 2


@cuda
def test_least_recently_used_graph_is_dropped_and_a_new_key_captures() -> None:
    net = _net().cuda()
    policy = ["a"]
    g = ShapeGraphs(net, [8, 16], key=lambda: policy[0], max_graphs=1, warmup=3, eager_first=0)
    _train(net, g, _batches([8, 8]), autocast=True)
    assert g.captures == 1 and g.graphs == 1
    _train(net, g, _batches([16]), autocast=True)   # the bs-8 graph goes
    _train(net, g, _batches([8]), autocast=True)    # captured again
    assert g.captures == 3 and g.graphs == 1
    policy[0] = "b"                                   # a new policy: a new capture at the same size
    _train(net, g, _batches([8]), autocast=True)
    assert g.captures == 4
    g.release()
    assert g.graphs == 0


def test_the_capture_probe_refuses_bad_arguments(capsys) -> None:
    """benchmarks/device/capture_cost.py (run on the GPU) refuses bad sizes and warm-up counts."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "device"))
    import capture_cost

    for bad in (["--sizes", "96", "0"], ["--warmups", "0"], ["--warmups", "lazy"]):
        with pytest.raises(SystemExit):
            capture_cost.main(bad)
        assert "--warmups integers >= 1 or 'eager'" in capsys.readouterr().err
