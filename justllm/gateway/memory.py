"""A runner's memory before it starts (for ``max-memory``): its model's GGUF header and its
engine flags, through ``policy.memory_estimate``."""

from __future__ import annotations

from pathlib import Path

from justllm.config import EngineConfig
from justllm.gateway.config import ModelSpec
from justllm.gateway.policy import memory_estimate
from justllm.models.gguf import read_gguf_header
from justllm.models.source import SOURCES, ModelSource, resolve_model


def runner_memory(spec: ModelSpec, sources: tuple[ModelSource, ...] | None = None) -> int:
    """Estimated bytes for ``spec``'s runner (resolving its source among ``sources``, the
    built-in ones by default: a pull may download)."""
    path = Path(resolve_model(spec.source, sources or SOURCES))
    header = read_gguf_header(path)
    arch = header.architecture
    flags = dict(spec.flags)
    d = EngineConfig()
    pool_tokens = int(flags.get("pool-blocks", d.pool_blocks)) * int(
        flags.get("block-size", d.block_size))
    n_head = header.integer(f"{arch}.attention.head_count") or 1
    head_dim = (header.integer(f"{arch}.embedding_length") or 0) // n_head
    seq_ids = int(flags.get("max-seqs", d.max_seqs)) + d.spare_seq_ids
    return memory_estimate(
        file_bytes=path.stat().st_size, pool_tokens=pool_tokens,
        n_layer=header.integer(f"{arch}.block_count") or 0,
        n_head_kv=header.integer(f"{arch}.attention.head_count_kv") or n_head,
        key_length=header.integer(f"{arch}.attention.key_length") or head_dim,
        value_length=header.integer(f"{arch}.attention.value_length") or head_dim,
        logit_rows=2 * seq_ids,  # llama.cpp reserves a row per sequence id, twins included
        n_vocab=header.array_lengths.get("tokenizer.ggml.tokens", 0))
