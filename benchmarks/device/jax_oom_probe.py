"""Where does JAX report a device out-of-memory error: at the jitted call (dispatch) or only when the
result is waited for? (`elastic_step` waits for every micro-batch so that an OOM surfaces inside its
retry loop; that wait costs the loop its overlap of host and device.)

    python3 benchmarks/device/jax_oom_probe.py      # GPU machine, after prep.sh

Cases, each after the device already holds --fill GiB: a jitted function whose output does not fit,
one whose temporaries do not fit (a sort of an outer product), and the same dispatched while an
earlier long computation is still running (the allocation then happens while the stream is busy).
Prints, per case, "dispatch" or "wait" (where the error was raised) and the error's first line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # benchmarks/: the shared helpers
from _results import write_to_out  # noqa: E402


def where(fn, *args) -> dict[str, str]:
    try:
        out = fn(*args)
    except Exception as e:  # XLA's runtime errors have no public OOM type
        return {"raised": "dispatch", "error": str(e).splitlines()[0][:160]}
    try:
        jax.block_until_ready(out)
    except Exception as e:
        return {"raised": "wait", "error": str(e).splitlines()[0][:160]}
    return {"raised": "none", "error": ""}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fill", type=float, default=None, help="GiB held before the cases (default: all but 4 GiB, so that the sorted outer product stays below 2^31 elements)")
    a = ap.parse_args()
    dev = jax.devices()[0]
    limit = (dev.memory_stats() or {}).get("bytes_limit", 16 * 2**30)
    fill = int((a.fill * 2**30) if a.fill is not None else limit - 4 * 2**30)
    held = jnp.ones((fill // 4,), jnp.float32).block_until_ready()
    free = limit - fill
    n_out = int((1.5 * free / 4) ** 0.5) + 1          # an n x n float32 output of ~1.5x the free bytes
    out_fn = jax.jit(lambda x: x[:, None] * x[None, :])
    tmp_fn = jax.jit(lambda x: jnp.sort((x[:, None] * x[None, :]).ravel())[:4])
    x = jnp.linspace(0.0, 1.0, n_out, dtype=jnp.float32)
    out_fn.lower(x).compile()
    tmp_fn.lower(x).compile()
    m = 8192
    busy = jax.jit(lambda a: jax.lax.fori_loop(0, 200, lambda i, b: jnp.tanh(b @ b), a))
    b = jnp.ones((m, m), jnp.float32) / m
    jax.block_until_ready(busy(b))
    rows = {}
    rows["output too large"] = where(out_fn, x)
    rows["temporaries too large"] = where(tmp_fn, x)
    t0 = time.perf_counter()
    pending = busy(b)                                   # the stream is busy for a while
    rows["output too large, stream busy"] = where(out_fn, x)
    rows["temporaries too large, stream busy"] = where(tmp_fn, x)
    rows["busy computation still ran"] = {"raised": "none" if bool(jnp.isfinite(pending).all()) else "nan",
                                          "error": f"{time.perf_counter() - t0:.2f} s"}
    del held
    print(f"# {dev.device_kind}, jax {jax.__version__}, {fill / 2**30:.1f} GiB held of {limit / 2**30:.1f}")
    for k, v in rows.items():
        print(f"{k:<36} {v['raised']:<9} {v['error']}")
    write_to_out("jax_oom_probe.json", {"device": dev.device_kind, "jax": jax.__version__, "rows": rows})


if __name__ == "__main__":
    main()
