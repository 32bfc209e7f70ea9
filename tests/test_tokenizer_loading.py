"""``load_tokenizer``: ``FastTokenizer`` where transformers runs ``tokenizer.json`` as it is
(found on a first load, kept on disk), with transformers' ids, text and chat prompts;
``AutoTokenizer`` everywhere else."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from tgengine import EngineConfig
from tgengine.errors import ModelLoadError
from tgengine.tokenization import tokenizer_facts
from tgengine.tokenization.fast_tokenizer import FastTokenizer
from tgengine.tokenization.hf_tokenizer import _plain_config, load_hf_tokenizer
from tgengine.tokenization.tokenizer import chat_prompt, load_tokenizer

from model_factory import IM_END, IM_START, make_tiny_model_dir

TEXTS = [
    "Hello world, <|im_start|> ünïcode 123\n\tend",
    "  leading spaces, trailing spaces  ",
    "<|endoftext|><|im_end|>emoji 🤖 and 日本語",
    "",
]
# A template that uses what transformers adds to the Jinja environment and the context:
# tojson (non-ASCII kept, indent), namespace, loopcontrols, the special tokens, tools,
# raise_exception, trimmed blocks, and messages whose None fields are dropped and reasoning
# aliased.
RICH_TEMPLATE = (
    "{% set ns = namespace(n=0) %}\n"  # trim_blocks drops this newline
    "    {% if true %}\n    {% endif %}\n"  # lstrip_blocks drops these spaces
    "{% if tools %}{{ bos_token }}TOOLS {{ tools | tojson(indent=2) }}\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'skip' %}{% continue %}{% endif %}"
    "{% if message['role'] == 'bad' %}{{ raise_exception('bad role') }}{% endif %}"
    "{% set ns.n = ns.n + 1 %}"
    "<|im_start|>{{ message['role'] }} {{ ns.n }} {{ message.keys() | list | sort | join(',') }}\n"
    "{% if message.thinking is defined %}[{{ message.thinking }}]{% endif %}"
    "{{ message['content'] | tojson }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief. ünï"},
    {"role": "skip", "content": "never shown"},
    {"role": "user", "content": "Hi 🤖", "name": None},
    {"role": "assistant", "content": "Hello!", "reasoning_content": "greet back"},
    {"role": "user", "content": "2+2?"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Adds. Ünïcode.",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
        },
    }
]


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TGENGINE_CACHE", str(tmp_path / "cache"))


def _load_twice(model_dir: Path) -> Any:
    """The second load's tokenizer; the first always takes transformers and takes the facts."""
    first = load_tokenizer(str(model_dir))
    assert not isinstance(first, FastTokenizer)
    assert tokenizer_facts.lookup(model_dir) is not None
    return load_tokenizer(str(model_dir))


def _edit_tokenizer_config(model_dir: Path, **changes: object) -> None:
    path = model_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps({k: v for k, v in config.items() if v is not None}))


def _hf(model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


@pytest.fixture
def llama_dir(tmp_path: Path) -> Path:
    return make_tiny_model_dir(tmp_path / "llama", "llama")


def _assert_same(ours: Any, theirs: Any) -> None:
    assert isinstance(ours, FastTokenizer)
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == theirs.encode(text, add_special_tokens=special)
            assert ours.decode(ids, skip_special_tokens=special) == theirs.decode(
                ids, skip_special_tokens=special
            )
            assert ours.decode(ids, clean_up_tokenization_spaces=False) == theirs.decode(
                ids, clean_up_tokenization_spaces=False
            )
        assert ours.convert_ids_to_tokens(ours.encode(text)) == theirs.convert_ids_to_tokens(
            theirs.encode(text)
        )
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "model_max_length"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.special_tokens_map == {
        k: v for k, v in theirs.special_tokens_map.items() if isinstance(v, str)
    }
    assert len(ours) == len(theirs) and ours.vocab_size == theirs.vocab_size
    assert ours.get_vocab() == theirs.get_vocab()
    assert ours(TEXTS[0])["input_ids"] == theirs(TEXTS[0])["input_ids"]  # transformers' own
    assert ours.chat_template == theirs.chat_template


def test_the_fast_path_matches_auto_tokenizer(llama_dir: Path) -> None:
    _assert_same(_load_twice(llama_dir), _hf(llama_dir))


def test_a_class_that_rebuilds_the_pipeline_keeps_auto_tokenizer(tmp_path: Path) -> None:
    """transformers 5 builds Qwen2's pipeline from the vocabulary for the model type (the
    file's own class notwithstanding): the ids differ from the file's, so no fast path."""
    model_dir = make_tiny_model_dir(tmp_path / "qwen2", "qwen2")
    second = _load_twice(model_dir)
    theirs = _hf(model_dir)
    facts = tokenizer_facts.lookup(model_dir)
    assert facts is not None
    if facts.plain:  # another transformers version may take the file as it is
        _assert_same(second, theirs)
    else:
        assert "pipeline" in facts.reason and type(second) is type(theirs)


def test_chat_prompts_match_transformers(llama_dir: Path) -> None:
    """Both the template of the test models and one that uses what transformers provides."""
    for template in (None, RICH_TEMPLATE):
        if template is not None:
            (llama_dir / "chat_template.jinja").write_text(template)
        ours, theirs = _load_twice(llama_dir), _hf(llama_dir)
        assert isinstance(ours, FastTokenizer)
        messages = MESSAGES if template else [m for m in MESSAGES if m["role"] != "skip"]
        for tools in (None, TOOLS):
            for generation in (True, False):
                kwargs: dict[str, Any] = dict(tools=tools, add_generation_prompt=generation)
                text = ours.apply_chat_template(messages, tokenize=False, **kwargs)
                assert text == theirs.apply_chat_template(messages, tokenize=False, **kwargs)
                encoded = theirs.apply_chat_template(messages, **kwargs)
                assert ours.apply_chat_template(messages, **kwargs) == dict(encoded)
                assert chat_prompt(ours, messages, tools, generation) == encoded["input_ids"]
    if template is not None:
        assert "ünï" in text and "greet back" in text and "never shown" not in text
        bad = [*MESSAGES, {"role": "bad", "content": "x"}]
        for tokenizer in (ours, theirs):
            with pytest.raises(Exception, match="bad role"):
                tokenizer.apply_chat_template(bad, tokenize=False)


def test_the_template_file_wins_and_what_it_cannot_render_goes_to_transformers(
    tmp_path: Path,
) -> None:
    model_dir = make_tiny_model_dir(tmp_path / "m", "llama")
    (model_dir / "chat_template.jinja").write_text(RICH_TEMPLATE)
    ours, theirs = _load_twice(model_dir), _hf(model_dir)
    assert ours.chat_template == theirs.chat_template == RICH_TEMPLATE
    # Arguments the fast path does not take: transformers renders (same result).
    final = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    kwargs: dict[str, Any] = dict(continue_final_message=True, tokenize=False)
    assert ours.apply_chat_template(final, **kwargs) == theirs.apply_chat_template(final, **kwargs)
    assert ours._hf is not None  # it did go to transformers
    # And attributes it does not have.
    assert ours.batch_decode([[5, 6], [7]]) == theirs.batch_decode([[5, 6], [7]])


def _refused(model_dir: Path) -> str:
    second = _load_twice(model_dir)
    assert not isinstance(second, FastTokenizer)
    assert second.encode(TEXTS[0]) == _hf(model_dir).encode(TEXTS[0])
    facts = tokenizer_facts.lookup(model_dir)
    assert facts is not None and not facts.plain
    return facts.reason


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"tokenizer_class": "GPT2Tokenizer"}, "pipeline"),  # rebuilt from the vocabulary
        ({"extra_special_tokens": [IM_START, IM_END, "<|not_in_the_file|>"]}, "pipeline"),
        ({"split_special_tokens": True}, "split_special_tokens"),
        (
            {
                "clean_up_tokenization_spaces": True,
                "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output": True,
            },
            "cleans up spaces",
        ),
    ],
)
def test_what_transformers_changes_keeps_auto_tokenizer(
    tmp_path: Path, change: dict[str, Any], reason: str
) -> None:
    model_dir = make_tiny_model_dir(tmp_path / "m", "llama")
    _edit_tokenizer_config(model_dir, **change)
    assert reason in _refused(model_dir)


def test_templates_only_transformers_renders_keep_auto_tokenizer(tmp_path: Path) -> None:
    model_dir = make_tiny_model_dir(tmp_path / "m", "llama")
    (model_dir / "chat_template.jinja").write_text("{% generation %}{{ 1 }}{% endgeneration %}")
    assert "assistant tokens" in _refused(model_dir)
    (model_dir / "chat_template.jinja").unlink()
    several = [{"name": "default", "template": "x"}, {"name": "b", "template": "y"}]
    _edit_tokenizer_config(model_dir, chat_template=several)
    assert "several chat templates" in _refused(model_dir)


def test_spaces_cleaned_up_only_where_transformers_does(tmp_path: Path) -> None:
    """transformers 5 ignores ``clean_up_tokenization_spaces`` for BPE: still the file."""
    model_dir = make_tiny_model_dir(tmp_path / "m", "llama")
    _edit_tokenizer_config(model_dir, clean_up_tokenization_spaces=True)
    second, theirs = _load_twice(model_dir), _hf(model_dir)
    ids = theirs.encode("Hello , world ! it 's")
    assert second.decode(ids) == theirs.decode(ids)
    if isinstance(second, FastTokenizer):
        _assert_same(second, theirs)


def test_a_tokenizer_that_cannot_be_compared_keeps_auto_tokenizer(llama_dir: Path) -> None:
    """Anything unlike what the comparison expects is a refusal with its reason, not a
    failed start."""

    class Odd:
        special_tokens_map = property(lambda self: 1 / 0)

    facts = tokenizer_facts.facts_of(Odd(), llama_dir)
    assert not facts.plain and "not a tokenizers-backed class" in facts.reason
    hf = _hf(llama_dir)
    broken = type("Broken", (type(hf),), {"special_tokens_map": property(lambda self: 1 / 0)})
    hf.__class__ = broken
    facts = tokenizer_facts.facts_of(hf, llama_dir)
    assert not facts.plain and "ZeroDivisionError" in facts.reason


def test_a_directory_with_several_templates_keeps_auto_tokenizer(tmp_path: Path) -> None:
    model_dir = make_tiny_model_dir(tmp_path / "m", "llama")
    (model_dir / "additional_chat_templates").mkdir()
    (model_dir / "additional_chat_templates" / "rag.jinja").write_text("{{ messages }}")
    assert "chat templates" in _refused(model_dir)


def test_facts_follow_the_files(llama_dir: Path) -> None:
    assert isinstance(_load_twice(llama_dir), FastTokenizer)
    original = (llama_dir / "tokenizer_config.json").read_bytes()
    _edit_tokenizer_config(llama_dir, split_special_tokens=True)  # new files: new facts
    assert not isinstance(_load_twice(llama_dir), FastTokenizer)
    # The same files again: the first facts. A template directory added since then sends
    # the load to transformers.
    (llama_dir / "tokenizer_config.json").write_bytes(original)
    assert isinstance(load_tokenizer(str(llama_dir)), FastTokenizer)
    (llama_dir / "additional_chat_templates").mkdir()
    assert not isinstance(load_tokenizer(str(llama_dir)), FastTokenizer)


def test_tokenizer_mode_hf_is_always_auto_tokenizer(llama_dir: Path) -> None:
    assert isinstance(_load_twice(llama_dir), FastTokenizer)
    assert not isinstance(load_tokenizer(str(llama_dir), "hf"), FastTokenizer)
    with pytest.raises(ValueError, match="tokenizer_mode"):
        EngineConfig(model="m", tokenizer_mode="slow")  # type: ignore[arg-type]


def test_auto_tokenizer_without_the_model_config_class(tmp_path: Path) -> None:
    """``load_hf_tokenizer`` skips the model's config class where the tokenizer names its own."""
    model_dir = make_tiny_model_dir(tmp_path / "m", "llama")
    assert "config" in _plain_config(str(model_dir))
    assert type(load_hf_tokenizer(str(model_dir))) is type(_hf(model_dir))
    _edit_tokenizer_config(model_dir, tokenizer_class=None)
    assert _plain_config(str(model_dir)) == {}
    assert load_tokenizer(str(model_dir)).encode(TEXTS[0])  # still loads, the usual way
    _edit_tokenizer_config(model_dir, tokenizer_class="PreTrainedTokenizerFast", auto_map={})
    assert _plain_config(str(model_dir)) == {}
    (model_dir / "tokenizer_config.json").write_text("{not json")
    assert _plain_config(str(model_dir)) == {}


def test_a_directory_without_a_tokenizer_is_a_model_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no usable tokenizer"):
        load_tokenizer(str(tmp_path))
