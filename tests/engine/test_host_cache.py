"""Host memory for cached prefixes (--cache-ram) on the demo model: a prefix past the KV's
share for idle prefixes leaves llama.cpp's cells for host memory, and a request that shares
it gets it back, a cache hit with exactly the logits of a local prefill."""

from __future__ import annotations

import pytest

from justllm.config import CPU_RESIDENT_BLOCKS, EngineConfig
from justllm.core.sampling_params import SamplingParams
from justllm.engine.engine import Engine
from tests.helpers import EXACT, divergence_is_noise, run_alone

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
    local = Engine(EngineConfig(model=model_path, max_seqs=4, pool_blocks=256, cache_ram=0))
    try:
        reference = run_alone(local, LONG + " Then", GREEDY)
    finally:
        local.close()
    if EXACT:
        assert restored[0] == reference[0]
        assert [lp.logprob for lp in restored[1]] == [lp.logprob for lp in reference[1]]
    else:
        ok, why = divergence_is_noise(reference[0], reference[1], restored[0], restored[1])
        assert ok, why
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
