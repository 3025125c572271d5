"""One version of a model as the registry keeps it, and how the registry's files are written.

A ``Manifest`` describes one GGUF by its sha256: where the file is, what it is, where it came
from and when it was added. It is written once, as ``ROOT/manifests/sha256-<hex>.json``, and
never changed (the exceptions: a version whose file has gone is written again when the same
bytes are registered from another place, one whose bytes ``justllm tag FILE`` names at
another path records that path among its ``copies``, and one pulled again from another hub
file records it among its ``origins``). Paths inside the models directory are stored relative
to it, so the directory can move; a file registered from elsewhere keeps its absolute path.
Every registry file is written to a temporary name and renamed into place, and every
read-modify-write happens under one lock file, ``ROOT/.lock``.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from justllm.errors import ModelLoadError
from justllm.models.refs import DIGEST_PREFIX
from justllm.models.store import recorded_quantization

try:
    import fcntl
except ImportError:  # Windows: no cross-process lock; one justllm at a time there
    fcntl = None  # type: ignore[assignment]

SCHEMA = 1


@dataclass(frozen=True)
class Source:
    """Where a version came from: a local file, a file of a Hugging Face repo at a commit, a
    conversion (``justllm convert``) of a repo at a commit or of a local folder (``file``), or
    a quantization (``justllm quantize``) of the GGUF at ``file`` whose digest was
    ``revision``."""

    kind: str  # "file" | "huggingface" | "converted" | "quantized"
    repo: str | None = None
    file: str | None = None
    revision: str | None = None  # the commit the download resolved to (quantized: a digest)

    def __str__(self) -> str:
        if self.kind == "huggingface":
            return f"huggingface {self.repo}:{self.file} @ {self.revision}"
        if self.kind == "converted":
            return (f"converted from {self.repo} @ {self.revision}" if self.repo
                    else f"converted from {self.file}")
        if self.kind == "quantized":
            short = (self.revision or "").removeprefix("sha256:")[:12]
            return f"quantized from {self.file}" + (f" (sha256:{short})" if short else "")
        return self.kind


@dataclass(frozen=True)
class Origin:
    """Another Hugging Face file a version was pulled from (a mirror, another repo with the
    same bytes; or its source's own file, pulled again after another version of it): its
    ``source`` names only the first; ``added``: when it was pulled from there at
    ``revision``, the last time it was the file's newest."""

    repo: str
    file: str
    revision: str
    added: str

    def __str__(self) -> str:
        return f"huggingface {self.repo}:{self.file} @ {self.revision}"


@dataclass(frozen=True)
class Manifest:
    digest: str  # "sha256:<64 hex>"
    path: Path  # absolute
    size: int
    architecture: str
    quantization: str
    context_length: int | None
    source: Source
    added: str  # ISO 8601, UTC
    # Other files tagged with these bytes (``justllm tag FILE NAME``, FILE a copy of ``path``):
    # the version moves to one of them when ``path`` is gone or changed (Registry.verify).
    copies: tuple[Path, ...] = ()
    # The other hub files it was pulled from (``Registry.pull``), so each finds it offline.
    origins: tuple[Origin, ...] = ()

    @property
    def hex(self) -> str:
        return self.digest.removeprefix(DIGEST_PREFIX)

    @property
    def short(self) -> str:
        return self.hex[:12]

    @property
    def files(self) -> tuple[Path, ...]:
        """Every file recorded with these bytes: ``path`` first, then the copies."""
        return (self.path, *self.copies)

    def pulled_from(self, repo: str, file: str) -> bool:
        """Whether its source is the hub file ``repo:file``."""
        return self.source.kind == "huggingface" and (self.source.repo,
                                                      self.source.file) == (repo, file)

    def pulled_at(self, repo: str, file: str) -> str | None:
        """When this version was last pulled from the hub file ``repo:file`` (its source's, or
        an origin's); None when it never was."""
        times = [o.added for o in self.origins if (o.repo, o.file) == (repo, file)]
        if self.pulled_from(repo, file):
            times.append(self.added)
        return max(times, default=None)

    def to_json(self, root: Path) -> dict[str, Any]:
        data = {"schema": SCHEMA, "digest": self.digest, "path": stored_path(self.path, root),
                "size": self.size, "architecture": self.architecture,
                "quantization": self.quantization, "context_length": self.context_length,
                "source": {k: v for k, v in vars(self.source).items() if v is not None},
                "added": self.added}
        if self.copies:  # (written only when there are: older manifests read as they were)
            data["copies"] = [stored_path(c, root) for c in self.copies]
        if self.origins:  # (likewise)
            data["origins"] = [vars(o) for o in self.origins]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any], root: Path) -> Manifest:
        copies = data.get("copies", [])
        if not isinstance(copies, list) or not all(isinstance(c, str) for c in copies):
            raise ValueError("copies must be a list of paths")
        origins = data.get("origins", [])
        if not isinstance(origins, list) or not all(isinstance(o, dict) for o in origins):
            raise ValueError("origins must be a list of objects")
        return cls(digest=data["digest"], path=root / data["path"], size=int(data["size"]),
                   architecture=data["architecture"],
                   quantization=recorded_quantization(data["quantization"]),
                   context_length=data.get("context_length"), source=Source(**data["source"]),
                   added=data["added"], copies=tuple(root / c for c in copies),
                   origins=tuple(Origin(**o) for o in origins))


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def absolute(path: Path | str) -> Path:
    """``path`` made absolute as the shell reads it: ``~`` expanded, a ``../`` dropped (a
    recorded path kept it), no link followed (a linked file stays the link)."""
    return Path(os.path.abspath(Path(path).expanduser()))


def is_inside(path: Path, root: Path) -> bool:
    """Whether ``path`` lives in ``root``, judged by its folder (a symlink in the models
    directory is inside it, wherever it points)."""
    return path.parent.resolve().is_relative_to(root.resolve())


def stored_path(path: Path, root: Path) -> str:
    """``path`` as a registry file records it: relative to ``root`` when inside it."""
    if is_inside(path, root):
        return str(path.parent.resolve().relative_to(root.resolve()) / path.name)
    return str(absolute(path))


class DamagedFileError(ModelLoadError):
    """A registry file that was read but is not JSON (cut short, edited by hand): a damaged
    manifest is skipped and reported like one that holds the wrong JSON, not a failure of
    every command that lists the versions."""


def read_json(path: Path, default: Any) -> Any:
    """``path``'s JSON, or ``default`` when there is no such file. A file that cannot be read
    is a ModelLoadError; one that reads but is no JSON a DamagedFileError."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return default
    except OSError as e:
        raise ModelLoadError(f"cannot read the registry file {path} ({e})") from None
    try:
        return json.loads(data.decode("utf-8"))
    except ValueError as e:  # cut short, edited by hand, not UTF-8
        raise DamagedFileError(f"cannot read the registry file {path} ({e})") from None


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` to a temporary file beside ``path`` and rename it into place, so a
    reader sees the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        with part.open("w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, path)
    except OSError as e:
        part.unlink(missing_ok=True)
        raise ModelLoadError(f"cannot write the registry file {path}: {e.strerror or e}") from None


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (created if need be) for as long as the block runs."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise ModelLoadError(f"cannot lock the registry ({path}): {e.strerror or e}") from None
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock
