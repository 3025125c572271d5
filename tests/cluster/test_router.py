"""justllm's routing policy as Ray Serve's RequestRouter, with fake replicas (no Ray cluster):
the policy's two halves (propose, then commit what Ray did), the ranking Ray gets, loads from
the replicas' own reports and Ray's queue-length cache, bursts spread by the proposals not yet
confirmed, and replicas that leave forgotten."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest, ReplicaID

from justllm.cluster.router import JustLLMRouter, route_of
from justllm.gateway.routing import (
    Decision,
    ReplicaLoad,
    RouteRequest,
    make_router,
    ranked,
    reported_load,
)

DEPLOYMENT = DeploymentID(name="model-demo", app_name="justllm")
SYSTEM_A = "You are a pirate. Answer every question in pirate speech, briefly. " * 4
SYSTEM_B = "You are a lawyer. Answer every question with legal caveats, formally. " * 4


@dataclass
class FakeReplica:
    """What the router reads of Ray's RunningReplica."""

    replica_id: ReplicaID
    routing_stats: dict = field(default_factory=dict)
    max_ongoing_requests: int = 100
    multiplexed_model_ids: set = field(default_factory=set)


def replica(name: str, **stats) -> FakeReplica:
    return FakeReplica(ReplicaID(unique_id=name, deployment_id=DEPLOYMENT), dict(stats))


@pytest.fixture(autouse=True)
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """Ray's PendingRequest makes a future at once: the tests run in one loop of their own."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        yield loop
    finally:
        asyncio.set_event_loop(None)
        loop.close()


def request(key: str, text: str = "", session: str | None = None,
            model_id: str = "") -> PendingRequest:
    return PendingRequest(args=[], kwargs={"route": (text, session)},
                          metadata=RequestMetadata(request_id=key, internal_request_id=key,
                                                   multiplexed_model_id=model_id))


def router(**routing) -> JustLLMRouter:
    r = JustLLMRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN,
                      use_replica_queue_len_cache=True)
    r.initialize_state(**routing)
    return r


def choose(r: JustLLMRouter, replicas: list[FakeReplica], pending: PendingRequest
           ) -> list[str]:
    ranks = asyncio.get_event_loop().run_until_complete(r.choose_replicas(replicas, pending))
    assert all(len(rank) == 1 for rank in ranks)
    return [rank[0].replica_id.unique_id for rank in ranks]


def routed(r: JustLLMRouter, pending: PendingRequest, name: str) -> None:
    """What Ray does once a replica took the request: count it sent, then say so."""
    rid = ReplicaID(unique_id=name, deployment_id=DEPLOYMENT)
    r.on_send_request(rid)
    r.on_request_routed(pending, rid, None)


# ---- routing.py's adapter -------------------------------------------------------------------


def test_propose_records_nothing_and_commit_records_the_decision():
    policy = make_router()
    loads = [ReplicaLoad("r0"), ReplicaLoad("r1")]
    ask = RouteRequest(SYSTEM_A + "Q1", session="s")
    first = policy.propose(ask, loads)
    assert policy.counts == {} and policy.propose(ask, loads) == first
    policy.commit(ask, Decision("r1", "load"))
    assert policy.counts == {"load": 1}
    assert policy.propose(RouteRequest(SYSTEM_A + "Q2"), loads).replica == "r1"  # the tree
    assert policy.propose(RouteRequest("other", session="s"), loads) == Decision("r1", "session")


def test_ranked_puts_the_decision_first_then_the_least_loaded():
    loads = [ReplicaLoad("a", running=5), ReplicaLoad("b", running=1),
             ReplicaLoad("c", running=3), ReplicaLoad("d", healthy=False)]
    assert ranked(Decision("c", "prefix"), loads) == ["c", "b", "a"]


def test_reported_load_prefers_the_callers_count_of_ongoing_requests():
    stats = {"running": 3, "waiting": 4, "kv_usage": 0.5, "ttft_p50": 0.2}
    assert reported_load("r", stats) == ReplicaLoad("r", running=3, waiting=4, kv_usage=0.5,
                                                     ttft_p50=0.2)
    assert reported_load("r", stats, ongoing=2) == ReplicaLoad("r", running=2, waiting=0,
                                                               kv_usage=0.5, ttft_p50=0.2)
    assert reported_load("r", stats, ongoing=9).load == 9
    assert reported_load("r", {"running": "x", "kv_usage": 7}) == ReplicaLoad("r", kv_usage=1.0)
    assert reported_load("r", None) == ReplicaLoad("r")


# ---- the RequestRouter --------------------------------------------------------------------


def test_a_prefix_stays_on_the_replica_that_took_it():
    r = router()
    replicas = [replica("r0"), replica("r1")]
    a, b = request("a", SYSTEM_A + "Q: where is the gold?"), request("b", SYSTEM_B + "Q: park?")
    first_a = choose(r, replicas, a)
    routed(r, a, first_a[0])
    first_b = choose(r, replicas, b)
    routed(r, b, first_b[0])
    assert first_a[0] != first_b[0]  # the second prefix goes to the idle replica
    for i in range(3):
        qa, qb = request(f"a{i}", SYSTEM_A + f"Q{i}"), request(f"b{i}", SYSTEM_B + f"Q{i}")
        assert choose(r, replicas, qa)[0] == first_a[0]
        routed(r, qa, first_a[0])
        assert choose(r, replicas, qb)[0] == first_b[0]
        routed(r, qb, first_b[0])
    assert r.policy.counts == {"fallback": 2, "prefix": 6}
    assert r._pending == {}  # every proposal confirmed


def test_a_burst_routed_before_any_of_it_is_sent_is_spread():
    r = router()
    replicas = [replica("r0"), replica("r1")]
    firsts = [choose(r, replicas, request(f"q{i}", f"{word} tale:"))[0]
              for i, word in enumerate(["Apple", "Bridge", "Cloud", "Dragon"])]
    assert sorted(firsts) == ["r0", "r0", "r1", "r1"]


def test_a_burst_sharing_a_prefix_stays_together_before_ray_confirms_any_of_it():
    r = router()
    replicas = [replica("r0"), replica("r1")]
    homes = {choose(r, replicas, request(f"q{i}", SYSTEM_A + f"Q{i}"))[0] for i in range(4)}
    assert len(homes) == 1


def test_load_comes_from_rays_queue_length_cache_else_the_replicas_report():
    r = router(policy="least-load")
    busy, idle = replica("busy", running=0), replica("idle", running=6, waiting=2)
    assert choose(r, [busy, idle], request("1"))[0] == "busy"  # reports: 0 against 8
    r.replica_queue_len_cache.update(busy.replica_id, 9)  # Ray knows better, and later
    r.replica_queue_len_cache.update(idle.replica_id, 1)
    assert choose(r, [busy, idle], request("2"))[0] == "idle"


def test_when_the_proposal_has_no_room_the_replica_that_took_it_is_committed():
    r = router()
    replicas = [replica("r0"), replica("r1")]
    q = request("q", SYSTEM_A + "Q", session="s")
    proposed, other = choose(r, replicas, q)
    routed(r, q, other)  # Ray found the first rank full
    assert r.policy.counts == {"fallback": 1, "load": 1}
    assert choose(r, replicas, request("q2", "unrelated", session="s"))[0] == other
    routed(r, request("unknown"), proposed)  # nothing proposed: nothing more committed
    assert r.policy.counts == {"fallback": 1, "load": 1, "session": 1}


def test_a_replica_that_leaves_is_forgotten():
    r = router()
    q = request("q", SYSTEM_A + "Q")
    routed(r, q, choose(r, [replica("old")], q)[0])
    assert choose(r, [replica("old"), replica("new")],
                  request("q2", SYSTEM_A + "Q2"))[0] == "old"
    # "old" was killed; Ray started "fresh" instead: its cache is empty, nothing is sent there
    # for the prefix, and the tree no longer points at "old".
    assert choose(r, [replica("new"), replica("fresh")], request("q3", SYSTEM_A + "Q3")) \
        in (["new", "fresh"], ["fresh", "new"])
    assert "old" not in r.policy.tree.replicas  # type: ignore[attr-defined]


def test_no_replica_gives_no_ranking_and_the_route_comes_from_the_call():
    assert choose(router(), [], request("q")) == []
    assert route_of(request("q", "text", "s")) == RouteRequest("text", "s")
    assert route_of(None) == RouteRequest()
    odd = PendingRequest(args=[], kwargs={"route": 5}, metadata=RequestMetadata("x", "x"))
    assert route_of(odd) == RouteRequest()


def test_a_runtime_adapters_requests_go_to_the_replicas_that_hold_it_first():
    """Ray's multiplexed model id (a LoRA adapter loaded at run time): the policy chooses among
    the replicas holding it, even past a shared prefix elsewhere or a lighter load; the others
    follow in the ranking (one of them loads it when the holders are full). No holder yet, or
    no adapter: the policy over every replica, as before."""
    r = router()
    replicas = [replica("r0"), replica("r1", running=3), replica("r2")]
    replicas[1].multiplexed_model_ids = {"sql@1"}
    first = request("a", SYSTEM_A + "Q1")
    assert choose(r, replicas, first)[0] in ("r0", "r2")
    routed(r, first, choose(r, replicas, first)[0])
    ranks = choose(r, replicas, request("b", SYSTEM_A + "Q2", model_id="sql@1"))
    assert ranks[0] == "r1" and sorted(ranks[1:]) == ["r0", "r2"]
    replicas[2].multiplexed_model_ids = {"sql@1"}
    assert choose(r, replicas, request("c", "x", model_id="sql@1"))[0] == "r2"  # less loaded
    fresh = choose(r, replicas, request("d", SYSTEM_A + "Q3", model_id="other@2"))
    assert fresh[0] == choose(r, replicas, request("e", SYSTEM_A + "Q4"))[0]
