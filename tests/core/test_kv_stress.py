"""Randomised concurrent load on the scheduler and prefix cache over a model of llama.cpp's KV.

Prompts from a tiny vocabulary share prefixes of every length (one or two tokens, exact
duplicates, long ones), the pool is small enough to evict and preempt, and requests are aborted
at random points, also while "llama_decode" runs (as a client disconnect does). After every
step's KV operations the scheduler's view of every sequence id must equal the KV model's, cell for
cell; when idle, the pool holds exactly what the prefix cache holds. The same invariant runs on
the real model in tests/engine/test_kv_stress.py.
"""

from __future__ import annotations

import random

import pytest

from justllm.core.kv_view import expected_kv, kv_mismatches
from justllm.core.request import FinishReason, Request, RequestStatus
from justllm.core.sampling_params import SamplingParams
from justllm.core.scheduler import Scheduler, SchedulerConfig
from justllm.kv.block_pool import BlockPool
from justllm.kv.radix_cache import RadixCache
from tests.core.fake_kv import FakeKV

VOCAB = [11, 12, 13]
BOS = 2


def random_prompt(rng: random.Random, earlier: list[list[int]]) -> list[int]:
    kind = rng.random()
    if earlier and kind < 0.15:
        return list(rng.choice(earlier))  # an exact duplicate
    if earlier and kind < 0.45:  # an earlier prompt's prefix of any length, then new tokens
        base = rng.choice(earlier)
        cut = rng.randint(1, len(base))
        return base[:cut] + [rng.choice(VOCAB) for _ in range(rng.randint(0, 40))]
    return [BOS] + [rng.choice(VOCAB) for _ in range(rng.choice([0, 1, 2, 5, 20, 60, 150]))]


def exact_mismatches(s: Scheduler, kv: FakeKV, n_ids: int, skip: set[int]) -> list[str]:
    want = expected_kv(s)
    out = []
    for seq in range(n_ids):
        if seq in skip:
            continue
        expected = [p for a, b in want.get(seq, []) for p in range(a, b)]
        if kv.positions(seq) != expected:
            out.append(f"seq {seq}: scheduler {expected[:3]}..({len(expected)}), "
                       f"kv {kv.positions(seq)[:3]}..({len(kv.positions(seq))})")
    return out


def drive(seed: int, steps: int = 400, pool_blocks: int = 24, block_size: int = 8,
          cache_cap: int | None = None) -> dict[str, int]:
    rng = random.Random(seed)
    cfg = SchedulerConfig(max_seqs=6, max_prefill=3, chunk_size=32, n_batch=64, max_queue=64,
                          n_seq_ids=10)
    pool = BlockPool(pool_blocks, block_size)
    cache = RadixCache(pool, max_blocks=cache_cap)
    s = Scheduler(cfg, pool, cache)
    kv = FakeKV(pool_blocks * block_size)
    earlier: list[list[int]] = []
    live: dict[str, Request] = {}
    counts = {"finished": 0, "aborted": 0, "preempted": 0, "hits": 0}
    n = 0

    def abort_some(p: float) -> None:
        for rid in [r for r in live if rng.random() < p]:
            s.abort(rid)
            del live[rid]
            counts["aborted"] += 1

    for step in range(steps):
        if step < steps - 60 and rng.random() < 0.5:  # arrivals stop so the run drains
            for _ in range(rng.randint(1, 3)):
                prompt = random_prompt(rng, earlier)
                if pool.blocks_for(len(prompt) + 8) > pool_blocks:  # up to the whole pool
                    continue
                earlier.append(prompt)
                req = Request(f"r{n}", prompt, SamplingParams(max_tokens=8), n,
                              len(prompt) + rng.randint(1, 8))
                n += 1
                if len(s.waiting) < cfg.max_queue:
                    s.add(req)
                    live[req.request_id] = req
        abort_some(0.03)  # between steps
        plan = s.schedule()
        counts["preempted"] += len(plan.preempted)
        kv.apply(plan.kv_ops)
        leaves = {q for c in plan.chunks for q in c.leaf_seqs}
        problems = exact_mismatches(s, kv, cfg.n_seq_ids, leaves)
        problems += kv_mismatches(s, kv, cfg.n_seq_ids, leaves)
        assert not problems, f"seed {seed} step {step}: {problems}"
        if not plan.chunks:
            # Nothing runs, so nothing will change: the head must be able to start.
            assert s.running or not s.waiting, \
                f"seed {seed} step {step}: nothing runs and {s.waiting[0].request_id} never starts"
            continue
        kv.decode(plan)  # raises on a position error: the bug this test exists for
        abort_some(0.03)  # while the batch "runs" (a client disconnect)
        s.update(plan)
        for c in plan.chunks:
            req = c.request
            if not c.wants_logits or req.status is not RequestStatus.RUNNING:
                continue
            req.output_token_ids.append(rng.choice(VOCAB))
            if req.num_tokens >= req.max_total_tokens or rng.random() < 0.05:
                s.finish(req, FinishReason.STOP)
                del live[req.request_id]
                counts["finished"] += 1
    for rid in list(live):
        s.abort(rid)
    plan = s.schedule()
    kv.apply(plan.kv_ops)
    assert not plan.chunks and not s.running and not s.waiting
    assert not kv_mismatches(s, kv, cfg.n_seq_ids)
    assert not exact_mismatches(s, kv, cfg.n_seq_ids, set())
    # Idle: the pool holds exactly the prefix cache, and the cells are exactly the cache's.
    assert pool.usage().used == cache.num_blocks
    assert len(kv.cells) == cache.num_tokens
    s.flush_cache()
    kv.apply(s.schedule().kv_ops)
    assert pool.usage().used == 0 and not kv.cells
    counts["hits"] = cache.stats().hits
    return counts


@pytest.mark.parametrize("seed", range(40))
def test_random_load_keeps_scheduler_and_kv_in_step(seed):
    counts = drive(seed)
    assert counts["finished"] > 10


@pytest.mark.parametrize("seed", range(10))
def test_random_load_with_a_capped_cache(seed):
    drive(1000 + seed, cache_cap=6)


def test_the_load_exercises_eviction_preemption_and_hits():
    """The driver must reach the paths it is there for, or the tests above prove little."""
    totals = {"finished": 0, "aborted": 0, "preempted": 0, "hits": 0}
    for seed in range(5):
        for k, v in drive(seed).items():
            totals[k] += v
    assert totals["preempted"] > 0 and totals["aborted"] > 20 and totals["hits"] > 20
