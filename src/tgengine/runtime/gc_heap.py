"""Start-up's objects out of the garbage collector's way, in the processes tgengine owns.

Once an engine serves, the objects that torch, transformers and the loaded model left
behind (about 180,000 for SmolLM2) live as long as the process. Every full collection
walks them all: ``sleep()`` ends with one (``agent.host_memory.free_device_memory``, to
release tensors held by reference cycles), and it took 80-150 ms of each sleep in an
engine process. ``freeze_startup_heap`` collects once and then moves everything alive into
the permanent generation, which later collections skip (vLLM's engine process does the
same, ``freeze_gc_heap``). Objects made afterwards are collected as before.

tgengine calls it where the process is its own: the engine process of ``ProcessEngine``,
the ``mp`` executor's workers and ``python -m tgengine serve``. In an application's own
process the heap is the application's: call ``gc.freeze()`` there once the engine serves
(docs/rl.md).
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect every generation, then freeze what is alive; returns how many objects are
    frozen in all (``gc.get_freeze_count()``).

    Collecting first matters: ``gc.freeze()`` takes garbage as it finds it, and frozen
    garbage is never reclaimed.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
