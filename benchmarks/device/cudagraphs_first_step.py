"""First training steps of EfficientNet-B0 through `compile_model(..., backend="cudagraphs")`: what the
cudagraphs backend's tracing (dynamo and AOT autograd) costs before the first step, and whether a new
batch size compiles again. On a CPU the graphs themselves are skipped (torch's warning), the tracing is
the same.

    python3 benchmarks/device/cudagraphs_first_step.py dynamic    # or: static (one trace per batch size)
"""
import time, torch, torch.nn.functional as F
from triaccel.backends.torch.models import create_model
from triaccel.backends.torch.compile import compile_model
import sys
dyn = sys.argv[1] == "dynamic"
m = create_model("efficientnet_b0", num_classes=10, width=1.0, seed=0).to("cuda" if torch.cuda.is_available() else "cpu")
c = compile_model(m, backend="cudagraphs", dynamic_batch=dyn)
for bs in (8, 16, 8):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(bs, 3, 32, 32, device=dev); y = torch.randint(0, 10, (bs,), device=dev)
    t = time.time()
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        loss = F.cross_entropy(c(x), y)
    loss.backward()
    if dev == "cuda":
        torch.cuda.synchronize()
    print(f"bs {bs}: {time.time() - t:.2f} s", flush=True)
t = time.time()
with torch.autocast(x.device.type, dtype=torch.bfloat16):
    loss = F.cross_entropy(m(x), y)
loss.backward()
if dev == "cuda":
    torch.cuda.synchronize()
print(f"eager bs 8: {time.time() - t:.2f} s")
print(dict(torch._dynamo.utils.counters["stats"]))
