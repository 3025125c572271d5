"""Downloading GGUF models from the Hugging Face Hub into the local models directory.

Used by ``justllm pull`` and by any command given a model as ``REPO[:FILE]``.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from rich.console import Console

from justllm.errors import ModelLoadError
from justllm.models.gguf import GGUF_MAGIC, gguf_magic

PREFERRED_QUANT = "Q4_K_M"  # what `REPO` alone picks when a repo holds several quantizations


def split_ref(ref: str) -> tuple[str, str | None]:
    """``REPO[:FILE]`` -> ``(repo, file or None)``; hub repo ids never contain ``:``."""
    repo, sep, file = ref.partition(":")
    repo, file = repo.strip().strip("/"), file.strip().strip("/")
    if not repo or (sep and not file):
        raise ModelLoadError(f"expected REPO or REPO:FILE, got '{ref}'")
    return repo, file or None


def pick_gguf(repo: str, files: list[str]) -> str:
    """The one GGUF that ``REPO`` alone means: the only one, else the only Q4_K_M one.

    ``mmproj*`` files (the vision projectors many GGUF repos carry next to the model) are not
    models by themselves, so they are never picked; ``REPO:FILE`` still downloads one.
    """
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf")
                   and not Path(f).name.lower().startswith("mmproj"))
    if not ggufs:
        raise ModelLoadError(f"no .gguf model file in {repo}")
    if len(ggufs) == 1:
        return ggufs[0]
    preferred = [f for f in ggufs if PREFERRED_QUANT.lower() in f.lower()]
    if len(preferred) == 1:
        return preferred[0]
    candidates = preferred or ggufs
    raise ModelLoadError(f"{repo} has {len(candidates)} .gguf files ({', '.join(candidates)}); "
                         f"choose one with {repo}:FILE")


def _one_line(e: BaseException) -> str:
    """An exception (and the cause the hub library wraps network errors in) as one line."""
    text = " ".join(str(e).split()) or type(e).__name__
    cause = " ".join(str(e.__cause__ or "").split())
    return f"{text} ({cause})" if cause and cause not in text else text


def _fetch(repo: str, file: str | None, revision: str, root: Path, *, force: bool,
           endpoint: str | None, console: Console) -> tuple[str, Path]:
    """List (when no FILE) and download; every hub or network failure becomes a ModelLoadError."""
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.utils import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    # The HTTP client's own error base (requests, httpx or httpx2 depending on the hub library's
    # version): connection errors from it are not OSErrors everywhere.
    transport = tuple(c for c in HfHubHTTPError.__mro__[1:] if c.__name__ == "HTTPError")
    where = endpoint or "the Hugging Face Hub"
    try:
        if file is None:
            file = pick_gguf(repo, HfApi(endpoint=endpoint).list_repo_files(repo, revision=revision))
        console.print(f"pulling {repo}:{file} ({revision})", highlight=False, soft_wrap=True)
        got = Path(hf_hub_download(repo, file, revision=revision, local_dir=root,
                                   force_download=force, endpoint=endpoint))
    except GatedRepoError:
        raise ModelLoadError(f"{repo} is gated: accept its terms on the hub, then log in "
                             "(hf auth login, or set HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise ModelLoadError(f"repository '{repo}' not found on {where} (a private repo needs "
                             "hf auth login, or HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ModelLoadError(f"revision '{revision}' not found in {repo}") from None
    except LocalEntryNotFoundError as e:  # the library's way of saying "the hub was unreachable"
        raise ModelLoadError(f"cannot download {repo}:{file} from {where}: "
                             f"{_one_line(e.__cause__ or e)}") from None
    except EntryNotFoundError:
        raise ModelLoadError(f"file '{file}' not found in {repo} at revision '{revision}'") from None
    except (OSError, ValueError, *transport) as e:
        raise ModelLoadError(f"cannot download {repo}:{file or '(listing)'} from {where}: "
                             f"{_one_line(e)}") from None
    return file, got


def _flatten(root: Path, got: Path) -> Path:
    """``local_dir`` mirrors the repo's folders; the models directory is flat (name = file stem)."""
    path = root / got.name
    if got != path:
        os.replace(got, path)
        for parent in got.relative_to(root).parents:
            if parent != Path("."):
                with contextlib.suppress(OSError):  # only empty folders go
                    (root / parent).rmdir()
    return path


def looks_like_repo(ref: str) -> bool:
    """``owner/name`` or ``owner/name:file.gguf`` that is not a local path."""
    repo = ref.partition(":")[0]
    return (repo.count("/") == 1 and not repo.startswith(("/", ".", "~"))
            and not Path(ref).exists())


def pull_model(ref: str, *, revision: str = "main", force: bool = False,
               console: Console | None = None) -> Path:
    """Download ``REPO[:FILE]`` into the models directory; returns the local path."""
    from justllm.models.store import models_dir

    console = console or Console(stderr=True)
    repo, file = split_ref(ref)
    if file is not None and not file.lower().endswith(".gguf"):
        raise ModelLoadError(f"'{file}' is not a .gguf file (justllm serves GGUF models only)")
    root = models_dir().expanduser().resolve()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelLoadError(f"cannot create the models directory {root}: {e}") from None
    # Read at call time: huggingface_hub copies HF_ENDPOINT into a constant at import.
    endpoint = (os.environ.get("HF_ENDPOINT") or "").rstrip("/") or None
    file, got = _fetch(repo, file, revision, root, force=force, endpoint=endpoint,
                       console=console)
    path = _flatten(root, got)
    magic = gguf_magic(path)
    if magic != GGUF_MAGIC:
        path.unlink()
        raise ModelLoadError(f"{repo}:{file} is not a GGUF file (it starts with {magic!r})")
    console.print(f"pulled {repo}:{file} -> {path}", highlight=False, soft_wrap=True)
    return path
