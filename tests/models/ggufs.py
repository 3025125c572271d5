"""Small GGUF files for registry and pull tests: complete headers, a few hundred bytes each."""

from __future__ import annotations

import tempfile
from pathlib import Path

import gguf
import numpy as np


def tiny_gguf(path: Path | None = None, *, name: str = "tiny", file_type: int = 7,
              context: int = 2048, seed: int = 0) -> bytes:
    """A GGUF that reads as a ``llama`` model (``file_type`` 7 is Q8_0) with one small tensor;
    a different ``seed`` gives different bytes. Written to ``path`` when given; its bytes are
    returned either way. llama.cpp cannot load it (it has no weights to speak of)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "tiny.gguf"
        w = gguf.GGUFWriter(out, arch="llama")
        w.add_name(name)
        w.add_file_type(file_type)
        w.add_context_length(context)
        w.add_block_count(1)
        w.add_tensor("token_embd.weight",
                     np.random.default_rng(seed).standard_normal((4, 32), dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        data = out.read_bytes()
    if path is not None:
        Path(path).write_bytes(data)
    return data


# The demo model's first unused tokens, named as a code model's FIM tokens by with_fim_tokens.
FIM_IDS = {"pre": 6, "suf": 7, "mid": 8, "rep": 9, "sep": 10}  # <unused0> .. <unused4>


def with_fim_tokens(src: Path, dst: Path, names: tuple[str, ...] = ("pre", "suf", "mid")
                    ) -> Path:
    """A copy of the GGUF ``src`` whose metadata names tokens of its vocabulary (FIM_IDS) as
    the fill-in-the-middle tokens ``names``, as a code model's does (Gemma 3 has none): the
    weights are the same, so the model infills no better, but llama.cpp reads the tokens and
    /infill lays its prompt out with them."""
    return with_metadata(src, dst, lambda w, arch: [
        w.add_uint32(f"tokenizer.ggml.fim_{name}_token_id", FIM_IDS[name]) for name in names])


def with_pooling(src: Path, dst: Path, pooling: int) -> Path:
    """A copy of ``src`` whose metadata says how its embeddings are pooled (llama.cpp's
    ``{arch}.pooling_type``: 1 mean, 2 CLS, 3 last), as an embedding model's does."""
    return with_metadata(src, dst, lambda w, arch: w.add_uint32(f"{arch}.pooling_type",
                                                                  pooling))


def with_metadata(src: Path, dst: Path, add, edit=None) -> Path:
    """A copy of ``src`` (metadata and the same tensors), with what ``add(writer, arch)``
    adds to its metadata and each value through ``edit(name, value, is_array)`` if given."""
    from justllm.models.draft import _read, _value, copying_writer

    reader = _read(src)
    arch = str(_value(reader.get_field(gguf.Keys.General.ARCHITECTURE)), "utf-8")
    w = copying_writer(reader, dst, arch, edit)
    add(w, arch)
    for t in reader.tensors:
        w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type,
                     tensor_endianess=reader.endianess)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def with_chat_template(src: Path, dst: Path, template: str) -> Path:
    """A copy of ``src`` (a base model: it has none) whose metadata holds a chat template, as
    an instruction-tuned model's does."""
    return with_metadata(src, dst, lambda w, arch: w.add_chat_template(template))
