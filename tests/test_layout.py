"""The layout shows the architecture (issue 31), checked on the source's imports.

Every import of every module under ``src/tgengine`` is read with ``ast`` (function-local
and ``TYPE_CHECKING`` ones included), so the checks need no import of tgengine and no
torch. They assert:

- no import cycle between modules;
- no import from a lower layer to a higher one (``LAYERS``, top first);
- no module over ``MAX_LINES`` lines;
- at the top level, only the public modules (``TOP_LEVEL``).

Known violations that other branches remove sit in explicit allow-lists below; each test
compares what it finds with its allow-list exactly, so a violation that disappears must
leave the list too (the list cannot rot), and a new one fails.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "tgengine"
MAX_LINES = 500

# The layers, top first. A module may import its own layer and the layers below it, never
# one above. A unit is a package under tgengine/ or a module at its top level; ``tgengine``
# is the package's ``__init__``: the public API, a client of everything it re-exports.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("__main__", "cli"),  # the dev runner
    ("server", "bench", "examples"),  # applications of the public API
    ("tgengine", "open_engine"),  # the public API's re-exports and entry point
    ("process",),  # the engine in its own process: ProcessEngine, host, supervisor
    ("engine",),  # Engine, the loop, requests and streams, admission
    ("executor",),  # one ModelAgent in-process, or one per rank in workers or actors
    ("ipc",),  # spawn, wire, orphans, shared-memory files: what process/ and executor/ share
    ("agent",),  # ModelAgent: weights, KV cache, forward steps
    ("sample",),  # sampler, logits processors, logprobs
    ("models",),  # config, loader, the forward of each architecture
    ("kernels",),  # C++ and fused kernels
    ("core",),  # scheduler, block manager, sequence, step: torch-free bookkeeping
    ("sampling",),  # SamplingParams (it holds a StructuredOutputsParams)
    ("structured_outputs",),  # grammars, matchers, bitmasks
    ("tokenization",),
    ("runtime", "config", "errors", "outputs", "state", "stats"),
)

# The top level holds the public API only.
TOP_LEVEL = {
    "__init__",
    "__main__",
    "config",
    "errors",
    "sampling",
    "outputs",
    "state",
    "stats",
    "open_engine",
}

# ALLOW-LIST, removed by the lead at integration (issue 31). Each is an exact finding.
KNOWN_CYCLES: set[frozenset[str]] = set()
KNOWN_UPWARD: set[tuple[str, str]] = set()
KNOWN_LONG: set[str] = set()


def module_files(src: Path = SRC) -> dict[str, Path]:
    """Every module under ``src/tgengine``, by dotted name (a package by its own name)."""
    files = {}
    for path in sorted((src / PACKAGE).rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join(parts)] = path
    return files


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    """``{module: the modules of the package it imports}``, every import in the file.

    ``from a import b`` names module ``a.b`` where there is one, else ``a``. Importing
    ``a.b.c`` also runs the packages ``a.b`` on the way, unless the importer is inside
    them already (then they are initialising); the top package is left out (it is
    initialising whenever anything inside it runs).
    """
    files = module_files(src)
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(name, is_package, node.level, node.module)
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.add(full if full in files else base)
        edges: set[str] = set()
        for target in targets:
            module = _known(target, files)
            if module is None:
                continue
            edges.add(module)
            edges.update(_parents_to_run(name, module))
        edges.discard(name)
        graph[name] = edges
    return graph


def _absolute(module: str, is_package: bool, level: int, name: str | None) -> str:
    if level == 0:
        return name or ""
    parts = module.split(".")
    if not is_package:
        parts = parts[:-1]
    parts = parts[: len(parts) - (level - 1)]
    return ".".join([*parts, name] if name else parts)


def _known(target: str, files: dict[str, Path]) -> str | None:
    while target and target not in files:
        target = target.rpartition(".")[0]
    return target or None


def _parents_to_run(importer: str, module: str) -> set[str]:
    parts = module.split(".")
    parents = {".".join(parts[:i]) for i in range(2, len(parts))}
    return {p for p in parents if not (importer == p or importer.startswith(p + "."))}


def cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.add(frozenset(component))
    return found


def unit(module: str) -> str:
    """The layer unit of ``module``: its package under tgengine/, or its own name."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def layer(unit_name: str) -> int:
    for i, units in enumerate(LAYERS):
        if unit_name in units:
            return i
    raise KeyError(f"{unit_name!r} has no layer in LAYERS")


def upward_imports(
    graph: dict[str, set[str]], unit_of: Callable[[str], str] = unit
) -> set[tuple[str, str]]:
    """``(importer, imported)`` pairs whose imported module sits in a higher layer."""
    return {
        (source, target)
        for source, targets in graph.items()
        for target in targets
        if layer(unit_of(target)) < layer(unit_of(source))
    }


def short(names: Iterable[str]) -> set[str]:
    return {name.removeprefix(f"{PACKAGE}.") for name in names}


def short_pairs(pairs: Iterable[tuple[str, str]]) -> set[tuple[str, str]]:
    return {(a.removeprefix(f"{PACKAGE}."), b.removeprefix(f"{PACKAGE}.")) for a, b in pairs}


def long_modules(src: Path = SRC) -> dict[str, int]:
    counts = {name: len(path.read_text().splitlines()) for name, path in module_files(src).items()}
    return {name: n for name, n in counts.items() if n > MAX_LINES}


def top_level_modules(src: Path = SRC) -> set[str]:
    return {path.stem for path in (src / PACKAGE).glob("*.py")}


@functools.cache
def source_graph() -> dict[str, set[str]]:
    return import_graph()


def test_no_import_cycles() -> None:
    found = {frozenset(short(c)) for c in cycles(source_graph())}
    assert found - KNOWN_CYCLES == set(), "new import cycles"
    assert KNOWN_CYCLES - found == set(), "gone: remove them from KNOWN_CYCLES"


def test_every_package_and_top_level_module_has_a_layer() -> None:
    for module in source_graph():
        layer(unit(module))


def test_no_import_points_up() -> None:
    found = short_pairs(upward_imports(source_graph()))
    assert found - KNOWN_UPWARD == set(), "imports from a lower layer to a higher one"
    assert KNOWN_UPWARD - found == set(), "gone: remove them from KNOWN_UPWARD"


def test_no_module_over_max_lines() -> None:
    found = short(long_modules())
    assert found - KNOWN_LONG == set(), f"modules over {MAX_LINES} lines: {long_modules()}"
    assert KNOWN_LONG - found == set(), "gone: remove them from KNOWN_LONG"


def test_the_top_level_holds_only_the_public_modules() -> None:
    assert top_level_modules() - TOP_LEVEL == set()
    assert TOP_LEVEL - top_level_modules() == set(), "gone: remove them from TOP_LEVEL"


def _plant(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / PACKAGE / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


@pytest.mark.parametrize(
    "files",
    [
        # relative, at module level
        {
            "core/__init__.py": "",
            "core/a.py": "from . import b\n",
            "core/b.py": "from .a import x\n",
        },
        # absolute and hidden in a function
        {
            "core/__init__.py": "",
            "core/a.py": "import tgengine.core.b\n",
            "core/b.py": "def f():\n    from tgengine.core import a\n",
        },
        # through a package's __init__ that re-exports
        {
            "core/__init__.py": "from .b import z\n",
            "core/a.py": "x = 1\n",
            "core/b.py": "from ..sample.s import y\nz = 1\n",
            "sample/__init__.py": "",
            "sample/s.py": "from ..core.a import x\n",
        },
    ],
)
def test_a_planted_cycle_is_found(tmp_path: Path, files: dict[str, str]) -> None:
    src = _plant(tmp_path, {"__init__.py": "", **files})
    assert cycles(import_graph(src)), import_graph(src)


def test_a_planted_upward_import_is_found(tmp_path: Path) -> None:
    src = _plant(
        tmp_path,
        {
            "__init__.py": "",
            "core/__init__.py": "",
            "core/a.py": "def f():\n    from ..engine.loop import x\n",
            "engine/__init__.py": "",
            "engine/loop.py": "from ..core import a\n",
        },
    )
    found = short_pairs(upward_imports(import_graph(src)))
    assert found == {("core.a", "engine.loop"), ("core.a", "engine")}  # engine/__init__ runs
    assert not cycles({k: v for k, v in import_graph(src).items() if k != "tgengine.core.a"})
