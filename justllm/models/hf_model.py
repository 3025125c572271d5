"""A Hugging Face transformers model as ``justllm convert`` sees it before converting it: its
``config.json``, its top-level files and their sizes. Made from a local directory or from a hub
repo's listing plus its downloaded config, so the same checks (an architecture the converter
knows, a tokenizer, safetensors weights) run before a single weight is downloaded.
"""

from __future__ import annotations

import difflib
import fnmatch
import json
import math
import struct
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
# safetensors' dtype names of the float types, as config.json (torch) names them
_SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32",
                       "F64": "float64"}
_MAX_HEADER = 100 * 1024 * 1024  # (safetensors' own limit)


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
    # What the weights' own headers say (a local model's; a hub repo's are not downloaded
    # when the checks run): more than config.json's dtype, which some fine-tunes get wrong.
    stored: StoredWeights | None = None

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
        """The dtype the weights are stored in, as their safetensors headers say (as
        llama.cpp's converter decides its ``auto``: it does not trust config.json, "because
        some finetunes lie"); else the one config.json declares (``dtype`` in transformers 5,
        ``torch_dtype`` before), or that of its text config."""
        if self.stored is not None and self.stored.dtype is not None:
            return self.stored.dtype
        for cfg in (self.config, self.config.get("text_config") or {}):
            if isinstance(cfg, dict):
                for key in ("dtype", "torch_dtype"):
                    if isinstance(cfg.get(key), str):
                        return str(cfg[key])
        return None

    @property
    def parameters(self) -> int:
        """The number of weights: counted from the safetensors headers, else roughly the
        weights' bytes over the declared dtype's width (2 bytes when the config says
        nothing)."""
        if self.stored is not None:
            return self.stored.parameters
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


@dataclass(frozen=True)
class StoredWeights:
    """What a model's safetensors headers say: the float type most of its matrices (tensors
    of two or more dimensions) are stored in, as config.json names it (None: another type,
    such as FP8), and how many weights it has."""

    dtype: str | None
    parameters: int


def read_stored(directory: Path, weights: list[str]) -> StoredWeights | None:
    """The weights' headers read (a few KB each, no weight); None when one cannot be read
    (the converter then says what is wrong with the file)."""
    elements: dict[str, int] = {}
    parameters = 0
    for name in weights:
        try:
            with (directory / name).open("rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                if size > _MAX_HEADER:
                    return None
                header = json.loads(f.read(size))
        except (OSError, ValueError, struct.error):
            return None
        if not isinstance(header, dict):
            return None
        for key, entry in header.items():
            if key == "__metadata__" or not isinstance(entry, dict):
                continue
            shape = entry.get("shape")
            if not isinstance(shape, list) or not all(isinstance(n, int) for n in shape):
                return None
            count = math.prod(shape)
            parameters += count
            if len(shape) >= 2:
                dtype = str(entry.get("dtype"))
                elements[dtype] = elements.get(dtype, 0) + count
    if not elements:
        return None
    most = max(elements, key=lambda d: elements[d])
    return StoredWeights(_SAFETENSORS_DTYPES.get(most), parameters)


def read_local(directory: Path) -> HFModel:
    """The model in a local directory."""
    d = directory.expanduser()
    if not d.is_dir():
        what = "a file" if d.exists() else "not found"
        raise ModelLoadError(f"{directory} is {what}: give a Hugging Face model directory "
                             "(config.json, tokenizer, *.safetensors) or a repo id OWNER/NAME")
    files = {p.name: p.stat().st_size for p in d.iterdir() if p.is_file()}
    return HFModel(str(directory), read_config(d / "config.json", str(directory)), files,
                   read_stored(d, weight_files(list(files))))
