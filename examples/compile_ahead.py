"""Every program of a run compiled before any of them is timed, many at once.

Lowering a jitted function (tracing its Python, emitting its MLIR) holds the GIL, so `AheadOfTime`
lowers in the calling thread, one program after another; each lowered program is then compiled on a
thread pool, where XLA compiles without the GIL, so that the compilations overlap each other and the
lowering of the programs after them. `jax.jit` keeps the executable that `.lower(...).compile()`
made for the same arguments (same shapes, dtypes, shardings and static arguments), so a later call
of the jitted function runs it without compiling again. `compilations` records the compilations
that still happen (every XLA compilation of this process, or load from the persistent compilation
cache, by function name).
"""
from __future__ import annotations

import concurrent.futures
import os
import time
from typing import Callable, Hashable

import jax
from jax._src import dispatch

# Host memory one XLA compilation may take at its peak, for a program of the example's size (a
# 36-layer unrolled decode loop); on the safe side, so that the pool does not run the host out of memory.
COMPILE_BYTES = 4 * 2**30


def available_memory() -> int | None:
    """Bytes of host memory available now (Linux's MemAvailable), or None where it is not known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def default_workers(programs: int, cpus: int | None = None, memory: int | None = None) -> int:
    """Compilations to run at once: one per core, at most what the available host memory holds at
    COMPILE_BYTES each, at most one per program, at least one."""
    cpus = cpus if cpus is not None else os.cpu_count() or 1
    memory = memory if memory is not None else available_memory()
    by_memory = cpus if memory is None else memory // COMPILE_BYTES
    return max(1, min(programs, cpus, by_memory))


def _compile(lowered):
    start = time.perf_counter()
    compiled = lowered.compile()
    return compiled, time.perf_counter() - start


class AheadOfTime:
    """Programs lowered here and compiled on `workers` threads: submit(key, lower) lowers now and
    queues the compilation; result(key) waits for that program's executable; wait() for all of them.
    A key submitted again is not lowered again (programs that settings share)."""

    def __init__(self, workers: int, log: Callable[[str], None] = print):
        self.workers, self.log = workers, log
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="compile")
        self._futures: dict[Hashable, concurrent.futures.Future] = {}
        self._start = time.perf_counter()
        self.lowering_s = 0.0

    def submit(self, key: Hashable, lower: Callable[[], object]) -> None:
        if key in self._futures:
            return
        start = time.perf_counter()
        lowered = lower()
        self.lowering_s += time.perf_counter() - start
        self._futures[key] = self._pool.submit(_compile, lowered)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._futures

    def result(self, key: Hashable):
        """The compiled program (a `jax.stages.Compiled`), once compiled."""
        return self._futures[key].result()[0]

    def wait(self) -> dict:
        """Waits for every compilation; returns dict(programs=, workers=, wall_s= (from the first
        submission), lowering_s=, compile_s= (the compilations' sum), longest_s=, longest=)."""
        done = {key: future.result() for key, future in self._futures.items()}
        self._pool.shutdown()
        longest = max(done, key=lambda key: done[key][1]) if done else None
        return dict(programs=len(done), workers=self.workers, wall_s=time.perf_counter() - self._start,
                    lowering_s=self.lowering_s, compile_s=sum(s for _, s in done.values()),
                    longest_s=done[longest][1] if done else 0.0, longest=str(longest))


_compiled: list[str] = []  # the function name of every XLA compilation of this process, in order


def _record(event: str, duration: float, **kwargs) -> None:
    if event == dispatch.BACKEND_COMPILE_EVENT:
        _compiled.append(str(kwargs.get("fun_name", "")))


jax.monitoring.register_event_duration_secs_listener(_record)


class compilations:
    """`with compilations() as seen:` ... then seen.names: the function names of the XLA
    compilations inside the block (jitted programs as "_speculative", eager ops by their op name),
    from any thread."""

    def __enter__(self):
        self._first = len(_compiled)
        self.names: list[str] = []
        return self

    def __exit__(self, *exc):
        self.names = _compiled[self._first:]
        return False
