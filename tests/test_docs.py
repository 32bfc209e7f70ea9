"""Every ``# docs-test`` Python example in docs/ and the README runs and exits 0."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"```python\n(.*?)```", re.DOTALL)


def examples() -> list[tuple[str, str]]:
    found = []
    for page in sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")]):
        blocks = [b for b in FENCE.findall(page.read_text()) if "# docs-test" in b]
        found += [(f"{page.name}#{i}", code) for i, code in enumerate(blocks)]
    return found


def test_each_capability_page_has_asyncio_and_trio_examples() -> None:
    pages = ("engine.md", "lifecycle.md", "sampling.md", "structured-outputs.md", "quantization.md")
    for page in pages:
        code = "".join(c for name, c in examples() if name.startswith(page))
        assert 'backend="asyncio"' in code and 'backend="trio"' in code, page


@pytest.mark.parametrize(("name", "code"), examples(), ids=[n for n, _ in examples()])
def test_docs_example_runs(name: str, code: str, tiny_llama_dir: Path) -> None:
    env = {**os.environ, "TGENGINE_DOCS_MODEL": str(tiny_llama_dir)}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"{name}:\n{result.stderr[-3000:]}"
    assert result.stdout.strip(), f"{name} printed nothing"
