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
(the tokens from position 0), each as *chunks* of ``chunk_tokens`` positions (the cells as
llama.cpp serialises them). A chunk is named by a digest of every token up to its end (its
cells depend on all of them), so prefixes that begin alike share their first chunks: a
thousand requests after one long system prompt store it once, and moving one out copies only
the chunks not stored yet. At most ``max_bytes`` of chunks are kept; the least recently used
prefix goes first (its chunks with it, unless another prefix uses them), and none is kept
that a longer one holds. A prefix comes back as far as a prompt shares it: the chunks it
needs, the last one's cells past that dropped.

Prefixes computed under LoRA adapters are kept too, each in its adapter set's *tree* (the
prefix cache's tree key, ``()`` for the base model): their cells differ from the base model's
for the same tokens, so a tree's chunks are named by digests that start from the tree's own
seed, and a lookup only finds entries of the tree it names. An adapter being unloaded takes its
trees' entries with it (``drop_trees``).
"""

from __future__ import annotations

import hashlib
import itertools
from array import array
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass

from justllm.kv.radix_cache import common_prefix_len


@dataclass(frozen=True)
class Span:
    """Chunk ``index`` of a prefix: positions [start, end), named by ``digest``."""

    index: int
    start: int
    end: int
    digest: bytes


@dataclass
class HostEntry:
    tokens: list[int]
    spans: list[Span]
    last_use: int = 0
    tree: Hashable = ()  # the prefix cache's tree key: the adapter set it was computed under


@dataclass(frozen=True)
class HostCacheStats:
    entries: int = 0
    bytes: int = 0  # of the chunks kept (each once)
    tokens: int = 0  # of the prefixes kept (shared chunks counted in each)
    stored: int = 0  # prefixes moved out of the KV
    restored: int = 0  # prefixes moved back for a request
    restored_tokens: int = 0


def free_floor(n_batch: int, block_size: int, max_seqs: int, total_blocks: int) -> int:
    """The KV blocks the end of a step keeps free by moving idle prefixes here, where the prefix
    cache may fill the whole pool (a GPU): room for one step's most new tokens (a full batch)
    and a block for each sequence's next token, at most a quarter of the pool. Without it,
    such prefixes leave the KV only when the scheduler evicts them for room, and those are
    dropped, so a GPU engine's host memory would never be used."""
    return min(total_blocks // 4, -(-n_batch // block_size) + max_seqs)


def spans(tokens: list[int], chunk_tokens: int, tree: Hashable = ()) -> list[Span]:
    """``tokens``' chunks, each named by a digest of the tokens through its end (chained),
    from a seed of the tree's own (none for the base model's, ``()``)."""
    out: list[Span] = []
    digest = b"" if tree == () else hashlib.blake2b(repr(tree).encode(), digest_size=16,
                                                    person=b"justllm-tree").digest()
    for k, a in enumerate(range(0, len(tokens), chunk_tokens)):
        b = min(a + chunk_tokens, len(tokens))
        digest = hashlib.blake2b(digest + array("q", tokens[a:b]).tobytes(),
                                 digest_size=16).digest()
        out.append(Span(k, a, b, digest))
    return out


class HostCache:
    """Entries keyed by their tree and their first ``key_tokens`` tokens (a lookup compares
    only entries of its tree that begin as the prompt does); chunks kept once, with the number
    of entries using each. ``tree``: the prefix cache's tree key (module docstring)."""

    def __init__(self, max_bytes: int, chunk_tokens: int, key_tokens: int = 16) -> None:
        if max_bytes < 0 or chunk_tokens < 1:
            raise ValueError("max_bytes must be >= 0 and chunk_tokens >= 1")
        self.max_bytes = max_bytes
        self.chunk_tokens = chunk_tokens
        self.key_tokens = max(1, key_tokens)
        self._by_key: dict[tuple[Hashable, tuple[int, ...]], list[HostEntry]] = {}
        self._chunks: dict[bytes, bytes | bytearray] = {}  # (as the backend serialised them)
        self._refs: dict[bytes, int] = {}
        self._bytes = 0
        self._tick = itertools.count(1)
        self._stored = self._restored = self._restored_tokens = 0

    def _key(self, tokens: list[int], tree: Hashable) -> tuple[Hashable, tuple[int, ...]]:
        return tree, tuple(tokens[:self.key_tokens])

    def _entries(self) -> list[HostEntry]:
        return [e for group in self._by_key.values() for e in group]

    def covers(self, tokens: list[int], tree: Hashable = ()) -> bool:
        """Whether an entry holds all of ``tokens`` (they are one of its prefixes)."""
        return any(len(e.tokens) >= len(tokens) and e.tokens[:len(tokens)] == tokens
                   for e in self._by_key.get(self._key(tokens, tree), ()))

    def missing(self, tokens: list[int], tree: Hashable = ()) -> list[Span]:
        """The chunks of ``tokens`` not kept yet: what :meth:`put` needs for them."""
        return [s for s in spans(tokens, self.chunk_tokens, tree)
                if s.digest not in self._chunks]

    def put(self, tokens: list[int], data: Mapping[bytes, bytes | bytearray],
            tree: Hashable = ()) -> bool:
        """Keep the prefix ``tokens``, ``data`` holding the cells of its chunks :meth:`missing`
        named (by digest); False when they do not fit the whole budget, or when the prefix is
        shorter than a lookup's key. Entries this one holds all of go; then the least recently
        used, until it fits."""
        if len(tokens) < self.key_tokens:
            return False
        entry = HostEntry(list(tokens), spans(tokens, self.chunk_tokens, tree),
                          next(self._tick), tree)
        key = self._key(tokens, tree)
        for s in entry.spans:  # held first, so no eviction below frees a chunk this one uses
            if s.digest not in self._chunks:
                chunk = data[s.digest]
                self._chunks[s.digest] = chunk
                self._bytes += len(chunk)
            self._refs[s.digest] = self._refs.get(s.digest, 0) + 1
        for old in [e for e in self._by_key.get(key, ()) if tokens[:len(e.tokens)] == e.tokens]:
            self._remove(old)
        self._by_key.setdefault(key, []).append(entry)
        while self._bytes > self.max_bytes:
            oldest = min(self._entries(), key=lambda e: e.last_use)
            self._remove(oldest)
            if oldest is entry:
                return False
        self._stored += 1
        return True

    def best(self, tokens: list[int], tree: Hashable = ()) -> tuple[int, HostEntry | None]:
        """The entry of ``tree`` sharing the longest prefix with ``tokens``, and how long that
        is (0, None: none shares its first ``key_tokens`` tokens)."""
        best: tuple[int, HostEntry | None] = (0, None)
        for e in self._by_key.get(self._key(tokens, tree), ()):
            k = common_prefix_len(e.tokens, tokens)
            if k > best[0]:
                best = (k, e)
        return best

    def chunks(self, entry: HostEntry, start: int, end: int
               ) -> list[tuple[Span, bytes | bytearray]]:
        """``entry``'s chunks holding positions ``start`` to ``end`` (the last may go on
        past it: the engine drops those cells), with their cells."""
        return [(s, self._chunks[s.digest]) for s in entry.spans if s.end > start and
                s.start < end]

    def used(self, entry: HostEntry, tokens: int) -> None:
        """``tokens`` of ``entry`` went back into the KV for a request: most recently used."""
        entry.last_use = next(self._tick)
        self._restored += 1
        self._restored_tokens += tokens

    def clear(self) -> None:
        """Forget every entry (the counters stay)."""
        self.drop_trees(lambda tree: True)

    def drop_trees(self, which: Callable[[Hashable], bool]) -> int:
        """Forget the entries of the trees ``which`` accepts (an adapter being unloaded:
        nothing can look them up again); how many went."""
        gone = [e for e in self._entries() if which(e.tree)]
        for e in gone:
            self._remove(e)
        return len(gone)

    def _remove(self, entry: HostEntry) -> None:
        key = self._key(entry.tokens, entry.tree)
        group = self._by_key[key]
        group.remove(entry)
        if not group:
            del self._by_key[key]
        for s in entry.spans:
            left = self._refs[s.digest] - 1
            if left:
                self._refs[s.digest] = left
            else:
                del self._refs[s.digest]
                self._bytes -= len(self._chunks.pop(s.digest))

    def stats(self) -> HostCacheStats:
        entries = self._entries()
        return HostCacheStats(len(entries), self._bytes, sum(len(e.tokens) for e in entries),
                              self._stored, self._restored, self._restored_tokens)
