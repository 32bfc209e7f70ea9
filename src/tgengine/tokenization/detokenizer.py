"""``IncrementalDetokenizer``: turns a stream of token ids into a stream of text.

The text of a token depends on its neighbours (a byte-level token may hold half of a
UTF-8 character; SentencePiece drops the leading space of the first token it decodes), so
each step decodes a small window of ids, as vLLM's ``detokenize_incrementally`` does:
the first ids of the window (up to ``read_offset``) are already emitted and only give
context, and the new text is what the ids after them add to the window's decoding. The
window only grows while its text ends with U+FFFD (an unfinished character), so each step
costs O(new tokens).

Stop strings are matched on the decoded text: text that could be the beginning of a stop
string is held back until the next tokens tell. The first stop string to complete wins.
"""

from __future__ import annotations

from typing import Any

_REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as context, so the first output token's text (its leading space
# in particular) comes out as it would in the middle of the whole text.
_NUM_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Detokenizes one request's output tokens, one step at a time, and finds its stop strings.

    ``add`` returns the new text that is safe to emit; ``flush`` returns what is still held
    back, once the request ends for another reason than a stop string. ``stopped`` says a
    stop string matched: the text before it has been emitted, the stop string and what
    follows never are, and later calls return ``""``. ``tokenizer`` is a Hugging Face
    tokenizer (anything with ``decode(ids, skip_special_tokens=...)``).
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        *,
        stop: tuple[str, ...] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = tuple(s for s in stop if s)
        # The decode window: ids[:read_offset] were read (context), the rest are not yet.
        self._ids = list(prompt_token_ids[-_NUM_CONTEXT_TOKENS:])
        self._read_offset = len(self._ids)
        self._prefix_text: str | None = None
        self._pending = ""  # decoded, not emitted: it may start a stop string
        self._chunks: list[str] = []
        self.stopped = False

    @property
    def text(self) -> str:
        """All the text emitted so far."""
        return "".join(self._chunks)

    def add(self, token_ids: list[int]) -> str:
        """Append new output tokens; return the new text that is safe to emit now."""
        if self.stopped:
            return ""
        new_text = []
        for token_id in token_ids:
            self._ids.append(token_id)
            new_text.append(self._decode_new(final=False))
        return self._emit("".join(new_text), final=False)

    def flush(self) -> str:
        """Return the text held back (an unfinished character, a possible stop string).

        Call it once, when the request finishes for another reason than a stop string.
        """
        if self.stopped:
            return ""
        return self._emit(self._decode_new(final=True), final=True)

    def _decode_new(self, *, final: bool) -> str:
        """Text that ``ids[read_offset:]`` adds; ``""`` while it ends in an unfinished char."""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[: self._read_offset])
        text = self._decode(self._ids)
        if len(text) <= len(self._prefix_text) or (text.endswith(_REPLACEMENT_CHAR) and not final):
            return ""
        new_text = text[len(self._prefix_text) :]
        # Slide the window: what was read becomes the context of the next step.
        del self._ids[: self._read_offset]
        self._read_offset = len(self._ids)
        self._prefix_text = None
        return new_text

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        # Cleaning up spaces looks at neighbouring tokens, so it would differ from window
        # to window; the streamed text is the plain decoding.
        text: str = self._tokenizer.decode(
            ids,
            skip_special_tokens=self._skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )
        return text

    def _emit(self, new_text: str, *, final: bool) -> str:
        """Release what no stop string can claim any more; stop at the earliest match."""
        text = self._pending + new_text
        self._pending = ""
        if self._stop:
            end = _first_stop_end(text, self._stop)
            if end is not None:
                self.stopped = True
                text = text[:end]
            elif not final:
                num_held = _longest_stop_prefix_suffix(text, self._stop)
                text, self._pending = text[: len(text) - num_held], text[len(text) - num_held :]
        if text:
            self._chunks.append(text)
        return text


def _first_stop_end(text: str, stop: tuple[str, ...]) -> int | None:
    """Where to cut ``text`` for the stop string that completes first in it, if any.

    The first to complete wins (ties: the one that starts first), as if the text came one
    character at a time, so the cut does not depend on how the text is split into tokens.
    """
    matches = [(i + len(s), i) for i, s in ((text.find(s), s) for s in stop) if i >= 0]
    return min(matches)[1] if matches else None


def _longest_stop_prefix_suffix(text: str, stop: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    longest = 0
    for s in stop:
        for length in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:length]):
                longest = length
                break
    return longest
