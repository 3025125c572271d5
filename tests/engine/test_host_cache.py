"""Host memory for cached prefixes (--cache-ram) on the demo model: a prefix past the KV's
share for idle prefixes leaves llama.cpp's cells for host memory, and a request that shares
it gets it back, a cache hit with exactly the logits of a local prefill."""

from __future__ import annotations

import pytest

from justllm.config import CPU_RESIDENT_BLOCKS, EngineConfig
from justllm.core.sampling_params import SamplingParams
from justllm.engine.engine import Engine
from tests.helpers import assert_same_run, run_all, run_alone, run_in_fresh_engine

# Past the model's 512-token sliding window: kept in window-sized chunks.
LONG = "Rivers carve valleys, winds shape dunes, and glaciers grind mountains to sand. " * 40
GREEDY = SamplingParams(max_tokens=8, temperature=0, logprobs=5, ignore_eos=True)
SHORT = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)


def settled(engine: Engine) -> None:
    engine.runner.apply_kv_ops(engine.scheduler.take_kv_ops())
    engine.check_kv()


def cells(engine: Engine) -> int:
    """The KV cells llama.cpp holds, over every sequence id."""
    b = engine.backend
    return sum(b.seq_pos_max(s) - b.seq_pos_min(s) + 1
               for s in range(b.config.n_seq_max) if b.seq_pos_max(s) >= 0)


@pytest.fixture(scope="module")
def engine(model_path):
    e = Engine(EngineConfig(model=model_path, max_seqs=4, pool_blocks=256, cache_ram=256,
                            prefix_cache_blocks=8))
    yield e
    e.close()


def test_a_prefix_past_the_share_moves_to_host_memory_and_back_with_the_same_logits(
        engine, model_path):
    engine.flush_prefix_cache()
    n = len(engine.tokenize(LONG))
    run_alone(engine, LONG, SHORT)
    settled(engine)
    host = engine.stats().host_cache
    # the prompt and the one token computed after it (the last token is never computed)
    assert host.entries == 1 and host.tokens == n + 1 and host.bytes > n * 1024
    assert engine.stats().prefix_cache.blocks <= 8 and cells(engine) <= 8 * 16

    before = engine.stats().prefix_cache
    restored = run_alone(engine, LONG + " Then", GREEDY)
    after = engine.stats()
    assert after.host_cache.restored == host.restored + 1
    assert after.prefix_cache.hit_tokens - before.hit_tokens >= n - 1  # (its last token differs)
    reference = run_in_fresh_engine(EngineConfig(model=model_path, max_seqs=4, pool_blocks=256,
                                                 cache_ram=0), LONG + " Then", GREEDY)
    assert_same_run(reference, restored)
    settled(engine)


def test_an_entry_in_host_memory_is_exported_and_a_flush_forgets_it(engine):
    engine.flush_prefix_cache()
    run_alone(engine, LONG, SHORT)
    tokens = engine.tokenize(LONG)
    assert engine.stats().host_cache.entries == 1 and engine.cache.match(tokens, 99).length < 99
    engine.export_prefix(tokens)  # (copied back first: PD's prefill replica exports it)
    settled(engine)
    engine.flush_prefix_cache()
    assert engine.stats().host_cache.entries == 0
    settled(engine)
    assert cells(engine) == 0


def test_an_import_of_a_prefix_in_host_memory_is_here_already_and_comes_back_for_a_request(
        engine):
    """PD's decode replica handed a prefix it moved to host memory takes it as cached, with
    no room asked for (a request sharing its head may hold the pool), and the request that
    needs it gets it back from there."""
    engine.flush_prefix_cache()
    tokens = engine.tokenize(LONG)
    run_alone(engine, LONG, SHORT)
    blob = engine.export_prefix(tokens)  # (copied back into the KV first)
    run_alone(engine, "Something else entirely.", SHORT)  # a step: past the share, out again
    settled(engine)
    assert engine.cache.match(tokens, len(tokens)).length < len(tokens)
    before = engine.stats()
    assert engine.import_prefix(blob) == len(tokens)
    settled(engine)
    assert engine.stats().prefix_cache.blocks == before.prefix_cache.blocks  # nothing loaded
    run_alone(engine, LONG + " Then", SHORT)
    after = engine.stats()
    assert after.host_cache.restored == before.host_cache.restored + 1
    assert after.prefix_cache.hit_tokens - before.prefix_cache.hit_tokens >= len(tokens) - 1
    settled(engine)


def test_without_host_memory_the_share_only_drops(model_path):
    e = Engine(EngineConfig(model=model_path, max_seqs=4, pool_blocks=256, cache_ram=0,
                            prefix_cache_blocks=8))
    try:
        run_alone(e, LONG, SHORT)
        settled(e)
        assert e.host_cache is None and e.stats().host_cache.entries == 0
        assert 0 < e.stats().prefix_cache.blocks <= 8  # the head that fits stays
    finally:
        e.close()


def test_a_cpu_engine_keeps_its_default_share_of_idle_prefixes_in_the_kv(model_path):
    e = Engine(EngineConfig(model=model_path, max_seqs=4, pool_blocks=256))
    try:
        assert e.config.cache_ram == 8192 and e.host_cache is not None
        run_alone(e, LONG * 2, SHORT)  # 1,200 tokens: 76 blocks
        settled(e)
        assert e.stats().prefix_cache.blocks <= CPU_RESIDENT_BLOCKS
        assert e.stats().host_cache.stored >= 1
    finally:
        e.close()


def test_prefixes_share_their_chunks_and_a_restore_goes_on_from_the_head_in_the_kv(model_path):
    """Two prompts after one 200-token head: past a 16-block share both tails go to host
    memory, the head stays in the KV (their common parent), and their first chunk is kept
    once. A prompt that goes on from the first tail gets back only the chunks past the head,
    with exactly the logits of a local prefill."""
    e = Engine(EngineConfig(model=model_path, max_seqs=4, pool_blocks=256, cache_ram=256,
                            prefix_cache_blocks=16))
    try:
        words = e.tokenize(" apple river stone light")
        bos, vocab = words[0], words[1:]
        head = [bos] + [vocab[i % 4] for i in range(199)]
        tail_a = [vocab[(3 * i + 1) % 4] for i in range(150)]
        tail_b = [vocab[(i // 2) % 4] for i in range(150)]
        assert tail_a[0] != tail_b[0]
        run_all(e, [head + tail_a, head + tail_b], SHORT)  # both in the tree at once
        settled(e)
        host = e.stats().host_cache
        chunk = e.host_cache.chunk_tokens
        assert host.entries == 2 and e.stats().prefix_cache.blocks == 13  # the head's 200
        per_chunk = host.bytes / (1 + 2 * 2)  # one shared chunk, two of each tail's own
        assert host.bytes == pytest.approx(5 * per_chunk) and per_chunk > chunk * 1024 * 0.9

        prompt = head + tail_a + [vocab[0]] * 20
        shared, _ = e.host_cache.best(prompt[:-1])  # (the last token is never taken)
        assert shared >= len(head + tail_a)
        before = e.stats()
        restored = run_alone(e, prompt, GREEDY)
        after = e.stats()
        assert after.host_cache.restored == before.host_cache.restored + 1
        # from the chunk that holds the head's end (its start is in the KV: copied again)
        assert (after.host_cache.restored_tokens - before.host_cache.restored_tokens
                == shared - chunk)
        assert after.prefix_cache.hit_tokens - before.prefix_cache.hit_tokens == shared
        settled(e)
    finally:
        e.close()
    reference = run_in_fresh_engine(EngineConfig(model=model_path, max_seqs=4, pool_blocks=256,
                                                 cache_ram=0), prompt, GREEDY)
    assert_same_run(reference, restored)


@pytest.mark.parametrize("floor", [0, 16])
def test_where_the_share_is_the_whole_pool_the_floor_moves_idle_prefixes_out(model_path, floor):
    """A GPU engine's prefix cache may fill the whole pool (its share is the pool): the end of
    a step moves idle prefixes to host memory while fewer blocks than its floor are free
    (``kv/host_cache.free_floor``; set here as a GPU engine sets it), where the scheduler
    would otherwise drop them for room. Without a floor (0) the prefix stays in the KV."""
    e = Engine(EngineConfig(model=model_path, max_seqs=4, pool_blocks=48, cache_ram=64,
                            prefix_cache_blocks=48))
    try:
        e._free_floor = floor
        n = len(e.tokenize(LONG))
        assert 48 - 16 < n // 16 < 48  # the prefix leaves fewer free blocks than the floor
        run_alone(e, LONG, SHORT)
        settled(e)
        host = e.stats().host_cache
        if not floor:
            assert host.entries == 0 and e.stats().prefix_cache.blocks >= n // 16
            return
        assert host.entries == 1 and host.tokens == n + 1
        assert e.pool.num_free >= floor and cells(e) < 16 * 16
        before = e.stats().prefix_cache
        restored = run_alone(e, LONG + " Then", GREEDY)
        assert e.stats().host_cache.restored == 1
        assert e.stats().prefix_cache.hit_tokens - before.hit_tokens >= n - 1
        reference = run_in_fresh_engine(EngineConfig(model=model_path, max_seqs=4,
                                                     pool_blocks=256, cache_ram=0),
                                        LONG + " Then", GREEDY)
        assert_same_run(reference, restored)
        settled(e)
    finally:
        e.close()
