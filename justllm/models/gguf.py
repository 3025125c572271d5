"""The one check that a file is a GGUF before llama.cpp (or a download) is trusted with it."""

from __future__ import annotations

from pathlib import Path

from justllm.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"


def gguf_magic(path: Path) -> bytes:
    """The first four bytes of ``path`` (a ModelLoadError when it cannot be read)."""
    try:
        with path.open("rb") as f:
            return f.read(4)
    except OSError as e:
        raise ModelLoadError(f"cannot read model file {path}: {e.strerror}") from e


def check_gguf_file(path: str | Path) -> None:
    """Fail with a clear message before llama.cpp sees a file that is not a GGUF."""
    p = Path(path)
    if not p.is_file():
        raise ModelLoadError(f"model file not found: {path}")
    if gguf_magic(p) != GGUF_MAGIC:
        raise ModelLoadError(f"{path} is not a GGUF file (no GGUF magic at its start)")
