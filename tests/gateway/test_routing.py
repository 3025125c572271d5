"""The gateway's routing policies and prefix tree: pure, no model, no processes."""

from __future__ import annotations

import random

import pytest

from justllm.gateway.routing import (
    POLICIES,
    REASONS,
    CacheAware,
    Decision,
    LeastLoad,
    NoReplica,
    PowerOfTwo,
    PrefixTree,
    ReplicaLoad,
    RoundRobin,
    RouteRequest,
    RoutingConfig,
    make_router,
    routing_config,
)

SYSTEM_A = "You are a pirate. Answer every question in pirate speech. " * 8
SYSTEM_B = "You are a lawyer. Cite the statute for every claim you make. " * 8


def idle(*ids: str) -> list[ReplicaLoad]:
    return [ReplicaLoad(i) for i in ids]


def ask(text: str, session: str | None = None) -> RouteRequest:
    return RouteRequest(text, session)


# ---- cache-aware ------------------------------------------------------------------------------


def test_prefix_affinity_sends_each_follow_up_to_the_replica_that_saw_its_prefix():
    router = CacheAware()
    # Round one: nothing cached; the least loaded replica takes each new prefix.
    first_a = router.choose(ask(SYSTEM_A + "Q: where is the gold?"),
                            [ReplicaLoad("r0"), ReplicaLoad("r1", running=1)])
    first_b = router.choose(ask(SYSTEM_B + "Q: may I park here?"),
                            [ReplicaLoad("r0", running=1), ReplicaLoad("r1")])
    assert (first_a, first_b) == (Decision("r0", "fallback"), Decision("r1", "fallback"))
    # Follow-ups go back to their prefix's replica, though the other one is less loaded.
    for i in range(3):
        loads = [ReplicaLoad("r0", running=4 - i), ReplicaLoad("r1", running=i)]
        a = router.choose(ask(SYSTEM_A + f"Q{i}: how many parrots?"), loads)
        b = router.choose(ask(SYSTEM_B + f"Q{i}: is this legal?"), list(reversed(loads)))
        assert (a.replica, a.reason, a.matched) == ("r0", "prefix", len(SYSTEM_A) + 1)
        assert (b.replica, b.reason) == ("r1", "prefix")
    assert router.counts == {"fallback": 2, "prefix": 6}


def test_new_conversations_on_an_idle_model_spread_by_what_each_tree_holds():
    """Every load ties on an idle model: each new conversation (and a sticky session's first
    request) went to the first replica; the one whose tree holds least takes it, as SGLang
    routes a prompt nobody cached."""
    router = CacheAware(RoutingConfig(sticky_sessions=True))
    firsts = [router.choose(ask(f"conversation {i}: " + "hello there " * 20, f"user-{i}"),
                            idle("r0", "r1", "r2")) for i in range(6)]
    assert [d.replica for d in firsts] == ["r0", "r1", "r2", "r0", "r1", "r2"]
    assert {d.reason for d in firsts} == {"fallback"}
    # each session then stays where it began, and a follow-up goes to its prefix
    again = router.choose(ask("conversation 4: hello", "user-4"), idle("r0", "r1", "r2"))
    assert (again.replica, again.reason) == ("r1", "session")
    # load still comes first: a busier replica with an empty tree is not chosen
    busy = router.choose(ask("something new entirely"),
                         [ReplicaLoad("r0"), ReplicaLoad("r1"), ReplicaLoad("r2", running=1),
                          ReplicaLoad("r3", running=1)])
    assert busy.replica in ("r0", "r1")


def test_a_match_under_the_cache_threshold_goes_to_the_least_loaded():
    router = CacheAware(RoutingConfig(cache_threshold=0.5))
    router.choose(ask("0123456789" + "a" * 10), idle("r0", "r1"))
    loads = [ReplicaLoad("r0", running=3), ReplicaLoad("r1", running=2)]
    half = router.choose(ask("0123456789" + "b" * 10), loads)  # 10 of 20: exactly the share
    assert (half.replica, half.reason, half.matched) == ("r0", "prefix", 10)
    less = router.choose(ask("0123456789" + "c" * 11), loads)  # 10 of 21
    assert (less.replica, less.reason) == ("r1", "fallback")


def test_an_overloaded_replica_loses_its_prefix_to_the_least_loaded():
    router = CacheAware(RoutingConfig(balance_abs_threshold=32, balance_rel_threshold=1.5))
    router.choose(ask(SYSTEM_A + "Q: first"), idle("r0", "r1"))  # r0 has SYSTEM_A
    prompt = ask(SYSTEM_A + "Q: second")

    def route(r0: int, r1: int) -> Decision:
        return router.choose(prompt, [ReplicaLoad("r0", running=r0),
                                      ReplicaLoad("r1", running=r1)])

    assert route(32, 0).reason == "prefix"  # 32 more than the least loaded: not more
    assert route(100, 67).reason == "prefix"  # 33 more, but not over 1.5x
    lost = route(100, 66)  # 34 more and over 1.5x
    assert lost == Decision("r1", "load", 0)
    # r1 has seen the prompt now: with both matching, the one not overloaded wins on its prefix.
    assert route(33, 0) == Decision("r1", "prefix", len(prompt.text))


def test_one_busy_replica_does_not_break_the_affinity_of_other_prefixes():
    router = CacheAware()
    router.choose(ask(SYSTEM_A + "Q: 1"), [ReplicaLoad("r0"), ReplicaLoad("r1", running=1),
                                           ReplicaLoad("hot", running=1)])
    d = router.choose(ask(SYSTEM_A + "Q: 2"), [ReplicaLoad("r0", running=5),
                                               ReplicaLoad("r1", running=0),
                                               ReplicaLoad("hot", running=200)])
    assert (d.replica, d.reason) == ("r0", "prefix")


def test_a_shorter_match_on_a_fit_replica_beats_a_longer_one_on_an_overloaded_replica():
    router = CacheAware()
    router.choose(ask(SYSTEM_A), idle("r0"))  # r0 has the system prompt
    router.choose(ask(SYSTEM_A + "Q: long conversation so far"), idle("r1"))  # r1 has more
    d = router.choose(ask(SYSTEM_A + "Q: long conversation so far, and more"),
                      [ReplicaLoad("r0", running=10), ReplicaLoad("r1", running=100),
                       ReplicaLoad("r2", running=0)])
    assert (d.replica, d.reason, d.matched) == ("r0", "prefix", len(SYSTEM_A))


def test_ttft_breaks_ties_of_load_and_of_prefix():
    loads = [ReplicaLoad("slow", running=2, kv_usage=0.31, ttft_p50=0.9),
             ReplicaLoad("fast", running=2, kv_usage=0.33, ttft_p50=0.2),
             ReplicaLoad("busy", running=3, ttft_p50=0.01)]
    assert LeastLoad().choose(ask("x"), loads).replica == "fast"
    router = CacheAware()
    router.choose(ask(SYSTEM_B), idle("slow"))
    router.choose(ask(SYSTEM_B), idle("fast"))
    router.choose(ask(SYSTEM_B), idle("busy"))
    d = router.choose(ask(SYSTEM_B + "Q: a tie"), loads)  # all three match it all
    assert (d.replica, d.reason, d.matched) == ("fast", "prefix", len(SYSTEM_B))


def test_a_prompt_longer_than_the_stored_prefix_matches_in_full():
    router = CacheAware(RoutingConfig(max_prefix_chars=100))
    router.choose(ask(SYSTEM_A + "one"), idle("r0", "r1"))
    d = router.choose(ask(SYSTEM_A + "two"), [ReplicaLoad("r0", running=5), ReplicaLoad("r1")])
    assert (d.replica, d.reason, d.matched) == ("r0", "prefix", 100)
    assert router.tree.chars("r0") == 100


def test_a_dead_replica_is_forgotten():
    router = CacheAware()
    router.choose(ask(SYSTEM_A, session="s"), idle("r0", "r1"))
    router.forget_replica("r0")
    assert router.tree.chars("r0") == 0 and router.tree.match(SYSTEM_A) == {}
    d = router.choose(ask(SYSTEM_A, session="s"), [ReplicaLoad("r0", running=1),
                                                   ReplicaLoad("r1", running=0)])
    assert (d.replica, d.reason) == ("r1", "fallback")


# ---- sessions ---------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_session_stays_on_its_replica_while_it_is_healthy(policy):
    router = make_router(RoutingConfig(policy=policy), seed=1)
    first = router.choose(ask("hello", session="alice"), idle("r0", "r1", "r2"))
    others = [r for r in ("r0", "r1", "r2") if r != first.replica]
    for load in (0, 50, 500):  # whatever its load
        loads = [ReplicaLoad(first.replica, running=load), *idle(*others)]
        assert router.choose(ask(f"turn {load}", session="alice"), loads) == \
            Decision(first.replica, "session")
    # Its replica fails (or refuses this request): routed as usual, and the session moves.
    loads = [ReplicaLoad(first.replica, healthy=False), *idle(*others)]
    moved = router.choose(ask("hello again", session="alice"), loads)
    assert moved.replica in others and moved.reason != "session"
    back = [ReplicaLoad(first.replica), *idle(*others)]
    assert router.choose(ask("and again", session="alice"), back) == \
        Decision(moved.replica, "session")
    skipped = [ReplicaLoad(moved.replica, skip=True),
               *idle(*(r for r in ("r0", "r1", "r2") if r != moved.replica))]
    assert router.choose(ask("refused", session="alice"), skipped).replica != moved.replica


def test_sessions_are_off_when_sticky_sessions_is_off_and_bounded_when_on():
    off = make_router(RoutingConfig(policy="round-robin", sticky_sessions=False))
    assert [off.choose(ask("x", session="s"), idle("a", "b")).replica
            for _ in range(3)] == ["a", "b", "a"]
    on = make_router(RoutingConfig(policy="round-robin", max_sessions=2))
    on.choose(ask("x", session="s1"), idle("a", "b"))  # s1 -> a
    on.choose(ask("x", session="s2"), idle("a", "b"))  # s2 -> b
    on.choose(ask("x", session="s1"), idle("a", "b"))  # s1 used again: s2 is the oldest
    on.choose(ask("x", session="s3"), idle("a", "b"))  # s3 -> a; s2 forgotten
    assert on.choose(ask("x", session="s1"), idle("a", "b")).reason == "session"
    assert on.choose(ask("x", session="s2"), idle("a", "b")) == Decision("b", "round-robin")


def test_a_session_decision_teaches_the_tree():
    router = CacheAware()
    router.choose(ask("chat one", session="s"), idle("r0", "r1"))
    router.choose(ask(SYSTEM_A, session="s"), [ReplicaLoad("r0", running=9), *idle("r1")])
    assert router.tree.match(SYSTEM_A) == {"r0": len(SYSTEM_A)}


# ---- the simple policies ----------------------------------------------------------------------


def test_round_robin_goes_in_order_and_skips_unavailable_replicas():
    router = RoundRobin()
    all_up = idle("a", "b", "c")
    b_down = [ReplicaLoad("a"), ReplicaLoad("b", healthy=False), ReplicaLoad("c")]
    c_busy = [ReplicaLoad("a"), ReplicaLoad("b"), ReplicaLoad("c", skip=True)]
    picks = [router.choose(ask("x"), loads).replica
             for loads in [all_up, all_up, b_down, b_down, all_up, c_busy, c_busy]]
    assert picks == ["a", "b", "c", "a", "b", "a", "b"]
    assert router.counts == {"round-robin": 7}


def test_least_load_orders_by_requests_then_kv_steps_then_ttft():
    def pick(*loads: ReplicaLoad) -> str:
        return LeastLoad().choose(ask("x"), list(loads)).replica

    assert pick(ReplicaLoad("a", running=2), ReplicaLoad("b", running=1, waiting=2),
                ReplicaLoad("c", waiting=1, kv_usage=0.99)) == "c"
    assert pick(ReplicaLoad("a", running=1, kv_usage=0.5),
                ReplicaLoad("b", running=1, kv_usage=0.2)) == "b"
    # 0.41 and 0.49 are one step: TTFT decides; an unmeasured replica ranks as fast.
    assert pick(ReplicaLoad("a", kv_usage=0.41, ttft_p50=0.5),
                ReplicaLoad("b", kv_usage=0.49, ttft_p50=0.3)) == "b"
    assert pick(ReplicaLoad("a", ttft_p50=0.3), ReplicaLoad("new")) == "new"
    assert pick(ReplicaLoad("a", running=1), ReplicaLoad("b", running=9, healthy=False)) == "a"


def test_power_of_two_picks_the_less_loaded_of_a_seeded_pair():
    loads = [ReplicaLoad("a", running=1), ReplicaLoad("b", running=2),
             ReplicaLoad("c", running=3), ReplicaLoad("d", running=9)]
    picks = [PowerOfTwo(seed=7).choose(ask("x"), loads).replica for _ in range(3)]
    assert len(set(picks)) == 1  # the same seed, the same draws
    router = PowerOfTwo(seed=7)
    seen = [router.choose(ask("x"), loads).replica for _ in range(200)]
    assert "d" not in seen  # the most loaded loses to whichever it is drawn with
    assert set(seen) == {"a", "b", "c"}
    assert seen.count("a") > seen.count("b") > seen.count("c")
    rng = random.Random(7)  # the pairs come from the seeded generator, in order
    expected = [min(rng.sample(loads, 2), key=lambda r: r.running).id for _ in range(200)]
    assert seen == expected
    assert PowerOfTwo(seed=1).choose(ask("x"), [ReplicaLoad("only", running=99)]).replica == \
        "only"


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_no_available_replica_is_an_error(policy):
    router = make_router(RoutingConfig(policy=policy), seed=0)
    for loads in ([], [ReplicaLoad("a", healthy=False), ReplicaLoad("b", skip=True)]):
        with pytest.raises(NoReplica):
            router.choose(ask("x", session="s"), loads)
    assert sum(router.counts.values()) == 0


def test_policies_reasons_and_config():
    assert set(POLICIES) == {"round-robin", "least-load", "power-of-two", "cache-aware"}
    assert set(REASONS) == {"prefix", "load", "fallback", "session", "round-robin",
                            "least-load", "power-of-two", "policy-failed"}
    assert isinstance(make_router(), CacheAware)
    assert isinstance(make_router(RoutingConfig(policy="least-load")), LeastLoad)
    assert routing_config(None) == RoutingConfig()
    assert routing_config("power-of-two") == RoutingConfig(policy="power-of-two")
    assert routing_config({"balance-abs-threshold": 16, "balance-rel-threshold": 2,
                           "sticky-sessions": False}) == \
        RoutingConfig(balance_abs_threshold=16, balance_rel_threshold=2.0,
                      sticky_sessions=False)
    for bad, words in [("random", "must be one of"), ({"cache-treshold": 0.4}, "unknown key"),
                       ({"balance-abs-threshold": "32"}, "must be an integer"),
                       ({"sticky-sessions": 1}, "must be true or false"),
                       ({"max-sessions": True}, "must be an integer"),
                       ({"policy": 3}, "must be text"),
                       ({"cache-threshold": "0.5"}, "must be a number"),
                       ({"balance-rel-threshold": 0.5}, ">= 1"),
                       ({"cache-threshold": 1.5}, "between 0 and 1"),
                       ({"max-tree-chars": 100}, "max-tree-chars >="), (3, "policy name")]:
        with pytest.raises(ValueError, match=words):
            routing_config(bad)


# ---- the prefix tree --------------------------------------------------------------------------


def test_the_tree_matches_the_longest_prefix_per_replica_and_splits_edges():
    tree = PrefixTree()
    tree.insert("hello world", "r0")
    tree.insert("hello there", "r1")
    tree.insert("help", "r1")
    assert tree.match("hello world, again") == {"r0": 11, "r1": 6}
    assert tree.match("hello th") == {"r0": 6, "r1": 8}
    assert tree.match("help me") == {"r0": 3, "r1": 4}
    assert tree.match("goodbye") == {} and tree.match("") == {}
    # Splits keep each replica's characters: r0 "hello world", r1 "hello there" + "p".
    assert (tree.chars("r0"), tree.chars("r1")) == (11, 12)
    assert sorted(tree.root.children["h"].children) == ["l", "p"]


def test_eviction_drops_least_recently_used_leaves_down_to_the_cap():
    tree = PrefixTree()
    for text in ("aaaa-one", "bbbb-two", "cccc-six"):
        tree.insert(text, "r")
    tree.insert("aaaa-one", "r")  # used again: "bbbb-two" is now the oldest
    assert tree.evict("r", 16) == 8
    assert tree.chars("r") == 16
    assert tree.match("bbbb-two") == {}
    assert tree.match("aaaa-one") == tree.match("cccc-six") == {"r": 8}
    assert "b" not in tree.root.children  # a node no replica holds is gone
    assert tree.evict("r", 16) == 0


def test_eviction_takes_leaves_before_the_prefix_they_share():
    tree = PrefixTree()
    tree.insert("system: x", "r")  # "system: " + "x"
    tree.insert("system: yy", "r")  # "system: " + "yy", the newest
    tree.insert("system: zzz", "r2")  # another replica's entries are not touched
    assert tree.chars("r") == 11
    assert tree.evict("r", 10) == 1  # "x", the oldest leaf
    assert tree.match("system: x") == {"r": 8, "r2": 8}
    assert tree.evict("r", 8) == 2  # "yy"; "system: " is a leaf of r's now
    assert tree.match("system: yy") == {"r": 8, "r2": 8}
    assert tree.evict("r", 0) == 8
    assert tree.match("system: zzz") == {"r2": 11} and tree.chars("r") == 0


def test_eviction_after_a_split_keeps_the_lru_order_of_other_replicas():
    tree = PrefixTree()
    tree.insert("abcdef", "old")
    tree.insert("zzzz", "old")  # "zzzz" is newer than "abcdef" for "old"
    tree.insert("abcxyz", "new")  # splits "abcdef" under "old"'s feet
    assert tree.chars("old") == 10
    assert tree.evict("old", 4) == 6  # "def", then "abc" (only "new" keeps it): all of abcdef
    assert tree.match("abcdef") == {"new": 3}
    assert tree.match("zzzz") == {"old": 4}


def test_the_router_keeps_each_replica_under_its_cap_and_forgets_the_oldest():
    router = CacheAware(RoutingConfig(max_prefix_chars=64, max_tree_chars=200))
    prompts = [chr(65 + i) * 64 for i in range(8)]  # distinct from the first character
    for p in prompts:
        router.choose(ask(p), idle("r0"))
        assert router.tree.chars("r0") <= 200
    assert router.tree.chars("r0") == 192  # the three newest
    assert [bool(router.tree.match(p)) for p in prompts] == [False] * 5 + [True] * 3
    assert router.choose(ask(prompts[0]), idle("r0", "r1")).reason == "fallback"


def test_the_tree_agrees_with_a_brute_force_model_under_random_inserts_and_evictions():
    rng = random.Random(5)
    tree = PrefixTree()
    held: dict[str, list[str]] = {"r0": [], "r1": [], "r2": []}

    def common(a: str, b: str) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    def text() -> str:
        return "".join(rng.choice("ab") for _ in range(rng.randint(1, 12)))

    for _ in range(300):
        t, r = text(), rng.choice(list(held))
        tree.insert(t, r)
        held[r].append(t)
        probe = text()
        expected = {r: max(common(probe, h) for h in hs) for r, hs in held.items() if hs}
        assert tree.match(probe) == {r: n for r, n in expected.items() if n}
    check_invariants(tree)
    before = {r: tree.chars(r) for r in held}
    for r in held:
        tree.evict(r, before[r] // 3)
        assert tree.chars(r) <= before[r] // 3
        check_invariants(tree)
    for _ in range(100):  # evicting only shortens matches
        probe = text()
        expected = {r: max(common(probe, h) for h in hs) for r, hs in held.items()}
        for r, n in tree.match(probe).items():
            assert 0 < n <= expected[r]
    tree.forget_replica("r1")
    check_invariants(tree)
    assert tree.replicas == ["r0", "r2"]


def check_invariants(tree: PrefixTree) -> None:
    """Every node but the root has a replica, whose ancestors all have it; each replica's chars
    is the text of its nodes; in its LRU list, a node comes before its ancestors."""
    chars: dict[str, int] = {}
    stack = [tree.root]
    while stack:
        node = stack.pop()
        for first, child in node.children.items():
            assert child.text[0] == first and child.parent is node and child.entries
            for r in child.entries:
                assert node is tree.root or r in node.entries
                chars[r] = chars.get(r, 0) + len(child.text)
            stack.append(child)
    for r in tree.replicas:
        assert tree.chars(r) == chars.get(r, 0)
        lru = tree._lrus[r]
        seen: set[int] = set()
        e = lru.end.next
        while e is not lru.end:
            assert e.replica == r and e.node.entries[r] is e
            for child in e.node.children.values():
                assert r not in child.entries or id(child) in seen
            seen.add(id(e.node))
            e = e.next


# ---- plugins' policies ------------------------------------------------------------------------


def test_a_plugin_policys_reason_that_is_not_text_is_counted_as_text():
    """An unhashable reason raised in ``commit``, outside ``pick``'s guard: every request of
    the model failed."""
    from justllm.gateway.routing import Policy

    class Listy(Policy):
        def pick(self, request, available, replicas):
            return Decision(available[-1].id, ["mine"])

    router = Listy()
    decision = router.choose(ask("x"), idle("a", "b"))
    assert decision == Decision("b", "['mine']") and router.counts == {"['mine']": 1}
    assert router.failures == 0


def test_a_plugin_policy_that_cannot_be_made_is_replaced_by_the_least_loaded_replica():
    from justllm.gateway.routing import fallback_router

    router = fallback_router(RoutingConfig())
    loads = [ReplicaLoad("a", running=3), ReplicaLoad("b", running=1)]
    assert router.choose(ask("x", session="s"), loads) == Decision("b", "policy-failed")
    assert router.counts == {"policy-failed": 1}
    # sessions are still followed
    assert router.choose(ask("y", session="s"), [ReplicaLoad("a"), ReplicaLoad("b", running=5)]
                         ) == Decision("b", "session")
