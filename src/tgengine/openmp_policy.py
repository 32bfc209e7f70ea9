"""OpenMP's wait policy for the processes that import tgengine before torch: ``PASSIVE``.

With the default policy, a thread that reaches a barrier first spins for a while before it
sleeps. On a machine where another process competes for the cores (a trainer beside the
engine, a build, another engineer's tests, even at nice 15), a decode step of one
sequence at 2 threads, ~150 parallel regions per token, then waits a scheduler slice at
nearly every barrier: measured here, 0.7-3 tokens/s instead of 46-65. With ``PASSIVE`` the
waiting thread sleeps at once and the competitor runs in its place: 27-46 tokens/s under the
same load, and the same speed on a quiet machine (docs/engine.md, "Threads").

OpenMP reads the policy once, when torch loads its runtime, so this only works if tgengine
is imported first; an ``OMP_WAIT_POLICY`` already set is left as it is.
"""

from __future__ import annotations

import os
import sys

POLICY = "PASSIVE"
_set_here = False


def prefer_passive_wait() -> bool:
    """Set ``OMP_WAIT_POLICY`` for this process (and its children) if it still matters.

    Returns whether it was set: not when torch is already loaded or the variable is set.
    """
    global _set_here
    if "torch" in sys.modules or "OMP_WAIT_POLICY" in os.environ:
        return False
    os.environ["OMP_WAIT_POLICY"] = POLICY
    _set_here = True
    return True


def user_environ() -> dict[str, str]:
    """This process's environment without the policy tgengine set: for other programs (the
    benches' peers run with their own defaults)."""
    env = dict(os.environ)
    if _set_here and env.get("OMP_WAIT_POLICY") == POLICY:
        del env["OMP_WAIT_POLICY"]
    return env
