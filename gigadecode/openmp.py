"""The process's OpenMP runtime (the one torch loaded): freeing a thread's pool of worker threads.

Each thread that starts an OpenMP parallel region gets its own pool of workers, and GNU libgomp counts the
workers of every pool: once there are more than the cores the process may use, every worker waiting at a
barrier spins ~1,000 times instead of ~300,000 before it sleeps, so each of the thousands of parallel regions
of a decode step pays a futex wake-up. A server loads the model on its main thread (whose pool then stays)
and steps the engine on another, which made every decode step ~1.35x slower on 2 cores (`small`, batch 8:
33.8 -> 47.7 ms). `release_thread_pool()` on the loading thread, before the engine thread starts, ends its
pool (OpenMP 5.0's `omp_pause_resource_all`, soft): the engine thread's pool is then the only one.
"""

from __future__ import annotations

import ctypes
import functools
import os

OMP_PAUSE_SOFT = 1
_RUNTIMES = ("libgomp", "libiomp5", "libomp")     # GNU (torch's Linux wheels), Intel, LLVM


@functools.cache
def _runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime mapped into this process, or None (none loaded, or no /proc)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if line.rstrip().endswith((".so", ".so.1", ".so.5"))}
    except OSError:
        return None
    for p in sorted(paths):
        if os.path.basename(p).startswith(_RUNTIMES):
            try:
                return ctypes.CDLL(p)
            except OSError:
                continue
    return None


def release_thread_pool() -> bool:
    """End the calling thread's OpenMP worker pool (a later parallel region on this thread makes a new one).
    -> whether the runtime did (False: no runtime found, or one without OpenMP 5.0's pause)."""
    lib = _runtime()
    pause = getattr(lib, "omp_pause_resource_all", None) if lib is not None else None
    if pause is None:
        return False
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause(OMP_PAUSE_SOFT) == 0
