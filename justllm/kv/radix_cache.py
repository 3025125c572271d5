"""A radix tree over token ids whose nodes reference KV held by llama.cpp sequence ids.

The tree never holds KV (SGLang's design): a node says "positions ``start..end`` of these
tokens are in the cells of sequence ``holder``". In llama.cpp's unified KV cache a hit is then a
zero-copy ``seq_cp(holder, new_seq, start, end)`` (docs/llama-cpp-facts.md), and eviction is a
``seq_rm(holder, start, end)``. The cache returns those operations as :class:`KVOp`s for the
runner; it never calls llama.cpp itself, so it is tested with no model.

Holders:
- a *live* node's holder is a running request whose prompt was just computed, so a request
  arriving with the same prefix can share it at once; its cells are counted in that request's
  blocks, and it cannot be evicted while the request runs;
- when a request ends (finish, abort or preemption) its sequence is handed to the cache: the
  part of it that the tree already had is dropped from it, the rest becomes owned nodes whose
  blocks the cache reserves from the pool, and the sequence id stays alive as their holder
  until eviction removes its last node.

Nodes on a running request's matched path are locked (counts along the path); only unlocked,
non-live leaves are evicted, in the order a pluggable :class:`EvictionPolicy` chooses. Evicting
for a number of blocks (room in the pool, or the cache's cap) takes whole leaves but the last,
which loses only the tail that is too much.

Trees: KV computed under one LoRA adapter set is not the KV another set (or the base model)
would compute, so every lookup and insertion names a *tree key* (the scheduler's adapter set;
``()`` for the base model) and each key has a tree of its own under its own root. The block
accounting, holders and eviction are shared by all trees.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from justllm.kv.block_pool import BlockPool
from justllm.kv.cache_stats import PrefixCacheStats


class KVOpKind(enum.Enum):
    RM = "rm"
    CP = "cp"


@dataclass(frozen=True)
class KVOp:
    """``RM``: drop positions p0..p1 of ``seq`` (-1: open); ``CP``: tag ``src``'s cells at
    p0..p1 with ``seq`` too. The runner applies them in order before the step's batch."""

    kind: KVOpKind
    seq: int
    p0: int = -1
    p1: int = -1
    src: int = -1

    @staticmethod
    def rm(seq: int, p0: int = -1, p1: int = -1) -> "KVOp":
        return KVOp(KVOpKind.RM, seq, p0, p1)

    @staticmethod
    def cp(src: int, dst: int, p0: int, p1: int) -> "KVOp":
        return KVOp(KVOpKind.CP, dst, p0, p1, src)

    @property
    def drops_sequence(self) -> bool:
        """The whole sequence goes: among the cache's operations, a holder it gives up (the
        sequence id is free for reuse once this runs)."""
        return self.kind is KVOpKind.RM and self.p0 == -1 and self.p1 == -1


def freed_sequences(ops: list[KVOp]) -> list[int]:
    """Sequence ids the operations give up whole."""
    return [op.seq for op in ops if op.drops_sequence]


@dataclass(eq=False)
class RadixNode:
    tokens: list[int]
    start: int
    parent: "RadixNode | None"
    holder: int
    children: dict[int, "RadixNode"] = field(default_factory=dict)
    live: bool = False
    lock: int = 0
    last_access: int = 0
    referenced: bool = True  # for the clock policy
    tree: Hashable = ()  # the key of the tree the node is in (its root's)

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


class EvictionPolicy(Protocol):
    def pick(self, candidates: list[RadixNode]) -> RadixNode: ...


def _age(node: RadixNode) -> tuple[int, int, int]:
    """Least recently used first; ties broken by position and holder (unique per node), so the
    order never depends on how a set iterates."""
    return node.last_access, node.start, node.holder


class LRUPolicy:
    """Evict the least recently matched or inserted leaf."""

    def pick(self, candidates: list[RadixNode]) -> RadixNode:
        return min(candidates, key=_age)


class ClockPolicy:
    """Second chance: a leaf used since the hand last passed it is spared once."""

    def pick(self, candidates: list[RadixNode]) -> RadixNode:
        ordered = sorted(candidates, key=_age)
        for node in ordered:
            if not node.referenced:
                return node
            node.referenced = False
        return ordered[0]


EVICTION_POLICIES: dict[str, type[LRUPolicy] | type[ClockPolicy]] = {
    "lru": LRUPolicy, "clock": ClockPolicy}


def make_eviction_policy(name: str) -> EvictionPolicy:
    try:
        return EVICTION_POLICIES[name]()
    except KeyError:
        raise ValueError(f"eviction policy must be one of {', '.join(EVICTION_POLICIES)} "
                         f"(got {name!r})") from None


@dataclass(frozen=True)
class Match:
    length: int
    nodes: list[RadixNode]

    @property
    def last(self) -> RadixNode | None:
        return self.nodes[-1] if self.nodes else None

    def copy_ops(self, dst: int) -> list[KVOp]:
        return [KVOp.cp(n.holder, dst, n.start, min(n.end, self.length)) for n in self.nodes]


class RadixCache:
    """The tree, its holders and its share of the block pool. Only the scheduler calls it.

    Every change comes back as the KV operations the runner must apply; a holder the cache
    gives up is a whole-sequence ``rm`` among them (:func:`freed_sequences`)."""

    def __init__(self, pool: BlockPool, *, max_blocks: int | None = None,
                 policy: EvictionPolicy | None = None) -> None:
        self.pool = pool
        self.max_blocks = max_blocks
        self.policy = policy or LRUPolicy()
        self.root = RadixNode([], 0, None, -1)  # the base model's tree (key ``()``)
        self._roots: dict[Hashable, RadixNode] = {(): self.root}
        # The cache's share of the pool: blocks_for(_owned_tokens) blocks, held as one.
        self._block_ids: list[int] = []
        self._owned_tokens = 0
        self._tick = itertools.count(1)
        self._holder_nodes: dict[int, int] = {}  # seq id -> how many nodes it holds
        # Leaves that may be evicted now (no children, unlocked, not live), kept up to date at
        # every change so eviction never walks the tree (SGLang keeps the same set).
        self._evictable: set[RadixNode] = set()
        self._hits = self._misses = self._queried = self._hit_tokens = 0

    # ---- lookup ---------------------------------------------------------------------------

    def match(self, tokens: list[int], limit: int, key: Hashable = ()) -> Match:
        """The longest cached prefix of ``tokens[:limit]`` (token granularity) in tree ``key``."""
        node, pos, path = self._roots.get(key), 0, []
        if node is None:
            return Match(0, [])
        tick = next(self._tick)
        while pos < limit:
            child = node.children.get(tokens[pos])
            if child is None:
                break
            k = _common(child.tokens, tokens, pos, limit)
            child.last_access = tick
            child.referenced = True
            path.append(child)
            pos += k
            if k < len(child.tokens):
                break
            node = child
        return Match(pos, path)

    def record_lookup(self, queried: int, hit: int) -> None:
        """Count a request as a hit when it reused at least one block (a shared BOS token
        alone is not worth reporting as a hit)."""
        self._queried += queried
        self._hit_tokens += hit
        if hit >= self.pool.block_size:
            self._hits += 1
        else:
            self._misses += 1

    def hold(self, match: Match) -> RadixNode | None:
        """Lock a request's matched path and return the node to unlock when it is done. A
        match that ends inside its last node first cuts that node there (SGLang splits on a
        match too), so the request pins exactly the tokens it reuses: locking the whole node
        would pin its tail as well, and a long cached prompt of which a request shares only
        the first few tokens could then never be evicted to make that request room."""
        last = match.last
        if last is not None and match.length < last.end:
            match.nodes[-1] = last = self._split(last, match.length - last.start)
        self.lock(last)
        return last

    def lock(self, node: RadixNode | None) -> None:
        """Lock ``node`` and every ancestor (a request's matched path)."""
        while node is not None and node.parent is not None:
            node.lock += 1
            self._evictable.discard(node)
            node = node.parent

    def unlock(self, node: RadixNode | None) -> None:
        while node is not None and node.parent is not None:
            node.lock -= 1
            self._refresh(node)
            node = node.parent

    def _refresh(self, node: RadixNode) -> None:
        """Put ``node`` in or out of the evictable set after a change to it."""
        if node.parent is None:  # a root
            return
        if not node.children and not node.lock and not node.live:
            self._evictable.add(node)
        else:
            self._evictable.discard(node)

    # ---- insertion ------------------------------------------------------------------------

    def insert(self, tokens: list[int], seq: int, *, live: bool,
               key: Hashable = ()) -> list[KVOp]:
        """Record that ``seq`` holds ``tokens`` at positions ``0..len(tokens)``, computed
        under tree ``key``'s adapters.

        ``live``: ``seq`` is still running (its blocks count its cells); only new nodes are
        added. Otherwise ``seq`` is handed over: what other holders already cover is dropped
        from it (returned as ``rm`` ops), its live nodes become owned, the rest becomes new
        owned nodes. If the pool cannot hold the new tail, the tail is dropped instead.

        A hand-over must come right after the request gave back its blocks: its live nodes are
        then always ownable (see the module docstring), and a failure to own one is a bug.
        """
        ops: list[KVOp] = []
        root = self._roots.get(key)
        if root is None:
            root = self._roots[key] = RadixNode([], 0, None, -1, tree=key)
        node, pos, n = root, 0, len(tokens)
        tick = next(self._tick)
        while pos < n:
            child = node.children.get(tokens[pos])
            if child is None:
                break
            k = _common(child.tokens, tokens, pos, n)
            if k < len(child.tokens):
                child = self._split(child, k)
            child.last_access = tick
            if child.holder != seq:
                if not live:
                    ops.append(KVOp.rm(seq, child.start, child.end))
            elif child.live and not live:
                if not self._reserve(len(child.tokens)):
                    raise RuntimeError(
                        f"prefix cache: no room to own sequence {seq}'s cached prompt; a "
                        "hand-over must follow the release of the request's blocks")
                child.live = False
                self._refresh(child)
            node, pos = child, pos + k
        if pos < n and (live or self._reserve(n - pos)):
            new = RadixNode(tokens[pos:], pos, node, seq, live=live, last_access=tick,
                            tree=key)
            node.children[tokens[pos]] = new
            self._holder_nodes[seq] = self._holder_nodes.get(seq, 0) + 1
            self._refresh(node)
            self._refresh(new)
            pos = n
        if not root.children and root is not self.root:
            self._roots.pop(key, None)
        if not live:
            if pos < n:
                ops.append(KVOp.rm(seq, pos, -1))
            if self._holder_nodes.get(seq, 0) == 0:
                ops.append(KVOp.rm(seq))
            ops += self._enforce_cap()
        return ops

    def holds(self, seq: int) -> bool:
        return self._holder_nodes.get(seq, 0) > 0

    def _reserve(self, n_tokens: int) -> bool:
        """Take blocks from the pool for ``n_tokens`` more owned tokens; False if they don't fit."""
        need = self.pool.blocks_for(self._owned_tokens + n_tokens) - len(self._block_ids)
        if need > 0:
            if not self.pool.can_allocate(need):
                return False
            self._block_ids += self.pool.allocate(need)
        self._owned_tokens += n_tokens
        return True

    def _unreserve(self, n_tokens: int) -> None:
        self._owned_tokens -= n_tokens
        keep = self.pool.blocks_for(self._owned_tokens)
        if len(self._block_ids) > keep:
            self.pool.free(self._block_ids[keep:])
            del self._block_ids[keep:]

    def _split(self, node: RadixNode, k: int) -> RadixNode:
        """Cut ``node`` after ``k`` tokens and return the new head. The node object keeps the
        tail, the head goes above it: requests hold their deepest node, and unlocking walks up
        from it. Costs no blocks (accounting is by tokens)."""
        parent = node.parent
        assert parent is not None
        head = RadixNode(node.tokens[:k], node.start, parent, node.holder,
                         {node.tokens[k]: node}, live=node.live, lock=node.lock,
                         last_access=node.last_access, tree=node.tree)
        parent.children[node.tokens[0]] = head  # a head has a child: never evictable
        node.tokens = node.tokens[k:]
        node.start += k
        node.parent = head
        self._holder_nodes[node.holder] = self._holder_nodes.get(node.holder, 0) + 1
        return head

    # ---- eviction -------------------------------------------------------------------------

    def evict_one(self) -> list[KVOp] | None:
        """Evict one leaf; None when nothing can be evicted. A holder that loses its last
        node is given up (a whole-sequence ``rm``: see :func:`freed_sequences`)."""
        leaf = self.spill_candidate()
        return None if leaf is None else self._evict(leaf)

    def spill_candidate(self) -> RadixNode | None:
        """The leaf the policy would evict next (None when nothing can go): the host tier
        copies its prefix out first (kv/host_cache.py), then :meth:`evict` drops it."""
        return self.policy.pick(list(self._evictable)) if self._evictable else None

    def is_evictable(self, node: RadixNode) -> bool:
        return node in self._evictable

    def evict(self, leaf: RadixNode) -> list[KVOp]:
        """Evict ``leaf`` (one :meth:`spill_candidate` returned, with no change since)."""
        assert leaf in self._evictable
        return self._evict(leaf)

    @staticmethod
    def path_tokens(node: RadixNode) -> list[int]:
        """The tokens from position 0 through ``node``'s last."""
        parts = []
        while node.parent is not None:
            parts.append(node.tokens)
            node = node.parent
        return [t for part in reversed(parts) for t in part]

    def _evict(self, victim: RadixNode) -> list[KVOp]:
        parent = victim.parent
        assert parent is not None
        del parent.children[victim.tokens[0]]
        self._evictable.discard(victim)
        self._refresh(parent)
        if parent.parent is None and not parent.children and parent is not self.root:
            self._roots.pop(parent.tree, None)  # an adapter set's tree that is empty now
        self._unreserve(len(victim.tokens))
        ops = [KVOp.rm(victim.holder, victim.start, victim.end)]
        left = self._holder_nodes[victim.holder] - 1
        if left:
            self._holder_nodes[victim.holder] = left
        else:
            del self._holder_nodes[victim.holder]
            ops.append(KVOp.rm(victim.holder))
        return ops

    def _shrink_to(self, blocks: int) -> list[KVOp]:
        """Evict until the cache holds at most ``blocks`` blocks (or nothing more can go).

        The last victim loses only the tail that is too much (vLLM frees a prefix's blocks
        from its end too): a prefix longer than the room left keeps the head that fits, so one
        long system prompt past ``--prefix-cache-blocks`` still saves most of its prefill
        instead of emptying the cache."""
        ops: list[KVOp] = []
        while self.num_blocks > blocks and self._evictable:
            victim = self.policy.pick(list(self._evictable))
            excess = self._owned_tokens - max(blocks, 0) * self.pool.block_size
            if excess < len(victim.tokens):
                ops += self._trim(victim, len(victim.tokens) - excess)
            else:
                ops += self._evict(victim)
        return ops

    def _trim(self, leaf: RadixNode, keep: int) -> list[KVOp]:
        """Drop all but the first ``keep`` (>= 1) tokens of an evictable leaf."""
        end = leaf.end
        self._unreserve(len(leaf.tokens) - keep)
        del leaf.tokens[keep:]
        return [KVOp.rm(leaf.holder, leaf.end, end)]

    def evict_blocks(self, needed: int) -> list[KVOp]:
        """Evict until the pool has ``needed`` free blocks or nothing more can go (the last
        prefix evicted may keep its head: :meth:`_shrink_to`)."""
        short = needed - self.pool.num_free
        return self._shrink_to(self.num_blocks - short) if short > 0 else []

    def evict_holder(self) -> list[KVOp]:
        """Evict until some holder sequence id is given up (or nothing more can go)."""
        ops: list[KVOp] = []
        while not freed_sequences(ops):
            more = self.evict_one()
            if more is None:
                break
            ops += more
        return ops

    def flush(self) -> list[KVOp]:
        return self._shrink_to(0)

    def flush_trees(self, which: Callable[[Hashable], bool]) -> list[KVOp]:
        """Evict every unlocked entry of the trees whose key ``which`` accepts (an adapter
        that is unloaded: its KV can never be matched again)."""
        ops: list[KVOp] = []
        while True:
            candidates = [n for n in self._evictable if which(n.tree)]
            if not candidates:
                return ops
            ops += self._evict(self.policy.pick(candidates))

    def _enforce_cap(self) -> list[KVOp]:
        if self.max_blocks is None:
            return []
        return self._shrink_to(self.max_blocks)

    # ---- introspection --------------------------------------------------------------------

    def _nodes(self) -> Iterator[RadixNode]:
        stack = [n for root in self._roots.values() for n in root.children.values()]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    @property
    def num_blocks(self) -> int:
        return len(self._block_ids)

    def held_ranges(self) -> dict[int, list[tuple[int, int]]]:
        """Holder sequence id -> the positions its owned nodes name (what llama.cpp must hold
        for it)."""
        out: dict[int, list[tuple[int, int]]] = {}
        for n in self._nodes():
            if not n.live:
                out.setdefault(n.holder, []).append((n.start, n.end))
        return out

    def live_ranges(self) -> dict[int, list[tuple[int, int]]]:
        """Running request's sequence id -> the positions of its live nodes."""
        out: dict[int, list[tuple[int, int]]] = {}
        for n in self._nodes():
            if n.live:
                out.setdefault(n.holder, []).append((n.start, n.end))
        return out

    def check(self) -> list[str]:
        """The tree's own invariants, in words (empty when sound): token accounting, holder
        counts, positions that follow on from the parent, locks that cover their subtree."""
        problems = []
        counts: dict[int, int] = {}
        owned = 0
        for n in self._nodes():
            counts[n.holder] = counts.get(n.holder, 0) + 1
            if not n.live:
                owned += len(n.tokens)
            parent = n.parent
            assert parent is not None
            if n.start != parent.end or not n.tokens:
                problems.append(f"node {n.tokens[:4]}@{n.start} does not follow its parent")
            if parent.parent is not None and parent.lock < n.lock:
                problems.append(f"node @{n.start} is locked more than its parent")
            if parent.children.get(n.tokens[0] if n.tokens else -1) is not n:
                problems.append(f"node @{n.start} is not its parent's child")
            if n.tree != parent.tree:
                problems.append(f"node @{n.start} is in tree {n.tree!r}, its parent in "
                                f"{parent.tree!r}")
        if counts != self._holder_nodes:
            problems.append(f"holder counts {self._holder_nodes} != nodes per holder {counts}")
        if owned != self._owned_tokens:
            problems.append(f"owned tokens {self._owned_tokens} != tokens in owned nodes {owned}")
        if len(self._block_ids) != self.pool.blocks_for(owned):
            problems.append(f"{len(self._block_ids)} blocks held for {owned} owned tokens")
        evictable = {n for n in self._nodes() if not n.children and not n.lock and not n.live}
        if evictable != self._evictable:
            problems.append(f"evictable set has {len(self._evictable)} nodes, "
                            f"the tree {len(evictable)}")
        return problems

    @property
    def num_tokens(self) -> int:
        return sum(len(n.tokens) for n in self._nodes())

    def idle_blocks(self) -> int:
        """The blocks of the cache's share that no running request uses: its owned nodes that
        no request's matched path locks (a lock counts up the whole path, so an unlocked node
        has no locked node below it). They are freed on demand, so vLLM counts such blocks
        as free in its KV usage."""
        busy = sum(len(n.tokens) for n in self._nodes() if not n.live and n.lock)
        return max(0, self.num_blocks - self.pool.blocks_for(busy))

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(hits=self._hits, misses=self._misses,
                                queried_tokens=self._queried, hit_tokens=self._hit_tokens,
                                blocks=self.num_blocks, idle_blocks=self.idle_blocks())

    def dump(self, fmt: Callable[[RadixNode], str] | None = None) -> list[str]:
        """The tree as indented lines (tests and debugging)."""
        fmt = fmt or (lambda n: f"{n.tokens}@{n.start} h{n.holder}{' live' if n.live else ''}"
                                f"{' L' + str(n.lock) if n.lock else ''}")
        out: list[str] = []

        def walk(node: RadixNode, depth: int) -> None:
            for key in sorted(node.children):
                child = node.children[key]
                out.append("  " * depth + fmt(child))
                walk(child, depth + 1)

        walk(self.root, 0)
        for key, root in self._roots.items():
            if root is not self.root:
                out.append(f"tree {key!r}:")
                walk(root, 1)
        return out


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share (list compares run in C; a binary search
    finds the first difference)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n - 1  # a[:lo] == b[:lo], a[:hi + 1] != b[:hi + 1]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _common(node_tokens: list[int], tokens: list[int], pos: int, limit: int) -> int:
    n = min(len(node_tokens), limit - pos)
    k = 0
    while k < n and node_tokens[k] == tokens[pos + k]:
        k += 1
    return k
