"""How long OpenMP's threads spin at a barrier before they sleep, for the processes that
import tgengine before torch: ``GOMP_SPINCOUNT`` 10,000 (libgomp's default: 300,000).

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

import os
import sys

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
