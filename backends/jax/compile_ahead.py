"""Compilations off the critical path: a background compiler and the persistent compilation cache.

`AheadCompiler` runs `jax.jit(...).lower(...).compile()` calls on one background thread (XLA
releases the GIL while it compiles and autotunes, so the training loop keeps dispatching steps);
`SplitStep` queues the variants the controller is likely to ask for next (`Controller.likely_next`:
the next batch bucket down and up, the noise measurement's half batch, and with `foresee_policies` the
precision policy the next decision would take) and takes the finished executable when the controller switches, with no trace
or compilation on the critical path. A variant needed while it is still queued is compiled at once
on the caller's thread instead (cancelled in the queue); one already compiling is waited for.

`enable_compilation_cache` turns on JAX's persistent compilation cache (a rerun loads its
executables from disk instead of compiling them) under ``<cache>/jax``, ``<cache>`` being
``$TRIACCEL_CACHE`` or ``~/.cache/triaccel`` (`triaccel.data.cifar.default_cache_dir`), unless the
user has set a cache folder of their own.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Hashable, Iterator

import jax

from .compile_log import BACKGROUND_THREAD_PREFIX, note_wait

__all__ = ["AheadCompiler", "abstract", "default_compile_cache_dir", "enable_compilation_cache"]


def abstract(x: Any, batch: int | None = None, new_batch: int | None = None) -> Any:
    """`jax.ShapeDtypeStruct` of an array (its sharding kept where it is committed, so that the
    executable accepts the same placement); anything else unchanged. With `batch` and `new_batch`,
    an array whose leading axis is `batch` gets `new_batch` there instead."""
    if not isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
        return x
    shape = tuple(x.shape)
    if batch is not None and new_batch is not None and shape and shape[0] == batch:
        shape = (new_batch, *shape[1:])
    sharding = x.sharding if getattr(x, "committed", isinstance(x, jax.ShapeDtypeStruct)) else None
    weak = x.aval.weak_type if isinstance(x, jax.Array) else x.weak_type
    return jax.ShapeDtypeStruct(shape, x.dtype, sharding=sharding, weak_type=weak)


class AheadCompiler:
    """One background thread running queued compilations, each under a hashable key.

    `submit(key, fn)` queues ``fn()`` (returning an executable) unless the key is queued or done;
    `take(key)` returns its result (waiting while it compiles; None when it was never queued or was
    still waiting in the queue, which is then cancelled so that the caller compiles it itself).
    A compilation that failed in the background is forgotten (None): the caller's own compilation
    then raises the error where it belongs. ``compiled_ahead`` counts those taken from the thread.
    Inside `hold()` no queued job starts (one already running goes on), and a job queued with
    ``gated=False`` runs until it calls `wait_open()` (e.g. between its lowering, Python work that
    overlaps an XLA compilation well, and its own XLA compilation): a caller compiling on its own
    thread has XLA's compiler and the GPU's autotuning to itself.
    """

    def __init__(self, nice: int = 10) -> None:
        """nice: the background thread's scheduling niceness increment (Linux: per thread, inherited
        by the threads XLA's compiler starts from it), so that the training loop's thread keeps
        the CPU when compilation saturates the cores; 0 leaves it as is."""
        if isinstance(nice, bool) or not isinstance(nice, int) or not 0 <= nice <= 19:
            raise ValueError(f"nice={nice!r}: allowed an integer in [0, 19]")
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix=BACKGROUND_THREAD_PREFIX,
                                           initializer=_lower_priority, initargs=(nice,))
        self._jobs: dict[Hashable, cf.Future[Any]] = {}
        self._names: dict[Hashable, str] = {}
        self._stored: set[Hashable] = set()   # jobs whose results their callers keep themselves (no `take`)
        self._started: set[Hashable] = set()   # jobs past their gate (tracing, lowering, compiling)
        self._lock = threading.Lock()
        self._open = threading.Event()
        self._open.set()
        self._holds = 0
        self._compiling = 0   # jobs past the gate (their XLA compilation, with its autotuning, may run)
        self._idle = threading.Condition(self._lock)
        self.compiled_ahead = 0

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Queued compilations wait until the block (and any enclosing one) ends."""
        with self._lock:
            self._holds += 1
            self._open.clear()
        try:
            yield
        finally:
            with self._lock:
                self._holds -= 1
                if self._holds == 0:
                    self._open.set()

    def wait_open(self) -> None:
        """Block while a `hold()` is in force (for a job's own use; never call it inside a hold)."""
        while True:
            self._open.wait()
            with self._lock:   # checked under the lock that `hold` takes: no hold slips in between
                if self._holds == 0:
                    self._compiling += 1
                    return

    def _job(self, key: Hashable, fn: Callable[[], Any], gated: bool) -> Any:
        with self._lock:
            before = self._compiling
        try:
            if gated:
                self.wait_open()
            with self._lock:
                self._started.add(key)
            return fn()
        finally:
            with self._lock:   # the job passed the gate (wait_open) at most once
                self._compiling = before
                self._idle.notify_all()

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """Inside the block no background XLA compilation runs: queued jobs wait (as in `hold()`) and
        one already compiling is waited for first. Its autotuning takes device memory from the
        pool the training step allocates from (e.g. before replaying a step that ran out of memory)."""
        with self.hold():
            with self._lock:
                self._idle.wait_for(lambda: self._compiling == 0)
            yield

    def submit(self, key: Hashable, fn: Callable[[], Any], name: str = "", gated: bool = True,
               stores: bool = False) -> None:
        """Queue ``fn()`` under `key` (name: how the compile log calls a wait on it). gated: the job
        starts only outside a `hold()`; False: it starts when the thread is free and calls
        `wait_open()` itself where a hold must stop it. stores: ``fn`` keeps its result where its
        users find it (e.g. `packing.StatePacking.compile_take_put`), so no `take` will collect it and
        `never_taken` does not list it."""
        with self._lock:
            if key not in self._jobs:
                self._jobs[key] = self._pool.submit(self._job, key, fn, gated)
                self._names[key] = name
                if stores:
                    self._stored.add(key)

    def pending(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._jobs

    def take(self, key: Hashable) -> Any:
        with self._lock:
            job = self._jobs.pop(key, None)
            name = self._names.pop(key, "")
            self._started.discard(key)
        if job is None or job.cancel():
            return None
        t0 = time.perf_counter()
        running = not job.done()
        try:
            out = job.result()
        except Exception:  # the caller compiles again in the foreground and sees the error there
            return None
        finally:
            if running:  # the caller waited on the critical path: the compile log shows it
                note_wait(name, time.perf_counter() - t0)
        self.compiled_ahead += 1
        return out

    def never_taken(self) -> list[str]:
        """The names of the compilations that ran in the background and were never taken, one still
        running marked " (unfinished)": work the training loop's thread shared the CPU with for
        nothing so far (e.g. a precision policy that `Controller.likely_next` foresaw and the run
        never decided; on JAX EfficientNet-B0 one such step variant compiled for 21.6 s across epochs
        2-10, H100, 2026-12-07, docs/results.md). Jobs still waiting in the queue are not listed, nor
        those submitted with ``stores=True``."""
        with self._lock:
            return [self._names[k] + ("" if job.done() else " (unfinished)") for k, job in self._jobs.items()
                    if k not in self._stored and ((k in self._started and not job.done())
                                                  or (job.done() and not job.cancelled() and job.exception() is None))]

    def wait(self) -> None:
        """Block until every queued compilation has finished (tests, benchmarks)."""
        with self._lock:
            jobs = list(self._jobs.values())
        cf.wait(jobs)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _lower_priority(nice: int) -> None:
    """Raise the calling thread's niceness by `nice` where the OS schedules threads by it (Linux)."""
    if nice and hasattr(os, "setpriority") and hasattr(threading, "get_native_id"):
        try:
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)
        except OSError:  # not permitted here: the thread keeps the process's priority
            pass


def default_compile_cache_dir() -> Path:
    """``<cache>/jax``: ``$TRIACCEL_CACHE`` or ``~/.cache/triaccel`` (the datasets' cache root)."""
    from triaccel.data.cifar import default_cache_dir

    return default_cache_dir() / "jax"


_enabled_by_us: list[str] = []


def enable_compilation_cache(path: str | os.PathLike[str] | bool | None = True) -> str | None:
    """Turn JAX's persistent compilation cache on (or off); returns the folder in use (None: off).

    path: True (default) -> `default_compile_cache_dir()`, unless the user already set
    ``jax_compilation_cache_dir`` (theirs is kept); a folder -> that folder (created); False or
    None -> off (``jax_enable_compilation_cache`` False). Every compilation that takes at least
    ``jax_persistent_cache_min_compile_time_secs`` (JAX's default 1 s) is written there.
    """
    from jax.experimental.compilation_cache import compilation_cache as cc

    if path is False or path is None:
        if jax.config.jax_enable_compilation_cache:
            jax.config.update("jax_enable_compilation_cache", False)
            cc.reset_cache()  # JAX decides once per process whether its cache is used: decide again
        return None
    if isinstance(path, bool):
        current = jax.config.jax_compilation_cache_dir
        if current and current not in _enabled_by_us:
            jax.config.update("jax_enable_compilation_cache", True)
            return str(current)
        folder = default_compile_cache_dir()
    else:
        folder = Path(path).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    target = str(folder)
    changed = jax.config.jax_compilation_cache_dir != target or not jax.config.jax_enable_compilation_cache
    if changed:
        jax.config.update("jax_enable_compilation_cache", True)
        cc.set_cache_dir(target)
        cc.reset_cache()  # JAX opens its cache once per process: the new folder takes effect now
        _enabled_by_us.append(target)
    return target
