"""The radix tree with no model: insert, match, split, lock, evict order, KV ops, accounting."""

from justllm.kv.block_pool import BlockPool
from justllm.kv.radix_cache import ClockPolicy, KVOp, RadixCache, freed_sequences


def cache(blocks=64, bs=4, **kw) -> RadixCache:
    return RadixCache(BlockPool(blocks, bs), **kw)


def test_insert_and_match_at_token_granularity():
    c = cache()
    assert c.insert([1, 2, 3, 4, 5, 6], seq=7, live=False) == []
    assert c.dump() == ["[1, 2, 3, 4, 5, 6]@0 h7"]
    m = c.match([1, 2, 3, 9], limit=4)
    assert m.length == 3 and [n.holder for n in m.nodes] == [7]
    assert m.copy_ops(dst=2) == [KVOp.cp(7, 2, 0, 3)]
    assert c.match([9, 1], limit=2).length == 0
    assert c.match([1, 2, 3, 4, 5, 6, 7], limit=4).length == 4  # limit: keep the last token
    assert c.pool.num_free == 64 - 2  # 6 tokens in blocks of 4


def test_second_insert_splits_and_drops_what_is_already_cached():
    c = cache()
    c.insert([1, 2, 3, 4, 5, 6], seq=7, live=False)
    ops = c.insert([1, 2, 3, 8, 9], seq=3, live=False)
    # seq 3's copy of [1,2,3] is redundant: dropped from it; [8,9] becomes its own node
    assert ops == [KVOp.rm(3, 0, 3)]
    assert c.dump() == ["[1, 2, 3]@0 h7", "  [4, 5, 6]@3 h7", "  [8, 9]@3 h3"]
    m = c.match([1, 2, 3, 8, 9, 10], limit=6)
    assert m.length == 5
    assert m.copy_ops(dst=0) == [KVOp.cp(7, 0, 0, 3), KVOp.cp(3, 0, 3, 5)]
    assert c.holds(7) and c.holds(3)
    assert c.num_blocks == 2  # 8 owned tokens in blocks of 4: accounting is by tokens


def test_fully_cached_insert_gives_the_sequence_back():
    c = cache()
    c.insert([1, 2, 3], seq=7, live=False)
    ops = c.insert([1, 2, 3], seq=4, live=False)
    assert ops == [KVOp.rm(4, 0, 3), KVOp.rm(4)]
    assert freed_sequences(ops) == [4] and not c.holds(4)


def test_locked_paths_are_not_evicted_and_lru_order_is_exact():
    c = cache()
    c.insert([1, 2], seq=1, live=False)
    c.insert([3, 4], seq=2, live=False)
    c.insert([5, 6], seq=3, live=False)
    c.match([1, 2], limit=2)  # touch seq 1's node: now the most recent
    m = c.match([3, 4], limit=2)
    c.lock(m.last)
    assert c.evict_one() == [KVOp.rm(3, 0, 2), KVOp.rm(3)]  # [5,6]: least recent, unlocked
    assert c.evict_one() == [KVOp.rm(1, 0, 2), KVOp.rm(1)]
    assert c.evict_one() is None  # [3,4] is locked
    c.unlock(m.last)
    assert c.evict_one() == [KVOp.rm(2, 0, 2), KVOp.rm(2)]
    assert c.pool.num_free == 64 and c.check() == []


def test_eviction_goes_leaf_first_and_lock_survives_a_split():
    c = cache()
    c.insert([1, 2, 3, 4], seq=1, live=False)
    m = c.match([1, 2, 3, 4, 5], limit=5)
    c.lock(m.last)
    c.insert([1, 2, 9], seq=2, live=False)  # splits the locked node
    assert c.dump() == ["[1, 2]@0 h1 L1", "  [3, 4]@2 h1 L1", "  [9]@2 h2"]
    assert c.evict_one() == [KVOp.rm(2, 2, 3), KVOp.rm(2)]
    assert c.evict_one() is None
    c.unlock(m.last)
    assert c.dump() == ["[1, 2]@0 h1", "  [3, 4]@2 h1"]
    assert c.evict_one() == [KVOp.rm(1, 2, 4)]  # the leaf first, the holder still holds [1,2]
    assert c.evict_one() == [KVOp.rm(1, 0, 2), KVOp.rm(1)]


def test_live_nodes_are_shared_but_never_evicted_until_handed_over():
    c = cache()
    assert c.insert([1, 2, 3, 4, 5], seq=0, live=True) == []
    assert c.pool.num_free == 64  # live: counted in the running request's blocks
    assert c.match([1, 2, 3, 4, 5, 6], limit=6).length == 5
    assert c.evict_one() is None
    ops = c.insert([1, 2, 3, 4, 5, 6, 7], seq=0, live=False)  # the request ends
    assert ops == []
    assert c.dump() == ["[1, 2, 3, 4, 5]@0 h0", "  [6, 7]@5 h0"]
    assert c.num_blocks == 2  # 7 tokens
    assert c.check() == []


def test_pool_too_full_drops_the_uncached_tail():
    c = cache(blocks=2, bs=4)
    c.pool.allocate(1)
    ops = c.insert(list(range(1, 10)), seq=5, live=False)  # 9 tokens need 3 blocks, 1 free
    assert ops == [KVOp.rm(5, 0, -1), KVOp.rm(5)]
    assert c.dump() == []


def test_cap_on_cache_blocks_evicts_lru_and_the_last_victim_keeps_its_head():
    c = cache(max_blocks=2)
    c.insert([1, 2, 3, 4], seq=1, live=False)
    c.insert([5, 6, 7, 8], seq=2, live=False)
    ops = c.insert([9, 10], seq=3, live=False)
    assert ops == [KVOp.rm(1, 2, 4)]  # 10 tokens, room for 8: the LRU prefix loses 2
    assert c.num_blocks == 2 and c.match([1, 2, 3], limit=3).length == 2
    ops = c.insert([11, 12, 13, 14, 15, 16], seq=4, live=False)
    # 14 tokens, 6 too many: [1, 2] was just matched, so [5..8] and [9, 10] go whole.
    assert ops == [KVOp.rm(2, 0, 4), KVOp.rm(2), KVOp.rm(3, 0, 2), KVOp.rm(3)]
    assert c.num_blocks == 2 and c.num_tokens == 8 and c.check() == []


def test_a_prefix_longer_than_the_cap_keeps_the_head_that_fits():
    c = cache(max_blocks=3)
    ops = c.insert(list(range(1, 21)), seq=1, live=False)  # 20 tokens, room for 12
    assert ops == [KVOp.rm(1, 12, 20)]
    assert c.match(list(range(1, 21)), limit=19).length == 12
    assert c.num_blocks == 3 and c.check() == []


def test_evicting_for_blocks_frees_what_is_asked_and_no_more():
    c = cache(blocks=8, bs=4)
    c.insert(list(range(1, 25)), seq=1, live=False)  # 6 blocks
    c.pool.allocate(2)  # a running request's
    ops = c.evict_blocks(3)  # 0 free, 3 needed: the prefix loses its last 3 blocks
    assert ops == [KVOp.rm(1, 12, 24)]
    assert c.pool.num_free == 3 and c.match(list(range(1, 25)), limit=23).length == 12
    assert c.evict_blocks(3) == []  # already free
    ops = c.evict_blocks(7)  # more than the cache holds: all of it goes
    assert ops == [KVOp.rm(1, 0, 12), KVOp.rm(1)] and c.pool.num_free == 6
    assert c.check() == []


def test_flush_and_evict_for_blocks_and_holders():
    c = cache(blocks=4, bs=4)
    c.insert([1, 2, 3, 4], seq=1, live=False)
    c.insert([5, 6, 7, 8], seq=2, live=False)
    c.insert([5, 6, 7, 8, 9], seq=3, live=False)
    assert c.pool.num_free == 1
    c.evict_blocks(2)
    assert c.pool.num_free >= 2
    assert len(freed_sequences(c.evict_holder())) == 1
    c.flush()
    assert c.pool.num_free == 4 and c.dump() == []


def test_clock_policy_spares_recently_used_once():
    c = cache(policy=ClockPolicy())
    c.insert([1], seq=1, live=False)
    c.insert([2], seq=2, live=False)
    for n in c._nodes():
        n.referenced = False
    c.match([1], limit=1)  # sets the reference bit of [1]
    assert c.evict_one()[0] == KVOp.rm(2, 0, 1)


def test_stats():
    c = cache()
    c.record_lookup(10, 0)
    c.record_lookup(10, 8)
    s = c.stats()
    assert (s.hits, s.misses, s.queried_tokens, s.hit_tokens) == (1, 1, 20, 8)
    assert s.hit_ratio == 0.5


def test_splits_cost_no_blocks_on_a_full_pool():
    """Per-node block rounding made a split need a block; on a full pool the split failed and
    the insert replaced the node it could not split (its blocks and holder leaked)."""
    c = cache(blocks=2, bs=4)
    c.insert([1, 2, 3, 4, 5, 6, 7, 8], seq=1, live=False)
    assert c.pool.num_free == 0
    c.insert([1, 2, 9], seq=0, live=True)  # splits [1..8] at 2 with no block free
    assert c.dump() == ["[1, 2]@0 h1", "  [3, 4, 5, 6, 7, 8]@2 h1", "  [9]@2 h0 live"]
    assert c.num_blocks == 2 and c.check() == []


def test_a_hand_over_right_after_release_always_fits():
    """A running request's live prompt, split by later inserts into several nodes, is owned in
    full when the request ends and gives its blocks back, even on a pool with nothing free:
    before, the third piece found no block, stayed live with its holder's cells dropped, and
    the next request that matched it failed in llama_decode."""
    c = cache(blocks=4, bs=4)
    prompt = list(range(1, 9))  # 8 tokens: the request holds 2 blocks
    request_blocks = c.pool.allocate(2)
    c.insert(prompt, seq=0, live=True)
    c.insert(prompt[:3] + [50], seq=1, live=True)  # splits the live node at 3
    c.insert(prompt[:5] + [60], seq=2, live=True)  # and at 5: pieces of 3, 2 and 3 tokens
    c.pool.allocate(c.pool.num_free)  # the rest of the pool is taken by others
    c.pool.free(request_blocks)  # the request is aborted right after its prefill
    ops = c.insert(prompt, seq=0, live=False)
    assert ops == []
    assert [line for line in c.dump() if "h0" in line] == [
        "[1, 2, 3]@0 h0", "  [4, 5]@3 h0", "    [6, 7, 8]@5 h0"]
    assert c.num_blocks == 2 and c.pool.num_free == 0 and c.check() == []


def test_held_and_live_ranges():
    c = cache()
    c.insert([1, 2, 3], seq=4, live=False)
    c.insert([1, 2, 3, 4, 5], seq=0, live=True)
    assert c.held_ranges() == {4: [(0, 3)]}
    assert c.live_ranges() == {0: [(3, 5)]}


def test_holding_a_match_that_ends_inside_a_node_pins_only_the_matched_tokens():
    """A request that shares the first 3 tokens of a long cached prompt holds those 3: the rest
    of the node can still be evicted to make it room (locking the whole node pinned it all,
    and such a request could never be admitted)."""
    c = cache(blocks=12, bs=4)
    long = list(range(1, 41))  # 10 blocks, one node
    c.insert(long, seq=1, live=False)
    match = c.match([1, 2, 3, 99, 98], limit=4)
    assert match.length == 3
    node = c.hold(match)
    assert node is match.last and (node.start, node.end) == (0, 3)
    assert match.copy_ops(5) == [KVOp.cp(1, 5, 0, 3)]
    ops = c.evict_blocks(11)  # 2 free, 11 needed: all but the held head goes
    assert ops == [KVOp.rm(1, 4, 40)] and c.pool.num_free == 11
    assert c.match(long, limit=40).length == 4  # the head's block keeps 4 tokens
    c.unlock(node)
    assert c.check() == []
    whole = c.match(long, limit=40)  # a match to a node's end cuts nothing
    assert c.hold(whole) is whole.last and whole.last.end == 4


def test_idle_blocks_are_the_cached_blocks_no_running_request_uses():
    """vLLM's KV usage counts such blocks as free; an idle server's usage read 100%."""
    c = cache()
    c.insert([1, 2, 3, 4, 5, 6, 7, 8], seq=1, live=False)  # a finished request: 2 blocks
    c.insert([9, 10, 11, 12], seq=2, live=False)  # another: 1 block
    assert c.num_blocks == 3 and c.idle_blocks() == 3
    held = c.hold(c.match([1, 2, 3, 4, 5, 6, 99], limit=7))  # a running request reuses 6
    assert c.idle_blocks() == 1  # its 6 tokens take 2 blocks; the other request's block is idle
    assert c.stats().idle_blocks == 1
    c.insert([20, 21, 22, 23], seq=3, live=True)  # a live node is its request's own block
    assert c.idle_blocks() == 1
    c.unlock(held)
    assert c.idle_blocks() == 3 and c.check() == []
