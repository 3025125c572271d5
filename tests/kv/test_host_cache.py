"""Host memory for cached prefixes (--cache-ram) with no model: chunks kept once for every
prefix that shares them, the longest shared prefix found with the chunks that hold it, what
goes first; and the radix-tree calls the engine spills through."""

import pytest

from justllm.kv.block_pool import BlockPool
from justllm.kv.host_cache import HostCache, free_floor, spans
from justllm.kv.radix_cache import KVOp, RadixCache


def put(h: HostCache, tokens: list[int], size: int = 10, tree: tuple = ()) -> bool:
    """Store ``tokens`` (in ``tree``) with ``size`` bytes for each chunk it lacks."""
    return h.put(tokens, {s.digest: bytes(size) for s in h.missing(tokens, tree)}, tree)


def test_a_chunk_is_named_by_every_token_up_to_its_end():
    a, b = spans([1, 2, 3, 4, 5], 2), spans([1, 2, 3, 4, 6], 2)
    assert [(s.start, s.end) for s in a] == [(0, 2), (2, 4), (4, 5)]
    assert [x.digest == y.digest for x, y in zip(a, b)] == [True, True, False]
    assert spans([9, 2, 3, 4], 2)[1].digest != a[1].digest  # same tokens, another past


def test_an_adapter_sets_prefixes_are_a_tree_of_their_own():
    """The same tokens under an adapter set are other cells: other chunks, found only by a
    lookup in that tree, and dropped with it."""
    lora_a, lora_b = ((0, 1.0),), ((1, 0.5),)
    assert spans([1, 2, 3], 2, lora_a)[0].digest not in {
        spans([1, 2, 3], 2)[0].digest, spans([1, 2, 3], 2, lora_b)[0].digest}
    h = HostCache(1000, chunk_tokens=2, key_tokens=2)
    assert put(h, [1, 2, 3, 4]) and put(h, [1, 2, 3, 4, 5], tree=lora_a)
    assert h.stats().entries == 2 and h.stats().bytes == 50  # nothing shared across trees
    assert h.covers([1, 2, 3, 4, 5], lora_a) and not h.covers([1, 2, 3, 4, 5])
    assert h.best([1, 2, 3, 4, 5], lora_b) == (0, None)
    usable, entry = h.best([1, 2, 3, 4, 5, 6], lora_a)
    assert usable == 5 and entry is not None and entry.tree == lora_a
    assert h.drop_trees(lambda tree: tree == lora_a) == 1
    assert h.best([1, 2, 3, 4, 5, 6], lora_a) == (0, None) and h.best([1, 2, 3, 4])[0] == 4
    assert h.stats().entries == 1 and h.stats().bytes == 20


def test_prefixes_that_begin_alike_keep_their_shared_chunks_once():
    h = HostCache(1000, chunk_tokens=2, key_tokens=2)
    assert put(h, [1, 2, 3, 4, 5])
    assert [s.start for s in h.missing([1, 2, 3, 4, 7, 8])] == [4]
    assert put(h, [1, 2, 3, 4, 7, 8])
    s = h.stats()
    assert (s.entries, s.bytes, s.tokens, s.stored) == (2, 40, 11, 2)  # 4 chunks, not 5
    h.clear()
    assert h.stats().bytes == 0 and h.stats().entries == 0


def test_the_longest_shared_prefix_is_found_and_the_chunks_that_hold_it():
    h = HostCache(1000, chunk_tokens=2, key_tokens=2)
    put(h, [1, 2, 3, 4, 5, 6, 7])
    put(h, [1, 2, 8, 9])
    usable, entry = h.best([1, 2, 3, 4, 5, 0])
    assert usable == 5 and entry is not None and entry.tokens[:5] == [1, 2, 3, 4, 5]
    # from the chunk holding position 3 (the KV has 3 tokens) to the one holding the 5th
    assert [(s.start, s.end) for s, _ in h.chunks(entry, 3, usable)] == [(2, 4), (4, 6)]
    assert h.best([1, 2, 8, 9, 10])[0] == 4
    assert h.best([1, 3, 3, 4]) == (0, None)  # another first key: never compared
    assert h.covers([1, 2, 3]) and not h.covers([1, 2, 3, 4, 5, 6, 7, 8])


def test_an_entry_that_a_longer_one_holds_goes():
    h = HostCache(1000, chunk_tokens=2, key_tokens=2)
    put(h, [1, 2, 3])
    put(h, [1, 2, 3, 4, 5])
    s = h.stats()
    assert (s.entries, s.bytes, s.tokens) == (1, 30, 5)  # [3] alone went with its entry


def test_the_least_recently_used_goes_first_and_a_restore_counts_as_a_use():
    h = HostCache(30, chunk_tokens=2, key_tokens=1)
    for t in (1, 2, 3):
        put(h, [t, t])
    h.used(h.best([1, 1])[1], 2)
    put(h, [4, 4])  # over the budget: [2, 2] is the oldest now
    assert [h.best([t, t])[0] for t in (1, 2, 3, 4)] == [2, 0, 2, 2]
    s = h.stats()
    assert s.bytes == 30 and s.restored == 1 and s.restored_tokens == 2


def test_a_shared_chunk_stays_while_an_entry_uses_it():
    h = HostCache(40, chunk_tokens=2, key_tokens=1)
    put(h, [1, 2, 3, 4])
    put(h, [1, 2, 5, 6])  # shares [1, 2]
    put(h, [7, 7, 7, 7])  # 60 bytes: the oldest entry goes, the chunk it shares stays
    assert h.stats().bytes == 40
    usable, entry = h.best([1, 2, 5, 6])
    assert usable == 4 and entry is not None and len(h.chunks(entry, 0, 4)) == 2
    assert h.best([1, 2, 3, 4]) == (2, entry)  # [1, 2, 3, 4] itself is gone


def test_what_exceeds_the_budget_or_the_key_is_not_kept():
    h = HostCache(10, chunk_tokens=4, key_tokens=4)
    assert not put(h, [1, 2, 3, 4, 5], size=6)  # two chunks of 6 bytes
    assert h.stats().bytes == 0 and h.stats().entries == 0
    assert not put(h, [1, 2, 3])  # shorter than a lookup's key
    assert put(h, [1, 2, 3, 4, 5], size=5)
    with pytest.raises(ValueError):
        HostCache(-1, 4)


def test_the_spill_candidate_is_the_policys_victim_and_its_path_starts_at_zero():
    c = RadixCache(BlockPool(64, 4))
    c.insert([1, 2, 3, 4, 5, 6], seq=7, live=False)
    c.insert([1, 2, 3, 8, 9], seq=3, live=False)  # newer: [4, 5, 6] is the older leaf
    leaf = c.spill_candidate()
    assert leaf is not None and leaf.tokens == [4, 5, 6] and c.is_evictable(leaf)
    assert RadixCache.path_tokens(leaf) == [1, 2, 3, 4, 5, 6]
    assert c.evict(leaf) == [KVOp.rm(7, 3, 6)]
    assert not c.is_evictable(leaf) and c.check() == []
    c.lock(c.match([1, 2, 3, 8], 4).last)
    assert c.spill_candidate() is None  # the one leaf left is in use


def test_the_free_floor_is_a_full_batch_and_a_block_a_sequence_at_most_a_quarter():
    assert free_floor(2048, 16, 32, 2048) == 128 + 32  # a GPU's defaults, a 32k-token pool
    assert free_floor(2040, 16, 4, 2048) == 128 + 4  # (a part block is a block)
    assert free_floor(2048, 16, 32, 100) == 25
