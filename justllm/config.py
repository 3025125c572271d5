"""The engine's configuration: one dataclass, validated once, passed down."""

from __future__ import annotations

from dataclasses import dataclass

from justllm.core.scheduler import SchedulerConfig


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs; CLI flags map one to one onto these fields.

    ``pool_blocks * block_size`` is the KV pool in tokens and the llama.cpp context size, shared
    by all sequences. ``ctx`` caps one request (prompt + output); 0 means the smaller of the
    pool and the model's training context. ``spare_seq_ids`` are llama.cpp sequence ids above
    ``max_seqs`` kept for features that need extra ids (prefix-cache holders, speculation).
    ``prefix_cache`` shares KV between requests with a common prefix (radix tree).
    """

    model: str | None = None
    max_seqs: int = 32
    pool_blocks: int = 1024
    block_size: int = 16
    chunk_size: int = 256
    max_prefill: int = 4
    max_decode: int = 32
    n_batch: int = 512
    max_queue: int = 256
    threads: int = 0
    ctx: int = 0
    gpu: bool = False
    spare_seq_ids: int = 32
    prefix_cache: bool = True
    prefix_cache_blocks: int = 0  # cap on blocks the prefix cache keeps; 0: the whole pool
    verbose: bool = False

    def __post_init__(self) -> None:
        positive = ("max_seqs", "pool_blocks", "block_size", "chunk_size", "max_prefill",
                    "max_decode", "n_batch")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1 (got {value!r})")
        for name in ("max_queue", "threads", "ctx", "spare_seq_ids", "prefix_cache_blocks"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.max_seqs + self.spare_seq_ids > 256:
            raise ValueError("max_seqs + spare_seq_ids must be <= 256 (llama.cpp's limit)")
        if self.chunk_size > self.n_batch:
            raise ValueError(f"chunk_size ({self.chunk_size}) must be <= n_batch ({self.n_batch})")

    @property
    def pool_tokens(self) -> int:
        return self.pool_blocks * self.block_size

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            max_seqs=self.max_seqs, max_prefill=self.max_prefill, max_decode=self.max_decode,
            chunk_size=self.chunk_size, n_batch=self.n_batch, max_queue=self.max_queue,
            n_seq_ids=self.max_seqs + (self.spare_seq_ids if self.prefix_cache else 0))
