"""Prefix-cache counters, as the engine reports them (all zero while no cache is enabled)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefixCacheStats:
    hits: int = 0  # requests that reused a cached prefix
    misses: int = 0  # requests that found none
    queried_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # prompt tokens found (not recomputed)
    blocks: int = 0  # KV blocks the cache holds
    idle_blocks: int = 0  # of those, the ones no running request uses (evictable on demand)

    @property
    def hit_ratio(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0
