"""GPU-timeline step intervals of one rank of the demo: a CUDA event after each elastic_step; per epoch prints
the epoch's wall (the loop's own), the sum of step intervals, the median interval, the first/last intervals,
and the lead-in (epoch start -> first step's end). args = demo args."""
import os, runpy, statistics, sys, time
import torch
import examples.cifar.torch_loop as tl
rank = int(os.environ.get("RANK", "0"))
if os.environ.get("PIN"):   # disjoint cores per local rank
    cpus = sorted(os.sched_getaffinity(0)); w = int(os.environ.get("LOCAL_WORLD_SIZE", "1")); k = len(cpus) // w
    lr = int(os.environ.get("LOCAL_RANK", "0")); os.sched_setaffinity(0, cpus[lr * k:(lr + 1) * k])
    print(f"[probe] rank {rank} pinned to {len(os.sched_getaffinity(0))} cpus of {len(cpus)}", flush=True)
orig = tl.elastic_step
ev, samples = [], []
def step(*a, **k):
    if not ev:
        s = torch.cuda.Event(enable_timing=True); s.record(); ev.append(s); samples.append(0)
    r = orig(*a, **k)
    e = torch.cuda.Event(enable_timing=True); e.record(); ev.append(e); samples.append(r.samples)
    if r.end_of_epoch:
        torch.cuda.synchronize()
        d = [ev[i].elapsed_time(ev[i + 1]) for i in range(len(ev) - 1)]
        med = statistics.median(d[3:-2]) if len(d) > 8 else float("nan")
        b = statistics.median(samples[1:])
        if rank == 0:
            print(f"[probe] steps {len(d)} sum {sum(d):.0f} ms  median {med:.2f} ms (B {b:.0f}: {1e3 * b / med:.0f} img/s/rank)"
                  f"  first {[round(x, 1) for x in d[:4]]}  last {[round(x, 1) for x in d[-3:]]}", flush=True)
        ev.clear(); samples.clear()
    return r
tl.elastic_step = step
sys.argv = ["examples.cifar.train", *sys.argv[1:]]
runpy.run_module("examples.cifar.train", run_name="__main__", alter_sys=True)
