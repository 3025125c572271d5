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
