"""Joining or starting Ray, and placing the ranks: blocking calls, run in a worker thread.

Ray is an optional dependency (``pip install tgengine[ray]``): it is imported here, when a
``ray`` executor starts, and nowhere else in the engine.
"""

from __future__ import annotations

import os
import sys
from typing import Any

# A local Ray started by the engine keeps every address on 127.0.0.1. Ray reads this when
# it is imported, so it is set before the first import (tests and CI set it themselves).
LOCAL_RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
PLACEMENT_TIMEOUT = 60.0  # seconds for the cluster to find room for every rank


def import_ray(local: bool) -> Any:
    """``ray``, imported (for a local Ray: with the loopback settings, if not imported yet)."""
    if local and "ray" not in sys.modules:
        for key, value in LOCAL_RAY_ENV.items():
            os.environ.setdefault(key, value)
    try:
        import ray
    except ImportError as exc:
        raise ImportError("executor='ray' needs Ray: pip install 'tgengine[ray]'") from exc
    return ray


def connect(address: str | None, num_ranks: int) -> bool:
    """Join Ray at ``address``, or start a private local Ray when None; True if this call
    did either (then the executor ends with ``ray.shutdown()``).

    Already connected (``ray.init`` called by the application): that session is used, and
    the executor leaves it running.
    """
    ray = import_ray(local=address is None)
    if ray.is_initialized():
        return False
    if address is None:  # "local": a new Ray of our own, even if one runs on this machine
        ray.init(
            address="local",
            num_cpus=max(os.cpu_count() or 1, num_ranks),
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
    else:
        ray.init(address=address, log_to_driver=False, configure_logging=False)
    return True


def place(num_ranks: int, strategy: str, use_gpus: bool) -> tuple[Any, dict[str, float]]:
    """A placement group of one bundle per rank, ready; raises if Ray has no room for it."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    bundle = {"CPU": 1.0, "GPU": 1.0} if use_gpus else {"CPU": 1.0}
    group = placement_group([dict(bundle) for _ in range(num_ranks)], strategy=strategy)
    try:
        ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        have = ray.available_resources()
        raise RuntimeError(
            f"Ray found no room for {num_ranks} ranks of {bundle} placed {strategy} within "
            f"{PLACEMENT_TIMEOUT:.0f} s (available now: {have})"
        ) from None
    except BaseException:
        remove_placement_group(group)
        raise
    return group, bundle


def wants_gpus(device: str, num_ranks: int) -> bool:
    """Whether each rank gets a GPU: device 'cuda...', or 'auto' on a cluster with enough."""
    import ray

    if device.startswith("cuda"):
        return True
    if device != "auto":
        return False
    return float(ray.cluster_resources().get("GPU", 0.0)) >= num_ranks


def kill(actors: list[Any], serving: list[Any], timeout: float) -> None:
    """Kill the rank actors and wait (up to ``timeout``) until Ray reports each one dead."""
    import ray

    for actor in actors:
        ray.kill(actor, no_restart=True)
    if serving:
        ray.wait(serving, num_returns=len(serving), timeout=timeout)


def remove_group(group: Any) -> None:
    from ray.util.placement_group import remove_placement_group

    remove_placement_group(group)


def shutdown() -> None:
    import ray

    ray.shutdown()
