"""The sha256 of model files, computed once per content.

Hashing a multi-GB GGUF takes seconds, so a digest is remembered with the file's size and
modification time (``ROOT/digests.json``: path -> ``"<hex> <size> <mtime_ns>"``, the stamp
``demo_model_path`` writes beside the demo model too). While both are unchanged the file is
taken to be unchanged; when either moves the file is hashed again. The registry owns the file
and calls in under its lock.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

from justllm.errors import ModelLoadError
from justllm.models.manifest import DamagedFileError, read_json, stored_path, write_json


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    try:
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    except OSError as e:
        raise ModelLoadError(f"cannot read model file {path}: {e.strerror or e}") from None
    return h.hexdigest()


def stamp(path: Path, sha: str) -> str:
    """The hash plus size and mtime, so a later change to the file forces a recheck."""
    st = path.stat()
    return f"{sha} {st.st_size} {st.st_mtime_ns}"


def _matches(path: Path, recorded: str | None) -> str | None:
    """The hex of ``recorded`` when its size and mtime are still those of ``path``."""
    if not recorded or not isinstance(recorded, str):
        return None
    sha = recorded.split(" ", 1)[0]
    try:
        return sha if stamp(path, sha) == recorded.strip() else None
    except OSError:
        return None


class DigestCache:
    def __init__(self, root: Path, lock: Callable[[], AbstractContextManager]) -> None:
        self.root = root
        self.file = root / "digests.json"
        self._lock = lock

    def cached(self, path: Path) -> str | None:
        """The remembered hex for ``path`` if the file has not changed since, else None."""
        known = self._table().get(stored_path(path, self.root))
        if (hit := _matches(path, known)) is not None:
            return hit
        return stamped_sha(path)

    def _table(self) -> dict:
        """``digests.json``; one edited into something else is only a cache lost (the files
        are hashed again and it is written anew), not an error."""
        try:
            table = read_json(self.file, {})
        except DamagedFileError:  # cut short: as lost
            return {}
        return table if isinstance(table, dict) else {}

    def digest(self, path: Path) -> str:
        """``path``'s sha256 hex, hashing it only when it changed since it was last hashed."""
        if (hit := self.cached(path)) is not None:
            return hit
        sha = sha256_file(path)
        self.remember(path, sha)
        return sha

    def remember(self, path: Path, sha: str) -> None:
        with self._lock():
            table = self._table()
            table[stored_path(path, self.root)] = stamp(path, sha)
            for key in [k for k in table if not (self.root / k).exists()]:
                del table[key]
            write_json(self.file, table)


def stamped_sha(path: Path) -> str | None:
    """The hex the stamp beside ``path`` records, if the file has not changed since."""
    return _matches(path, _read_sidecar(path))


def write_sidecar(path: Path, sha: str) -> None:
    """Stamp ``path`` (hashed to ``sha``) beside it."""
    sidecar(path).write_text(stamp(path, sha))


def _read_sidecar(path: Path) -> str | None:
    try:
        return sidecar(path).read_text().strip()
    except OSError:
        return None


def sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def remove_file(path: Path) -> None:
    """Delete a model file and the stamp beside it, if any."""
    for p in (path, sidecar(path)):
        if p.is_symlink() or p.exists():
            os.unlink(p)
