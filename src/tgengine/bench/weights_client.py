"""A trainer in another process, for ``bench weights``: full updates pushed over HTTP.

``python -m tgengine.bench.weights_client SPEC.json`` reads the model's tensors (the
trainer's weights, held in memory before the clock starts), then times ``updates`` updates
in parts one after the other, as a trainer in a loop pushes them: open one, send each part
as a safetensors body, commit. It prints one JSON line: ``seconds`` (the fastest update),
``all_seconds``, ``peak_rss_over_bytes`` (its peak RSS over the updates, above the RSS with
the weights loaded: ``peak_rss``) and ``weight_version`` after the last commit. Each body is
streamed from the tensors' own memory (``safetensors_pieces``), as a trainer would send
them; with ``"shared": true`` in the spec each part is written to one file in /dev/shm
instead (written over by the next) and its path posted to ``parts/shared``; with ``"hold":
true`` as well, each part to a file of its own, which the engine maps and holds until the
commit (the next update writes over the same files).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

PIECE_BYTES = 4 * 1024 * 1024


async def _bytes(pieces: Iterator[memoryview]) -> AsyncIterator[bytes]:
    for piece in pieces:
        yield piece  # type: ignore[misc]  # httpx sends any bytes-like piece


def _load(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The trainer's weights in parts of about ``part_bytes`` (a tensor never split)."""
    import torch

    from ..models import iter_safetensors

    dtype = getattr(torch, spec["dtype"])
    names = set(spec["names"])
    parts: list[dict[str, Any]] = [{}]
    size = 0
    for name, tensor in iter_safetensors(spec["model_dir"]):
        if name not in names:
            continue
        tensor = tensor.to(dtype)
        if parts[-1] and size + tensor.nbytes > spec["part_bytes"]:
            parts.append({})
            size = 0
        parts[-1][name] = tensor
        size += tensor.nbytes
    return parts


async def push(spec: dict[str, Any]) -> dict[str, Any]:
    import anyio
    import httpx

    from ..ipc.weights_file import new_weights_dir, remove_weights_dir
    from .peak_rss import PeakRSS

    parts = await anyio.to_thread.run_sync(_load, spec)
    headers = {"Authorization": f"Bearer {spec['admin_key']}"}
    rss = PeakRSS({"client": os.getpid()})

    hold = bool(spec.get("hold"))
    seconds: list[float] = []
    async with httpx.AsyncClient(base_url=spec["url"], headers=headers, timeout=600) as http:
        shared = await anyio.to_thread.run_sync(new_weights_dir) if spec["shared"] else None
        try:
            async with rss.watching():
                for _ in range(spec.get("updates", 1)):
                    start = time.perf_counter()
                    version = await _update(http, parts, shared, hold)
                    seconds.append(time.perf_counter() - start)
        finally:
            if shared is not None:
                remove_weights_dir(shared)
    return {
        "seconds": min(seconds),
        "all_seconds": seconds,
        "peak_rss_over_bytes": rss.peaks()["client"],
        "weight_version": version,
        "num_parts": len(parts),
    }


async def _update(http: Any, parts: list[dict[str, Any]], shared: Path | None, hold: bool) -> int:
    """One update: open it, send every part, commit; the engine's version then. A part
    posted by path is written to ``shared`` first (``hold``: a file of its own, written
    over by the next update's same part, as a trainer in a loop would)."""
    import anyio

    from ..ipc.weights_file import FILE_NAME, safetensors_pieces, write_weights_file

    opened = await http.post("/weights/updates")
    opened.raise_for_status()
    update = opened.json()["id"]
    for i, part in enumerate(parts):
        if shared is not None:  # written to /dev/shm here, its path posted
            file = shared / (f"part-{i}.safetensors" if hold else FILE_NAME)
            await anyio.to_thread.run_sync(write_weights_file, part.items(), file)
            sent = await http.post(
                f"/weights/updates/{update}/parts/shared", json={"path": str(file), "hold": hold}
            )
        else:  # the body streamed from the tensors' own memory: no serialized copy
            size, pieces = safetensors_pieces(part.items(), PIECE_BYTES)
            sent = await http.post(
                f"/weights/updates/{update}/parts",
                content=_bytes(pieces),
                headers={"Content-Length": str(size)},
            )
        sent.raise_for_status()
    committed = await http.post(f"/weights/updates/{update}/commit")
    committed.raise_for_status()
    return int(committed.json()["weight_version"])


def main(argv: list[str] | None = None) -> int:
    import anyio

    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        spec = json.load(f)
    print(json.dumps(anyio.run(push, spec)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
