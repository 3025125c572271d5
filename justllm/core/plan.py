"""What the scheduler asks the runner to compute in one step, and what comes back."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from justllm.core.request import FinishReason, Request
from justllm.kv.radix_cache import KVOp, freed_sequences


@dataclass(frozen=True, eq=False)
class DraftTree:
    """Draft tokens to verify after a request's last token (the root).

    Nodes are in topological order; ``parents[i]`` is the index of node ``i``'s parent, ``-1``
    for the root. A chain (``parents == (-1, 0, 1, ...)``) is the common case; a tree holds
    several candidates at a level, each leaf verified as its own llama.cpp sequence that shares
    the cells of its ancestors. ``q`` optionally holds the proposer's probability rows, one per
    node (a sampled draft, verified with the min(1, p/q) rule); ``None`` means the draft was
    chosen deterministically.
    """

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    q: object | None = None
    # Nodes the request's window asked for; the rest of a longer draft only fill output rows
    # that the step would pay for anyway (see SchedulerConfig.row_multiple). None: all.
    wanted: int | None = None

    @staticmethod
    def chain(tokens: list[int] | tuple[int, ...], q: object | None = None,
              wanted: int | None = None) -> DraftTree:
        return DraftTree(tuple(tokens), tuple(range(-1, len(tokens) - 1)), q, wanted)

    def __len__(self) -> int:
        return len(self.tokens)

    @cached_property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    @cached_property
    def depths(self) -> tuple[int, ...]:
        """Depth of each node (1 for the root's children): its offset from the root."""
        d: list[int] = []
        for p in self.parents:
            d.append(1 if p < 0 else d[p] + 1)
        return tuple(d)

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """Children of the root (index 0) and of each node (index i + 1)."""
        kids: list[list[int]] = [[] for _ in range(len(self.tokens) + 1)]
        for i, p in enumerate(self.parents):
            kids[p + 1].append(i)
        return tuple(tuple(k) for k in kids)

    @cached_property
    def leaves(self) -> tuple[int, ...]:
        return tuple(i for i in range(len(self.tokens)) if not self.children[i + 1])

    @cached_property
    def node_leaves(self) -> tuple[tuple[int, ...], ...]:
        """For each node, the indices (into ``leaves``) of the leaves below or at it."""
        below: list[set[int]] = [set() for _ in self.tokens]
        for j, leaf in enumerate(self.leaves):
            n = leaf
            while n >= 0:
                below[n].add(j)
                n = self.parents[n]
        return tuple(tuple(sorted(b)) for b in below)

    def truncated(self, n: int) -> DraftTree:
        """The first ``n`` nodes (a prefix in topological order is still a tree)."""
        if n >= len(self.tokens):
            return self
        q = None if self.q is None else self.q[:n]  # type: ignore[index]
        return DraftTree(self.tokens[:n], self.parents[:n], q, self.wanted)

    def first_branch(self) -> DraftTree:
        """The chain from the root to the first leaf."""
        nodes = self.path(self.leaves[0]) if self.tokens else []
        q = None if self.q is None else self.q[nodes]  # type: ignore[index]
        return DraftTree.chain([self.tokens[i] for i in nodes], q)

    def path(self, node: int) -> list[int]:
        """Nodes from the root's child down to ``node``."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens ``start .. start+len(token_ids)`` of one request, to be put in this step's batch.

    ``wants_logits`` is true when the chunk ends at the request's last known token, so the step
    samples the next one; a middle chunk of a long prompt asks for no output row (on this model
    output rows are the dearest part of a step on a CPU: the 262k-wide head costs ~26 ms for one
    row and is computed in groups of 4, see docs/llama-cpp-facts.md).

    A speculative chunk is a decode whose ``token_ids`` are the last token followed by
    ``draft.tokens``, with logits on every row; ``leaf_seqs`` are the extra sequence ids of a
    tree's leaves after the first (which uses the request's own sequence). ``all_logits``: a
    prompt chunk with an output row on every token, for the prompt's logprobs (its last row
    is the one sampled from when ``wants_logits``).
    """

    request: Request
    start: int
    token_ids: list[int]
    wants_logits: bool
    draft: DraftTree | None = None
    leaf_seqs: tuple[int, ...] = ()
    all_logits: bool = False

    @property
    def is_decode(self) -> bool:
        return (len(self.token_ids) == 1 or self.draft is not None) \
            and self.start >= self.request.num_prompt_tokens

    @property
    def num_logits(self) -> int:
        if self.draft is not None or self.all_logits:
            return len(self.token_ids)
        return 1 if self.wants_logits else 0


@dataclass
class StepPlan:
    """One step: KV operations first, in order (drops, prefix-cache copies), then one batch."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    kv_ops: list[KVOp] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Extra logits rows, on prompt tokens that need none, that round the step's rows up to the
    # CPU's group of 4 (cheaper than the odd count, docs/llama-cpp-facts.md); the runner asks
    # for them and discards them.
    pad_rows: int = 0
    # Tokens at the head of the batch (the decodes, drafts included) that llama.cpp computes in
    # a llama_decode of their own before the prompt chunks (the scheduler's ``split_decodes_at``
    # says why); 0: one llama_decode for the whole batch.
    split: int = 0

    @property
    def released_seq_ids(self) -> list[int]:
        """Sequences dropped whole in this step."""
        return freed_sequences(self.kv_ops)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def num_logits(self) -> int:
        return sum(c.num_logits for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks and not self.kv_ops


@dataclass
class StepResult:
    """What sampling made of a computed step, for ``Scheduler.update``: the accepted draft nodes
    of each speculative chunk (by chunk index; a missing one accepted nothing) and the requests
    that ended in this step, with why. The sampled tokens themselves are already appended to
    each request's ``output_token_ids`` by the engine, which owns them."""

    paths: dict[int, list[int]] = field(default_factory=dict)
    finished: list[tuple[Request, FinishReason]] = field(default_factory=list)
