"""The tensor-parallel process group: which rank this is, and the collectives the model needs.

``init_distributed`` joins ``torch.distributed``'s default group (gloo on CPU, NCCL on CUDA)
over a loopback TCP rendezvous and returns a ``ParallelContext``; the model and the
``ModelAgent`` only ever talk to that context. At ``world_size`` 1 every collective is a
no-op and no process group exists, so a single process runs exactly as before.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import urllib.parse
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class ParallelContext:
    """This process's place in the tensor-parallel group (rank 0 of 1: no group at all)."""

    rank: int = 0
    world_size: int = 1

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    @property
    def is_driver(self) -> bool:
        """Rank 0: the rank that samples and answers for the group."""
        return self.rank == 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place; returns ``t``."""
        if self.is_parallel:
            dist.all_reduce(t)
        return t

    def all_gather_last_dim(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's ``t`` side by side along the last axis, rank 0's first."""
        if not self.is_parallel:
            return t
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts, dim=-1)

    def agree_any(self, flags: list[bool]) -> list[bool]:
        """Element-wise OR of ``flags`` over the ranks (every rank passes as many)."""
        if not self.is_parallel or not flags:
            return list(flags)
        t = torch.tensor(flags, dtype=torch.int32, device=_collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [bool(v) for v in t.tolist()]

    def barrier(self) -> None:
        if self.is_parallel:
            dist.barrier()


def init_distributed(
    rank: int,
    world_size: int,
    init_method: str,
    device_type: str,
    timeout: float | None = None,
) -> ParallelContext:
    """Join the group of ``world_size`` ranks rendezvousing at ``init_method`` as ``rank``.

    ``init_method`` is ``"tcp://127.0.0.1:PORT"`` (see ``free_port``); ``device_type`` is
    ``"cpu"`` (gloo) or ``"cuda"`` (NCCL, and this process's device becomes ``local_cuda``).
    Both backends are kept on the loopback interface when the rendezvous is on loopback
    (ranks on several machines, on Ray, use their real interfaces). ``timeout`` (seconds)
    bounds the rendezvous and every collective; None keeps torch's default. Blocks until
    every rank has joined. At ``world_size`` 1 nothing is created.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
    if world_size == 1:
        return ParallelContext()
    loopback = _loopback_interface() if _is_loopback(init_method) else None
    if loopback is not None:  # ranks on several machines (Ray) use their real interfaces
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", loopback)
    backend = "nccl" if device_type == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_cuda(rank))
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=None if timeout is None else timedelta(seconds=timeout),
    )
    return ParallelContext(rank=rank, world_size=world_size)


def destroy_distributed() -> None:
    """Leave the group (a no-op when none was joined)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def local_cuda(rank: int) -> torch.device:
    """Rank ``rank``'s GPU among those this process sees: ``cuda:rank`` when it sees them all
    (``mp`` on one machine), ``cuda:0`` when it sees only its own (a Ray actor)."""
    return torch.device("cuda", rank % max(1, torch.cuda.device_count()))


def free_port() -> int:
    """A TCP port on 127.0.0.1 free right now (for ``init_method``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def _is_loopback(init_method: str) -> bool:
    host = urllib.parse.urlparse(init_method).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _collective_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _loopback_interface() -> str | None:
    """The loopback interface's name ("lo" on Linux, "lo0" on macOS), if there is one."""
    if not hasattr(socket, "if_nameindex"):
        return None
    names = [name for _, name in socket.if_nameindex()]
    for candidate in ("lo", "lo0"):
        if candidate in names:
            return candidate
    return None
