"""justllm's routing policy as Ray Serve's RequestRouter: the same policy objects the local
gateway uses (justllm/gateway/routing.py, ``cache-aware`` by default), fed what Ray knows.

Ray creates one router per deployment handle, so each ingress replica has one per model, with
its own prefix tree built from its own decisions (as each SGLang router or justllm gateway
does). For each request Ray calls ``choose_replicas``: the policy proposes a replica from the
request's routing text (the ingress passes it as the call's ``route`` keyword) and each
replica's load, and commits it at once, as the gateway does, so the next request of a burst
that shares the prefix finds it in the tree (committed only once Ray confirms, a burst of one
system prompt would be spread over every replica); the router answers a ranking, the proposal
first. Ray sends to the first rank whose replica has room (``max_ongoing_requests``, set to
what the engine can hold, so nearly always the first) and then calls ``on_request_routed``;
when another replica took the request, that one is committed too, so the tree and the session
follow what happened.

A replica's load: the requests Ray's queue-length cache says it has now (updated on every send
and every answer, from all handles) when known, else what the replica last reported through
``record_routing_stats`` (running, waiting, KV use, recent TTFT; every ``STATS_PERIOD``); plus
the requests this router has proposed it and Ray has not yet said were taken. Without those, a
burst is routed before any of it is sent, every request sees the same loads, and all of it
goes to one replica.
A replica that leaves the set (stopped, or killed and replaced by a new one with a new id) is
forgotten: a new process has an empty cache.

A request for a LoRA adapter loaded at run time carries Ray's multiplexed model id
(justllm/cluster/lora.py): the policy then chooses among the replicas that hold the adapter,
if any does, and the others are ranked after them (one of them loads it when the holders are
full). This is what Ray's own routers do with multiplexing, with justllm's policy inside.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, replace
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from justllm.gateway.routing import (
    Decision,
    NoReplica,
    Router,
    RouteRequest,
    RoutingConfig,
    make_router,
    ranked,
    reported_load,
)

MAX_PROPOSALS = 10_000  # proposals awaiting Ray's word (a request cancelled first is dropped)
PROPOSAL_TTL = 30.0  # seconds after which a proposal Ray never confirmed stops counting


@dataclass(frozen=True)
class Proposal:
    request: RouteRequest
    decision: Decision
    at: float  # time.monotonic()


def route_of(pending: PendingRequest | None) -> RouteRequest:
    """The routing text and session the ingress put on the call (``route=(text, session)``);
    none for a call without them (the stats board's, a test's)."""
    route = pending.kwargs.get("route") if pending is not None else None
    if isinstance(route, (tuple, list)) and len(route) == 2:
        text, session = route
        return RouteRequest(text if isinstance(text, str) else "",
                            session if isinstance(session, str) else None)
    return RouteRequest()


def multiplexed_holders(candidates: list[Any], pending: PendingRequest | None) -> set[str]:
    """The replicas that hold the request's multiplexed model (a LoRA adapter loaded at run
    time); none when the request names none or no replica holds it yet."""
    model_id = pending.metadata.multiplexed_model_id if pending is not None else ""
    if not model_id:
        return set()
    return {r.replica_id.unique_id for r in candidates
            if model_id in getattr(r, "multiplexed_model_ids", ())}


class JustLLMRouter(RequestRouter):
    """Ranks a model's replicas with justllm's routing policy (``request_router_kwargs``:
    the model's RoutingConfig fields)."""

    policy: Router

    def initialize_state(self, **kwargs: Any) -> None:
        self.policy = make_router(RoutingConfig(**kwargs))
        self._proposals: OrderedDict[str, Proposal] = OrderedDict()  # by Ray's request id
        self._pending: Counter[str] = Counter()  # proposals per replica
        self._known: set[str] = set()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        self._forget_gone(set(by_id))
        if not by_id:
            return []
        now = time.monotonic()
        while self._proposals and now - next(iter(self._proposals.values())).at > PROPOSAL_TTL:
            self._drop(next(iter(self._proposals)))
        key = pending_request.metadata.internal_request_id if pending_request else None
        if key is not None:
            self._drop(key)  # asked again (no replica had room): this one counts anew
        holders = multiplexed_holders(candidate_replicas, pending_request)
        loads = []
        for rid, r in by_id.items():
            load = reported_load(rid, r.routing_stats,
                                 self.replica_queue_len_cache.get(r.replica_id))
            loads.append(replace(load, waiting=load.waiting + self._pending[rid]))
        request = route_of(pending_request)
        try:
            decision = self.policy.propose(
                request, [x for x in loads if x.id in holders] or loads)
        except NoReplica:
            return []
        self.policy.commit(request, decision)
        self._known.add(decision.replica)
        if key is not None:
            self._proposals[key] = Proposal(request, decision, now)
            self._pending[decision.replica] += 1
            while len(self._proposals) > MAX_PROPOSALS:
                self._drop(next(iter(self._proposals)))
        order = ranked(decision, loads)
        order = [r for r in order if r in holders] + [r for r in order if r not in holders]
        return [[by_id[rid]] for rid in order]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        proposal = self._drop(pending_request.metadata.internal_request_id)
        took = replica_id.unique_id
        self._known.add(took)
        if proposal is not None and took != proposal.decision.replica:
            # The proposal had no room and a later rank took the request.
            self.policy.commit(proposal.request, Decision(took, "load"))

    def _drop(self, key: str) -> Proposal | None:
        proposal = self._proposals.pop(key, None)
        if proposal is not None:
            self._pending[proposal.decision.replica] -= 1
            if self._pending[proposal.decision.replica] <= 0:
                del self._pending[proposal.decision.replica]
        return proposal

    def _forget_gone(self, present: set[str]) -> None:
        for gone in self._known - present:
            self.policy.forget_replica(gone)
        self._known &= present
