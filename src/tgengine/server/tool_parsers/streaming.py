"""``ToolCallStream``: split a streamed answer into content deltas and finished tool calls.

Content streams as it comes, except text that may be the start of a tool-call marker,
which waits until it is known not to be one. From the marker on, the text is the tool-call
part: each call goes out once the format says it is closed, and the rest when the answer
ends. A tool-call part that holds no call after all goes out as content.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .base import ParsedCall, ToolParser


@dataclass
class StreamedCall:
    """What one ``feed`` or ``finish`` releases."""

    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)


class ToolCallStream:
    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self._held = ""  # content not yet released: it may begin a marker
        self._calls_text: str | None = None  # the tool-call part, once a marker was seen
        self._num_sent = 0
        self._at_start = True
        self.num_calls = 0

    def feed(self, delta: str) -> StreamedCall:
        if self._calls_text is not None:
            self._calls_text += delta
            return StreamedCall(calls=self._new_calls(self.parser.complete_calls(self._calls_text)))
        self._held += delta
        start = self._marker_start()
        if start is not None:
            content, self._calls_text = self._held[:start], self._held[start:]
            self._held = ""
            out = self.feed("")
            return StreamedCall(content, out.calls)
        keep = self._undecided_tail()
        content = self._held[: len(self._held) - keep]
        self._held = self._held[len(content) :]
        if content.strip():
            self._at_start = False
        return StreamedCall(content)

    def finish(self) -> StreamedCall:
        if self._calls_text is None:
            content, self._held = self._held, ""
            return StreamedCall(content)
        parsed = self.parser.parse(self._calls_text)
        if not parsed.calls:
            return StreamedCall(self._calls_text)
        return StreamedCall(parsed.content, self._new_calls(parsed.calls))

    def _new_calls(self, calls: list[ParsedCall]) -> list[ParsedCall]:
        new = calls[self._num_sent :]
        self._num_sent = max(self._num_sent, len(calls))
        self.num_calls = self._num_sent
        return new

    def _marker_start(self) -> int | None:
        if self.parser.at_start_only:
            if not self._at_start:
                return None
            stripped = self._held.lstrip()
            hit = any(stripped.startswith(m) for m in self.parser.markers)
            return 0 if hit else None  # the leading whitespace belongs to the calls
        found = [i for i in (self._held.find(m) for m in self.parser.markers) if i >= 0]
        return min(found) if found else None

    def _undecided_tail(self) -> int:
        """How many trailing characters of the held text could still begin a marker."""
        if self.parser.at_start_only:
            if not self._at_start:
                return 0
            stripped = self._held.lstrip()
            maybe = any(m.startswith(stripped) for m in self.parser.markers)
            return len(self._held) if maybe else 0
        longest = 0
        for marker in self.parser.markers:
            for n in range(min(len(marker) - 1, len(self._held)), 0, -1):
                if self._held.endswith(marker[:n]):
                    longest = max(longest, n)
                    break
        return longest
