"""Cached prompts' KV kept in host memory (``--cache-ram``, llama-server's flag): the pure policy.

Why: llama.cpp's unified KV cache attends over every cell up to the highest one in use, the
prefix cache's idle cells included, so each cached token costs every later decode about 0.09
µs per token in the batch on the demo model (``benchmarks/cached_kv_cost.py``; 14,736 cached
tokens: 0.835x at 8 streams). Kept in host memory instead, an idle prefix costs nothing until a
request needs it, and then a copy of its cells back (milliseconds) instead of its prefill
(seconds). llama-server keeps prompts the same way (``--cache-ram``); its slots' KV streams
spare it the decode cost that this tier removes here.

The engine (engine/engine.py) moves a prefix out when the prefix cache holds more than
``--prefix-cache-blocks`` and back in when a waiting request shares more of its prompt with an
entry here than with what is in the KV. This module only decides what is kept: whole prefixes
(the tokens from position 0, their cells as llama.cpp serialises them, in chunks), at most
``max_bytes`` of them, least recently used out first, none that a longer entry already holds.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from justllm.kv.radix_cache import common_prefix_len


@dataclass
class HostEntry:
    tokens: list[int]
    chunks: list[bytes]  # the cells of positions [k * chunk_tokens, (k + 1) * chunk_tokens)
    chunk_tokens: int
    last_use: int = 0

    @property
    def n_bytes(self) -> int:
        return sum(len(c) for c in self.chunks)

    def spans(self) -> list[tuple[int, int]]:
        n, step = len(self.tokens), self.chunk_tokens
        return [(a, min(a + step, n)) for a in range(0, n, step)]


@dataclass(frozen=True)
class HostCacheStats:
    entries: int = 0
    bytes: int = 0
    tokens: int = 0
    stored: int = 0  # prefixes moved out of the KV
    restored: int = 0  # prefixes moved back for a request
    restored_tokens: int = 0


class HostCache:
    """Entries keyed by their first ``key_tokens`` tokens (a lookup compares only entries
    that begin as the prompt does)."""

    def __init__(self, max_bytes: int, key_tokens: int = 16) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.max_bytes = max_bytes
        self.key_tokens = max(1, key_tokens)
        self._by_key: dict[tuple[int, ...], list[HostEntry]] = {}
        self._bytes = 0
        self._tick = itertools.count(1)
        self._stored = self._restored = self._restored_tokens = 0

    def _key(self, tokens: Sequence[int]) -> tuple[int, ...]:
        return tuple(tokens[:self.key_tokens])

    def _entries(self) -> list[HostEntry]:
        return [e for group in self._by_key.values() for e in group]

    def covers(self, tokens: list[int]) -> bool:
        """Whether an entry holds all of ``tokens`` (they are one of its prefixes)."""
        return any(len(e.tokens) >= len(tokens) and e.tokens[:len(tokens)] == tokens
                   for e in self._by_key.get(self._key(tokens), ()))

    def best(self, tokens: list[int]) -> tuple[int, HostEntry | None]:
        """The entry sharing the longest prefix with ``tokens``, and how long that is (0,
        None: none shares its first ``key_tokens`` tokens)."""
        best: tuple[int, HostEntry | None] = (0, None)
        for e in self._by_key.get(self._key(tokens), ()):
            k = common_prefix_len(e.tokens, tokens)
            if k > best[0]:
                best = (k, e)
        return best

    def put(self, tokens: list[int], chunks: list[bytes], chunk_tokens: int) -> bool:
        """Keep a prefix's cells; False when they are larger than the whole budget. Entries
        this one holds all of (their tokens begin it) go; then the least recently used, until
        it fits."""
        entry = HostEntry(list(tokens), list(chunks), chunk_tokens, next(self._tick))
        if entry.n_bytes > self.max_bytes or len(tokens) < self.key_tokens:
            return False
        key = self._key(tokens)
        group = self._by_key.setdefault(key, [])
        for old in [e for e in group if tokens[:len(e.tokens)] == e.tokens]:
            self._remove(key, old)
        while self._bytes + entry.n_bytes > self.max_bytes:
            oldest = min(self._entries(), key=lambda e: e.last_use)
            self._remove(self._key(oldest.tokens), oldest)
        self._by_key.setdefault(key, []).append(entry)
        self._bytes += entry.n_bytes
        self._stored += 1
        return True

    def used(self, entry: HostEntry) -> None:
        """``entry`` went back into the KV for a request: most recently used now."""
        entry.last_use = next(self._tick)
        self._restored += 1
        self._restored_tokens += len(entry.tokens)

    def clear(self) -> None:
        """Forget every entry (the counters stay)."""
        self._by_key.clear()
        self._bytes = 0

    def _remove(self, key: tuple[int, ...], entry: HostEntry) -> None:
        group = self._by_key[key]
        group.remove(entry)
        if not group:
            del self._by_key[key]
        self._bytes -= entry.n_bytes

    def stats(self) -> HostCacheStats:
        entries = self._entries()
        return HostCacheStats(len(entries), self._bytes, sum(len(e.tokens) for e in entries),
                              self._stored, self._restored, self._restored_tokens)
