"""A Hugging Face transformers model as ``justllm convert`` sees it before converting it: its
``config.json``, its top-level files and their sizes. Made from a local directory or from a hub
repo's listing plus its downloaded config, so the same checks (an architecture the converter
knows, a tokenizer, safetensors weights) run before a single weight is downloaded.
"""

from __future__ import annotations

import difflib
import fnmatch
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from justllm.errors import ModelLoadError

# Files the converter may read besides the weights: config, tokenizer (fast, sentencepiece,
# tiktoken, Mistral's tekken), chat templates, the model card it takes metadata from.
SIDE_FILES = ("*.json", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja", "README.md")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tekken.json", "vocab.json", "vocab.txt",
                   "*.tiktoken", "rwkv_vocab*.txt")
WEIGHTS = "*.safetensors"
# Bytes per weight of the source, by the dtype its config.json declares.
_DTYPE_BYTES = {"float32": 4.0, "float16": 2.0, "bfloat16": 2.0, "float64": 8.0}


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def side_files(names: list[str]) -> list[str]:
    """The top-level files to download before the weights (small ones only)."""
    return sorted(n for n in names if "/" not in n and _matches(n, SIDE_FILES))


def weight_files(names: list[str]) -> list[str]:
    return sorted(n for n in names if "/" not in n and fnmatch.fnmatchcase(n, WEIGHTS))


@dataclass(frozen=True)
class HFModel:
    """``where``: the directory or ``REPO @ COMMIT`` (for messages); ``files``: top-level
    file name -> size in bytes."""

    where: str
    config: dict[str, Any]
    files: dict[str, int]

    def candidate_architectures(self) -> list[str]:
        """What llama.cpp's converter dispatches on: ``architectures[0]``, and for a
        multimodal wrapper its text config's."""
        def first(config: dict) -> list[str]:
            named = config.get("architectures") or []
            if isinstance(named, str):  # (a string was sliced: "architecture L")
                named = [named]
            return [a for a in named[:1] if isinstance(a, str)] if isinstance(named, list) \
                else []

        text = self.config.get("text_config") or {}
        return first(self.config) + (first(text) if isinstance(text, dict) else [])

    @property
    def weights(self) -> list[str]:
        return weight_files(list(self.files))

    @property
    def weights_bytes(self) -> int:
        return sum(self.files[n] for n in self.weights)

    @property
    def source_dtype(self) -> str | None:
        """The dtype config.json declares (``dtype`` in transformers 5, ``torch_dtype``
        before), or that of its text config."""
        for cfg in (self.config, self.config.get("text_config") or {}):
            if isinstance(cfg, dict):
                for key in ("dtype", "torch_dtype"):
                    if isinstance(cfg.get(key), str):
                        return str(cfg[key])
        return None

    @property
    def parameters(self) -> int:
        """Roughly, the number of weights: the weights' bytes over the declared dtype's
        width (2 bytes when the config says nothing)."""
        return int(self.weights_bytes / _DTYPE_BYTES.get(self.source_dtype or "", 2.0))

    @property
    def has_tokenizer(self) -> bool:
        return any(_matches(n, TOKENIZER_FILES) for n in self.files)

    def check(self, supported: tuple[str, ...]) -> None:
        """One-line errors for what would make llama.cpp's converter fail for certain."""
        self.check_files()
        self.check_architecture(supported)

    def check_files(self, weights: bool = True) -> None:
        """What can be checked before llama.cpp's converter is fetched: weights (unless
        ``weights`` is False: a LoRA adapter's base model), a named architecture, a
        tokenizer."""
        if weights and not self.weights:
            raise ModelLoadError(f"no *.safetensors weights in {self.where} (justllm converts "
                                 "safetensors models)")
        if not self.candidate_architectures():
            raise ModelLoadError(f"{self.where}: config.json names no 'architectures', so "
                                 "llama.cpp's converter cannot tell what model it is")
        if not self.has_tokenizer:
            raise ModelLoadError(f"no tokenizer in {self.where}: llama.cpp's converter needs "
                                 "the model's tokenizer files (tokenizer.json or tokenizer.model) "
                                 "beside config.json")

    def check_architecture(self, supported: tuple[str, ...]) -> None:
        """The architecture is one llama.cpp's converter (which lists ``supported``) converts."""
        candidates = self.candidate_architectures()
        if not any(a in supported for a in candidates):
            # The nearest names, not all ~270 of them (a line of some 10,000 characters).
            near = difflib.get_close_matches(candidates[0], supported, n=5, cutoff=0.5)
            raise ModelLoadError(
                f"architecture {candidates[0]} is not supported by llama.cpp's converter "
                f"(it converts {len(supported)} architectures"
                + (f"; the nearest: {', '.join(near)})" if near else ")"))


def read_config(path: Path, where: str) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"{where} is not a Hugging Face model: it has no config.json") \
            from None
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {where}'s config.json: {e}") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{where}'s config.json is not a JSON object")
    return config


def read_local(directory: Path) -> HFModel:
    """The model in a local directory."""
    d = directory.expanduser()
    if not d.is_dir():
        what = "a file" if d.exists() else "not found"
        raise ModelLoadError(f"{directory} is {what}: give a Hugging Face model directory "
                             "(config.json, tokenizer, *.safetensors) or a repo id OWNER/NAME")
    files = {p.name: p.stat().st_size for p in d.iterdir() if p.is_file()}
    return HFModel(str(directory), read_config(d / "config.json", str(directory)), files)
