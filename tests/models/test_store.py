"""The models directory's file-type names (justllm/models/store.py)."""

from __future__ import annotations

from pathlib import Path

from llama_cpp import llama_cpp as C

from justllm.models.manifest import Source
from justllm.models.registry import Registry
from justllm.models.store import FILE_TYPES, quantization_name, recorded_quantization
from tests.models.ggufs import tiny_gguf


def _llama_h_ftypes() -> dict[int, str]:
    """llama.h's ``LLAMA_FTYPE_*`` values, as the bindings of the pinned llama-cpp-python
    declare them, named without their ``ALL_``/``MOSTLY_`` prefix (``LLAMA_FTYPE_GUESSED`` is
    a flag, not a type)."""
    return {value: name.removeprefix("LLAMA_FTYPE_").removeprefix("ALL_").removeprefix("MOSTLY_")
            for name, value in vars(C).items()
            if name.startswith("LLAMA_FTYPE_") and name != "LLAMA_FTYPE_GUESSED"}


def test_every_ftype_llama_h_declares_has_its_name() -> None:
    declared = _llama_h_ftypes()
    assert {40, 41} <= declared.keys()  # Q1_0 and Q2_0 showed as "type 40", "type 41"
    assert {v: FILE_TYPES.get(v) for v in declared} == declared
    assert FILE_TYPES.keys() == declared.keys()  # and nothing llama.h does not declare


def test_quantization_name() -> None:
    assert quantization_name(40) == "Q1_0" and quantization_name(41) == "Q2_0"
    assert quantization_name(38) == "MXFP4_MOE"
    assert quantization_name(None) == "?" and quantization_name(99) == "type 99"


def test_a_type_number_recorded_before_it_had_a_name_reads_as_its_name(tmp_path: Path) -> None:
    """Versions quantized to Q1_0 before the table named it were registered as "type 40"."""
    path = tmp_path / "x-q1_0.gguf"
    tiny_gguf(path, file_type=40)
    registry = Registry(tmp_path)
    m = registry.register(path, Source("file"))
    assert m.quantization == "Q1_0"
    file = tmp_path / "manifests" / f"sha256-{m.hex}.json"
    file.write_text(file.read_text().replace('"Q1_0"', '"type 40"'))
    assert registry.manifest(m.hex) == m
    assert recorded_quantization("type 99") == "type 99" and recorded_quantization("?") == "?"
