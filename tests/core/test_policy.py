"""Scheduling policies with no model: admission order and the preemption victim."""

from collections import deque

import pytest

from justllm.core.policy import FCFSPolicy, PriorityPolicy, make_policy
from justllm.core.request import Request
from justllm.core.sampling_params import SamplingParams
from justllm.core.scheduler import Scheduler, SchedulerConfig
from justllm.errors import InvalidRequestError
from justllm.kv.block_pool import BlockPool


def req(i: int, priority: int = 0, n_prompt: int = 4, max_tokens: int = 50) -> Request:
    return Request(f"r{i}", list(range(1, n_prompt + 1)),
                   SamplingParams(max_tokens=max_tokens, priority=priority), arrival=i,
                   max_total_tokens=n_prompt + max_tokens)


def ids(requests) -> list[str]:
    return [r.request_id for r in requests]


def test_priority_queue_is_lower_first_then_fcfs():
    q: deque = deque()
    p = PriorityPolicy()
    for r in [req(0, 5), req(1, 0), req(2, 5), req(3, -1), req(4, 0)]:
        p.enqueue(q, r)
    assert ids(q) == ["r3", "r1", "r4", "r0", "r2"]
    p.requeue(q, req(-1, 5))  # a preempted request arrived before everyone of its priority
    assert ids(q) == ["r3", "r1", "r4", "r-1", "r0", "r2"]


def test_fcfs_keeps_arrival_order_and_preempted_go_first():
    q: deque = deque()
    f = FCFSPolicy()
    for r in [req(0, 5), req(1, 0)]:
        f.enqueue(q, r)
    f.requeue(q, req(9))
    assert ids(q) == ["r9", "r0", "r1"]
    running = [req(0), req(1), req(2)]
    assert f.keep_order(running)[-1].request_id == "r2"  # the newest is the victim


def test_priority_victim_is_the_lowest_priority_then_the_newest():
    p = PriorityPolicy()
    running = [req(0, 1), req(1, 9), req(2, 0), req(3, 9)]
    assert ids(p.keep_order(running)) == ["r2", "r0", "r1", "r3"]


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="fcfs, priority"):
        make_policy("lifo")
    with pytest.raises(ValueError, match="fcfs, priority"):
        SchedulerConfig(policy="lifo")


def test_priority_must_be_an_integer():
    with pytest.raises(InvalidRequestError, match="priority"):
        SamplingParams(priority=1.5)  # type: ignore[arg-type]


def run_step(s: Scheduler) -> None:
    plan = s.schedule()
    s.update(plan)
    for c in plan.chunks:
        if c.wants_logits:
            c.request.output_token_ids.append(7)


def test_scheduler_admits_by_priority_and_preempts_the_lowest():
    s = Scheduler(SchedulerConfig(max_seqs=2, max_prefill=2, n_batch=64, chunk_size=16,
                                  policy="priority"), BlockPool(3, 4))
    low, high = req(0, priority=9, n_prompt=4), req(1, priority=0, n_prompt=4)
    s.add(low)
    s.add(high)
    assert ids(s.waiting) == ["r1", "r0"]
    run_step(s)  # both admitted (one block each), the higher priority first
    assert ids(s.running) == ["r1", "r0"]
    # Each decode needs a new block every 4 tokens; with 3 blocks the low one must go.
    for _ in range(6):
        run_step(s)
    assert low.num_preemptions >= 1 and high.num_preemptions == 0
    assert ids(s.running) == ["r1"] and ids(s.waiting) == ["r0"]
