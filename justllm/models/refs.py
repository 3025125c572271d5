"""How a registry model is named: ``NAME[:TAG]`` or a digest (pure: no files, no I/O).

A name never holds ``/``: ``owner/repo:file.gguf`` is a Hugging Face ``REPO[:FILE]`` and
``name:tag`` a registry name, so the colon means one thing or the other by the slash alone.
Names and tags are lowercased (``Qwen:Q4`` and ``qwen:q4`` are one model). A digest is
``sha256:<hex>``, or a bare hex prefix of at least 12 characters when no model has that name.
So a new name may not read as a digest (``new_ref``): a tag ``sha256:0b6d7a9d554b`` would be
listed like a name but resolved, and removed, as another model's digest.
"""

from __future__ import annotations

import re

from justllm.errors import ModelLoadError

DEFAULT_TAG = "latest"
DIGEST_PREFIX = "sha256:"
MIN_DIGEST_CHARS = 12

_PART_MOST = 128
_PART = re.compile(rf"[a-z0-9][a-z0-9._-]{{0,{_PART_MOST - 1}}}")
_HEX = re.compile(rf"[0-9a-f]{{{MIN_DIGEST_CHARS},64}}")
_NOT_NAME = re.compile(r"[^a-z0-9._-]+")


class InvalidRefError(ModelLoadError):
    """The text is not ``NAME[:TAG]`` (it may still be a path or a Hugging Face repo)."""


def parse_ref(ref: str) -> tuple[str, str]:
    """``NAME[:TAG]`` -> ``(name, tag)``, lowercased; the tag is ``latest`` when not given."""
    name, sep, tag = ref.strip().lower().partition(":")
    if not sep:
        tag = DEFAULT_TAG
    if not _PART.fullmatch(name) or not _PART.fullmatch(tag):
        raise InvalidRefError(f"'{ref}' is not a model name (NAME[:TAG]: letters, digits, '.', "
                              "'_' and '-', starting with a letter or a digit, at most "
                              f"{_PART_MOST} characters each)")
    return name, tag


def new_ref(ref: str) -> tuple[str, str]:
    """``parse_ref`` for a name about to be made (``tag``, ``pull --tag``, ``convert --name``):
    a name that would read as a digest is refused, since the digest would win over it."""
    name, tag = parse_ref(ref)
    if reads_as_digest(name):
        raise InvalidRefError(f"'{ref}' cannot be a model name: it reads as a digest "
                              f"({DIGEST_PREFIX}<hex>, or {MIN_DIGEST_CHARS} to 64 hex digits, "
                              "names a version); pick a name with other letters")
    return name, tag


def reads_as_digest(name: str) -> bool:
    """Whether ``name`` (a NAME without its tag) would be taken for a digest: ``sha256`` (the
    start of ``sha256:<hex>``) or a bare hex prefix."""
    return name == DIGEST_PREFIX.rstrip(":") or _HEX.fullmatch(name) is not None


def label(name: str, tag: str) -> str:
    return f"{name}:{tag}"


def parse_digest(ref: str) -> str | None:
    """``sha256:<hex>`` or a bare hex prefix (12 to 64 characters) -> the hex; None when ``ref``
    is not a digest. ``sha256:`` with anything else after it is an error."""
    text = ref.strip().lower()
    hex_part = text.removeprefix(DIGEST_PREFIX)
    if _HEX.fullmatch(hex_part):
        return hex_part
    if text.startswith(DIGEST_PREFIX):
        raise InvalidRefError(f"'{ref}' is not a digest (sha256: and at least "
                              f"{MIN_DIGEST_CHARS} hex characters)")
    return None


def is_explicit_digest(ref: str) -> bool:
    return ref.strip().lower().startswith(DIGEST_PREFIX)


def could_be_name(ref: str) -> bool:
    """False for what only a path or a Hugging Face repo can be (a ``/`` or ``\\``)."""
    return "/" not in ref and "\\" not in ref


def name_for_file(stem: str) -> str:
    """The name a GGUF file gets in the registry: its stem lowercased, every run of characters
    a name cannot hold turned into ``-`` (``Qwen2.5 Coder+Q4`` -> ``qwen2.5-coder-q4``); a stem
    that would read as a digest (``0b6d7a9d554b``, ``sha256``) gets ``model-`` before it."""
    name = _NOT_NAME.sub("-", stem.lower()).lstrip("._-")[:128].rstrip("-")
    if reads_as_digest(name):
        return f"model-{name}"
    return name or "model"
