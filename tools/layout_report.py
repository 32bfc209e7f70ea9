"""Print the layout's counts (issue 31): top-level modules, import cycles, upward imports,
the largest modules, and the lines of ``src/`` and ``tests/``.

The import graph and the layers are ``tests/test_layout.py``'s, applied to the working
tree or to the tree of a git revision. A module of the flat layout before the packages
is placed in the layer of the package it moved to (``MOVED``). Usage (from the
repository root)::

    python tools/layout_report.py            # the working tree
    python tools/layout_report.py 720d450    # a revision (read with git archive)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import test_layout as layout  # noqa: E402  (the policy lives in the test)

# Top-level modules of the flat layout -> the package they moved to (issue 31).
MOVED = {
    "engine_loop": "engine",
    "requests": "engine",
    "stream": "engine",
    "admission": "engine",
    "request_stats": "engine",
    "engine_client": "engine",
    "_groups": "runtime",
    "_task_status": "runtime",
    "disk_cache": "runtime",
    "openmp_policy": "runtime",
    "parallel": "runtime",
    "scheduler": "core",
    "block_manager": "core",
    "sequence": "core",
    "step": "core",
    "sampler": "sample",
    "step_sampler": "sample",
    "logprobs": "sample",
    "logits_processors": "sample",
    "tokenizer": "tokenization",
    "fast_tokenizer": "tokenization",
    "tokenizer_facts": "tokenization",
    "chat_template": "tokenization",
    "detokenizer": "tokenization",
    "model_agent": "agent",
    "model_inputs": "agent",
    "cpu_threads": "agent",
    "default_model": "cli",
    "_faults": "runtime",  # removed since (faults go through a seam in tests); it imported nothing
}


def moved_unit(module: str) -> str:
    name = layout.unit(module)
    return MOVED.get(name, name)


def tree(rev: str | None, scratch: Path) -> Path:
    """The repository at ``rev`` (its ``src/`` and ``tests/``), or the working tree."""
    if rev is None:
        return ROOT
    archive = scratch / "tree.tar"
    with archive.open("wb") as out:
        subprocess.run(["git", "archive", rev, "src", "tests"], cwd=ROOT, stdout=out, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(scratch / "tree", filter="data")
    return scratch / "tree"


def files(root: Path, folder: str) -> list[Path]:
    """The files git would keep under ``folder`` (no caches, no build outputs)."""
    if root != ROOT:
        return sorted(p for p in (root / folder).rglob("*") if p.is_file())
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", folder],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [ROOT / name for name in listed if (ROOT / name).is_file()]


def lines(path: Path) -> int:
    return len(path.read_bytes().splitlines())


def report(root: Path) -> None:
    src = root / "src"
    graph = layout.import_graph(src)
    found_cycles = layout.cycles(graph)
    upward = layout.upward_imports(graph, moved_unit)
    top = layout.top_level_modules(src)
    print(f"top-level modules: {len(top)}")
    print(f"import cycles: {len(found_cycles)}")
    for cycle in sorted(sorted(layout.short(c)) for c in found_cycles):
        print(f"  {' <-> '.join(cycle)}")
    by_unit = Counter((moved_unit(a), moved_unit(b)) for a, b in upward)
    print(f"upward imports: {len(upward)} (module pairs), {len(by_unit)} (package pairs)")
    for (a, b), n in sorted(by_unit.items()):
        print(f"  {a} -> {b}: {n}")
    sizes = sorted(((lines(p), n) for n, p in layout.module_files(src).items()), reverse=True)
    print("largest modules:")
    for n, name in sizes[:5]:
        print(f"  {n:5d} {name.removeprefix('tgengine.')}")
    over = [name for n, name in sizes if n > layout.MAX_LINES]
    print(f"modules over {layout.MAX_LINES} lines: {len(over)}")
    for folder in ("src", "tests"):
        paths = files(root, folder)
        py = [p for p in paths if p.suffix == ".py"]
        total, in_py = sum(map(lines, paths)), sum(map(lines, py))
        print(f"lines of {folder}/: {total} ({in_py} in {len(py)} .py files)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rev", nargs="?", help="a git revision (default: the working tree)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        report(tree(args.rev, Path(scratch)))


if __name__ == "__main__":
    main()
