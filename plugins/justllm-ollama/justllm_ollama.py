"""justllm-ollama: serve the models Ollama has already pulled, without downloading them again.

``ollama:NAME`` (``justllm run ollama:llama3.2``, ``serve``, ``source:`` in a models.yaml) is
read from Ollama's own store: ``manifests/<host>/<namespace>/<model>/<tag>`` is a JSON manifest
whose layer of media type ``application/vnd.ollama.image.model`` names the GGUF by digest, and
that file is ``blobs/sha256-<hex>``. Nothing is copied and nothing is written: the blob is handed
to llama.cpp where Ollama keeps it.

Everything is read at call time (the environment included), so the module holds no state but
the hook implementation its entry point registers.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from justllm.errors import ModelLoadError
from justllm.plugins import hookimpl

if TYPE_CHECKING:
    from justllm.models.source import ListedModel

log = logging.getLogger("justllm.plugins.ollama")

PREFIX = "ollama:"
DEFAULT_HOST = "registry.ollama.ai"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"
MODEL_MEDIA_TYPE = "application/vnd.ollama.image.model"
ADAPTER_MEDIA_TYPE = "application/vnd.ollama.image.adapter"
PROJECTOR_MEDIA_TYPE = "application/vnd.ollama.image.projector"
# Where the Linux install script's systemd service (user ``ollama``) keeps its models: tried
# when the user's own directory does not exist, so a stock Linux install is found as is.
SERVICE_MODELS_DIR = Path("/usr/share/ollama/.ollama/models")

# A name part never starts with a dot (so never ``..``) and holds no separator: a reference
# cannot reach outside the manifests directory. The host may carry a port (``host:5000``).
_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_HOST = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]*")
_DIGEST = re.compile(r"sha256[:-]([0-9a-fA-F]{64})")


@dataclass(frozen=True)
class OllamaName:
    """A fully qualified Ollama model name: Ollama fills in what a short name leaves out
    (``llama3.2`` is ``registry.ollama.ai/library/llama3.2:latest``), and so must we to find
    the same manifest file."""

    host: str
    namespace: str
    model: str
    tag: str

    @classmethod
    def parse(cls, text: str) -> OllamaName:
        """``model``, ``model:tag``, ``ns/model[:tag]`` or ``host/ns/model[:tag]`` (an
        ``http(s)://`` in front is dropped, as Ollama does)."""
        bare = re.sub(r"^https?://", "", text.strip())
        if "@" in bare:
            raise ModelLoadError(f"ollama:{text}: digest references (@sha256-...) are not "
                                 "supported; name the model as NAME[:TAG]")
        path, tag = bare, DEFAULT_TAG
        if bare.rfind(":") > bare.rfind("/"):  # a colon before the last slash is a port
            path, tag = bare.rsplit(":", 1)
        parts = path.split("/")
        if len(parts) > 3:
            raise ModelLoadError(f"ollama:{text}: not an Ollama model name (at most "
                                 "HOST/NAMESPACE/MODEL[:TAG])")
        host, namespace, model = [DEFAULT_HOST, DEFAULT_NAMESPACE][:3 - len(parts)] + parts
        ok = (_HOST.fullmatch(host) and _PART.fullmatch(namespace) and _PART.fullmatch(model)
              and _PART.fullmatch(tag))
        if not ok:
            raise ModelLoadError(f"ollama:{text}: not an Ollama model name (letters, digits, "
                                 "'_', '.' and '-' in [HOST/][NAMESPACE/]MODEL[:TAG])")
        return cls(host, namespace, model, tag)

    @property
    def parts(self) -> tuple[str, str, str, str]:
        """The manifest's path below ``manifests/``, one directory per part."""
        return self.host, self.namespace, self.model, self.tag

    @property
    def short(self) -> str:
        """How Ollama displays the name (``ollama list``): default host and namespace left
        out, the tag always shown."""
        if self.host.lower() != DEFAULT_HOST:
            return f"{self.host}/{self.namespace}/{self.model}:{self.tag}"
        if self.namespace.lower() != DEFAULT_NAMESPACE:
            return f"{self.namespace}/{self.model}:{self.tag}"
        return f"{self.model}:{self.tag}"


def models_dirs(environ: Mapping[str, str] | None = None) -> list[Path]:
    """The directories Ollama may keep its models in, in the order they are tried:
    ``$OLLAMA_MODELS`` alone when set (trimmed of blanks and quotes as Ollama trims it),
    otherwise ``~/.ollama/models`` then the Linux service's ``SERVICE_MODELS_DIR``."""
    environ = os.environ if environ is None else environ
    configured = environ.get("OLLAMA_MODELS", "").strip().strip("\"'")
    if configured:
        return [Path(configured).expanduser()]
    return [Path("~/.ollama/models").expanduser(), SERVICE_MODELS_DIR]


def models_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The first of ``models_dirs`` that exists (the first one when none does, for messages).
    One that cannot be looked at (the Linux service's, in a home only the ``ollama`` user and
    group may enter) counts as there: reading it then says why it cannot be read."""
    candidates = models_dirs(environ)
    return next((d for d in candidates if _is_dir_or_hidden(d)), candidates[0])


def _is_dir_or_hidden(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:  # (pathlib raises EACCES, where it answers False for ENOENT)
        return True


def _lookup(root: Path, parts: tuple[str, ...]) -> Path | None:
    """``root/parts...`` as a file, matching each part without regard to case when the exact
    spelling is not there: Ollama treats ``Llama3.2`` and ``llama3.2`` as one name, and some
    of its versions wrote manifests in lower case."""
    here = root
    for i, part in enumerate(parts):
        exact = here / part
        last = i == len(parts) - 1
        if exact.is_file() if last else exact.is_dir():
            here = exact
            continue
        try:
            entries = list(here.iterdir())
        except OSError:
            return None
        folded = part.casefold()
        match = next((e for e in entries if e.name.casefold() == folded
                      and (e.is_file() if last else e.is_dir())), None)
        if match is None:
            return None
        here = match
    return here


def _layers(manifest: Path) -> list[dict]:
    """The manifest's layers (those that are JSON objects)."""
    try:
        data = json.loads(manifest.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"Ollama manifest {manifest} is unreadable: {e}") from None
    layers = data.get("layers") if isinstance(data, dict) else None
    return [layer for layer in layers if isinstance(layer, dict)] \
        if isinstance(layers, list) else []


def _model_digest(manifest: Path, layers: list[dict] | None = None) -> str | None:
    """The hex digest of the manifest's model layer (the first one; Ollama merges split GGUFs
    into one), or None when it has none, as a cloud model's manifest does not."""
    for layer in _layers(manifest) if layers is None else layers:
        if layer.get("mediaType") == MODEL_MEDIA_TYPE:
            match = _DIGEST.fullmatch(str(layer.get("digest", "")))
            if match is None:
                raise ModelLoadError(f"Ollama manifest {manifest}: its model layer has no "
                                     f"sha256 digest ({layer.get('digest')!r})")
            return match.group(1).lower()
    return None


def _unused(root: Path, layers: list[dict]) -> list[str]:
    """What of the model Ollama would run that justllm does not: its adapter (the answers are
    the base model's) and its vision projector. (Its template, system prompt and parameters
    are left out too, as the README says: the GGUF's own chat template stands in for them.)"""
    said = []
    for layer in layers:
        if layer.get("mediaType") == ADAPTER_MEDIA_TYPE:
            match = _DIGEST.fullmatch(str(layer.get("digest", "")))
            where = f" --lora NAME={_blob(root, match.group(1).lower())}" if match else ""
            said.append(f"its adapter is not applied, so the answers are the base model's "
                        f"(load it with{where or ' --lora'})")
    if any(layer.get("mediaType") == PROJECTOR_MEDIA_TYPE for layer in layers):
        said.append("its vision projector is not used (text only)")
    return said


def _blob(root: Path, hex_digest: str) -> Path:
    return root / "blobs" / f"sha256-{hex_digest}"


class OllamaSource:
    """The ``ollama:`` model source. A reference with that prefix is this source's alone: one
    it cannot serve is an error naming why, never passed on to the next source (which would
    only say "model not found" or, worse, try to download ``ollama`` from a registry)."""

    name = "ollama"

    def find(self, ref: str) -> Path | None:
        """The GGUF blob of ``ollama:NAME``; None for a reference without the prefix. The
        blob's sha256 is not checked (Ollama checked it at pull; hashing gigabytes on every
        start is what this plugin saves), only that it is a GGUF."""
        if not ref.startswith(PREFIX):
            return None
        text = ref[len(PREFIX):]
        if not text.strip():
            raise ModelLoadError("ollama: needs a model name, e.g. ollama:llama3.2")
        name = OllamaName.parse(text)
        try:
            return self._find(name, text)
        except OSError as e:  # a directory or file of the store this user may not read
            hint = (" (Ollama's Linux service keeps its models as the 'ollama' user: join its "
                    "group, or set OLLAMA_MODELS)" if isinstance(e, PermissionError) else "")
            raise ModelLoadError(f"ollama model {name.short}: cannot read "
                                 f"{e.filename or models_dir()}: {e.strerror or e}{hint}"
                                 ) from None

    def _find(self, name: OllamaName, text: str) -> Path:
        root = models_dir()
        pull = f"ollama pull {text}"
        if not root.is_dir():
            looked = " or ".join(str(d) for d in models_dirs())
            raise ModelLoadError(f"ollama model {name.short} not found: no Ollama models "
                                 f"directory at {looked} (set OLLAMA_MODELS, or {pull})")
        manifest = _lookup(root / "manifests", name.parts)
        if manifest is None:
            raise ModelLoadError(f"ollama model {name.short} not found in {root} (no manifest "
                                 f"manifests/{'/'.join(name.parts)}); pull it with: {pull}")
        layers = _layers(manifest)
        digest = _model_digest(manifest, layers)
        if digest is None:
            raise ModelLoadError(f"ollama model {name.short} has no local model layer "
                                 f"({manifest}): a cloud model or not a GGUF model, which "
                                 "justllm cannot serve")
        blob = _blob(root, digest)
        if not blob.is_file():
            raise ModelLoadError(f"ollama model {name.short}: its model blob {blob} is missing "
                                 f"(pull it again with: {pull})")
        from justllm.models.gguf import GGUF_MAGIC, check_gguf_file

        with blob.open("rb") as f:  # (an OSError: find's message)
            magic = f.read(len(GGUF_MAGIC))
        if magic != GGUF_MAGIC:
            raise ModelLoadError(f"ollama model {name.short}: its model blob {blob} is not a "
                                 "GGUF file, which justllm (llama.cpp) cannot load")
        try:
            check_gguf_file(blob)
        except ModelLoadError as e:  # (a LoRA adapter as the model layer)
            raise ModelLoadError(f"ollama model {name.short}: {e}") from None
        for line in _unused(root, layers):  # not silently: it answers unlike `ollama run`
            log.warning("ollama model %s: %s", name.short, line)
        return blob

    def served_name(self, ref: str) -> str | None:
        """``justllm serve ollama:NAME`` answers to ``NAME`` as written (what an Ollama or
        OpenAI client sends; the blanks around it left out, as the name is read), not to the
        blob's ``sha256-...`` file name."""
        name = ref[len(PREFIX):].strip() if ref.startswith(PREFIX) else ""
        return name or None

    def models(self) -> list[ListedModel]:
        """Every pulled model with a local model layer, as ``ollama:NAME:TAG`` (``justllm
        models``). A manifest that cannot be read or has no model layer is left out, as Ollama
        leaves out what it cannot parse; a missing blob is listed (its row says so)."""
        from justllm.models.source import ListedModel

        root = models_dir()
        manifests = root / "manifests"
        if not manifests.is_dir():
            return []
        listed = []
        for path in sorted(manifests.glob("*/*/*/*")):
            if not path.is_file():
                continue
            name = OllamaName(*path.relative_to(manifests).parts)
            try:
                digest = _model_digest(path)
            except ModelLoadError:
                continue
            if digest is not None:
                listed.append(ListedModel(PREFIX + name.short, _blob(root, digest)))
        return sorted(listed, key=lambda m: m.name)


@hookimpl
def register_model_sources(register: Callable[..., None]) -> None:
    """Before the registry (200), so ``ollama:NAME`` never reaches the registry's
    ``NAME:TAG`` parsing; after a path (100), so an existing file still wins."""
    register(OllamaSource(), priority=150)
