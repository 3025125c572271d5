"""The scheduler with no model: exact plans, admission, preemption, release."""

import pytest

from justllm.core.kv_view import block_mismatches
from justllm.core.plan import StepPlan
from justllm.core.request import FinishReason, Request, RequestStatus
from justllm.core.sampling_params import SamplingParams
from justllm.core.scheduler import Scheduler, SchedulerConfig
from justllm.errors import QueueFullError
from justllm.kv.block_pool import BlockPool
from justllm.kv.radix_cache import RadixCache


def make_req(i: int, n_prompt: int, max_tokens: int = 100) -> Request:
    return Request(f"r{i}", list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens),
                   arrival=i, max_total_tokens=n_prompt + max_tokens)


def run_step(s: Scheduler, next_token: int = 7):
    """Schedule, pretend the runner computed it, append a sampled token where logits were asked."""
    plan = s.schedule()
    s.update(plan)
    for c in plan.chunks:
        if c.wants_logits:
            c.request.output_token_ids.append(next_token)
    return plan


def sched(**kw) -> Scheduler:
    pool_blocks = kw.pop("pool_blocks", 64)
    block_size = kw.pop("block_size", 4)
    return Scheduler(SchedulerConfig(**kw), BlockPool(pool_blocks, block_size))


def test_admission_prefill_then_decode():
    s = sched(chunk_size=8, n_batch=16)
    r = make_req(0, 10)
    s.add(r)
    p1 = run_step(s)
    assert [(c.start, len(c.token_ids), c.wants_logits) for c in p1.chunks] == [(0, 8, False)]
    assert r.seq_id == 0 and len(r.block_ids) == 3  # blocks for the whole 10-token prompt
    p2 = run_step(s)
    assert [(c.start, len(c.token_ids), c.wants_logits) for c in p2.chunks] == [(8, 2, True)]
    p3 = run_step(s)
    assert [(c.start, c.token_ids, c.is_decode) for c in p3.chunks] == [(10, [7], True)]
    assert r.num_computed_tokens == 11


def test_decodes_are_never_starved_by_a_long_prompt():
    s = sched(chunk_size=8, n_batch=12, max_prefill=4, pool_blocks=256)
    decoders = [make_req(i, 3) for i in range(4)]
    for r in decoders:
        s.add(r)
    run_step(s)  # all four prefilled (3 tokens each = 12)
    long = make_req(9, 100)
    s.add(long)
    for _ in range(10):
        plan = run_step(s)
        decoded = {c.request.request_id for c in plan.chunks if c.is_decode}
        assert decoded == {r.request_id for r in decoders}
        long_chunks = [c for c in plan.chunks if c.request is long]
        assert len(long_chunks) == 1 and len(long_chunks[0].token_ids) == 8
        assert plan.num_tokens <= 12


def test_limits_on_concurrency():
    s = sched(max_seqs=3, max_prefill=2, n_batch=64, chunk_size=16, pool_blocks=256)
    for i in range(6):
        s.add(make_req(i, 40))
    p = s.schedule()
    assert len(p.chunks) == 2  # max_prefill
    s.update(p)
    p = s.schedule()
    # the two running ones continue; no third prefill beyond max_prefill
    assert {c.request.request_id for c in p.chunks} == {"r0", "r1"}
    assert s.num_running == 2 and s.num_waiting == 4


def test_max_seqs_bounds_running():
    s = sched(max_seqs=2, max_prefill=4, n_batch=64, chunk_size=16)
    for i in range(4):
        s.add(make_req(i, 2))
    run_step(s)
    assert s.num_running == 2 and s.num_waiting == 2


def test_queue_full():
    s = sched(max_queue=2)
    s.add(make_req(0, 2))
    s.add(make_req(1, 2))
    with pytest.raises(QueueFullError):
        s.add(make_req(2, 2))


def test_admission_waits_for_blocks_fcfs():
    s = sched(pool_blocks=4, block_size=4, n_batch=64, chunk_size=32)
    a, b, c = make_req(0, 12), make_req(1, 8), make_req(2, 1)
    for r in (a, b, c):
        s.add(r)
    run_step(s)
    # a holds 3 of 4 blocks; b needs 2, so b waits, and c (which would fit) does not jump it
    assert a.status is RequestStatus.RUNNING
    assert b.status is RequestStatus.WAITING and c.status is RequestStatus.WAITING
    s.finish(a, FinishReason.STOP)
    plan = s.schedule()
    assert plan.released_seq_ids == [0]
    assert {ch.request.request_id for ch in plan.chunks} == {"r1", "r2"}


def test_decode_out_of_blocks_preempts_newest_and_recomputes():
    s = sched(pool_blocks=4, block_size=4, n_batch=64, chunk_size=32)
    a, b = make_req(0, 4), make_req(1, 4)
    s.add(a)
    s.add(b)
    b.host_checked = True  # (the engine looked for it in host memory while it waited)
    run_step(s)  # both prefilled: 1 block each, one output token each
    run_step(s)  # decode: each needs a 2nd block (5 tokens) -> 4 blocks used
    assert s.pool.num_free == 0
    for _ in range(3):
        run_step(s)  # tokens 6..8 fit in the 2nd blocks
    plan = run_step(s)  # a needs a 3rd block: b (newest) is preempted
    assert plan.preempted == [b]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
    assert not b.host_checked  # looked for again: its KV may be in host memory by its turn
    assert b.seq_id is None and b.block_ids == []
    assert plan.released_seq_ids == [1]
    assert [c.request for c in plan.chunks] == [a]
    assert len(b.output_token_ids) == 5  # kept: recomputed later, not lost
    s.finish(a, FinishReason.STOP)
    plan = run_step(s)
    assert plan.chunks[0].request is b and plan.chunks[0].start == 0
    assert len(plan.chunks[0].token_ids) == 9  # prompt + outputs recomputed in one chunk
    assert plan.chunks[0].wants_logits


def test_lone_request_preempts_itself_only_when_nothing_else():
    s = sched(pool_blocks=2, block_size=4, n_batch=64, chunk_size=32)
    r = make_req(0, 4)
    s.add(r)
    for _ in range(5):
        run_step(s)
    assert r.status is RequestStatus.RUNNING and len(r.block_ids) == 2


def test_abort_releases_blocks_and_seq():
    s = sched()
    r = make_req(0, 10)
    s.add(r)
    run_step(s)
    used = s.pool.usage().used
    assert used == 3
    assert s.abort("r0") is r
    assert r.finish_reason is FinishReason.ABORT
    assert s.pool.usage().used == 0
    assert s.schedule().released_seq_ids == [0]
    assert s.abort("nope") is None


def test_abort_waiting_request():
    s = sched(max_seqs=1)
    s.add(make_req(0, 2))
    s.add(make_req(1, 2))
    run_step(s)
    assert s.abort("r1").status is RequestStatus.FINISHED
    assert s.num_waiting == 0


def test_everything_free_after_all_finish():
    s = sched(pool_blocks=8, block_size=4, n_batch=32, chunk_size=16, max_seqs=4)
    reqs = [make_req(i, 5 + i) for i in range(6)]
    for r in reqs:
        s.add(r)
    for _ in range(200):
        plan = run_step(s)
        for c in plan.chunks:
            if c.wants_logits and len(c.request.output_token_ids) >= 6 and not c.request.finished:
                s.finish(c.request, FinishReason.LENGTH)
        if not s.running and not s.waiting:
            break
    assert all(r.finished for r in reqs)
    assert all(len(r.output_token_ids) == 6 for r in reqs)
    assert s.pool.usage().free == 8


def after_a_cached_prompt(prompt: list[int]) -> tuple[Scheduler, Request, StepPlan]:
    """A 20-block pool of 4-token blocks whose cache holds one finished 60-token prompt
    (tokens 1..60: 15 blocks); then a request for ``prompt`` and the step planned for it."""
    pool = BlockPool(20, 4)
    s = Scheduler(SchedulerConfig(chunk_size=64, n_batch=128), pool, RadixCache(pool))
    first = make_req(0, 60, max_tokens=1)
    s.add(first)
    run_step(s)
    s.finish(first, FinishReason.LENGTH)  # its 60 computed tokens go to the cache
    assert s.cache is not None and s.cache.stats().blocks == 15 and pool.num_free == 5
    second = Request("r1", prompt, SamplingParams(max_tokens=1), arrival=1,
                     max_total_tokens=len(prompt) + 1)
    s.add(second)
    return s, second, run_step(s)


def test_a_request_sharing_a_few_tokens_of_a_long_cached_prompt_is_admitted():
    """A request that shares the first 3 tokens of the cached prompt and needs nearly the
    whole pool: the cache gives up what it must and the request runs (the whole cached node
    used to stay locked, nothing could be evicted, and the engine spun on an empty plan for
    ever)."""
    s, second, plan = after_a_cached_prompt([1, 2, 3] + list(range(100, 165)))
    assert [c.request.request_id for c in plan.chunks] == ["r1"]
    # 17 blocks for its 65 new tokens: the cache keeps 3 of its 15 (the 3 shared tokens and
    # the head of the rest that fits), as much as the pool can spare.
    assert second.num_cached_tokens == 3 and len(second.block_ids) == 17
    assert s.cache is not None and s.cache.stats().blocks == 3 and s.pool.num_free == 0


def test_a_lone_request_that_needs_the_whole_pool_starts_without_its_shared_token():
    """The shared head's block is what is missing: a 79-token prompt whose first token is
    cached needs 20 blocks for the other 78, and the cache's block for that token makes 21 of
    20. With nothing running to free room, it starts without the match rather than never."""
    s, second, plan = after_a_cached_prompt([1] + list(range(100, 178)))
    assert [c.request.request_id for c in plan.chunks] == ["r1"]
    assert second.num_cached_tokens == 0 and len(second.block_ids) == 20
    assert s.cache is not None and s.cache.stats().blocks == 0 and s.pool.num_free == 0


def test_a_prompt_for_its_logprobs_is_computed_whole_with_a_row_per_token():
    """prompt_logprobs: no prefix-cache hit (every prompt token needs its output row), chunks
    whose every token has a row, as many as the step's rows allow beside the others (one kept
    per prefill slot); once the logprobs went out, a recompute may use the cache again."""
    pool = BlockPool(64, 4)
    s = Scheduler(SchedulerConfig(chunk_size=64, n_batch=128, max_outputs=24, max_prefill=2),
                  pool, RadixCache(pool))
    first = make_req(0, 60, max_tokens=1)
    s.add(first)
    run_step(s)
    s.finish(first, FinishReason.LENGTH)  # the 60 tokens are cached
    decoder = make_req(5, 3)
    s.add(decoder)
    run_step(s)  # admitted and prefilled: it decodes from now on
    wants = Request("r1", list(range(1, 41)), SamplingParams(max_tokens=3, prompt_logprobs=1),
                    arrival=1, max_total_tokens=43)
    s.add(wants)
    plans = [run_step(s) for _ in range(3)]
    assert wants.num_cached_tokens == 0
    chunks = [c for p in plans for c in p.chunks if c.request is wants]
    # 24 rows a step: one for the decoder, one kept for the other prefill slot: 22 tokens,
    # then the rest
    assert [(c.start, len(c.token_ids), c.all_logits, c.num_logits) for c in chunks] == [
        (0, 22, True, 22), (22, 18, True, 18), (40, 1, False, 1)]
    assert all(p.num_logits <= 24 for p in plans)
    # one sent back to the queue (preempted) after its logprobs went out: the cache serves it
    again = Request("r2", list(range(1, 41)), SamplingParams(max_tokens=3, prompt_logprobs=1),
                    arrival=2, max_total_tokens=43, prompt_logprobs_done=True)
    s.add(again)
    run_step(s)
    assert again.num_cached_tokens > 0


def test_the_kv_check_names_a_block_nobody_holds():
    """The engine's KV check (kv_view.block_mismatches, run at every step in the tests)
    finds blocks the pool counts as used that no running request or the prefix cache holds."""
    pool = BlockPool(16, 4)
    s = Scheduler(SchedulerConfig(chunk_size=8, n_batch=16), pool, RadixCache(pool))
    a, b = make_req(0, 6), make_req(1, 3)
    s.add(a)
    run_step(s)
    s.finish(a, FinishReason.STOP)  # its prompt goes to the prefix cache
    s.add(b)
    run_step(s)
    assert block_mismatches(s) == []
    lost = pool.allocate(1)
    assert block_mismatches(s) == [f"{pool.usage().used} KV blocks used, "
                                   f"{pool.usage().used - 1} held by the running requests and "
                                   "the prefix cache"]
    pool.free(lost)
    s.waiting.append(make_req(2, 3))
    s.waiting[0].block_ids = pool.allocate(1)
    assert block_mismatches(s)[0] == "waiting request r2 holds 1 KV blocks"
