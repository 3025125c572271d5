"""The synchronous engine: ``add_request``, ``abort``, ``step()``.

Each step reads like a sentence: the scheduler plans, the runner computes, the scheduler is told,
and every sampled token is detokenized and checked against the request's stop conditions.
``Engine`` is safe to call from two threads in one way: ``add_request``/``abort``/``stats`` from
any thread while one thread runs ``step()`` (the AsyncEngine's engine thread). Only that thread
calls llama.cpp compute.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np

from justllm.config import CPU_RESIDENT_BLOCKS, CPU_ROW_MULTIPLE, EngineConfig
from justllm.core import harmony
from justllm.core.kv_view import kv_mismatches
from justllm.core.plan import DraftTree, ScheduledChunk, StepPlan, StepResult
from justllm.core.record import RequestOrigin, RequestRecord
from justllm.core.request import FinishReason, LoraKey, Request, RequestStatus
from justllm.core.sampling_params import SamplingParams
from justllm.core.scheduler import Scheduler
from justllm.core.thinking_budget import ThinkingBudget
from justllm.engine.backend import (
    BackendConfig,
    GraphSampling,
    KVCacheFullError,
    LlamaBackend,
    cores_idle_between_decodes,
)
from justllm.engine.detokenizer import IncrementalDetokenizer
from justllm.engine.graph_sampling import graph_sampling
from justllm.engine.lazy_grammar import LazyGrammar
from justllm.engine.lora import LoadedLora, LoraRegistry
from justllm.engine.proposers import make_proposer
from justllm.engine.records import RequestObserver, request_record
from justllm.engine.row_sampling import RowJob, RowSampler, sampling_workers, worth_a_worker
from justllm.engine.runner import Runner
from justllm.engine.sampler import (
    Constraint,
    InfillVocab,
    RequestSampler,
    SampledToken,
    token_logprob,
)
from justllm.engine.vram import with_vram_pool
from justllm.errors import (
    BeyondContextError,
    EngineClosedError,
    EngineError,
    HandoverError,
    InvalidRequestError,
    KVConsistencyError,
)
from justllm.kv.block_pool import BlockPool, BlockUsage
from justllm.kv.cache_stats import PrefixCacheStats
from justllm.kv.host_cache import HostCache, HostCacheStats, free_floor
from justllm.kv.radix_cache import KVOp, Match, RadixCache, make_eviction_policy
from justllm.kv.transfer import KVIdentity, KVTransferError, check_fits, pack, unpack
from justllm.models.registry import file_digest
from justllm.models.source import resolve_model
from justllm.spec.controller import SpecController, SpecStats
from justllm.spec.verify import walk_draft

KV_TYPE = "f16"  # llama.cpp's default cache type, which the backend keeps
# Positions per chunk of a prefix in host memory (kv/host_cache.py): prefixes that begin alike
# share whole chunks (shorter ones share more of them, longer ones take fewer llama.cpp calls).
HOST_CHUNK_TOKENS = 128

log = logging.getLogger(__name__)


def _ram_bytes(mib: int) -> int:
    """``--cache-ram`` in bytes (-1: no limit)."""
    return 1 << 62 if mib < 0 else mib << 20


STUCK = "the request could not be scheduled (an engine bug: see the server log)"
ENCODER_ONLY = ("this model makes embeddings only (an encoder, such as BERT: it has no "
                "language-model head and writes no text); ask for embeddings (/v1/embeddings)")


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    # The token's rank in its distribution (1: the most likely); given for prompt tokens.
    rank: int | None = None


@dataclass
class RequestMetrics:
    """Per-request counters; times are ``time.perf_counter()`` seconds."""

    arrival_time: float
    scheduled_time: float | None = None  # first put in a step (the end of queueing)
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    # Tokens this request put through llama_decode, recomputation after preemption included.
    num_computed_tokens: int = 0
    # Prompt tokens taken from the prefix cache instead of being computed.
    num_cached_tokens: int = 0
    # The LoRA adapters it ran under ("a+b"; "" for the base model), for per-adapter metrics.
    lora: str = ""

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(frozen=True)
class Handover:
    """A request's first tokens, drawn by one engine (a PD prefill replica) for another to go on
    from (``Engine.resume_request``) exactly as if it had drawn them itself: the tokens, their
    logprobs when the request asked for them, and the request's random generator as it was
    after the draw (numpy's PCG64 state), so a seed draws the same answer either way."""

    token_ids: tuple[int, ...]
    rng_state: dict
    logprobs: tuple[TokenLogprob, ...] | None = None
    # What prompt they follow (:func:`prompt_digest` of its tokens): another prompt's draw is
    # refused (HandoverError), as a render of the prompt that differs between the two
    # replicas (another chat template) would otherwise go on from a foreign token.
    prompt: str = ""
    # The prompt tokens the drawing engine took from its prefix cache: the request's
    # ``cached_tokens`` (the other engine's hit on the KV handed over is no cache hit to it).
    cached_tokens: int = 0


def check_request_fits(n_prompt: int, max_tokens: int | None, limit: int) -> None:
    """The prompt, and the prompt plus ``max_tokens`` when given, must fit one request's
    context of ``limit`` tokens (as in vLLM and OpenAI, a request that cannot be served in
    full is refused)."""
    if n_prompt >= limit:
        raise InvalidRequestError(
            f"the prompt has {n_prompt} tokens; this model's context holds at most {limit} "
            f"tokens per request, prompt and output (see --ctx and --pool-blocks)",
            param="prompt")
    if max_tokens is not None and n_prompt + max_tokens > limit:
        raise BeyondContextError(
            f"this model's maximum context length is {limit} tokens; the request asks for "
            f"{n_prompt + max_tokens} ({n_prompt} in the prompt, {max_tokens} in max_tokens): "
            "reduce the prompt or max_tokens", param="max_tokens")


def prompt_digest(tokens: Sequence[int]) -> str:
    """A prompt's token ids, as a hand-over names the prompt it follows."""
    return hashlib.sha256(np.asarray(tokens, dtype="<i4").tobytes()).hexdigest()


@dataclass(frozen=True)
class PreparedRequest:
    """A request checked and made ready by :meth:`Engine.prepare`: its prompt tokenized, its
    sampler (seed, grammar, ``min_tokens``' end tokens) built and, for a resumed request, the
    hand-over checked against it. That work reads only the model, so any thread may do it,
    and it is what a request costs before it is queued: seconds for a prompt of megabytes, a
    large grammar's compile. A prepared request is queued once."""

    prompt: str | list[int]
    tokens: list[int]
    params: SamplingParams
    sampler: RequestSampler
    resume: Handover | None


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request: the new text and tokens since the last output."""

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None
    metrics: RequestMetrics
    error: str | None = None
    # What kind of error (``GrammarDeadEndError.code``: the request's own fault), if known.
    error_code: str | None = None
    # The stop string that ended the request (finish_reason "stop" by a string, not a token):
    # APIs that report which stop matched (Anthropic's stop_sequence) read it here.
    stop: str | None = None
    # On the final output of a request added with ``handover=True``: where another engine
    # goes on from (prefill/decode disaggregation).
    handover: Handover | None = None
    # On the first output of a request with ``prompt_logprobs``: one entry per prompt token,
    # None for the first (nothing comes before it).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_token_ids: list[int] | None = None  # with prompt_logprobs: the tokens they are of
    # A grammar held the text when this output was made (a lazy one once its trigger came):
    # the tool-call text it holds cannot turn out malformed, so it may be streamed as it grows.
    held: bool = False


@dataclass
class _Live:
    """Engine-side state of a request the scheduler knows about."""

    request: Request
    sampler: RequestSampler
    detok: IncrementalDetokenizer
    metrics: RequestMetrics
    # Only while a RequestObserver watches: why it ended with an error, and (when it records
    # text) the prompt given as text and the output so far.
    error: str | None = None
    prompt: str | None = None
    output: list[str] | None = None
    handover: bool = False  # its final output carries a Handover
    resumed: bool = False  # its first tokens came in a Handover
    resumed_cached: int = 0  # that Handover's cached_tokens
    origin: RequestOrigin | None = None  # for its record
    # params.prompt_logprobs: filled chunk by chunk as the prompt is computed
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass(frozen=True)
class BusyRequest:
    """What llama-server's ``/slots`` shows of a request being computed (no text)."""

    arrival: int  # the engine's count of requests when it came (llama-server's task ids: numbers)
    params: SamplingParams
    n_prompt: int
    n_prompt_computed: int  # its prompt's tokens in the KV cache, the prefix cache's included
    n_prompt_cached: int  # of them, those the prefix cache held
    n_decoded: int


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks: BlockUsage
    prompt_tokens_total: int
    generation_tokens_total: int
    num_preemptions_total: int
    prefix_cache: PrefixCacheStats = PrefixCacheStats()
    host_cache: HostCacheStats = HostCacheStats()  # prefixes in host memory (--cache-ram)
    spec: SpecStats = SpecStats()
    lora_adapters: int = 0  # loaded
    lora_switches: int = 0  # changes of the adapter set applied to the context


class Engine:
    def __init__(self, config: EngineConfig, backend: LlamaBackend | None = None, *,
                 model_checked: bool = False, cancel: Callable[[], bool] | None = None) -> None:
        """``model_checked``: the caller has checked the model's file with read_gguf_header
        just now (BackendConfig.model_checked). ``cancel``: asked while the model loads, which
        stops (LoadCancelled) once it answers True (BackendConfig.cancel)."""
        config = with_vram_pool(config)  # a --gpu engine's pool, when not given
        self.config = config
        owns_backend = backend is None
        if backend is None:
            backend = LlamaBackend(BackendConfig(
                model_path=resolve_model(config.model),
                n_ctx=config.pool_tokens,
                n_batch=config.n_batch,
                n_ubatch=config.n_ubatch,
                flash_attn=config.flash_attn,
                repack=config.repack,
                n_seq_max=config.max_seqs + config.spare_seq_ids,
                n_outputs_max=config.n_outputs + CPU_ROW_MULTIPLE,  # + the runner's padding
                n_threads=config.threads,
                gpu=config.gpu,
                verbose=config.verbose,
                keep_swa_cells=True,
                model_checked=model_checked,
                cancel=cancel,
            ))
        self.backend = backend
        self.closed = False  # (close: every later call that needs the model refused)
        self.generates = backend.generates()  # (an encoder makes embeddings only)
        self.pool = BlockPool(config.pool_blocks, config.block_size)
        # With host memory for them, prefixes past the cap move there at the end of a step
        # (``_spill``) instead of being dropped by the cache itself.
        self.host_cache = (HostCache(_ram_bytes(config.cache_ram),
                                     min(HOST_CHUNK_TOKENS, backend.n_swa or HOST_CHUNK_TOKENS),
                                     key_tokens=config.block_size)
                           if config.cache_ram and config.prefix_cache else None)
        cap = None if self.host_cache is not None else config.prefix_cache_blocks or None
        self.cache = (RadixCache(self.pool, max_blocks=cap,
                                 policy=make_eviction_policy(config.eviction_policy))
                      if config.prefix_cache else None)
        self._resident_blocks = config.prefix_cache_blocks or (
            self.pool.total_blocks if config.gpu else CPU_RESIDENT_BLOCKS)
        # (a CPU's small share already moves idle prefixes out long before the pool is short)
        self._free_floor = (free_floor(config.n_batch, config.block_size, config.max_seqs,
                                       self.pool.total_blocks)
                            if self.host_cache is not None and config.gpu else 0)
        self.scheduler = Scheduler(config.scheduler_config(), self.pool, self.cache)
        self.runner = Runner(backend)
        limit = min(config.pool_tokens, backend.n_ctx_train or config.pool_tokens)
        self.max_request_tokens = min(config.ctx, limit) if config.ctx else limit
        if config.ctx > limit:
            # llama-server warns and goes past the training context; here a request stops at it
            log.warning("--ctx %d is more than the %s (%d tokens): a request may have at most %d",
                        config.ctx, "model's training context" if limit < config.pool_tokens
                        else "KV pool", limit, limit)
        if config.backend_sampling and not config.gpu:
            # measured on a 2-core CPU (engine_throughput.py --levels 8 --tokens 32 --vs-greedy)
            log.warning("--backend-sampling without --gpu: on the CPU choosing tokens in the "
                        "graph is slower than the engine's own choosing (8 streams at "
                        "temperature 0.8, top_p 0.95: 109 against 157 tok/s; greedy 148 "
                        "against 163)")
        self._live: dict[str, _Live] = {}
        self._lock = threading.Lock()
        self._arrivals = itertools.count()
        self._ids = itertools.count()
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._preemptions_total = 0
        try:
            proposer = make_proposer(config, backend)
        except BaseException:
            if owns_backend:
                backend.close()
            raise
        self.spec = (SpecController(proposer, gamma=config.gamma,
                                    max_nodes=config.max_draft_nodes, p_min=config.draft_p_min,
                                    n_vocab=backend.n_vocab)
                     if proposer is not None else None)
        self._steps = 0  # steps taken, the clock of the speculation windows
        self._observer: RequestObserver | None = None
        self.row_sampler = RowSampler(sampling_workers(config.gpu, config.threads,
                                                       cores_idle=cores_idle_between_decodes()))
        self._kv_identity: KVIdentity | None = None
        self.loras = LoraRegistry(backend)
        try:
            for spec in config.lora:
                self.loras.load(spec.name, spec.path, spec.scale)
        except BaseException:
            if owns_backend:
                self.close()
            raise

    def observe(self, callback: Callable[[RequestRecord], None] | None, *,
                model: str | None = None, text: bool = False) -> None:
        """Call ``callback`` with a RequestRecord whenever a request leaves the engine
        (finished, aborted or failed); None stops. ``model``: the id records carry (default:
        the GGUF file's stem); ``text``: records carry the prompt and the output text. The
        callback runs under the engine's lock and must not block (plugins/events.py)."""
        model = model or os.path.splitext(os.path.basename(self.backend.config.model_path))[0]
        self._observer = (RequestObserver(callback, model, text) if callback is not None
                          else None)

    # ---- requests -------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty", param="prompt")
            return self.backend.tokenize(prompt)
        if not isinstance(prompt, list | tuple):  # bytes would pass for token ids
            raise InvalidRequestError(f"a prompt is a str or a list of token ids, not "
                                      f"{type(prompt).__name__}", param="prompt")
        if not prompt:
            raise InvalidRequestError("prompt is empty", param="prompt")
        n_vocab = self.backend.n_vocab
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < n_vocab
                   for t in prompt):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {n_vocab})",
                                      param="prompt")
        return list(prompt)

    def prepare(self, prompt: str | list[int], params: SamplingParams | None = None,
                resume: Handover | None = None) -> PreparedRequest:
        """Check a request and make it ready to queue (:class:`PreparedRequest`); raises
        InvalidRequestError or HandoverError. Thread-safe: it reads the model, never the
        engine's state, so a server does it off its event loop."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params must be a SamplingParams")
        if not self.generates:
            raise InvalidRequestError(ENCODER_ONLY, param="model")
        if params.priority and self.config.scheduling_policy != "priority":
            raise InvalidRequestError(
                f"priority {params.priority} given, but priority scheduling is off (start with "
                "--scheduling-policy priority)", param="priority")
        if resume is not None and not resume.token_ids:
            raise HandoverError("a hand-over needs its tokens")
        if params.prompt_logprobs is not None and resume is not None:
            raise InvalidRequestError("a resumed request's prompt was computed elsewhere: no "
                                      "prompt_logprobs", param="prompt_logprobs")
        tokens = self.tokenize(prompt)
        check_request_fits(len(tokens), params.max_tokens, self.max_request_tokens)
        self._check_speculation(params)
        n_vocab = self.backend.n_vocab
        if any(t >= n_vocab for t, _ in params.logit_bias):
            raise InvalidRequestError(f"logit_bias token ids must be in [0, {n_vocab})",
                                      param="logit_bias")
        if any(t >= n_vocab for t in params.stop_token_ids):  # (the servers check it too)
            raise InvalidRequestError(f"stop_token_ids must be in [0, {n_vocab})",
                                      param="stop_token_ids")
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        constraint: Constraint | None = None
        if params.grammar and params.grammar_triggers:
            b = self.backend
            # (compiled now: a grammar llama.cpp refuses is refused before the queue)
            # (a harmony answer's triggers are message headers, which its analysis cannot
            # hold: its tags here are a budget's, not where the answer begins)
            tags = params.thinking_tags if params.thinking_tags != harmony.BUDGET_TAGS else None
            constraint = LazyGrammar(  # (a marker may be a control token: <tool_call>)
                b.grammar(params.grammar), params.grammar_triggers,
                lambda t: b.token_to_piece(t, special=True),
                lambda text: b.tokenize(text, add_special=False),
                (tags, params.thinking_open) if tags else None)
        elif params.grammar:
            constraint = self.backend.grammar(params.grammar)
        ends = None
        if params.min_tokens:
            ends = np.union1d(self.backend.eog_ids(),
                              np.asarray(params.stop_token_ids, dtype=np.int64))
        infill = None
        if "infill" in (params.samplers or ()):
            b = self.backend
            infill = InfillVocab(b.token_to_piece, b.is_eog, b.end_of_turn())
        budget = None
        if params.thinking_budget >= 0:
            assert params.thinking_tags is not None  # (SamplingParams checks)
            # (the message right before the end tag, as llama-server forces it)
            text = (harmony.budget_closing(params.thinking_message)
                    if params.thinking_tags == harmony.BUDGET_TAGS
                    else f"{params.thinking_message}\n{params.thinking_tags[1]}\n\n")
            closing = self.backend.tokenize(text, add_special=False)
            budget = (ThinkingBudget(params.thinking_tags, params.thinking_budget, closing,
                                     params.thinking_open), self.backend.token_to_piece)
        sampler = RequestSampler(params, seed, constraint, ends, infill, budget)
        if resume is not None:
            self._check_resume(resume, sampler, tokens)
        return PreparedRequest(prompt, tokens, params, sampler, resume)

    def add_request(self, prompt: str | list[int] | PreparedRequest,
                    params: SamplingParams | None = None,
                    request_id: str | None = None, *, handover: bool = False,
                    origin: RequestOrigin | None = None) -> str:
        """Queue a request; raises InvalidRequestError or QueueFullError for this request only.
        ``prompt``: text, token ids, or a request :meth:`prepare` made ready (then ``params``
        is left out). ``handover``: the request draws one token (``max_tokens`` 1) and its
        final output carries a Handover for another engine to go on from
        (``resume_request``). ``origin``: what its server knew of it, for its record."""
        prepared = self._prepared(prompt, params, None)
        if handover and prepared.params.prompt_logprobs is not None:
            raise InvalidRequestError("a request handed over computes no prompt_logprobs",
                                      param="prompt_logprobs")
        if handover and prepared.params.max_tokens != 1:
            raise InvalidRequestError("a request handed over draws one token (max_tokens 1)",
                                      param="max_tokens")
        request_id, _ = self._add(prepared, request_id, handover=handover, origin=origin)
        return request_id

    def resume_request(self, prompt: str | list[int] | PreparedRequest,
                       params: SamplingParams | None, resume: Handover,
                       request_id: str | None = None, *,
                       origin: RequestOrigin | None = None) -> RequestOutput:
        """Queue a request whose first tokens another engine drew (``resume``, from a request
        added there with ``handover=True``): they are this request's first output, returned
        here at once, before any step; the sampler goes on from the random state after them
        and the grammar from after them. The output is final when they already end the
        request (an end-of-generation token, a stop string, ``max_tokens``). Raises
        HandoverError when ``resume`` does not fit the request. ``prompt`` may be a request
        :meth:`prepare` made ready with this ``resume``."""
        _, first = self._add(self._prepared(prompt, params, resume), request_id,
                             origin=origin)
        assert first is not None
        return first

    def _prepared(self, prompt: str | list[int] | PreparedRequest,
                  params: SamplingParams | None, resume: Handover | None) -> PreparedRequest:
        if self.closed:
            raise EngineClosedError("the engine is closed")
        if not isinstance(prompt, PreparedRequest):
            return self.prepare(prompt, params, resume)
        if params is not None and params is not prompt.params:
            raise InvalidRequestError("a prepared request carries its own params")
        if prompt.resume is not resume:
            raise HandoverError("the request was prepared for another hand-over")
        return prompt

    def _add(self, prepared: PreparedRequest, request_id: str | None, *,
             handover: bool = False, origin: RequestOrigin | None = None
             ) -> tuple[str, RequestOutput | None]:
        prompt, tokens, params, sampler, resume = (
            prepared.prompt, prepared.tokens, prepared.params, prepared.sampler, prepared.resume)
        with self._lock:
            if request_id is None:
                request_id = f"req-{next(self._ids)}"
            if request_id in self._live:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            lora = self.loras.key_for(params.lora)
            req = Request(
                request_id=request_id, prompt_token_ids=tokens, params=params,
                arrival=next(self._arrivals),
                max_total_tokens=self.max_request_tokens if params.max_tokens is None
                else len(tokens) + params.max_tokens, lora=lora)
            live = _Live(
                req, sampler, IncrementalDetokenizer(self.backend.token_to_piece, params.stop,
                                            params.keep_stops),
                RequestMetrics(arrival_time=time.perf_counter(), num_prompt_tokens=len(tokens),
                               lora=self.loras.label(lora)),
                handover=handover, resumed=resume is not None, origin=origin)
            if resume is not None:
                live.resumed_cached = min(resume.cached_tokens, len(tokens))
            if self._observer is not None and self._observer.text:
                live.prompt = prompt if isinstance(prompt, str) else None
                live.output = []
            if params.prompt_logprobs is not None:
                live.prompt_logprobs = [None] * len(tokens)
            self.scheduler.add(req)
            self.loras.acquire(lora)
            self._live[request_id] = live
            first = self._resumed_output(live, resume) if resume is not None else None
            if first is not None and first.finished:  # its given tokens ended it
                self.scheduler.abort(request_id)
                req.finish_reason = FinishReason(first.finish_reason)
                self._drop(request_id)
            elif self.spec is not None:
                self.spec.admit(request_id, params, self._steps)
        return request_id, first

    def _check_speculation(self, params: SamplingParams) -> None:
        """A request's speculation fields are honoured or refused: without --spec there is
        nothing to tune (``n_max`` 0, speculation off, is what it gets anyway)."""
        if self.spec is not None:
            self.spec.check(params)
        elif params.spec_n_max or params.spec_p_min is not None:
            field = "speculative.n_max" if params.spec_n_max else "speculative.p_min"
            raise InvalidRequestError(f"{field}: this server does not speculate (start it "
                                      "with --spec)", param=field)

    def _check_resume(self, resume: Handover, sampler: RequestSampler,
                      tokens: Sequence[int]) -> None:
        """The hand-over drawn after this very prompt (``tokens``), its tokens in the
        vocabulary and allowed by the request's grammar (which then stands after them), its
        random state a PCG64 state (the sampler takes it), and its logprobs there when the
        request asks for them."""
        if resume.prompt and resume.prompt != prompt_digest(tokens):
            # (none: a replica of an older justllm, which said nothing of it, as mid-upgrade)
            raise HandoverError("the hand-over was drawn after another prompt (the two "
                                "replicas render it differently)")
        n_vocab = self.backend.n_vocab
        if not all(isinstance(t, int) and 0 <= t < n_vocab for t in resume.token_ids):
            raise HandoverError(f"the hand-over's token ids must be in [0, {n_vocab})")
        if sampler.params.logprobs is not None and (
                resume.logprobs is None or len(resume.logprobs) != len(resume.token_ids)):
            raise HandoverError("the request asks for logprobs; the hand-over has none")
        try:
            sampler.rng.bit_generator.state = resume.rng_state
        except (TypeError, ValueError, KeyError) as e:
            raise HandoverError(f"the hand-over's random state is not PCG64's: {e}") from None
        for t in resume.token_ids:
            sampler.accepted(t)  # (a thinking budget counts them)
        c = sampler.constraint
        if c is None:
            return
        for t in resume.token_ids:
            if not c.allows(t):
                raise HandoverError(f"the hand-over's token {t} is not allowed by the "
                                    "request's grammar")
            c.accept(t)

    def _resumed_output(self, live: _Live, resume: Handover) -> RequestOutput:
        """A resumed request's first output: its given tokens, emitted as if sampled now."""
        now = time.perf_counter()
        out = _Emitted()
        lps = resume.logprobs if live.request.params.logprobs is not None else None
        for i, token in enumerate(resume.token_ids):
            lp = lps[i] if lps else None
            self._emit(live, SampledToken(token, lp.logprob if lp else None,
                                          lp.top if lp else None), now, out, here=False)
            if out.reason is not None:
                break
        return self._finish_output(live, out, now, StepResult())

    def request_metrics(self, request_id: str) -> RequestMetrics | None:
        """An unfinished request's counters (the object its outputs carry)."""
        with self._lock:
            live = self._live.get(request_id)
            return None if live is None else live.metrics

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> bool:
        """Abort a request; its KV blocks are free at once and its cells before the next step.
        ``reason``: what its record says it ended by (a server's own limit: length)."""
        with self._lock:
            req = self.scheduler.abort(request_id, reason)
            if req is None:
                return False
            self._drop(request_id)
            return True

    def has_work(self) -> bool:
        with self._lock:
            return self.scheduler.has_work

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._live)

    def stats(self) -> EngineStats:
        with self._lock:
            return EngineStats(
                num_running=self.scheduler.num_running,
                num_waiting=self.scheduler.num_waiting,
                kv_blocks=self.pool.usage(),
                prompt_tokens_total=self._prompt_tokens_total,
                generation_tokens_total=self._generation_tokens_total,
                num_preemptions_total=self._preemptions_total,
                prefix_cache=self.cache.stats() if self.cache else PrefixCacheStats(),
                host_cache=(self.host_cache.stats() if self.host_cache is not None
                            else HostCacheStats()),
                spec=self.spec.stats if self.spec is not None else SpecStats(),
                lora_adapters=len(self.loras.adapters()), lora_switches=self.loras.switches)

    def busy_requests(self) -> list[BusyRequest]:
        """The running requests (those that hold a sequence), in the scheduler's order."""
        with self._lock:
            return [BusyRequest(r.arrival, r.params, len(r.prompt_token_ids),
                                min(r.num_computed_tokens, len(r.prompt_token_ids)),
                                r.num_cached_tokens, len(r.output_token_ids))
                    for r in self.scheduler.running]

    def flush_prefix_cache(self) -> None:
        """Drop every cached prefix no running request uses (the KV goes at the next step),
        and those in host memory."""
        with self._lock:
            self.scheduler.flush_cache()
            if self.host_cache is not None:
                self.host_cache.clear()

    # ---- LoRA adapters at run time --------------------------------------------------------
    # ``load_lora`` and ``finish_unload_lora`` call llama.cpp: the engine thread's only
    # (AsyncEngine runs them between steps).

    def lora_adapters(self) -> list[LoadedLora]:
        with self._lock:
            return self.loras.adapters()

    def check_lora(self, name: str, path: str, replacing: bool = False) -> None:
        """Everything about a new adapter that needs no llama.cpp (any thread); ``replacing``:
        its name may be taken (by the adapter it replaces)."""
        with self._lock:
            self.loras.check(name, path, replacing)

    def load_lora(self, name: str, path: str, scale: float = 1.0) -> LoadedLora:
        with self._lock:
            return self.loras.load(name, path, scale)

    def replace_lora(self, name: str, path: str, scale: float = 1.0
                     ) -> tuple[LoadedLora, int | None]:
        """Load an adapter in place of the one of its name (``LoraRegistry.replace``): the
        old one's id, to ``finish_unload_lora`` once it is no longer busy."""
        with self._lock:
            return self.loras.replace(name, path, scale)

    def begin_unload_lora(self, name: str) -> int:
        """New requests for ``name`` are refused from now on; its id, for ``lora_busy`` and
        ``finish_unload_lora`` once its last request has ended."""
        with self._lock:
            return self.loras.begin_unload(name)

    def lora_busy(self, lora_id: int) -> bool:
        with self._lock:
            return self.loras.busy(lora_id)

    def finish_unload_lora(self, lora_id: int) -> None:
        """Drop the adapter's cached KV (at the next step) and free it."""
        with self._lock:
            def of_it(key: Hashable) -> bool:  # (the prefix cache's and host memory's trees)
                return isinstance(key, tuple) and any(i == lora_id for i, _ in key)

            self.scheduler.flush_cache_trees(of_it)
            if self.host_cache is not None:
                self.host_cache.drop_trees(of_it)
            self.loras.finish_unload(lora_id)

    # ---- KV export and import (prefill/decode disaggregation) ----------------------------
    # Both call llama.cpp: the engine thread's only (AsyncEngine runs them between steps).

    def kv_identity(self) -> KVIdentity:
        """What this engine's KV data fits: the GGUF's sha256 (the registry's, else hashed
        once), KV type, layers. AsyncEngine computes it off the engine thread first."""
        if self._kv_identity is None:
            meta = self.backend.metadata()
            arch = meta.get("general.architecture", "")
            self._kv_identity = KVIdentity(
                file_digest(self.backend.config.model_path), KV_TYPE,
                int(meta.get(f"{arch}.block_count", 0)),
                v_trans=self.config.flash_attn == "off")  # (auto: on wherever it can be)
        return self._kv_identity

    def export_prefix(self, tokens: list[int]) -> bytes:
        """The KV of the longest cached prefix of ``tokens`` as transfer bytes (header and
        checksum: ``kv/transfer.py``), one sliding window of positions a chunk (llama.cpp
        leaves cells outside a sequence's window out of its state). Raises KVTransferError
        when nothing of it is cached."""
        identity = self.kv_identity()
        with self._lock:
            self._restore_for(tokens)  # (a longer prefix in host memory goes back first)
            cache = self.cache
            match = cache.match(tokens, len(tokens)) if cache is not None else None
            if match is None or match.length == 0:
                raise KVTransferError("no prefix of these tokens is in the prefix cache")
            n = match.length
            step = self.backend.n_swa or n
            chunks = self._gather(match, [(a, min(a + step, n)) for a in range(0, n, step)])
        return pack(identity, tokens[:n], chunks, step)

    def _gather(self, match: Match, spans: list[tuple[int, int]]) -> list[bytearray]:
        """The cells of a cached prefix (``match``) at each span of positions, serialised
        (under the lock): its cells, spread over the cache's holders, are gathered into a
        borrowed sequence by the same zero-copy ``seq_cp`` a cache hit uses, serialised, and
        the sequence given back. A span must lie within one sliding window."""
        cache = self.cache
        assert cache is not None
        cache.lock(match.last)
        chunks: list[bytearray] = []
        try:
            for a, b in spans:
                seq = self._borrow_seq("export through")
                try:
                    self.runner.apply_kv_ops(self.scheduler.take_kv_ops() + [
                        KVOp.cp(node.holder, seq, max(node.start, a), min(node.end, b))
                        for node in match.nodes if node.start < b and node.end > a])
                    chunks.append(self.backend.seq_state(seq))
                finally:
                    self.scheduler.return_seq(seq)
        finally:
            cache.unlock(match.last)
            self.runner.apply_kv_ops(self.scheduler.take_kv_ops())
        return chunks

    def _borrow_seq(self, what: str) -> int:
        seq = self.scheduler.borrow_seq()
        if seq is None:
            raise KVTransferError(f"no free sequence id to {what}")
        return seq

    def import_prefix(self, blob: bytes | memoryview) -> int:
        """Put exported KV into this engine's prefix cache, so requests that start with its
        tokens hit it; returns the tokens of it now cached (in the KV or, moved out there
        already, in host memory: ``_restore`` brings it back for a request). Everything is
        checked before llama.cpp sees the bytes (KVTransferError: another model, KV type, a
        bad checksum, a truncated blob, no room); the caller then just computes the prompt.
        Each chunk goes into a scratch sequence and is tagged onto the holder by ``seq_cp``,
        which keeps earlier chunks (a state load empties its sequence first)."""
        header, chunks = unpack(blob)
        check_fits(header, self.kv_identity(), self.backend.n_vocab)
        tokens = list(header.tokens)
        if self.pool.blocks_for(len(tokens)) > self.pool.total_blocks or self.cache is None:
            raise KVTransferError(f"{len(tokens)} tokens of KV do not fit this engine's "
                                  "prefix cache")
        if header.chunk_tokens != (self.backend.n_swa or len(tokens)):
            raise KVTransferError(f"KV data cut in chunks of {header.chunk_tokens} positions; "
                                  "this model needs its sliding window")
        with self._lock:
            if self.host_cache is not None and self.host_cache.covers(tokens):
                # Here already, in host memory (moved out past the share of idle prefixes): a
                # request that needs it gets it back from there. Loading it now would ask room
                # for its chunks whole, which requests sharing its head may hold.
                return len(tokens)
            return self._load_prefix(tokens, header.spans(), chunks)

    def _load_prefix(self, tokens: list[int], spans: list[tuple[int, int]],
                     chunks: Sequence[bytes | bytearray | memoryview], tree: LoraKey = ()) -> int:
        """Serialised cells of ``tokens`` (chunk k: positions ``spans[k]``) into the prefix
        cache's tree ``tree`` (under the lock); the tokens of them now cached. The chunks may
        begin past position 0 where the cache holds the tokens before them (kept locked
        meanwhile), and the last may go on past ``tokens`` (its cells there are dropped).
        Each chunk goes into a scratch sequence and is tagged onto the holder by ``seq_cp``,
        which keeps earlier chunks (a state load empties its sequence first)."""
        cache = self.cache
        assert cache is not None
        backend = self.backend
        held = cache.match(tokens, len(tokens), tree)
        if held.length == len(tokens):
            # Here already (an earlier hand-over of the same prompt, or a request): nothing
            # to load. It used to ask room for the whole prompt again, which requests
            # sharing that very prefix held, and refused the import.
            return held.length
        first = spans[0][0] if spans else 0
        if first > held.length:
            raise KVTransferError(f"KV data from position {first}, but the cache holds "
                                  f"{held.length} tokens before it")
        node = cache.hold(held) if first else None  # the head the chunks go on from stays
        # Room for every cell the chunks load, not only for the tokens the cache lacks: a
        # chunk goes whole through a scratch sequence, positions the cache holds included.
        loaded = sum(min(b, len(tokens)) - a for a, b in spans)
        try:
            if not self.scheduler.make_room(max(loaded, len(tokens) - held.length)):
                raise KVTransferError(f"no room for {len(tokens)} tokens of KV: the running "
                                      "requests hold the pool")
            holder = self._borrow_seq("import into")
            try:
                for (a, b), data in zip(spans, chunks):
                    scratch = self._borrow_seq("import through")
                    self.runner.apply_kv_ops(self.scheduler.take_kv_ops())
                    try:
                        backend.set_seq_state(scratch, data)
                        if (backend.seq_pos_min(scratch), backend.seq_pos_max(scratch)) != \
                                (a, b - 1):
                            raise KVTransferError(f"the KV data does not hold positions "
                                                  f"{a}..{b - 1}")
                        if b > len(tokens):  # a chunk that goes on past the prefix wanted
                            backend.seq_rm(scratch, len(tokens), -1)
                        backend.seq_cp(scratch, holder)
                    except EngineError as e:
                        raise KVTransferError(str(e)) from None
                    finally:
                        self.scheduler.return_seq(scratch)
            except BaseException:
                self.scheduler.return_seq(holder)
                self.runner.apply_kv_ops(self.scheduler.take_kv_ops())
                raise
            self.scheduler.adopt_prefix(tokens, holder, tree)
        finally:
            cache.unlock(node)
        self.runner.apply_kv_ops(self.scheduler.take_kv_ops())
        return cache.match(tokens, len(tokens), tree).length

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        if self.closed:
            raise EngineClosedError("the engine is closed")
        self._steps += 1
        drafts = self._propose() if self.spec is not None else None
        try:
            with self._lock:  # planned and put in the batch before an abort can interleave
                if self.host_cache is not None and self.scheduler.waiting:
                    self._restore()
                plan = self.scheduler.schedule(drafts)
                self._preemptions_total += len(plan.preempted)
                if plan.is_empty:
                    stuck = self._stuck_head()
                else:
                    self._mark_scheduled(plan)
                    n_tokens = self.runner.prepare(plan)
                    in_graph = self._graph_rows(plan) if self.config.backend_sampling else {}
                    if plan.chunks:  # one adapter set per step (the scheduler's choice)
                        self.loras.apply(plan.chunks[0].request.lora)
                    if self.config.check_kv:
                        self.check_kv(plan)
            if plan.is_empty:  # answered outside the lock: _fail takes it
                return [] if stuck is None else self._fail([stuck], STUCK)
            logits = self.runner.decode(n_tokens)
        except KVCacheFullError:
            self._undo(plan)
            return self._on_cache_full(plan)
        except EngineError as e:
            isolated = self._isolate_inconsistent(plan, str(e))
            self._undo(plan)
            # The others go again in the next step; without a culprit the step fails whole.
            return isolated if isolated is not None else self._fail_plan(plan, str(e))
        with self._lock:
            outputs, result = self._postprocess(plan, logits, in_graph)
            for req in self.scheduler.update(plan, result):
                self._drop(req.request_id)
            if self.host_cache is not None:
                self._spill()
            return outputs

    # ---- the host-memory tier (--cache-ram) -----------------------------------------------

    def _spill(self) -> None:
        """While the prefix cache holds more than its share of the KV, or the pool has fewer
        free blocks than the floor (``free_floor``: a GPU's), its next victim's prefix (from
        position 0) is copied to host memory, but the chunks kept there already, unless an
        entry there holds all of it, and then evicted (kv/host_cache.py says why: idle cells
        slow every decode). An adapter set's prefixes go to its own tree there."""
        cache, host = self.cache, self.host_cache
        assert cache is not None and host is not None
        while (cache.num_blocks > self._resident_blocks
               or (self.pool.num_free < self._free_floor and cache.num_blocks)):
            leaf = cache.spill_candidate()
            if leaf is None:
                return
            tokens, tree = cache.path_tokens(leaf), leaf.tree
            if not host.covers(tokens, tree):
                missing = host.missing(tokens, tree)
                match = cache.match(tokens, len(tokens), tree)
                assert match.length == len(tokens) and match.last is leaf
                try:
                    data = self._gather(match, [(m.start, m.end) for m in missing])
                except KVTransferError as e:  # (no sequence id to gather through)
                    log.debug("prefix not moved to host memory: %s", e)
                else:
                    host.put(tokens, {m.digest: d for m, d in zip(missing, data)}, tree)
            if cache.is_evictable(leaf):  # (the gather locked it: nothing evicted it)
                self.scheduler.evict_cached(leaf)

    def _restore(self) -> None:
        """The requests that may be admitted this step, each once: one that shares at least a
        block more of its tokens with a prefix in host memory than with the prefix cache gets
        that prefix back in the KV first (it then hits it as any cached prefix)."""
        for req in itertools.islice(self.scheduler.waiting, self.config.max_prefill):
            if req.host_checked or not req.takes_cached_prefix:
                continue
            req.host_checked = True
            self._restore_for((req.prompt_token_ids + req.output_token_ids)[:req.num_tokens - 1],
                              req.lora)

    def _restore_for(self, tokens: list[int], tree: LoraKey = ()) -> None:
        """Copy back the chunks of the prefix in host memory sharing the most with
        ``tokens`` (in the adapter set ``tree``'s prefixes) that the prefix cache lacks, if
        that is at least a block more than it shares with them (under the lock)."""
        cache, host = self.cache, self.host_cache
        if cache is None or host is None:
            return
        usable, entry = host.best(tokens, tree)
        have = cache.match(tokens, len(tokens), tree).length
        if entry is None or usable < have + self.pool.block_size:
            return
        chunks = host.chunks(entry, have, usable)  # (the last one is cut at ``usable``)
        try:
            self._load_prefix(entry.tokens[:usable], [(s.start, s.end) for s, _ in chunks],
                              [d for _, d in chunks], tree)
        except KVTransferError as e:  # no room or no id now: the prompt is computed
            log.debug("prefix not restored from host memory: %s", e)
            return
        host.used(entry, usable - chunks[0][0].start)

    def check_kv(self, plan: StepPlan | None = None) -> None:
        """Raise KVConsistencyError unless every sequence id's cells in llama.cpp are what the
        scheduler and prefix cache believe (valid once the pending KV operations are applied:
        the engine calls it after the runner applied a plan's, before the batch is decoded)."""
        leaves = [q for c in plan.chunks for q in c.leaf_seqs] if plan else []
        n_ids = self.backend.config.n_seq_max
        problems = kv_mismatches(self.scheduler, self.backend, n_ids, leaves)
        problems += [f"sequence {s} and its twin differ" for s in range(n_ids)
                     if self.backend.twin_differs(s)]
        if problems:
            raise KVConsistencyError("KV cache out of step with the scheduler: "
                                     + "; ".join(problems[:5]))

    def _isolate_inconsistent(self, plan: StepPlan, message: str) -> list[RequestOutput] | None:
        """llama.cpp refused the batch. Chunks that do not follow on from what llama.cpp holds
        for their sequence (its "inconsistent sequence positions" error) are to blame: their
        requests go back to be recomputed from scratch without the prefix cache (or fail, alone,
        when that already happened once or their prompt is shared), and the step is retried for
        everyone else: one bad sequence must not fail the others. None when no chunk is to
        blame."""
        with self._lock:
            bad = [c.request for c in plan.chunks
                   if c.request.status is RequestStatus.RUNNING and c.request.seq_id is not None
                   and self.backend.seq_pos_max(c.request.seq_id) != c.start - 1]
            for req in bad:
                if not req.prompt_cached:  # its KV is dropped, never handed to the cache
                    self.scheduler.recompute(req)
            give_up = [r for r in bad if r.prompt_cached or r.kv_errors > 1]
        if not bad:
            return None
        return self._fail(give_up, message)

    def _propose(self) -> dict[str, DraftTree]:
        """Drafts for the requests about to decode whose window is open. The proposer runs
        outside the lock (a draft model decodes); a request aborted meanwhile is skipped by the
        scheduler, which only plans running requests."""
        assert self.spec is not None
        with self._lock:
            wants = self.spec.wants(self.scheduler.decoding(), self._steps)
        drafts = self.spec.propose(wants)
        if wants and len(drafts) < len(wants):
            with self._lock:
                self.spec.record_misses(wants, drafts, self._steps)
        return drafts

    def _mark_scheduled(self, plan: StepPlan) -> None:
        now = time.perf_counter()
        for chunk in plan.chunks:
            live = self._live.get(chunk.request.request_id)
            if live is not None and live.metrics.scheduled_time is None:
                live.metrics.scheduled_time = now
                if live.resumed:  # its first token came before its prompt met the cache:
                    # the drawing engine's hit, less what this one had to compute again (an
                    # import refused), as the prompt tokens no engine computed for it
                    live.metrics.num_cached_tokens = min(chunk.request.num_cached_tokens,
                                                         live.resumed_cached)

    def _graph_rows(self, plan: StepPlan) -> dict[int, tuple[int, bool]]:
        """``--backend-sampling``: give each sequence with an output row this step the chain
        its request draws with in the graph, or none (engine/graph_sampling.py); the chunks
        whose token the graph chooses (or whose candidates it takes), by index, with their
        row's batch entry and whether it takes candidates."""
        specs: dict[int, GraphSampling | None] = {}
        rows: dict[int, tuple[int, bool]] = {}
        o = 0
        for i, chunk in enumerate(plan.chunks):
            o += len(chunk.token_ids)
            req = chunk.request
            live = self._live.get(req.request_id)
            if req.seq_id is None or not (chunk.wants_logits or chunk.all_logits):
                continue
            spec = None
            if (live is not None and chunk.wants_logits and not chunk.all_logits
                    and chunk.draft is None and req.params.max_tokens != 0):
                spec = graph_sampling(req.params, live.sampler, req.seq_id, live.handover,
                                      self.backend.n_vocab)
            specs[req.seq_id] = spec
            if spec is not None:
                rows[i] = (o - 1, spec.candidates > 0)
        self.backend.set_graph_sampling(specs)
        return rows

    def _postprocess(self, plan: StepPlan, logits, in_graph: dict[int, tuple[int, bool]]
                     ) -> tuple[list[RequestOutput], StepResult]:
        """Sample (or verify the draft of) every chunk that asked for logits: the new tokens go
        to the requests and their outputs; what the scheduler must know goes in the result.
        ``in_graph``: the chunks whose token llama.cpp chose in the graph, or whose candidates
        it took (``_graph_rows``); a chunk whose candidates could not decide its draw has its
        row computed again once every other row is read (the view of them is the decode's)."""
        now = time.perf_counter()
        outputs: list[RequestOutput] = []
        result = StepResult()
        presampled = self._presample(plan, logits, in_graph)
        for i, (entry, candidates) in in_graph.items():
            presampled[i] = self._graph_token(plan.chunks[i], entry, candidates)
        undecided = [i for i in in_graph if presampled[i] is None]
        row = 0
        for i, chunk in enumerate(plan.chunks):
            req = chunk.request
            live = self._live.get(req.request_id)
            if live is not None:
                live.metrics.num_computed_tokens += len(chunk.token_ids)
            n_rows = chunk.num_logits
            rows = logits[row:row + n_rows]
            row += n_rows
            if live is None or req.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran (a draft's KV is still settled)
            if chunk.all_logits:
                self._prompt_logprobs(live, chunk, rows)
            if chunk.draft is not None:
                outputs.append(self._verify(live, chunk, rows, now, result, i))
            elif chunk.wants_logits and req.params.max_tokens == 0:
                # the prompt scored for its logprobs, nothing to draw (OpenAI's echo idiom)
                outputs.append(self._finish_output(live, _Emitted(reason=FinishReason.LENGTH),
                                                   now, result))
            elif i in undecided:
                continue  # below, once the other rows are read
            elif chunk.wants_logits:  # the chunk's last row (its only one, but for all_logits)
                outputs.append(self._sample_one(live, rows[-1] if len(rows) else None, now,
                                                result, presampled.get(i)))
        for i in undecided:
            live = self._live.get(plan.chunks[i].request.request_id)
            if live is not None and live.request.status is RequestStatus.RUNNING:
                try:
                    again = self._row_again(plan.chunks[i])
                except EngineError as e:
                    outputs.append(self._end_with_error(live, _Emitted(), str(e), result, None))
                    continue
                outputs.append(self._sample_one(live, again, now, result))
        return outputs, result

    def _graph_token(self, chunk: ScheduledChunk, entry: int, candidates: bool
                     ) -> SampledToken | EngineError | None:
        """The token the graph chose for ``chunk``, or the one its request's generator draws
        from the candidates the graph took (None when they cannot decide it)."""
        live = self._live.get(chunk.request.request_id)
        try:
            if candidates:
                if live is None:
                    return None
                token = live.sampler.draw_candidates(*self.backend.graph_candidates(entry))
                if token is None:
                    return None
            else:
                token = self.backend.graph_token(entry)
        except EngineError as e:
            return e
        if live is not None:
            live.sampler.accepted(token)
        return SampledToken(token)

    def _row_again(self, chunk: ScheduledChunk) -> np.ndarray:
        """The logits row of ``chunk``'s last token, computed again with no chain on its
        sequence: its cell is dropped and the token decoded alone at its position (the KV ends
        as it was). For the rare draw the graph's candidates cannot decide."""
        seq = chunk.request.seq_id
        assert seq is not None
        pos = chunk.start + len(chunk.token_ids) - 1
        b = self.backend
        b.set_graph_sampling({seq: None})
        b.seq_rm(seq, pos, -1)
        b.batch_tokens[0], b.batch_pos[0], b.batch_seq[0] = chunk.token_ids[-1], pos, seq
        b.batch_n_seq[0], b.batch_logits[0] = 1, 1
        return np.array(b.decode(1)[0])

    def _presample(self, plan: StepPlan, logits, in_graph: dict[int, tuple[int, bool]]
                   ) -> dict:
        """The step's rows, side by side on the row sampler's threads where it has them
        (engine/row_sampling.py); grammar rows, and every row when it has none, are left to
        ``_sample_one``; rows the graph chose (``in_graph``) are not read."""
        if self.row_sampler.workers < 2:
            return {}
        jobs = []
        row = 0
        for i, chunk in enumerate(plan.chunks):
            last, row = row + chunk.num_logits - 1, row + chunk.num_logits
            live = self._live.get(chunk.request.request_id)
            if (chunk.draft is None and chunk.wants_logits and live is not None
                    and i not in in_graph
                    and chunk.request.params.max_tokens != 0
                    and chunk.request.status is RequestStatus.RUNNING
                    and worth_a_worker(live.sampler)):
                req = live.request
                jobs.append(RowJob(i, live.sampler, logits[last], req.prompt_token_ids,
                                   req.output_token_ids))
        return self.row_sampler.sample(jobs) if len(jobs) > 1 else {}

    def _prompt_logprobs(self, live: _Live, chunk: ScheduledChunk, rows) -> None:
        """The logprobs of the prompt tokens this chunk's rows predict (row ``j`` is position
        ``start + j``; it predicts the next token). A recompute writes them again, the same."""
        lps, prompt = live.prompt_logprobs, live.request.prompt_token_ids
        if lps is None:
            return
        k = live.request.params.prompt_logprobs or 0
        for j in range(min(len(chunk.token_ids), len(prompt) - 1 - chunk.start)):
            token = prompt[chunk.start + j + 1]
            logprob, top, rank = token_logprob(rows[j], token, k)
            lps[chunk.start + j + 1] = TokenLogprob(token, logprob, top, rank)

    def _sample_one(self, live: _Live, logits, now: float, result: StepResult,
                    sampled: SampledToken | EngineError | None = None) -> RequestOutput:
        """``sampled``: the row's token when ``_presample`` drew it (or its sampler's error)."""
        req = live.request
        out = _Emitted()
        try:
            if isinstance(sampled, EngineError):
                raise sampled
            if sampled is None:
                sampled = live.sampler.sample(logits, req.prompt_token_ids,
                                              req.output_token_ids)
        except EngineError as e:  # e.g. a grammar with no way forward: end this request only
            return self._end_with_error(live, out, str(e), result, getattr(e, "code", None))
        self._emit(live, sampled, now, out)
        return self._finish_output(live, out, now, result)

    def _verify(self, live: _Live, chunk: ScheduledChunk, rows, now: float,
                result: StepResult, index: int) -> RequestOutput:
        """Walk the draft with the request's own sampling rule, emitting each token the target
        produced; the accepted nodes go in the result (the scheduler keeps their KV)."""
        req, draft, sampler = live.request, chunk.draft, live.sampler
        assert draft is not None
        out = _Emitted()
        q = draft.q

        def step(row: int, kids: tuple[int, ...]) -> tuple[int, bool]:
            against = None
            if q is not None and len(kids) == 1:
                against = (draft.tokens[kids[0]], q[kids[0]])  # type: ignore[index]
            sampled = sampler.sample(rows[row], req.prompt_token_ids, req.output_token_ids,
                                     against)
            self._emit(live, sampled, now, out)
            return sampled.token_id, out.reason is not None

        try:
            verdict = walk_draft(draft, step)
        except EngineError as e:
            return self._end_with_error(live, out, str(e), result, getattr(e, "code", None))
        result.paths[index] = list(verdict.path)
        assert self.spec is not None
        self.spec.record(req.request_id, draft, verdict.accepted, self._steps)
        return self._finish_output(live, out, now, result)

    def _emit(self, live: _Live, sampled: SampledToken, now: float, out: _Emitted,
              here: bool = True) -> None:
        """Append one token to the request and check its stop conditions. ``here``: drawn by
        this engine (a hand-over's tokens, and the prompt before them, were drawn and
        computed by the prefill replica, whose totals count them)."""
        req, params = live.request, live.request.params
        token = sampled.token_id
        req.output_token_ids.append(token)
        out.token_ids.append(token)
        self._generation_tokens_total += here
        m = live.metrics
        m.num_generated_tokens += 1
        m.token_times.append(now)
        if m.first_token_time is None:
            m.first_token_time = now
            # (a resumed request's, until its prompt meets the cache here, if it ever does)
            m.num_cached_tokens = live.resumed_cached if live.resumed else req.num_cached_tokens
            self._prompt_tokens_total += req.num_prompt_tokens if here else 0
        if sampled.logprob is not None:
            out.logprobs.append(TokenLogprob(token, sampled.logprob, sampled.top_logprobs or ()))
        early = len(req.output_token_ids) < params.min_tokens  # (the sampler masked ends)
        if not early and token in params.stop_token_ids:
            # vLLM's: the stop token's text is part of the answer (a control token has none)
            live.detok.add_token(token, find_stop=False)
            out.reason = FinishReason.STOP
            return
        # A grammar offers the end only once it is complete: the answer ends there, ignore_eos
        # or not (else every later token would be another end).
        if not early and (not params.ignore_eos or _held(live.sampler.constraint)) \
                and self.backend.is_eog(token):
            out.reason = FinishReason.STOP
            return
        live.detok.add_token(token, find_stop=not early)
        if live.detok.stopped:
            out.reason = FinishReason.STOP
        elif req.num_tokens >= req.max_total_tokens:
            out.reason = FinishReason.LENGTH

    def _finish_output(self, live: _Live, out: _Emitted, now: float,
                       result: StepResult) -> RequestOutput:
        req, reason = live.request, out.reason
        text = live.detok.take_new_text(final=reason is not None)
        if live.output is not None:
            live.output.append(text)
        if reason is not None:
            result.finished.append((req, reason))
            live.metrics.finished_time = now
        handover = None
        if reason is not None and live.handover:
            rng_state = dict(live.sampler.rng.bit_generator.state)
            handover = Handover(tuple(req.output_token_ids), rng_state,
                                tuple(out.logprobs) if out.logprobs else None,
                                prompt_digest(req.prompt_token_ids), req.num_cached_tokens)
        prompt_lps = None
        if live.prompt_logprobs is not None and not req.prompt_logprobs_done:
            prompt_lps, req.prompt_logprobs_done = live.prompt_logprobs, True
            live.prompt_logprobs = None
        return RequestOutput(req.request_id, text, out.token_ids, reason is not None,
                             reason.value if reason else None, out.logprobs or None,
                             live.metrics, stop=live.detok.matched if reason else None,
                             handover=handover, prompt_logprobs=prompt_lps,
                             prompt_token_ids=req.prompt_token_ids if prompt_lps else None,
                             held=live.sampler.constraint is not None
                             and live.sampler.constraint.active)

    def _end_with_error(self, live: _Live, out: _Emitted, message: str,
                        result: StepResult, code: str | None = None) -> RequestOutput:
        req = live.request
        result.finished.append((req, FinishReason.ABORT))
        live.error = message
        text = live.detok.take_new_text(final=True)
        if live.output is not None:
            live.output.append(text)
        return RequestOutput(req.request_id, text, out.token_ids, True, "abort",
                             out.logprobs or None, live.metrics, error=message,
                             error_code=code)

    def _drop(self, request_id: str) -> None:
        live = self._live.pop(request_id, None)
        if live is not None:
            self.loras.release(live.request.lora)
            if self._observer is not None:
                self._observer.callback(request_record(
                    self._observer, live.request, live.metrics, error=live.error,
                    prompt=live.prompt,
                    output="".join(live.output) if live.output is not None else None,
                    origin=live.origin))
        if self.spec is not None:
            self.spec.release(request_id)

    def _undo(self, plan: StepPlan) -> None:
        with self._lock:
            self.scheduler.undo(plan)

    def _on_cache_full(self, plan: StepPlan) -> list[RequestOutput]:
        """Block accounting should prevent this; if llama.cpp still finds no room, preempt the
        policy's victim (it is recomputed later) rather than fail anyone."""
        with self._lock:
            if len(self.scheduler.running) > 1:
                self.scheduler.preempt_victim()
                self._preemptions_total += 1
                return []
        return self._fail_plan(plan, "the KV cache is full")

    def _stuck_head(self) -> Request | None:
        """After an empty plan (the engine's lock held): the head of the queue if nothing runs,
        since nothing will then change by itself and it would wait for ever (and the engine
        thread spin). No such case is known (the last, a prefix-cache lock that pinned too
        much, is fixed); should one come, that request ends with an error and the others go
        on, rather than a hang."""
        s = self.scheduler
        if s.running or not s.waiting:
            return None
        head = s.waiting[0]
        log.error("request %s cannot be scheduled with nothing running (%d tokens, %d of %d "
                  "KV blocks free, prefix cache %d blocks): ended with an error",
                  head.request_id, head.num_tokens, self.pool.num_free, self.pool.total_blocks,
                  self.cache.num_blocks if self.cache is not None else 0)
        return head

    def _fail_plan(self, plan: StepPlan, message: str) -> list[RequestOutput]:
        """llama.cpp refused the batch: end the requests in it with an error, keep serving."""
        return self._fail([c.request for c in plan.chunks], message)

    def fail_all(self, message: str) -> list[RequestOutput]:
        """End every unfinished request with an error (the last resort of the step loop when a
        step raised something unexpected: clients get an error instead of waiting forever)."""
        with self._lock:
            requests = [live.request for live in self._live.values()]
        return self._fail(requests, message)

    def _fail(self, requests: list[Request], message: str) -> list[RequestOutput]:
        outputs = []
        with self._lock:
            for req in requests:
                live = self._live.get(req.request_id)
                if live is not None:
                    live.error = message
                self._drop(req.request_id)
                if live is None or req.finished:
                    continue
                if req.status is RequestStatus.WAITING:
                    self.scheduler.abort(req.request_id)
                else:
                    self.scheduler.finish(req, FinishReason.ABORT)
                outputs.append(RequestOutput(req.request_id, "", [], True, "abort", None,
                                             live.metrics, error=message))
        return outputs

    def close(self) -> None:
        """Free the model and its context; later calls that need them raise
        EngineClosedError (they read freed memory: a segfault)."""
        self.closed = True
        if self.spec is not None:
            self.spec.close()
        self.row_sampler.close()
        self.backend.close()


@dataclass
class _Emitted:
    """Tokens one step appended to one request (several when a draft was accepted)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    reason: FinishReason | None = None


def _held(constraint: Constraint | None) -> bool:
    """Whether a grammar holds the answer now (a lazy one only once its trigger came)."""
    return constraint is not None and constraint.active
