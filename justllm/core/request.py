"""One request's state as the scheduler and engine see it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from justllm.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from justllm.kv.radix_cache import RadixNode


# A LoRA adapter set: (adapter id, scale) pairs sorted by id, without zero scales (llama.cpp
# leaves those out too); ``()`` is the base model. llama.cpp applies adapters to a whole
# context, so one step serves one set, and KV computed under one set is not another's.
LoraKey = tuple[tuple[int, float], ...]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(eq=False)
class Request:
    """A prompt and everything generated for it so far.

    There is no prefill or decode "mode": the KV holds ``num_computed_tokens`` of the request's
    tokens (prompt then output) and each step the scheduler hands out some of the rest. A
    preempted request drops its KV and recomputes prompt + output later, losing nothing.

    ``seq_id`` and ``block_ids`` are owned by the scheduler; ``output_token_ids`` by the engine.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int
    max_total_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    seq_id: int | None = None
    block_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    # Prefix cache (owned by the scheduler): tokens taken from the cache at admission, the
    # deepest cache node this request locks, and whether its prompt was offered to the cache.
    num_cached_tokens: int = 0
    cache_node: RadixNode | None = None
    prompt_cached: bool = False
    # Whether the engine looked for its prefix in host memory (``--cache-ram``): once a request
    # while it waits (again after a preemption: its KV went to the cache, and may go further).
    host_checked: bool = False
    # Times llama.cpp refused a batch because this request's KV was not what the scheduler
    # believed; such a request is recomputed without the prefix cache, and fails the next time.
    kv_errors: int = 0
    # The adapter set it runs under (the engine resolves it when the request is added); the
    # scheduler serves one set per step and the prefix cache keeps one tree per set.
    lora: LoraKey = ()
    # The scheduler's step count when it was added (owned by the scheduler): how long its
    # adapter set's work has waited, for the choice of the set a step serves.
    queued_step: int = 0
    # Set by the engine once the prompt's logprobs (params.prompt_logprobs) went out with the
    # first token: a recompute after a preemption needs no output rows on the prompt again.
    prompt_logprobs_done: bool = False

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Every prompt token must be computed with an output row (no prefix-cache hit)."""
        return self.params.prompt_logprobs is not None and not self.prompt_logprobs_done

    @property
    def takes_cached_prefix(self) -> bool:
        """It may start from a prefix in the cache (or in host memory): not one sent back after
        a KV error (recomputed whole), nor one that wants its prompt's logprobs (every prompt
        token needs its output row), nor one whose request said ``cache_prompt: false``."""
        return not self.kv_errors and not self.wants_prompt_logprobs and self.params.cache_prompt

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens at positions ``start..end`` of prompt + output, without joining the lists."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt:end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n_prompt]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
