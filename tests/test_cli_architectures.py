"""``python -m tgengine generate`` and ``serve`` on every supported architecture.

``generate`` runs through the CLI's own ``main`` in this process (one process per
architecture would cost a Python start each); ``serve`` is the same engine behind the
HTTP server, answering a completion and a chat completion.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from server_helpers import MODEL, TIMEOUT, completion_body, running_server
from test_architectures import ARCHS
from tgengine.cli.main import main

from model_factory import make_tiny_model_dir

MAX_TOKENS = 6


@pytest.fixture(scope="module", params=list(ARCHS))
def name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def arch_dir(name: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch, overrides = ARCHS[name]
    return make_tiny_model_dir(tmp_path_factory.mktemp(f"cli-{name}"), arch=arch, **overrides)


def test_generate_runs(name: str, arch_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Each architecture on one backend, the two backends taking turns: both are covered.
    backend = ["asyncio", "trio"][list(ARCHS).index(name) % 2]
    argv = ["generate", "Hello there", "--model", str(arch_dir), "--dtype", "float32"]
    argv += ["--chat", "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--backend", backend]
    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 0, err
    assert f"[{MAX_TOKENS} tokens in " in err and "finish_reason=length" in err


@pytest.mark.anyio
async def test_serve_answers(arch_dir: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with running_server(arch_dir) as running, running.client() as client:
            body = completion_body([5, 6, 7, 8], max_tokens=MAX_TOKENS, ignore_eos=True)
            response = await client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            completion = response.json()
            chat = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "Hello there"}],
                "max_tokens": MAX_TOKENS,
                "ignore_eos": True,
            }
            response = await client.post("/v1/chat/completions", json=chat)
            assert response.status_code == 200, response.text
            answer = response.json()
    for reply in (completion, answer):
        assert reply["usage"]["completion_tokens"] == MAX_TOKENS
        assert reply["choices"][0]["finish_reason"] == "length"
