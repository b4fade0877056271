"""Where JAX compilation time goes: traces, lowerings and XLA compilations, timed per thread.

`CompileLog` listens to JAX's own monitoring events (`jax.monitoring`: each jit trace, lowering to
MLIR and backend compilation reports its duration on the thread that did it; a persistent-cache hit
reports its retrieval) and to the waits of `AheadCompiler.take` (the caller blocked on a variant
still compiling in the background). A record on the caller's thread, or a wait, is on the critical
path; one on the background compiler's thread (`AheadCompiler`, threads named ``triaccel-compile``)
is not. `window()` summarises the records since the last window (e.g. one epoch, one evaluation),
`summary()` all of them. The listener costs one Python call per compilation event, nothing per
step.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

__all__ = ["CompileLog", "CompileRecord", "BACKGROUND_THREAD_PREFIX", "describe", "note_wait", "summarise"]

BACKGROUND_THREAD_PREFIX = "triaccel-compile"

# jax.monitoring event -> record kind (jax._src.dispatch's names; stable since jax 0.4.3x)
_EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "compile",
    "/jax/compilation_cache/cache_retrieval_time_sec": "cache_read",
}
KINDS = ("trace", "lower", "compile", "cache_read", "wait")

_active: list["CompileLog"] = []
_lock = threading.Lock()
_registered = False


@dataclass(frozen=True)
class CompileRecord:
    """One event: kind (trace | lower | compile | cache_read | wait), the function's name, its
    duration in seconds, whether it ran on a background compiler thread, and its end time
    (seconds since the log started)."""

    kind: str
    name: str
    seconds: float
    background: bool
    end: float


def _listener(event: str, duration: float, **kwargs: Any) -> None:
    kind = _EVENTS.get(event)
    if kind is None or not _active:
        return
    _dispatch(kind, str(kwargs.get("fun_name", "")), float(duration))


def _dispatch(kind: str, name: str, seconds: float, background: bool | None = None) -> None:
    if background is None:
        background = threading.current_thread().name.startswith(BACKGROUND_THREAD_PREFIX)
    for log in list(_active):
        log._add(kind, name, seconds, background)


def note_wait(name: str, seconds: float) -> None:
    """Record that the caller's thread blocked `seconds` on a background compilation of `name`
    (called by `AheadCompiler.take`); a no-op while no log is active."""
    if _active:
        _dispatch("wait", name, float(seconds), background=False)


def _register() -> None:
    global _registered
    with _lock:
        if not _registered:
            import jax

            jax.monitoring.register_event_duration_secs_listener(_listener)
            _registered = True


class CompileLog:
    """Records JAX compilation events while active (`start`/`stop`, or as a context manager).

    ``records`` holds every `CompileRecord`; `window()` and `summary()` aggregate them (module
    docstring). The JAX listener is registered once per process and forwards to the active logs.
    """

    def __init__(self) -> None:
        self.records: list[CompileRecord] = []
        self._mark = 0
        self._t0 = time.perf_counter()
        self._rec_lock = threading.Lock()

    def start(self) -> "CompileLog":
        _register()
        with _lock:
            if self not in _active:
                _active.append(self)
        return self

    def stop(self) -> None:
        with _lock:
            if self in _active:
                _active.remove(self)

    def __enter__(self) -> "CompileLog":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _add(self, kind: str, name: str, seconds: float, background: bool) -> None:
        rec = CompileRecord(kind, name, seconds, background, time.perf_counter() - self._t0)
        with self._rec_lock:
            self.records.append(rec)

    def window(self) -> dict[str, Any]:
        """`summarise` of the records since the previous `window()` call (or the start)."""
        with self._rec_lock:
            recs, self._mark = self.records[self._mark:], len(self.records)
        return summarise(recs)

    def summary(self) -> dict[str, Any]:
        """`summarise` of every record so far."""
        with self._rec_lock:
            recs = list(self.records)
        return summarise(recs)


def summarise(records: list[CompileRecord], top: int = 5) -> dict[str, Any]:
    """Counts and seconds of `records`, split into the critical path (the caller's thread, waits
    included) and the background: ``{"critical": {"compiles": n, "seconds": s, "by_kind": {kind:
    seconds}, "top": [[name, seconds, compiles], ...]}, "background": {...}}``. ``compiles`` counts
    backend compilations and persistent-cache reads (one per executable); ``top`` lists the
    `top` names by seconds (all kinds summed)."""
    out: dict[str, Any] = {}
    for part, bg in (("critical", False), ("background", True)):
        recs = [r for r in records if r.background == bg]
        by_kind = {k: 0.0 for k in KINDS}
        by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        for r in recs:
            by_kind[r.kind] += r.seconds
            by_name[r.name][0] += r.seconds
            if r.kind in ("compile", "cache_read"):
                by_name[r.name][1] += 1
        ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
        out[part] = {"compiles": sum(1 for r in recs if r.kind in ("compile", "cache_read")),
                     "seconds": round(sum(by_kind.values()), 3),
                     "by_kind": {k: round(v, 3) for k, v in by_kind.items() if v},
                     "top": [[n, round(s, 3), int(c)] for n, (s, c) in ranked]}
    return out


def describe(window: dict[str, Any]) -> str:
    """One line for a `summarise` result: compilations and seconds on the critical path (waits
    included) and in the background, and the costliest names on the critical path."""
    c, b = window["critical"], window["background"]
    wait = c["by_kind"].get("wait", 0.0)
    names = ", ".join(f"{n} {s:.1f}s" for n, s, _ in c["top"][:3] if s >= 0.05)
    return (f"compiles: {c['compiles']} on the critical path {c['seconds']:.1f}s"
            f"{f' (waited {wait:.1f}s)' if wait else ''}{f' [{names}]' if names else ''}; "
            f"{b['compiles']} in the background {b['seconds']:.1f}s")
