"""``Channel``: whole pickled messages over a byte stream (a socket to the engine process).

A frame is a 4-byte big-endian length and a pickle. Only small control messages and
chunks travel this way; weights travel as a safetensors file (see ``weights_file``).
"""

from __future__ import annotations

import pickle
import struct
from typing import Any

import anyio
from anyio.abc import ByteStream
from anyio.streams.buffered import BufferedByteReceiveStream

HEADER = struct.Struct("!I")
MAX_FRAME = 1 << 30


def encode(message: Any) -> bytes:
    """``message`` as one frame: its length, then its pickle."""
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(payload)) + payload


class Channel:
    """Sends and receives whole messages; one writer task and one reader task at most."""

    def __init__(self, stream: ByteStream) -> None:
        self._stream = stream
        self._reader = BufferedByteReceiveStream(stream)

    async def send(self, message: Any) -> None:
        await self.send_encoded(encode(message))

    async def send_encoded(self, frame: bytes) -> None:
        """Send a frame from ``encode`` (one pickle for a message sent on many channels)."""
        await self._stream.send(frame)

    async def receive(self) -> Any:
        """The next message; ``anyio.EndOfStream`` once the peer has closed or died."""
        try:
            header = await self._reader.receive_exactly(HEADER.size)
            (size,) = HEADER.unpack(header)
            if size > MAX_FRAME:
                raise anyio.BrokenResourceError(f"frame of {size} bytes: not a tgengine peer")
            return pickle.loads(await self._reader.receive_exactly(size))
        except (anyio.IncompleteRead, anyio.BrokenResourceError, ConnectionError) as exc:
            raise anyio.EndOfStream from exc

    async def aclose(self) -> None:
        await self._stream.aclose()
