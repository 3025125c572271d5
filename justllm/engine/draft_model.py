"""A small draft model proposing chains or trees, batched over every speculating request.

The draft GGUF gets its own llama.cpp context with one sequence per request (plus temporary
ones while a tree grows). Its KV follows each request lazily: before drafting, the tokens it
holds are compared with the request's tokens and everything after the first difference (a
rejected draft, a preemption) is removed with ``llama_memory_seq_rm``; the rest is decoded in
one batch with every other request's catch-up. Then the draft grows one level per
``llama_decode``, all requests together.

For a greedy request the draft takes the draft model's argmax (the target accepts it when its
own argmax agrees). For a sampled request a chain's tokens are drawn from the draft's
distribution ``q`` at the request's temperature and verified with min(1, p/q). A tree keeps
the top ``branch`` candidates at each of the first two levels (a candidate after the first
only if the draft gives it at least ``P_SPLIT``) and extends each leaf greedily.
"""

from __future__ import annotations

import math
import secrets
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import numpy as np

from justllm.core.plan import DraftTree
from justllm.engine.sampler import inverse_cdf, with_logprobs
from justllm.errors import EngineError, ModelLoadError
from justllm.kv.radix_cache import common_prefix_len
from justllm.spec.proposer import DraftRequest

if TYPE_CHECKING:
    from justllm.config import EngineConfig
    from justllm.engine.backend import LlamaBackend

P_SPLIT = 0.1  # a tree's second-best candidates need this much of the draft's probability
TREE_LEVELS = 2  # levels of a tree that branch; deeper levels extend each leaf greedily
MAX_LEAVES = 8


@dataclass
class _Slot:
    """The draft context's view of one request."""

    seq: int
    tokens: list[int] = field(default_factory=list)  # what the sequence's cells hold
    rng: np.random.Generator | None = None


@dataclass
class _Node:
    token: int
    parent: int  # index into the request's node list; -1: the root
    seq: int  # draft sequence whose cells hold this node's path
    pos: int
    q: np.ndarray | None = None


class DraftModelProposer:
    costly = True
    uses_p_min = True  # a request's speculative.p_min is its cut-off (SpecController.check)

    def __init__(self, backend: LlamaBackend, n_slots: int, *, tree: bool = False,
                 branch: int = 2) -> None:
        self.backend = backend
        self.tree = tree
        self.branch = branch
        self._free_slots = list(range(n_slots - 1, -1, -1))
        self._temp_seqs = list(range(backend.config.n_seq_max - 1, n_slots - 1, -1))
        self._slots: dict[str, _Slot] = {}
        self._released: deque[str] = deque()  # appended from any thread, drained here

    @classmethod
    def load(cls, config: EngineConfig, target: LlamaBackend) -> DraftModelProposer:
        from justllm.engine.backend import BackendConfig, LlamaBackend
        from justllm.models.source import resolve_model

        path = resolve_model(config.draft_model)
        tree = config.spec_method is not None and config.spec_method.tree
        leaves = min(config.branch ** TREE_LEVELS, MAX_LEAVES) if tree else 1
        n_seq = min(256, config.max_seqs * leaves)
        backend = LlamaBackend(BackendConfig(
            model_path=path,
            n_ctx=config.pool_tokens + config.max_seqs * (config.max_draft_nodes + 1),
            n_batch=config.n_batch,
            n_ubatch=config.n_ubatch,  # (the target's micro-batch: what compute_reserve counts)
            flash_attn=config.flash_attn,
            n_seq_max=n_seq,
            n_outputs_max=min(config.n_batch, max(64, config.max_seqs * leaves)),
            n_threads=config.threads,
            repack=config.repack,
            gpu=config.gpu,
            verbose=config.verbose,
            cancel=target.config.cancel,  # (serve stopped while the models load)
        ))
        try:
            if backend.vocab_fingerprint() != target.vocab_fingerprint():
                raise ModelLoadError(
                    f"the draft model {path} has a different vocabulary from the target "
                    f"({backend.n_vocab} vs {target.n_vocab} tokens, or different token "
                    "texts): a draft must tokenize exactly like the model it drafts for")
        except BaseException:
            backend.close()
            raise
        return cls(backend, config.max_seqs, tree=tree, branch=config.branch)

    def release(self, request_id: str) -> None:
        self._released.append(request_id)

    def close(self) -> None:
        self.backend.close()

    # ---- proposing ------------------------------------------------------------------------

    def propose(self, wants: list[DraftRequest]) -> dict[str, DraftTree]:
        self._drain_released()
        try:
            return self._propose(wants)
        except EngineError:
            # The draft context is only an accelerator: start it afresh, decode plainly.
            self.reset()
            return {}

    def reset(self) -> None:
        self.backend.clear_kv()
        for slot in self._slots.values():
            slot.tokens.clear()

    def _propose(self, wants: list[DraftRequest]) -> dict[str, DraftTree]:
        jobs: list[tuple[DraftRequest, _Slot]] = []
        for w in wants:
            slot = self._slot(w)
            if slot is not None and w.k > 0 and w.tokens:
                jobs.append((w, slot))
        if not jobs:
            return {}
        roots = self._catch_up(jobs)
        nodes: list[list[_Node]] = [[] for _ in jobs]
        frontier: list[tuple[int, int]] = [(j, -1) for j in range(len(jobs))]  # (job, node)
        rows = {(j, -1): roots[j] for j in range(len(jobs))}
        temps: list[int] = []
        try:
            depth = 0
            while frontier:
                depth += 1
                grown: list[tuple[int, int]] = []
                for j, n in frontier:
                    w, slot = jobs[j]
                    grown += self._children(j, n, rows[(j, n)], w, slot, nodes[j], depth, temps)
                rows = {}
                frontier = []
                to_decode = [(j, n) for j, n in grown if depth < jobs[j][0].k]
                if to_decode:
                    out = self._decode([(nodes[j][n].token, nodes[j][n].pos, nodes[j][n].seq)
                                        for j, n in to_decode])
                    for i, key in enumerate(to_decode):
                        rows[key] = out[i]
                        j, n = key
                        if nodes[j][n].seq == jobs[j][1].seq:  # the first branch stays cached
                            jobs[j][1].tokens.append(nodes[j][n].token)
                    frontier = to_decode
            for seq in temps:
                self.backend.seq_rm(seq)
        finally:  # (a draft that failed kept them: trees became chains for good)
            self._temp_seqs.extend(temps)
        out_trees = {}
        for (w, _slot), ns in zip(jobs, nodes):
            if ns:
                qs = [n.q for n in ns if n.q is not None]  # all of them (sampled) or none
                q = np.stack(qs) if qs else None
                out_trees[w.request_id] = DraftTree(
                    tuple(n.token for n in ns), tuple(n.parent for n in ns), q)
        return out_trees

    def _children(self, j: int, n: int, row: np.ndarray, w: DraftRequest, slot: _Slot,
                  nodes: list[_Node], depth: int, temps: list[int]) -> list[tuple[int, int]]:
        """Add the children of node ``n`` (-1: the root) from its draft logits row; returns
        the new nodes as (job, node) keys."""
        parent_seq = slot.seq if n < 0 else nodes[n].seq
        pos = len(w.tokens) if n < 0 else nodes[n].pos + 1
        sampled = not w.params.greedy and not self.tree
        if sampled:
            q = _softmax(row, w.params.temperature)
            assert slot.rng is not None
            token = inverse_cdf(q, slot.rng.random())
            if w.p_min > 0:
                if q[token] < w.p_min:
                    return []
                # A token under the cut-off ends the draft, so a drafted one was drawn from q
                # among the tokens at or above it: that is what it is verified against (with q
                # itself, those tokens were accepted too often, skewing every sampled answer).
                q = np.where(q >= w.p_min, q, 0.0)
                q /= q.sum()
            nodes.append(_Node(token, n, parent_seq, pos, q))
            return [(j, len(nodes) - 1)]
        branches = self.branch if self.tree and depth <= TREE_LEVELS else 1
        if branches == 1:
            token = int(np.argmax(row))
            if w.p_min > 0 and math.exp(cast(float, with_logprobs(row, token, 0).logprob)) < w.p_min:
                return []
            nodes.append(_Node(token, n, parent_seq, pos))
            return [(j, len(nodes) - 1)]
        probs = _softmax(row, 1.0)
        best = np.argpartition(-probs, branches - 1)[:branches]
        best = best[np.argsort(-probs[best])]
        keys = []
        for b, token in enumerate(best):
            p = float(probs[token])
            if b == 0 and p < w.p_min:
                break
            if b > 0 and (p < P_SPLIT or not self._temp_seqs
                          or len(self._leaves(nodes)) >= MAX_LEAVES):
                break
            seq = parent_seq
            if b > 0:  # a new branch: its own sequence sharing the parent's cells
                seq = self._temp_seqs.pop()
                temps.append(seq)
                self.backend.seq_rm(seq)
                self.backend.seq_cp(parent_seq, seq)  # the parent's path: nothing deeper yet
            nodes.append(_Node(int(token), n, seq, pos))
            keys.append((j, len(nodes) - 1))
        return keys

    @staticmethod
    def _leaves(nodes: list[_Node]) -> list[int]:
        parents = {n.parent for n in nodes}
        return [i for i in range(len(nodes)) if i not in parents]

    def _slot(self, w: DraftRequest) -> _Slot | None:
        slot = self._slots.get(w.request_id)
        if slot is None:
            if not self._free_slots:
                return None
            seed = w.params.seed if w.params.seed is not None else secrets.randbits(63)
            slot = _Slot(self._free_slots.pop(),
                         rng=np.random.Generator(np.random.PCG64([seed, 1])))
            self.backend.seq_rm(slot.seq)
            self._slots[w.request_id] = slot
        return slot

    def _drain_released(self) -> None:
        while self._released:
            slot = self._slots.pop(self._released.popleft(), None)
            if slot is not None:
                self.backend.seq_rm(slot.seq)
                self._free_slots.append(slot.seq)

    def _catch_up(self, jobs: list[tuple[DraftRequest, _Slot]]) -> list[np.ndarray]:
        """Bring every slot's cells up to its request's tokens; the logits row after each
        request's last token (copied: the next decode reuses the buffer)."""
        pending: list[tuple[int, int, int]] = []  # (token, pos, seq)
        last_index: list[int] = []
        for w, slot in jobs:
            have = slot.tokens
            m = common_prefix_len(have, w.tokens)
            m = min(m, len(w.tokens) - 1)  # the last token is decoded again for its logits
            if m < len(have):
                self.backend.seq_rm(slot.seq, m, -1)
                del have[m:]
            for pos in range(m, len(w.tokens)):
                pending.append((w.tokens[pos], pos, slot.seq))
            have.extend(w.tokens[m:])
            last_index.append(len(pending) - 1)
        wanted = set(last_index)
        flags = [i in wanted for i in range(len(pending))]
        out = self._decode(pending, flags)  # (in parts of the batch's size)
        rows = dict(zip((i for i, flag in enumerate(flags) if flag), out))
        return [rows[i] for i in last_index]

    def _decode(self, items: list[tuple[int, int, int]], logits: list[bool] | None = None
                ) -> list[np.ndarray]:
        b = self.backend
        n_batch = b.config.n_batch
        if len(items) > n_batch:  # (a level of many requests' drafts: the batch's size)
            flags = [True] * len(items) if logits is None else logits
            parts: list[np.ndarray] = []
            for s in range(0, len(items), n_batch):
                parts += self._decode(items[s:s + n_batch], flags[s:s + n_batch])
            return parts
        n = len(items)
        toks, pos, seqs = zip(*items)
        b.batch_tokens[:n] = toks
        b.batch_pos[:n] = pos
        b.batch_seq[:n] = seqs
        b.batch_n_seq[:n] = 1
        b.batch_logits[:n] = 1 if logits is None else logits
        out = b.decode(n)
        return [np.array(r) for r in out]


def _softmax(row: np.ndarray, temperature: float) -> np.ndarray:
    x = np.asarray(row, dtype=np.float64) / max(temperature, 1e-6)
    x -= x.max()
    np.exp(x, out=x)
    x /= x.sum()
    return x
