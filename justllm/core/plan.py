"""What the scheduler asks the runner to compute in one step, and what comes back."""

from __future__ import annotations

from dataclasses import dataclass, field

from justllm.core.request import Request
from justllm.kv.radix_cache import KVOp


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens ``start .. start+len(token_ids)`` of one request, to be put in this step's batch.

    ``wants_logits`` is true when the chunk ends at the request's last known token, so the step
    samples the next one; a middle chunk of a long prompt asks for no output row (on this model
    each output row costs ~4 ms of the 262k-wide head).
    """

    request: Request
    start: int
    token_ids: list[int]
    wants_logits: bool

    @property
    def is_decode(self) -> bool:
        return len(self.token_ids) == 1 and self.start >= self.request.num_prompt_tokens


@dataclass
class StepPlan:
    """One step: KV operations first, in order (drops, prefix-cache copies), then one batch."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    kv_ops: list[KVOp] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def released_seq_ids(self) -> list[int]:
        """Sequences dropped whole in this step."""
        return [op.seq for op in self.kv_ops if op.kind == "rm" and op.p0 == -1 and op.p1 == -1]

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks and not self.kv_ops
