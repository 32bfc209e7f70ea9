"""``load_tokenizer`` picks the tokenizer ``AutoTokenizer`` picks, without the model's config
class where the tokenizer's own config names its class (a second of imports saved)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tgengine.errors import ModelLoadError
from tgengine.tokenizer import _plain_config, load_tokenizer

from model_factory import make_tiny_model_dir

TEXT = "Hello world, <|im_start|> ünïcode 123\n\tend"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_same_tokenizer_as_auto_tokenizer(tmp_path: Path, arch: str) -> None:
    model_dir = make_tiny_model_dir(tmp_path / arch, arch)
    assert "config" in _plain_config(str(model_dir))  # the short path applies
    ours = load_tokenizer(str(model_dir))
    theirs = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    assert type(ours) is type(theirs)
    assert ours.encode(TEXT) == theirs.encode(TEXT)
    assert ours.decode(ours.encode(TEXT)) == theirs.decode(theirs.encode(TEXT))
    assert (ours.bos_token_id, ours.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id)
    assert ours.chat_template == theirs.chat_template


def _edit_tokenizer_config(model_dir: Path, **changes: object) -> None:
    path = model_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps({k: v for k, v in config.items() if v is not None}))


def test_the_usual_path_without_a_declared_class_or_with_remote_code(tmp_path: Path) -> None:
    model_dir = make_tiny_model_dir(tmp_path / "m", "llama")
    _edit_tokenizer_config(model_dir, tokenizer_class=None)
    assert _plain_config(str(model_dir)) == {}
    assert load_tokenizer(str(model_dir)).encode(TEXT)  # still loads, the usual way
    _edit_tokenizer_config(model_dir, tokenizer_class="PreTrainedTokenizerFast", auto_map={})
    assert _plain_config(str(model_dir)) == {}
    (model_dir / "tokenizer_config.json").write_text("{not json")
    assert _plain_config(str(model_dir)) == {}


def test_a_directory_without_a_tokenizer_is_a_model_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no usable tokenizer"):
        load_tokenizer(str(tmp_path))
