"""A ``--gpu`` engine's KV pool, sized from the GPU's free memory when the model starts.

The numbers come from here (ggml's device registry through the backend, the GGUF header, the
files' sizes); the policy is kv/sizing.py's.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from justllm.config import CPU_DEFAULTS, EngineConfig
from justllm.engine.backend import gpu_devices, require_gpu_offload
from justllm.errors import GPUUnavailableError, ModelLoadError
from justllm.kv.sizing import compute_reserve, pool_cap, scores_bytes_per_token, vram_pool_blocks
from justllm.models.gguf import ModelShape, read_gguf_header
from justllm.models.source import resolve_model


def with_vram_pool(config: EngineConfig, free_bytes: int | None = None) -> EngineConfig:
    """``config`` with ``pool_blocks`` set, when it is 0 (a ``--gpu`` engine whose pool was not
    given), from ``free_bytes`` (default: the free memory of every GPU llama.cpp sees, which
    it splits the layers across). A draft model's weights and KV count as well."""
    if config.pool_blocks:
        return config
    if free_bytes is None:
        require_gpu_offload()
        devices = gpu_devices()
        if not devices:
            raise GPUUnavailableError("--gpu: this llama.cpp build has a GPU backend but sees no "
                                      "GPU (check the driver and CUDA_VISIBLE_DEVICES)")
        free_bytes = sum(d.free_bytes for d in devices)
    path = resolve_model(config.model)
    shape = ModelShape.of(read_gguf_header(path, vocabulary=False))
    weights, per_token = Path(path).stat().st_size, shape.kv_bytes_per_token
    if config.flash_attn == "off":
        per_token += scores_bytes_per_token(config.n_ubatch or config.n_batch, shape.n_head)
    if config.draft_model:
        draft = resolve_model(config.draft_model)
        weights += Path(draft).stat().st_size
        per_token += ModelShape.of(read_gguf_header(draft, vocabulary=False)).kv_bytes_per_token
    blocks = vram_pool_blocks(
        free_bytes, weights_bytes=weights,
        reserve_bytes=compute_reserve(config.n_ubatch, shape.n_vocab, shape.n_embd),
        kv_bytes_per_token=per_token, block_size=config.block_size,
        max_tokens=pool_cap(shape.n_ctx_train, CPU_DEFAULTS.pool_blocks * config.block_size))
    if blocks < 1:
        raise ModelLoadError(
            f"{path} leaves no room for a KV cache in the GPU's free memory "
            f"({free_bytes / 2**30:.1f} GiB free, the weights {weights / 2**30:.1f} GiB): free "
            "some, or give --pool-blocks")
    return replace(config, pool_blocks=blocks)
