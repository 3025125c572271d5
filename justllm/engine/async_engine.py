"""The step loop on one background thread, with ``async for`` over a request's outputs.

docs/llama-cpp-facts.md: llama.cpp compute must happen on a single OS thread, so the engine thread is the only
caller of ``Engine.step()``; the event loop only adds and aborts requests (cheap, under the
engine's lock: what is not cheap, tokenizing a prompt and compiling its grammar, happens first
on a worker thread, ``asubmit``) and receives outputs through ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import queue
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Generator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np

from justllm.core.fim import FimTokens
from justllm.core.gbnf import GBNF_TEXT, left_recursion
from justllm.core.record import RequestOrigin, RequestRecord
from justllm.core.request import FinishReason
from justllm.core.sampling_params import SamplingParams
from justllm.engine.backend import (
    JSON_GRAMMAR,
    MAX_GRAMMAR_ALTERNATIVES,
    EmbeddingContext,
    grammar_from_json_schema,
    grammar_from_regex,
    without_trailing_space,
)
from justllm.engine.chat_template import ChatTemplate
from justllm.engine.engine import (
    Engine,
    EngineStats,
    Handover,
    PreparedRequest,
    RequestMetrics,
    RequestOutput,
)
from justllm.engine.lora import LoadedLora
from justllm.errors import EngineClosedError, InvalidRequestError

log = logging.getLogger(__name__)


T = TypeVar("T")


# response_format json_object's grammar (made once: it is the same for every request).
JSON_OBJECT_GRAMMAR = without_trailing_space(JSON_GRAMMAR)
# Work for requests of this many characters (or token ids) or more runs on the pool for large
# ones (``AsyncEngine.off_loop``): 64 KiB of text tokenizes in ~40 ms on this machine.
LARGE_REQUEST = 64 * 1024


class RequestStream:
    """The outputs of one submitted request, as an async iterator.

    ``abort()`` (idempotent) ends the request early; iterating after the final output stops.
    """

    def __init__(self, owner: "AsyncEngine", request_id: str,
                 loop: asyncio.AbstractEventLoop, prompt_tokens: int = 0) -> None:
        self.request_id = request_id
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.finished = False
        self.arrival = time.perf_counter()  # as RequestMetrics.arrival_time (an abort's e2e)
        self.prompt_tokens = prompt_tokens  # the prompt's length, known once it is queued
        self._owner = owner
        # Set by AsyncEngine.submit: aborts the request if this stream is collected before it
        # ends; detached once it has (its id may be a later request's by then).
        self.on_drop: weakref.finalize | None = None

    def ended(self) -> None:
        """The request is over: collecting this stream aborts nothing."""
        if self.on_drop is not None:
            self.on_drop.detach()

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            out = await self.queue.get()
        except BaseException:
            self.abort()
            raise
        if out.finished:
            self.finished = True
            self._owner._forget(self.request_id)
        return out

    def abort(self, reason: FinishReason = FinishReason.ABORT) -> None:
        """End the request (``reason``: what its record says, when not its client leaving)."""
        if not self.finished:
            self.finished = True
            self.ended()
            self._owner._forget(self.request_id)
            self._owner.abort(self.request_id, reason)


class AsyncEngine:
    """The engine on its own thread, and the narrow face a server sees: submit and abort
    requests, tokenize, read limits and stats, the chat template, JSON grammars, embeddings.
    Servers use nothing else (the layer contracts forbid ``justllm.server`` the backend)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._embedding_ctx: EmbeddingContext | None = None  # engine thread only
        # llama-server's global adapter scales (POST /lora-adapters): the adapters a request
        # that chooses none runs under (adapter name -> scale; none by default)
        self._lora_defaults: dict[str, float] = {}
        # Held weakly: a stream its caller dropped unread is aborted (``_dropped``), not run to
        # its max_tokens for no one.
        self._sinks: weakref.WeakValueDictionary[str, RequestStream] = (
            weakref.WeakValueDictionary())
        # Request ids of streams collected unfinished, aborted by the engine thread (a
        # finalizer may run on any thread, inside any lock: it only appends here).
        self._dropped: deque[str] = deque()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        # Jobs done a piece at a time (a long embedding), the engine stepping between pieces;
        # only the first advances, so they run one after another (engine thread only).
        self._pieces: deque[tuple[Generator[bool | None, None, object], asyncio.Future]] = deque()
        # Set by abort_all (any thread): the stepwise jobs end with this message.
        self._jobs_ended: str | None = None
        self._sinks_lock = threading.Lock()
        # json_grammar's memo (schema JSON -> GBNF, oldest first): the prepare workers' own
        self._grammars: OrderedDict[str, str] = OrderedDict()
        self._grammars_lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False  # the engine thread ends
        self._accepting = True  # new requests are taken (False from stop_accepting() on)
        self._thread = threading.Thread(target=self._loop, name="justllm-engine", daemon=True)
        self._thread.start()
        # off_loop's workers: small requests never queue behind large ones
        self._small_pool = ThreadPoolExecutor(4, thread_name_prefix="justllm-prepare")
        self._large_pool = ThreadPoolExecutor(2, thread_name_prefix="justllm-prepare-large")

    async def off_loop(self, size: int, fn: Callable[[], T]) -> T:
        """``fn()`` on a worker thread: what a request costs before it is queued (rendering,
        tokenizing, compiling its grammar), which the event loop must not wait on. ``size``:
        the request's text in characters (or token ids); from ``LARGE_REQUEST`` on it goes to
        a pool of its own, so a few clients sending megabytes (seconds of tokenizing each)
        hold up each other, not every small request behind them. Cancelled, ``fn`` still runs
        to its end, and its result is dropped."""
        pool = self._large_pool if size >= LARGE_REQUEST else self._small_pool
        run = contextvars.copy_context().run
        return await asyncio.get_running_loop().run_in_executor(pool, run, fn)

    def prepare(self, prompt: str | list[int], params: SamplingParams | None = None,
                resume: Handover | None = None) -> PreparedRequest:
        """``Engine.prepare``: tokenize and check a request, build its sampler and grammar.
        Any thread may call it; :meth:`asubmit` calls it on a worker thread."""
        return self.engine.prepare(prompt, params, resume)

    def submit(self, prompt: str | list[int] | PreparedRequest,
               params: SamplingParams | None = None,
               request_id: str | None = None, *, handover: bool = False,
               resume: Handover | None = None,
               origin: RequestOrigin | None = None) -> "RequestStream":
        """Queue a request now; validation and queue-full errors raise here, synchronously, so a
        server can answer with the right status before it starts a response. ``prompt`` may be
        a request :meth:`prepare` made ready (``params`` then left out); otherwise it is
        prepared here, on the caller's thread -- a server should use :meth:`asubmit`.
        ``handover`` and ``resume``: prefill/decode disaggregation (``Engine.add_request``,
        ``Engine.resume_request``); a resumed request's given tokens are its first output,
        ready at once. ``origin``: what the server knew of it, for its record. A resumed
        request is taken while a shutdown drains (``stop_accepting``): it is the second half
        of one a prefill replica took before (router mode stops the runners once it is handed
        over)."""
        if not self._takes(resume):
            raise EngineClosedError("the server is shutting down")
        loop = asyncio.get_running_loop()
        if not isinstance(prompt, PreparedRequest):  # outside the lock: it may take seconds
            prompt = self.engine.prepare(prompt, params, resume)
            params = None
        with self._sinks_lock:  # the sink is there before the engine thread can feed it
            first = None
            if resume is not None:
                first = self.engine.resume_request(prompt, params, resume, request_id,
                                                   origin=origin)
                request_id = first.request_id
            else:
                request_id = self.engine.add_request(prompt, params, request_id,
                                                     handover=handover, origin=origin)
            stream = RequestStream(self, request_id, loop, len(prompt.tokens))
            if first is not None:
                stream.queue.put_nowait(first)
            if first is None or not first.finished:
                self._sinks[request_id] = stream
                stream.on_drop = weakref.finalize(stream, self._dropped.append, request_id)
        self._wake.set()
        return stream

    async def asubmit(self, prompt: str | list[int], params: SamplingParams | None = None,
                      request_id: str | None = None, *, handover: bool = False,
                      resume: Handover | None = None,
                      origin: RequestOrigin | None = None) -> "RequestStream":
        """:meth:`submit`, the request prepared on a worker thread first: tokenizing a prompt
        of megabytes takes seconds, and the event loop serves every other request meanwhile.
        Cancelled while it prepares, nothing is queued."""
        if not self._takes(resume):  # no tokenizing for a closed engine
            raise EngineClosedError("the server is shutting down")
        prepared = await self.off_loop(len(prompt),
                                       lambda: self.engine.prepare(prompt, params, resume))
        return self.submit(prepared, None, request_id, handover=handover, resume=resume,
                           origin=origin)

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None, *, handover: bool = False,
                       resume: Handover | None = None,
                       origin: RequestOrigin | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as steps produce them; the last one has ``finished``.

        Leaving the loop early (with ``contextlib.aclosing``) or cancelling the task aborts the
        request and frees its KV within one step.
        """
        stream = await self.asubmit(prompt, params, request_id, handover=handover,
                                    resume=resume, origin=origin)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    # ---- the model, as a server needs it ---------------------------------------------------

    def observe(self, callback: Callable[[RequestRecord], None] | None, *,
                model: str | None = None, text: bool = False) -> None:
        """``Engine.observe``: a RequestRecord per request that leaves the engine."""
        self.engine.observe(callback, model=model, text=text)

    @property
    def model_path(self) -> str:
        return self.engine.backend.config.model_path

    @property
    def n_vocab(self) -> int:
        return self.engine.backend.n_vocab

    @property
    def max_request_tokens(self) -> int:
        """Most tokens one request may hold, prompt and output (``--ctx``, pool, model)."""
        return self.engine.max_request_tokens

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True
                 ) -> list[int]:
        """``text``'s tokens; by default as a prompt is tokenized (BOS added, special tokens'
        text read as those tokens). The vocabulary is read-only: any thread may call this."""
        return self.engine.backend.tokenize(text, add_special=add_special,
                                            parse_special=parse_special)

    def check_token_ids(self, ids: list[int], param: str) -> None:
        """400 (naming ``param`` and the first bad one) for an id outside the vocabulary."""
        n_vocab = self.n_vocab
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < n_vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"{param}[{bad}]: {ids[bad]} is not a token id (they are "
                                      f"in [0, {n_vocab}))", param=param)

    def eog_ids(self) -> list[int]:
        """The end-of-generation tokens (llama.cpp's set; the first call asks every id)."""
        return [int(t) for t in self.engine.backend.eog_ids()]

    @property
    def generates(self) -> bool:
        """False for an encoder (a BERT-like embedding model): it makes embeddings only."""
        return self.engine.generates

    def fim_tokens(self) -> FimTokens:
        """The model's fill-in-the-middle tokens (``FimTokens.missing``: what it lacks)."""
        return self.engine.backend.fim_tokens()

    def bos_added(self) -> int | None:
        """The BOS token if the model's prompts start with one."""
        return self.engine.backend.adds_bos()

    def detokenize(self, tokens: list[int]) -> str:
        """The text of ``tokens`` (special tokens as their text); 400 for an id outside the
        vocabulary."""
        self.check_token_ids(tokens, "tokens")
        return self.engine.backend.detokenize(tokens)

    def token_text(self, token: int) -> str:
        """A token's text in the vocabulary (``▁Hello``), as Hugging Face tokenizers list it."""
        return self.engine.backend.token_text(token)

    def token_bytes(self, token: int, special: bool = False) -> bytes:
        """The bytes of one token (a piece of UTF-8 that may end mid-character); control
        tokens as nothing, or as their text with ``special``."""
        return self.engine.backend.token_to_piece(token, special=special)

    def chat_template(self) -> ChatTemplate:
        """The chat template requests are rendered with: ``--chat-template``, else the model's
        own, else a plain transcript (with a ``notice`` saying so)."""
        return ChatTemplate.from_backend(self.engine.backend, self.engine.config.chat_template)

    def check_grammar(self, gbnf: str, param: str) -> None:
        """400 (naming ``param``) unless llama.cpp can parse ``gbnf``, which it is shown
        only within :func:`grammar_limits` (its parser and sampler recurse per nested group
        and per rule: 100,000 of either overflowed the stack and killed the server)."""
        grammar_limits(gbnf, param)
        why = self.engine.backend.grammar_error(gbnf) if gbnf.strip() else ""
        if why is not None:
            raise InvalidRequestError(f"{param}: llama.cpp could not parse the grammar"
                                      + (f": {why}" if why else " (GBNF with a root rule; see "
                                         "llama.cpp's grammars/README.md)"), param=param)

    def json_grammar(self, schema: dict | None = None) -> str:
        """:func:`schema_grammar`, remembered for the last :data:`GRAMMAR_MEMO` schemas (an
        agent sends the same tools with every request: ten tools of twenty properties took
        32 ms a request to make their grammar again)."""
        if schema is None:
            return JSON_OBJECT_GRAMMAR
        key = json.dumps(schema)
        with self._grammars_lock:
            gbnf = self._grammars.get(key)
            if gbnf is not None:
                self._grammars.move_to_end(key)
                return gbnf
        gbnf = schema_grammar(schema, key)
        with self._grammars_lock:
            self._grammars[key] = gbnf
            while len(self._grammars) > GRAMMAR_MEMO:
                self._grammars.popitem(last=False)
        return gbnf

    @staticmethod
    def regex_grammar(pattern: str) -> str:
        """GBNF for text that ``pattern`` matches whole (vLLM's ``regex``), held to
        :func:`grammar_limits` as a schema's grammar is."""
        gbnf = grammar_from_regex(pattern)
        grammar_limits(gbnf, "the grammar made from the regular expression",
                       rules=MAX_SCHEMA_GRAMMAR_RULES,
                       alternatives=MAX_SCHEMA_GRAMMAR_ALTERNATIVES)
        return gbnf

    @property
    def embedding_limit(self) -> int:
        """The most tokens one embedding input holds (longer ones are refused): the
        backend's limit, or ``--ctx`` if smaller (as Ollama's ``num_ctx`` and vLLM's
        ``max_model_len`` cap an embedding input)."""
        limit = self.engine.backend.embedding_limit()
        ctx = self.engine.config.ctx
        return min(limit, ctx) if ctx > 0 else limit

    @property
    def pooling(self) -> str:
        """How embeddings pool: mean, cls, last, or rank (a reranker: a score per input)."""
        return self.engine.backend.embedding_pooling(self.engine.config.pooling)

    def rerank_tokens(self, query: str, document: str) -> list[int]:
        """A (query, document) pair as a reranker reads it (any thread: the vocabulary)."""
        return self.engine.backend.rerank_tokens(query, document)

    async def embed(self, token_lists: list[list[int]]) -> list[np.ndarray]:
        """Pooled embeddings (not normalised; pooled as ``--pooling`` or the model says),
        computed on the engine thread in a second context on the same model (created at
        first use), a chunk at a time with the engine's steps between chunks: a long input
        holds the running requests up for one chunk at a time, not for all of it."""
        return await self.call_on_engine_thread(lambda: self._embed_all(token_lists),
                                                stepwise=True)

    def _embed_all(self, token_lists: list[list[int]]
                   ) -> Generator[bool | None, None, list[np.ndarray]]:
        if self._embedding_ctx is None:
            backend = self.engine.backend
            self._embedding_ctx = backend.embedding_context(self.pooling, self.embedding_limit)
        ctx = self._embedding_ctx
        for tokens in token_lists:
            if len(tokens) > ctx.n_ctx:
                raise InvalidRequestError(
                    f"an input has {len(tokens)} tokens; embeddings take at most {ctx.n_ctx}",
                    param="input")
        out: list[np.ndarray] = []
        for tokens in token_lists:
            if out:
                # a step between inputs too, and another job's turn (the context holds one
                # input at a time: only here may another job's input go first)
                yield True
            out.append((yield from ctx.embed_in_pieces(tokens)))
        return out

    def call_on_engine_thread(self, fn: Callable[[], T]
                              | Callable[[], Generator[bool | None, None, T]],
                              *, stepwise: bool = False) -> "asyncio.Future[T]":
        """Run ``fn`` on the engine thread between steps (for other llama.cpp compute, such as
        embeddings, which must not run on a second OS thread). ``stepwise``: ``fn`` returns a
        generator, advanced one ``yield`` at a time with a step between; its return value
        is the result. Such jobs take turns where one yields True (the next job goes on
        then), in the order they came: a request of hundreds of inputs held a one-input
        request back for all of them."""
        fut: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._jobs.put((fn, fut, stepwise))
        self._wake.set()
        return fut

    async def export_prefix(self, tokens: list[int]) -> tuple[bytes, float]:
        """The KV of the longest cached prefix of ``tokens`` (``Engine.export_prefix``), and
        the seconds the export took on the engine thread (without the wait for a step's end)."""
        await asyncio.to_thread(self.engine.kv_identity)  # a first GGUF hash stalls no step
        return await self.call_on_engine_thread(_timed(lambda: self.engine.export_prefix(tokens)))

    async def import_prefix(self, blob: bytes | memoryview) -> tuple[int, float]:
        """Exported KV into the prefix cache (``Engine.import_prefix``): the tokens now cached,
        and the seconds the import took on the engine thread."""
        await asyncio.to_thread(self.engine.kv_identity)
        return await self.call_on_engine_thread(_timed(lambda: self.engine.import_prefix(blob)))

    # ---- LoRA adapters ------------------------------------------------------------------

    @property
    def lora_runtime(self) -> bool:
        """Whether clients may load and unload adapters (``--enable-lora-runtime``)."""
        return self.engine.config.lora_runtime

    def lora_adapters(self) -> list[LoadedLora]:
        return self.engine.lora_adapters()

    def lora_defaults(self) -> tuple[tuple[str, float], ...]:
        """The adapters a request that chooses none runs under, as (name, scale) (llama-server's
        global scales; none unless :meth:`set_lora_defaults` set some)."""
        live = {a.name for a in self.lora_adapters() if not a.unloading}
        return tuple((n, s) for n, s in self._lora_defaults.items() if n in live)

    def set_lora_defaults(self, scales: dict[str, float]) -> None:
        """Replace the defaults: each named adapter at its scale, the others not applied (a
        scale of 0 is not applied)."""
        self._lora_defaults = {n: s for n, s in scales.items() if s != 0.0}

    async def load_lora(self, name: str, path: str, scale: float = 1.0, *,
                        replace: bool = False) -> LoadedLora:
        """Load an adapter: the file is checked off the engine thread, then llama.cpp loads it
        between two steps. ``replace``: it takes the place of the adapter of that name, if
        any, at once for new requests; the old one is freed once its running requests have
        ended (a file llama.cpp refuses leaves the old one as it was)."""
        await asyncio.to_thread(self.engine.check_lora, name, path, replace)
        if not replace:
            return await self.call_on_engine_thread(
                lambda: self.engine.load_lora(name, path, scale))
        lora, old = await self.call_on_engine_thread(
            lambda: self.engine.replace_lora(name, path, scale))
        self._lora_defaults.pop(name, None)  # other weights: not applied until asked again
        if old is not None:
            await self._finish_unload(old)
        return lora

    async def unload_lora(self, name: str) -> None:
        """Unload an adapter: new requests for it are refused at once, the ones running finish,
        then its cached KV is dropped and it is freed. Runs to the end even if the caller is
        cancelled (a half-unloaded adapter would refuse requests forever)."""
        lora_id = self.engine.begin_unload_lora(name)
        self._lora_defaults.pop(name, None)  # an adapter loaded later under its name starts off
        await self._finish_unload(lora_id)

    async def _finish_unload(self, lora_id: int) -> None:
        """Once the adapter's last request has ended: drop its cached KV and free it."""
        async def finish() -> None:
            while self.engine.lora_busy(lora_id):
                await asyncio.sleep(0.02)
            await self.call_on_engine_thread(lambda: self.engine.finish_unload_lora(lora_id))

        await asyncio.shield(asyncio.ensure_future(finish()))

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> bool:
        aborted = self.engine.abort(request_id, reason)
        self._wake.set()
        return aborted

    def _forget(self, request_id: str) -> None:
        with self._sinks_lock:
            self._sinks.pop(request_id, None)

    def _run_jobs(self) -> None:
        while not self._jobs.empty():
            fn, fut, stepwise = self._jobs.get()
            try:
                result = fn()
            except BaseException as e:  # delivered to the awaiting coroutine
                _deliver(fut.get_loop(), _settle, fut, None, e)
            else:
                if stepwise:
                    self._pieces.append((result, fut))
                else:
                    _deliver(fut.get_loop(), _settle, fut, result, None)

    def _run_piece(self) -> None:
        """The next piece of the first stepwise job (``call_on_engine_thread``). A job whose
        caller went (its future cancelled: a client that left) stops; :meth:`abort_all`
        ends them all with its message."""
        with self._sinks_lock:  # (abort_all sets it from another thread)
            ended, self._jobs_ended = self._jobs_ended, None
        if ended is not None:
            while self._pieces:
                pieces, fut = self._pieces.popleft()
                pieces.close()
                _deliver(fut.get_loop(), _settle, fut, None, EngineClosedError(ended))
        while self._pieces and self._pieces[0][1].cancelled():
            self._pieces.popleft()[0].close()
        if not self._pieces:
            return
        pieces, fut = self._pieces[0]
        try:
            turn = next(pieces)
        except StopIteration as done:
            self._pieces.popleft()
            _deliver(fut.get_loop(), _settle, fut, done.value, None)
        except BaseException as e:
            self._pieces.popleft()
            _deliver(fut.get_loop(), _settle, fut, None, e)
        else:
            if turn:
                self._pieces.rotate(-1)  # the next job's turn

    def _loop(self) -> None:
        while not self._stopping:
            while self._dropped:  # (finished ones are no longer the engine's: a no-op)
                self.engine.abort(self._dropped.popleft())
            self._run_jobs()
            self._run_piece()
            if not self.engine.has_work():
                if not self._pieces:
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                continue
            self._wake.clear()
            try:
                outputs = self.engine.step()
            except Exception as e:  # a bug must not kill the thread that serves everyone
                log.exception("engine step failed")
                outputs = self.engine.fail_all(f"internal engine error: {e}")
            for out in outputs:
                self._to_sink(out)
        self._run_jobs()
        while self._pieces:  # (whoever waits on them gets their answer)
            self._run_piece()

    def _to_sink(self, out: RequestOutput) -> None:
        """``out`` to its request's stream, if it is still held (a method of its own: a
        local in the loop kept the last stream alive, and so its request from being aborted
        when its caller dropped it)."""
        with self._sinks_lock:
            sink = self._sinks.get(out.request_id)
        if sink is not None:
            if out.finished:
                sink.ended()
            _deliver(sink.loop, sink.queue.put_nowait, out)

    @property
    def accepting(self) -> bool:
        return self._accepting and not self._stopping

    def _takes(self, resume: Handover | None) -> bool:
        return not self._stopping and (self._accepting or resume is not None)

    def stop_accepting(self) -> None:
        """Refuse new requests (EngineClosedError) and let the ones in flight go on: the first
        half of a graceful shutdown."""
        self._accepting = False

    def abort_all(self, message: str = "the server is shutting down") -> int:
        """End every unfinished request now with ``message`` as its error (streams get a final
        error event); their KV is freed at the next step. Returns how many were ended."""
        with self._sinks_lock:
            pending = list(self._sinks.values())
            self._sinks.clear()
        for stream in pending:
            stream.ended()
            # (its own counters: /metrics observes its latency, from its arrival to now)
            metrics = self.engine.request_metrics(stream.request_id) or RequestMetrics(
                arrival_time=stream.arrival, num_prompt_tokens=stream.prompt_tokens)
            self.engine.abort(stream.request_id)
            end = RequestOutput(stream.request_id, "", [], True, "abort", None, metrics,
                                error=message, error_code="shutting_down")
            _deliver(stream.loop, stream.queue.put_nowait, end)
        with self._sinks_lock:
            self._jobs_ended = message  # (embeddings under way, at their next piece)
        self._wake.set()
        return len(pending)

    def close(self) -> None:
        """Stop the engine thread; unfinished requests are aborted. Frees the model."""
        self._accepting = False
        self._stopping = True
        self._wake.set()
        self._thread.join()
        self.abort_all()
        # (work still queued runs, and its request is then refused as the server stops)
        self._small_pool.shutdown(wait=False)
        self._large_pool.shutdown(wait=False)
        self.engine.close()


def _deliver(loop: asyncio.AbstractEventLoop, fn: Callable[..., object], *args: object) -> None:
    """``fn(*args)`` on ``loop``'s thread; nothing when that loop has closed (whoever waited
    there is gone). The engine thread serves every caller: one caller's closed loop must not
    raise in it and stop it for all the others."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        if not loop.is_closed():
            raise


def _settle(fut: asyncio.Future, result: object, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


def _timed(fn: Callable[[], T]) -> Callable[[], tuple[T, float]]:
    """``fn`` returning its result and how long it ran (for a job on the engine thread, whose
    wait in the queue is not the job's cost)."""
    def run() -> tuple[T, float]:
        t0 = time.perf_counter()
        return fn(), time.perf_counter() - t0
    return run


MAX_GRAMMAR_RULES = 4096
# A schema's grammar gets more room. Its rules sit side by side (a call grammar for 128 tools of
# 11 parameters: 4,232 rules, 4,866 '|'), not chained, which is what the rule limit guards. Its
# enums and anyOf branches are mostly not live at the same time. Measured with the demo model
# (2-core CPU, greedy, 48 tokens): one object of 25 optional 25-value enums (648 '|') 4.1 s,
# anyOf of 13 such objects (8,124) 5.5 s; 20 100-value enums (1,999) 1.0 s for 24 tokens,
# 30 required strings (2) 0.5 s. The '|' count is a rough measure of a grammar's cost.
MAX_SCHEMA_GRAMMAR_RULES = 4 * MAX_GRAMMAR_RULES
MAX_SCHEMA_GRAMMAR_ALTERNATIVES = 8192
GRAMMAR_MEMO = 64  # schemas whose grammar an engine remembers (a big one's is ~40 KB)
MAX_GRAMMAR_NESTING = 1024


def schema_grammar(schema: dict, text: str | None = None) -> str:
    """GBNF for JSON matching ``schema`` (``text``: its JSON text, if made already); nothing
    after it. Held to :func:`grammar_limits`, with more room for rules and alternatives: a
    schema within every per-keyword limit can still multiply into a grammar that makes every
    other request wait (50 ``anyOf`` objects of 50 properties with 50-value enums: 7,502
    rules and 124,999 alternatives, seconds a token)."""
    gbnf = grammar_from_json_schema(schema)
    # (only a reference can lead a rule back to itself: the converter's own rules never
    # do, and reading a big grammar costs a third of making it)
    looped = left_recursion(gbnf) if "$ref" in (text or json.dumps(schema)) else None
    if looped is not None:  # (llama.cpp's refusal came only on the engine thread, in words
        # that named response_format wherever the schema came from)
        raise InvalidRequestError(
            f"the schema refers back to itself before any of its value is written (grammar "
            f"rule '{looped}'): no grammar can follow that (llama.cpp refuses left "
            "recursion)", param="response_format")
    grammar_limits(gbnf, "the grammar made from the schema", rules=MAX_SCHEMA_GRAMMAR_RULES,
                   alternatives=MAX_SCHEMA_GRAMMAR_ALTERNATIVES)
    # (after the limits: the top's copies of an anyOf's alternatives are not live beside the
    # originals, which they would count twice)
    return without_trailing_space(gbnf)


def grammar_limits(gbnf: str, param: str, rules: int = MAX_GRAMMAR_RULES,
                   alternatives: int = MAX_GRAMMAR_ALTERNATIVES) -> None:
    """400 for a client's GBNF with more than ``rules`` rules, groups nested deeper than
    ``MAX_GRAMMAR_NESTING`` or more than ``alternatives`` ``|`` (counted outside string
    literals and character classes). llama.cpp turns each group into
    a rule and follows rule references by recursion, so the first two bound its stack (4,096
    chained rules around 1,024 nested groups parse and sample; 100,000 of either crashed);
    the grammar's mask costs about its live alternatives times the vocabulary, on the engine
    thread, so the third bounds what one request makes every other wait (5,000 choices: 2 s
    a token)."""
    # (outside literals, classes and comments: a quote in a comment hid a 30,000-deep
    # grammar from these limits, and it killed the server)
    text = GBNF_TEXT.sub(" ", gbnf)
    # Each rule has its one "::=" (counted by line starts, rules apart by "\r" went uncounted)
    n_rules = text.count("::=")
    if n_rules > rules:
        raise InvalidRequestError(f"{param}: {n_rules} rules; at most {rules}", param=param)
    structure = np.frombuffer(text.encode(), dtype=np.uint8)
    found = int(np.count_nonzero(structure == ord("|")))
    if found > alternatives:
        raise InvalidRequestError(f"{param}: {found} alternatives ('|'); at most "
                                  f"{alternatives}", param=param)
    depth = np.cumsum((structure == ord("(")).astype(np.int64)
                      - (structure == ord(")")).astype(np.int64))
    deepest = int(depth.max()) if depth.size else 0
    if deepest > MAX_GRAMMAR_NESTING:
        raise InvalidRequestError(f"{param}: groups nested {deepest} deep; at most "
                                  f"{MAX_GRAMMAR_NESTING}", param=param)
