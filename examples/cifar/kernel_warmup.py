"""The demo's `--triton-warmup process` (torch, triaccel, one CUDA device): the statistics kernel compiled
by a child process started before the run loads its data, so that the run's own first launch finds it in
Triton's on-disk cache.

A thread cannot hide that compilation: Triton's front end and passes hold the interpreter lock, and the
demo's set-up is Python too (H200, 2026-11-28, `benchmarks/device/triton_warmup_probe.py`: the launch took
2.0-3.1 s on a thread beside Python work against 1.05 s alone; from the cache filled by another process it
took 0.19-0.21 s). The child builds the same model and wrapper as the run (`torch_loop.build_model`,
`inner_optimizer`, `RunOptions.triaccel_config`), so its launch has the run's specialisation, launches
once (`TriAccelOptimizer.prepare_kernels`) and exits; it writes nothing but the cache. If it fails, the
run compiles the kernel itself, as without it, and says why.

    python3 -m examples.cifar.kernel_warmup < pickled (RunOptions, num_classes)   # the child
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
import warnings
from typing import Any

from triaccel.data import NUM_CLASSES

from .common import RunOptions

# seconds the run waits for the child before compiling itself (the child takes ~5 s on an H200)
WAIT_S = 60.0


def spawn(opts: RunOptions) -> subprocess.Popen | None:
    """The child for a torch triaccel run with `triton_warmup="process"` on one CUDA device, started at
    once; None where there is none to start (another method, backend or option, torchrun, no CUDA)."""
    if (opts.backend != "torch" or opts.method != "triaccel" or opts.triton_warmup != "process"
            or "WORLD_SIZE" in os.environ or not (opts.device == "auto" or opts.device.startswith("cuda"))):
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    return start(opts, NUM_CLASSES[opts.dataset])


def start(opts: RunOptions, num_classes: int) -> subprocess.Popen:
    """The child for `opts` (any device), its output kept in a temporary file for `finish`."""
    log = tempfile.TemporaryFile()
    child = subprocess.Popen([sys.executable, "-m", "examples.cifar.kernel_warmup"], stdin=subprocess.PIPE,
                             stdout=log, stderr=subprocess.STDOUT, cwd=os.getcwd())
    child.log = log   # type: ignore[attr-defined]
    assert child.stdin is not None
    with child.stdin:
        child.stdin.write(pickle.dumps((opts, num_classes)))
    return child


def finish(child: subprocess.Popen | None, opt: Any) -> None:
    """Wait for the child (at most WAIT_S seconds), then the run's own first launch (from the cache when
    the child succeeded). Call before the first forward: loading a module during a CUDA graph capture
    would break the capture."""
    if child is not None:
        try:
            rc = child.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            warnings.warn(f"--triton-warmup process: the child did not finish in {WAIT_S:.0f} s; the run "
                          "compiles the statistics kernel itself", RuntimeWarning, stacklevel=2)
        else:
            if rc != 0:
                log = getattr(child, "log", None)
                tail: list[str] = []
                if log is not None:
                    log.seek(0)
                    tail = log.read().decode(errors="replace").strip().splitlines()[-5:]
                warnings.warn(f"--triton-warmup process: the child exited with {rc}; the run compiles the "
                              f"statistics kernel itself. Its last lines: {tail}", RuntimeWarning, stacklevel=2)
        if getattr(child, "log", None) is not None:
            child.log.close()
    opt.prepare_kernels()


def main() -> None:
    import torch

    from triaccel.backends.torch import wrap

    from .torch_loop import build_model, inner_optimizer, pick_device

    opts, num_classes = pickle.loads(sys.stdin.buffer.read())
    device = pick_device(opts)
    model = build_model(opts, num_classes, device)
    opt = wrap(inner_optimizer(opts, model), model, opts.triaccel_config(1))
    opt.prepare_kernels()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    main()
