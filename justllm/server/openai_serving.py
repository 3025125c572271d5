"""Chat and text completions: OpenAI request -> engine requests -> OpenAI response or SSE stream.

Route handlers stay thin; this object holds what serving needs (engine, model id, chat template,
metrics) and lives in the app's state, built by ``create_app``.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import string
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeVar, cast

import msgspec

from justllm.core.harmony import THINKING as HARMONY_THINKING
from justllm.core.reasoning import (
    EFFORT_VARIABLE,
    REASONING_FORMATS,
    THINKING_SWITCH,
    opens_thinking,
)
from justllm.core.record import RequestOrigin
from justllm.core.sampling_params import MAX_LOGPROBS, SamplingParams
from justllm.engine.async_engine import (
    MAX_SCHEMA_GRAMMAR_ALTERNATIVES,
    MAX_SCHEMA_GRAMMAR_RULES,
    AsyncEngine,
    RequestStream,
    grammar_limits,
)
from justllm.engine.chat_template import ChatTemplate, template_globals, with_template_stops
from justllm.engine.engine import Handover, PreparedRequest, RequestOutput, TokenLogprob
from justllm.errors import (
    EngineClosedError,
    GrammarDeadEndError,
    HandoverError,
    InvalidRequestError,
)
from justllm.server.code_prompt import code_prompt
from justllm.server.errors import APIError, error_body
from justllm.server.json_schema import check_strict
from justllm.server.lora import adapter, request_lora
from justllm.server.metrics import ServerMetrics, failed
from justllm.server.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionChunkWithUsage,
    ChatCompletionRequest,
    ChatDelta,
    ChatMessage,
    CompletionChoice,
    CompletionRequest,
    ContentPart,
    FunctionCallDelta,
    FunctionCallOut,
    TextCompletion,
    TextCompletionWithUsage,
    ToolCallDelta,
    ToolCallOut,
    Usage,
)
from justllm.server.structured import requested, structured_grammar
from justllm.server.tools.answer import (
    ChatEvent,
    ChatResult,
    ChoiceEnd,
    ChoiceResult,
    ChoiceText,
    StreamEnd,
    StreamError,
    TextDelta,
    Thinking,
    Timings,
    ToolCall,
    ToolCallArguments,
    ToolCallStart,
)
from justllm.server.tools.grammar import (
    NO_PARAMETERS,
    call_or_answer_grammar,
    call_schema,
    call_triggers,
    named_args_grammar,
    section_calls_grammar,
    wrap_call_grammar,
)
from justllm.server.tools.harmony_grammar import CALL_TRIGGERS as HARMONY_CALL_TRIGGERS
from justllm.server.tools.harmony_grammar import answer_grammar
from justllm.server.tools.harmony_grammar import call_grammar as harmony_call_grammar
from justllm.server.tools.parse import SECTIONS, XML_FORMATS, ParsedCall
from justllm.server.tools.request import (
    ToolPlan,
    check_tool_messages,
    message_dict,
    tool_plan,
)
from justllm.server.tools.stream import CallDelta, CallOpened
from justllm.server.tools.xml_grammar import unheld_keyword, xml_call_grammar

_json = msgspec.json.Encoder()
log = logging.getLogger(__name__)
MAX_REQUEST_STOP = 16  # stop strings a request may send; a chat template adds its own
# (SamplingParams' MAX_STOP bounds the sum)

# /v1/completions' max_tokens when a request gives none (OpenAI's default).
COMPLETION_MAX_TOKENS = 16

# OpenAI request fields justllm does not implement, with the values that mean "off" (accepted)
# and why any other value is refused: every accepted field is honoured, none ignored.
_UNSUPPORTED: dict[str, tuple[tuple[object, ...], str]] = {
    "functions": ((None, []), "the deprecated functions field is not supported: send tools"),
    "function_call": ((None, "none"), "the deprecated function_call field is not supported: "
                                      "send tool_choice"),
    "modalities": ((None, ["text"]), "this server only produces text"),
    "audio": ((None,), "this server only produces text"),
    "prediction": ((None,), "predicted outputs are not supported"),
    "web_search_options": ((None,), "web search is not supported"),
    "store": ((None, False), "completions are not stored"),
    "metadata": ((None, {}), "metadata is only kept with stored completions, and none are"),
    "service_tier": ((None, "auto", "default"), "there is one service tier"),
    "verbosity": ((None, "medium"), "this server has no verbosity control"),
    "skip_special_tokens": ((None, True), "control tokens are always left out of the text "
                                          "(as llama.cpp writes tokens)"),
}
# What the server itself gives a chat template, and what jinja2 means by ``self`` (the
# template) and ``loop`` (a for loop's state): a client's chat_template_kwargs may not set it.
_TEMPLATE_OWN = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token",
                           "tools", "parallel_tool_calls", "continue_final", "self", "loop"})


Job = tuple[str | list[int], SamplingParams]  # one choice: its prompt and sampling
T = TypeVar("T")


@dataclass(frozen=True)
class ServingLimits:
    max_n: int = 16


def sse(payload: object) -> bytes:
    return b"data: " + _json.encode(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
_ALNUM = string.ascii_letters + string.digits


def error_status(code: str | None) -> int:
    """The HTTP status of a request the engine ended with an error ``code``: 400 when it was
    the request's own fault (its grammar), else 500."""
    return 400 if code == GrammarDeadEndError.code else 500


def error_type(code: str | None) -> str:
    """OpenAI's error type for an engine error ``code`` (an in-stream error event's)."""
    return "invalid_request_error" if error_status(code) < 500 else "server_error"


def check_model(name: str | None, model_id: str) -> None:
    """404 in OpenAI's shape unless ``name`` is the served model (None: the served one), or
    its ``NAME:latest``, the tag Ollama clients add (``ollama list`` shows it; a router
    takes it, and a single server answered 404)."""
    if name is not None and name != model_id and name != f"{model_id}:latest":
        raise APIError(404, f"the model '{name}' does not exist; this server serves "
                            f"'{model_id}'", type="not_found_error", param="model",
                       code="model_not_found")


class OpenAIServing:
    def __init__(self, aengine: AsyncEngine, model_id: str, template: ChatTemplate,
                 metrics: ServerMetrics, limits: ServingLimits) -> None:
        self.aengine = aengine
        self.model_id = model_id
        self.template = template
        self.metrics = metrics
        self.limits = limits
        self._piece = aengine.token_bytes

    # ---- shared -----------------------------------------------------------------------------

    def check_model(self, name: str | None) -> None:
        """The served model, or one of its LoRA adapters (server/lora.py)."""
        if adapter(self.aengine, name) is None:
            check_model(name, self.model_id)

    def answer_model(self, name: str | None) -> str:
        """The ``model`` an answer names: the adapter the request named as its model (as vLLM
        answers), else the served model."""
        return name if name and adapter(self.aengine, name) is not None else self.model_id

    def answered_as(self, origin: RequestOrigin | None, name: str | None) -> RequestOrigin:
        """``origin`` with the model the answer names (``answer_model``): the record's."""
        return replace(origin or RequestOrigin(), model=self.answer_model(name))

    @staticmethod
    def check_supported(req: msgspec.Struct) -> None:
        """400 for an OpenAI field set to a value justllm would otherwise have to ignore."""
        for name in req.__struct_fields__:
            rule = _UNSUPPORTED.get(name)
            if rule is not None and getattr(req, name) not in rule[0]:
                raise InvalidRequestError(f"{name}: {rule[1]}", param=name)
        best_of = getattr(req, "best_of", None)
        if best_of is not None and best_of != getattr(req, "n", 1):
            raise InvalidRequestError("best_of: only best_of = n is supported (no server-side "
                                      "ranking of extra choices)", param="best_of")

    def _params(self, req: ChatCompletionRequest | CompletionRequest, max_tokens: int | None,
                logprobs: int | None, n_index: int, template: ChatTemplate | None = None,
                prompt_logprobs: int | None = None) -> SamplingParams:
        if not 1 <= req.n <= self.limits.max_n:
            raise InvalidRequestError(f"n must be between 1 and {self.limits.max_n}", param="n")
        _check_generates(max_tokens, prompt_logprobs)
        seed = (req.seed + n_index) % 2**64 if req.seed is not None else None
        fields = self._sampling_fields(req, max_tokens)
        stop = fields.pop("stop")
        return SamplingParams(
            **fields, seed=seed, stop=with_template_stops(stop, template) if template else stop,
            stop_token_ids=self._stop_token_ids(req.stop_token_ids), logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            lora=request_lora(self.aengine, req.model, req.lora))

    @staticmethod
    def _sampling_fields(req: ChatCompletionRequest | CompletionRequest,
                         max_tokens: int | None) -> dict[str, Any]:
        """The SamplingParams values a request gives that need no model: router mode checks
        them before it loads one (a temperature of 500 started a runner, and under max-loaded
        evicted a busy model, for a 400)."""
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        if len(stop) > MAX_REQUEST_STOP:
            raise InvalidRequestError(f"at most {MAX_REQUEST_STOP} stop strings", param="stop")
        return dict(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            min_p=req.min_p or 0.0,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            **OpenAIServing._repeat(req),
            stop=stop, keep_stops=stop if req.include_stop_str_in_output else (),
            min_tokens=req.min_tokens or 0, ignore_eos=req.ignore_eos,
            logit_bias=tuple(_logit_bias(req.logit_bias).items()),
            spec_n_max=req.speculative_n_max, spec_p_min=req.speculative_p_min,
            priority=req.priority, cache_prompt=req.cache_prompt is not False)

    @staticmethod
    def check_extras(req: ChatCompletionRequest | CompletionRequest) -> None:
        """The checks of vLLM's and llama-server's extra fields that need no model (router
        mode runs them before a load; the route runs them all again)."""
        structured_grammar(None, req)
        max_tokens = one_value({"max_completion_tokens": getattr(req, "max_completion_tokens",
                                                                 None),
                                "max_tokens": req.max_tokens})
        if max_tokens is None and isinstance(req, CompletionRequest):
            max_tokens = COMPLETION_MAX_TOKENS  # (the route's default, which min_tokens meets)
        prompt_logprobs = (prompt_logprobs_of(req) if isinstance(req, CompletionRequest)
                           else req.prompt_logprobs)
        _check_generates(max_tokens, prompt_logprobs)
        SamplingParams(**OpenAIServing._sampling_fields(req, max_tokens),
                       prompt_logprobs=prompt_logprobs)
        if isinstance(req, CompletionRequest) and req.suffix:
            _check_suffix(req)

    @staticmethod
    def _repeat(req: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
        """llama.cpp's repeat_penalty (over the last 64 tokens), or vLLM's
        repetition_penalty: the same rule over the whole prompt and answer."""
        if req.repetition_penalty is None:
            return {"repeat_penalty": 1.0 if req.repeat_penalty is None else req.repeat_penalty}
        if req.repeat_penalty is not None:
            raise InvalidRequestError("repeat_penalty and repetition_penalty: give one (the "
                                      "last 64 tokens, or vLLM's whole sequence)",
                                      param="repetition_penalty")
        if not req.repetition_penalty > 0:
            raise InvalidRequestError("repetition_penalty must be a number > 0",
                                      param="repetition_penalty")
        return {"repeat_penalty": req.repetition_penalty, "repeat_last_n": 2**31 - 1}

    def _stop_token_ids(self, ids: list[int] | None) -> tuple[int, ...]:
        self.aengine.check_token_ids(ids or [], "stop_token_ids")
        return tuple(ids or ())

    def _prepare(self, jobs: list[Job], resume: Sequence[Handover] | None,
                 keep: int | None = None) -> list[PreparedRequest]:
        """Each choice tokenized, checked, its grammar compiled (``AsyncEngine.prepare``): the
        routes call this on a worker thread, with the rendering before it, in one hop (a hop
        costs ~0.2 ms), so the event loop never waits on it. ``resume``: each choice's first
        tokens, drawn by a PD prefill replica (server/pd.py); ``keep``: vLLM's
        ``truncate_prompt_tokens`` (only each prompt's last tokens are read)."""
        most = self.aengine.engine.config.max_queue
        if len(jobs) > most:  # it could never be queued: a 400, not a 429 to retry
            raise InvalidRequestError(f"this request asks for {len(jobs)} choices (its prompts "
                                      f"times n); the server queues at most {most} "
                                      "(--max-queue)", param="n")
        if resume is not None and len(resume) != len(jobs):
            raise HandoverError(f"the hand-over has {len(resume)} choice(s); the request "
                                f"asks for {len(jobs)}")
        if keep is not None:
            k = keep_last(keep, self.aengine.max_request_tokens)
            jobs = [((self.aengine.tokenize(p) if isinstance(p, str) else list(p))[-k:], params)
                    for p, params in jobs]
        resumes = list(resume) if resume is not None else [None] * len(jobs)
        return [self.aengine.prepare(prompt, params, r)
                for (prompt, params), r in zip(jobs, resumes)]

    def submit(self, prepared: list[PreparedRequest], rid: str | None = None,
               origin: RequestOrigin | None = None) -> list[RequestStream]:
        """Queue every choice, or none: if one is refused the others are aborted. ``rid``:
        the API's response id, which the engine's requests take (``RID`` for one choice,
        ``RID-0``, ``RID-1``... for several), so records and logs name what clients see;
        ``origin``: what the route knew of the request, for the records."""
        streams: list[RequestStream] = []
        ids = ([rid] if len(prepared) == 1 else [f"{rid}-{i}" for i in range(len(prepared))]
               if rid else [None] * len(prepared))
        try:
            for ready, request_id in zip(prepared, ids):
                streams.append(self.aengine.submit(ready, None, request_id,
                                                   resume=ready.resume, origin=origin))
        except BaseException:
            for s in streams:
                s.abort()
            raise
        return streams

    async def merged(self, streams: list[RequestStream], stopped: set[int] | None = None
                     ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """Outputs of all choices as they come, tagged with the choice index. Closing this
        iterator (client gone, task cancelled) aborts every unfinished choice. ``stopped``:
        the choices the caller ended itself (it aborts their streams and adds them here, as
        they come), which count as finished by their length."""
        queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()
        stopped = set() if stopped is None else stopped
        last: dict[int, RequestOutput] = {}

        async def pump(i: int, s: RequestStream) -> None:
            async for out in s:
                queue.put_nowait((i, out))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        ended: set[int] = set()  # choices whose last output was taken (and counted)
        timed: set[int] = set()  # choices whose first token was counted
        try:
            while len(ended) < len(streams):
                i, out = await queue.get()
                if i not in timed and self.metrics.observe_first_token(out.metrics):
                    timed.add(i)
                if out.finished:
                    ended.add(i)
                    self.metrics.observe_finished(out.metrics, out.finish_reason, failed(out))
                last[i] = out
                yield i, out
                for j in stopped - ended:  # ended with its last token so far
                    ended.add(j)
                    m = last[j].metrics
                    self.metrics.observe_finished(m, "length", False, end=m.token_times[-1]
                                                  if m.token_times else time.perf_counter())
        finally:
            for t in tasks:
                t.cancel()
            for i, s in enumerate(streams):
                if i not in ended:  # the client left before this choice ended
                    self.metrics.observe_aborted(s.arrival, last[i].metrics if i in last
                                                 else None)
                s.abort()

    async def _collect(self, streams: list[RequestStream], texts: list[str],
                       prompts: list[RequestOutput | None] | None = None
                       ) -> tuple[list[str], list[list[TokenLogprob] | None], list[RequestOutput]]:
        """Every choice to its end (non-streaming): text after ``texts``, logprobs, last output
        (and in ``prompts``, when given, the output that carried its prompt's logprobs)."""
        texts = list(texts)
        lps: list[list[TokenLogprob] | None] = [None] * len(streams)
        finals: list[RequestOutput | None] = [None] * len(streams)
        async with aclosing(self.merged(streams)) as merged:
            async for i, out in merged:
                if out.error:
                    raise self.failure(out)
                texts[i] += out.text
                if out.logprobs is not None:
                    lps[i] = (lps[i] or []) + out.logprobs
                if prompts is not None and out.prompt_logprobs is not None:
                    prompts[i] = out
                if out.finished:
                    finals[i] = out
        return texts, lps, finals  # type: ignore[return-value]

    def failure(self, out: RequestOutput) -> Exception:
        """What a choice that ended with an error answers: 503 when a shutdown aborted it
        (retry later), else the error's own status."""
        assert out.error is not None
        if not self.aengine.accepting:
            return EngineClosedError(out.error)
        return APIError(error_status(out.error_code), out.error, type=error_type(out.error_code),
                        code=out.error_code)

    def _token_text(self, token: int) -> str:
        return self._piece(token).decode("utf-8", "replace")

    # ---- chat -------------------------------------------------------------------------------

    def chat_prompt(self, messages: list[ChatMessage], continue_final: bool = False,
                    kwargs: dict[str, Any] | None = None, constrained: str | None = None
                    ) -> str:
        """The prompt for ``messages`` without tools (``continue_final``: it ends inside the
        last, assistant, message, which the answer continues; ``kwargs``: template variables;
        ``constrained``: the field whose grammar holds the answer, see :meth:`_unbound`)."""
        return self._unbound(messages, ToolPlan(), continue_final, kwargs, True, constrained)

    def request_prompt(self, req: ChatCompletionRequest, generation_prompt: bool = True) -> str:
        """The prompt ``req`` is answered from, its tools included (what usage counts);
        without the assistant's opening when ``generation_prompt`` is False (/tokenize)."""
        plan = tool_plan(req)
        return self._prompt(req, plan, held_by(req, plan), generation_prompt)

    def _render(self, messages: list[ChatMessage], plan: ToolPlan,
                continue_final: bool = False, kwargs: dict[str, Any] | None = None,
                generation_prompt: bool = True) -> str:
        if not messages:
            raise InvalidRequestError("messages must not be empty", param="messages")
        plain = []
        for i, m in enumerate(messages):
            content = m.content
            if isinstance(content, list):
                content = "".join(_text_part(part, f"messages[{i}].content[{j}]")
                                  for j, part in enumerate(content))
            if m.refusal:
                content = f"{content}\n{m.refusal}" if content else m.refusal
            plain.append(message_dict(m, i, content or ""))
        taken = sorted((_TEMPLATE_OWN | template_globals()) & set(kwargs)) if kwargs else None
        if taken:
            raise InvalidRequestError(f"chat_template_kwargs: {', '.join(taken)}: the "
                                      "server's to set, or a name the template relies on",
                                      param="chat_template_kwargs")
        return self.template.render(plain, add_generation_prompt=generation_prompt,
                                    tools=plan.for_template(), parallel_tool_calls=plan.parallel,
                                    continue_final=continue_final, **(kwargs or {}))

    def _grammar(self, req: ChatCompletionRequest) -> str | None:
        fmt = req.response_format
        if fmt is not None and fmt.type != "json_schema" and fmt.json_schema is not None:
            raise InvalidRequestError(f"response_format.json_schema: only with type "
                                      f"'json_schema' (the type is '{fmt.type}')",
                                      param="response_format.json_schema")
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return self.aengine.json_grammar()
        if fmt.json_schema is None or fmt.json_schema.schema is None:
            raise InvalidRequestError("response_format json_schema needs json_schema.schema",
                                      param="response_format")
        if not fmt.json_schema.name or not _SCHEMA_NAME.fullmatch(fmt.json_schema.name):
            raise InvalidRequestError(  # OpenAI's rule (and vLLM's: the name is required)
                "response_format.json_schema.name: required, 1 to 64 letters, digits, '_' "
                "or '-'", param="response_format.json_schema.name")
        if fmt.json_schema.strict:
            check_strict(fmt.json_schema.schema, "response_format")
        try:
            return self.aengine.json_grammar(fmt.json_schema.schema)
        except InvalidRequestError as e:
            raise InvalidRequestError(str(e), param=SCHEMA_PARAM) from None

    def _tool_grammar(self, plan: ToolPlan) -> str:
        """GBNF that admits only calls of the plan's callable functions, in the template's
        format, with arguments that follow each function's schema."""
        fmt = self.template.tool_format
        parallel = plan.parallel and plan.mode != "named"
        try:
            if self.template.harmony:  # a message to the function (one call a turn)
                return _within_schema_limits(harmony_call_grammar(
                    [(f.name, self.aengine.json_grammar(f.parameters or NO_PARAMETERS))
                     for f in plan.callable()]))
            if fmt in XML_FORMATS:  # Qwen3-Coder's and GLM's: each value held apart
                return _within_schema_limits(xml_call_grammar(
                    fmt, [(f.name, f.parameters) for f in plan.callable()],
                    self.aengine.json_grammar, parallel, self.template.compact_tool_calls))
            if fmt in SECTIONS:  # Kimi K2's, DeepSeek V3.1's
                return _within_schema_limits(section_calls_grammar(
                    fmt, [(f.name, self.aengine.json_grammar(f.parameters or NO_PARAMETERS))
                          for f in plan.callable()], parallel))
            if self.template.names_call_arguments:  # Mistral's [TOOL_CALLS]name[ARGS]{..}
                return _within_schema_limits(named_args_grammar(
                    [(f.name, self.aengine.json_grammar(f.parameters or NO_PARAMETERS))
                     for f in plan.callable()], parallel))
            gbnf = self.aengine.json_grammar(
                call_schema([(f.name, f.parameters) for f in plan.callable()], fmt))
        except InvalidRequestError as e:
            raise InvalidRequestError(str(e), param="tools") from None
        return wrap_call_grammar(gbnf, fmt, parallel)

    def _held_grammar(self, req: ChatCompletionRequest, plan: ToolPlan
                      ) -> tuple[str | None, tuple[str, ...]]:
        """The grammar that holds ``req``'s answer (a forced call, a response format or a
        structured-output extra, a call or an answer in the format), or under
        ``tool_choice: "auto"`` a lazy grammar and its triggers (:meth:`_lazy_tool_grammar`).
        A gpt-oss answer is held in its harmony messages (tools/harmony_grammar.py), but
        for a continued final message, which the format's grammar holds alone."""
        extra = structured_grammar(self.aengine, req)
        if extra is not None and plan.active:
            raise InvalidRequestError(f"tools and {extra[1]}: give one way to constrain the "
                                      "answer (or tool_choice: none)", param=extra[1])
        calls = self._tool_grammar(plan) if plan.enforced else None
        answer = None if plan.enforced else self._grammar(req)
        if extra is not None:
            if answer is not None:
                raise InvalidRequestError(f"response_format and {extra[1]}: give one way to "
                                          "constrain the answer", param=extra[1])
            answer = extra[0]
        if plan.mode == "auto" and answer is not None:  # a call, or an answer in the format
            calls = self._tool_grammar(plan)
        if calls is None and answer is None:
            if plan.mode == "auto" and not req.min_tokens:
                return self._lazy_tool_grammar(plan)
            return None, ()
        if calls is None:
            assert answer is not None
            return self.held_answer(answer, req.continue_final_message), ()
        if self.template.harmony and not req.continue_final_message:
            return _within_schema_limits(answer_grammar(calls, answer)), ()
        if answer is not None:
            return _within_schema_limits(call_or_answer_grammar(calls, answer)), ()
        return calls, ()

    def held_answer(self, grammar: str, continue_final: bool = False) -> str:
        """``grammar`` (a format's) as it holds a chat answer: a gpt-oss answer's final
        message's body, after analysis as free as unheld (tools/harmony_grammar.py), but in a
        continued final message; any other model's answer whole. Ollama's routes ask too."""
        if self.template.harmony and not continue_final:
            return _within_schema_limits(answer_grammar(None, grammar))
        return grammar

    def _lazy_tool_grammar(self, plan: ToolPlan) -> tuple[str | None, tuple[str, ...]]:
        """Under ``tool_choice: "auto"``: the call grammar and where it takes hold (a call's
        marker), so that a call the model starts is one of the tools with valid arguments,
        as llama-server's lazy grammars make it; (None, ()) for a family left free, and for
        gpt-oss at a message to a function (its calls are harmony messages: the grammar is
        tools/harmony_grammar.py's). A model that thinks has its triggers
        counted only after its thinking (which may name the marker: the request's
        ``thinking_tags``). Not with vLLM's ``min_tokens`` (the caller's check): a grammar
        ends the answer with its call."""
        if self.template.harmony:
            return self._tool_grammar(plan), HARMONY_CALL_TRIGGERS
        fmt = self.template.tool_format
        triggers = call_triggers(fmt, plan.parallel)
        if not triggers or fmt in XML_FORMATS and any(
                unheld_keyword(fmt, f.parameters) for f in plan.callable()):
            return None, ()  # (an XML call of such a tool is left free: its grammar refuses it)
        return self._tool_grammar(plan), triggers

    def _chat_logprobs(self, lps: list[TokenLogprob] | None) -> dict | None:
        if lps is None:
            return None
        return {"content": [self._chat_logprob(lp) for lp in lps]}

    def _chat_logprob(self, lp: TokenLogprob) -> dict:
        def entry(token: int, value: float) -> dict:
            piece = self._piece(token)
            return {"token": piece.decode("utf-8", "replace"), "logprob": value,
                    "bytes": list(piece)}
        return {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}

    def chat_jobs(self, req: ChatCompletionRequest) -> tuple[list[Job], ToolPlan]:
        """Check ``req`` and render it: each choice's prompt and sampling, and its tool plan."""
        self.check_model(req.model)
        self.check_supported(req)
        plan = tool_plan(req)
        check_tool_messages(req.messages)
        grammar, triggers = self._held_grammar(req, plan)
        prompt = self._prompt(req, plan, constrained=held_by(req, plan))
        tags = self.template.thinking_tags if triggers else None
        top = req.top_logprobs
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise InvalidRequestError(f"top_logprobs must be in [0, {MAX_LOGPROBS}]",
                                      param="top_logprobs")
        logprobs = (top or 0) if req.logprobs else None
        max_tokens = one_value({"max_completion_tokens": req.max_completion_tokens,
                                "max_tokens": req.max_tokens})
        own = self._own_thinking_budget(req)
        return [(prompt, self.budgeted(
            replace(self._params(req, max_tokens, logprobs, i, self.template,
                                 req.prompt_logprobs), grammar=grammar,
                    grammar_triggers=triggers, thinking_tags=tags,
                    thinking_open=tags is not None and opens_thinking(prompt, tags)),
            prompt, own, req.reasoning_budget_message)) for i in range(req.n)], plan

    def _prompt(self, req: ChatCompletionRequest, plan: ToolPlan,
                constrained: str | None = None, generation_prompt: bool = True) -> str:
        """``req``'s prompt (``constrained``: the field whose grammar holds the answer)."""
        return self._unbound(req.messages, plan, req.continue_final_message,
                             self._template_kwargs(req), generation_prompt, constrained)

    def _template_kwargs(self, req: ChatCompletionRequest) -> dict[str, Any] | None:
        """``chat_template_kwargs`` with ``reasoning_effort`` as llama-server reads it:
        "none" is ``enable_thinking`` false, a level is the template's ``reasoning_effort``.
        Either needs a template that takes it (else a 400: not honoured, not ignored)."""
        kwargs = req.chat_template_kwargs
        effort = req.reasoning_effort
        if effort is None:
            return kwargs
        value: object = effort
        if effort == "none" and not self.template.thinks:
            return kwargs  # a model that does not think: honoured as it is
        if effort == "none":
            name, value, why = THINKING_SWITCH, False, "switch its thinking off"
        else:
            name, why = EFFORT_VARIABLE, "take a reasoning effort"
        if name not in self.template.source:
            raise InvalidRequestError(f"reasoning_effort: this model's chat template cannot "
                                      f"{why}", param="reasoning_effort")
        if name in (kwargs or {}) and (kwargs or {})[name] != value:
            raise InvalidRequestError(f"reasoning_effort and chat_template_kwargs.{name} "
                                      "disagree", param="reasoning_effort")
        return {**(kwargs or {}), name: value}

    @staticmethod
    def _own_thinking_budget(req: ChatCompletionRequest) -> int | None:
        """The budget ``req`` asks for under either of llama-server's names (None: none)."""
        return one_value({"reasoning_budget_tokens": req.reasoning_budget_tokens,
                          "thinking_budget_tokens": req.thinking_budget_tokens})

    def budgeted(self, params: SamplingParams, prompt: str, own: int | None = None,
                 message: str | None = None) -> SamplingParams:
        """``params`` held to the thinking budget that holds for ``prompt``: a request's
        ``own`` (-1: none), else the server's ``--reasoning-budget``, for a model that thinks
        and an answer no grammar holds; with the text forced before the end tag (a request's
        ``message``, else the server's ``--reasoning-budget-message``). Every API's chat
        route and Ollama's ask here."""
        tags = self.template.budget_tags
        # (a lazy grammar holds only a call after the thinking: the budget is the thinking's)
        constrained = params.grammar is not None and not params.grammar_triggers
        if own is not None and own >= 0 and tags is None:
            raise InvalidRequestError("a thinking budget needs a model that thinks (its chat "
                                      "template writes no thinking tags)",
                                      param="reasoning_budget_tokens")
        if own is not None and own >= 0 and constrained:
            raise InvalidRequestError("a thinking budget cannot be combined with a format the "
                                      "answer is held to (response_format, a required tool "
                                      "call, structured outputs)",
                                      param="reasoning_budget_tokens")
        config = self.aengine.engine.config
        budget = (own if own is not None
                  else -1 if constrained or tags is None else config.reasoning_budget)
        if message is not None and budget < 0:
            raise InvalidRequestError("reasoning_budget_message needs a thinking budget "
                                      "(reasoning_budget_tokens, or the server's "
                                      "--reasoning-budget)", param="reasoning_budget_message")
        if budget < 0 or tags is None:
            return params
        return replace(params, thinking_budget=budget, thinking_tags=tags,
                       thinking_open=opens_thinking(prompt, tags),
                       thinking_message=config.reasoning_budget_message if message is None
                       else message)

    def _unbound(self, messages: list[ChatMessage], plan: ToolPlan, continue_final: bool,
                 kwargs: dict[str, Any] | None, generation_prompt: bool,
                 constrained: str | None) -> str:
        """The prompt, rendered so that a grammar (from the field ``constrained`` names) does
        not bind a reasoning model's thinking: a prompt that would open the thinking is
        rendered with the thinking switched off, where the template has the switch and the
        request did not choose; else it is a 400, naming the switch the request turned on, or
        where the template has none, the field that holds the answer."""
        tags = self.template.thinking_tags
        prompt = self._render(messages, plan, continue_final, kwargs, generation_prompt)
        if not (constrained and tags and opens_thinking(prompt, tags)):
            return prompt
        if self.template.thinking_switch and THINKING_SWITCH not in (kwargs or {}):
            prompt = self._render(messages, plan, continue_final,
                                  {**(kwargs or {}), THINKING_SWITCH: False}, generation_prompt)
            if not opens_thinking(prompt, tags):
                return prompt
        if not self.template.thinking_switch:  # (no field of any API turns it off)
            raise InvalidRequestError(
                f"{constrained}: this model thinks before it answers and its chat template "
                "has no switch to turn that off, so an answer held to a format (a response "
                "format, a required tool call, structured outputs) cannot hold its thinking: "
                "send no constraint", param=constrained)
        raise InvalidRequestError(
            "this model thinks before it answers, and an answer held to a format "
            "(response_format, a required tool call, structured outputs) cannot hold its "
            f"thinking: send chat_template_kwargs {{\"{THINKING_SWITCH}\": false}}, or no "
            "constraint", param="chat_template_kwargs")

    def reasoning_format(self, req: ChatCompletionRequest) -> str:
        """How ``req``'s thinking is returned: its own ``reasoning_format``, else the
        server's (``--reasoning-format``)."""
        fmt = req.reasoning_format or self.aengine.engine.config.reasoning_format
        if fmt not in REASONING_FORMATS:
            raise InvalidRequestError(f"reasoning_format must be one of "
                                      f"{', '.join(REASONING_FORMATS)}", param="reasoning_format")
        return fmt

    def opening(self, req: ChatCompletionRequest, prompt: str) -> str:
        """What a thinking left in the text (``reasoning_format: none``) begins with when the
        prompt opened it: the prompt's start tag and what follows it (``<think>\n``), as
        llama-server writes it, so that the text holds the whole thinking, tags and all."""
        tags = self.template.thinking_tags
        if tags is None or self.reasoning_format(req) != "none" or not opens_thinking(
                prompt, tags):
            return ""
        return prompt[prompt.rindex(tags[0]):]

    def thinking(self, req: ChatCompletionRequest, prompt: str) -> Thinking | None:
        """How an answer to ``prompt`` is taken apart: None when the model does not think or
        ``req`` keeps the thinking in the text."""
        tags = self.template.thinking_tags
        if self.reasoning_format(req) == "none":
            return None
        if self.template.harmony:
            return Thinking(HARMONY_THINKING)
        if tags is None:
            return None
        return Thinking(tags, opens_thinking(prompt, tags))

    async def _start_chat(self, req: ChatCompletionRequest, rid: str | None = None,
                          resume: Sequence[Handover] | None = None,
                          origin: RequestOrigin | None = None
                          ) -> tuple[list[RequestStream], list[ChoiceText]]:
        """Check ``req``, render it (on a worker thread: a long conversation is megabytes of
        template), submit its choices (as ``rid``, the response id); their streams and text
        handlers."""
        def ready() -> tuple[ToolPlan, list[PreparedRequest], Thinking | None, str]:
            jobs, plan = self.chat_jobs(req)
            prompt = str(jobs[0][0])
            try:
                return (plan, self._prepare(jobs, resume, req.truncate_prompt_tokens),
                        self.thinking(req, prompt),
                        self.opening(req, prompt))
            except InvalidRequestError as e:  # the engine compiles the grammar
                if plan.enforced and e.param == "response_format":
                    raise InvalidRequestError(str(e), param="tools") from None
                raise

        plan, prepared, thinking, opening = await self.aengine.off_loop(text_size(req), ready)
        streams = self.submit(prepared, rid, self.answered_as(origin, req.model))
        # After a transcript's "Assistant:" the model writes the separating space itself;
        # within a continued message, a space it writes is the answer's own.
        fmt = self.template.tool_format if plan.active else None
        lstrip = self.template.name == "transcript" and not req.continue_final_message
        texts = [ChoiceText(lstrip=lstrip, fmt=fmt, names=plan.names,
                            parallel=plan.parallel, thinking=thinking, prefix=opening,
                            harmony=self.template.harmony,
                            schemas={f.name: f.parameters for f in plan.functions})
                 for _ in streams]
        return streams, texts

    def _call_id(self) -> str:
        if self.template.tool_format == "mistral":  # its templates insist on 9 alphanumerics
            return "".join(secrets.choice(_ALNUM) for _ in range(9))
        return f"call_{uuid.uuid4().hex[:24]}"

    def _call(self, call: ParsedCall) -> ToolCall:
        return ToolCall(self._call_id(), call.name, call.arguments)

    def _call_events(self, index: int, deltas: list[CallDelta]
                     ) -> Iterator[ToolCallStart | ToolCallArguments]:
        """Choice ``index``'s calls' news as events: a call's start (its id made here), then
        pieces of its arguments."""
        for d in deltas:
            if isinstance(d, CallOpened):
                yield ToolCallStart(index, d.call_index, self._call_id(), d.name)
            else:
                yield ToolCallArguments(index, d.call_index, d.arguments)

    async def chat_result(self, req: ChatCompletionRequest, rid: str | None = None,
                          resume: Sequence[Handover] | None = None,
                          origin: RequestOrigin | None = None) -> ChatResult:
        """``req`` answered whole (``req.stream`` is not read). Request errors raise before
        anything runs. ``rid``: the response id (the engine's request ids follow it)."""
        streams, answers = await self._start_chat(req, rid, resume, origin)
        prompts: list[RequestOutput | None] = [None] * len(streams)
        texts, lps, finals = await self._collect(streams, [""] * len(streams), prompts)
        choices = []
        thoughts = []
        for i, (answer, final) in enumerate(zip(answers, finals)):
            thought, parsed = answer.whole(texts[i], final is not None and final.held)
            thoughts.append(thought or "")
            calls = tuple(self._call(c) for c in parsed.calls)
            choices.append(ChoiceResult(
                i, parsed.content if parsed.content or not calls else None, calls,
                "tool_calls" if parsed.called else final.finish_reason if final else None,
                lps[i], None if parsed.called or final is None else final.stop, thought))
        return ChatResult(choices, self._with_reasoning(_usage(finals, req.n), thoughts),
                          _timings(finals), prompts[0])

    def _with_reasoning(self, usage: Usage, thoughts: list[str]) -> Usage:
        """``usage`` with OpenAI's ``completion_tokens_details.reasoning_tokens`` when the
        model thought: the thinking's text in tokens (the tokens it drew but for the blanks
        around it, and a text the tokenizer would split otherwise)."""
        if not any(thoughts):
            return usage
        n = sum(len(self.aengine.tokenize(t, add_special=False)) for t in thoughts if t)
        return msgspec.structs.replace(usage,
                                       completion_tokens_details={"reasoning_tokens": n})

    async def chat_events(self, req: ChatCompletionRequest, rid: str | None = None,
                          resume: Sequence[Handover] | None = None,
                          origin: RequestOrigin | None = None
                          ) -> AsyncGenerator[ChatEvent, None]:
        """``req`` answered as a stream of events (``req.stream`` is not read). Request errors
        raise here, before anything is streamed; closing the iterator aborts the request."""
        return (await self.counted_chat_events(req, rid, resume, origin))[0]

    async def counted_chat_events(self, req: ChatCompletionRequest, rid: str | None = None,
                                  resume: Sequence[Handover] | None = None,
                                  origin: RequestOrigin | None = None
                                  ) -> tuple[AsyncGenerator[ChatEvent, None], int]:
        """:meth:`chat_events` and the prompt's length in tokens, known before the first event
        (what Anthropic's ``message_start`` reports) without tokenizing it again."""
        streams, answers = await self._start_chat(req, rid, resume, origin)
        return self._events(streams, answers, req.n), streams[0].prompt_tokens

    async def _events(self, streams: list[RequestStream], answers: list[ChoiceText], n: int
                      ) -> AsyncGenerator[ChatEvent, None]:
        finals: list[RequestOutput | None] = [None] * len(streams)
        thoughts = [""] * len(streams)
        async with aclosing(self.merged(streams)) as merged:
            async for i, out in merged:
                if out.error:
                    yield StreamError(out.error, out.error_code if self.aengine.accepting
                                      else "shutting_down")
                    return
                answer = answers[i]
                thought, text = answer.feed(out.text, out.held)
                thoughts[i] += thought
                if text or thought or out.logprobs:
                    yield TextDelta(i, text, out.logprobs, thought)
                for ev in self._call_events(i, answer.deltas()):
                    yield ev
                if out.finished:
                    finals[i] = out
                    thought, rest, parsed = answer.finish()
                    thoughts[i] += thought
                    if rest or thought:
                        yield TextDelta(i, rest, reasoning=thought)
                    for ev in self._call_events(i, answer.deltas()):
                        yield ev
                    if parsed is not None and parsed.called:
                        yield ChoiceEnd(i, "tool_calls")
                    else:
                        yield ChoiceEnd(i, out.finish_reason or "stop", out.stop)
        yield StreamEnd(self._with_reasoning(_usage(finals, n), thoughts), _timings(finals))

    async def chat(self, req: ChatCompletionRequest, resume: Sequence[Handover] | None = None,
                   origin: RequestOrigin | None = None) -> ChatCompletion | AsyncIterator[bytes]:
        """The OpenAI route: a ``ChatCompletion``, or SSE bytes when ``req.stream``.
        ``resume``: each choice's first tokens, drawn by a PD prefill replica; ``origin``:
        what the HTTP request says for the records (server/app.py's ``origin``: the client's
        trace context, its ``X-Request-Id``, logged beside the response id)."""
        check_chat_request(req)
        origin = origin or RequestOrigin("openai.chat", bool(req.stream))
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        log.info("%s: %d choice(s), stream=%s, user=%s, x-request-id=%s", rid, req.n,
                 req.stream, end_user(req.user, req.safety_identifier), origin.http_request_id)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            events = await self.chat_events(req, rid, resume, origin)
            return self._chat_sse(events, rid, created, req.n, include_usage,
                                  self.answer_model(req.model))
        result = await self.chat_result(req, rid, resume, origin)
        choices = [ChatChoice(c.index, AssistantMessage("assistant", c.content, [
            ToolCallOut(t.id, "function", FunctionCallOut(t.name, t.arguments))
            for t in c.tool_calls] or None, c.reasoning), self._chat_logprobs(c.logprobs),
            c.finish_reason)
            for c in result.choices]
        plp = (None if req.prompt_logprobs is None
               else self._vllm_prompt_logprobs(result.prompt, req.prompt_logprobs))
        return ChatCompletion(rid, "chat.completion", created, self.answer_model(req.model),
                              choices, result.usage, prompt_logprobs=plp)

    async def _chat_sse(self, events: AsyncGenerator[ChatEvent, None], rid: str, created: int, n: int,
                        include_usage: bool, model: str) -> AsyncIterator[bytes]:
        shape = ChatCompletionChunkWithUsage if include_usage else ChatCompletionChunk

        def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> bytes:
            return sse(shape(rid, "chat.completion.chunk", created, model, choices, usage))

        def delta(i: int, d: ChatDelta, lps: dict | None = None,
                  reason: str | None = None) -> bytes:
            return chunk([ChatChunkChoice(i, d, lps, reason)])

        for i in range(n):
            yield delta(i, ChatDelta(role="assistant", content=""))
        async with aclosing(events):
            async for ev in events:
                if isinstance(ev, TextDelta):
                    if ev.reasoning:  # the thinking comes before any text: its own chunk
                        yield delta(ev.index, ChatDelta(reasoning_content=ev.reasoning))
                    if ev.text or ev.logprobs or not ev.reasoning:
                        yield delta(ev.index, ChatDelta(content=ev.text or None),
                                    self._chat_logprobs(ev.logprobs))
                elif isinstance(ev, ToolCallStart):
                    yield delta(ev.index, ChatDelta(tool_calls=[ToolCallDelta(
                        ev.call_index, ev.id, "function", FunctionCallDelta(ev.name, ""))]))
                elif isinstance(ev, ToolCallArguments):
                    yield delta(ev.index, ChatDelta(tool_calls=[ToolCallDelta(
                        ev.call_index, function=FunctionCallDelta(arguments=ev.arguments))]))
                elif isinstance(ev, ChoiceEnd):
                    yield delta(ev.index, ChatDelta(), reason=ev.finish_reason)
                elif isinstance(ev, StreamEnd):
                    if include_usage:
                        yield chunk([], usage=ev.usage)
                else:
                    yield sse(error_body(ev.message, error_type(ev.code), code=ev.code))
        yield SSE_DONE

    # ---- text completions -----------------------------------------------------------------

    def _completion_prompts(self, prompt: object) -> list[str | list[int]]:
        return prompt_list(prompt, "prompt")

    def _completion_logprobs(self, lps: list[TokenLogprob] | None, offset: int) -> dict | None:
        if lps is None:
            return None
        tokens, values, tops, offsets = [], [], [], []
        for lp in lps:
            text = self._token_text(lp.token_id)
            tokens.append(text)
            values.append(lp.logprob)
            top = {self._token_text(t): v for t, v in lp.top}
            top.setdefault(text, lp.logprob)  # OpenAI's: the sampled token is always among them
            tops.append(top)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
                "text_offset": offsets}

    def _prompt_token_text(self, token: int) -> str:
        """A prompt token's text, control tokens as written (``<start_of_turn>``), as a prompt
        that holds them reads and as vLLM decodes them."""
        return self.aengine.token_bytes(token, special=True).decode("utf-8", "replace")

    def _echoed_logprobs(self, out: RequestOutput, n_top: int, answer: dict | None,
                         echo: str) -> dict:
        """OpenAI's echo with logprobs: the prompt's tokens first (the first with none: nothing
        comes before it), from offset 0, then ``answer``'s. The tokens' texts make up ``echo``
        (the prompt's text) but for a BOS the tokenizer added to a text prompt, written as
        nothing, and for a character split over byte tokens (each a replacement character)."""
        assert out.prompt_logprobs is not None and out.prompt_token_ids is not None
        tokens, values, tops, offsets = [], [], [], []
        offset = 0
        for i, (token, lp) in enumerate(zip(out.prompt_token_ids, out.prompt_logprobs)):
            text = self._prompt_token_text(token)
            if i == 0 and not echo.startswith(text):
                text = ""  # the BOS the tokenizer added: not in the prompt's text
            tokens.append(text)
            values.append(None if lp is None else lp.logprob)
            top = None
            if lp is not None:
                top = {self._prompt_token_text(t): v for t, v in lp.top[:n_top]}
                top.setdefault(text, lp.logprob)
            tops.append(top)
            offsets.append(offset)
            offset += len(text)
        prompt = {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
                  "text_offset": offsets}
        return {k: v + answer[k] for k, v in prompt.items()} if answer else prompt

    def _vllm_prompt_logprobs(self, out: RequestOutput | None, n_top: int
                              ) -> list[dict | None] | None:
        """vLLM's ``prompt_logprobs``: per prompt token (None for the first) the token and the
        ``n_top`` most likely ones, by id, with their logprob, rank and text."""
        if out is None or out.prompt_logprobs is None:
            return None

        def entry(token: int, value: float, rank: int | None) -> dict[str, Any]:
            return {"logprob": value, "rank": rank,
                    "decoded_token": self._prompt_token_text(token)}

        listed: list[dict | None] = []
        for lp in out.prompt_logprobs:
            if lp is None:
                listed.append(None)
                continue
            ranked = {str(lp.token_id): entry(lp.token_id, lp.logprob, lp.rank)}
            for r, (t, v) in enumerate(lp.top[:n_top], start=1):
                ranked.setdefault(str(t), entry(t, v, r))
            listed.append(ranked)
        return listed

    def completion_jobs(self, req: CompletionRequest) -> list[Job]:
        """Check ``req``: each choice's prompt and sampling (prompts times ``n``)."""
        self.check_model(req.model)
        self.check_supported(req)
        if req.logprobs is not None and not 0 <= req.logprobs <= 5:
            raise InvalidRequestError("logprobs must be in [0, 5]", param="logprobs")
        extra = structured_grammar(self.aengine, req)
        grammar = extra[0] if extra is not None else None
        max_tokens = req.max_tokens if req.max_tokens is not None else COMPLETION_MAX_TOKENS
        prompts = self._completion_prompts(req.prompt)
        if req.truncate_prompt_tokens is not None and (req.echo or req.suffix):
            raise InvalidRequestError("truncate_prompt_tokens: not with echo or suffix (the "
                                      "prompt they write back or fill in is the whole one)",
                                      param="truncate_prompt_tokens")
        if req.suffix:  # fill-in-the-middle: each prompt is the code before the gap
            _check_suffix(req)
            missing = self.aengine.fim_tokens().missing()
            if missing:
                raise InvalidRequestError(f"suffix: this model cannot fill in the middle: it "
                                          f"has no FIM {', '.join(missing)} token (a code "
                                          "model with FIM tokens can)", param="suffix")
            prompts = [code_prompt(self.aengine, cast(str, p), req.suffix, [], "", max_tokens)
                       for p in prompts]
        return [(p, replace(self._params(req, max_tokens, req.logprobs, j,
                                         prompt_logprobs=prompt_logprobs_of(req)),
                            grammar=grammar))
                for p in prompts for j in range(req.n)]

    async def completions(self, req: CompletionRequest, resume: Sequence[Handover] | None = None,
                          origin: RequestOrigin | None = None
                          ) -> TextCompletion | AsyncIterator[bytes]:
        """The OpenAI route; the other arguments as for ``chat``."""
        check_stream_options(req)
        def ready() -> tuple[list[Job], list[PreparedRequest]]:
            jobs = self.completion_jobs(req)
            return jobs, self._prepare(jobs, resume, req.truncate_prompt_tokens)

        jobs, prepared = await self.aengine.off_loop(text_size(req.prompt) * req.n, ready)
        shape = _CompletionShape(self, [self._echo_text(p) if req.echo else "" for p, _ in jobs],
                                 req.logprobs if req.echo else None, req.prompt_logprobs)
        rid = f"{shape.id_prefix}-{uuid.uuid4().hex}"
        origin = self.answered_as(
            origin or RequestOrigin("openai.completions", bool(req.stream)), req.model)
        streams = self.submit(prepared, rid, origin)
        return await self._respond(streams, shape, req, req.n, rid, origin.http_request_id)

    def _echo_text(self, prompt: str | list[int]) -> str:
        """The prompt as echoed: a token prompt's text with its control tokens written (as
        vLLM decodes it), so its tokens' texts make it up."""
        if isinstance(prompt, str):
            return prompt
        return b"".join(self.aengine.token_bytes(t, special=True) for t in prompt
                        ).decode("utf-8", "replace")

    # ---- the scaffold of text completions' full and streamed responses ---------------------

    async def _respond(self, streams: list[RequestStream], shape: _Shape,
                       req: CompletionRequest, n: int, rid: str, request_id: str | None
                       ) -> TextCompletion | AsyncIterator[bytes]:
        created, model = int(time.time()), self.answer_model(req.model)
        log.info("%s: %d choice(s), stream=%s, user=%s, x-request-id=%s", rid, len(streams),
                 req.stream, end_user(req.user, req.safety_identifier), request_id)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return self._stream(streams, shape, rid, created, include_usage, n, model)
        return await self._full(streams, shape, rid, created, n, model)

    async def _full(self, streams: list[RequestStream], shape: _Shape, rid: str, created: int,
                    n: int, model: str) -> TextCompletion:
        prompts: list[RequestOutput | None] = [None] * len(streams)
        texts, lps, finals = await self._collect(streams, shape.initial_texts(len(streams)),
                                                 prompts)
        choices = [shape.choice(i, texts[i], lps[i], finals[i], prompts[i])
                   for i in range(len(streams))]
        return shape.full(rid, created, model, choices, _usage(finals, n))

    async def _stream(self, streams: list[RequestStream], shape: _Shape, rid: str,
                      created: int, include_usage: bool, n: int,
                      model: str) -> AsyncIterator[bytes]:
        def chunk(choices: list, usage: Usage | None = None) -> bytes:
            return sse(shape.chunk(rid, created, model, choices, usage, include_usage))

        finals: list[RequestOutput | None] = [None] * len(streams)
        for i in range(len(streams)):
            opening = shape.opening(i)
            if opening is not None:
                yield chunk([opening])
        async with aclosing(self.merged(streams)) as merged:
            async for i, out in merged:
                if out.error:
                    closing = not self.aengine.accepting
                    code = "shutting_down" if closing else out.error_code
                    yield sse(error_body(out.error, error_type(code), code=code))
                    break
                delta = shape.delta(i, out)
                if delta is not None:
                    yield chunk([delta])
                if out.finished:
                    finals[i] = out
        if include_usage and all(finals):
            yield chunk([], usage=_usage(finals, n))
        yield SSE_DONE


class _Shape(Protocol):
    """How one route renders its choices; the scaffold (``_full``, ``_stream``) does the rest."""

    id_prefix: str

    def initial_texts(self, n: int) -> list[str]: ...
    def choice(self, i: int, text: str, lps: list[TokenLogprob] | None,
               final: RequestOutput | None, prompt: RequestOutput | None) -> Any: ...
    def opening(self, i: int) -> Any | None: ...
    def delta(self, i: int, out: RequestOutput) -> Any | None: ...
    def full(self, rid: str, created: int, model: str, choices: list,
             usage: Usage) -> Any: ...
    def chunk(self, rid: str, created: int, model: str, choices: list,
              usage: Usage | None, with_usage: bool) -> Any: ...


class _CompletionShape:
    id_prefix = "cmpl"

    def __init__(self, serving: OpenAIServing, echoes: list[str], echo_logprobs: int | None,
                 prompt_logprobs: int | None) -> None:
        """``echo_logprobs``: with echo, ``logprobs`` (the prompt's tokens come first in each
        choice's logprobs); ``prompt_logprobs``: vLLM's field. With either, a stream's echo
        waits for the first delta, which carries the prompt's logprobs."""
        self._serving = serving
        self._echoes = echoes
        self._echo_logprobs = echo_logprobs
        self._prompt_logprobs = prompt_logprobs
        self._echo_late = echo_logprobs is not None or prompt_logprobs is not None
        self._offsets = [len(e) for e in echoes]  # streamed text so far, for logprob offsets

    def initial_texts(self, n: int) -> list[str]:
        return list(self._echoes)

    def _logprobs(self, i: int, lps: list[TokenLogprob] | None, offset: int,
                  prompt: RequestOutput | None) -> dict | None:
        answer = self._serving._completion_logprobs(lps, offset)
        if self._echo_logprobs is None or prompt is None:
            return answer
        return self._serving._echoed_logprobs(prompt, self._echo_logprobs, answer,
                                              self._echoes[i])

    def choice(self, i: int, text: str, lps: list[TokenLogprob] | None,
               final: RequestOutput | None, prompt: RequestOutput | None) -> CompletionChoice:
        return CompletionChoice(i, text, self._logprobs(i, lps, len(self._echoes[i]), prompt),
                                final.finish_reason if final else None,
                                self._vllm(prompt))

    def _vllm(self, prompt: RequestOutput | None) -> list[dict | None] | None:
        if self._prompt_logprobs is None:
            return None
        return self._serving._vllm_prompt_logprobs(prompt, self._prompt_logprobs)

    def opening(self, i: int) -> CompletionChoice | None:
        echo = self._echoes[i]
        # With the prompt's logprobs the echo goes out with them, in the first delta.
        return CompletionChoice(i, echo, None, None) if echo and not self._echo_late else None

    def delta(self, i: int, out: RequestOutput) -> CompletionChoice | None:
        first = out.prompt_logprobs is not None
        text = self._echoes[i] + out.text if first and self._echo_late else out.text
        d = CompletionChoice(i, text,
                             self._logprobs(i, out.logprobs, self._offsets[i],
                                            out if first else None),
                             out.finish_reason, self._vllm(out) if first else None)
        self._offsets[i] += len(out.text)
        # Text held back (it may begin a stop string) with nothing else to say: no chunk of
        # "" (a held token's logprobs, a first delta's prompt logprobs and the end still go).
        if not text and d.logprobs is None and d.finish_reason is None and not first:
            return None
        return d

    def full(self, rid: str, created: int, model: str, choices: list,
             usage: Usage | None) -> TextCompletion:
        return TextCompletion(rid, "text_completion", created, model, choices, usage)

    def chunk(self, rid: str, created: int, model: str, choices: list, usage: Usage | None,
              with_usage: bool) -> TextCompletion:
        """A streamed chunk: a full completion's shape, usage only on the last (null on the
        others ``with_usage``)."""
        shape = TextCompletionWithUsage if with_usage else TextCompletion
        return shape(rid, "text_completion", created, model, choices, usage)


_NOT_TEXT = {"image_url": "images", "image": "images", "input_image": "images",
             "input_audio": "audio", "audio": "audio", "file": "files", "input_file": "files"}


# Where a response_format's schema is, for errors the grammar converter raises on it.
SCHEMA_PARAM = "response_format.json_schema.schema"
_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class _Streamed(Protocol):
    @property
    def stream(self) -> bool | None: ...
    @property
    def stream_options(self) -> object: ...


def _within_schema_limits(gbnf: str) -> str:
    """A grammar put together from schema grammars (each held to a schema grammar's limits),
    held to them as a whole as one schema's grammar is: together they may pass them."""
    grammar_limits(gbnf, "tools", rules=MAX_SCHEMA_GRAMMAR_RULES,
                   alternatives=MAX_SCHEMA_GRAMMAR_ALTERNATIVES)
    return gbnf


def held_by(req: ChatCompletionRequest, plan: ToolPlan) -> str | None:
    """The request's field whose grammar holds the whole answer (a required call, a response
    format, a structured-output extra), which the prompt is rendered for and a refusal
    names; None when the answer is free (an auto call's lazy grammar holds only the call)."""
    fmt = req.response_format
    found = requested(req)
    return ("tool_choice" if plan.enforced
            else "response_format" if fmt is not None and fmt.type != "text"
            else found[0] if found is not None else None)


def check_stream_options(req: _Streamed) -> None:
    """OpenAI's rule, on chat, completions and responses: ``stream_options`` only with
    ``stream: true`` (else it would be ignored)."""
    if req.stream_options is not None and not req.stream:
        raise InvalidRequestError("stream_options is only allowed when stream is true",
                                  param="stream_options")
    if getattr(req.stream_options, "include_obfuscation", None):
        raise InvalidRequestError("stream_options.include_obfuscation: stream obfuscation is "
                                  "not supported", param="stream_options.include_obfuscation")


def keep_last(k: int, most: int) -> int:
    """How many of a prompt's last tokens vLLM's ``truncate_prompt_tokens`` keeps: ``k``, or
    with -1 ``most`` (what the model holds); 0, or more than ``most``, is a 400, as in vLLM
    (more was taken, and cut nothing from a prompt too long to be served)."""
    if k == 0 or k > most:
        raise InvalidRequestError(f"truncate_prompt_tokens must be -1 (as many as the model "
                                  f"holds, {most}) or from 1 to {most}",
                                  param="truncate_prompt_tokens")
    return most if k < 0 else k


def check_chat_request(req: ChatCompletionRequest) -> None:
    """What OpenAI refuses in a chat request and the shared chat path would otherwise ignore:
    ``top_logprobs`` without ``logprobs``, ``parallel_tool_calls`` without ``tools``,
    ``stream_options`` without ``stream``, and
    (:func:`check_messages`) message fields."""
    if req.top_logprobs and not req.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
    if req.prompt_logprobs is not None and req.stream:
        raise InvalidRequestError("prompt_logprobs are not available with stream: true (as in "
                                  "vLLM)", param="prompt_logprobs")
    if req.parallel_tool_calls is not None and not req.tools:  # (OpenAI's 400: it did nothing)
        raise InvalidRequestError("parallel_tool_calls is only allowed when tools are given",
                                  param="parallel_tool_calls")
    check_stream_options(req)
    check_messages(req.messages)
    check_continuation(req)


def check_continuation(req: ChatCompletionRequest) -> None:
    """vLLM's ``continue_final_message`` (the answer goes on from the last, assistant,
    message) with its ``add_generation_prompt``, which must then be false: a generation
    prompt opens a new turn. Without it, ``add_generation_prompt`` may only be true."""
    if req.continue_final_message:
        if req.add_generation_prompt:
            raise InvalidRequestError("continue_final_message and add_generation_prompt cannot "
                                      "both be true", param="add_generation_prompt")
        if not req.messages or req.messages[-1].role != "assistant":
            raise InvalidRequestError("continue_final_message needs an assistant message last",
                                      param="continue_final_message")
        if tool_plan(req).active:
            raise InvalidRequestError("continue_final_message cannot be combined with tools "
                                      "(send tool_choice: none or no tools)",
                                      param="continue_final_message")
    elif req.add_generation_prompt is False:
        raise InvalidRequestError("add_generation_prompt: false is only supported with "
                                  "continue_final_message: true", param="add_generation_prompt")


_NOT_IN_HISTORY = {
    "audio": "this server makes no audio, so an audio reply cannot be part of the history",
    "function_call": "the deprecated function_call is not supported: send tool_calls",
    "annotations": "annotations (citations) are not supported",
}


def check_messages(messages: list[ChatMessage]) -> None:
    """Each message has what its role needs (OpenAI's rules: content, except for an assistant
    message with tool calls or a refusal; a content list is not empty; a tool message answers
    a call an earlier assistant message made), and the assistant-only fields this server
    cannot honour are null or empty (``model_dump()`` of an SDK message sends them so)."""
    if not messages:  # (also where the prompt is rendered; here before a router loads)
        raise InvalidRequestError("messages must not be empty", param="messages")
    calls: set[str] = set()  # the tool call ids the messages so far made
    for i, m in enumerate(messages):
        if isinstance(m.content, list) and not m.content:
            raise InvalidRequestError(f"messages[{i}].content: an empty list (give at least "
                                      "one part, or a string)", param=f"messages[{i}].content")
        if m.role == "tool" and m.tool_call_id is not None and m.tool_call_id not in calls:
            # OpenAI: "messages with role 'tool' must be a response to a preceding message
            # with 'tool_calls'"; the template would render an answer to nothing
            raise InvalidRequestError(
                f"messages[{i}].tool_call_id: no earlier assistant message made a tool call "
                f"with the id {m.tool_call_id!r}" if calls else
                f"messages[{i}]: a tool message must answer an earlier assistant message's "
                "tool_calls", param=f"messages[{i}].tool_call_id")
        calls.update(c.id for c in m.tool_calls or ())
        for name, why in _NOT_IN_HISTORY.items():
            if getattr(m, name):
                raise InvalidRequestError(f"messages[{i}].{name}: {why}",
                                          param=f"messages[{i}].{name}")
        if m.parsed is not None and (m.role != "assistant" or m.content is None):
            raise InvalidRequestError(f"messages[{i}].parsed: only an assistant message with "
                                      "the content it was parsed from carries it",
                                      param=f"messages[{i}].parsed")
        if m.refusal is not None and m.role != "assistant":
            raise InvalidRequestError(f"messages[{i}].refusal: only assistant messages carry "
                                      "a refusal", param=f"messages[{i}].refusal")
        if m.content is None and not (m.role == "assistant" and (m.tool_calls or m.refusal)):
            needs = " (or tool_calls)" if m.role == "assistant" else ""
            raise InvalidRequestError(f"messages[{i}].content: a {m.role} message needs "
                                      f"content{needs}", param=f"messages[{i}].content")


def _text_part(part: ContentPart, where: str) -> str:
    """The text of a content part; 400 for any other kind (this model reads text only)."""
    if part.type == "text":
        if part.text is None:
            raise InvalidRequestError(f"{where}: a text part needs 'text'", param=where)
        return part.text
    if part.type == "refusal":  # an assistant's, as OpenAI returns it: what it said
        if part.refusal is None:
            raise InvalidRequestError(f"{where}: a refusal part needs 'refusal'", param=where)
        return part.refusal
    kind = _NOT_TEXT.get(part.type)
    if kind is not None:
        raise InvalidRequestError(
            f"{where}: this model reads text only and cannot take {kind} (content part type "
            f"'{part.type}')", param=where)
    raise InvalidRequestError(f"{where}: unknown content part type '{part.type}' (only "
                              "'text' is supported)", param=where)


def token_id(key: str) -> int:
    """A token id written as an object key (digits, perhaps signed): one of more digits than
    any vocabulary's ids have is a 400 here, not ``int``'s ValueError past 4,300 digits (a
    500) or an id the size of the body."""
    if len(key.lstrip("+-").lstrip("0")) > 18:
        raise InvalidRequestError(f"logit_bias: {key[:24]}... is not a token id of this "
                                  "model's vocabulary", param="logit_bias")
    return int(key)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias (token ids as decimal strings) as token id -> bias; the values and
    the vocabulary are checked by SamplingParams and the engine."""
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdigit()):
            raise InvalidRequestError(f"logit_bias keys must be token ids (got {key!r})",
                                      param="logit_bias")
        out[token_id(key)] = value
    return out


def _check_generates(max_tokens: int | None, prompt_logprobs: int | None) -> None:
    """OpenAI's routes generate at least one token, but for the echo idiom (the prompt
    scored for its logprobs, ``max_tokens`` 0)."""
    if max_tokens == 0 and prompt_logprobs is None:
        raise InvalidRequestError("max_tokens must be an integer >= 1 (0 only with the "
                                  "prompt's logprobs: the prompt scored, nothing generated)",
                                  param="max_tokens")


def prompt_logprobs_of(req: CompletionRequest) -> int | None:
    """The prompt logprobs a completion asks for: vLLM's ``prompt_logprobs``, or echo's
    ``logprobs`` (the larger; each shape lists its own number)."""
    wanted = [k for k in (req.prompt_logprobs, req.logprobs if req.echo else None)
              if k is not None]
    return max(wanted) if wanted else None


def text_size(value: object) -> int:
    """The characters (token ids counted one each) in a decoded request's strings, lists and
    fields: how much tokenizing it asks for, to pick ``AsyncEngine.off_loop``'s pool."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, (list, tuple)):
        if value and isinstance(value[0], int):  # token ids
            return len(value)
        return sum(text_size(v) for v in value)
    if isinstance(value, dict):
        return sum(text_size(v) for v in value.values())
    if isinstance(value, msgspec.Struct):
        return sum(text_size(getattr(value, f)) for f in value.__struct_fields__)
    return 0


def _is_tokens(x: object) -> bool:
    return isinstance(x, list) and bool(x) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in x)


def _check_suffix(req: CompletionRequest) -> None:
    """``suffix`` (OpenAI's insert, as llama-cpp-python and DeepSeek's FIM take it): with text
    prompts, without ``echo`` (the prompt is not what was sent)."""
    if req.echo:
        raise InvalidRequestError("echo is not supported with suffix", param="echo")
    if not all(isinstance(p, str) for p in prompt_list(req.prompt, "prompt")):
        raise InvalidRequestError("with suffix, a prompt is text (the code before the gap), "
                                  "not token ids", param="prompt")


def end_user(user: str | None, safety_identifier: str | None = None) -> str | None:
    """Who a request says it is for, as logged: ``user`` and OpenAI's newer
    ``safety_identifier``, both where a client sends two."""
    if user and safety_identifier and user != safety_identifier:
        return f"{user} (safety_identifier {safety_identifier})"
    return user or safety_identifier


def one_value(names: dict[str, T | None]) -> T | None:
    """The value given under any of one field's names (None: none), the first name the main
    one: another name given at another value is a 400 naming both (param: the other), never
    one of them silently ignored."""
    given = [(k, v) for k, v in names.items() if v is not None]
    for name, value in given[1:]:
        if value != given[0][1]:
            raise InvalidRequestError(f"{given[0][0]} and {name} disagree (they are one field "
                                      "under two names: send one)", param=name)
    return given[0][1] if given else None


def prompt_list(value: object, param: str) -> list[str | list[int]]:
    """OpenAI's prompt/input forms -> a list of strings or token arrays (400 otherwise)."""
    if isinstance(value, str):
        items: list = [value]
    elif _is_tokens(value):
        items = [value]
    elif isinstance(value, list) and value and (all(isinstance(x, str) for x in value)
                                                 or all(_is_tokens(x) for x in value)):
        items = list(value)  # (strings and token arrays mixed: a 400, as OpenAI and vLLM)
    else:
        raise InvalidRequestError(
            f"{param} must be a non-empty string, list of strings, token array or list of "
            "token arrays", param=param)
    if any(isinstance(x, str) and not x for x in items):
        raise InvalidRequestError(f"{param} must not contain empty strings", param=param)
    return items


def _timings(finals: Sequence[RequestOutput | None]) -> Timings | None:
    first = finals[0] if finals else None
    return None if first is None else Timings.of(first.metrics)


def _usage(finals: Sequence[RequestOutput | None], n: int = 1) -> Usage:
    """Prompt tokens once per prompt (its ``n`` choices share it), those of them the prefix
    cache held, completion tokens summed."""
    prompt = sum(f.metrics.num_prompt_tokens for f in finals[::n] if f is not None)
    cached = sum(f.metrics.num_cached_tokens for f in finals[::n] if f is not None)
    completion = sum(f.metrics.num_generated_tokens for f in finals if f is not None)
    return Usage(prompt, completion, prompt + completion, {"cached_tokens": cached})


