"""The model registry: named, versioned GGUF files in the models directory.

A version is one GGUF, known by its sha256 and described by an immutable manifest; a tag
(``name:tag``) is a movable pointer to a version. On disk, under the models directory ``ROOT``:

    manifests/sha256-<hex>.json    one per version (manifest.py)
    tags.json                      {"name:tag": "sha256:<hex>"}
    digests.json                   digests remembered with size and mtime (digests.py)
    leases/                        running models' claims on versions (lease.py)
    huggingface/OWNER/NAME/COMMIT/ pulled files, one folder per commit (hub.py)
    *.gguf                         files put there by hand, the demo model, older pulls

A GGUF in ``ROOT`` that no manifest names is adopted the first time a listing or a name needs
it: hashed once, given a manifest and the tag ``stem:latest`` (when that tag is free). Files are
never copied: a file tagged from outside ``ROOT`` stays where it is, and ``rm`` deletes only
files inside ``ROOT``. A resolved version is checked against its digest, by size and mtime
first, so an unchanged file is not hashed again. A file tagged whose bytes are a version's
already, at another path, is recorded as a copy of it: the version moves to the copy when its
own file is gone or changed.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from rich.console import Console

from justllm.errors import ModelLoadError
from justllm.models.digests import DigestCache, remove_file, sha256_file
from justllm.models.gguf import ADAPTER_TYPE, read_gguf_header
from justllm.models.hub import HUB_DIR, Download
from justllm.models.lease import Lease, acquire_lease, holders
from justllm.models.manifest import (
    DamagedFileError,
    Manifest,
    Origin,
    Source,
    absolute,
    file_lock,
    is_inside,
    now,
    read_json,
    stored_path,
    write_json,
)
from justllm.models.refs import (
    DEFAULT_TAG,
    DIGEST_PREFIX,
    InvalidRefError,
    could_be_name,
    is_explicit_digest,
    label,
    name_for_file,
    new_ref,
    parse_digest,
    parse_ref,
)

_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


def _manifest_state(file: Path) -> str:
    """What is wrong with a manifest that did not read as one."""
    return "is damaged (not a manifest)" if file.exists() else "is missing"


class UnknownModelError(ModelLoadError):
    """No tag has this name (other sources may still know it: a stem, a path)."""


class DigestMismatchError(ModelLoadError):
    """A file whose sha256 is not the one it was expected to have (a pull: the hub's)."""

    def __init__(self, path: Path, found: str, expected: str) -> None:
        super().__init__(f"digest mismatch: {path} has sha256:{found[:12]}, expected "
                         f"sha256:{expected[:12]}")
        self.found, self.expected = found, expected


@dataclass(frozen=True)
class Entry:
    """One row of ``justllm models``: a tag and its version, or an untagged version."""

    label: str | None
    manifest: Manifest


@dataclass(frozen=True)
class Removal:
    what: str  # the tag or the digest removed
    manifest: Manifest | None
    untagged: tuple[str, ...]
    still_tagged: tuple[str, ...]  # the version stays: these tags point to it
    deleted_file: Path | None
    kept_file: Path | None
    kept_because: str | None = None


@dataclass(frozen=True)
class Rewritten:
    """A registered file overwritten in place (``quantize --force``, ``convert --force``): the
    version of its new bytes, the versions of its old bytes (dropped: those bytes are gone),
    and the tags that pointed to those and now point to the new one."""

    manifest: Manifest
    dropped: tuple[Manifest, ...]
    moved: tuple[str, ...]


@dataclass(frozen=True)
class Pulled:
    label: str
    manifest: Manifest
    previous: Manifest | None  # the version the tag pointed to before (kept)
    download: Download


class Registry:
    """The registry of one models directory (default: ``models_dir()``). Cheap to make: make
    one per command or per thread, not one shared between threads (its lock is re-entrant per
    object, across processes through ``ROOT/.lock``)."""

    def __init__(self, root: Path | None = None) -> None:
        from justllm.models.store import models_dir

        self.root = absolute(root or models_dir())
        self.digests = DigestCache(self.root, self._locked)
        self._depth = 0

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The registry's lock, re-entrant within this object (``flock`` is not: a second
        ``open`` of the lock file by the same process would wait for itself)."""
        if self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        with file_lock(self.root / ".lock"):
            self._depth = 1
            try:
                yield
            finally:
                self._depth = 0

    # -- reading ---------------------------------------------------------------------------

    def tags(self) -> dict[str, str]:
        """``tags.json``, checked: a file edited into something else is one clear error naming
        the file and the entry, not a traceback somewhere later."""
        file = self.root / "tags.json"
        tags = read_json(file, {})
        if not isinstance(tags, dict):
            raise ModelLoadError(f"the registry file {file} is damaged: it is not a mapping of "
                                 "NAME:TAG to sha256:<digest> (fix it, or delete it to drop "
                                 "every tag)")
        for key, digest in tags.items():
            if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
                raise ModelLoadError(f"the registry file {file} is damaged: {key!r} points to "
                                     f"{digest!r}, not sha256:<64 hex digits> (fix or delete "
                                     "that entry)")
        return tags

    def _write_tags(self, tags: dict[str, str]) -> None:
        write_json(self.root / "tags.json", tags)

    def _manifest_file(self, hex_digest: str) -> Path:
        return self.root / "manifests" / f"sha256-{hex_digest}.json"

    def manifest(self, hex_digest: str) -> Manifest | None:
        """Version ``hex_digest``'s manifest; None when it is missing or damaged (no JSON, as
        a file cut short; or JSON that is no manifest): the listing reports those, and
        ``rm`` of a tag pointing to one still drops the tag."""
        try:
            data = read_json(self._manifest_file(hex_digest), None)
            return None if data is None else Manifest.from_json(data, self.root)
        except (DamagedFileError, KeyError, TypeError, ValueError):
            return None

    def manifests(self) -> dict[str, Manifest]:
        """Every version, by hex digest (a manifest edited into nonsense is left out;
        ``entries`` says which)."""
        out = {}
        for file in sorted((self.root / "manifests").glob("sha256-*.json")):
            m = self.manifest(file.stem.removeprefix("sha256-"))
            if m is not None:
                out[m.hex] = m
        return out

    def _damaged(self, manifests: dict[str, Manifest], tags: dict[str, str]) -> list[str]:
        """One line for each tag whose version's manifest is damaged or missing (the tag would
        otherwise vanish from the listing without a word), and for each damaged manifest no
        tag points to."""
        problems = []
        dangling: dict[str, list[str]] = {}
        for key, digest in sorted(tags.items()):
            if digest.removeprefix(DIGEST_PREFIX) not in manifests:
                dangling.setdefault(digest.removeprefix(DIGEST_PREFIX), []).append(key)
        files = {f.stem.removeprefix("sha256-")
                 for f in (self.root / "manifests").glob("sha256-*.json")}
        for hex_digest in sorted((files - manifests.keys()) | dangling.keys()):
            keys = dangling.get(hex_digest, [])
            file = self._manifest_file(hex_digest)
            state = _manifest_state(file)
            said = f"; {', '.join(keys)} point{'s' if len(keys) == 1 else ''} to it" \
                if keys else ""
            fix = f"'justllm rm {keys[0]}' drops the tag" if keys else "delete it"
            problems.append(f"the manifest {file} {state}{said} ({fix}, or tag the file again)")
        return problems

    def entries(self) -> tuple[list[Entry], list[str]]:
        """Every tag with its version, then the untagged versions (oldest first); and the
        files in the models directory that could not be adopted and the damaged manifests, as
        one-line reasons."""
        problems = self.adopt()
        manifests, tags = self.manifests(), self.tags()
        problems += self._damaged(manifests, tags)
        rows = [Entry(key, manifests[d.removeprefix(DIGEST_PREFIX)])
                for key, d in sorted(tags.items()) if d.removeprefix(DIGEST_PREFIX) in manifests]
        tagged = set(tags.values())
        rows += [Entry(None, m) for m in sorted(manifests.values(), key=lambda m: m.added)
                 if m.digest not in tagged]
        return rows, problems

    def labels(self, digest: str) -> list[str]:
        return sorted(k for k, v in self.tags().items() if v == digest)

    def manifest_for_path(self, path: Path) -> Manifest | None:
        """The version whose file ``path`` is (the same file through a link counts)."""
        path = absolute(path)
        found = self._versions_of(path)
        if len(found) > 1:  # the file changed and was registered again: the current bytes win
            current = self.digests.cached(path)
            found.sort(key=lambda m: (m.hex == current, m.added), reverse=True)
        return found[0] if found else None

    def pulled(self, repo: str, file: str) -> Path | None:
        """The checked file of the newest version pulled from ``repo:file`` that is still
        here; None when there is none (then it is to be pulled)."""
        newest = self._newest_pull(repo, file)
        return None if newest is None else self.verify(newest, f"{repo}:{file}").path

    def _newest_pull(self, repo: str, file: str) -> Manifest | None:
        """The version pulled from ``repo:file`` last whose file is here (a tagged one first
        among those pulled at the same time), unchecked; None when there is none."""
        found = [m for m in self.manifests().values()
                 if m.pulled_at(repo, file) is not None and m.path.is_file()]
        if not found:
            return None
        tagged = set(self.tags().values())
        return max(found, key=lambda m: (m.pulled_at(repo, file) or "", m.digest in tagged))

    # -- resolving -------------------------------------------------------------------------

    def resolve(self, ref: str) -> tuple[str, Manifest]:
        """``NAME[:TAG]`` or a digest -> (what it was resolved as, the checked version)."""
        tags = self.tags()
        hex_prefix = parse_digest(ref)
        if hex_prefix is not None and (is_explicit_digest(ref)
                                       or label(ref.strip().lower(), DEFAULT_TAG) not in tags):
            m = self._by_digest(hex_prefix, required=is_explicit_digest(ref))
            if m is not None:
                return m.digest, self.verify(m, m.digest)
        name, tag = parse_ref(ref)
        key = label(name, tag)
        if key not in tags:
            self.adopt(name, raise_for=name)
            tags = self.tags()
        if key not in tags:
            raise self._unknown(key, tags, hex_prefix)
        m = self.manifest(tags[key].removeprefix(DIGEST_PREFIX))
        if m is None:
            file = self._manifest_file(tags[key].removeprefix(DIGEST_PREFIX))
            state = _manifest_state(file)
            raise ModelLoadError(f"{key} points to {tags[key][:19]}, whose manifest {file} "
                                 f"{state} ('justllm rm {key}' drops the tag)")
        return key, self.verify(m, key)

    def listed(self, ref: str) -> Manifest | None:
        """The version a ``NAME[:TAG]`` or a pulled ``REPO:FILE`` names now, for a listing:
        nothing hashed, checked or adopted (a load checks it); None when there is none."""
        from justllm.models.hub import looks_like_repo, split_ref

        if looks_like_repo(ref):
            repo, file = split_ref(ref)
            if file is None:
                return None
            return self._newest_pull(repo, file)  # (as pulled() picks it, unchecked)
        if not could_be_name(ref):
            return None
        try:
            digest = self.tags().get(label(*parse_ref(ref)))
        except InvalidRefError:
            return None
        return None if digest is None else self.manifest(digest.removeprefix(DIGEST_PREFIX))

    def find(self, ref: str) -> Path | None:
        """The model source's face: the checked file of ``ref``, or None when the registry
        does not know the name (a path or a Hugging Face repo is none of its business)."""
        if not could_be_name(ref):
            return None
        try:
            return self.resolve(ref)[1].path
        except (InvalidRefError, UnknownModelError):
            return None

    def verify(self, m: Manifest, what: str) -> Manifest:
        """``m``, its file checked to be still the version's bytes (hashed again only if its
        size or mtime moved). A file gone or changed: the version moved to a copy that still
        holds them (``justllm tag COPY NAME``), or a ModelLoadError."""
        there = m.path.is_file()
        now_hex = self.digests.digest(m.path) if there else None
        if now_hex == m.hex:
            return m
        moved = self._move_to_copy(m)
        if moved is not None:
            return moved
        if now_hex is None:
            raise ModelLoadError(f"{what}: its file {m.path} is missing "
                                 f"('justllm rm {what}' forgets it)")
        raise ModelLoadError(
            f"digest mismatch: {m.path} changed on disk since it was registered as {what} "
            f"(sha256 now {now_hex[:12]}, registered {m.short}); "
            f"{self._retag_hint(m, what)}")

    def _retag_hint(self, m: Manifest, what: str) -> str:
        """A ``justllm tag FILE NAME`` that works: with the tag ``what`` is, or the tags on
        the version; never a digest (a digest is no name)."""
        tags = self.tags()
        names = [what] if what in tags else sorted(k for k, v in tags.items() if v == m.digest)
        if not names:
            return f"'justllm tag {m.path} NAME' registers the new content as NAME"
        others = f" (then the same for {', '.join(names[1:])})" if len(names) > 1 else ""
        return f"'justllm tag {m.path} {names[0]}' registers the new content{others}"

    def _by_digest(self, hex_prefix: str, *, required: bool) -> Manifest | None:
        found = [m for h, m in self.manifests().items() if h.startswith(hex_prefix)]
        if len(found) > 1:
            raise ModelLoadError(f"sha256:{hex_prefix} is ambiguous: {len(found)} versions start "
                                 "with it; give more of the digest")
        if not found and required:
            raise ModelLoadError(f"no version sha256:{hex_prefix} (see 'justllm models')")
        return found[0] if found else None

    def _unknown(self, key: str, tags: dict[str, str],
                 hex_prefix: str | None = None) -> ModelLoadError:
        """No tag ``key``; ``hex_prefix``: the bare hex it also read as, which no version's
        digest starts with either (both readings are said: 12 hex digits are how ``justllm
        models`` shows a digest)."""
        name = key.partition(":")[0]
        same = sorted(k.partition(":")[2] for k in tags if k.partition(":")[0] == name)
        nor = f" and no version sha256:{hex_prefix}" if hex_prefix else ""
        if same:
            return ModelLoadError(f"no model named '{key}'{nor} ({name} has tags: "
                                  f"{', '.join(same)})")
        return UnknownModelError(f"no model named '{key}'{nor} (see 'justllm models')")

    # -- registering -----------------------------------------------------------------------

    def register(self, path: Path, source: Source, *, expected: str | None = None) -> Manifest:
        """The version of the GGUF at ``path``: its existing manifest when those bytes are
        registered already and their file still holds them; the same version moved here when
        that file is gone or changed (a file moved by hand keeps where it came from); else a
        new one. A corrupt or truncated GGUF, or (``expected``: the sha256 hex the file must
        have) other bytes than expected, are refused before anything is written: the bytes
        first, so a download corrupted in its header says so rather than "not a GGUF"."""
        from justllm.models.store import quantization_name

        path = absolute(path)
        if expected is not None and (found := self.digests.digest(path)) != expected:
            raise DigestMismatchError(path, found, expected)
        header = read_gguf_header(path)
        hex_digest = self.digests.digest(path)  # (remembered: hashed once)
        with self._locked():
            old = self.manifest(hex_digest)
            if old is not None and self.digests.cached(old.path) == hex_digest:
                # another file of these bytes (two quantizations alike, a copy dropped in):
                # the version knows it, so removing the version removes it too (left out, it
                # stayed on disk unlisted, and came back as a model once the version went)
                return self._with_copy(old, path)
            if old is not None:
                moved = replace(old, path=path, source=_source_after_move(old.source, source),
                                copies=_without(old.copies, path, self.root))
                write_json(self._manifest_file(hex_digest), moved.to_json(self.root))
                return moved
            arch = header.architecture
            m = Manifest(digest=DIGEST_PREFIX + hex_digest, path=path,
                         size=path.stat().st_size, architecture=arch,
                         quantization=quantization_name(header.integer("general.file_type")),
                         context_length=header.integer(f"{arch}.context_length"),
                         source=source, added=now())
            write_json(self._manifest_file(hex_digest), m.to_json(self.root))
            return m

    def adopt(self, name: str | None = None, *, raise_for: str | None = None) -> list[str]:
        """Give the GGUF files in the models directory that no manifest names (all of them,
        or those whose name would be ``name``) a version and the tag ``stem:latest`` if that
        tag is free. A file that is not a usable GGUF is skipped, with its reason returned,
        or raised when its name is ``raise_for``."""
        from justllm.models.store import ModelStore

        manifests = self.manifests()
        known = {stored_path(m.path, self.root) for m in manifests.values()}
        problems = []
        for path in ModelStore(self.root).paths():
            file_name = name_for_file(path.stem)
            if (name is not None and file_name != name) or stored_path(path, self.root) in known:
                continue
            if self.digests.cached(path) in manifests:
                continue  # a copy of a registered version, seen before
            try:
                m = self.register(path, Source("file"))
            except ModelLoadError as e:
                if file_name == raise_for:
                    raise ModelLoadError(f"cannot use {file_name}: {e}") from None
                problems.append(str(e))
                continue
            with self._locked():
                tags = self.tags()
                key = label(file_name, DEFAULT_TAG)
                if key not in tags:
                    tags[key] = m.digest
                    self._write_tags(tags)
        return problems

    def tag(self, source: str, target: str) -> tuple[str, Manifest, Manifest | None]:
        """Point ``target`` (``NAME[:TAG]``) at ``source``: a GGUF file (registered as it is,
        where it is), a tag or a digest. Returns the tag, its version and the version it
        pointed to before, if another."""
        key = label(*new_ref(target))
        path = Path(source).expanduser()
        if path.is_dir():
            raise ModelLoadError(f"{source} is a directory; pass a path to a .gguf file")
        if path.is_file():
            m = self._with_copy(self.register(path, Source("file")), path)
        elif could_be_name(source) and not source.lower().endswith(".gguf"):
            m = self.resolve(source)[1]
        else:
            raise ModelLoadError(f"model file not found: {source} (SOURCE is a path to a .gguf "
                                 "file, NAME[:TAG] or a digest)")
        return key, m, self._point(key, m)

    def rewritten(self, path: Path, source: Source) -> Rewritten | None:
        """The file at ``path`` was just overwritten (``--force``): register its new bytes and
        drop the versions that named it with the old ones (their bytes are gone; left, they
        would list the old digest, size and type and fail every use with a digest mismatch),
        moving their tags to the new version. None when no version named the file."""
        path = absolute(path)
        if not self._versions_of(path):
            return None  # (and no lock file made where there is no registry)
        with self._locked():
            old = self._versions_of(path)
            m = self.register(path, source)
            # A version this file was only a copy of keeps its own file: it forgets the copy.
            copied = [o for o in old if o.hex != m.hex and not _names(o.path, path, self.root)]
            for o in copied:
                write_json(self._manifest_file(o.hex), replace(
                    o, copies=_without(o.copies, path, self.root)).to_json(self.root))
            stale = [o for o in old if o.hex != m.hex and o not in copied]
            tags = self.tags()
            moved = tuple(sorted(k for k, v in tags.items()
                                 if v in {o.digest for o in stale}))
            for k in moved:
                tags[k] = m.digest
            self._write_tags(tags)
            for o in stale:
                self._manifest_file(o.hex).unlink(missing_ok=True)
            return Rewritten(m, tuple(stale), moved)

    def _versions_of(self, path: Path) -> list[Manifest]:
        """Every version whose file, or one of whose copies, is ``path`` (by its recorded path,
        or through a link)."""
        return [m for m in self.manifests().values()
                if any(_names(f, path, self.root) for f in m.files)]

    def _with_copy(self, m: Manifest, path: Path) -> Manifest:
        """Version ``m`` with ``path`` among its copies when ``path`` is not its file: ``tag
        FILE NAME`` of bytes registered at another path names that version, and the tag must
        not break while FILE holds them (moving the other file broke it)."""
        path = absolute(path)
        if any(_names(f, path, self.root) for f in m.files):
            return m
        with self._locked():
            m = self.manifest(m.hex) or m
            # (copies gone since are forgotten: the list does not grow without end)
            kept = tuple(c for c in m.copies if c.is_file())
            m = replace(m, copies=(*kept, path))
            write_json(self._manifest_file(m.hex), m.to_json(self.root))
        return m

    def _move_to_copy(self, m: Manifest) -> Manifest | None:
        """Version ``m`` moved to the first of its copies that still holds its bytes (its own
        file is gone or changed); None when none does."""
        for copy in m.copies:
            if copy.is_file() and self.digests.digest(copy) == m.hex:
                with self._locked():  # (as it is now: another process may have moved it)
                    m = self.manifest(m.hex) or m
                    moved = replace(m, path=copy, copies=_without(m.copies, copy, self.root))
                    write_json(self._manifest_file(m.hex), moved.to_json(self.root))
                return moved
        return None

    def _point(self, key: str, m: Manifest) -> Manifest | None:
        with self._locked():
            tags = self.tags()
            before = tags.get(key)
            tags[key] = m.digest
            self._write_tags(tags)
        if before is None or before == m.digest:
            return None
        return self.manifest(before.removeprefix(DIGEST_PREFIX))

    def pull(self, ref: str, *, tag: str | None = None, revision: str = "main",
             force: bool = False, console: Console | None = None) -> Pulled:
        """Download ``REPO[:FILE]`` (unless a version with the hub's sha256 for it is here),
        record it with the commit it resolved to, and point ``tag`` (default: the file's stem,
        lowercased, ``:latest``) at it; the version the tag pointed to before is kept."""
        from justllm.models import hub

        # (an empty --tag, say from an empty shell variable, is no name: refused, not taken
        # for no --tag at all)
        target = label(*new_ref(tag)) if tag is not None else None
        got = hub.download(ref, root=self.root, revision=revision, force=force,
                           have=self._intact, console=console)
        reused = self.manifest(got.sha256) if got.reused and got.sha256 else None
        m = self._with_origin(reused or self._register_download(got), got)
        key = target or label(name_for_file(Path(got.file).stem), DEFAULT_TAG)
        return Pulled(key, m, self._point(key, m), got)

    def _with_origin(self, m: Manifest, got: Download) -> Manifest:
        """Version ``m`` with the hub file ``got`` came from among its origins, when it is not
        the version pulled from that file last already: a mirror's pull of bytes already here
        (``REPO:FILE`` finds it offline as its source's does), or its own file pulled again
        after another version of it (``--revision`` an older commit: ``REPO:FILE`` named the
        newer version still). One origin per hub file: a later pull updates it."""
        with self._locked():
            m = self.manifest(m.hex) or m
            if self._newest_pull(got.repo, got.file) == m:
                return m  # (a fresh download, or pulled from there last: nothing new)
            others = tuple(o for o in m.origins if (o.repo, o.file) != (got.repo, got.file))
            m = replace(m, origins=(*others, Origin(got.repo, got.file, got.revision, now())))
            write_json(self._manifest_file(m.hex), m.to_json(self.root))
        return m

    def _intact(self, hex_digest: str) -> Path | None:
        """The file of version ``hex_digest`` if it is here and unchanged (a file not adopted
        yet, such as one pulled before there was a registry, counts)."""
        m = self.manifest(hex_digest)
        if m is None:
            self.adopt()
            m = self.manifest(hex_digest)
        if m is None or self.digests.cached(m.path) != hex_digest:
            return None
        return m.path

    def _register_download(self, got: Download) -> Manifest:
        from justllm.models import hub

        source = Source("huggingface", got.repo, got.file, got.revision)
        try:
            m = self.register(got.path, source, expected=got.sha256)
        except DigestMismatchError as e:
            # (deleted even when a version names that path, as after --force: its bytes are
            # gone already; only a version of these very bytes keeps the file)
            if all(v.hex != e.found for v in self._versions_of(got.path)):
                hub.remove_download(got.path, self.root)
            raise ModelLoadError(
                f"digest mismatch: {got.repo}:{got.file} downloaded with sha256:{e.found[:12]}, "
                f"but the hub lists sha256:{e.expected[:12]} (the download is deleted and "
                "nothing is registered: pull it again)") from None
        except ModelLoadError as e:
            adapter = _is_adapter(got.path)
            if self.manifest_for_path(got.path) is None:
                hub.remove_download(got.path, self.root)
            if adapter:  # (the adapter's "use --lora NAME=PATH" named the file just deleted)
                raise ModelLoadError(
                    f"cannot use {got.repo}:{got.file}: it is a LoRA adapter, not a model, and "
                    "the registry keeps models only (the download is deleted); download it "
                    f"yourself (hf download {got.repo} {got.file}) and load it with --lora "
                    "NAME=PATH") from None
            raise ModelLoadError(f"cannot use {got.repo}:{got.file} (the download is deleted): "
                                 f"{e}") from None
        if stored_path(m.path, self.root) != stored_path(got.path, self.root):
            hub.remove_download(got.path, self.root)  # the same bytes are here already
        return m

    # -- removing and leases ---------------------------------------------------------------

    def remove(self, ref: str) -> Removal:
        """``NAME[:TAG]``: drop the tag, and its version with it when no other tag points
        there. A digest: drop the version and every tag on it. A version's file goes too when
        it lives in the models directory and no other version names it. A version a running
        model holds (a live lease) is refused, and then nothing changes."""
        with self._locked():
            tags = self.tags()
            m, what, untag = self._removal_target(ref, tags)
            digest = tags.get(untag[0]) if m is None else m.digest
            others = tuple(sorted(k for k, v in tags.items() if v == digest and k not in untag))
            if m is None or others:  # the version stays (or, a tag to nothing, never was)
                for k in untag:
                    del tags[k]
                self._write_tags(tags)
                return Removal(what, m, tuple(untag), others, None, None)
            pids = self._holders(m)
            if pids:
                raise ModelLoadError(
                    f"cannot remove {what}: its version sha256:{m.short} is in use by a running "
                    f"model (pid {', '.join(map(str, pids))}); stop that model first")
            for k in untag:
                del tags[k]
            self._write_tags(tags)
            self._manifest_file(m.hex).unlink(missing_ok=True)
            return Removal(what, m, tuple(untag), (), *self._remove_file(m))

    def _removal_target(self, ref: str,
                        tags: dict[str, str]) -> tuple[Manifest | None, str, list[str]]:
        literal = ref.strip().lower()
        if is_explicit_digest(ref) and literal in tags:
            # A tag made before names that read as digests were refused (the listing shows it
            # as a NAME): remove that tag, never the version the digest would name.
            return self.manifest(tags[literal].removeprefix(DIGEST_PREFIX)), literal, [literal]
        hex_prefix = parse_digest(ref)
        if hex_prefix is not None and (is_explicit_digest(ref)
                                       or label(ref.strip().lower(), DEFAULT_TAG) not in tags):
            m = self._by_digest(hex_prefix, required=is_explicit_digest(ref))
            if m is not None:
                return m, m.digest, sorted(k for k, v in tags.items() if v == m.digest)
        key = label(*parse_ref(ref))
        if key not in tags:
            self.adopt(key.partition(":")[0], raise_for=key.partition(":")[0])
            tags.clear()
            tags.update(self.tags())
        if key not in tags:
            raise self._unknown(key, tags, hex_prefix)
        return self.manifest(tags[key].removeprefix(DIGEST_PREFIX)), key, [key]

    def _remove_file(self, m: Manifest) -> tuple[Path | None, Path | None, str | None]:
        """(deleted, kept, why kept): the version's file goes when it lives in the models
        directory and no other version names it; so do its copies there (files of the same
        bytes it knows of), which the models directory would otherwise adopt again."""
        for copy in m.copies:
            if (copy != m.path and is_inside(copy, self.root) and copy.is_file()
                    and self.manifest_for_path(copy) is None
                    and self.digests.digest(copy) == m.hex):
                with contextlib.suppress(OSError):
                    remove_file(copy)
        if not (m.path.is_file() or m.path.is_symlink()):
            return None, None, None
        if not is_inside(m.path, self.root):
            return None, m.path, "outside the models directory"
        if self.manifest_for_path(m.path) is not None:
            return None, m.path, "another version names it"
        from justllm.models import hub

        try:
            if is_inside(m.path, self.root / HUB_DIR):
                hub.remove_download(m.path, self.root)
            else:
                remove_file(m.path)
        except OSError as e:
            raise ModelLoadError(f"removed {m.digest[:19]} but could not delete {m.path}: "
                                 f"{e.strerror or e}") from None
        return m.path, None, None

    @contextlib.contextmanager
    def lease(self, digest: str) -> Iterator[None]:
        """Hold version ``digest`` for as long as the block runs: ``rm`` refuses it meanwhile."""
        hex_digest = digest.removeprefix(DIGEST_PREFIX)
        with self._locked():
            if self.manifest(hex_digest) is None:
                raise ModelLoadError(f"no version sha256:{hex_digest[:12]} to hold")
            held = acquire_lease(self.root, hex_digest)
        try:
            yield
        finally:
            held.release()

    def check_overwritable(self, path: Path) -> None:
        """ModelLoadError when a running model holds a version of the file at ``path``, which
        ``--force`` would overwrite (``rm`` refuses the same)."""
        for m in self._versions_of(absolute(path)):
            pids = self._holders(m)
            if pids:
                raise ModelLoadError(
                    f"cannot overwrite {path}: its version sha256:{m.short} is in use by a "
                    f"running model (pid {', '.join(map(str, pids))}); stop that model first, "
                    "or write elsewhere (-o)")

    def in_use(self, digest: str) -> list[int]:
        """The pids of the running processes that hold version ``digest`` (or its file)."""
        hex_digest = digest.removeprefix(DIGEST_PREFIX)
        m = self.manifest(hex_digest)
        return holders(self.root, hex_digest) if m is None else self._holders(m)

    def _holders(self, m: Manifest) -> list[int]:
        """The pids that hold version ``m``: by its digest, or by its file (a model served
        from the models directory before the file was registered)."""
        return sorted(set(holders(self.root, m.hex)) | set(holders(self.root, _path_key(m.path))))


def file_digest(path: str | Path) -> str:
    """A model file's sha256: the registry's remembered one while the file is unchanged, else
    hashed now (seconds for a large GGUF: call it off the event loop and the engine thread)."""
    p = Path(path)
    return Registry().digests.cached(p) or sha256_file(p)


@contextlib.contextmanager
def lease_for_path(path: str | Path, root: Path | None = None) -> Iterator[str | None]:
    """Hold the model file ``path`` while the block runs (``serve``, ``run`` and ``chat`` wrap
    the model's whole life in this), so ``justllm rm`` refuses to delete it: a lease on its
    registered version, and, for a file in the models directory (or a link to one), a lease
    on the file itself, which holds it even when it is registered only later (adopted by a
    ``justllm models`` while it is served: it was deleted by the ``rm`` after). Yields the
    version's digest, or None when no version names the file yet."""
    registry = Registry(root)
    p = absolute(path)
    inside = is_inside(p, registry.root) or is_inside(Path(os.path.realpath(p)), registry.root)
    if not inside and registry.manifest_for_path(p) is None:
        yield None  # outside the models directory and unregistered: nothing to protect
        return
    held: list[Lease] = []
    try:
        try:
            with registry._locked():  # as rm checks: no lease appears between check and delete
                m = registry.manifest_for_path(p)
                if inside:
                    held.append(acquire_lease(registry.root, _path_key(p)))
                if m is not None:
                    held.append(acquire_lease(registry.root, m.hex))
        except (OSError, ModelLoadError) as e:
            if registry.manifest_for_path(p) is not None:
                if isinstance(e, OSError):
                    raise ModelLoadError(f"cannot hold {p} against 'justllm rm' (a lease in "
                                         f"{registry.root / 'leases'}): {e.strerror or e}"
                                         ) from None
                raise
            # An unregistered file in a models directory this process cannot write (a shared,
            # read-only one), as before: its rm could not delete there either.
            m = None
        yield None if m is None else m.digest
    finally:
        for lease in held:
            lease.release()


def _path_key(path: Path) -> str:
    """A lease's key for a model file by where it really is (links followed): ``path-`` and
    the sha256 of its real path (no dot: lease files are ``KEY.PID.N``)."""
    real = os.path.realpath(absolute(path))
    return "path-" + hashlib.sha256(os.fsencode(real)).hexdigest()


def _source_after_move(was: Source, now_from: Source) -> Source:
    """The source of a version whose file had gone and that is registered again from
    ``now_from``: a pull's (the version downloaded again), unless the version was pulled from
    another hub file, which stays its source (the pull records the new one among its
    origins); a file moved by hand keeps where it came from."""
    if now_from.kind != "huggingface":
        return was
    other_hub_file = was.kind == "huggingface" and (was.repo, was.file) != (now_from.repo,
                                                                             now_from.file)
    return was if other_hub_file else now_from


def _is_adapter(path: Path) -> bool:
    """Whether ``path`` is a readable LoRA adapter GGUF."""
    try:
        return read_gguf_header(path, adapter=True).metadata.get("general.type") == ADAPTER_TYPE
    except ModelLoadError:
        return False


def _names(recorded: Path, path: Path, root: Path) -> bool:
    """Whether the file a manifest recorded is ``path`` (the same stored path, or a link)."""
    return stored_path(recorded, root) == stored_path(path, root) or same_file(recorded, path)


def _without(paths: tuple[Path, ...], path: Path, root: Path) -> tuple[Path, ...]:
    return tuple(p for p in paths if not _names(p, path, root))


def same_file(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` are one file (False where either is missing)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
