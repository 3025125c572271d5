"""Ollama's REST API (``/api/...``) on ``justllm serve``, so Ollama clients and UIs work unchanged.

The routes reuse the OpenAI side's building blocks: the served ``OpenAIServing`` renders chats
through the chat template (``chat_prompt``), ``AsyncEngine.submit`` runs the request,
``EmbeddingServing`` computes embeddings. A chat that offers tools is served whole by
``OpenAIServing.chat_result`` / ``chat_events`` (``ollama_chat.py`` translates it both ways), so
calls are parsed and forced exactly as on ``/v1/chat/completions``. What is Ollama's own lives
here: its request bodies (decoded strictly, as every body of this server), ``options`` ->
``SamplingParams`` with Ollama's defaults, NDJSON streaming, durations in nanoseconds,
``{"error": "..."}`` errors.

Every accepted field is honoured or refused with a 400 naming it, never silently ignored
(Ollama itself ignores unknown fields): load-time options are accepted only at the server's own
value; ``keep_alive`` 0 (unload) is refused, since a single-model server never unloads.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import re
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, Union, cast, get_args, get_type_hints

import msgspec
from litestar import Request, Response, Router, delete, get, head, post
from litestar.datastructures import State
from litestar.params import JSONBody
from litestar.response import Stream

from justllm import __version__
from justllm.core.harmony import HarmonyReader
from justllm.core.reasoning import (
    EFFORT_VARIABLE,
    THINKING_SWITCH,
    ReasoningSplitter,
)
from justllm.core.sampling_params import MAX_LOGPROBS, SamplingParams
from justllm.engine.async_engine import RequestStream
from justllm.engine.chat_template import ChatTemplate, with_template_stops
from justllm.engine.engine import RequestMetrics, RequestOutput, TokenLogprob
from justllm.engine.lora import LoadedLora
from justllm.errors import BeyondContextError, InvalidRequestError
from justllm.models.gguf import GGUFHeader, read_gguf_header
from justllm.models.registry import file_digest
from justllm.models.store import quantization_name
from justllm.server.app import (
    Served,
    _served,
    decode_request,
    origin,
    require_api_key,
    unless_disconnected,
)
from justllm.server.code_prompt import code_prompt
from justllm.server.errors import APIError, ollama_response, to_api_error
from justllm.server.lora import adapter, no_adapter_embeddings
from justllm.server.metrics import failed
from justllm.server.ollama_chat import (
    Arrival,
    OllamaMessage,
    ToolChoice,
    answer,
    answer_lines,
    bad_format,
    chat_messages,
    continues_last_message,
    created_at,
    nanoseconds,
    tool_request,
)
from justllm.server.openai_serving import MAX_REQUEST_STOP
from justllm.server.schemas import ChatCompletionRequest, ChatMessage, EmbeddingRequest, Tool
from justllm.server.tools.answer import Timings

_json = msgspec.json.Encoder()
NDJSON = "application/x-ndjson"

# Ollama's defaults (api.DefaultOptions) for a model whose Modelfile sets none: a GGUF here has
# no Modelfile, so an Ollama client gets what Ollama would give it.
DEFAULT_TEMPERATURE = 0.8
DEFAULT_TOP_K = 40
DEFAULT_TOP_P = 0.9
DEFAULT_REPEAT_PENALTY = 1.1
DEFAULT_REPEAT_LAST_N = 64

# Load-time options whose value this server has for certain (llama.cpp's defaults, which
# justllm keeps): accepted at that value only.
_FIXED_OPTIONS: dict[str, object] = {
    "numa": False, "low_vram": False, "f16_kv": True, "logits_all": False,
    "vocab_only": False, "use_mmap": True, "use_mlock": False, "embedding_only": False,
    "main_gpu": 0,
}
# Load-time options set when `justllm serve` starts, which a request cannot change.
_START_OPTIONS = {"num_gpu": "--gpu", "num_batch": "--n-batch", "num_thread": "--threads"}
# Runtime options justllm does not implement, with the values that mean "off" (Ollama's
# defaults, accepted) and why another value is refused.
_OFF_OPTIONS: dict[str, tuple[object, str]] = {
    "tfs_z": (1.0, "tail-free sampling is not supported"),
    "typical_p": (1.0, "locally typical sampling is not supported"),
    "mirostat": (0, "mirostat sampling is not supported"),
    "mirostat_tau": (5.0, "mirostat sampling is not supported"),
    "mirostat_eta": (0.1, "mirostat sampling is not supported"),
    "penalize_newline": (True, "the repeat penalty applies to every token, newlines included"),
}
_SAMPLING_OPTIONS = ("num_keep", "seed", "num_predict", "top_k", "top_p", "min_p",
                     "repeat_last_n", "temperature", "repeat_penalty", "presence_penalty",
                     "frequency_penalty", "stop", *_OFF_OPTIONS)


# ---- request bodies ------------------------------------------------------------------------

class _Body(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """An Ollama request body part: unknown fields are refused, never silently ignored."""


if TYPE_CHECKING:
    _Integer = int
else:  # (a whole JSON number is taken for an integer option: OllamaOptions.__post_init__)
    _Integer = Union[int, float]


class OllamaOptions(_Body):
    """``options``: Ollama's Modelfile parameters (api.Options)."""

    # load time
    numa: bool | None = None
    num_ctx: _Integer | None = None
    num_batch: _Integer | None = None
    num_gpu: _Integer | None = None
    main_gpu: _Integer | None = None
    low_vram: bool | None = None
    f16_kv: bool | None = None
    logits_all: bool | None = None
    vocab_only: bool | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    embedding_only: bool | None = None
    num_thread: _Integer | None = None
    # runtime
    num_keep: _Integer | None = None
    seed: _Integer | None = None
    num_predict: _Integer | None = None
    top_k: _Integer | None = None
    top_p: float | None = None
    min_p: float | None = None
    tfs_z: float | None = None
    typical_p: float | None = None
    repeat_last_n: _Integer | None = None
    temperature: float | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    mirostat: _Integer | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    penalize_newline: bool | None = None
    stop: list[str] | None = None

    def __post_init__(self) -> None:
        # Ollama's own reading takes a JSON number for an integer option (its JSON has no
        # integers); a whole one is taken here, any other is refused (Ollama truncates it).
        for name in _INTEGER_OPTIONS:
            value = getattr(self, name)
            if isinstance(value, float):
                if not value.is_integer():
                    raise InvalidRequestError(f"options.{name} must be an integer (got "
                                              f"{value})", param=f"options.{name}")
                setattr(self, name, int(value))


# (the options declared _Integer)
_INTEGER_OPTIONS = tuple(name for name, hint in get_type_hints(OllamaOptions).items()
                         if int in get_args(hint))


class _Generation(_Body):
    model: str
    stream: bool = True
    format: Union[str, dict[str, Any], None] = None  # "json" or a JSON schema
    options: OllamaOptions | None = None
    keep_alive: Union[float, str, None] = None
    think: Union[bool, str, None] = None
    logprobs: bool = False
    top_logprobs: int | None = None


class OllamaTool(Tool, kw_only=True):
    """An Ollama tool: its ``type`` may be left out (Ollama reads the function; it was a 400
    here)."""

    type: str = "function"


class OllamaChatRequest(_Generation):
    messages: list[OllamaMessage] = []
    tools: list[OllamaTool] | None = None
    # justllm's extension (Ollama has none): OpenAI's tool_choice; absent = "auto"
    tool_choice: ToolChoice = None


class OllamaGenerateRequest(_Generation):
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[str] | None = None
    # image generation
    width: int | None = None
    height: int | None = None
    steps: int | None = None


class OllamaEmbedRequest(_Body):
    model: str
    input: Union[str, list[str]] = ""
    truncate: bool | None = None
    options: OllamaOptions | None = None
    keep_alive: Union[float, str, None] = None
    dimensions: int | None = None


class OllamaEmbeddingsRequest(_Body):
    """The older ``/api/embeddings``: one prompt, one ``embedding``."""

    model: str
    prompt: str = ""
    options: OllamaOptions | None = None
    keep_alive: Union[float, str, None] = None


class OllamaShowRequest(_Body):
    model: str = ""
    name: str = ""  # the older spelling of ``model``
    verbose: bool = False


# ---- checks ----------------------------------------------------------------------------------

def _not_found(name: str) -> APIError:
    return APIError(404, f'model "{name}" not found, try pulling it first',
                    type="not_found_error", param="model", code="model_not_found")


def _arrival(request: Request, state: State) -> Arrival:
    """When the request arrived; a router-mode runner also reads what its gateway says of
    it (the load it waited for, the name the client asked for), which no other client's
    headers may set (``ServerConfig.gateway_headers``)."""
    return Arrival.now(request.headers if state["config"].gateway_headers else {})


def _check_model(name: str, served: Served, adapters: bool = True) -> LoadedLora | None:
    """``name`` must be the served model or, where ``adapters``, one of its LoRA adapters (as
    an Ollama model made with ``ADAPTER``), bare or with the ``:latest`` tag Ollama clients
    add. The adapter it names, if it names one."""
    if not name:
        raise InvalidRequestError("model is required", param="model")
    if name.removesuffix(":latest") == served.model_id.removesuffix(":latest"):
        return None  # (Ollama's "m" and "m:latest" are one model, however it was named)
    found = adapter(served.aengine, name.removesuffix(":latest"))
    if found is None:
        raise _not_found(name)
    if not adapters:
        raise no_adapter_embeddings(name, served.model_id)
    return found


_GO_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_GO_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0,
             "h": 3600.0}


# Go's longest time.Duration, which Ollama's keep_alive is.
GO_MAX_SECONDS = (2**63 - 1) / 1e9


def keep_alive_seconds(value: object) -> float:
    """Ollama's ``keep_alive``: seconds (a number, or a string of one) or a Go duration
    ("5m", "1h30m", "-1s"), at most Go's longest (about 292 years: a negative one keeps the
    model loaded for ever). A 400 for anything else. (Router mode's gateway reads it here
    too, from bodies it does not decode into a type.)"""
    seconds = _keep_alive_seconds(value)
    if seconds > GO_MAX_SECONDS:  # (inf too; it broke /api/ps's expires_at in router mode)
        raise InvalidRequestError(f"keep_alive: {value!r} is longer than the longest duration "
                                  "(about 292 years); a negative keep_alive keeps the model "
                                  "loaded for ever", param="keep_alive")
    return seconds


def _keep_alive_seconds(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise InvalidRequestError("keep_alive must be a number of seconds or a duration such "
                                  "as '5m'", param="keep_alive")
    if isinstance(value, int):  # (past a float's range in router mode's untyped body)
        return float(value) if abs(value) < 2**63 else math.inf if value > 0 else -math.inf
    if isinstance(value, float):
        if math.isnan(value):
            raise InvalidRequestError("keep_alive must be a number", param="keep_alive")
        return value
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        pass
    else:
        if math.isnan(seconds):
            raise InvalidRequestError("keep_alive must be a number of seconds or a duration",
                                      param="keep_alive")
        return seconds
    sign, body = (-1.0, text[1:]) if text[:1] == "-" else (1.0, text.removeprefix("+"))
    if not body or _GO_DURATION.sub("", body):
        raise InvalidRequestError(f"keep_alive: {value!r} is neither a number of seconds nor a "
                                  "duration such as '5m' or '1h30m'", param="keep_alive")
    return sign * sum(float(n) * _GO_UNITS[u] for n, u in _GO_DURATION.findall(body))


def _check_keep_alive(value: float | str | None) -> None:
    """Negative (keep loaded) and positive durations hold: the model stays loaded as long as
    the server runs. 0 asks for an unload, which only router mode does."""
    if value is None:
        return
    if keep_alive_seconds(value) == 0:
        raise InvalidRequestError(
            "keep_alive 0 unloads the model, and this single-model server never unloads it; "
            "`justllm serve --models models.yaml` (router mode) loads and unloads models and "
            "honours keep_alive", param="keep_alive")


def _check_load_options(o: OllamaOptions, served: Served) -> None:
    if o.num_ctx is not None and o.num_ctx != served.aengine.max_request_tokens:
        raise InvalidRequestError(
            f"options.num_ctx: this server's context is {served.aengine.max_request_tokens} "
            f"tokens per request (set by --ctx when it starts); a request cannot change it "
            f"(send {served.aengine.max_request_tokens} or leave num_ctx out)",
            param="options.num_ctx")
    for name, value in _FIXED_OPTIONS.items():
        got = getattr(o, name)
        if got is not None and got != value:
            raise InvalidRequestError(
                f"options.{name}: this server runs with {name} = {_show(value)}, set when it "
                "starts; a request cannot change it", param=f"options.{name}")
    for name, flag in _START_OPTIONS.items():
        if getattr(o, name) is not None:
            raise InvalidRequestError(
                f"options.{name} is a load-time option: `justllm serve` sets it when it starts "
                f"({flag}) and a request cannot change it; leave it out", param=f"options.{name}")


def _show(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _sampling(o: OllamaOptions | None, served: Served, *, grammar: str | None,
              logprobs: int | None, template_stops: bool,
              lora: LoadedLora | None = None) -> SamplingParams:
    """``options`` as SamplingParams, with Ollama's defaults for what is not set (and the
    request's adapter, at its own scale; without one, llama-server's global scales if set:
    server/lora.py)."""
    o = o or OllamaOptions()
    _check_load_options(o, served)
    template = served.completions.template
    return _options_params(
        o, served.aengine.max_request_tokens, template if template_stops else None, grammar,
        logprobs, served.aengine.lora_defaults() if lora is None else ((lora.name, lora.scale),))


def check_options(o: OllamaOptions | None) -> None:
    """The checks of ``options`` that need no model: router mode runs them before it loads one
    (``options.temperature: -5`` started a runner, and under max-loaded evicted a busy
    model, for a 400)."""
    _options_params(o or OllamaOptions(), 1, None, None, None, ())


def _options_params(o: OllamaOptions, whole: int, template: ChatTemplate | None,
                    grammar: str | None, logprobs: int | None,
                    lora: tuple[tuple[str, float], ...]) -> SamplingParams:
    """``_sampling``'s checks and values (``whole``: the tokens a request holds, what
    repeat_last_n -1 means; ``template``: its end-of-turn stops are added)."""
    for name, (off, why) in _OFF_OPTIONS.items():
        value = getattr(o, name)
        if value is not None and value != off:
            raise InvalidRequestError(f"options.{name}: {why} (only {_show(off)} is accepted)",
                                      param=f"options.{name}")
    n = o.num_predict
    if n is not None and n < 1 and n not in (-1, -2):
        raise InvalidRequestError("options.num_predict must be >= 1, or -1 (until the "
                                  "context is full)", param="options.num_predict")
    last_n = DEFAULT_REPEAT_LAST_N if o.repeat_last_n is None else o.repeat_last_n
    if last_n == -1:
        last_n = whole
    if last_n < 0:
        raise InvalidRequestError("options.repeat_last_n must be >= 0, or -1 (the whole "
                                  "context)", param="options.repeat_last_n")
    if o.num_keep is not None and o.num_keep < -1:
        raise InvalidRequestError("options.num_keep must be >= -1", param="options.num_keep")
    stop = tuple(o.stop or ())
    if len(stop) > MAX_REQUEST_STOP:
        raise InvalidRequestError(f"at most {MAX_REQUEST_STOP} stop strings",
                                  param="options.stop")
    try:
        return _params(o, n, last_n, with_template_stops(stop, template) if template else stop,
                       grammar, logprobs, lora)
    except InvalidRequestError as e:  # named as the client named it: options.temperature
        text = str(e)
        if not (e.param and text.startswith(e.param)):  # ("a stop string has at most ...")
            text = f"{e.param or 'options'}: {text}"
        raise InvalidRequestError(f"options.{text}" if e.param else text,
                                  param=f"options.{e.param}" if e.param else None) from None


def _params(o: OllamaOptions, n: int | None, last_n: int, stop: tuple[str, ...],
            grammar: str | None, logprobs: int | None,
            lora: tuple[tuple[str, float], ...]) -> SamplingParams:
    return SamplingParams(
        max_tokens=n if n is not None and n >= 1 else None,
        temperature=DEFAULT_TEMPERATURE if o.temperature is None else o.temperature,
        top_k=DEFAULT_TOP_K if o.top_k is None else o.top_k,
        top_p=DEFAULT_TOP_P if o.top_p is None else o.top_p,
        min_p=o.min_p or 0.0,
        repeat_penalty=DEFAULT_REPEAT_PENALTY if o.repeat_penalty is None else o.repeat_penalty,
        repeat_last_n=last_n,
        presence_penalty=o.presence_penalty or 0.0,
        frequency_penalty=o.frequency_penalty or 0.0,
        # -1 alone means random, as in Ollama (another negative seed is a seed there too)
        seed=o.seed if o.seed is not None and o.seed != -1 else None,
        stop=stop, logprobs=logprobs, grammar=grammar, lora=lora)


def _grammar(fmt: str | dict[str, Any] | None, served: Served) -> str | None:
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return served.aengine.json_grammar()
    if isinstance(fmt, dict):
        try:
            return served.aengine.json_grammar(fmt)
        except InvalidRequestError as e:
            raise InvalidRequestError(f"format: {e}", param="format") from None
    raise bad_format(fmt)


def _logprobs(req: _Generation) -> int | None:
    top = req.top_logprobs
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise InvalidRequestError(f"top_logprobs must be in [0, {MAX_LOGPROBS}]",
                                  param="top_logprobs")
    if top and not req.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
    return (top or 0) if req.logprobs else None


def _check_generation(req: _Generation, served: Served) -> LoadedLora | None:
    """The request's checks; the adapter its model names, if it names one. An encoder
    (BERT-like embedding model) writes nothing: Ollama's 400 for an embedding model."""
    lora = _check_model(req.model, served)
    _check_keep_alive(req.keep_alive)
    if not served.aengine.generates:
        what = "chat" if isinstance(req, OllamaChatRequest) else "generate"
        raise InvalidRequestError(f'"{req.model}" does not support {what}', param="model")
    return lora


_T = TypeVar("_T")
_THINK_LEVELS = ("low", "medium", "high")


@dataclass(frozen=True)
class _Think:
    """What a request's ``think`` comes to: the chat template's variables, and whether the
    answer's thinking is taken apart (Ollama's ``thinking`` field)."""

    kwargs: dict[str, Any] | None = None
    apart: bool = False


def _think(req: _Generation, served: Served) -> _Think:
    """Ollama's ``think``: a model thinks when its chat template writes thinking tags
    (Ollama's "thinking" capability), and then by default (``think`` absent means true, as in
    Ollama); true on any other model is Ollama's 400. The template's ``enable_thinking`` gets
    the choice; a level ("low", "medium", "high"; "max" is "high", as Ollama maps it) needs
    a template that takes
    ``reasoning_effort``. Thinking stays in the text with ``think: false``, and when ``think``
    is absent and the server was started with ``--reasoning-format none``."""
    template = served.completions.template
    think = "high" if req.think == "max" else req.think
    if not template.thinks:
        if think in (None, False):
            return _Think()
        raise InvalidRequestError(f'"{req.model}" does not support thinking', param="think")
    kwargs: dict[str, Any] = {}
    if isinstance(think, str):
        if think not in _THINK_LEVELS:
            raise InvalidRequestError('think: true, false, "low", "medium" or "high"',
                                      param="think")
        if EFFORT_VARIABLE not in template.source:
            raise InvalidRequestError(f'"{req.model}" thinks or does not (think: true or '
                                      f'false); it has no thinking levels', param="think")
        kwargs[EFFORT_VARIABLE] = think
    on = think is not False
    if template.thinking_switch and think is not None:
        # (left out when the request did not choose: an answer held to a format then has
        # the thinking switched off for it, as on the other APIs)
        kwargs[THINKING_SWITCH] = on
    apart = on and (think is not None
                    or served.aengine.engine.config.reasoning_format != "none")
    return _Think(kwargs or None, apart)


def _no_images(images: list[str] | None, where: str) -> None:
    if images:
        raise InvalidRequestError(f"{where}: this model reads text only and cannot take images",
                                  param=where)


# ---- one generation ------------------------------------------------------------------------

@dataclass
class _Job:
    """One chat or generate request on its way: how its chunks look and what it has so far."""

    served: Served
    name: str  # the model as the client named it (echoed back, as Ollama does)
    chat: bool
    arrival: Arrival
    lstrip: bool  # leading blanks still to drop
    thinking: ReasoningSplitter | HarmonyReader | None = None  # takes it apart (think)

    def text(self, piece: str) -> tuple[str, str]:
        """A piece of the answer -> the thinking and the text to show now."""
        if self.lstrip:
            piece = piece.lstrip()
            self.lstrip = not piece
        return self.thinking.feed(piece) if self.thinking is not None else ("", piece)

    def rest(self) -> tuple[str, str]:
        """At the answer's end: the thinking and the text held back."""
        return self.thinking.finish() if self.thinking is not None else ("", "")

    def chunk(self, text: str, done: bool, lps: list[TokenLogprob] | None = None,
              thought: str = "") -> dict:
        out: dict[str, Any] = {"model": self.name, "created_at": created_at()}
        if self.chat:
            out["message"] = {"role": "assistant", "content": text}
            if thought:
                out["message"]["thinking"] = thought
        else:
            out["response"] = text
            if thought:
                out["thinking"] = thought
        if lps is not None:
            out["logprobs"] = [_logprob(self.served, lp) for lp in lps]
        out["done"] = done
        return out

    def final(self, text: str, out: RequestOutput, lps: list[TokenLogprob] | None,
              thought: str = "") -> dict:
        m = out.metrics
        timings = Timings.of(m)
        return {**self.chunk(text, True, lps, thought),
                "done_reason": "length" if out.finish_reason == "length" else "stop",
                **self.arrival.durations(),
                "prompt_eval_count": m.num_prompt_tokens,
                "prompt_eval_duration": nanoseconds(timings.prompt_seconds),
                "eval_count": m.num_generated_tokens,
                "eval_duration": nanoseconds(timings.generation_seconds)}

    def error(self, out: RequestOutput) -> Exception:
        return self.served.completions.failure(out)


def _logprob(served: Served, lp: TokenLogprob) -> dict:
    def entry(token: int, value: float) -> dict:
        piece = served.aengine.token_bytes(token)
        return {"token": piece.decode("utf-8", "replace"), "logprob": value,
                "bytes": list(piece)}
    return {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}


async def _outputs(job: _Job, stream: RequestStream) -> AsyncGenerator[RequestOutput, None]:
    """The request's outputs; a finished one is counted in the metrics. Closing the iterator
    (client gone, task cancelled) aborts the request."""
    ended = False  # not stream.finished: a cancelled wait for the next output sets that
    timed = False  # its first token counted
    seen: RequestMetrics | None = None  # its metrics so far
    try:
        async for out in stream:
            seen = out.metrics
            timed = timed or job.served.metrics.observe_first_token(out.metrics)
            if out.finished:
                ended = True
                job.served.metrics.observe_finished(out.metrics, out.finish_reason,
                                                    failed(out))
            yield out
    finally:
        if not ended:  # the client left
            job.served.metrics.observe_aborted(stream.arrival, seen)
        stream.abort()


async def _ndjson(job: _Job, stream: RequestStream) -> AsyncIterator[bytes]:
    async with aclosing(_outputs(job, stream)) as outputs:
        async for out in outputs:
            if out.error:
                yield _json.encode({"error": str(job.error(out))}) + b"\n"
                return
            thought, text = job.text(out.text)
            if out.finished:
                more, rest = job.rest()
                thought, text = thought + more, text + rest
            if text or thought or (out.logprobs and not out.finished):
                yield _json.encode(job.chunk(text, False, out.logprobs, thought)) + b"\n"
                if out.finished:
                    yield _json.encode(job.final("", out, None)) + b"\n"
            elif out.finished:
                yield _json.encode(job.final("", out, out.logprobs)) + b"\n"


async def _collect(job: _Job, stream: RequestStream, want_logprobs: bool) -> dict:
    text = thoughts = ""
    lps: list[TokenLogprob] = []
    async with aclosing(_outputs(job, stream)) as outputs:
        async for out in outputs:
            if out.error:
                raise job.error(out)
            thought, piece = job.text(out.text)
            text, thoughts = text + piece, thoughts + thought
            lps += out.logprobs or []
            if out.finished:
                thought, piece = job.rest()
                return job.final(text + piece, out, lps if want_logprobs else None,
                                 thoughts + thought)
    raise APIError(500, "the request ended without a result", type="server_error")


def _as_ollamas(e: InvalidRequestError) -> InvalidRequestError:
    """A refusal from the chat side, naming what an Ollama request sends instead."""
    if e.param == "max_tokens":
        return InvalidRequestError(str(e).replace("max_tokens", "num_predict"),
                                   param="options.num_predict")
    if e.param and e.param.startswith("response_format"):  # (format with tools)
        text = str(e)
        return InvalidRequestError("format" + text[len(e.param):] if text.startswith(e.param)
                                   else f"format: {text}", param="format")
    if e.param == "chat_template_kwargs":  # (the thinking and a format or a required call)
        return InvalidRequestError(
            "think: this model thinks before it answers, and an answer held to a format or a "
            "required tool call cannot hold its thinking: send think: false, or no format",
            param="think")
    return e


async def _refused_or_begun(begin: Callable[[bool], Awaitable[_T]]) -> _T:
    """``begin(capped)``'s answer, a refusal (raised before any answer) in Ollama's words.
    ``num_predict`` is a most, as Ollama reads it: one past what the context holds is not
    refused (as the OpenAI routes refuse such a ``max_tokens``) but begun again uncapped, to
    answer until the context is full."""
    try:
        try:
            return await begin(True)
        except BeyondContextError:
            return await begin(False)
    except InvalidRequestError as e:
        raise _as_ollamas(e) from None


def ollama_id() -> str:
    """The id of an Ollama request in logs and records (Ollama's answers carry none): unique
    across restarts, as the other APIs' response ids are (the engine's own ``req-N`` counts
    from 1 in every process, so a request log kept them apart badly)."""
    return f"ollama-{uuid.uuid4().hex}"


async def _run(request: Request, served: Served, req: _Generation, prompt: str | list[int],
               params: SamplingParams, *, chat: bool, templated: bool, arrival: Arrival,
               think: _Think) -> Any:
    # After a transcript's "Assistant:" the model writes the separating space itself
    # (``templated``: the prompt ends where the template opens the answer).
    lstrip = templated and served.completions.template.name == "transcript"
    splitter = (served.completions.template.thinking_reader(prompt)
                if think.apart and isinstance(prompt, str) else None)
    if isinstance(prompt, str):  # (the server's --reasoning-budget, as on the other APIs)
        params = served.completions.budgeted(params, prompt)
    job = _Job(served, arrival.named(req.model), chat, arrival, lstrip, splitter)
    where = served.completions.answered_as(  # (an adapter's record names it, bare)
        origin(request, "ollama.chat" if chat else "ollama.generate", req.stream),
        req.model.removesuffix(":latest"))
    stream = await _refused_or_begun(lambda capped: served.aengine.asubmit(
        prompt, params if capped else replace(params, max_tokens=None), ollama_id(),
        origin=where))
    if req.stream:
        return Stream(_ndjson(job, stream), media_type=NDJSON, headers={"Content-Type": NDJSON})
    return await unless_disconnected(request, _collect(job, stream, req.logprobs))


def _loaded(name: str, chat: bool, reason: str = "load") -> dict:
    """Ollama's answer to a request with nothing to generate: it loads the model (here it
    already is), or with ``keep_alive`` 0 unloads it (``reason`` "unload": router mode)."""
    body: dict[str, Any] = {"model": name, "created_at": created_at()}
    if chat:
        body["message"] = {"role": "assistant", "content": ""}
    else:
        body["response"] = ""
    return {**body, "done_reason": reason, "done": True}


def unloaded(name: str, path: str, body: dict) -> dict | None:
    """Ollama's answer to ``keep_alive`` 0 with nothing to generate (an empty ``prompt``, or
    no ``messages``): the model is unloaded, not run; None for any other request."""
    chat = path == "/api/chat"
    if path not in ("/api/chat", "/api/generate") or body.get("messages" if chat else "prompt"):
        return None
    return _loaded(name, chat, "unload")


# ---- generation routes ---------------------------------------------------------------------

@post("/chat", status_code=200, summary="Ollama: the next message of a chat (NDJSON stream)")
async def chat(data: JSONBody[OllamaChatRequest], request: Request, state: State) -> Any:
    arrival = _arrival(request, state)
    served = _served(state)
    req = await decode_request(request, OllamaChatRequest)
    lora = _check_generation(req, served)
    think = _think(req, served)
    messages = chat_messages(req.messages, req.model,
                             served.completions.template.thinks)
    continued = continues_last_message(req.messages, req.tools)
    with_tools = tool_request(messages, list[Tool](req.tools) if req.tools else None,
                              req.tool_choice, req.format)
    if with_tools is not None:
        with_tools = msgspec.structs.replace(
            with_tools, chat_template_kwargs=think.kwargs,
            reasoning_format="deepseek" if think.apart else "none")
        if lora is not None:  # the chat path applies the adapter its model names
            with_tools = msgspec.structs.replace(with_tools, model=lora.name)
        return await _chat_with_tools(request, served, req, with_tools, arrival)
    grammar = _grammar(req.format, served)
    params = _sampling(req.options, served, grammar=grammar and served.completions.held_answer(
                           grammar, continued),
                       logprobs=_logprobs(req), template_stops=True, lora=lora)
    if not messages:
        return _loaded(arrival.named(req.model), chat=True)
    try:
        prompt = served.completions.chat_prompt(messages, continued, think.kwargs,
                                                constrained="format" if grammar else None)
    except InvalidRequestError as e:
        raise _as_ollamas(e) from None
    # (a continued message's text goes on as the model writes it: see _run's lstrip)
    return await _run(request, served, req, prompt, params, chat=True, templated=not continued,
                      arrival=arrival, think=think)


async def _chat_with_tools(request: Request, served: Served, req: OllamaChatRequest,
                           chat: ChatCompletionRequest, arrival: Arrival) -> Any:
    """Served by the chat completion's tool machinery (``ollama_chat.py``), with Ollama's
    sampling defaults and options."""
    params = _sampling(req.options, served, grammar=None, logprobs=_logprobs(req),
                       template_stops=False)
    if params.repeat_last_n != DEFAULT_REPEAT_LAST_N:
        raise InvalidRequestError(
            f"options.repeat_last_n: with tools only the default ({DEFAULT_REPEAT_LAST_N}) "
            "is supported", param="options.repeat_last_n")
    if not req.messages:
        return _loaded(arrival.named(req.model), chat=True)
    chat = msgspec.structs.replace(
        chat, max_tokens=params.max_tokens, temperature=params.temperature,
        top_p=params.top_p, top_k=params.top_k, min_p=params.min_p,
        repeat_penalty=params.repeat_penalty, presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty, seed=params.seed,
        stop=list(params.stop) or None, logprobs=req.logprobs, top_logprobs=req.top_logprobs)
    return await _refused_or_begun(lambda capped: _answer_with_tools(
        request, served, req, chat if capped else msgspec.structs.replace(chat, max_tokens=None),
        arrival))


async def _answer_with_tools(request: Request, served: Served, req: OllamaChatRequest,
                             chat: ChatCompletionRequest, arrival: Arrival) -> Any:
    if req.stream:
        events = await served.completions.chat_events(
            chat, ollama_id(), origin=origin(request, "ollama.chat", True))
        return Stream(answer_lines(arrival.named(req.model), arrival, events), media_type=NDJSON,
                      headers={"Content-Type": NDJSON})
    result = await unless_disconnected(request, served.completions.chat_result(
        chat, ollama_id(), origin=origin(request, "ollama.chat", False)))
    if isinstance(result, Response):
        return result
    return answer(arrival.named(req.model), arrival, result)


@post("/generate", status_code=200, summary="Ollama: a completion of a prompt (NDJSON stream)")
async def generate(data: JSONBody[OllamaGenerateRequest], request: Request, state: State) -> Any:
    arrival = _arrival(request, state)
    served = _served(state)
    req = await decode_request(request, OllamaGenerateRequest)
    lora = _check_generation(req, served)
    if isinstance(req.think, str) and (req.raw or req.suffix):
        raise InvalidRequestError("think: a thinking level goes through the chat template, "
                                  "which a raw or fill-in-the-middle prompt does not use; send "
                                  "think: true or false", param="think")
    think = _think(req, served)
    _no_images(req.images, "images")
    if req.suffix:
        _check_insert(req, served)
    if req.template:
        raise InvalidRequestError("template: a per-request prompt template is not supported; "
                                  "send raw: true with a prompt formatted yourself, or use the "
                                  "server's chat template (--chat-template)", param="template")
    if req.context:
        raise InvalidRequestError("context: continuing from a previous response's context is "
                                  "not supported (Ollama deprecates it); send the conversation "
                                  "to /api/chat", param="context")
    for name in ("width", "height", "steps"):
        if getattr(req, name) is not None:
            raise InvalidRequestError(f"{name}: image generation is not supported", param=name)
    if req.raw and req.system:
        raise InvalidRequestError("system: a raw prompt is sent as it is, without a system "
                                  "message; put it in the prompt", param="system")
    grammar = _grammar(req.format, served)
    templated = not req.raw and not req.suffix
    params = _sampling(req.options, served, grammar=grammar and (
                           served.completions.held_answer(grammar) if templated else grammar),
                       logprobs=_logprobs(req), template_stops=templated, lora=lora)
    if req.suffix:  # fill-in-the-middle: the code before (prompt) and after (suffix)
        n = params.max_tokens

        def fim() -> list[int]:
            return code_prompt(served.aengine, req.prompt, req.suffix or "", [], "",
                               -1 if n is None else n)

        prompt: str | list[int] = await served.aengine.off_loop(
            len(req.prompt) + len(req.suffix), fim)
    elif not req.prompt:
        return _loaded(arrival.named(req.model), chat=False)
    elif req.raw:
        prompt = req.prompt
    else:
        turn = [ChatMessage(role="user", content=req.prompt)]
        if req.system:
            turn.insert(0, ChatMessage(role="system", content=req.system))
        try:
            prompt = served.completions.chat_prompt(turn, kwargs=think.kwargs,
                                                    constrained="format" if grammar else None)
        except InvalidRequestError as e:
            raise _as_ollamas(e) from None
    return await _run(request, served, req, prompt, params, chat=False,
                      templated=not req.raw and not req.suffix, arrival=arrival, think=think)


def _check_insert(req: OllamaGenerateRequest, served: Served) -> None:
    """A request with ``suffix`` (Ollama's insert): a model with FIM tokens, and none of the
    fields a fill-in-the-middle prompt has no place for (Ollama drops them; refused here)."""
    if req.raw:
        raise InvalidRequestError("suffix: a raw prompt is sent as it is; leave raw out for "
                                  "a fill-in-the-middle prompt of prompt and suffix",
                                  param="suffix")
    if req.system:
        raise InvalidRequestError("system: a fill-in-the-middle prompt (suffix) has no system "
                                  "message", param="system")
    missing = served.aengine.fim_tokens().missing()
    if missing:
        raise InvalidRequestError(f'"{req.model}" does not support insert (it has no FIM '
                                  f"{', '.join(missing)} token)", param="suffix")


# ---- embeddings ------------------------------------------------------------------------------

def _check_embedding_options(o: OllamaOptions | None, served: Served) -> None:
    if o is None:
        return
    _check_load_options(o, served)
    for name in _SAMPLING_OPTIONS:
        if getattr(o, name) is not None:
            raise InvalidRequestError(f"options.{name} does not apply to embeddings",
                                      param=f"options.{name}")


async def _embed(served: Served, name: str, inputs: str | list[str], dimensions: int | None,
                 truncate: bool, normalise: bool = True) -> tuple[list[list[float]], int]:
    if served.embeddings is None:
        raise InvalidRequestError(f'"{name}" does not support embeddings: this server runs '
                                  "with embeddings disabled", param="model")
    result = await served.embeddings.create(
        EmbeddingRequest(input=inputs, dimensions=dimensions), truncate=truncate,
        normalise=normalise)
    # floats: the request asked for no base64
    return ([list(cast(list[float], e.embedding)) for e in result.data],
            result.usage.prompt_tokens)


@post("/embed", status_code=200, summary="Ollama: embeddings of one or more inputs")
async def embed(data: JSONBody[OllamaEmbedRequest], request: Request, state: State) -> Any:
    arrival = _arrival(request, state)
    served = _served(state)
    req = await decode_request(request, OllamaEmbedRequest)
    _check_model(req.model, served, adapters=False)
    _check_keep_alive(req.keep_alive)
    _check_embedding_options(req.options, served)
    if req.dimensions is not None and req.dimensions < 1:
        raise InvalidRequestError("dimensions must be >= 1", param="dimensions")
    if req.input in ("", []):
        return {"model": arrival.named(req.model), "embeddings": []}
    done = await unless_disconnected(request, _embed(
        served, req.model, req.input, req.dimensions,
        truncate=req.truncate is not False))  # (Ollama's default)
    if isinstance(done, Response):
        return done
    vectors, tokens = done
    return {"model": arrival.named(req.model), "embeddings": vectors, **arrival.durations(),
            "prompt_eval_count": tokens}


@post("/embeddings", status_code=200, summary="Ollama (older): the embedding of one prompt")
async def embeddings(data: JSONBody[OllamaEmbeddingsRequest], request: Request,
                     state: State) -> Any:
    served = _served(state)
    req = await decode_request(request, OllamaEmbeddingsRequest)
    _check_model(req.model, served, adapters=False)
    _check_keep_alive(req.keep_alive)
    _check_embedding_options(req.options, served)
    if not req.prompt:
        return {"embedding": []}
    # (as Ollama's: not truncated, and the vector as pooled, not normalised)
    done = await unless_disconnected(request, _embed(served, req.model, req.prompt, None,
                                                     truncate=False, normalise=False))
    if isinstance(done, Response):
        return done
    return {"embedding": done[0][0]}


# ---- the model -----------------------------------------------------------------------------

@dataclass(frozen=True)
class _ModelFacts:
    """What Ollama's listings say of a model, read once from the GGUF (header and digest)."""

    size: int
    digest: str
    details: dict[str, Any]
    model_info: dict[str, Any]
    license: str | None


def gguf_details(header: GGUFHeader) -> dict[str, Any]:
    """Ollama's ``details`` of a model, read off its GGUF header (router mode's listings
    give them too)."""
    meta = header.metadata
    arch = header.architecture
    ftype = header.integer("general.file_type")
    count = header.integer("general.parameter_count")
    size_label = meta.get("general.size_label")
    return {"parent_model": "", "format": "gguf", "family": arch, "families": [arch],
            "parameter_size": (_human_count(count) if count else
                               str(size_label) if size_label else ""),
            "quantization_level": quantization_name(ftype) if ftype is not None else ""}


def _read_facts(path: str) -> _ModelFacts:
    """Blocking (the header, and the file's sha256 unless the registry remembers it)."""
    header = read_gguf_header(path)
    meta = header.metadata
    details = gguf_details(header)
    info: dict[str, Any] = {k: v for k, v in meta.items() if k != "tokenizer.chat_template"}
    info.update({k: [] for k in header.array_lengths})  # arrays left out, as Ollama does
    licence = meta.get("general.license")
    p = Path(path)
    return _ModelFacts(p.stat().st_size, file_digest(p), details, dict(sorted(info.items())),
                       str(licence) if licence is not None else None)


def _human_count(n: int) -> str:
    """A parameter count as Ollama writes it: 8.0B, 268.10M, 20K."""
    for unit, scale, digits in (("B", 1e9, 1), ("M", 1e6, 2), ("K", 1e3, 0)):
        if n >= scale:
            x = n / scale
            return f"{x:.0f}{unit}" if x == math.floor(x) else f"{x:.{digits}f}{unit}"
    return str(n)


async def _facts(state: State, served: Served) -> _ModelFacts:
    facts: _ModelFacts | None = state.get("ollama_facts")
    if facts is None:
        facts = await asyncio.to_thread(_read_facts, served.aengine.model_path)
        state["ollama_facts"] = facts
    return facts


def _tag(served: Served) -> str:
    """The served model as Ollama lists it: ``name:latest`` (a name with a tag stays as it is)."""
    return served.model_id if ":" in served.model_id else f"{served.model_id}:latest"


def _iso(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _iso_time(t: float) -> str:
    return _iso(datetime.fromtimestamp(t, UTC))


def _adapter_tag(a: LoadedLora) -> str:
    return a.name if ":" in a.name else f"{a.name}:latest"


def _listed(served: Served, facts: _ModelFacts) -> list[dict[str, Any]]:
    """The served model and its LoRA adapters as Ollama lists models; an adapter as a model
    made with ``ADAPTER`` is: the base model's details with it as ``parent_model``, its size
    the adapter file's, its digest one of the base model's digest, the adapter's path and
    scale (what the adapter model is)."""
    base = _tag(served)
    out: list[dict[str, Any]] = [
        {"name": base, "model": base, "modified_at": _iso_time(served.created),
         "size": facts.size, "digest": facts.digest, "details": facts.details}]
    for a in served.aengine.lora_adapters():
        try:
            st = os.stat(a.path)
            size, mtime = st.st_size, st.st_mtime
        except OSError:
            size, mtime = 0, served.created
        digest = hashlib.sha256(f"{facts.digest}\n{a.path}\n{a.scale}".encode()).hexdigest()
        out.append({"name": _adapter_tag(a), "model": _adapter_tag(a),
                    "modified_at": _iso_time(mtime), "size": size, "digest": digest,
                    "details": {**facts.details, "parent_model": base}})
    return out


@get("/tags", summary="Ollama: the models this server has (the one it serves, its adapters)")
async def tags(state: State) -> Any:
    served = _served(state)
    return {"models": _listed(served, await _facts(state, served))}


@get("/ps", summary="Ollama: the models loaded now (the one it serves and its adapters, for "
                    "as long as it runs)")
async def ps(state: State) -> Any:
    served = _served(state)
    # Never unloaded: Ollama's own "forever" is now + the longest Go duration (292 years).
    forever = _iso(datetime.now(UTC) + timedelta(days=292 * 365))
    # size_vram (always present in Ollama's answer): the model's bytes on the GPU, all of them
    # with --gpu (every layer offloaded), else none
    on_gpu = served.aengine.engine.config.gpu
    return {"models": [
        {k: v for k, v in m.items() if k != "modified_at"}
        | {"expires_at": forever, "context_length": served.aengine.max_request_tokens,
           "size_vram": m["size"] if on_gpu else 0}
        for m in _listed(served, await _facts(state, served))]}


# Ollama clients tell a model that fills in the middle by its Go template's {{ .Suffix }}
# (Continue's autocomplete sends /api/generate's suffix only then, and otherwise lays out the
# FIM prompt itself, raw); this server's template is Jinja, so such a model's gets this
# comment (a comment: the template renders as before).
_FIM_NOTE = ("\n{#- justllm: /api/generate with a suffix fills in the middle with this model's "
             "FIM tokens, {{ .Prompt }} before the gap and {{ .Suffix }} after it #}")


def _capabilities(served: Served) -> list[str]:
    """What the model can do, in Ollama's words: an encoder (a BERT-like embedding model)
    only makes embeddings, as Ollama lists one; a reranker makes none (it scores pairs, at
    /v1/rerank, which Ollama has no word for)."""
    makes = served.embeddings is not None and served.aengine.pooling != "rank"
    embedding = ["embedding"] if makes else []
    if not served.aengine.generates:
        return embedding
    return (["completion", "tools"] + embedding
            + ([] if served.aengine.fim_tokens().missing() else ["insert"])
            + (["thinking"] if served.completions.template.thinks else []))


@post("/show", status_code=200, summary="Ollama: what is known of a model")
async def show(data: JSONBody[OllamaShowRequest], request: Request, state: State) -> Any:
    served = _served(state)
    req = await decode_request(request, OllamaShowRequest)
    if req.model and req.name and req.model != req.name:
        raise InvalidRequestError("name: the older name of model; send one of them",
                                  param="name")
    name = req.model or req.name
    lora = _check_model(name, served)
    if req.verbose:
        raise InvalidRequestError("verbose: the GGUF's array values (the vocabulary) are not "
                                  "listed; leave verbose out", param="verbose")
    facts = await _facts(state, served)
    template = served.completions.template
    parameters = [("num_ctx", served.aengine.max_request_tokens),
                  ("temperature", DEFAULT_TEMPERATURE), ("top_k", DEFAULT_TOP_K),
                  ("top_p", DEFAULT_TOP_P), ("repeat_penalty", DEFAULT_REPEAT_PENALTY),
                  ("repeat_last_n", DEFAULT_REPEAT_LAST_N),
                  *(("stop", msgspec.json.encode(s).decode()) for s in template.stop)]
    lines = "\n".join(f"{k:<30} {v}" for k, v in parameters)
    adapter_line = "" if lora is None else f"ADAPTER {os.path.abspath(lora.path)}\n"
    modelfile = (f"# Modelfile generated by justllm {__version__}\n"
                 f"FROM {os.path.abspath(served.aengine.model_path)}\n{adapter_line}"
                 + "\n".join(f"PARAMETER {k} {v}" for k, v in parameters))
    details = facts.details if lora is None else {**facts.details, "parent_model": _tag(served)}
    capabilities = _capabilities(served)
    body: dict[str, Any] = {
        "modelfile": modelfile, "parameters": lines,
        "template": template.source + (_FIM_NOTE if "insert" in capabilities else ""),
        "details": details, "model_info": facts.model_info,
        "capabilities": capabilities,
        "modified_at": _iso_time(served.created)}
    if facts.license is not None:
        body["license"] = facts.license
    return body


@get("/version", summary="Ollama: the server's version (justllm's)")
async def version() -> Any:
    return {"version": __version__}


# Ollama answers HEAD on these two as on "/" (health checks use them).
@head(["/tags", "/version"], summary="Ollama: headers only", media_type="application/json")
async def head_only() -> None:
    return None


# Ollama's model management is refused with what to do instead (left out of the OpenAPI
# document: the refusal is the documented answer, whatever the body).
@post(["/pull", "/push", "/create", "/copy"], status_code=200, include_in_schema=False)
async def manage(request: Request) -> Any:
    raise _unmanaged(request)


@delete("/delete", status_code=200, include_in_schema=False)
async def remove(request: Request) -> None:
    raise _unmanaged(request)


def _unmanaged(request: Request) -> APIError:
    # A 400, not Ollama's missing route or a 501: the request is one this server refuses, and
    # the answer says what to do instead.
    return APIError(400, f"{request.url.path}: `justllm serve` serves the model it was started "
                         "with and does not manage models over HTTP; use `justllm pull`, "
                         "`justllm models` and `justllm rm` on the server's machine",
                    type="invalid_request_error")


# ---- root and errors -----------------------------------------------------------------------

@get("/", summary="Ollama's liveness answer", media_type="text/plain")
async def root() -> str:
    return "Ollama is running"


@head("/", summary="Ollama's liveness answer (headers only)", media_type="text/plain")
async def root_head() -> None:
    return None


def ollama_error(_: Request, exc: Exception) -> Response:
    """Ollama's error shape, ``{"error": "message"}``, with the status the OpenAI side would
    give."""
    return ollama_response(to_api_error(exc))


def ollama_router() -> Router:
    """The ``/api`` routes, behind the same API key guard as ``/v1``."""
    return Router(path="/api", route_handlers=[
        chat, generate, embed, embeddings, tags, ps, show, version, head_only, manage,
        remove],
        guards=[require_api_key], exception_handlers={Exception: ollama_error})
