"""OpenMP's threads: how long they spin at a barrier before they sleep, for the processes that
import tgengine before torch (``GOMP_SPINCOUNT`` 10,000; libgomp's default: 300,000), and
letting go of a thread's team (``release_openmp_threads``).

A decode step of one sequence at 2 threads meets ~150 barriers per token. On a quiet machine
a thread must not sleep at them (OpenMP's ``PASSIVE`` policy: 38 tokens/s instead of 70 on
the 2-core machine of docs/benchmarks.md, slower than one thread). But when another process
competes for the cores (a trainer beside the engine, a build, tests at nice 15), libgomp's
default spin of 300,000 rounds makes nearly every barrier wait a scheduler slice: measured
there, 0.7-3 tokens/s instead of ~50. A spin of 10,000 rounds keeps the quiet speed (70 / 84
tokens/s bf16 / int8 weights, against 70-73 / 83-98 with the default) and the competed one
(35-47 tokens/s). Figures: docs/notes/benchmarks-history.md, fifth round.

OpenMP reads the variable once, when torch loads its runtime, so this only works if tgengine
is imported first; ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` already set are left alone.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

SPIN_COUNT = "10000"
_set_here = False


def shorten_openmp_spin() -> bool:
    """Set ``GOMP_SPINCOUNT`` for this process (and its children) if it still matters.

    Returns whether it was set: not when torch is already loaded or the user chose a policy.
    """
    global _set_here
    if "torch" in sys.modules or {"GOMP_SPINCOUNT", "OMP_WAIT_POLICY"} & os.environ.keys():
        return False
    os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    _set_here = True
    return True


def user_environ() -> dict[str, str]:
    """This process's environment without the spin count tgengine set: for other programs
    (the benches' peers run with their own defaults)."""
    env = dict(os.environ)
    if _set_here and env.get("GOMP_SPINCOUNT") == SPIN_COUNT:
        del env["GOMP_SPINCOUNT"]
    return env


def release_openmp_threads() -> bool:
    """Let the OpenMP threads that this thread's parallel regions started go (libgomp's
    ``omp_pause_resource_all(omp_pause_hard)``); False where no libgomp is loaded.

    libgomp keeps a team of threads per thread that ever started a parallel region. Once it
    manages more threads than there are cores, every barrier spins only a few hundred rounds
    before it sleeps: measured on the 2-core machine of docs/benchmarks.md (avx512_bf16), a
    two-thread product of one row took 94 us from a second thread, 34 from the first, and a
    one-sequence decode step 16 ms instead of 7.4. So the engine runs all its torch work on
    one thread (``agent.compute_thread``), and a thread that ran some elsewhere (a GEMM rate
    probe) lets its team go with this. The next parallel region there starts a new team.
    """
    lib = _libgomp()
    return lib is not None and lib.omp_pause_resource_all(2) == 0  # 2: omp_pause_hard


_found: list[ctypes.CDLL] = []


def _libgomp() -> ctypes.CDLL | None:
    """The libgomp this process loaded (torch's own copy, whatever its file is called)."""
    if _found:
        return _found[0]
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    paths = {line.split()[-1] for line in maps.splitlines() if "libgomp" in line.split()[-1]}
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        if hasattr(lib, "omp_pause_resource_all"):
            lib.omp_pause_resource_all.restype = ctypes.c_int
            lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
            _found.append(lib)
            return lib
    return None
