"""Local model files: the models directory, the GGUF files in it, and what each GGUF is."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from justllm.errors import ModelLoadError
from justllm.models.source import cache_dir

# llama.cpp's llama_ftype values (general.file_type) -> the names people use: llama.h's
# LLAMA_FTYPE_ALL_* / LLAMA_FTYPE_MOSTLY_* without that prefix, as its quantize tool names them
# (4 to 6 and 33 to 35 were removed from llama.cpp, and no GGUF written since holds them).
FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
    11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
    17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS",
    23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S",
    29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0", 37: "TQ2_0",
    38: "MXFP4_MOE", 39: "NVFP4", 40: "Q1_0", 41: "Q2_0",
}


def quantization_name(file_type: int | None) -> str:
    """``general.file_type`` as people name it (``Q4_K_M``); ``?`` when the GGUF has none."""
    if file_type is None:
        return "?"
    return FILE_TYPES.get(file_type, f"type {file_type}")


# Names recorded before the table took llama.h's own (MXFP4 is llama.h's MXFP4_MOE).
_RENAMED = {"MXFP4": "MXFP4_MOE"}


def recorded_quantization(recorded: str) -> str:
    """A manifest's quantization as it reads now: ``type N`` recorded before the table named
    ``N`` (a Q1_0 quantization registered as ``type 40``) reads as its name, a name since
    renamed as its new one."""
    number = recorded.removeprefix("type ")
    if number != recorded and number.isdigit():
        return quantization_name(int(number))
    return _RENAMED.get(recorded, recorded)


def models_dir() -> Path:
    """The models directory: ``JUSTLLM_MODELS_DIR``, else ``models`` in the cache directory.
    One that is a file, or under one, is refused here in words (making it said only "File
    exists: PATH"); one that does not exist yet is made where it is needed."""
    given = os.environ.get("JUSTLLM_MODELS_DIR")
    root = Path(given) if given else cache_dir() / "models"
    there = next((p for p in (root, *root.parents) if p.exists()), None)
    if there is not None and not there.is_dir():
        where = f"JUSTLLM_MODELS_DIR={given}" if given else f"the models directory {root}"
        under = "" if there == root else f" (it would be under the file {there})"
        raise ModelLoadError(f"{where} is not a directory{under}: point it at a folder")
    return root


@dataclass(frozen=True)
class ModelInfo:
    name: str
    path: Path
    size_bytes: int
    architecture: str
    quantization: str
    context_length: int | None
    metadata: dict[str, str]

    @property
    def chat_template(self) -> str | None:
        return self.metadata.get("tokenizer.chat_template")


def describe(path: Path) -> ModelInfo:
    from justllm.engine.backend import read_gguf_info

    meta = read_gguf_info(str(path))
    arch = meta.get("general.architecture", "?")
    ftype = meta.get("general.file_type")
    quant = quantization_name(int(ftype)) if ftype and ftype.isdigit() else "?"
    ctx = meta.get(f"{arch}.context_length")
    return ModelInfo(path.stem, path, path.stat().st_size, arch, quant,
                     int(ctx) if ctx and ctx.isdigit() else None, meta)


class ModelStore:
    """GGUF files in one directory (and below), named by file name without ``.gguf``: what the
    registry adopts, and the last resort for a name the registry does not know."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root or models_dir()

    def paths(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.rglob("*.gguf") if p.is_file())

    def find(self, name: str) -> Path | None:
        for p in self.paths():
            if name in (p.stem, p.name, str(p.relative_to(self.root))):
                return p
        return None
