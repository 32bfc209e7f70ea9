"""``DiskCache``: small results worked out from a model directory, kept on disk between starts.

A result (a parsed model config, what a tokenizer directory needs) depends only on some
files of the directory, on the versions of the libraries that read them and on the code
that computes it; it is stored under ``$TGENGINE_CACHE/<name>/`` (default
``~/.cache/tgengine``), keyed by a hash of exactly those, and read back on the next start.

The entries are pickles written by this process's user, the same trust as the compiled
kernels beside them. A cache that cannot be read or written is skipped: the result is then
worked out as usual. At most ``max_entries`` entries are kept (the oldest go first).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import pickle
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)


def cache_root() -> Path:
    """``$TGENGINE_CACHE`` when set and non-empty, else ``~/.cache/tgengine``: where the
    converted default model, the compiled kernels and every ``DiskCache`` live."""
    return Path(os.environ.get("TGENGINE_CACHE") or "~/.cache/tgengine").expanduser()


class DiskCache:
    """Pickled results under ``cache_root() / name``, keyed by ``files`` of a directory,
    the ``libraries``' versions and the source of the ``code`` modules (bump ``format`` when
    a result changes meaning)."""

    def __init__(
        self,
        name: str,
        *,
        format: int,
        files: Sequence[str],
        libraries: Sequence[str],
        code: Sequence[ModuleType],
        max_entries: int = 256,
    ) -> None:
        self.name = name
        self.format = format
        self.files = tuple(files)
        self.libraries = tuple(libraries)
        self.code = tuple(code)
        self.max_entries = max_entries

    def directory(self) -> Path:
        return cache_root() / self.name

    def lookup(self, model_dir: Path) -> Any:
        """The result stored earlier for these same files, versions and code, or None."""
        entry = self._entry(model_dir)
        if entry is None or not entry.is_file():
            return None
        try:
            return pickle.loads(entry.read_bytes())
        except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError) as exc:
            log.info("ignoring unreadable %s cache entry %s: %s", self.name, entry, exc)
            return None

    def store(self, model_dir: Path, value: Any) -> None:
        """Keep ``value`` for the next ``lookup`` of the same files (best effort)."""
        entry = self._entry(model_dir)
        if entry is None:
            return
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            fd, temp = tempfile.mkstemp(dir=entry.parent, prefix=".tmp-")
            with os.fdopen(fd, "wb") as f:
                f.write(pickle.dumps(value))
            os.replace(temp, entry)
            self._prune(entry.parent)
        except OSError as exc:
            log.info("not caching the %s of %s: %s", self.name, model_dir, exc)

    def _entry(self, model_dir: Path) -> Path | None:
        digest = hashlib.sha256(f"format {self.format}\n".encode())
        for library in self.libraries:
            try:
                version = importlib.metadata.version(library)
            except importlib.metadata.PackageNotFoundError:
                version = "?"
            digest.update(f"{library} {version}\n".encode())
        try:
            for module in self.code:
                digest.update(Path(str(module.__file__)).read_bytes())
            for name in self.files:
                path = model_dir / name
                data = path.read_bytes() if path.is_file() else None
                digest.update(f"{name} {'-' if data is None else len(data)}\n".encode())
                digest.update(data or b"")
        except OSError:
            return None
        return self.directory() / f"{digest.hexdigest()}.pickle"

    def _prune(self, directory: Path) -> None:
        entries = sorted(directory.glob("*.pickle"), key=lambda p: p.stat().st_mtime)
        for old in entries[: max(0, len(entries) - self.max_entries)]:
            old.unlink(missing_ok=True)
