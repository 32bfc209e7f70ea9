"""Plant small, plausible lifecycle bugs one at a time; count those the lifecycle machine catches.

Each bug is one textual edit of one module under ``src/tgengine``. For each, the tree is
copied to a scratch directory, the edit applied there (your checkout is never touched),
and ``tests/test_lifecycle_machine.py`` alone runs against the copy. A bug is *caught* when
that run fails. Usage (from the repository root)::

    nice -n 19 python tools/plant_lifecycle_bugs.py [--only NAME ...] [--examples N]

Prints one line per bug and the ratio; exits 1 if any bug survived.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name: (module, the original text, the buggy text)
BUGS: dict[str, tuple[str, str, str]] = {
    "death-leaves-requests-open": (
        "engine/engine.py",
        '        self._end_all("error", error=f"engine died: {type(cause).__name__}: {cause}")\n',
        "",
    ),
    "sleep-keeps-stale-prefix-cache": (
        "engine/loop.py",
        "            self._scheduler.reset_cache(self._scheduler.block_manager.num_blocks)\n",
        "",
    ),
    "cache-error-ends-the-batch": (
        "agent/agent.py",
        "                    result.errors[seq.seq_id] = "
        "str(CacheNotReadyError(seq.seq_id, problem))\n",
        "                    for other in batch.seqs:\n"
        "                        result.errors[other.seq_id] = "
        "str(CacheNotReadyError(other.seq_id, problem))\n"
        "                    return result\n",
    ),
    "pause-keep-aborts": (
        "engine/engine.py",
        '        if mode == "abort":\n            self._end_all("abort")\n',
        '        if mode in ("abort", "keep"):\n            self._end_all("abort")\n',
    ),
    "failed-update-applies": (  # a part refused (or the block raised): the rest applies
        "engine/weight_update.py",
        "            if exc_type is None:\n",
        "            if True:\n",
    ),
    "dropped-stream-does-not-abort": (
        "engine/stream.py",
        "    def __del__(self) -> None:\n        self._let_go()\n",
        "    def __del__(self) -> None:\n        pass\n",
    ),
    "reused-block-keeps-old-prefix-hash": (
        "core/block_manager.py",
        "            del self._hash_to_block[block.block_hash]\n"
        "            block.block_hash = block.parent_hash = None\n"
        "            block.token_ids = ()\n",
        "            pass\n",
    ),
    "stop-leaves-held-requests": (
        "engine/engine.py",
        '        self._loop.finish_held("abort")\n        self._stop_event.set()\n',
        "        self._stop_event.set()\n",
    ),
    "update-keeps-stale-prefix-cache": (
        "engine/loop.py",
        "        self._scheduler.block_manager.forget_prefixes()\n",
        "",
    ),
    "abort-keeps-blocks": (
        "engine/requests.py",
        "            self.scheduler.finish(request.seq)  # its blocks are free now\n",
        "            pass\n",
    ),
    "wakeup-keeps-requests-held": (
        "engine/engine.py",
        "                    self._pause_mode = None\n"
        "                    self._loop.release_held()\n",
        "                    self._pause_mode = None\n",
    ),
    "cancelled-consumer-does-not-abort": (
        "engine/stream.py",
        "        except BaseException:\n            self._let_go()",
        "        except BaseException:\n            self._receive.close()",
    ),
    "no-step-timeout": (
        "engine/loop.py",
        "            with anyio.fail_after(timeout) if timeout is not None else _no_deadline():\n",
        "            with _no_deadline():\n",
    ),
    "reload-keeps-weight-version": (
        "engine/loop.py",
        "            if await self.executor.wakeup(tag):\n"
        "                self.weight_version += 1\n",
        "            await self.executor.wakeup(tag)\n",
    ),
    "drain-does-not-wait": (
        "engine/engine.py",
        "            try:\n                await self._loop.wait_until_idle()\n"
        "            finally:\n                self._draining = False\n",
        "            self._draining = False\n",
    ),
    "level1-sleep-drops-weights": (
        "agent/agent.py",
        "            if level == 1:\n",
        "            if level == 3:\n",
    ),
}


def plant(name: str, scratch: Path, source: Path = ROOT) -> Path:
    """A copy of ``source``'s src/ and tests/ under ``scratch``, with bug ``name`` planted."""
    module, original, buggy = BUGS[name]
    tree = scratch / name
    for part in ("src", "tests"):
        ignore = shutil.ignore_patterns("__pycache__")
        shutil.copytree(source / part, tree / part, ignore=ignore)
    path = tree / "src" / "tgengine" / module
    text = path.read_text()
    if text.count(original) != 1:
        raise SystemExit(f"{name}: the original text is not found exactly once in {module}")
    path.write_text(text.replace(original, buggy))
    return tree


def run_machine(tree: Path, examples: int) -> tuple[bool, float]:
    env = {
        **os.environ,
        "PYTHONPATH": f"{tree / 'src'}{os.pathsep}{tree / 'tests'}",
        "TGENGINE_HYPOTHESIS_EXAMPLES": str(examples),
        "CI": "1",  # no shrinking: a failing example is enough
    }
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
               str(tree / "tests" / "test_lifecycle_machine.py")]  # fmt: skip
    start = time.monotonic()
    result = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    return result.returncode != 0, time.monotonic() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", choices=sorted(BUGS), help="plant only these")
    parser.add_argument("--examples", type=int, default=10, help="examples per backend")
    args = parser.parse_args()
    names = args.only or list(BUGS)
    caught = 0
    with tempfile.TemporaryDirectory(prefix="planted-") as scratch:
        snapshot = Path(scratch) / "_snapshot"  # later edits of the checkout change nothing
        for part in ("src", "tests"):
            shutil.copytree(ROOT / part, snapshot / part)
        for name in names:
            killed, seconds = run_machine(plant(name, Path(scratch), snapshot), args.examples)
            caught += killed
            print(f"{'caught ' if killed else 'MISSED '} {name} ({seconds:.0f} s)", flush=True)
    print(f"caught {caught} of {len(names)} planted bugs")
    return 0 if caught == len(names) else 1


if __name__ == "__main__":
    sys.exit(main())
