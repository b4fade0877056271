"""#17 probe, as run (dev box CPU, 2026-12-07): saved bytes after the forward of benchmarks/offload.py's ResNet-152
(224px, bs 2, fp32): plain, every block under a selective checkpoint keeping its convolution outputs only, every
block checkpointed whole. From the repository root: .venv/bin/python benchmarks/results/s55/cpu/sac_probe.py"""
import functools, sys, torch
sys.path.insert(0, "benchmarks")
from offload import resnet152
from triaccel.backends.torch.offload import LiveBytes
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts, CheckpointPolicy
torch.manual_seed(0)
m = resnet152()
x = torch.randn(2, 3, 224, 224)
CONV = {torch.ops.aten.convolution.default}
def policy(ctx, op, *a, **k):
    return CheckpointPolicy.MUST_SAVE if op in CONV else CheckpointPolicy.PREFER_RECOMPUTE
def run(mode):
    blocks = list(m)[1:-1]
    if mode != "plain":
        ctx = functools.partial(create_selective_checkpoint_contexts, policy) if mode == "sac" else None
        for b in blocks:
            f = b.forward
            b.forward = (lambda f: lambda *a: checkpoint(f, *a, use_reentrant=False, **({"context_fn": ctx} if ctx else {})))(f)
    live = LiveBytes()
    with live:
        loss = m(x).sum()
        after_fwd = live.allocated()
        loss.backward()
        peak = live.peak()
    for b in blocks:
        b.__dict__.pop("forward", None)
    m.zero_grad(set_to_none=True)
    return after_fwd, peak
for mode in ("plain", "sac", "full"):
    a, p = run(mode)
    print(f"{mode:6s} saved after forward {a/2**20:7.1f} MiB  peak {p/2**20:7.1f} MiB")
