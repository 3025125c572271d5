"""Downloading GGUF models from the Hugging Face Hub into the local models directory.

Used by the registry's ``pull`` (``justllm pull``, and any command given a model as
``REPO[:FILE]``). A file lands in ``ROOT/huggingface/OWNER/NAME/COMMIT/FILE``: one folder per
commit, so an older version stays on disk until it is removed. The hub library's notes
(``.cache/huggingface`` in that folder) let a second pull of the same commit skip the download.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import re
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from rich.console import Console

from justllm.errors import ModelLoadError

try:
    import fcntl
except ImportError:  # Windows: no flock, so no partial download can be told to be abandoned
    fcntl = None  # type: ignore[assignment]

PREFERRED_QUANT = "Q4_K_M"  # what `REPO` alone picks when a repo holds several quantizations
HUB_DIR = "huggingface"
_SHA256 = re.compile(r"[0-9a-f]{64}")


class SafetensorsRepoError(ModelLoadError):
    """The repo holds no GGUF but a Hugging Face safetensors model (``pull --convert``)."""


LOCAL_PREFIXES = ("/", "./", "../", "~")


def is_local_path(ref: str) -> bool:
    """Whether ``ref`` is written as a local path: ``/``, ``./``, ``../`` or ``~`` at its start,
    which no hub repo id has."""
    return ref.strip().startswith(LOCAL_PREFIXES) or Path(ref.strip()).is_absolute()


def split_ref(ref: str) -> tuple[str, str | None]:
    """``REPO[:FILE]`` -> ``(repo, file or None)``; hub repo ids never contain ``:``. A local
    path is refused here, before any request: its ``/`` would be stripped, and the hub asked
    for a repo named after the path."""
    refuse_local(ref)
    repo, sep, file = ref.partition(":")
    repo, file = repo.strip().strip("/"), file.strip().strip("/")
    if not repo or (sep and not file):
        raise ModelLoadError(f"expected REPO or REPO:FILE, got '{ref}'")
    if ".." in file.split("/"):  # (the hub's refusal read as "repo not found")
        raise ModelLoadError(f"FILE is a path inside the repo, without '..': got '{file}'")
    return repo, file or None


def refuse_local(ref: str) -> None:
    """A path given where a hub ``REPO[:FILE]`` is wanted (``justllm pull FILE``): one line that
    says how a local file is used instead."""
    path = Path(ref.strip()).expanduser()
    if path.is_file():
        raise ModelLoadError(f"{ref} is a local file, not a Hugging Face REPO[:FILE]: register "
                             f"it with 'justllm tag {ref} NAME' (or run it directly)")
    if not is_local_path(ref):
        return  # (a folder named like OWNER/NAME, as a git clone of the repo is, is no answer)
    if path.is_dir():
        raise ModelLoadError(f"{ref} is a local folder, not a Hugging Face REPO[:FILE] "
                             f"('justllm convert {ref}' converts a safetensors model there)")
    raise ModelLoadError(f"{ref} is a local path, not a Hugging Face REPO[:FILE], and no file "
                         "is there")


def pick_gguf(repo: str, files: list[str]) -> str:
    """The one GGUF that ``REPO`` alone means: the only one, else the only Q4_K_M one.

    ``mmproj*`` files (the vision projectors many GGUF repos carry next to the model) are not
    models by themselves, so they are never picked; ``REPO:FILE`` still downloads one.
    """
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf")
                   and not Path(f).name.lower().startswith("mmproj"))
    if not ggufs:
        top = {f for f in files if "/" not in f}
        if "adapter_config.json" in top and "config.json" not in top:
            raise ModelLoadError(f"no .gguf model file in {repo}: it is a PEFT LoRA adapter, "
                                 f"which 'justllm convert {repo}' turns into an adapter GGUF "
                                 "for --lora")
        if any(f.lower().endswith(".safetensors") for f in top) and "config.json" not in top:
            raise ModelLoadError(f"no .gguf model file in {repo}, and its safetensors weights "
                                 "come without a config.json: not a transformers model that "
                                 "llama.cpp's converter can read")
        if any(f.lower().endswith(".safetensors") for f in top):
            raise SafetensorsRepoError(
                f"no .gguf model file in {repo}, but it has safetensors weights: "
                f"'justllm pull {repo} --convert' converts them to GGUF")
        raise ModelLoadError(f"no .gguf model file in {repo}")
    if len(ggufs) == 1:
        return ggufs[0]
    preferred = [f for f in ggufs if PREFERRED_QUANT.lower() in f.lower()]
    if len(preferred) == 1:
        return preferred[0]
    candidates = preferred or ggufs
    raise ModelLoadError(f"{repo} has {len(candidates)} .gguf files ({', '.join(candidates)}); "
                         f"choose one with {repo}:FILE")


def _resolvable(endpoint: str | None) -> None:
    """A repo's listing goes through huggingface_hub's backoff, five retries over ~25 s with a
    warning line each, even when the hub's name does not resolve (no network) or nothing
    listens there (a mirror that is down): that is known in a moment, so it is asked first
    (an OSError, which ``hub_errors`` makes one line). Through a proxy only the name is
    checked; a connection that is slow, not refused, is left to the hub library."""
    from urllib.parse import urlsplit
    from urllib.request import getproxies

    parts = urlsplit(endpoint or "https://huggingface.co")
    host = parts.hostname or "huggingface.co"
    try:
        port = parts.port or (80 if parts.scheme == "http" else 443)
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise OSError(f"{host}: {e.strerror}") from None
    except ValueError:  # a port that is not one: the hub library says what is wrong
        return
    if getproxies():
        return
    try:
        with socket.create_connection((host, port), timeout=5):
            pass
    except ConnectionRefusedError:
        raise OSError(f"{host}:{port}: connection refused") from None
    except OSError:
        return


def _one_line(e: BaseException) -> str:
    """An exception (and the cause the hub library wraps network errors in) as one line."""
    text = " ".join(str(e).split()) or type(e).__name__
    cause = " ".join(str(e.__cause__ or "").split())
    return f"{text} ({cause})" if cause and cause not in text else text


@dataclass(frozen=True)
class Download:
    """A pulled file: where it is and the commit the revision resolved to."""

    repo: str
    file: str
    revision: str  # the commit (the revision as given when the hub names none)
    path: Path
    sha256: str | None  # the hub's sha256 of the file, when it gives one (LFS files)
    reused: bool  # not downloaded: a local file already had that sha256


def revision_dir(root: Path, repo: str, commit: str) -> Path:
    """Each commit of a repo gets a folder, so pulling a newer revision never overwrites the
    file an older version points to."""
    return root / HUB_DIR / repo / commit


def _lfs_sha256(etag: str | None) -> str | None:
    """The hub's ETag of an LFS file is the sha256 of its bytes (other files: a git sha1)."""
    tag = (etag or "").removeprefix("W/").strip('"').lower()
    return tag if _SHA256.fullmatch(tag) else None


def _partial_key(file_name: str) -> str:
    """The prefix of the partial downloads of ``file_name`` (huggingface_hub 2.x writes
    ``FILE`` to ``<key>.<etag>.<random>.incomplete`` beside ``FILE.lock``, the key being its
    ``_short_hash`` of ``FILE.metadata``)."""
    return base64.urlsafe_b64encode(hashlib.sha1(f"{file_name}.metadata".encode()).digest()
                                    ).decode()


@contextlib.contextmanager
def _lock_if_free(lock: Path) -> Iterator[bool]:
    """Whether ``lock`` (huggingface_hub's lock on one file's download, an flock its process
    holds for the whole download and loses when it dies) was free, holding it meanwhile.
    False where it cannot be told: no lock file, no flock, an error."""
    if fcntl is None:
        yield False
        return
    try:
        fd = os.open(lock, os.O_RDWR)
    except OSError:
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held by a running download (or a filesystem without flock)
            yield False
            return
        yield True
    finally:
        os.close(fd)  # closing releases the lock


def sweep_partials(repo_dir: Path, started_ns: int) -> list[Path]:
    """Delete the partial downloads (``*.incomplete``) that pulls of a repo killed outright
    (SIGKILL, a crash) left in ``repo_dir`` (``ROOT/huggingface/OWNER/NAME``), and return them.
    An interrupted or terminated pull deletes its own; a killed one cannot. A partial goes only
    when its file's download lock is free (no running process downloads that file) and it was
    last written before ``started_ns``, this pull's start (a guard for filesystems whose flock
    always succeeds); one whose lock is missing or cannot be taken is left."""
    swept: list[Path] = []
    for folder in sorted({p.parent for p in repo_dir.glob("*/.cache/huggingface/download/**/"
                                                          "*.incomplete")}):
        locks = {_partial_key(lock.name.removesuffix(".lock")): lock
                 for lock in folder.glob("*.lock")}
        for part in sorted(folder.glob("*.incomplete")):
            lock = locks.get(part.name.partition(".")[0])
            if lock is None:
                continue
            with _lock_if_free(lock) as free, contextlib.suppress(OSError):
                if free and part.stat().st_mtime_ns < started_ns:
                    part.unlink()
                    swept.append(part)
    return swept


def _fetch(repo: str, file: str | None, revision: str, root: Path, *, force: bool,
           endpoint: str | None, have: Callable[[str], Path | None],
           console: Console) -> Download:
    """List (when no FILE), resolve the commit, download; every hub or network failure becomes
    a ModelLoadError."""
    from huggingface_hub import HfApi, get_hf_file_metadata, hf_hub_download, hf_hub_url

    started_ns = time.time_ns()
    with hub_errors(repo, lambda: file, revision, endpoint):
        if file is None:
            _resolvable(endpoint)
            files = HfApi(endpoint=endpoint).list_repo_files(repo, revision=revision)
            if not all(isinstance(f, str) for f in files):
                raise TypeError(f"file names that are not strings: {files[:3]!r}")
            file = pick_gguf(repo, files)
        meta = get_hf_file_metadata(hf_hub_url(repo, file, revision=revision, endpoint=endpoint),
                                    endpoint=endpoint)
        commit = meta.commit_hash or revision
        sha = _lfs_sha256(meta.etag)
        if not force and sha is not None and (local := have(sha)) is not None:
            console.print(f"{repo}:{file} ({revision} @ {commit[:12]}) is already here: {local}",
                          highlight=False, soft_wrap=True)
            return Download(repo, file, commit, local, sha, reused=True)
        sweep_partials(root / HUB_DIR / repo, started_ns)  # (before the room is counted)
        if meta.size:
            _check_room(root, meta.size, f"{repo}:{file}")
        console.print(f"pulling {repo}:{file} ({revision} @ {commit[:12]})", highlight=False,
                      soft_wrap=True)
        with _hub_quiet():
            got = Path(hf_hub_download(repo, file, revision=commit,
                                       local_dir=revision_dir(root, repo, commit),
                                       force_download=force, endpoint=endpoint))
    return Download(repo, file, commit, got, sha, reused=False)


@contextlib.contextmanager
def _hub_quiet() -> Iterator[None]:
    """The hub library's own retry notes (five "Error while downloading ... Trying to resume
    download..." lines when a server goes away mid-file) and disk-space warnings (each with
    its source line) kept off the terminal: a failed pull is the one error line that
    ``hub_errors`` makes of it."""
    import logging
    import warnings

    hub_log = logging.getLogger("huggingface_hub")
    level = hub_log.level
    hub_log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hub_log.setLevel(level)


def _check_room(root: Path, size: int, what: str) -> None:
    """ModelLoadError when the models directory's disk cannot hold a ``size``-byte file
    (quantize and convert check before they write; a pull failed once the disk was full)."""
    from justllm.models.quantize import disk_free, nearest_dir

    where, free = nearest_dir(root), disk_free(root)
    if size > free:
        raise ModelLoadError(f"not enough disk space in {where} for {what}: it is "
                             f"{size / 1e6:.0f} MB, {free / 1e6:.0f} MB free")


def remove_download(path: Path, root: Path) -> None:
    """Delete a pulled file with the hub library's notes on it, then its commit's folder and the
    folders above when nothing else is left in them."""
    from justllm.models.digests import remove_file

    base = (root / HUB_DIR).resolve()
    rel = path.parent.resolve().relative_to(base) / path.name  # owner/name/commit/...file
    remove_file(path)
    if len(rel.parts) < 4:  # not where a pull puts files: nothing of the hub's beside it
        return
    commit_dir = base / Path(*rel.parts[:3])
    notes = commit_dir / ".cache" / "huggingface" / "download" / Path(*rel.parts[3:])
    # (its lock stays: another pull of the file may hold it; unlinked, a third could take a
    # new one and download beside it)
    notes.with_name(notes.name + ".metadata").unlink(missing_ok=True)
    if commit_dir.is_dir() and not any(
            p.is_file() and (p.relative_to(commit_dir).parts[0] != ".cache"
                             or p.name.endswith(".incomplete"))  # (another pull's, under way)
            for p in commit_dir.rglob("*")):
        shutil.rmtree(commit_dir, ignore_errors=True)
    for parent in [path.parent, *path.parent.parents]:
        if parent.resolve() == base.parent or not parent.resolve().is_relative_to(base):
            break
        with contextlib.suppress(OSError):  # only empty folders go
            parent.rmdir()


def looks_like_repo(ref: str) -> bool:
    """``owner/name`` or ``owner/name:file.gguf`` that is not a local path (``dir/x.gguf``
    that does not exist is a mistyped path, not a repo)."""
    repo = ref.partition(":")[0]
    return (repo.count("/") == 1 and not repo.startswith(("/", ".", "~"))
            and not (ref == repo and repo.lower().endswith(".gguf")) and not Path(ref).exists())


def download(ref: str, *, root: Path, revision: str = "main", force: bool = False,
             have: Callable[[str], Path | None] = lambda _sha: None,
             console: Console | None = None) -> Download:
    """Download ``REPO[:FILE]`` at ``revision`` into ``root/huggingface/REPO/COMMIT/``, unless
    ``have(sha256)`` names a local file with the bytes the hub lists for it (not with
    ``force``). The file is not checked here: the registry checks it against the hub's
    sha256 (``Download.sha256``) when it hashes it to record it, and deletes it on a mismatch."""
    console = console or Console(stderr=True, emoji=False)
    repo, file = split_ref(ref)
    if offline():
        raise ModelLoadError(f"HF_HUB_OFFLINE is set: pulling {ref} needs the hub (a model "
                             "pulled before is served by its name, or by REPO:FILE, offline)")
    if file is not None and not file.lower().endswith(".gguf"):
        raise ModelLoadError(f"'{file}' is not a .gguf file (justllm serves GGUF models only)")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelLoadError(f"cannot create the models directory {root}: {e}") from None
    # Read at call time: huggingface_hub copies HF_ENDPOINT into a constant at import.
    endpoint = (os.environ.get("HF_ENDPOINT") or "").rstrip("/") or None
    return _fetch(repo, file, revision, root, force=force, endpoint=endpoint, have=have,
                  console=console)


# -- whole models (justllm convert, pull --convert) -------------------------------------------


@dataclass(frozen=True)
class RepoListing:
    """A repo's top-level files at one commit, with their sizes."""

    repo: str
    commit: str
    files: dict[str, int]


def _endpoint() -> str | None:
    return (os.environ.get("HF_ENDPOINT") or "").rstrip("/") or None


@contextlib.contextmanager
def hub_errors(repo: str, file: Callable[[], str | None], revision: str,
               endpoint: str | None = None) -> Iterator[None]:
    """Every hub or network failure inside the block as one ModelLoadError line. ``file``:
    the file being fetched, asked only when something failed (None: the repo's listing)."""
    from huggingface_hub.utils import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    # The HTTP client's own error base (requests, httpx or httpx2 depending on the hub library's
    # version): connection errors from it are not OSErrors everywhere. Caught with OSError and
    # ValueError.
    transport: tuple[type[Exception], ...] = (OSError, ValueError, *(
        c for c in HfHubHTTPError.__mro__[1:] if c.__name__ == "HTTPError"))
    where = endpoint or _endpoint() or "the Hugging Face Hub"
    try:
        yield
    except GatedRepoError:
        raise ModelLoadError(f"{repo} is gated: accept its terms on the hub, then log in "
                             "(hf auth login, or set HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise ModelLoadError(f"repository '{repo}' not found on {where} (a private repo needs "
                             "hf auth login, or HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ModelLoadError(f"revision '{revision}' not found in {repo}") from None
    except LocalEntryNotFoundError as e:  # the library's way of saying "the hub was unreachable"
        raise ModelLoadError(f"{_what(repo, file())} {where}: "
                             f"{_one_line(e.__cause__ or e)}") from None
    except EntryNotFoundError:
        raise ModelLoadError(f"file '{file()}' not found in {repo} at revision "
                             f"'{revision}'") from None
    except transport as e:
        raise ModelLoadError(f"{_what(repo, file())} {where}: {_one_line(e)}") from None
    except (TypeError, LookupError, AttributeError) as e:  # JSON, but not the hub's answer
        raise ModelLoadError(f"{_what(repo, file())} {where}: its answer is not a Hugging Face "
                             f"Hub's ({type(e).__name__}: {_one_line(e)})") from None


def _what(repo: str, file: str | None) -> str:
    return f"cannot download {repo}:{file} from" if file else f"cannot list {repo} on"


def offline() -> bool:
    """``HF_HUB_OFFLINE`` as huggingface_hub obeys it (read when it is first imported)."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _cached_listing(repo: str, revision: str) -> RepoListing:
    """Offline, the listing is the revision's snapshot in the hub library's cache: the files an
    earlier download left there (a repo fetched in part lists only that part, which the
    model's own checks then name)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(repo, revision=revision, local_files_only=True))
    except LocalEntryNotFoundError:
        raise ModelLoadError(f"{repo} at revision '{revision}' is not in the Hugging Face cache "
                             f"({hub_cache_dir()}) and HF_HUB_OFFLINE is set: download it "
                             "once online") from None
    return RepoListing(repo, folder.name, {p.name: p.stat().st_size for p in folder.iterdir()
                                           if p.is_file()})


def list_repo(repo: str, revision: str = "main", probe: str = "config.json") -> RepoListing:
    """The commit ``revision`` resolves to (asked through ``probe``: config.json, which a
    transformers model has; a PEFT adapter's adapter_config.json), then the top-level files at
    that commit, so the listing and the later downloads see the same commit even if the branch
    moves meanwhile. Offline (``HF_HUB_OFFLINE``), what the hub library's cache holds of it."""
    from huggingface_hub import HfApi, hf_hub_download

    if offline():
        return _cached_listing(repo, revision)
    endpoint = _endpoint()
    with hub_errors(repo, lambda: probe, revision):
        _resolvable(endpoint)
        # Downloaded, not only asked: the hub library's cache then records which commit
        # ``revision`` was (its refs/), so the listing can be made offline later.
        commit = Path(hf_hub_download(repo, probe, revision=revision,
                                      endpoint=endpoint)).parent.name
        files = {f.path: int(getattr(f, "size", 0) or 0)
                 for f in HfApi(endpoint=endpoint).list_repo_tree(repo, revision=commit)
                 if "/" not in f.path and hasattr(f, "size")}
    return RepoListing(repo, commit, files)


def has_file(repo: str, file: str, revision: str = "main") -> bool:
    """Whether ``repo`` has ``file`` at ``revision`` (a missing repo or revision, or no hub:
    the ModelLoadError line; offline, whether the cached snapshot has it)."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.utils import EntryNotFoundError

    if offline():
        return file in _cached_listing(repo, revision).files
    endpoint = _endpoint()
    # (a question about the repo, downloading nothing: an unreachable hub said "cannot
    # download OWNER/NAME:adapter_config.json" to `justllm convert OWNER/NAME`)
    with hub_errors(repo, lambda: None, revision):
        _resolvable(endpoint)
        try:
            get_hf_file_metadata(hf_hub_url(repo, file, revision=revision, endpoint=endpoint),
                                 endpoint=endpoint)
        except EntryNotFoundError:
            return False
    return True


def download_files(listing: RepoListing, files: list[str]) -> Path:
    """Download ``files`` of the listed commit into the hub library's own cache (a second
    conversion of the same commit, say to another type, downloads nothing) and return the
    folder that holds them: the commit's snapshot folder there."""
    from huggingface_hub import hf_hub_download

    endpoint = _endpoint()
    folder: Path | None = None
    for file in files:
        with hub_errors(listing.repo, partial(str, file), listing.commit):
            got = Path(hf_hub_download(listing.repo, file, revision=listing.commit,
                                       endpoint=endpoint))
        folder = got.parent
    if folder is None:
        raise ModelLoadError(f"nothing to download from {listing.repo}")
    return folder


def cached_bytes(listing: RepoListing, files: list[str]) -> int:
    """How many of those files' bytes are in the hub library's cache already."""
    from huggingface_hub import try_to_load_from_cache

    total = 0
    for file in files:
        found = try_to_load_from_cache(listing.repo, file, revision=listing.commit)
        if isinstance(found, str):
            total += listing.files.get(file, 0)
    return total


def hub_cache_dir() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)
