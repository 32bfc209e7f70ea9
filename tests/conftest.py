from __future__ import annotations

import os
from pathlib import Path

import pytest

# Ray (the ray executor's tests) keeps every address on 127.0.0.1 and sends no usage
# statistics; Ray reads these when it is first imported (DESIGN.md §6).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

# The processes tests start (engine processes, mp workers, Ray workers) unpickle fault plans
# and helpers defined here, by module name: they get this directory on their path too, as
# pytest gives it to this process.
_TESTS = str(Path(__file__).resolve().parent)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_TESTS, os.environ.get("PYTHONPATH")) if p)


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Every async test runs on both backends."""
    return str(request.param)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from model_factory import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"), arch="llama")


@pytest.fixture(scope="session")
def other_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama's shapes with other weights (seed 7): what a weight update pushes."""
    from model_factory import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("other"), arch="llama", seed=7)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from model_factory import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-qwen2"), arch="qwen2")


@pytest.fixture(scope="session")
def long_context_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama whose context is long enough that one request outlives any test."""
    from model_factory import make_tiny_model_dir

    path = tmp_path_factory.mktemp("long-context")
    return make_tiny_model_dir(path, arch="llama", max_position_embeddings=1_000_000)
