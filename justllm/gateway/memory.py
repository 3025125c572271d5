"""A runner's memory before it starts (for ``max-memory``): its model's GGUF header and its
engine flags, through ``policy.memory_estimate``."""

from __future__ import annotations

from pathlib import Path

from justllm.config import EngineConfig, default_spare_seq_ids
from justllm.gateway.config import ModelSpec
from justllm.gateway.policy import memory_estimate
from justllm.models.gguf import ModelShape, read_gguf_header
from justllm.models.source import SOURCES, ModelSource, resolve_model


def runner_memory(spec: ModelSpec, sources: tuple[ModelSource, ...] | None = None) -> int:
    """Estimated bytes for ``spec``'s runner (resolving its source among ``sources``, the
    built-in ones by default: a pull may download)."""
    path = Path(resolve_model(spec.source, sources or SOURCES))
    shape = ModelShape.of(read_gguf_header(path, vocabulary=False))  # (the runner checks it)
    flags = dict(spec.flags)
    d = EngineConfig(gpu=False)  # (a runner's device is its flags', never the environment's)
    # A --gpu runner's KV cache is in VRAM, not in the memory max-memory shares out.
    pool_blocks = 0 if flags.get("gpu") else int(flags.get("pool-blocks") or d.pool_blocks)
    pool_tokens = pool_blocks * int(flags.get("block-size", d.block_size))
    max_seqs = int(flags.get("max-seqs", d.max_seqs))
    seq_ids = max_seqs + default_spare_seq_ids(max_seqs)
    return memory_estimate(
        file_bytes=path.stat().st_size, pool_tokens=pool_tokens,
        kv_bytes_per_token=shape.kv_bytes_per_token,
        logit_rows=2 * seq_ids,  # llama.cpp reserves a row per sequence id, twins included
        n_vocab=shape.n_vocab)
