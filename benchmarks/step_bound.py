"""Is a training step host-bound or GPU-bound? Eager wall time per step beside the GPU time of the same step.

Run on a CUDA machine:  python benchmarks/step_bound.py [--model resnet18] [--case NAME:START:STOP:BATCH[:HEAD]] ...

A case trains units [START, STOP) of the model's unit sequence (`triaccel.backends.torch.local.sequential_units`:
ResNet-18 = stem + 8 BasicBlocks, EfficientNet-B0 = stem + 16 MBConv + head conv) at BATCH samples against
an auxiliary head of width HEAD (`AuxHead`; omitted or "clf" with STOP = all units: the model's own
classifier, i.e. end-to-end training). Input: random data of the shape the frozen prefix produces on
CIFAR images (32x32). Step: bf16 autocast forward, cross-entropy, backward, fused SGD (momentum 0.9,
Nesterov, weight decay 5e-4), ``zero_grad(set_to_none=True)`` (the demo's and the local trainer's step).

Columns (ms per step): ``wall`` = pipelined eager steps, synchronised once at the end; ``issue`` = the
host's time to queue them (before that sync); ``gpu`` = the forward + backward replayed as one CUDA graph
plus the fused SGD step, each timed with CUDA events (the step's device time without host gaps).
``wall / gpu`` near 1: GPU-bound; well above 1: the GPU waits for the host (a leaner host path or CUDA
graphs would pay). Default cases: the local plan of issue 18 on ResNet-18 (blocks stem..layer2.0 and
layer2.1..layer4.0 at batch 64, heads of width 256) and end-to-end at batch 32 and 64.
Writes benchmarks/results/step_bound/step-bound-<model>-<device>.json.
``--smoke`` runs on the CPU with a tiny model (no CUDA graph; gpu column empty).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from _results import device_tag, write_json
from triaccel.backends.torch.local import AuxHead, sequential_units
from triaccel.backends.torch.models import create_model

DEFAULT_CASES = {"resnet18": ["block0:0:4:64:256", "block1:4:8:64:256", "e2e:0:9:32:clf", "e2e:0:9:64:clf"],
                 "efficientnet_b0": ["e2e:0:18:96:clf", "e2e:0:18:192:clf", "e2e:0:18:512:clf"]}


def parse_case(text: str, n_units: int) -> tuple[str, int, int, int, int | None]:
    """NAME:START:STOP:BATCH[:HEAD] -> (name, start, stop, batch, head width or None for the classifier)."""
    parts = text.split(":")
    if len(parts) not in (4, 5) or not all(p.isdigit() for p in parts[1:4]):
        raise ValueError(f"--case {text!r}: expected NAME:START:STOP:BATCH[:HEAD], e.g. block0:0:4:64:256")
    start, stop, batch = (int(p) for p in parts[1:4])
    if not 0 <= start < stop <= n_units or batch < 1:
        raise ValueError(f"--case {text!r}: needs 0 <= START < STOP <= {n_units} (the model's units) and BATCH >= 1")
    head = None if len(parts) == 4 or parts[4] == "clf" else parts[4]
    if head is not None and not head.isdigit():
        raise ValueError(f"--case {text!r}: HEAD must be a width >= 0 or 'clf'")
    if head is None and stop != n_units:
        raise ValueError(f"--case {text!r}: the model's classifier needs STOP = {n_units}; give a HEAD width")
    return parts[0], start, stop, batch, None if head is None else int(head)


def measure(name: str, units: list[nn.Module], clf: nn.Module, case: tuple, fmt: Any, dev: torch.device,
            steps: int, smoke: bool) -> dict[str, Any]:
    _, start, stop, batch, head_w = case
    with torch.no_grad():
        x = torch.randn(2, 3, 32, 32, device=dev).contiguous(memory_format=fmt)
        for m in units[:start]:
            m.eval()
            x = m(x)
    shape = tuple(x.shape[1:])
    body = nn.Sequential(*units[start:stop]).train()
    if head_w is None:
        head = clf
    else:
        with torch.no_grad():
            c = body(torch.zeros(2, *shape, device=dev).contiguous(memory_format=fmt)).shape[1]
        head = AuxHead(c, head_w, 10).to(dev)
    head = head.to(memory_format=fmt).train()
    params = [*body.parameters(), *head.parameters()]
    opt = torch.optim.SGD(params, lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4, fused=not smoke)
    xb = torch.randn(batch, *shape, device=dev).contiguous(memory_format=fmt)
    yb = torch.randint(0, 10, (batch,), device=dev)
    cast = torch.autocast(dev.type, dtype=torch.bfloat16)

    def fwd_bwd() -> None:
        with cast:
            loss = F.cross_entropy(head(body(xb)), yb)
        loss.backward()

    def step() -> None:
        fwd_bwd()
        opt.step()
        opt.zero_grad(set_to_none=True)

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for _ in range(min(steps, 20)):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    issue = (time.perf_counter() - t0) / steps * 1e3
    sync()
    wall = (time.perf_counter() - t0) / steps * 1e3
    gpu = opt_ms = float("nan")
    if dev.type == "cuda":
        opt.zero_grad(set_to_none=False)    # static gradient buffers for the graph
        cast = torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False)   # no cached casts across replays
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                fwd_bwd()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fwd_bwd()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        timed = []
        for fn in (g.replay, opt.step):
            for _ in range(5):
                fn()
            e0.record()
            for _ in range(steps):
                fn()
            e1.record()
            torch.cuda.synchronize()
            timed.append(e0.elapsed_time(e1) / steps)
        opt_ms = timed[1]
        gpu = timed[0] + opt_ms
    return {"case": name, "start": start, "stop": stop, "batch": batch, "head": "clf" if head_w is None else head_w,
            "input_shape": list(shape), "params": sum(p.numel() for p in params), "wall_ms": wall, "issue_ms": issue,
            "gpu_ms": gpu, "opt_gpu_ms": opt_ms, "wall_over_gpu": wall / gpu if gpu == gpu else float("nan")}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(DEFAULT_CASES), default="resnet18")
    p.add_argument("--case", action="append", default=None, help="NAME:START:STOP:BATCH[:HEAD] (repeatable)")
    p.add_argument("--memory-format", choices=["channels_last", "contiguous"], default=None,
                   help="default: the demo's (contiguous for EfficientNet, channels_last otherwise)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, few steps, no CUDA graph")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.steps < 1:
        p.error(f"--steps={a.steps}: allowed [1, inf)")
    dev = torch.device("cpu" if a.smoke or not torch.cuda.is_available() else "cuda")
    if dev.type == "cpu" and not a.smoke:
        p.error("no CUDA device: this benchmark times GPU steps (use --smoke for a CPU check of the script)")
    torch.backends.cudnn.benchmark = True    # fixed shapes per case
    fmt_name = a.memory_format or ("contiguous" if a.model == "efficientnet_b0" else "channels_last")
    fmt = torch.channels_last if fmt_name == "channels_last" else torch.contiguous_format
    width = 0.125 if a.smoke else 1.0
    units, clf = sequential_units(create_model(a.model, num_classes=10, width=width).to(dev).to(memory_format=fmt))
    mods = [m for _, m in units]
    texts = a.case or DEFAULT_CASES[a.model]
    try:
        cases = [parse_case(t, len(mods)) for t in texts]
    except ValueError as exc:
        p.error(str(exc))
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    meta = {"device": name, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([os.path.basename(sys.executable)] + sys.argv), "torch": torch.__version__,
            "model": a.model, "memory_format": fmt_name, "steps": a.steps}
    print("#", meta)
    print(f"{'case':<10}{'units':>8}{'batch':>7}{'head':>6}{'wall':>9}{'issue':>9}{'gpu':>9}{'wall/gpu':>10}")
    rows = []
    for t, c in zip(texts, cases):
        r = measure(c[0], mods, clf, c, fmt, dev, a.steps, a.smoke)
        rows.append(r)
        print(f"{r['case']:<10}{f'{c[1]}-{c[2]}':>8}{r['batch']:>7}{str(r['head']):>6}{r['wall_ms']:>9.2f}"
              f"{r['issue_ms']:>9.2f}{r['gpu_ms']:>9.2f}{r['wall_over_gpu']:>10.2f}", flush=True)
    out = {"meta": meta, "rows": rows}
    path = a.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "step_bound",
                                 f"step-bound-{a.model}-{device_tag(name)}.json")
    if not a.smoke or a.out:
        write_json(out, path)
    return out


if __name__ == "__main__":
    main()
