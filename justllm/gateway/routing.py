"""Which replica of a model serves a request: named routing policies, each a pure function of
the request, the replicas' loads and what the router itself routed before. No clock, no I/O,
no processes, so every policy is tested with no model.

Policies (``RoutingConfig.policy``, chosen per model):

- ``round-robin``: the next available replica after the last one chosen, in the caller's order.
- ``least-load``: fewest running + waiting requests, then lower KV use (in steps of 1/KV_STEPS,
  so noise in the polled value does not decide), then lower recent TTFT.
- ``power-of-two``: two replicas drawn at random, the less loaded of them. With loads that are a
  poll old, it spreads a burst where least-load would send all of it to one replica.
- ``cache-aware`` (the default; SGLang's router policy, rethought): a :class:`PrefixTree` per
  model of the prompt text routed to each replica stands for what each replica's prefix cache
  holds. The replica with the longest match wins when the match covers at least
  ``cache_threshold`` of the prompt and it is not overloaded (its load more than
  ``balance_abs_threshold`` above the least loaded's, and more than ``balance_rel_threshold``
  times it); otherwise the least loaded replica does (reason ``load`` when a match was refused
  for load, ``fallback`` when no match was good enough). SGLang compares the most and the least
  loaded of all replicas and, when they are imbalanced, sends every request to the least
  loaded; here only the replica a request would go to is compared, so one busy replica does not
  break every other prefix's affinity, and a shorter match that still passes the threshold on a
  replica that is not overloaded beats a longer one on a replica that is. Among equally loaded
  replicas the one whose tree holds least wins (SGLang's choice for a prompt nobody cached),
  so new conversations on an idle model spread rather than all going to the first replica.

Every policy: unhealthy replicas and those that refused this very request (``skip``: a 429 or
503) are never chosen, and none left raises :class:`NoReplica`. With ``sticky_sessions``, a
request with a session key (the OpenAI ``user`` field or an ``X-Session-Id`` header) goes to
the replica its session last went to while that replica is available, whatever its load (the
issue's rule, and llm-d's and SGLang's: a conversation's KV is there; imbalance is left to the
requests without a session); otherwise it is routed as usual and the session moves with it.
Each decision is counted by reason in ``Router.counts`` for ``/metrics``.

The caller polls each replica's ``/metrics`` every few hundred ms for ``running``, ``waiting``
and ``kv_usage``. Between two polls it should add the requests it has sent to a replica since
the last poll to that replica's ``waiting``: with the bare snapshot, every request until the
next poll sees the same least loaded replica. A router is used from one event loop (not thread
safe); ``forget_replica`` drops what it knows of a replica that died (a new process has an
empty cache).

The same policies serve Ray Serve (justllm/cluster/router.py): there a decision is made in two
halves, ``propose`` (which replica; Ray gets the order :func:`ranked` gives) and ``commit``
(what the policy remembers of it; again for another replica if Ray sends the request to a
later one), and a replica's load comes from its own report (:func:`reported_load`).
"""

from __future__ import annotations

import logging
import math
import random
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, Protocol, cast, get_args

from justllm.errors import JustLLMError

log = logging.getLogger(__name__)

Reason = Literal["prefix", "load", "fallback", "session", "round-robin", "least-load",
                 "power-of-two", "policy-failed"]
REASONS: tuple[Reason, ...] = get_args(Reason)  # every reason, so /metrics can show zeros
KV_STEPS = 10  # KV usage ranks in steps of 10%: 41% and 43% are equally full


class NoReplica(JustLLMError):
    """No replica of the model can take the request (all unhealthy, or all refused it)."""


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica as the caller last saw it (see the module's note on stale polls).

    ``kv_usage`` is 0..1; ``ttft_p50`` is the recent median time to first token in seconds,
    None while not measured (ranked as fast, so a new replica gets requests and is measured).
    ``skip``: the replica refused this very request (429 or 503); try another."""

    id: str
    healthy: bool = True
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    ttft_p50: float | None = None
    skip: bool = False

    @property
    def load(self) -> int:
        return self.running + self.waiting

    @property
    def available(self) -> bool:
        return self.healthy and not self.skip


def load_rank(r: ReplicaLoad) -> tuple[int, int, float]:
    """Least loaded first: running + waiting, then KV usage in steps, then recent TTFT."""
    kv_step = math.floor(r.kv_usage * KV_STEPS + 1e-9)
    return r.load, kv_step, r.ttft_p50 if r.ttft_p50 is not None else 0.0


@dataclass(frozen=True)
class RouteRequest:
    """What routing sees of a request: the prompt as text (for chat, the caller's rendering of
    the messages, the same for every request of a conversation) and an optional session key."""

    text: str = ""
    session: str | None = None


@dataclass(frozen=True)
class Decision:
    replica: str
    reason: Reason
    matched: int = 0  # characters of the prompt the chosen replica has seen (cache-aware)


@dataclass(frozen=True)
class RoutingConfig:
    """One model's routing options (models.yaml: ``routing:``, see :func:`routing_config`)."""

    policy: str = "cache-aware"
    # A replica whose load (running + waiting) is at most this above the least loaded's keeps
    # its prefixes: SGLang's default, and one batch at justllm's default max-seqs (a model
    # that sets max-seqs gets that: routing_config's ``batch``).
    balance_abs_threshold: int = 32
    # ...as does one whose load is at most this many times the least loaded's (overloaded is
    # both thresholds passed). SGLang's 1.0001 leaves the decision to the difference; but when
    # every replica is deeply queued, 32 requests more is a small part of the wait and the
    # prefill a hit saves is worth it. At 1.5 a hit is given up only for a replica with under
    # two thirds of the load.
    balance_rel_threshold: float = 1.5
    # The share of the prompt a replica must have seen to win on its prefix (SGLang's default):
    # below half, the prefill saved is less than the prefill left, and load matters more.
    cache_threshold: float = 0.5
    # Characters of each prompt that routing looks at and stores: ~1,000 tokens tell system
    # prompts, few-shot examples and conversations apart, and bound a decision's cost.
    max_prefix_chars: int = 4096
    # Characters of prompt text remembered per replica (least recently used evicted beyond).
    # A default runner's KV pool holds 1024 x 16 tokens, some 64 Ki characters of English; the
    # tree remembers 4x that, because a stale entry costs at most a miss on a replica within
    # the balance thresholds, while a forgotten one copies the prefix to a second replica.
    # For other runners: about 16 x pool-blocks x block-size.
    max_tree_chars: int = 262_144
    sticky_sessions: bool = True
    max_sessions: int = 10_000  # sessions remembered (least recently used forgotten)
    # A plugin's policy class (routing_config looks its name up); None: POLICIES[policy].
    policy_class: type[Policy] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.policy_class is None and self.policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)} "
                             f"(got {self.policy!r})")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError("balance-abs-threshold must be >= 0 and balance-rel-threshold "
                             ">= 1")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError("cache-threshold must be between 0 and 1")
        if self.max_prefix_chars < 1 or self.max_tree_chars < self.max_prefix_chars:
            raise ValueError("max-prefix-chars must be >= 1 and max-tree-chars >= "
                             "max-prefix-chars (the newest prompt always fits)")
        if self.max_sessions < 1:
            raise ValueError("max-sessions must be >= 1")


def routing_config(data: Any, policies: Mapping[str, type[Policy]] | None = None,
                   batch: int | None = None) -> RoutingConfig:
    """A model's ``routing:`` entry: nothing (the defaults), a policy name, or a mapping of the
    options by their YAML names (``balance-abs-threshold: 16``). ``policies``: the names it may
    use (with plugins, Plugins.routing_policies; default: the built-in POLICIES). ``batch``:
    the replicas' ``max-seqs`` where the model sets it, the ``balance-abs-threshold`` unless
    the entry gives one: a replica that many requests ahead of the least loaded has a batch's
    worth queued (32 kept 28 shared-prefix requests queued on one of two replicas of
    ``max-seqs: 4`` while the other sat idle)."""
    if data is None:
        data = {}
    if isinstance(data, str):
        data = {"policy": data}
    if batch is not None and isinstance(data, dict) and "balance-abs-threshold" not in data:
        data = {**data, "balance-abs-threshold": batch}
    if not isinstance(data, dict):
        raise ValueError("routing must be a policy name or a mapping of options")
    names = {f.name.replace("_", "-"): f.name for f in fields(RoutingConfig)
             if f.name != "policy_class"}
    unknown = sorted(str(k) for k in data if k not in names)
    if unknown:
        raise ValueError(f"routing: unknown key(s) {', '.join(unknown)} (known: "
                         f"{', '.join(names)})")
    defaults = RoutingConfig()
    values: dict[str, Any] = {}
    for key, value in data.items():
        kind = type(getattr(defaults, names[key]))
        if kind is bool:
            ok = isinstance(value, bool)
        else:  # a float option takes an int too; no number option takes a bool
            ok = (isinstance(value, (int, float) if kind is float else kind)
                  and not isinstance(value, bool))
        if not ok:
            what = {bool: "true or false", int: "an integer", float: "a number"}.get(kind, "text")
            raise ValueError(f"routing: {key} must be {what} (got {value!r})")
        values[names[key]] = float(value) if kind is float else value
    policies = POLICIES if policies is None else policies
    policy = values.get("policy", RoutingConfig.policy)
    if policy not in policies:
        raise ValueError(f"routing policy must be one of {', '.join(policies)} "
                         f"(got {policy!r})")
    return RoutingConfig(**values, policy_class=policies[policy])


# ---- the prefix tree --------------------------------------------------------------------------


class _Node:
    """An edge of text below ``parent``; ``entries``: the replicas routed a prompt through it."""

    __slots__ = ("text", "parent", "children", "entries")

    def __init__(self, text: str, parent: _Node | None) -> None:
        self.text = text
        self.parent = parent
        self.children: dict[str, _Node] = {}  # by first character
        self.entries: dict[str, _Entry] = {}  # by replica


class _Entry:
    """A replica was routed the text down to ``node``: a link in that replica's LRU list."""

    __slots__ = ("node", "replica", "prev", "next")

    def __init__(self, node: _Node, replica: str) -> None:
        self.node = node
        self.replica = replica
        self.prev: _Entry = self
        self.next: _Entry = self


class _Lru:
    """One replica's entries, least recently used first: a circular doubly linked list around a
    sentinel, since a split must insert in the middle (an OrderedDict cannot). ``chars``: the
    text of its entries."""

    __slots__ = ("end", "chars")

    def __init__(self, root: _Node, replica: str) -> None:
        self.end = _Entry(root, replica)
        self.chars = 0

    def oldest(self) -> _Entry | None:
        e = self.end.next
        return None if e is self.end else e

    @staticmethod
    def insert_after(at: _Entry, entry: _Entry) -> None:
        entry.prev, entry.next = at, at.next
        at.next.prev = entry
        at.next = entry

    def append(self, entry: _Entry) -> None:
        self.insert_after(self.end.prev, entry)

    @staticmethod
    def unlink(entry: _Entry) -> None:
        entry.prev.next = entry.next
        entry.next.prev = entry.prev


def _common(edge: str, text: str, pos: int) -> int:
    """Characters ``edge`` and ``text[pos:]`` share at the start (compared in C: whole edge,
    then a binary search, so O(len(edge)) character work)."""
    if text.startswith(edge, pos):
        return len(edge)
    lo, hi = 0, min(len(edge), len(text) - pos)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if text.startswith(edge[:mid], pos):
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixTree:
    """An approximate radix tree over characters (compressed edges) of the prompts routed to
    each replica: the gateway's guess of what each replica's prefix cache holds, built from its
    own decisions (SGLang's router keeps one per model the same way).

    Invariants: a replica on a node is on all its ancestors (an insert marks the whole path);
    every node but the root has a replica; in each replica's LRU list a node comes before its
    ancestors (an insert touches its path from the leaf up, a split puts the new upper node
    just after the lower one), so the oldest entry of a replica is always a leaf for it and
    eviction just pops it. A replica's ``chars`` is the text of its nodes: text shared by two
    replicas counts for each, and what is stored is never more than the sum.

    Costs, for a prompt of L characters: ``match`` and ``insert`` are O(L) (plus O(replicas)
    per node on the path); evicting is O(1) per entry removed, so O(1) amortised per character
    inserted; ``forget_replica`` is O(that replica's entries). Emptied nodes are not merged back
    into their parent: a node always holds at least one character, so walks stay O(L).
    """

    def __init__(self) -> None:
        self.root = _Node("", None)
        self._lrus: dict[str, _Lru] = {}

    def chars(self, replica: str) -> int:
        lru = self._lrus.get(replica)
        return lru.chars if lru is not None else 0

    @property
    def replicas(self) -> list[str]:
        return list(self._lrus)

    def match(self, text: str) -> dict[str, int]:
        """The longest prefix of ``text`` each replica was routed, in characters (replicas with
        none are absent). Read-only: the decision's ``insert`` refreshes the path."""
        found: dict[str, int] = {}
        node, pos = self.root, 0
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                break
            n = _common(child.text, text, pos)
            pos += n
            for replica in child.entries:
                found[replica] = pos
            if n < len(child.text):
                break
            node = child
        return found

    def insert(self, text: str, replica: str) -> None:
        """``text`` was routed to ``replica``: its path, made if need be, becomes the replica's
        most recently used."""
        if not text:
            return
        lru = self._lrus.get(replica)
        if lru is None:
            lru = self._lrus[replica] = _Lru(self.root, replica)
        path: list[_Node] = []
        node, pos = self.root, 0
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                child = node.children[text[pos]] = _Node(text[pos:], node)
                path.append(child)
                break
            n = _common(child.text, text, pos)
            if n < len(child.text):
                child = self._split(child, n)
            path.append(child)
            node, pos = child, pos + n
        for node in reversed(path):
            entry = node.entries.get(replica)
            if entry is None:
                entry = node.entries[replica] = _Entry(node, replica)
                lru.chars += len(node.text)
            else:
                lru.unlink(entry)
            lru.append(entry)

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut ``node``'s edge after ``at`` characters; the new upper node is returned, with
        the same replicas, each entry just after the lower node's (so ``chars`` is unchanged)."""
        parent = node.parent
        assert parent is not None  # the root has no edge to cut
        upper = _Node(node.text[:at], parent)
        parent.children[upper.text[0]] = upper
        node.text = node.text[at:]
        node.parent = upper
        upper.children[node.text[0]] = node
        for replica, entry in node.entries.items():
            upper.entries[replica] = above = _Entry(upper, replica)
            _Lru.insert_after(entry, above)
        return upper

    def evict(self, replica: str, max_chars: int) -> int:
        """Drop the replica's least recently used leaves until its text is at most
        ``max_chars``; the characters dropped."""
        lru = self._lrus.get(replica)
        dropped = 0
        while lru is not None and lru.chars > max_chars:
            entry = lru.oldest()
            assert entry is not None  # chars > 0 means entries
            dropped += self._drop(lru, entry)
        return dropped

    def forget_replica(self, replica: str) -> None:
        """The replica is gone (its process died or was stopped): forget all it was routed."""
        lru = self._lrus.pop(replica, None)
        while lru is not None and (entry := lru.oldest()) is not None:
            self._drop(lru, entry)

    def _drop(self, lru: _Lru, entry: _Entry) -> int:
        node = entry.node
        lru.unlink(entry)
        lru.chars -= len(node.text)
        del node.entries[entry.replica]
        if not node.entries and node.parent is not None:  # no replica: no children either
            del node.parent.children[node.text[0]]
            node.parent = None
        return len(node.text)


# ---- the policies -----------------------------------------------------------------------------


class Router(Protocol):
    counts: Counter[str]  # decisions by reason

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaLoad]) -> Decision: ...

    def propose(self, request: RouteRequest, replicas: Sequence[ReplicaLoad]) -> Decision: ...

    def commit(self, request: RouteRequest, decision: Decision) -> None: ...

    def forget_replica(self, replica: str) -> None: ...


class Policy:
    """What every policy shares: availability, NoReplica, sticky sessions, counts. A policy
    implements ``pick`` over the available replicas (never empty); a plugin's policy too
(``register_routing_policies``)."""

    def __init__(self, config: RoutingConfig | None = None, *, seed: int | None = None) -> None:
        self.config = config or RoutingConfig()
        self.counts: Counter[str] = Counter()
        self.failures = 0  # times ``pick`` raised or chose no available replica
        self._rng = random.Random(seed)
        self._sessions: OrderedDict[str, str] = OrderedDict()  # session -> replica

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaLoad]) -> Decision:
        decision = self.propose(request, replicas)
        self.commit(request, decision)
        return decision

    def propose(self, request: RouteRequest, replicas: Sequence[ReplicaLoad]) -> Decision:
        """The decision ``choose`` makes, remembered nowhere (sessions, the prefix tree and
        the counts are left as they are; round-robin's turn and power-of-two's draw do move):
        for a caller that may carry out another one -- Ray Serve's RequestRouter ranks
        replicas (see :func:`ranked`) and may send to a later one -- and calls ``commit``
        with what it did."""
        available = [r for r in replicas if r.available]
        if not available:
            raise NoReplica(f"no replica can take the request ({len(replicas)} replicas, "
                            "none healthy and willing)")
        session = request.session if self.config.sticky_sessions else None
        held = self._sessions.get(session) if session is not None else None
        if held is not None and any(r.id == held for r in available):
            return Decision(held, "session")
        try:
            decision = self.pick(request, available, replicas)
            if isinstance(decision, Decision) and type(decision.reason) is not str:
                # A plugin's reason is counted, and labels /metrics, as text: one that is not
                # hashable failed every request, and mixed types failed /metrics.
                decision = replace(decision, reason=cast(Reason, str(decision.reason)))
        except Exception as e:  # a plugin's policy: its model keeps serving
            return self._failed(available, f"{type(e).__name__}: {e}")
        if not isinstance(decision, Decision) or all(r.id != decision.replica
                                                     for r in available):
            return self._failed(available, f"it chose {decision!r}, not one of the available "
                                           f"replicas ({', '.join(r.id for r in available)})")
        return decision

    def _failed(self, available: list[ReplicaLoad], why: str) -> Decision:
        """``pick`` raised or chose no available replica: the least loaded one serves the
        request (reason ``policy-failed``, counted in /metrics), and the first failure and
        every 1000th after it are logged."""
        self.failures += 1
        if self.failures == 1 or self.failures % 1000 == 0:
            log.warning("routing policy %s failed (%d so far): %s; the least loaded replica "
                        "serves the request", type(self).__name__, self.failures, why)
        best = min(available, key=lambda r: (r.running + r.waiting, r.kv_usage))
        return Decision(best.id, "policy-failed")

    def commit(self, request: RouteRequest, decision: Decision) -> None:
        """``decision`` was carried out: the request's session follows it, the policy
        remembers it (cache-aware: the prompt is now that replica's) and it is counted."""
        session = request.session if self.config.sticky_sessions else None
        if session is not None:
            self._sessions[session] = decision.replica
            self._sessions.move_to_end(session)
            if len(self._sessions) > self.config.max_sessions:
                self._sessions.popitem(last=False)
        self._routed(request, decision)
        self.counts[decision.reason] += 1

    def forget_replica(self, replica: str) -> None:
        for session in [s for s, r in self._sessions.items() if r == replica]:
            del self._sessions[session]

    def pick(self, request: RouteRequest, available: list[ReplicaLoad],
              replicas: Sequence[ReplicaLoad]) -> Decision:
        raise NotImplementedError

    def _routed(self, request: RouteRequest, decision: Decision) -> None:
        """The decision is made (by the policy or a session)."""


class RoundRobin(Policy):
    def __init__(self, config: RoutingConfig | None = None, *, seed: int | None = None) -> None:
        super().__init__(config, seed=seed)
        self._next = 0  # index in the caller's list

    def pick(self, request: RouteRequest, available: list[ReplicaLoad],
              replicas: Sequence[ReplicaLoad]) -> Decision:
        n = len(replicas)
        for step in range(n):
            i = (self._next + step) % n
            if replicas[i].available:
                self._next = i + 1
                return Decision(replicas[i].id, "round-robin")
        raise AssertionError("unreachable: choose checked that one is available")


class LeastLoad(Policy):
    def pick(self, request: RouteRequest, available: list[ReplicaLoad],
              replicas: Sequence[ReplicaLoad]) -> Decision:
        return Decision(min(available, key=load_rank).id, "least-load")


class PowerOfTwo(Policy):
    def pick(self, request: RouteRequest, available: list[ReplicaLoad],
              replicas: Sequence[ReplicaLoad]) -> Decision:
        pair = self._rng.sample(available, 2) if len(available) > 1 else available
        return Decision(min(pair, key=load_rank).id, "power-of-two")


class CacheAware(Policy):
    """The prefix tree's longest match unless that replica is overloaded (module docstring).
    Every decision, a session's too, is inserted into the tree."""

    def __init__(self, config: RoutingConfig | None = None, *, seed: int | None = None) -> None:
        super().__init__(config, seed=seed)
        self.tree = PrefixTree()

    def overloaded(self, r: ReplicaLoad, least: ReplicaLoad) -> bool:
        c = self.config
        return (r.load - least.load > c.balance_abs_threshold
                and r.load > c.balance_rel_threshold * least.load)

    def pick(self, request: RouteRequest, available: list[ReplicaLoad],
              replicas: Sequence[ReplicaLoad]) -> Decision:
        # Among the least loaded, the one whose tree holds least (SGLang's rule for a prompt
        # no replica has cached): on an idle model every load ties, and every new
        # conversation (and each session's first request) went to the first replica.
        least = min(available, key=lambda r: (*load_rank(r), self.tree.chars(r.id)))
        text = request.text[:self.config.max_prefix_chars]
        matched = self.tree.match(text) if text else {}
        need = max(self.config.cache_threshold * len(text), 1)
        hits = [r for r in available if matched.get(r.id, 0) >= need]
        fit = [r for r in hits if not self.overloaded(r, least)]
        if fit:
            best = min(fit, key=lambda r: (-matched[r.id], *load_rank(r)))
            return Decision(best.id, "prefix", matched[best.id])
        return Decision(least.id, "load" if hits else "fallback", matched.get(least.id, 0))

    def _routed(self, request: RouteRequest, decision: Decision) -> None:
        text = request.text[:self.config.max_prefix_chars]
        self.tree.insert(text, decision.replica)
        self.tree.evict(decision.replica, self.config.max_tree_chars)

    def forget_replica(self, replica: str) -> None:
        super().forget_replica(replica)
        self.tree.forget_replica(replica)


POLICIES: dict[str, type[Policy]] = {
    "round-robin": RoundRobin, "least-load": LeastLoad, "power-of-two": PowerOfTwo,
    "cache-aware": CacheAware}


def make_router(config: RoutingConfig | None = None, *, seed: int | None = None) -> Router:
    """The configured policy; ``seed`` makes power-of-two's draws repeatable (tests)."""
    config = config or RoutingConfig()
    return (config.policy_class or POLICIES[config.policy])(config, seed=seed)


class PolicyFailed(Policy):
    """In place of a plugin's policy that could not be made (its constructor raised): the
    least loaded available replica, reason ``policy-failed``, as when a policy's ``pick``
    fails. Sessions are still followed."""

    def pick(self, request: RouteRequest, available: list[ReplicaLoad],
             replicas: Sequence[ReplicaLoad]) -> Decision:
        best = min(available, key=lambda r: (r.running + r.waiting, r.kv_usage))
        return Decision(best.id, "policy-failed")


def fallback_router(config: RoutingConfig) -> Router:
    """What serves a model whose configured policy could not be made (:class:`PolicyFailed`)."""
    return PolicyFailed(config)


# ---- for callers that rank replicas (Ray Serve's RequestRouter, justllm/cluster/router.py) ----


def ranked(decision: Decision, replicas: Sequence[ReplicaLoad]) -> list[str]:
    """Every available replica in order of preference: the decision's first, then the others
    least loaded first. A caller whose transport may find the first one full (Ray Serve's
    ``max_ongoing_requests``) takes the next rather than waiting."""
    rest = sorted((r for r in replicas if r.available and r.id != decision.replica),
                  key=load_rank)
    return [decision.replica, *(r.id for r in rest)]


def reported_load(replica: str, stats: Any, ongoing: int | None = None) -> ReplicaLoad:
    """A replica's load from what it reports of itself (``running``, ``waiting``,
    ``kv_usage``, ``ttft_p50``; missing keys count as nothing) and, when the caller tracks
    it, ``ongoing``: the requests the caller knows the replica has now, which is fresher than
    a report some hundred ms old and replaces its running + waiting (as the gateway's own
    in-flight count does a poll's)."""
    stats = stats if isinstance(stats, dict) else {}

    def number(key: str) -> float:
        value = stats.get(key)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return float(value) if ok and value >= 0 else 0.0

    running, waiting = int(number("running")), int(number("waiting"))
    if ongoing is not None:
        running, waiting = min(running, ongoing), max(0, ongoing - min(running, ongoing))
    ttft = stats.get("ttft_p50")
    return ReplicaLoad(replica, running=running, waiting=waiting,
                       kv_usage=min(1.0, number("kv_usage")),
                       ttft_p50=float(ttft) if isinstance(ttft, (int, float)) and
                       not isinstance(ttft, bool) else None)


def _as_text(value: Any) -> str:
    """A prompt, an input or a message's content as routing text: a string as it is; token
    ids as their numbers (a prefix of ids is a prefix of the text); a list of strings or of
    content parts joined; anything else as nothing."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return ",".join(map(str, value)) + ","
        return "\n".join(
            v if isinstance(v, str) else str(v.get("text", "")) if isinstance(v, dict)
            else _as_text(v) for v in value)
    return ""


def route_text(body: dict) -> str:
    """What routing matches of an OpenAI request body: the chat messages, each as its role and
    content (the same for every turn of a conversation, so a follow-up extends its prefix),
    else the prompt (of a batch of prompts, the first), else the embedding input."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return "".join(f"<{m.get('role', '')}>{_as_text(m.get('content'))}\n"
                       for m in messages if isinstance(m, dict))
    for key in ("prompt", "input"):
        value = body.get(key)
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            value = value[0]  # a batch: route by its first prompt
        if value is not None:
            return _as_text(value)
    return ""
