"""Scheduling policies: who is admitted next, and who is preempted when decode runs out of KV.

A policy is pure and small: it orders the waiting queue and the running requests, and the
scheduler applies it. ``fcfs``: first come, first served; the newest running request is
preempted. ``priority`` (vLLM's semantics): a lower ``priority`` value goes first, first come
first served within a priority; the running request with the highest value (the newest among
equals) is preempted. A preempted request goes back ahead of every waiting request of its own
priority (it arrived before them). Chosen by name through ``EngineConfig.scheduling_policy``.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from justllm.core.request import Request


class SchedulingPolicy(Protocol):
    name: str

    def enqueue(self, waiting: deque[Request], request: Request) -> None:
        """Put a new request in the waiting queue."""
        ...

    def requeue(self, waiting: deque[Request], request: Request) -> None:
        """Put back a request that ran and was preempted (it has waited longest)."""
        ...

    def keep_order(self, running: list[Request]) -> list[Request]:
        """Running requests, the one to keep most first: the last is the preemption victim,
        and decodes are given their KV blocks in this order."""
        ...


class FCFSPolicy:
    name = "fcfs"

    def enqueue(self, waiting: deque[Request], request: Request) -> None:
        waiting.append(request)

    def requeue(self, waiting: deque[Request], request: Request) -> None:
        waiting.appendleft(request)

    def keep_order(self, running: list[Request]) -> list[Request]:
        return running  # admission order


def _key(request: Request) -> tuple[int, int]:
    return request.params.priority, request.arrival


class PriorityPolicy:
    name = "priority"

    def enqueue(self, waiting: deque[Request], request: Request) -> None:
        key = _key(request)
        for i, other in enumerate(waiting):
            if _key(other) > key:
                waiting.insert(i, request)
                return
        waiting.append(request)

    requeue = enqueue  # its arrival puts it ahead of later requests of its priority

    def keep_order(self, running: list[Request]) -> list[Request]:
        return sorted(running, key=_key)


SCHEDULING_POLICIES: dict[str, type[FCFSPolicy] | type[PriorityPolicy]] = {
    "fcfs": FCFSPolicy, "priority": PriorityPolicy}


def make_policy(name: str) -> SchedulingPolicy:
    try:
        return SCHEDULING_POLICIES[name]()
    except KeyError:
        raise ValueError(f"scheduling policy must be one of {', '.join(SCHEDULING_POLICIES)} "
                         f"(got {name!r})") from None
