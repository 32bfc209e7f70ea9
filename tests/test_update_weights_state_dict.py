"""``update_weights`` takes a trainer's ``state_dict()`` as it is (tied alias, other dtype)."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch

from tgengine import InvalidRequestError, open_engine

from engine_helpers import TIMEOUT, _hf_model, collect, greedy, tiny_config, tokens_of

pytestmark = pytest.mark.anyio
PROMPT = [5, 17, 29, 3, 44, 8]


async def test_a_tied_models_state_dict_in_bfloat16_applies(tiny_qwen2_dir: Path) -> None:
    state = _hf_model(str(tiny_qwen2_dir)).state_dict()
    assert "lm_head.weight" in state  # the alias of the tied embedding
    halved = {name: (t * 0.5).to(torch.bfloat16) for name, t in state.items()}
    with anyio.fail_after(TIMEOUT):
        async with open_engine(tiny_config(tiny_qwen2_dir)) as engine:
            want = tokens_of(await collect(engine, PROMPT, greedy(8)))
            await engine.update_weights(state.items())
            same = tokens_of(await collect(engine, PROMPT, greedy(8)))
            await engine.update_weights(halved.items())
            changed = tokens_of(await collect(engine, PROMPT, greedy(8)))
            with pytest.raises(InvalidRequestError, match="shape"):
                bad_norm = state["model.norm.weight"][:1]
                await engine.update_weights([("model.norm.weight", bad_norm)])
            await engine.update_weights(state.items())
            back = tokens_of(await collect(engine, PROMPT, greedy(8)))
            version = engine.weight_version
    assert same == want == back and changed != want
    assert version == 3
