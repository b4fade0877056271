"""A disk cache for jax-triton's kernel compilations, shared by the processes of one machine.

jax-triton compiles a Triton kernel (TTIR -> TTGIR -> LLVM IR -> PTX) while JAX lowers the function
that calls it, keeps the PTX in memory only, and turns Triton's own disk cache off (its import sets
``TRITON_CACHE_DIR=""``). Every process therefore compiles each kernel variant again, inside a
lowering (on the critical path when the training step waits for it), and JAX's persistent
compilation cache cannot help, since its key is computed from the lowered module. `install`
wraps jax-triton's compile step (``triton_lib.compile_ttir_inplace``) with a cache keyed by the
kernel's TTIR text, the compile options, the compute capability and the Triton and jax-triton
versions; entries are small JSON files under ``<cache>/jax-triton``
(``<cache>``: ``$TRIACCEL_CACHE`` or ``~/.cache/triaccel``). ``TRIACCEL_JAX_TRITON_CACHE=0`` leaves
jax-triton as it is, as does a jax-triton version without that compile step.

Measured on an H100 (2026-11-23, fresh processes): a kernel variant's lowering 0.32-0.40 s without,
0.12 s with a warm cache. The first kernel lowering of a process still takes ~5 s there: with Triton
3.6 jax-triton's argument specializer, which runs before this step, imports torch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

__all__ = ["install", "default_folder", "ENV_SWITCH"]

ENV_SWITCH = "TRIACCEL_JAX_TRITON_CACHE"
_MARK = "_triaccel_disk_cache"


def default_folder() -> Path:
    """``<cache>/jax-triton``, ``<cache>`` being ``$TRIACCEL_CACHE`` or ``~/.cache/triaccel``."""
    env = os.environ.get("TRIACCEL_CACHE")
    return (Path(env) if env else Path.home() / ".cache" / "triaccel") / "jax-triton"


def install(jt: Any, folder: str | os.PathLike[str] | None = None) -> bool:
    """Put the disk cache in front of ``jt.triton_lib.compile_ttir_inplace`` (once per process).

    jt: the imported ``jax_triton`` module. folder: where entries go (default `default_folder()`).
    Returns True when the cache is in place, False when it was switched off (``ENV_SWITCH`` set to
    0/off/false) or this jax-triton has no compile step of the expected shape."""
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "off", "false", "no"):
        return False
    lib = getattr(jt, "triton_lib", None)
    compile_fn = getattr(lib, "compile_ttir_inplace", None)
    result_cls = getattr(lib, "CompilationResult", None)
    if compile_fn is None or result_cls is None or not dataclasses.is_dataclass(result_cls):
        return False
    if getattr(compile_fn, _MARK, False):
        return True
    import triton

    where = Path(folder) if folder is not None else default_folder()
    names = tuple(f.name for f in dataclasses.fields(result_cls))
    versions = (triton.__version__, getattr(jt, "__version__", "unknown"), names)

    def cached(ttir: Any, backend: Any, options: Any, compute_capability: Any, platform: Any) -> Any:
        if getattr(options, "debug", False):   # debug prints the stages: nothing to take from disk
            return compile_fn(ttir, backend, options, compute_capability, platform)
        key = hashlib.sha256(repr((versions, str(ttir), repr(options), compute_capability,
                                   platform)).encode()).hexdigest()
        path = where / f"{key}.json"
        try:
            return result_cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):   # absent, or unreadable: compile it again
            pass
        result = compile_fn(ttir, backend, options, compute_capability, platform)
        try:
            where.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")   # whole files only: readers race writers
            tmp.write_text(json.dumps(dataclasses.asdict(result)))
            os.replace(tmp, path)
        except (OSError, TypeError):   # a read-only or full cache costs the next process a compile, nothing else
            pass
        return result

    setattr(cached, _MARK, True)
    cached.__wrapped__ = compile_fn  # type: ignore[attr-defined]
    lib.compile_ttir_inplace = cached
    return True
