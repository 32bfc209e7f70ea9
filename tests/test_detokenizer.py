from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tgengine.tokenization.detokenizer import IncrementalDetokenizer

FFFD = "\ufffd"
ALPHABET = [*"abcdefghijklmnopqrstuvwxyz ABC.,!?\n0123", "é", "ü", "ñ", "ß", "€", "中", "文"]
ALPHABET += ["😀", "👍🏽", "🇫🇷", "\u0301"]
texts = st.lists(st.sampled_from(ALPHABET), max_size=30).map("".join)
PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@functools.cache
def _byte_level(path: Path) -> Any:
    """The project's tiny byte-level BPE tokenizer, loaded the way the engine loads it."""
    from transformers import AutoTokenizer

    from model_factory import make_tokenizer

    make_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path))


@functools.cache
def _metaspace() -> Any:
    """A Llama-style tokenizer: ▁ for spaces, byte fallback, first leading space stripped."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    from model_factory import CORPUS

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    special = ["<unk>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=special, show_progress=False)
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


@pytest.fixture(scope="module", params=["byte_level", "metaspace"])
def tokenizer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    if request.param == "byte_level":
        return _byte_level(tmp_path_factory.getbasetemp() / "byte-level-tokenizer")
    return _metaspace()


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return str(tokenizer.decode(ids, skip_special_tokens=True))


def _stream(detok: IncrementalDetokenizer, ids: list[int], sizes: list[int]) -> list[str]:
    """Feed ``ids`` in chunks of the given sizes (then one by one); return the text chunks."""
    chunks, i = [], 0
    for size in sizes:
        chunks.append(detok.add(ids[i : i + size]))
        i += size
    chunks += [detok.add([token]) for token in ids[i:]]
    return chunks


@PROPERTY
@given(text=texts)
def test_streamed_text_is_the_decoded_text(tokenizer: Any, text: str) -> None:
    ids = _encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, [])
    chunks = _stream(detok, ids, [])
    expected = _decode(tokenizer, ids)
    assert "".join(chunks) == expected == detok.text
    assert detok.flush() == ""
    assert not any(FFFD in chunk for chunk in chunks)


@PROPERTY
@given(prompt=texts, text=texts, sizes=st.lists(st.integers(0, 4), max_size=5))
def test_prompt_gives_context_and_is_never_emitted(
    tokenizer: Any, prompt: str, text: str, sizes: list[int]
) -> None:
    prompt_ids = [tokenizer.bos_token_id, *_encode(tokenizer, prompt)]
    ids = _encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    streamed = "".join(_stream(detok, ids, sizes)) + detok.flush()
    whole = _decode(tokenizer, prompt_ids + ids)
    assert streamed == whole[len(_decode(tokenizer, prompt_ids)) :]


@PROPERTY
@given(data=st.data())
def test_random_token_ids_stream_as_they_decode(tokenizer: Any, data: st.DataObject) -> None:
    ids = data.draw(st.lists(st.integers(0, len(tokenizer) - 1), max_size=30))
    detok = IncrementalDetokenizer(tokenizer, [])
    streamed = "".join(_stream(detok, ids, [])) + detok.flush()
    expected = _decode(tokenizer, ids)
    # Byte fallback renders a whole invalid run of bytes as U+FFFD, even its valid first
    # bytes, which a stream has already emitted; byte-level BPE has no such quirk.
    if FFFD not in expected or "<0x80>" not in tokenizer.get_vocab():
        assert streamed == expected


def test_multibyte_character_split_across_tokens_waits_for_its_last_byte() -> None:
    tokenizer = _metaspace()
    ids = _encode(tokenizer, "a😀b")
    assert len(ids) >= 5  # the emoji is four byte-fallback tokens
    detok = IncrementalDetokenizer(tokenizer, [])
    chunks = [detok.add([token]) for token in ids]
    assert "".join(chunks) == "a😀b"
    assert "😀" in chunks  # emitted whole, once its fourth byte arrived
    detok = IncrementalDetokenizer(tokenizer, [])
    detok.add(ids[:2])  # "a" and the emoji's first byte
    assert detok.text == "a"
    assert detok.flush() == FFFD  # the unfinished character, as decode renders it


def test_decode_window_stays_small() -> None:
    """Each step decodes a few tokens, not the whole output."""
    tokenizer = _metaspace()
    windows: list[int] = []

    class Counting:
        def decode(self, ids: list[int], **kwargs: Any) -> str:
            windows.append(len(ids))
            return str(tokenizer.decode(ids, **kwargs))

    ids = _encode(tokenizer, "The quick brown fox jumps over the lazy dog. " * 40)
    detok = IncrementalDetokenizer(Counting(), _encode(tokenizer, "Hello"))
    text = "".join(detok.add([token]) for token in ids)
    assert text == _decode(tokenizer, [*_encode(tokenizer, "Hello"), *ids])[len("Hello") :]
    assert len(ids) > 300
    assert max(windows) <= 6
    assert len(windows) <= 2 * len(ids) + 2


@PROPERTY
@given(text=texts, data=st.data())
def test_stop_string_and_what_follows_are_never_emitted(
    tokenizer: Any, text: str, data: st.DataObject
) -> None:
    ids = _encode(tokenizer, text)
    full = _decode(tokenizer, ids)
    assume(full)
    start = data.draw(st.integers(0, len(full) - 1))
    stop = full[start : data.draw(st.integers(start + 1, min(len(full), start + 6)))]
    other = data.draw(st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=3).map("".join))
    sizes = data.draw(st.lists(st.integers(0, 3), max_size=4))
    detok = IncrementalDetokenizer(tokenizer, [], stop=(other, stop))
    chunks = _stream(detok, ids, sizes)
    # The stop string that completes first wins, whatever the tokens.
    end = min((full.find(s) + len(s), full.find(s)) for s in (stop, other) if s in full)[1]
    assert detok.stopped
    assert "".join(chunks) == full[:end] == detok.text
    assert detok.add(ids) == "" and detok.flush() == ""
    assert detok.text == full[:end]


def test_stop_string_split_across_tokens(tokenizer: Any) -> None:
    ids = _encode(tokenizer, "Hello, world! How are you today?")
    detok = IncrementalDetokenizer(tokenizer, [], stop=("world! How",))
    chunks = []
    for token in ids:
        chunks.append(detok.add([token]))
        assert "w" not in detok.text
    assert "".join(chunks) == "Hello, " == detok.text
    assert detok.stopped
    assert detok.add(_encode(tokenizer, " more")) == ""


def test_earliest_of_several_stop_strings_wins(tokenizer: Any) -> None:
    ids = _encode(tokenizer, "The sun rises in the east and sets in the west.")
    detok = IncrementalDetokenizer(tokenizer, [], stop=("west", "in the", "east"))
    text = "".join(detok.add([token]) for token in ids)
    assert text == "The sun rises "
    assert detok.stopped


@pytest.mark.parametrize("sizes", [[], [1, 1], [2], [3], [100]])
def test_first_stop_string_to_complete_wins(tokenizer: Any, sizes: list[int]) -> None:
    ids = _encode(tokenizer, "The sun rises in the east.")
    detok = IncrementalDetokenizer(tokenizer, [], stop=("sun rises", "rise", "east"))
    assert "".join(_stream(detok, ids, sizes)) == "The sun "


def test_prefix_trap_releases_the_held_text(tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], stop=("abc",))
    first = detok.add(_encode(tokenizer, "hello ab"))
    assert first == "hello " == detok.text  # "ab" might start "abc"
    rest = detok.add(_encode(tokenizer, "d world"))
    assert first + rest == _decode(
        tokenizer, _encode(tokenizer, "hello ab") + _encode(tokenizer, "d world")
    )
    assert not detok.stopped
    assert detok.flush() == ""


def test_flush_returns_held_text(tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], stop=("STOP NOW", "!!!"))
    ids = _encode(tokenizer, "Paris is nice STOP N")
    streamed = "".join(detok.add([token]) for token in ids)
    assert streamed == "Paris is nice "
    assert detok.flush() == "STOP N"
    assert detok.text == "Paris is nice STOP N"
    assert not detok.stopped
    assert detok.flush() == ""


def test_special_tokens_are_skipped_unless_asked(tokenizer: Any) -> None:
    eos = tokenizer.eos_token_id
    ids = [*_encode(tokenizer, "Hello"), eos]
    detok = IncrementalDetokenizer(tokenizer, [])
    assert "".join(detok.add([token]) for token in ids) + detok.flush() == "Hello"
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    streamed = "".join(detok.add([token]) for token in ids) + detok.flush()
    assert streamed == "Hello" + tokenizer.eos_token
