"""Where a local block's CUDA-graph capture finds the memory gone (device only; issue 18's diagnostic).

Runs the CIFAR demo with its arguments and prints, prefixed for grep: ``STAGE`` the allocated MiB and
the live CUDA bf16 tensors before and after each planning stage of ``--method local`` (end-to-end
probes, ``measure_layers``, the plan, the trainer); ``PRE`` what is allocated/reserved and the largest
live tensors just before each capture (after gc and ``empty_cache``); ``SNAP`` the allocator's
segments by pool when a capture runs out of memory. It found the layer table's leak (2026-11-23).

  source benchmarks/device/prep.sh; cd /tmp/pkg
  python3 benchmarks/device/capture_snapshot.py --backend torch --method local --budget e2e:32 \\
      --block-inputs fresh --epochs 1 --data /tmp/data/cifar10-jpeg --no-progress --out $OUT/snap
"""

from __future__ import annotations

import collections
import gc
import sys

import torch

from examples.cifar import local_loop, train
from triaccel.backends.torch import cuda_graph
from triaccel.backends.torch.local import live_tensors


def _mib() -> int:
    return torch.cuda.memory_allocated() >> 20 if torch.cuda.is_initialized() else 0


def _bf16_alive() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.is_cuda and o.dtype == torch.bfloat16)


def _staged(name: str, fn):
    def run(*args, **kwargs):
        print(f"STAGE before {name}: {_mib()} MiB allocated, {_bf16_alive()} bf16 tensors", flush=True)
        out = fn(*args, **kwargs)
        print(f"STAGE after {name}: {_mib()} MiB allocated, {_bf16_alive()} bf16 tensors", flush=True)
        return out
    return run


def _segments() -> None:
    by_pool: dict = collections.defaultdict(lambda: [0, 0, 0])
    for seg in torch.cuda.memory_snapshot():
        key = (str(seg.get("segment_pool_id")), seg.get("segment_type"), seg.get("is_expandable"))
        row = by_pool[key]
        row[0] += 1
        row[1] += seg["total_size"]
        row[2] += seg["allocated_size"]
    for key, (n, total, used) in sorted(by_pool.items(), key=lambda kv: -kv[1][1]):
        print(f"SNAP pool/type/expandable {key}: {n} segments, {total >> 20} MiB reserved, {used >> 20} MiB allocated",
              flush=True)


def main() -> None:
    capture = cuda_graph.GraphedStep._capture

    def traced(self, inputs):
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        print(f"PRE capture: {_mib()} MiB allocated, {torch.cuda.memory_reserved() >> 20} MiB reserved; "
              + live_tensors("cuda", 12), flush=True)
        try:
            return capture(self, inputs)
        except torch.OutOfMemoryError:
            _segments()
            raise

    cuda_graph.GraphedStep._capture = traced
    for name in ("_e2e_probe", "measure_layers", "_plan", "LocalTrainer"):
        setattr(local_loop, name, _staged(name, getattr(local_loop, name)))
    train.main(sys.argv[1:])


if __name__ == "__main__":
    main()
