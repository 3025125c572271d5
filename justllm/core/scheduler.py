"""Continuous batching: which tokens of which requests go into the next step.

The scheduler is pure: ``schedule()`` returns a :class:`StepPlan`, the runner computes it, and
``update(plan)`` is told it happened. Requests move waiting -> running -> finished. Each step:

1. every running request that is decoding gets its one token (up to ``max_decode``) — a long
   prompt never starves them;
2. running requests still prefilling get a chunk of up to ``chunk_size`` tokens;
3. waiting requests are admitted in the policy's order (core/policy.py: first come first
   served, or by priority) while a sequence id, a prefill slot, token budget and KV blocks for
   their whole prompt are free.

All of it within ``n_batch`` tokens per step, and for requests of one LoRA adapter set only
(llama.cpp applies adapters per context): ``core/lora_groups.py`` picks the set, fairly, and a
set that cannot make progress this step yields to the next. With one set (no adapters) every
request is in it and nothing changes. When decode needs a block and none is free, the
prefix cache is evicted first, then the policy's victim (FCFS: the newest running request) is
preempted: its blocks and sequence id are released and it goes back to the queue, ahead of its
peers, to be recomputed (prompt + output so far) when blocks free up.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from justllm.core.lora_groups import LoraGroups, oldest_by_set
from justllm.core.plan import DraftTree, ScheduledChunk, StepPlan, StepResult
from justllm.core.policy import make_policy
from justllm.core.request import FinishReason, LoraKey, Request, RequestStatus
from justllm.errors import QueueFullError
from justllm.kv.block_pool import BlockPool
from justllm.kv.radix_cache import (
    KVOp,
    RadixCache,
    RadixNode,
    common_prefix_len,
    freed_sequences,
)


@dataclass(frozen=True)
class SchedulerConfig:
    max_seqs: int = 32
    max_prefill: int = 8
    max_decode: int = 32
    chunk_size: int = 256
    n_batch: int = 512
    max_queue: int = 256
    # Sequence ids in the llama.cpp context; those beyond max_seqs hold prefix-cache KV or
    # the extra leaves of a speculative tree.
    n_seq_ids: int = 0
    # Logits rows one step may ask for (the backend's n_outputs_max); 0: no cap below n_batch.
    max_outputs: int = 0
    # Output rows cost by groups of this many (llama.cpp's CPU matmul tiles: 3 rows of the
    # 262k-wide output head cost more than 4); spare draft tokens fill a group. 1: off.
    row_multiple: int = 1
    # A step of at least this many tokens that holds both decodes (fewer than this many
    # tokens) and prompt chunks computes the decodes in a llama_decode of their own (0: never).
    # llama.cpp's CPU flash attention takes a batch of 64 tokens or more in tiles of 64
    # queries and skips a tile of the KV only where the mask hides it from all 64; the decode
    # rows of 8 sequences see every sequence's cells, so in one batch with a prompt chunk they
    # make it attend over the whole KV. Alone (fewer than 64) they take the per-query path,
    # which skips each hidden cell. On this CPU, 8 decodes at ~900 tokens of context beside a
    # 504-token chunk: 1,262 ms in one batch, 1,080 in two (56-token chunk: 438 against 225).
    split_decodes_at: int = 0
    # Admission order and preemption victim (core/policy.py): "fcfs" or "priority".
    policy: str = "fcfs"
    # Consecutive steps one LoRA adapter set may take while another set has work.
    lora_max_steps: int = 4

    def __post_init__(self) -> None:
        for name in ("max_seqs", "max_prefill", "max_decode", "chunk_size", "n_batch",
                     "lora_max_steps", "max_queue"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.chunk_size > self.n_batch:
            raise ValueError("chunk_size must be <= n_batch")
        if self.n_seq_ids and self.n_seq_ids < self.max_seqs:
            raise ValueError("n_seq_ids must be >= max_seqs")
        make_policy(self.policy)  # raises on an unknown name


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool,
                 cache: RadixCache | None = None) -> None:
        self.config = config
        self.pool = pool
        self.cache = cache
        self.policy = make_policy(config.policy)
        # Ordered by the policy (admission order first: nobody jumps a head that cannot start).
        self.waiting: deque[Request] = deque()
        # Ordered by admission; the policy picks the preemption victim.
        self.running: list[Request] = []
        n_ids = config.n_seq_ids or config.max_seqs
        self._free_seq_ids: list[int] = list(range(n_ids - 1, -1, -1))
        # KV operations for the runner, in order, executed before the next batch.
        self._pending_ops: list[KVOp] = []
        self.lora_groups = LoraGroups(config.lora_max_steps)
        self._steps = 0  # schedule() calls: the clock of the adapter-set choice

    # ---- requests in and out -------------------------------------------------------------

    def add(self, request: Request) -> None:
        if len(self.waiting) >= self.config.max_queue:
            raise QueueFullError(
                f"the waiting queue is full ({self.config.max_queue} requests); retry later")
        if self.pool.blocks_for(request.num_tokens) > self.pool.total_blocks:
            raise ValueError("request needs more KV blocks than the pool holds")
        request.status = RequestStatus.WAITING
        request.queued_step = self._steps
        self.policy.enqueue(self.waiting, request)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT
              ) -> Request | None:
        """Remove a request wherever it is; its KV is released before the next step.
        ``reason``: why it ended (a server that ends an answer by its own limits: length)."""
        for req in self.waiting:
            if req.request_id == request_id:
                self.waiting.remove(req)
                self._finish(req, reason)
                return req
        for req in self.running:
            if req.request_id == request_id:
                self.finish(req, reason)
                return req
        return None

    def finish(self, request: Request, reason: FinishReason) -> None:
        if request in self.running:
            self.running.remove(request)
        self._release(request)
        self._finish(request, reason)

    def preempt_victim(self) -> Request | None:
        """Preempt the policy's victim (FCFS: the newest running request) outside a
        schedule() call."""
        if not self.running:
            return None
        victim = self.policy.keep_order(self.running)[-1]
        self._preempt(victim, StepPlan())
        return victim

    def recompute(self, request: Request) -> None:
        """Send a running request back to the queue (ahead of its peers) to be computed again
        from scratch, without the prefix cache: llama.cpp refused its batch because its KV is
        not what we believed, so that KV is dropped, not handed to the cache. Not for a request
        whose prompt the cache already shares (its sequence holds live nodes)."""
        if request.prompt_cached:
            raise ValueError("a request whose prompt is shared cannot be recomputed alone")
        self.running.remove(request)
        self._release(request, hand_over=False)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.kv_errors += 1
        self.policy.requeue(self.waiting, request)

    def flush_cache(self) -> None:
        """Evict every unlocked prefix-cache entry (its KV is dropped at the next step)."""
        if self.cache is not None:
            self._take(self.cache.flush())

    def flush_cache_trees(self, which: Callable[[LoraKey], bool]) -> None:
        """Evict the prefix-cache entries of the adapter sets ``which`` accepts (an adapter
        being unloaded: nothing can match them again)."""
        if self.cache is not None:
            self._take(self.cache.flush_trees(which))  # type: ignore[arg-type]

    # ---- KV moved in and out (prefill/decode disaggregation) ------------------------------

    def take_kv_ops(self) -> list[KVOp]:
        """The pending KV operations, for the engine to apply now (outside a step, before it
        touches a sequence id that was just freed: its cells go with them)."""
        ops, self._pending_ops = self._pending_ops, []
        return ops

    def borrow_seq(self) -> int | None:
        """A free sequence id for work beside the requests (a KV export or import), a cached
        holder evicted if none is free; None when every id is in use. Give it back with
        ``return_seq`` or hand it to ``adopt_prefix``."""
        if not self._free_seq_ids and self.cache is not None:
            self._take(self.cache.evict_holder())
        return self._free_seq_ids.pop() if self._free_seq_ids else None

    def return_seq(self, seq: int) -> None:
        """A borrowed id, its cells dropped before the next step."""
        self._pending_ops.append(KVOp.rm(seq))
        self._free_seq_ids.append(seq)

    def make_room(self, n_tokens: int) -> bool:
        """Free blocks for ``n_tokens`` by evicting cached prefixes nobody uses; False if the
        running requests leave too little."""
        needed = self.pool.blocks_for(n_tokens)
        if not self.pool.can_allocate(needed) and self.cache is not None:
            self._take(self.cache.evict_blocks(needed))
        return self.pool.can_allocate(needed)

    def adopt_prefix(self, tokens: list[int], seq: int, tree: LoraKey = ()) -> None:
        """``seq`` (borrowed, after ``make_room``) holds ``tokens`` at positions 0.., computed
        under the adapter set ``tree``: the prefix cache takes it as a finished request's
        prompt (what it already has is dropped from ``seq``)."""
        if self.cache is None:
            self.return_seq(seq)
            return
        self._take(self.cache.insert(tokens, seq, live=False, key=tree))

    def evict_cached(self, leaf: RadixNode) -> None:
        """Evict one prefix-cache leaf (``cache.spill_candidate()``'s, its prefix copied to
        host memory first); its cells are dropped before the next step."""
        assert self.cache is not None
        self._take(self.cache.evict(leaf))

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._pending_ops)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- the step -------------------------------------------------------------------------

    def decoding(self) -> list[Request]:
        """Running requests whose next step is a decode (candidates for speculation), in the
        policy's keep order: blocks go to them in this order, and a victim is always later.
        Only those of the adapter set the next step will most likely serve."""
        order = self._set_order()
        first = order[0] if order else ()
        return [r for r in self.policy.keep_order(self.running)
                if r.num_uncomputed_tokens == 1 and r.lora == first]

    def _set_order(self) -> list[LoraKey]:
        sets = oldest_by_set((r.lora, r.queued_step)
                             for r in (*self.running, *self.waiting))
        return self.lora_groups.order(sets) if len(sets) > 1 else list(sets)

    def schedule(self, drafts: dict[str, DraftTree] | None = None) -> StepPlan:
        """Plan the next step. ``drafts`` maps request ids to draft tokens to verify after
        their last token; a draft is cut to what the step's token and output budgets, the free
        KV blocks and the free sequence ids allow (speculation never preempts anyone).

        Every chunk of the plan is of one adapter set: the first in ``LoraGroups`` order that
        gets anything scheduled."""
        self._steps += 1
        plan = StepPlan()
        for key in self._set_order():
            self._schedule_set(plan, drafts, key)
            if plan.chunks:
                self.lora_groups.served(key, self._steps)
                break
        plan.kv_ops = self._pending_ops
        self._pending_ops = []
        return plan

    def _schedule_set(self, plan: StepPlan, drafts: dict[str, DraftTree] | None,
                      key: LoraKey) -> None:
        """Fill ``plan`` with the work of the requests of adapter set ``key``."""
        cfg = self.config
        budget = cfg.n_batch

        decoding = [r for r in self.policy.keep_order(self.running)
                    if r.num_uncomputed_tokens == 1 and r.lora == key]
        n_decode = min(len(decoding), cfg.max_decode, budget)
        # Drafts get what one token per decode and one row per prefill leave over.
        max_outputs = cfg.max_outputs or cfg.n_batch
        spare = min(budget - n_decode, max_outputs - n_decode - cfg.max_prefill) if drafts else 0
        decodes: list[Request] = []
        for req in decoding:
            if len(decodes) >= cfg.max_decode or budget < 1:
                break
            if req.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            if self._grow_for_decode(req, plan):
                decodes.append(req)
                budget -= 1
        # Drafts only after every decode has its block: they take what is left over.
        speculative: list[tuple[int, DraftTree]] = []
        for req in decodes:
            pos = req.num_computed_tokens
            draft = drafts.get(req.request_id) if drafts and spare > 0 else None
            chunk = self._speculative_chunk(req, draft, min(spare, budget)) if draft else None
            if chunk is None:
                chunk = ScheduledChunk(req, pos, req.token_slice(pos, pos + 1), True)
            else:
                speculative.append((len(plan.chunks), draft))  # type: ignore[arg-type]
            plan.chunks.append(chunk)
            budget -= len(chunk.token_ids) - 1
            spare -= len(chunk.token_ids) - 1

        n_prefill = 0
        for req in self.running:
            if budget < 1 or n_prefill >= cfg.max_prefill:
                break
            if req.num_uncomputed_tokens > 1 and req.lora == key:
                budget -= self._schedule_prefill(req, plan, budget)
                n_prefill += 1

        waiting = [r for r in self.waiting if r.lora == key]
        for req in waiting:
            if budget < 1 or n_prefill >= cfg.max_prefill or len(self.running) >= cfg.max_seqs:
                break
            # When the head (of this set) cannot start, nobody of its set jumps the queue.
            if not self._admit(req):
                break
            self.waiting.remove(req)
            self.running.append(req)
            budget -= self._schedule_prefill(req, plan, budget)
            n_prefill += 1

        if speculative and cfg.row_multiple > 1:
            self._fill_row_group(plan, speculative, budget)
        plan.split = self._split(plan)
        if cfg.row_multiple > 1:
            plan.pad_rows = self._pad_rows(plan)

    def _split(self, plan: StepPlan) -> int:
        """The decodes' tokens when they go in a llama_decode of their own (``split_decodes_at``),
        else 0. Decodes come first in a plan."""
        at = self.config.split_decodes_at
        if not at or plan.num_tokens < at:
            return 0
        lead = sum(len(c.token_ids) for c in plan.chunks[:_decodes_first(plan.chunks)])
        return lead if 0 < lead < at else 0  # (at <= num_tokens: a prompt chunk follows)

    def update(self, plan: StepPlan, result: StepResult | None = None) -> list[Request]:
        """The runner computed ``plan`` and the engine sampled it into ``result``; returns the
        requests that finished.

        In order: the computed tokens are now in the KV (a prompt that is complete is offered to
        the prefix cache at once, live, so requests arriving with the same prefix share it while
        this one is still running); each speculative chunk keeps the KV of its accepted draft
        nodes and drops the rest (:meth:`settle`); finished requests release their KV. Without
        ``result`` (pure scheduling tests) only the first happens."""
        for chunk in plan.chunks:
            req = chunk.request
            # Of a speculative chunk only the root is known good; settle() adds the rest.
            req.num_computed_tokens += 1 if chunk.draft is not None else len(chunk.token_ids)
            if (self.cache is not None and not req.prompt_cached and req.seq_id is not None
                    and req.num_computed_tokens >= req.num_prompt_tokens):
                req.prompt_cached = True
                self._take(self.cache.insert(req.prompt_token_ids, req.seq_id, live=True,
                                             key=req.lora))
        if result is None:
            return []
        for i, chunk in enumerate(plan.chunks):
            if chunk.draft is not None:
                self.settle(chunk, result.paths.get(i, []))
        finished = []
        for req, reason in result.finished:
            if req.status is RequestStatus.RUNNING:
                self.finish(req, reason)
                finished.append(req)
        return finished

    def settle(self, chunk: ScheduledChunk, path: list[int]) -> None:
        """Verification of ``chunk``'s draft kept the nodes ``path`` (root's child first): keep
        their cells in the request's sequence, drop every other draft cell and the tree's extra
        sequences, and give back blocks held for rejected drafts. ``update`` calls it for every
        speculative chunk, before finishing anyone, also for a request aborted while the step ran
        (its extra sequences still hold cells)."""
        draft, req = chunk.draft, chunk.request
        assert draft is not None
        ops = self._pending_ops
        if req.seq_id is not None and req.status is RequestStatus.RUNNING:
            main, first_kept = req.seq_id, chunk.start + 1
            n_keep = len(path)
            winner = draft.node_leaves[path[-1]][0] if path else 0
            if winner == 0:
                ops.append(KVOp.rm(main, first_kept + n_keep, -1))
            else:  # the accepted path lives in another leaf's sequence: copy it over
                ops.append(KVOp.rm(main, first_kept, -1))
                ops.append(KVOp.cp(chunk.leaf_seqs[winner - 1], main, first_kept,
                                   first_kept + n_keep))
            req.num_computed_tokens = first_kept + n_keep
            self._trim_blocks(req)
        self._free_leaf_seqs(chunk)

    def undo(self, plan: StepPlan) -> None:
        """llama.cpp refused ``plan``'s batch (it may have written part of it): drop every
        cell the batch could have added, so those positions are computed afresh, and give
        back what speculative chunks held."""
        for chunk in plan.chunks:
            req = chunk.request
            if req.seq_id is not None and req.status is RequestStatus.RUNNING:
                self._pending_ops.append(KVOp.rm(req.seq_id, chunk.start, -1))
                if chunk.draft is not None:
                    self._trim_blocks(req)
            self._free_leaf_seqs(chunk)

    def _trim_blocks(self, req: Request, extra: int = 0) -> None:
        """Free blocks held beyond the request's tokens (those of rejected draft cells) and
        ``extra`` more cells."""
        keep = self.pool.blocks_for(req.num_tokens - req.num_cached_tokens + extra)
        if len(req.block_ids) > keep:
            self.pool.free(req.block_ids[keep:])
            del req.block_ids[keep:]

    def _free_cells(self, req: Request, extra: int) -> int:
        """Cells ``req`` could add beyond its tokens and ``extra`` draft cells: the rest of
        its blocks plus every free block."""
        held = (len(req.block_ids) + self.pool.num_free) * self.pool.block_size
        return held - (req.num_tokens - req.num_cached_tokens + extra)

    def _hold_cells(self, req: Request, extra: int) -> None:
        """Give ``req`` blocks for its tokens and ``extra`` draft cells (callers checked
        ``_free_cells``)."""
        needed = self.pool.blocks_for(req.num_tokens - req.num_cached_tokens + extra)
        if needed > len(req.block_ids):
            req.block_ids.extend(self.pool.allocate(needed - len(req.block_ids)))

    def _free_leaf_seqs(self, chunk: ScheduledChunk) -> None:
        for seq in chunk.leaf_seqs:
            self._pending_ops.append(KVOp.rm(seq))
            self._free_seq_ids.append(seq)

    # ---- internals ------------------------------------------------------------------------

    def _fill_row_group(self, plan: StepPlan, speculative: list[tuple[int, DraftTree]],
                        budget: int) -> None:
        """Lengthen chain drafts with the tokens their window left out, up to the end of the
        step's last group of output rows: those rows cost nothing more. A step left one row
        into a new group drops a draft token instead (that row would cost as much as a whole
        group and is the draft's least likely token)."""
        self._fill_rows(plan, speculative, budget)
        if plan.num_logits % self.config.row_multiple == 1 and plan.num_logits > 1:
            self._drop_one_draft_token(plan, speculative)

    def _pad_rows(self, plan: StepPlan) -> int:
        """Rows of prompt tokens to add so the step's logits rows fill their last group (the
        drafts could not: a step with no speculation, or drafts at their window)."""
        chunks = plan.chunks
        if plan.split:  # (the prompt chunks' own llama_decode: the decodes' rows are apart)
            chunks = chunks[_decodes_first(chunks):]
        rows = sum(c.num_logits for c in chunks)
        pad = (-rows) % self.config.row_multiple
        spare = sum(len(c.token_ids) for c in chunks) - rows  # prompt tokens without logits
        return pad if rows > 1 and 0 < pad <= spare else 0

    def _drop_one_draft_token(self, plan: StepPlan,
                              speculative: list[tuple[int, DraftTree]]) -> None:
        # Never a draft's only token: the request's window waits for that verdict (and a
        # draft model has already paid for it).
        chains = [i for i, _ in speculative
                  if plan.chunks[i].draft.is_chain and len(plan.chunks[i].draft) > 1]  # type: ignore[union-attr, arg-type]
        if not chains:
            return
        i = max(chains, key=lambda j: len(plan.chunks[j].token_ids))
        chunk = plan.chunks[i]
        req, n = chunk.request, len(chunk.draft) - 1  # type: ignore[arg-type]
        shorter = chunk.draft.truncated(n)  # type: ignore[union-attr]
        plan.chunks[i] = ScheduledChunk(req, chunk.start, chunk.token_ids[:-1], True, shorter)
        self._trim_blocks(req, extra=n)

    def _fill_rows(self, plan: StepPlan, speculative: list[tuple[int, DraftTree]],
                   budget: int) -> None:
        cfg = self.config
        rows = plan.num_logits
        room = min((-rows) % cfg.row_multiple, budget,
                   (cfg.max_outputs or cfg.n_batch) - rows)
        for i, full in speculative:
            if room <= 0:
                break
            chunk = plan.chunks[i]
            have = len(chunk.draft)  # type: ignore[arg-type]
            if not full.is_chain or len(full) <= have:
                continue
            req = chunk.request
            extra = min(room, len(full) - have, self._free_cells(req, have))
            if extra <= 0:
                continue
            self._hold_cells(req, have + extra)
            longer = full.truncated(have + extra)
            plan.chunks[i] = ScheduledChunk(req, chunk.start,
                                            chunk.token_ids + list(longer.tokens[have:]), True,
                                            longer, chunk.leaf_seqs)
            room -= extra

    def _speculative_chunk(self, req: Request, draft: DraftTree, room: int
                           ) -> ScheduledChunk | None:
        """A decode chunk carrying as much of ``draft`` as its window wants and ``room``
        tokens, free blocks and free sequence ids allow; None when nothing of it fits."""
        room = min(room, self._free_cells(req, 0))
        if draft.wanted is not None:
            room = min(room, draft.wanted)
        draft = draft.truncated(max(room, 0))
        if len(draft.leaves) - 1 > len(self._free_seq_ids):
            draft = draft.first_branch()
        if not len(draft):
            return None
        self._hold_cells(req, len(draft))
        leaf_seqs = tuple(self._free_seq_ids.pop() for _ in draft.leaves[1:])
        pos = req.num_computed_tokens
        for seq in leaf_seqs:  # each extra leaf starts as a view of the request's prefix
            self._pending_ops.append(KVOp.cp(req.seq_id, seq, 0, pos))  # type: ignore[arg-type]
        tokens = req.token_slice(pos, pos + 1) + list(draft.tokens)
        return ScheduledChunk(req, pos, tokens, True, draft, leaf_seqs)


    def _admit(self, req: Request) -> bool:
        """Give the head of the queue a sequence id, its cached prefix and blocks for the rest."""
        cache = self.cache
        # One computed whole (Request.takes_cached_prefix) has no match and waits for none.
        match = cache.match(req.prompt_token_ids + req.output_token_ids,
                            req.num_tokens - 1, req.lora) \
            if cache and req.takes_cached_prefix else None
        matched = match.length if match else 0
        if match is not None and self._prefix_being_computed(req, matched):
            return False  # the same prefix is being computed: wait and share it
        node = cache.hold(match) if cache and match else None  # kept while evicting for room
        needed = self.pool.blocks_for(req.num_tokens - matched)
        if cache and not self.pool.can_allocate(needed):
            self._take(cache.evict_blocks(needed))
        if cache and node is not None and not self.running and not self.pool.can_allocate(needed):
            # Nothing runs that could free room, and the shared head's own block is what is
            # missing (its tokens round up to a block of the cache's, the rest to one of the
            # request's): start without the match rather than never.
            cache.unlock(node)
            node, matched = None, 0
            needed = self.pool.blocks_for(req.num_tokens)
            self._take(cache.evict_blocks(needed))
        if cache and not self._free_seq_ids:
            self._take(cache.evict_holder())
        if not self.pool.can_allocate(needed) or not self._free_seq_ids:
            if cache and node is not None:
                cache.unlock(node)
            return False
        req.block_ids = self.pool.allocate(needed)
        req.seq_id = self._free_seq_ids.pop()
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = matched
        req.num_cached_tokens = matched
        req.prompt_cached = False
        if cache and match:
            req.cache_node = node
            if node is not None:
                self._pending_ops += match.copy_ops(req.seq_id)
            cache.record_lookup(req.num_tokens, matched)
        return True

    def _prefix_being_computed(self, req: Request, matched: int) -> bool:
        """True if a running request is still prefilling a longer prefix this one shares
        (two requests with the same system prompt arriving together compute it once)."""
        for other in self.running:
            if other.num_computed_tokens >= other.num_prompt_tokens or other.lora != req.lora:
                continue
            k = common_prefix_len(req.prompt_token_ids, other.prompt_token_ids)
            if k >= matched + self.pool.block_size:
                return True
        return False

    def _take(self, cache_ops: list[KVOp]) -> None:
        """Queue the prefix cache's KV operations; the holders it gave up are free ids again."""
        self._pending_ops += cache_ops
        self._free_seq_ids += freed_sequences(cache_ops)

    def _schedule_prefill(self, req: Request, plan: StepPlan, budget: int) -> int:
        start = req.num_computed_tokens
        n = min(req.num_uncomputed_tokens, self.config.chunk_size, budget)
        all_logits = req.wants_prompt_logprobs
        if all_logits:
            # A row per token, within the step's rows: its own prefill slot's row and what the
            # decodes and drafts left, one row kept for each other prefill slot (drafts leave
            # those slots' rows, so it never waits on them for ever).
            cfg = self.config
            n = min(n, (cfg.max_outputs or cfg.n_batch) - plan.num_logits - cfg.max_prefill + 1)
            if n < 1:
                return 0
        end = start + n
        plan.chunks.append(ScheduledChunk(req, start, req.token_slice(start, end),
                                          end == req.num_tokens, all_logits=all_logits))
        return n

    def _grow_for_decode(self, req: Request, plan: StepPlan) -> bool:
        """Make room for one more token of ``req``: evict cached prefixes first, then preempt
        the policy's victim. False if ``req`` itself was preempted."""
        needed = self.pool.blocks_for(req.num_tokens - req.num_cached_tokens) - len(req.block_ids)
        while needed > 0 and not self.pool.can_allocate(needed):
            if self.cache is not None:
                self._take(self.cache.evict_blocks(needed))
                if self.pool.can_allocate(needed):
                    break
            victim = self.policy.keep_order(self.running)[-1]
            self._preempt(victim, plan)
            if victim is req:
                return False
        if needed > 0:
            req.block_ids.extend(self.pool.allocate(needed))
        return True

    def _preempt(self, req: Request, plan: StepPlan) -> None:
        self.running.remove(req)
        self._release(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.host_checked = False  # its KV, handed to the cache, may be in host memory by then
        self.policy.requeue(self.waiting, req)
        plan.preempted.append(req)

    def _release(self, req: Request, *, hand_over: bool = True) -> None:
        """Free a request's blocks; its sequence goes to the prefix cache (which keeps what is
        new and drops the rest) or, without a cache or ``hand_over``, is dropped whole."""
        if req.block_ids:
            self.pool.free(req.block_ids)
            req.block_ids = []
        if req.seq_id is None:
            return
        if self.cache is not None:
            self.cache.unlock(req.cache_node)
            req.cache_node = None
        if self.cache is not None and hand_over:
            # Cells past what we hand over (a step in flight when the request was aborted) go.
            self._pending_ops.append(KVOp.rm(req.seq_id, req.num_computed_tokens, -1))
            tokens = req.token_slice(0, req.num_computed_tokens)
            self._take(self.cache.insert(tokens, req.seq_id, live=False, key=req.lora))
        else:
            self._pending_ops.append(KVOp.rm(req.seq_id))
            self._free_seq_ids.append(req.seq_id)
        req.seq_id = None
        req.num_cached_tokens = 0

    def _finish(self, req: Request, reason: FinishReason) -> None:
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason


def _decodes_first(chunks: list[ScheduledChunk]) -> int:
    """How many chunks at the head of a plan are decodes (drafts included)."""
    return next((i for i, c in enumerate(chunks) if not c.is_decode), len(chunks))
