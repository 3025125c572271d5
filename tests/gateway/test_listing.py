"""What router mode's Ollama listings (``/api/tags``, ``/api/ps``) say of a model, by its
source: a path, a registry name or a pulled ``REPO:FILE`` (read off the registry, nothing
hashed or downloaded), or nothing here. The gateway's own function, on a temporary registry
holding the demo model (linked, never copied)."""

from __future__ import annotations

from pathlib import Path

import pytest

from justllm.gateway.app import _Listed, _listing
from justllm.models.manifest import Source
from justllm.models.registry import Registry
from tests.models.test_registry import link_demo


@pytest.fixture
def registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    models = tmp_path / "models"
    models.mkdir()
    monkeypatch.setenv("JUSTLLM_MODELS_DIR", str(models))
    return models


def test_a_registry_name_is_listed_with_its_files_details_and_digest(registry, model_path):
    demo = link_demo(model_path, registry / "demo.gguf")
    _, version, _ = Registry().tag(str(demo), "tiny:v1")
    kept: dict = {}
    listed = _listing("tiny:v1", kept)
    # (a registry name's details were blank: only a path's header was read)
    assert listed.details["family"] == "gemma3" and listed.details["quantization_level"] == \
        "Q4_K_M"
    assert (listed.size, listed.digest) == (demo.stat().st_size, version.hex)
    assert listed.mtime == demo.stat().st_mtime
    # the path itself: the same file, the same facts, read once
    assert _listing(str(demo), kept) == listed and len(kept) == 1
    # unknown here: blank, never an error (a load says what is wrong)
    for source in ("nothing:latest", "owner/repo:never-pulled.gguf", "", "Bad Name!"):
        assert _listing(source, kept) == _Listed(), source


def test_a_pulled_repo_file_is_listed_as_its_pull(registry, model_path):
    pulled = link_demo(model_path, registry / "pulled.gguf")
    version = Registry().register(pulled, Source(kind="huggingface", repo="owner/repo",
                                                 file="model.gguf", revision="abc"))
    listed = _listing("owner/repo:model.gguf", {})
    assert (listed.size, listed.digest, listed.details["family"]) == (
        pulled.stat().st_size, version.hex, "gemma3")


def test_a_file_that_is_no_gguf_lists_blank_details(registry):
    junk = registry / "junk.gguf"
    junk.write_bytes(b"not a gguf at all")
    listed = _listing(str(junk), {})
    assert listed.details == {"format": "gguf"} and listed.size == len(b"not a gguf at all")
