"""The radix prefix cache on the real model: same outputs, shared prefixes computed once."""

from __future__ import annotations

from dataclasses import replace

import pytest

from justllm.config import EngineConfig
from justllm.core.sampling_params import SamplingParams
from justllm.engine.engine import Engine
from tests.helpers import divergence_is_noise

SYSTEM = " ".join(f"Rule {i}: answer politely and briefly, citing rule {i}." for i in range(80))
QUESTIONS = [f" Question {i}: what is {i} plus {i}?" for i in range(16)]


def make(model_path, **kw) -> Engine:
    return Engine(EngineConfig(model=model_path, **{"max_seqs": 16, "pool_blocks": 512, **kw}))


@pytest.fixture(scope="module")
def cached(model_path):
    e = make(model_path)
    yield e
    e.close()


def run_collect(engine, prompts, params):
    """Run together; id -> (tokens, logprobs, final metrics)."""
    ids = [engine.add_request(p, params) for p in prompts]
    out = {i: ([], [], None) for i in ids}
    while any(out[i][2] is None for i in ids):
        for o in engine.step():
            toks, lps, _ = out[o.request_id]
            toks += o.token_ids
            lps += o.logprobs or []
            if o.finished:
                out[o.request_id] = (toks, lps, o.metrics)
    return [out[i] for i in ids]


def assert_pool_free_after_flush(engine):
    engine.flush_prefix_cache()
    engine.step()
    assert engine.stats().kv_blocks.used == 0
    assert all(engine.backend.seq_pos_max(s) == -1 for s in range(engine.backend.config.n_seq_max))


def test_shared_system_prompt_is_computed_once(cached):
    assert len(cached.tokenize(SYSTEM)) >= 1000
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    results = run_collect(cached, [SYSTEM + q for q in QUESTIONS], params)
    n_system = len(cached.tokenize(SYSTEM))
    decoded = sum(m.num_computed_tokens for _, _, m in results)
    own = sum(m.num_prompt_tokens - n_system + 7 for _, _, m in results)  # suffixes + decodes
    # Computed once, plus at most one block of it per request around the block-aligned wait.
    assert decoded <= n_system + own + 16 * cached.config.block_size, (decoded, n_system, own)
    assert decoded < 2 * n_system  # without the cache: 16x the system prompt
    stats = cached.stats().prefix_cache
    assert stats.hits >= 15 and stats.hit_tokens >= 15 * (n_system - cached.config.block_size)
    assert all(len(t) == 8 for t, _, _ in results)
    assert_pool_free_after_flush(cached)


def test_output_with_cache_equals_output_without(model_path, cached):
    params = SamplingParams(max_tokens=16, logprobs=5, ignore_eos=True)
    prompts = [SYSTEM + q for q in QUESTIONS[:2]]  # (each reference computes 1,000 tokens)
    plain = make(model_path, prefix_cache=False)
    try:
        reference = [(t, lp) for t, lp, _ in (run_collect(plain, [p], params)[0] for p in prompts)]
    finally:
        plain.close()
    run_collect(cached, [SYSTEM], SamplingParams(max_tokens=1))  # warm the prefix
    got = run_collect(cached, prompts, params)
    assert all(m.num_cached_tokens > 1000 for _, _, m in got)
    for (ref, ref_lp), (toks, lps, _) in zip(reference, got):
        ok, why = divergence_is_noise(ref, ref_lp, toks, lps)
        assert ok, why
    assert_pool_free_after_flush(cached)


def test_fully_cached_prompt_recomputes_only_its_last_token(cached):
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    prompt = SYSTEM + QUESTIONS[0]
    (_, _, first), = run_collect(cached, [prompt], params)
    (_, _, second), = run_collect(cached, [prompt], params)
    assert second.num_cached_tokens == second.num_prompt_tokens - 1
    assert second.num_computed_tokens == 1 + 3  # the last prompt token, then 3 decodes
    assert first.num_computed_tokens > 1000
    assert_pool_free_after_flush(cached)


def test_a_request_that_does_not_cache_its_prompt_computes_it_whole(cached):
    """llama-server's cache_prompt: false takes nothing from the prefix cache (it was a 400):
    the cached prompt is computed again, every token, and its answer is the whole
    computation's (greedy: the tokens of the first run, up to noise)."""
    params = SamplingParams(max_tokens=4, logprobs=5, ignore_eos=True)
    prompt = SYSTEM + QUESTIONS[1]
    (first, first_lp, _), = run_collect(cached, [prompt], params)
    hits = cached.stats().prefix_cache.hits
    (again, again_lp, m2), = run_collect(cached, [prompt], replace(params, cache_prompt=False))
    assert m2.num_cached_tokens == 0 and m2.num_computed_tokens == m2.num_prompt_tokens + 3
    assert cached.stats().prefix_cache.hits == hits
    ok, why = divergence_is_noise(first, first_lp, again, again_lp)
    assert ok, why
    (_, _, m3), = run_collect(cached, [prompt], params)  # the cache still serves the others
    assert m3.num_cached_tokens == m3.num_prompt_tokens - 1
    with pytest.raises(ValueError, match="cache_prompt must be true or false"):
        SamplingParams(cache_prompt=0)
    assert_pool_free_after_flush(cached)


def test_eviction_under_a_small_pool_keeps_requests_correct(model_path):
    params = SamplingParams(max_tokens=16, logprobs=5, ignore_eos=True)
    # 8 prompts of ~95 tokens (6 blocks) and 16 tokens out, 4 at a time in 20 blocks: the pool
    # cannot hold the 4 as they grow (requests are preempted) and the second round finds the
    # first round's prefixes evicted, or one of them still cached
    prompts = [f"Story {i}: " + " ".join(f"word{i}_{j}" for j in range(20)) for i in range(8)]
    plain = make(model_path, prefix_cache=False, pool_blocks=96)  # all 8 at once, no eviction
    try:
        reference = run_collect(plain, prompts, params)
    finally:
        plain.close()
    small = make(model_path, pool_blocks=20, max_seqs=4)
    try:
        for _ in range(2):
            got = run_collect(small, prompts, params)
            for (ref, ref_lp, _), (toks, lps, _) in zip(reference, got):
                ok, why = divergence_is_noise(ref, ref_lp, toks, lps)
                assert ok, why
        stats = small.stats()
        assert stats.num_preemptions_total > 0
        assert stats.prefix_cache.blocks <= 20 and stats.kv_blocks.used == stats.prefix_cache.blocks
        assert_pool_free_after_flush(small)
    finally:
        small.close()


def test_prefix_cache_cap_and_off_switch(model_path):
    # Two unrelated prompts of more than 4 blocks each: together past the cap, so the older
    # loses its tail, down to what fits, and keeps its head; the newer stays whole.
    prompts = [" ".join(f"{word}{i}" for i in range(40)) for word in ("alpha", "beta")]
    # (without host memory: with it the older prefix moves there whole, tests/engine/
    # test_host_cache.py)
    capped = make(model_path, prefix_cache_blocks=8, cache_ram=0)
    try:
        for prompt in prompts:
            run_collect(capped, [prompt], SamplingParams(max_tokens=2))
        assert capped.stats().prefix_cache.blocks == 8
        n_alpha = len(capped.tokenize(prompts[0]))
        assert n_alpha > 4 * capped.config.block_size
        again = run_collect(capped, [prompts[0]], SamplingParams(max_tokens=2))[0][2]
        assert 1 < again.num_cached_tokens < n_alpha - 1  # more than the shared BOS
        assert capped.stats().prefix_cache.blocks == 8
    finally:
        capped.close()
    off = make(model_path, prefix_cache=False)
    try:
        run_collect(off, [prompts[0], prompts[0]], SamplingParams(max_tokens=2))
        s = off.stats()
        assert s.prefix_cache.hits == 0 and s.kv_blocks.used == 0
    finally:
        off.close()


@pytest.mark.parametrize("spare", [-1, 32])
def test_a_load_that_sends_its_cached_prompts_again_runs_every_request_at_once(model_path, spare):
    """Each cached prompt is held by a sequence id of its own, pinned while a request that hit
    it runs. At max_seqs requests that each send a cached prompt again, the default spare ids
    (one per running request and more) let all of them run together, each hitting its prompt;
    the old default of 32 at 40 sequences could not (the parametrisation shows the test can
    tell)."""
    n = 40
    e = make(model_path, max_seqs=n, pool_blocks=1024, cache_ram=0, spare_seq_ids=spare)
    try:
        assert e.config.spare_seq_ids == (48 if spare == -1 else 32)
        prompts = [f"Request {i}: " + " ".join(f"river{i}_{j}" for j in range(5))
                   for i in range(n)]
        assert len(e.tokenize(prompts[0])) > e.config.block_size  # a whole block to hit
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        run_collect(e, prompts, SamplingParams(max_tokens=1))  # (their prompts cached)
        for p in prompts:
            e.add_request(p, params)
        peak = 0
        while e.has_unfinished():
            e.step()
            peak = max(peak, len(e.scheduler.running))
        all_at_once_all_hit = peak == n and e.stats().prefix_cache.hits >= n
        # (short of ids, requests wait for one, or the cache gives up holders: prompts missed)
        assert all_at_once_all_hit == (spare == -1)
    finally:
        e.close()
