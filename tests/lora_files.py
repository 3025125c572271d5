"""Small LoRA adapters for the demo model (Gemma 3 270M), written with the ``gguf`` package in
llama.cpp's adapter format (convert_lora_to_gguf.py): ``general.type = adapter``,
``adapter.type = lora``, ``adapter.lora.alpha``, and for each target weight ``W`` (ggml shape
``[n_in, n_out]``) a pair ``W.lora_a`` (numpy shape ``(rank, n_in)``) and ``W.lora_b``
(``(n_out, rank)``). llama.cpp adds ``scale * alpha / rank * B @ A @ x`` to ``W @ x``.

Random values with a fixed seed: the adapter means nothing, but it is large enough to change
greedy output. Used by the LoRA tests and benchmarks/lora_bench.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

# Gemma 3 270M: hidden size 640; attn_q projects to 4 heads x 256, attn_v to 1 KV head x 256.
N_EMBD = 640
TARGETS = {"attn_q": 1024, "attn_v": 256}


def write_adapter(path: Path, *, seed: int, rank: int = 8, alpha: float = 16.0,
                  layers: range = range(0, 18, 2), std: float = 0.05,
                  arch: str = "gemma3", n_embd: int = N_EMBD,
                  alpha_as_int: bool = False) -> Path:
    """Write a LoRA adapter GGUF on ``attn_q``/``attn_v`` of ``layers``. ``arch``, ``n_embd``
    and ``alpha_as_int`` make broken adapters for the error tests."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    if alpha_as_int:
        w.add_int32(gguf.Keys.Adapter.LORA_ALPHA, int(alpha))
    else:
        w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    for layer in layers:
        for name, n_out in TARGETS.items():
            base = f"blk.{layer}.{name}.weight"
            a = rng.normal(0.0, std, size=(rank, n_embd)).astype(np.float32)
            b = rng.normal(0.0, std, size=(n_out, rank)).astype(np.float32)
            w.add_tensor(base + ".lora_a", a)
            w.add_tensor(base + ".lora_b", b)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
