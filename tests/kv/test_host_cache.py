"""Host memory for cached prefixes (--cache-ram) with no model: what is kept, what goes first,
and the longest shared prefix found; and the radix-tree calls the engine spills through."""

import pytest

from justllm.kv.block_pool import BlockPool
from justllm.kv.host_cache import HostCache
from justllm.kv.radix_cache import KVOp, RadixCache


def chunk(n: int) -> list[bytes]:
    return [bytes(n)]


def test_the_longest_shared_prefix_is_found_among_entries_that_begin_alike():
    h = HostCache(1000, key_tokens=2)
    h.put([1, 2, 3, 4], chunk(10), 4)
    h.put([1, 2, 5, 6, 7], chunk(10), 4)
    h.put([9, 9, 3, 4, 5, 6], chunk(10), 4)
    assert h.best([1, 2, 5, 6, 8]) == (4, h.best([1, 2, 5, 6, 7, 1])[1])
    length, entry = h.best([1, 2, 3, 9])
    assert length == 3 and entry is not None and entry.tokens == [1, 2, 3, 4]
    assert h.best([1, 3, 3, 4]) == (0, None)  # another first block: never compared
    assert h.covers([1, 2, 5]) and h.covers([1, 2, 5, 6, 7]) and not h.covers([1, 2, 5, 6, 7, 8])


def test_an_entry_that_a_longer_one_holds_goes():
    h = HostCache(1000, key_tokens=2)
    h.put([1, 2, 3], chunk(10), 4)
    h.put([1, 2, 3, 4, 5], chunk(20), 4)
    s = h.stats()
    assert (s.entries, s.bytes, s.tokens, s.stored) == (1, 20, 5, 2)
    h.put([1, 2, 7], chunk(10), 4)  # not held by the longer one: both stay
    assert h.stats().entries == 2


def test_the_least_recently_used_goes_first_and_a_restore_counts_as_a_use():
    h = HostCache(30, key_tokens=1)
    h.put([1, 1], chunk(10), 4)
    h.put([2, 2], chunk(10), 4)
    h.put([3, 3], chunk(10), 4)
    h.used(h.best([1, 1])[1])
    h.put([4, 4], chunk(10), 4)  # over the budget: [2, 2] is the oldest now
    assert [h.best([t, t])[0] for t in (1, 2, 3, 4)] == [2, 0, 2, 2]
    s = h.stats()
    assert s.bytes == 30 and s.restored == 1 and s.restored_tokens == 2


def test_what_exceeds_the_budget_or_the_key_is_not_kept():
    h = HostCache(10, key_tokens=4)
    assert not h.put([1, 2, 3, 4, 5], chunk(11), 4)
    assert not h.put([1, 2, 3], chunk(5), 4)  # shorter than a lookup's key
    assert h.put([1, 2, 3, 4, 5], chunk(10), 4)
    entry = h.best([1, 2, 3, 4, 5])[1]
    assert entry is not None and entry.spans() == [(0, 4), (4, 5)]
    with pytest.raises(ValueError):
        HostCache(-1)


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
