"""A disk cache for jax-triton's kernel compilations, shared by the processes of one machine.

jax-triton compiles a Triton kernel (TTIR -> TTGIR -> LLVM IR -> PTX) while JAX lowers the function
that calls it, keeps the PTX in memory only, and turns Triton's own disk cache off (its import sets
``TRITON_CACHE_DIR=""``). Every process therefore compiles each kernel variant again, inside a
lowering (on the critical path when the training step waits for it), and JAX's persistent
compilation cache cannot help, since its key is computed from the lowered module. With Triton 3.6
the first kernel of a process also imports torch (Triton's argument specializer does; 5 s on the
H100 machine, whose Python compiles torch's sources anew).

`install` puts two caches, small JSON files under ``<cache>/jax-triton`` (``<cache>``:
``$TRIACCEL_CACHE`` or ``~/.cache/triaccel``), in front of jax-triton:

- whole kernels (``triton_lib.get_or_create_triton_kernel``), keyed by the kernel's source
  (``JITFunction.cache_key``), argument types, scalar arguments, meta-parameters, launch options,
  compute capability, ``TRITON_*`` environment and the Triton and jax-triton versions: a hit builds
  jax-triton's ``TritonKernel`` from the stored PTX with no specialization, no compile, no torch;
- the compile step (``triton_lib.compile_ttir_inplace``), keyed by the TTIR text and the compile
  options, for kernels the first cache does not cover (it also feeds the first one on a miss).

``TRIACCEL_JAX_TRITON_CACHE=0`` leaves jax-triton as it is, as does a jax-triton version without
those functions.

Measured on an H100 (2026-11-23, fresh processes, `python benchmarks/jax_first_lowering.py`): a
process's first kernel lowering 4.3-5.0 s with the caches off or empty (torch imported), 0.16-0.23 s
from the whole-kernel cache (torch not imported), results within 6e-7 of float64 sums; the
compile-step cache alone took a later kernel variant's lowering from 0.32-0.40 s to 0.12 s.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
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
    """Put the disk caches in front of ``jt.triton_lib.get_or_create_triton_kernel`` and
    ``compile_ttir_inplace`` (once per process).

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
            _store(path, dataclasses.asdict(result))
        except (OSError, TypeError):
            pass
        return result

    setattr(cached, _MARK, True)
    cached.__wrapped__ = compile_fn  # type: ignore[attr-defined]
    lib.compile_ttir_inplace = _recording(cached)
    _cache_kernels(lib, where, versions)
    return True


def _store(path: Path, entry: Any) -> None:
    """Write `entry` as JSON at `path`, whole or not at all (readers in other processes race the
    writer). Raises OSError/TypeError; a cache that cannot be written costs a compile, nothing else."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(entry))
    os.replace(tmp, path)


_seen = threading.local()   # the last compilation of this thread: (TTIR text, CompilationResult)


def _recording(compile_fn: Any) -> Any:
    """`compile_fn` that also remembers, per thread, what it compiled (for the whole-kernel cache)."""
    def compile_and_record(ttir: Any, backend: Any, options: Any, compute_capability: Any, platform: Any) -> Any:
        text = str(ttir)   # before the passes: they rewrite the module in place
        result = compile_fn(ttir, backend, options, compute_capability, platform)
        _seen.last = (text, result)
        return result

    setattr(compile_and_record, _MARK, True)
    compile_and_record.__wrapped__ = compile_fn  # type: ignore[attr-defined]
    return compile_and_record


def _cache_kernels(lib: Any, where: Path, versions: tuple) -> None:
    """Wrap ``lib.get_or_create_triton_kernel`` with the whole-kernel disk cache (when it and
    ``lib.triton_kernel_call_lib.TritonKernel`` are there)."""
    create = getattr(lib, "get_or_create_triton_kernel", None)
    call_lib = getattr(lib, "triton_kernel_call_lib", None)
    kernel_cls = getattr(call_lib, "TritonKernel", None)
    if create is None or kernel_cls is None or getattr(create, _MARK, False):
        return

    def cached(backend_init_func: Any, platform: Any, fn: Any, arg_dtypes: Any, scalar_args: Any, *,
               num_warps: Any, num_stages: Any, num_ctas: Any, compute_capability: Any,
               enable_fp_fusion: Any, metaparams: Any, dump: bool) -> Any:
        def original() -> Any:
            return create(backend_init_func, platform, fn, arg_dtypes, scalar_args, num_warps=num_warps,
                          num_stages=num_stages, num_ctas=num_ctas, compute_capability=compute_capability,
                          enable_fp_fusion=enable_fp_fusion, metaparams=metaparams, dump=dump)

        source = getattr(fn, "cache_key", None)
        if dump or source is None:
            return original()
        warps = 4 if num_warps is None else num_warps   # jax-triton's own defaults
        cc = compute_capability if compute_capability is not None else call_lib.get_compute_capability(0)
        env = sorted((k, v) for k, v in os.environ.items() if k.startswith("TRITON_"))
        key = hashlib.sha256(repr((versions, "kernel", source, platform, list(arg_dtypes), list(scalar_args),
                                   warps, 3 if num_stages is None else num_stages, num_ctas, cc,
                                   enable_fp_fusion, sorted(dict(metaparams).items()), env)).encode()).hexdigest()
        path = where / f"kernel-{key}.json"
        try:
            e = json.loads(path.read_text())
            kernel = kernel_cls(e["name"], e["num_warps"], e["num_ctas"], e["shared_mem_bytes"], e["binary"],
                                e["ttir"], e["cc"])
            return kernel, {tuple(k): v for k, v in e["attrs"]}
        except (OSError, ValueError, TypeError, KeyError):   # absent or unreadable: jax-triton's own path
            pass
        _seen.last = None
        kernel, attrs = original()
        last, _seen.last = getattr(_seen, "last", None), None
        if last is None:   # served from jax-triton's memory: its first compilation was stored then
            return kernel, attrs
        text, result = last
        try:
            entry = {"name": result.name, "num_warps": warps, "num_ctas": num_ctas,
                     "shared_mem_bytes": result.shared_mem_bytes, "binary": result.binary, "ttir": text, "cc": cc,
                     "attrs": [[list(k), v] for k, v in attrs.items()]}
            _store(path, entry)
        except (OSError, TypeError, AttributeError):   # not storable here: the next process compiles again
            pass
        return kernel, attrs

    setattr(cached, _MARK, True)
    cached.__wrapped__ = create  # type: ignore[attr-defined]
    lib.get_or_create_triton_kernel = cached
