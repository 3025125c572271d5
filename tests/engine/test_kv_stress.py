"""Randomised concurrent load on the real model: shared prefixes, a small pool, disconnects.

Requests arrive at random through the AsyncEngine with prompts from a four-token vocabulary
(shared prefixes of every length, one-token ones and exact duplicates included; some ask for
their prompt's logprobs, or say cache_prompt false, so every prompt token is computed beside
the others' chunks), the pool is
small enough that the prefix cache evicts and running requests are preempted, prompts run past
the model's 512-token sliding window (where llama.cpp reuses cells), and clients leave
at random points: before their first token (mid-prefill), after a few tokens (mid-decode), or by
cancelling their task while ``llama_decode`` runs. The engine's KV check is on
(tests/conftest.py), so after every step llama.cpp's own view of each sequence id is compared
with the scheduler's and the prefix cache's; a difference fails the step and shows up here as a
failed request. Idle, the pool must hold exactly what the prefix cache holds, and nothing once
the cache is flushed.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from dataclasses import replace

import pytest

from justllm.config import EngineConfig
from justllm.core.sampling_params import SamplingParams
from justllm.engine.async_engine import AsyncEngine
from justllm.engine.engine import Engine
from justllm.engine.sampler import RequestSampler
from justllm.kv.transfer import KVTransferError
from tests.helpers import count_graph_tokens

SEEDS = (1,)  # (seeds 2 and 3 as well cost ~65 s of the suite: seven variants below run
#  the same load with other seeds, 3 to 7)


def make_prompts(rng: random.Random, vocab: list[int], bos: int, n: int) -> list[list[int]]:
    prompts: list[list[int]] = []
    for _ in range(n):
        kind = rng.random()
        if prompts and kind < 0.15:
            prompts.append(list(rng.choice(prompts)))  # exact duplicate
        elif prompts and kind < 0.5:  # an earlier prompt's prefix of any length, then more
            base = rng.choice(prompts)
            cut = rng.randint(1, len(base))
            prompts.append(base[:cut] + [rng.choice(vocab) for _ in range(rng.randint(0, 60))])
        else:
            prompts.append([bos] + [rng.choice(vocab)
                                    for _ in range(rng.choice((1, 2, 8, 40, 120, 220, 650)))])
    return [p[:700] for p in prompts]


async def one_client(a: AsyncEngine, rng: random.Random, prompt: list[int], i: int,
                     results: dict, unseeded: bool = False) -> None:
    """``unseeded``: every other request has no seed (with --backend-sampling the graph
    chooses its tokens, or takes the candidates a top-p or top-k draw is drawn from, and a
    seeded request's are chosen on the host)."""
    await asyncio.sleep(rng.uniform(0, 4))  # random arrivals
    params = SamplingParams(max_tokens=rng.randint(1, 12), temperature=rng.choice((0.0, 0.8)),
                            top_p=rng.choice((1.0, 0.9, 0.9)) if unseeded else 1.0,
                            top_k=rng.choice((0, 0, 40)) if unseeded else 0,
                            seed=None if unseeded and i % 2 == 0 else i, ignore_eos=True,
                            cache_prompt=i % 7 != 5)  # (some computed whole, cache beside)
    if i % 4 == 1 and len(prompt) <= 60:  # every prompt token computed, an output row each
        params = replace(params, prompt_logprobs=i % 3,  # some only scored, nothing drawn
                         max_tokens=0 if i % 8 == 1 else params.max_tokens)
    elif i % 8 == 6:  # only computed, into the cache (llama-server's n_predict 0 warm-up)
        params = replace(params, max_tokens=0)
    elif i % 8 == 3:  # a reasoning model's thinking budget: the end tag forced past it
        params = replace(params, thinking_budget=i % 3, thinking_tags=("<think>", "</think>"),
                         thinking_open=True, max_tokens=12)
    mode = rng.random()
    outs = []

    async def consume(limit: int | None) -> None:
        async with contextlib.aclosing(a.generate(prompt, params)) as gen:
            async for out in gen:
                outs.append(out)
                if limit is not None and len(outs) >= limit:
                    return

    if mode < 0.15:  # cancelled at a random moment, often while its prompt is computed
        task = asyncio.create_task(consume(None))
        await asyncio.sleep(rng.uniform(0.0, 0.6))
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        results["cancelled"] += 1
    elif mode < 0.3:  # leaves after a few tokens (mid-decode)
        await consume(rng.randint(1, 3))
        results["left"] += 1
    else:
        await consume(None)
        assert not [o.error for o in outs if o.error]
        assert outs and outs[-1].finished
        tokens = sum(len(o.token_ids) for o in outs)
        assert tokens == params.max_tokens, (i, tokens, params.max_tokens)
        results["completed"] += 1
        if params.thinking_budget >= 0:  # (random words: the model never ends it itself)
            ids = [t for o in outs for t in o.token_ids]
            closing = a.tokenize("\n</think>\n\n", add_special=False)
            at = params.thinking_budget
            assert ids[at:at + len(closing)] == closing, (i, ids)
            results["thinking"] += 1
    errors = [o.error for o in outs if o.error]
    assert not errors, errors
    if params.prompt_logprobs is not None and outs:  # with the first token, once
        assert [o.prompt_logprobs is not None for o in outs] == [True] + [False] * (len(outs) - 1)
        lps = outs[0].prompt_logprobs
        assert lps[0] is None and [lp.token_id for lp in lps[1:]] == prompt[1:]
        assert all(lp.logprob <= 0 and lp.rank >= 1 and len(lp.top) == params.prompt_logprobs
                   for lp in lps[1:])
        results["prompt_logprobs"] += 1


@pytest.mark.parametrize("seed", SEEDS)
def test_random_concurrent_load_keeps_kv_consistent(model_path, seed):
    engine = Engine(EngineConfig(model=model_path, max_seqs=6, max_prefill=3, pool_blocks=80,
                                 block_size=16, spare_seq_ids=6, chunk_size=64, n_batch=128))
    assert engine.config.check_kv  # set by tests/conftest.py: every step is checked
    a = AsyncEngine(engine)
    try:
        asyncio.run(_drive(a, engine, seed))
    finally:
        a.close()


@pytest.mark.parametrize("share, floor, seed", [(6, 0, 5), (80, 24, 6)])
def test_host_memory_under_random_concurrent_load_keeps_kv_consistent(model_path, share, floor,
                                                                      seed):
    """The same load with host memory for idle prefixes (--cache-ram) and room in the KV for
    ``share`` blocks of them: 6 (a CPU's way: past the share they move out), or the whole pool
    (a GPU's) with a floor of free blocks the ends of steps keep by moving them out
    (``kv/host_cache.free_floor``, set here as a GPU engine sets it). Prefixes move out at the
    ends of steps and back in for requests that share them, beside requests that share,
    evict, preempt and leave; every step is KV-checked."""
    engine = Engine(EngineConfig(model=model_path, max_seqs=6, max_prefill=3, pool_blocks=80,
                                 block_size=16, spare_seq_ids=6, chunk_size=64, n_batch=128,
                                 cache_ram=64, prefix_cache_blocks=share))
    engine._free_floor = floor
    a = AsyncEngine(engine)
    try:
        asyncio.run(_drive(a, engine, seed, rounds=2, n_prompts=20))
        host = engine.stats().host_cache
        assert host.stored >= 5 and host.restored >= 3, host
    finally:
        a.close()


def test_backend_sampling_under_random_concurrent_load_keeps_kv_consistent(model_path,
                                                                          monkeypatch):
    """The same load with --backend-sampling: the unseeded plain requests' tokens are chosen
    in the graph (top-p ones drawn from the candidates the graph took), the others' (seeded,
    prompt logprobs, thinking budgets) on the host, in the same batches, with sequence ids
    passing from one kind to the other as requests come, go, are preempted and leave. Most
    candidate draws are left undecided at random, so their rows are computed again (a
    cell dropped and decoded anew) amid all that. Every step is KV-checked; every kind must
    have run."""
    engine = Engine(EngineConfig(model=model_path, max_seqs=6, max_prefill=3, pool_blocks=80,
                                 block_size=16, spare_seq_ids=6, chunk_size=64, n_batch=128,
                                 backend_sampling=True))
    counted = count_graph_tokens(engine)
    coin, draw = random.Random(7), RequestSampler.draw_candidates
    monkeypatch.setattr(RequestSampler, "draw_candidates",
                        lambda self, *a: draw(self, *a) if coin.random() < 0.4 else None)
    a = AsyncEngine(engine)
    try:
        asyncio.run(_drive(a, engine, 5, unseeded=True))
        assert counted["graph"] > 10 and counted["candidates"] > 8, counted
        assert counted["again"] >= 3, counted  # (about 6 here)
        assert engine.stats().generation_tokens_total > (counted["graph"]
                                                         + counted["candidates"] + 20)
    finally:
        a.close()


@pytest.mark.parametrize("spec, seed", [("ngram", 3), ("tree", 4)])
def test_speculation_under_random_concurrent_load_keeps_kv_consistent(model_path, spec, seed):
    """The same load with speculation: drafts are verified beside prefills, cut to the free
    blocks, rejected or accepted while other requests share, evict, preempt and leave; a tree
    puts each extra leaf in a sequence id of its own and copies the winner back (the demo
    model drafts for itself, so most drafts are accepted). Every step is KV-checked."""
    engine = Engine(EngineConfig(model=model_path, max_seqs=6, max_prefill=3, pool_blocks=80,
                                 block_size=16, spare_seq_ids=6, chunk_size=64, n_batch=128,
                                 spec=spec, draft_model=model_path if spec == "tree" else None))
    a = AsyncEngine(engine)
    try:
        asyncio.run(_drive(a, engine, seed))
        stats = engine.stats().spec
        assert stats is not None and stats.num_drafts > 5 and stats.num_accepted_tokens > 0
    finally:
        a.close()


def test_kv_imports_under_random_concurrent_load_keep_kv_consistent(model_path):
    """Prefill/decode hand-overs while the same random load runs: a second engine computes
    prompts of the workload (prefixes of every length), draws their first tokens and exports
    them; each blob is imported into the loaded engine at a random moment, beside requests
    that share, evict and preempt, and the request goes on there from its first token (some
    leave early). Imports that find no room are refused; every step is KV-checked."""
    config = dict(model=model_path, max_seqs=6, max_prefill=3, pool_blocks=80, block_size=16,
                  spare_seq_ids=6, chunk_size=64, n_batch=128)
    engine, source = Engine(EngineConfig(**config)), Engine(EngineConfig(**config))
    a, b = AsyncEngine(engine), AsyncEngine(source)
    try:
        asyncio.run(_drive(a, engine, 4, transfers=b))
    finally:
        a.close()
        b.close()


async def _transfer_client(a: AsyncEngine, source: AsyncEngine, rng: random.Random,
                           prompts: list[list[int]], results: dict) -> None:
    for i in range(10):
        prompt = rng.choice(prompts)[:rng.randint(2, 400)]
        params = SamplingParams(max_tokens=rng.randint(1, 8),
                                temperature=rng.choice((0.0, 0.8)), seed=i, ignore_eos=True)
        handover = None
        async for out in source.generate(prompt, replace(params, max_tokens=1), handover=True):
            handover = out.handover or handover
        assert handover is not None
        blob, _ = await source.export_prefix(prompt)
        await asyncio.sleep(rng.uniform(0, 0.4))
        try:
            cached, _ = await a.import_prefix(blob)
        except KVTransferError as e:
            assert "no room" in str(e) or "sequence id" in str(e), e
            results["refused"] += 1
        else:
            assert 0 < cached <= len(prompt)
            results["imported"] += 1
        # The request goes on from the hand-over (whether its KV fitted or not); some leave.
        leave = rng.random() < 0.3
        outs = []
        async with contextlib.aclosing(a.generate(prompt, params, resume=handover)) as gen:
            async for out in gen:
                outs.append(out)
                if leave and len(outs) >= 2:
                    break
        assert not [o.error for o in outs if o.error]
        assert outs[0].token_ids[:1] == list(handover.token_ids)
        if not leave:
            assert sum(len(o.token_ids) for o in outs) == params.max_tokens
        results["resumed"] += 1


async def _drive(a: AsyncEngine, engine: Engine, seed: int,
                 transfers: AsyncEngine | None = None, unseeded: bool = False,
                 rounds: int = 1, n_prompts: int = 36) -> None:
    """``rounds``: the same ``n_prompts`` prompts again, each round once the last has ended
    (its prefixes cached by then, or in host memory)."""
    rng = random.Random(seed)
    words = engine.tokenize(" apple river stone light")
    bos, vocab = words[0], words[1:]
    prompts = make_prompts(rng, vocab, bos, n_prompts)
    results = {"cancelled": 0, "left": 0, "completed": 0, "imported": 0, "refused": 0,
               "thinking": 0,
               "resumed": 0, "prompt_logprobs": 0}
    for r in range(rounds):
        clients = [one_client(a, random.Random(seed * 100 + i + 1000 * r), p, i, results,
                              unseeded) for i, p in enumerate(prompts)]
        if transfers is not None:
            clients.append(_transfer_client(a, transfers, random.Random(seed), prompts,
                                            results))
        await asyncio.gather(*clients)
    assert results["completed"] >= 10 and results["cancelled"] + results["left"] >= 3, results
    assert results["prompt_logprobs"] >= 2 and results["thinking"] >= 1, results
    if transfers is not None:
        assert results["imported"] >= 5 and results["resumed"] == 10, results

    await _idle(a, engine)
    await a.call_on_engine_thread(engine.check_kv)
    stats = engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.kv_blocks.used == stats.prefix_cache.blocks  # nothing leaked past the cache
    assert stats.prefix_cache.hits > 0
    await a.call_on_engine_thread(engine.flush_prefix_cache)
    await _idle(a, engine)
    assert engine.stats().kv_blocks.used == 0
    seqs = await a.call_on_engine_thread(
        lambda: [s for s in range(engine.backend.config.n_seq_max)
                 if engine.backend.seq_pos_max(s) != -1])
    assert seqs == []


async def _idle(a: AsyncEngine, engine: Engine) -> None:
    """Wait until the engine thread applied every pending release."""
    for _ in range(200):
        if not await a.call_on_engine_thread(engine.has_work):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the engine never became idle")


def _run_with_a_sequence_out_of_step(model_path, prefix_cache: bool):
    """Three requests; after their first step llama.cpp "loses" the cells of one of them from
    position 2 on, so the next batch is refused with "inconsistent sequence positions"."""
    engine = Engine(EngineConfig(model=model_path, max_seqs=4, pool_blocks=64, check_kv=False,
                                 prefix_cache=prefix_cache))
    try:
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        ids = [engine.add_request(f"Story {i}: once upon a time", params) for i in range(3)]
        outs: dict[str, list[int]] = {i: [] for i in ids}
        errors: dict[str, str] = {}

        def step() -> None:
            for o in engine.step():
                outs[o.request_id] += o.token_ids
                if o.error:
                    errors[o.request_id] = o.error

        step()  # the prompts are computed, first tokens sampled
        victim = engine.scheduler.running[1]
        engine.backend.seq_rm(victim.seq_id, 2, -1)
        step()  # refused: the victim is dealt with, the step is retried for the others
        while engine.has_unfinished():
            step()
        return victim, outs, errors
    finally:
        engine.close()


def test_a_sequence_out_of_step_is_recomputed_and_nobody_fails(model_path):
    """llama.cpp refuses a whole batch when one sequence's positions do not follow on. A
    request whose prompt nobody shares is sent back to be recomputed (without the prefix
    cache) and the step is retried for the rest: nobody fails, everyone gets all tokens."""
    victim, outs, errors = _run_with_a_sequence_out_of_step(model_path, prefix_cache=False)
    assert victim.kv_errors == 1
    assert errors == {}
    assert all(len(t) == 6 for t in outs.values()), outs


def test_a_shared_sequence_out_of_step_fails_alone(model_path):
    """With the prefix cache the victim's prompt is shared (live in the tree), so it cannot be
    recomputed in place: it fails on its own, and the others finish."""
    victim, outs, errors = _run_with_a_sequence_out_of_step(model_path, prefix_cache=True)
    assert list(errors) == [victim.request_id]
    assert all(len(t) == 6 for rid, t in outs.items() if rid != victim.request_id), outs


def test_a_request_that_cannot_be_scheduled_with_nothing_running_ends_with_an_error(
        model_path, monkeypatch, caplog):
    """The guard against livelock: should the queue's head never start while nothing runs (a
    scheduler bug, such as the prefix-cache lock that pinned a whole cached prompt), it ends
    with an error and is logged, instead of the engine spinning on empty plans for ever; the
    engine then serves as before."""
    engine = Engine(EngineConfig(model=model_path, max_seqs=2, pool_blocks=64))
    try:
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        ids = [engine.add_request(f"Story {i}: once upon a time", params) for i in range(2)]
        real = engine.scheduler._admit
        monkeypatch.setattr(engine.scheduler, "_admit", lambda req: False)
        errors = {}
        for _ in range(4):
            errors |= {o.request_id: o.error for o in engine.step() if o.error}
        assert sorted(errors) == sorted(ids) and not engine.has_unfinished()
        assert all("could not be scheduled" in e for e in errors.values())
        assert "cannot be scheduled with nothing running" in caplog.text
        monkeypatch.setattr(engine.scheduler, "_admit", real)
        again = engine.add_request("Story 3: once upon a time", params)
        tokens = []
        while engine.has_unfinished():
            tokens += [t for o in engine.step() if o.request_id == again for t in o.token_ids]
        assert len(tokens) == 3
    finally:
        engine.close()
