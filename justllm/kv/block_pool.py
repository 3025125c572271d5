"""Paged accounting of the llama.cpp KV cache.

llama.cpp owns the KV cells; this pool only counts them, in blocks of ``block_size`` tokens, so
the scheduler can admit a request when its KV fits and preempt one when decode runs out, long
before ``llama_decode`` would fail on a full cache. The context is created with
``n_ctx = total_blocks * block_size`` so the two agree.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class BlockUsage:
    used: int
    free: int
    total: int

    @property
    def used_fraction(self) -> float:
        return self.used / self.total if self.total else 0.0


class BlockPool:
    """A free list of block ids. The scheduler allocates and frees requests' blocks; the radix
    cache holds its own share (``RadixCache._block_ids``), taken and given back as it changes."""

    def __init__(self, total_blocks: int, block_size: int) -> None:
        if total_blocks < 1:
            raise ValueError("total_blocks must be >= 1")
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.total_blocks = total_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(total_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.total_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens of one sequence."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise ValueError(f"asked for {n} blocks, {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(block_ids)

    def usage(self) -> BlockUsage:
        free = len(self._free)
        return BlockUsage(used=self.total_blocks - free, free=free, total=self.total_blocks)
