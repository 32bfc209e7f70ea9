"""Every ``# docs-test`` Python example in docs/ and the README runs and exits 0.

Each example runs in a fresh interpreter on the tiny random model of ``tiny_llama_dir``
(``TGENGINE_DOCS_MODEL``). A ``sitecustomize`` on ``PYTHONPATH`` wraps ``anyio.run`` in
that interpreter and in every one it starts (``python -m tgengine``, an engine process, a
worker), and records the event loop library each run really ran on (``sniffio``), so
that the check "this page has an asyncio and a trio example" reads what ran, not what the
text says.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FENCE = "```python\n"
# Pages that document calls: their examples, together, must run on both backends.
BOTH_BACKENDS = (
    "engine.md",
    "lifecycle.md",
    "sampling.md",
    "structured-outputs.md",
    "quantization.md",
    "distributed.md",
    "cli.md",
    "server.md",
)
SITECUSTOMIZE = """
import os

if os.environ.get("TGENGINE_DOCS_BACKENDS"):
    import anyio

    _run = anyio.run

    def run(func, *args, **kwargs):
        async def recorded(*inner):
            import sniffio

            with open(os.environ["TGENGINE_DOCS_BACKENDS"], "a") as log:
                log.write(sniffio.current_async_library() + "\\n")
            return await func(*inner)

        return _run(recorded, *args, **kwargs)

    anyio.run = run
"""


def examples() -> list[tuple[str, str]]:
    found = []
    for page in sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")]):
        blocks = [b.split("```", 1)[0] for b in page.read_text().split(FENCE)[1:]]
        blocks = [b for b in blocks if b.startswith("# docs-test\n")]
        found += [(f"{page.name}#{i}", code) for i, code in enumerate(blocks)]
    return found


@functools.cache
def run_example(name: str, code: str, model_dir: Path, hooks: Path) -> frozenset[str]:
    """Run one example; return the backends its ``anyio.run`` calls ran on (cached)."""
    log = hooks / f"{name}.backends"
    log.unlink(missing_ok=True)
    path = os.pathsep.join([str(hooks), os.environ.get("PYTHONPATH", "")])
    env = {
        **os.environ,
        "TGENGINE_DOCS_MODEL": str(model_dir),
        "TGENGINE_DOCS_BACKENDS": str(log),
        "PYTHONPATH": path,
    }
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, f"{name}:\n{result.stderr[-3000:]}"
    assert result.stdout.strip(), f"{name} printed nothing"
    return frozenset(log.read_text().split()) if log.exists() else frozenset()


@pytest.fixture(scope="session")
def hooks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("docs-hooks")
    (path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return path


def test_examples_are_found() -> None:
    pages = {name.split("#")[0] for name, _ in examples()}
    assert set(BOTH_BACKENDS) <= pages, set(BOTH_BACKENDS) - pages


def test_notes_readme_lists_every_note() -> None:
    notes = ROOT / "docs" / "notes"
    listed = (notes / "README.md").read_text()
    files = sorted(p.name for p in notes.glob("*.md") if p.name != "README.md")
    assert files and all(f"]({name})" in listed for name in files), files


@pytest.mark.parametrize(("name", "code"), examples(), ids=[n for n, _ in examples()])
def test_docs_example_runs(name: str, code: str, tiny_llama_dir: Path, hooks: Path) -> None:
    assert run_example(name, code, tiny_llama_dir, hooks), f"{name} ran no anyio.run"


@pytest.mark.parametrize("page", BOTH_BACKENDS)
def test_page_runs_on_asyncio_and_trio(page: str, tiny_llama_dir: Path, hooks: Path) -> None:
    ran: set[str] = set()
    for name, code in examples():
        if name.startswith(f"{page}#"):
            ran |= run_example(name, code, tiny_llama_dir, hooks)  # cached: run once
    assert ran == {"asyncio", "trio"}, f"{page}'s examples ran on {sorted(ran)}"
