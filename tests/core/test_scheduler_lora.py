"""LoRA adapter sets in the scheduler and prefix cache, with no model.

llama.cpp applies adapters per context, so every step serves one adapter set; the choice is fair
(core/lora_groups.py) and the prefix cache keeps one tree per set. Checked exactly: one set per
plan, same-set requests batched, a bounded wait for every set, a set that cannot progress yields
its turn, and KV never crosses sets (over a cell model of llama.cpp's KV that remembers which
set computed each cell).
"""

from __future__ import annotations

import random

import pytest

from justllm.core.kv_view import kv_mismatches
from justllm.core.lora_groups import LoraGroups
from justllm.core.request import FinishReason, LoraKey, Request, RequestStatus
from justllm.core.sampling_params import SamplingParams
from justllm.core.scheduler import Scheduler, SchedulerConfig
from justllm.kv.block_pool import BlockPool
from justllm.kv.radix_cache import RadixCache
from tests.core.fake_kv import FakeKV

A: LoraKey = ((0, 1.0),)
B: LoraKey = ((1, 1.0),)
AB: LoraKey = ((0, 1.0), (1, 0.5))
BASE: LoraKey = ()


def req(i: int, lora: LoraKey, n_prompt: int = 6, max_tokens: int = 1000,
        prompt: list[int] | None = None) -> Request:
    tokens = prompt if prompt is not None else [1] + [100 + i] * (n_prompt - 1)
    return Request(f"r{i}", tokens, SamplingParams(max_tokens=max_tokens), arrival=i,
                   max_total_tokens=len(tokens) + max_tokens, lora=lora)


def sched(cache: bool = False, **kw) -> Scheduler:
    pool = BlockPool(kw.pop("pool_blocks", 256), kw.pop("block_size", 4))
    kw.setdefault("n_seq_ids", kw.get("max_seqs", 32) + 8)
    return Scheduler(SchedulerConfig(**kw), pool, RadixCache(pool) if cache else None)


def step(s: Scheduler, token: int = 7):
    plan = s.schedule()
    s.update(plan)
    for c in plan.chunks:
        if c.wants_logits:
            c.request.output_token_ids.append(token)
    return plan


def served(plan) -> set[LoraKey]:
    return {c.request.lora for c in plan.chunks}


# ---- the choice of the set ------------------------------------------------------------------

def test_groups_keep_the_current_set_up_to_the_bound_then_the_longest_waiting():
    g = LoraGroups(max_steps=2)
    assert g.order({A: 0, B: 3}) == [A, B]  # oldest queued first
    g.served(A, 1)
    assert g.order({A: 0, B: 3})[0] == A  # still under the bound
    g.served(A, 2)
    assert g.order({A: 0, B: 3}) == [B, A]  # bound reached: the other goes first
    g.served(B, 3)
    g.served(B, 4)
    assert g.order({A: 0, B: 3, BASE: 4}) == [A, BASE, B]  # A last served at 2, base queued 4
    assert g.order({B: 3}) == [B]  # alone: keeps going past the bound


def test_one_set_per_step_and_same_set_requests_batch_together():
    s = sched(max_seqs=16)
    sets = [A, B, BASE, AB]
    for i in range(12):
        s.add(req(i, sets[i % 4]))
    seen = set()
    for _ in range(30):
        plan = step(s)
        assert len(served(plan)) == 1, served(plan)
        (key,) = served(plan)
        seen.add(key)
        # the set's three requests are all in its step, together
        assert sorted(c.request.request_id for c in plan.chunks) == sorted(
            r.request_id for r in s.running if r.lora == key)
        assert len(plan.chunks) == 3
    assert seen == set(sets)


@pytest.mark.parametrize("bound", [1, 2, 4])
def test_no_set_waits_more_than_its_bound_times_the_other_sets(bound):
    """Three sets with long-running requests and a steady stream of new ones for set A: every
    set is served at least once in any window of (k - 1) * bound + 1 steps, and no set runs
    longer than ``bound`` steps in a row while another has work."""
    s = sched(max_seqs=24, lora_max_steps=bound)
    n = 0
    for key in (A, B, BASE):
        for _ in range(2):
            s.add(req(n, key))
            n += 1
    history: list[LoraKey] = []
    for t in range(120):
        if t % 3 == 0 and len(s.running) + len(s.waiting) < 24:
            s.add(req(n, A))  # A keeps getting work: it must not crowd the others out
            n += 1
        (key,) = served(step(s))
        history.append(key)
    window = 2 * bound + 1
    for i in range(len(history) - window):
        assert {A, B, BASE} <= set(history[i:i + window]), (i, history[i:i + window])
    runs = max(len(list(g)) for g in _runs(history))
    assert runs <= bound


def _runs(history):
    import itertools

    return (list(g) for _, g in itertools.groupby(history))


def test_a_set_that_cannot_start_yields_its_turn():
    """Every sequence slot is taken by set A's running requests; B's request waits without
    costing A a single step, and starts as soon as a slot frees."""
    s = sched(max_seqs=2, lora_max_steps=1)
    a1, a2 = req(0, A, max_tokens=5), req(1, A, max_tokens=50)
    s.add(a1)
    s.add(a2)
    step(s)
    b = req(2, B)
    s.add(b)
    for _ in range(4):
        assert served(step(s)) == {A}  # never an empty step
    s.finish(a1, FinishReason.STOP)
    assert served(step(s)) == {B}
    assert b.status is RequestStatus.RUNNING


def test_one_set_plans_exactly_as_without_adapters():
    """Adapters change nothing for a workload of one set: same chunks, step for step."""
    plans = []
    for key in (BASE, A):
        s = sched(max_seqs=4, chunk_size=8, n_batch=16, max_prefill=2, cache=True)
        for i in range(6):
            s.add(req(i, key, n_prompt=3 + 5 * i, max_tokens=6))
        shape = []
        for _ in range(40):
            plan = step(s)
            shape.append([(c.request.request_id, c.start, len(c.token_ids)) for c in plan.chunks])
            for c in plan.chunks:
                if c.request.num_tokens >= c.request.max_total_tokens:
                    s.finish(c.request, FinishReason.LENGTH)
        plans.append(shape)
    assert plans[0] == plans[1]


def test_speculation_candidates_are_those_of_the_next_set():
    s = sched(max_seqs=8, lora_max_steps=1)
    for i, key in enumerate((A, A, B)):
        s.add(req(i, key))
    step(s)  # A's prompts (oldest)
    step(s)  # B's prompt: A reached its bound
    assert {r.lora for r in s.decoding()} == {A}
    (key,) = served(step(s))
    assert key == A


# ---- the prefix cache: one tree per set ---------------------------------------------------------

def test_kv_computed_under_one_set_never_serves_another():
    s = sched(cache=True, max_seqs=4, block_size=4)
    prompt = [1] + list(range(50, 70))
    first = req(0, A, prompt=prompt, max_tokens=1)
    s.add(first)
    step(s)
    s.finish(first, FinishReason.STOP)
    for i, (key, hit) in enumerate([(B, 0), (BASE, 0), (AB, 0), (A, len(prompt) - 1)]):
        r = req(i + 1, key, prompt=prompt, max_tokens=1)
        s.add(r)
        plan = step(s)
        assert r.num_cached_tokens == hit, key
        assert [c.start for c in plan.chunks] == [hit]
        s.finish(r, FinishReason.STOP)
    cache = s.cache
    assert cache is not None and cache.check() == []
    dump = cache.dump()
    assert sum(line.startswith("tree ") for line in dump) == 3  # A, B, AB besides the base


def test_unloading_drops_only_that_adapters_trees():
    s = sched(cache=True, max_seqs=4)
    for i, key in enumerate((A, B, AB, BASE)):
        r = req(i, key, prompt=[1, 2, 3, 4, 5, 6, 7, 8, 9], max_tokens=1)
        s.add(r)
        step(s)
        s.finish(r, FinishReason.STOP)
    cache = s.cache
    assert cache is not None
    before = cache.num_tokens
    s.flush_cache_trees(lambda key: any(i == 0 for i, _ in key))  # adapter 0: A and AB
    assert cache.num_tokens == before - 2 * 9
    assert cache.match([1, 2, 3, 4, 5, 6, 7, 8, 9], 9, A).length == 0
    assert cache.match([1, 2, 3, 4, 5, 6, 7, 8, 9], 9, B).length == 9
    assert cache.check() == []


# ---- random load over a cell model that remembers which set computed each cell ---------------

class SetKV(FakeKV):
    """FakeKV whose cells also remember the adapter set of the batch that wrote them."""

    def __init__(self, n_cells: int) -> None:
        super().__init__(n_cells)
        self.written_by: dict[int, LoraKey] = {}

    def decode(self, plan) -> None:
        first = self._next
        super().decode(plan)
        (key,) = {c.request.lora for c in plan.chunks}
        for cell in range(first, self._next):
            self.written_by[cell] = key

    def sets_of(self, seq: int) -> set[LoraKey]:
        return {self.written_by[c] for c, (_, seqs) in self.cells.items() if seq in seqs}


@pytest.mark.parametrize("seed", range(12))
def test_random_mixed_sets_keep_kv_exact_and_isolated(seed):
    rng = random.Random(seed)
    cfg = SchedulerConfig(max_seqs=6, max_prefill=3, chunk_size=32, n_batch=64, n_seq_ids=10,
                          lora_max_steps=rng.choice([1, 2, 4]))
    pool = BlockPool(24, 8)
    s = Scheduler(cfg, pool, RadixCache(pool))
    kv = SetKV(24 * 8)
    prompts: list[list[int]] = []
    live: dict[str, Request] = {}
    n = 0
    for t in range(400):
        if t < 340 and rng.random() < 0.5:
            if prompts and rng.random() < 0.5:
                base = rng.choice(prompts)
                prompt = base[:rng.randint(1, len(base))] + [rng.choice((11, 12, 13))
                                                             for _ in range(rng.randint(0, 20))]
            else:
                prompt = [2] + [rng.choice((11, 12, 13))
                                for _ in range(rng.choice((1, 8, 40, 150)))]
            prompts.append(prompt)
            r = req(n, rng.choice((A, B, AB, BASE)), prompt=prompt, max_tokens=rng.randint(1, 8))
            n += 1
            s.add(r)
            live[r.request_id] = r
        for rid in [r for r in live if rng.random() < 0.02]:
            s.abort(rid)
            del live[rid]
        plan = s.schedule()
        kv.apply(plan.kv_ops)
        assert not kv_mismatches(s, kv, cfg.n_seq_ids)
        for r in s.running:  # what a request's sequence holds was computed under its set
            assert kv.sets_of(r.seq_id) <= {r.lora}, (t, r.request_id)
        if not plan.chunks:
            assert s.running or not s.waiting, f"seed {seed} step {t}: the queue never starts"
            continue
        assert len({c.request.lora for c in plan.chunks}) == 1
        kv.decode(plan)
        s.update(plan)
        for c in plan.chunks:
            r = c.request
            if c.wants_logits and r.status is RequestStatus.RUNNING:
                r.output_token_ids.append(rng.choice((11, 12, 13)))
                if r.num_tokens >= r.max_total_tokens:
                    s.finish(r, FinishReason.LENGTH)
                    del live[r.request_id]
    for rid in list(live):
        s.abort(rid)
    kv.apply(s.schedule().kv_ops)
    assert not s.running and not s.waiting
    assert s.cache is not None and s.cache.check() == []
    assert pool.usage().used == s.cache.num_blocks
