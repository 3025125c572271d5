"""llama-server's native ``POST /completion``, for clients written against it (SillyTavern's
llama.cpp backend, llama.cpp's own examples, scripts that read ``content``).

Its body and answer are llama-server's, not OpenAI's: ``prompt`` as a string, token ids,
mixed strings and ids, ``{"prompt_string"}``, or several of those (an array of answers; an
empty string is BOS alone); ``n_predict`` (-1: until
the context is full or the model ends); llama.cpp's sampling defaults (temperature 0.8, top_k
40, top_p 0.95, min_p 0.05) applied in **llama.cpp's order** -- top_k, top_p and min_p cut the
untempered distribution and the temperature comes last, or the order ``samplers`` gives --
so a client gets the distributions it asked for (OpenAI's routes temper first); ``n_probs``;
``grammar`` / ``json_schema``; ``stream`` as ``data: {...}`` events without ``[DONE]``. The
answer has ``content``, ``tokens``, ``stop_type``, ``stopping_word``, ``timings``,
``generation_settings``, ``completion_probabilities``.

llama.cpp samplers justllm has not (DRY, XTC, typical-p, top-n-sigma, mirostat, dynamic
temperature) and the slot and context-shift fields are accepted only at the values that
turn them off, so every field is honoured or refused with a 400 naming it.
"""

from __future__ import annotations

import math
import random
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Any

import msgspec
from litestar import Request, post
from litestar.datastructures import State
from litestar.params import JSONBody

from justllm.core.request import FinishReason
from justllm.core.sampling_params import (
    CHAIN_SAMPLERS,
    MAX_LOGPROBS,
    MAX_TEMPERATURE,
    TOP_P_BEST_ALONE,
    SamplingParams,
)
from justllm.engine.async_engine import AsyncEngine, RequestStream, grammar_limits
from justllm.engine.engine import PreparedRequest, RequestMetrics, RequestOutput, TokenLogprob
from justllm.errors import InvalidRequestError
from justllm.server.app import (
    Served,
    _served,
    decode_request,
    origin,
    sse_response,
    unless_disconnected,
)
from justllm.server.errors import llama_server_error, to_api_error
from justllm.server.line_limits import LineLimits
from justllm.server.lora import request_lora
from justllm.server.openai_serving import MAX_REQUEST_STOP, one_value, text_size, token_id
from justllm.server.schemas import LoraChoice, NullAsDefault, NullBool, NullFloat, NullInt

# llama.cpp's sampler names (and its one-letter forms) in ``samplers``; the ones justllm has
# not are kept out of the chain, their settings accepted only where they do nothing.
_BY_CHAR = {"e": "penalties", "d": "dry", "s": "top_n_sigma", "k": "top_k", "y": "typ_p",
            "p": "top_p", "m": "min_p", "t": "temperature", "x": "xtc", "i": "infill"}
_NO_OPS = frozenset({"dry", "top_n_sigma", "typ_p", "xtc"})  # off at the only values accepted
DEFAULT_SAMPLERS = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p",
                    "xtc", "temperature")
# The names llama.cpp reads (lowercased): each canonical one, its kebab-case and its form
# without the underscore (top-k, topk), and nucleus, temp, typ.
_BY_NAME = {alias: name for name in (*DEFAULT_SAMPLERS, "infill")
            for alias in (name, name.replace("_", "-"), name.replace("_", ""))} | {
    "nucleus": "top_p", "temp": "temperature", "typ": "typ_p"}


class LlamaCompletionRequest(NullAsDefault, kw_only=True):
    """llama-server's /completion body, with its defaults (a null is the default)."""

    prompt: Any
    model: str | None = None
    n_predict: int | None = None
    max_completion_tokens: int | None = None  # llama-server's other names for n_predict
    max_tokens: int | None = None
    temperature: NullFloat = 0.8
    top_k: NullInt = 40
    top_p: NullFloat = 0.95
    min_p: NullFloat = 0.05
    repeat_penalty: NullFloat = 1.0
    repeat_last_n: NullInt = 64
    presence_penalty: NullFloat = 0.0
    frequency_penalty: NullFloat = 0.0
    seed: NullInt = -1
    stop: list[str] | str | None = None
    ignore_eos: NullBool = False
    logit_bias: list[list[Any]] | dict[str, Any] | None = None
    n_probs: int | None = None
    logprobs: int | None = None  # llama-server's other name for n_probs
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    stream: NullBool = False
    return_tokens: NullBool = False
    samplers: list[str] | str | None = None
    response_fields: list[str] | None = None
    n_keep: NullInt = 0
    # Accepted only where they change nothing (_OFF).
    typical_p: NullFloat = 1.0
    dynatemp_range: NullFloat = 0.0
    dynatemp_exponent: NullFloat = 1.0
    top_n_sigma: NullFloat = -1.0
    xtc_probability: NullFloat = 0.0
    xtc_threshold: NullFloat = 0.1
    dry_multiplier: NullFloat = 0.0
    dry_base: NullFloat = 1.75
    dry_allowed_length: NullInt = 2
    dry_penalty_last_n: NullInt = -1
    dry_sequence_breakers: list[str] | None = None
    mirostat: NullInt = 0
    mirostat_tau: NullFloat = 5.0
    mirostat_eta: NullFloat = 0.1
    min_keep: NullInt = 0
    post_sampling_probs: NullBool = False
    cache_prompt: NullBool = True
    n_cmpl: NullInt = 1
    n: NullInt = 1  # llama-server's other name for n_cmpl
    adaptive_target: NullFloat = -1.0
    adaptive_decay: NullFloat = 0.9
    verbose: NullBool = False
    backend_sampling: NullBool = False
    # No slots here: every request reads the one shared prefix cache, which is what a client
    # pinning its requests to a slot wants (llama.vim sends 0); -1 or any slot number.
    id_slot: NullInt = -1
    n_discard: NullInt = 0
    n_indent: NullInt = 0  # server/line_limits.py
    n_cache_reuse: NullInt = 0
    t_max_predict_ms: NullInt = 0  # server/line_limits.py
    # llama.vim sends it; llama-server does not apply it (a TODO in its request schema), and
    # neither does justllm: the prompt is computed whole, however long it takes.
    t_max_prompt_ms: NullInt = -1
    timings_per_token: NullBool = False
    return_progress: NullBool = False
    lora: list[LoraChoice] | None = None  # as on the OpenAI routes (server/lora.py)
    # Speculative decoding per request, as on the OpenAI routes (llama-server's own names)
    speculative_n_max: int | None = msgspec.field(default=None, name="speculative.n_max")
    speculative_p_min: float | None = msgspec.field(default=None, name="speculative.p_min")



_ONE_COMPLETION = (lambda v: v == 1, "one completion per prompt (send the prompt again, or "
                                     "use /v1/completions' n)")
# field -> (is the value off?, why a value that is not is refused)
_OFF: dict[str, tuple[Any, str]] = {
    "typical_p": (lambda v: v >= 1.0, "locally typical sampling is not offered (1.0: off)"),
    "dynatemp_range": (lambda v: v <= 0.0, "dynamic temperature is not offered (0: off)"),
    "top_n_sigma": (lambda v: v <= 0.0, "top-n-sigma is not offered (-1: off)"),
    "xtc_probability": (lambda v: v <= 0.0, "XTC is not offered (0: off)"),
    "dry_multiplier": (lambda v: v == 0.0, "DRY is not offered (0: off)"),
    "mirostat": (lambda v: v == 0, "mirostat is not offered (0: off)"),
    "min_keep": (lambda v: v in (0, 1), "min_keep above 1 is not offered"),
    "post_sampling_probs": (lambda v: not v, "n_probs are the model's probabilities before "
                                             "sampling here (false)"),
    "n_cmpl": _ONE_COMPLETION,
    "n": _ONE_COMPLETION,  # (llama-server's other name for n_cmpl)
    "adaptive_target": (lambda v: v < 0.0, "adaptive-p sampling is not offered (-1: off)"),
    "verbose": (lambda v: not v, "the debug fields are not offered (false)"),
    "backend_sampling": (lambda v: not v, "sampling in the decode graph is not offered here "
                                          "(false)"),
    "id_slot": (lambda v: v >= -1, "a slot number, or -1 (any)"),
    "n_keep": (lambda v: v in (0, -1), "the context is never shifted here: a request that "
                                       "fills it ends (0 or -1)"),
    "n_discard": (lambda v: v == 0, "the context is never shifted here (0)"),
    "n_indent": (lambda v: v >= 0, "an indentation in spaces or tabs, >= 0 (0: off)"),
    "n_cache_reuse": (lambda v: v == 0, "KV-shift cache reuse is not offered (0); shared "
                                        "prefixes are reused anyway"),
    "t_max_predict_ms": (lambda v: v >= -1, "milliseconds, or 0 or -1 (no limit)"),
    "timings_per_token": (lambda v: not v, "timings come with the last event (false)"),
    "return_progress": (lambda v: not v, "prompt progress is not reported (false)"),
}


@dataclass(frozen=True)
class _Plan:
    """A checked request: its sampler steps (llama.cpp's names, in its order), its stop
    strings and its token limit (None: until the context is full)."""

    steps: tuple[str, ...]
    stop: tuple[str, ...]
    max_tokens: int | None

    @property
    def chain(self) -> tuple[str, ...]:
        """The steps the sampler applies (the others are off at every value accepted)."""
        return tuple(s for s in self.steps if s in CHAIN_SAMPLERS)

    @property
    def penalties(self) -> bool:
        return "penalties" in self.steps

    @property
    def tempered(self) -> bool:
        return "temperature" in self.steps


def _steps(samplers: list[str] | str | None) -> list[str]:
    if samplers is None:
        return list(DEFAULT_SAMPLERS)
    if isinstance(samplers, str):
        unknown = [c for c in samplers if c not in _BY_CHAR]
        if unknown:
            raise InvalidRequestError(f"samplers: unknown sampler '{unknown[0]}' (known: "
                                      f"{''.join(_BY_CHAR)})", param="samplers")
        return [_BY_CHAR[c] for c in samplers]
    steps = []
    for name in samplers:
        step = _BY_NAME.get(name.lower())
        if step is None:
            raise InvalidRequestError(f"samplers: unknown or unsupported sampler '{name}' "
                                      f"(known: {', '.join(DEFAULT_SAMPLERS)})",
                                      param="samplers")
        steps.append(step)
    return steps


def check_completion(req: LlamaCompletionRequest) -> _Plan:
    """The checks that need no model (router mode runs them before a load)."""
    for name, (off, why) in _OFF.items():
        if not off(getattr(req, name)):
            raise InvalidRequestError(f"{name}: {why}", param=name)
    if req.grammar and req.json_schema is not None:
        raise InvalidRequestError("grammar and json_schema: give one", param="json_schema")
    if req.grammar:
        grammar_limits(req.grammar, "grammar")
    if not 0 <= _n_probs(req) <= MAX_LOGPROBS:
        raise InvalidRequestError(f"n_probs must be in [0, {MAX_LOGPROBS}]", param="n_probs")
    n = _one_setting(req, _N_PREDICT)
    if n is not None and n < -1:
        raise InvalidRequestError("n_predict must be >= 0, or -1 (until the context is full)",
                                  param="n_predict")
    if req.repeat_last_n < -1:
        raise InvalidRequestError("repeat_last_n must be >= 0, or -1 (the whole context)",
                                  param="repeat_last_n")
    if not req.temperature <= MAX_TEMPERATURE:  # (as the engine's "[0, 100]" would say it)
        raise InvalidRequestError(f"temperature must be at most {MAX_TEMPERATURE:g} (0 or "
                                  "less: the best token alone, as llama.cpp reads it)",
                                  param="temperature")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if len(stop) > MAX_REQUEST_STOP:
        raise InvalidRequestError(f"at most {MAX_REQUEST_STOP} stop strings", param="stop")
    steps = _steps(req.samplers)
    penalised = (req.repeat_penalty != 1.0 or req.presence_penalty != 0.0
                 or req.frequency_penalty != 0.0)
    # (presence and frequency are subtracted from the logits: after the temperature they
    # weigh otherwise than before it, where the engine applies them)
    subtracted = req.presence_penalty != 0.0 or req.frequency_penalty != 0.0
    after = [i for i, s in enumerate(steps) if s in ("top_k", "top_p", "min_p")
             or (subtracted and s == "temperature")]
    if penalised and "penalties" in steps and after and steps.index("penalties") > after[0]:
        raise InvalidRequestError("samplers: penalties after a cut, or presence and frequency "
                                  "penalties after the temperature, are not offered "
                                  "(penalties come first here)", param="samplers")
    plan = _Plan(tuple(steps), stop, max_tokens=None if n is None or n == -1 else n)
    SamplingParams(**_sampling(req, plan, seed=None, logit_bias=()))  # the value checks
    return plan


# llama-server's names for one setting: a request may give it under any, or several alike.
_N_PREDICT = ("n_predict", "max_completion_tokens", "max_tokens")
_N_PROBS = ("n_probs", "logprobs")


def _one_setting(req: LlamaCompletionRequest, names: tuple[str, ...]) -> Any:
    """The value of the setting ``names`` name (None: not given); two of them given at odds
    are a 400 naming both, where llama-server would read the first and ignore the other."""
    return one_value({name: getattr(req, name) for name in names})


def _n_probs(req: LlamaCompletionRequest) -> int:
    n = _one_setting(req, _N_PROBS)
    return 0 if n is None else n


def _sampling(req: LlamaCompletionRequest, plan: _Plan, seed: int | None,
              logit_bias: tuple[tuple[int, float], ...]) -> dict[str, Any]:
    penalties = plan.penalties
    return dict(
        max_tokens=plan.max_tokens,
        # temperature <= 0 keeps the best token alone (greedy); without the temperature step
        # the distribution is the model's own (1).
        temperature=max(req.temperature, 0.0) if plan.tempered else 1.0,
        top_k=max(req.top_k, 0), top_p=_top_p(req.top_p), min_p=req.min_p,
        repeat_penalty=req.repeat_penalty if penalties else 1.0,
        # -1: the whole context (every token of the request, as vLLM's rule counts them)
        repeat_last_n=2**31 - 1 if req.repeat_last_n == -1 else req.repeat_last_n,
        presence_penalty=req.presence_penalty if penalties else 0.0,
        frequency_penalty=req.frequency_penalty if penalties else 0.0,
        llama_penalties=True,  # (as llama-server counts them: the prompt too, in the window)
        seed=seed, stop=plan.stop, ignore_eos=req.ignore_eos,
        logit_bias=logit_bias, logprobs=_n_probs(req) or None, samplers=plan.chain,
        cache_prompt=req.cache_prompt, spec_n_max=req.speculative_n_max,
        spec_p_min=req.speculative_p_min)


def _top_p(top_p: float) -> float:
    """llama.cpp's top_p as the sampler takes it: 1 and above is off, 0 and below keeps the
    best token alone (llama-server takes any number)."""
    return min(top_p, 1.0) if top_p > 0.0 else TOP_P_BEST_ALONE


_INT_KEY = re.compile(r"-?[0-9]+")  # an id as an object key (ASCII digits)


def _logit_bias(req: LlamaCompletionRequest, aengine: AsyncEngine
                ) -> tuple[tuple[int, float], ...]:
    """``[[token or text, bias or false], ...]`` or ``{"token or text": bias}``: a text biases
    each of its tokens; ``false`` bans the token (-100, as OpenAI's strongest bias)."""
    given = req.logit_bias
    pairs = list(given.items()) if isinstance(given, dict) else given or []
    out: dict[int, float] = {}
    for pair in pairs:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise InvalidRequestError("logit_bias entries are [token or text, bias]",
                                      param="logit_bias")
        key, value = pair
        if value is False:
            value = -100.0
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidRequestError("a logit_bias is a number or false", param="logit_bias")
        if isinstance(key, str) and isinstance(given, dict) and _INT_KEY.fullmatch(key):
            ids = [token_id(key)]  # OpenAI's form: ids as keys (a negative one refused below)
        elif isinstance(key, str):
            ids = aengine.tokenize(key, add_special=False, parse_special=False)
            if not ids:  # (an empty text biased nothing, without a word)
                raise InvalidRequestError(f"logit_bias: the text {key!r} has no tokens",
                                          param="logit_bias")
        elif isinstance(key, int) and not isinstance(key, bool):
            ids = [key]
        else:
            raise InvalidRequestError("a logit_bias key is a token id or a text",
                                      param="logit_bias")
        aengine.check_token_ids(ids, "logit_bias")
        for token in ids:
            try:
                out[token] = float(value)
            except OverflowError:  # an int past a float's range: refused as any bias past 100
                out[token] = math.inf if value > 0 else -math.inf
    return tuple(out.items())


def llama_prompts(value: object, aengine: AsyncEngine, field: str = "prompt"
                  ) -> list[str | list[int]]:
    """llama-server's prompt forms (in ``field``: its /completion's ``prompt``, its native
    embeddings' ``input`` or ``content``): a string, token ids, strings and ids mixed (the
    first string's tokens start with BOS, as its tokenize_mixed does), ``{"prompt_string": one
    of those}`` (its multimodal form, without ``multimodal_data`` here), or an array of those.
    An empty string is its BOS alone, as llama-server reads it (the model writes from the
    start of a document)."""
    def one(p: object) -> str | list[int]:
        if isinstance(p, dict):
            return one(_prompt_string(p, field))
        if isinstance(p, str):
            return p or aengine.tokenize("")
        if isinstance(p, list) and p and all(isinstance(x, (int, str)) and not isinstance(
                x, bool) for x in p):
            if all(isinstance(x, int) for x in p):
                return list(p)
            tokens: list[int] = []
            for i, x in enumerate(p):
                tokens += ([x] if isinstance(x, int) else aengine.tokenize(x, add_special=i == 0))
            return tokens
        raise InvalidRequestError(f"{field}: each is a string, token ids, strings and token "
                                  "ids mixed, or {\"prompt_string\": one of those}", param=field)

    single = isinstance(value, str | dict) or (isinstance(value, list) and any(
        isinstance(x, int) and not isinstance(x, bool) for x in value))
    items = [value] if single else value
    if not isinstance(items, list) or not items:
        raise InvalidRequestError(f"{field} must be a string, token ids, or an array of "
                                  "those", param=field)
    return [one(p) for p in items]


def _prompt_string(p: dict[str, Any], field: str) -> object:
    """The prompt of llama-server's object form; its images and sounds (``multimodal_data``)
    need a multimodal projector, which justllm does not load, and no other key is read."""
    if "multimodal_data" in p:
        raise InvalidRequestError("multimodal_data: this server runs text models only (no "
                                  "multimodal projector)", param=f"{field}.multimodal_data")
    other = sorted(set(p) - {"prompt_string"})
    if other:
        raise InvalidRequestError(f"{field}.{other[0]}: not a field of a prompt object (it "
                                  "has prompt_string)", param=f"{field}.{other[0]}")
    if "prompt_string" not in p:
        raise InvalidRequestError(f"a {field} object needs prompt_string", param=field)
    if isinstance(p["prompt_string"], dict):
        raise InvalidRequestError(f"{field}.prompt_string: a string, token ids, or both mixed",
                                  param=f"{field}.prompt_string")
    return p["prompt_string"]


def _settings(req: LlamaCompletionRequest, plan: _Plan, seed: int, served: Served,
              lora: tuple[tuple[str, float], ...]) -> dict[str, Any]:
    """generation_settings: what the request ran with, in llama-server's names."""
    applied = dict(lora)
    return {
        "n_predict": -1 if plan.max_tokens is None else plan.max_tokens,
        "seed": seed, "temperature": req.temperature, "dynatemp_range": req.dynatemp_range,
        "dynatemp_exponent": req.dynatemp_exponent, "top_k": req.top_k, "top_p": req.top_p,
        "min_p": req.min_p, "top_n_sigma": req.top_n_sigma,
        "xtc_probability": req.xtc_probability, "xtc_threshold": req.xtc_threshold,
        "typical_p": req.typical_p, "repeat_last_n": req.repeat_last_n,
        "repeat_penalty": req.repeat_penalty, "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty, "dry_multiplier": req.dry_multiplier,
        "dry_base": req.dry_base, "dry_allowed_length": req.dry_allowed_length,
        "dry_penalty_last_n": req.dry_penalty_last_n,
        "dry_sequence_breakers": req.dry_sequence_breakers or ["\n", ":", "\"", "*"],
        "mirostat": req.mirostat, "mirostat_tau": req.mirostat_tau,
        "mirostat_eta": req.mirostat_eta,
        "max_tokens": -1 if plan.max_tokens is None else plan.max_tokens,
        "n_keep": req.n_keep, "n_discard": req.n_discard, "ignore_eos": req.ignore_eos,
        "stream": req.stream, "n_probs": _n_probs(req), "min_keep": req.min_keep,
        "samplers": list(plan.steps), "stop": list(plan.stop),
        "grammar": req.grammar or "", "n_ctx": served.aengine.max_request_tokens,
        "model": served.model_id, "post_sampling_probs": False, "timings_per_token": False,
        "lora": [{"id": a.id, "scale": applied[a.name]}
                 for a in served.aengine.lora_adapters() if a.name in applied],
    }


def _timings(m: RequestMetrics) -> dict[str, float | int]:
    end = m.finished_time or time.perf_counter()
    first = m.first_token_time or end
    start = m.scheduled_time or m.arrival_time
    prompt_n = m.num_prompt_tokens - m.num_cached_tokens
    prompt_ms, predicted_ms = (first - start) * 1e3, (end - first) * 1e3
    n = m.num_generated_tokens
    return {"cache_n": m.num_cached_tokens, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": prompt_n * 1e3 / prompt_ms if prompt_ms else 0.0,
            "predicted_n": n, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / n if n else 0.0,
            "predicted_per_second": n * 1e3 / predicted_ms if predicted_ms else 0.0}


@dataclass
class _Answer:
    """One prompt's answer so far."""

    prompt: str  # as processed: special tokens written (<bos>)
    settings: dict[str, Any]
    limits: LineLimits
    text: str = ""
    tokens: list[int] | None = None
    probs: list[dict[str, Any]] | None = None


def _fields(fields: list[str], res: dict[str, Any]) -> dict[str, Any]:
    """llama-server's response_fields: the named fields only; ``a/b`` is ``res[a][b]``, under
    the key ``a/b`` (as its server answers); a field that is not there is left out."""
    out: dict[str, Any] = {}
    for path in fields:
        value: Any = res
        for part in path.split("/"):
            if not isinstance(value, dict) or part not in value:
                break
            value = value[part]
        else:
            out[path] = value
    return out


def _within(probs: list[dict[str, Any]], content: str) -> list[dict[str, Any]]:
    """The entries of the tokens that make up ``content``: a stop word's own tokens are left
    out, as llama-server leaves them."""
    room, kept = len(content.encode()), []
    for p in probs:
        room -= len(p["bytes"])
        if room < 0:
            break
        kept.append(p)
    return kept


class _Completion:
    """A checked /completion request on its way: its prompts, their answers, its events."""

    def __init__(self, served: Served, req: LlamaCompletionRequest, plan: _Plan,
                 prepared: list[PreparedRequest], seed: int) -> None:
        self.served, self.req, self.plan = served, req, plan
        self.model = served.completions.answer_model(req.model)  # an adapter's name, if named
        settings = _settings(req, plan, seed, served, prepared[0].params.lora if prepared
                             else ())
        token_bytes = served.aengine.token_bytes
        self.answers = [_Answer(b"".join(token_bytes(t, special=True) for t in p.tokens)
                                .decode("utf-8", "replace"), settings,
                                LineLimits(req.n_indent, max(req.t_max_predict_ms, 0)),
                                tokens=[], probs=[] if _n_probs(req) else None)
                        for p in prepared]
        self.stopped: set[int] = set()  # answers ended here by their LineLimits

    def _probs(self, lps: list[TokenLogprob]) -> list[dict[str, Any]]:
        piece = self.served.aengine.token_bytes

        def entry(token: int, value: float) -> dict[str, Any]:
            raw = piece(token)
            return {"id": token, "token": raw.decode("utf-8", "ignore"), "bytes": list(raw),
                    "logprob": value}
        return [{**entry(lp.token_id, lp.logprob),
                 "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]

    def add(self, i: int, out: RequestOutput, stream: RequestStream) -> str:
        """Take ``out`` into its answer; returns the text it adds. An answer its line limits
        end is aborted (its stream) and listed in ``stopped``."""
        a = self.answers[i]
        text, stop = a.limits.feed(out.text, time.perf_counter()) if a.limits.active else (
            out.text, False)
        a.text += text
        assert a.tokens is not None
        a.tokens += out.token_ids
        if a.probs is not None and out.logprobs:
            a.probs += self._probs(out.logprobs)
        if stop:
            self.stopped.add(i)
            if not out.finished:  # (its record says length, as the answer does)
                stream.abort(FinishReason.LENGTH)
        return text

    def final(self, i: int, out: RequestOutput, content: str, stream: bool) -> dict[str, Any]:
        """The answer's last event; ``out``: its last output (one its line limits ended it
        at, if they did)."""
        a, m = self.answers[i], out.metrics
        cut = i in self.stopped
        limited = out.finish_reason == "length" or cut
        res: dict[str, Any] = {
            "index": i, "content": content,
            "tokens": [] if stream or not self.req.return_tokens else a.tokens,
            "id_slot": -1,  # no slots here; -1 (any) is what a client may send back
            "stop": True, "model": self.model,
            "tokens_predicted": m.num_generated_tokens, "tokens_evaluated": m.num_prompt_tokens,
            "generation_settings": a.settings, "prompt": a.prompt,
            "has_new_line": "\n" in a.text,
            # the context filled before n_predict (or with -1) was reached
            "truncated": limited and not cut and (
                self.plan.max_tokens is None or m.num_generated_tokens < self.plan.max_tokens),
            "stop_type": "limit" if cut else "word" if out.stop is not None
            else "limit" if limited else "eos",
            "stopping_word": out.stop or "", "tokens_cached": m.num_cached_tokens,
            "timings": _timings(m)}
        if a.probs and not stream:
            res["completion_probabilities"] = _within(a.probs, content) if out.stop else a.probs
        return _fields(self.req.response_fields, res) if self.req.response_fields else res

    def chunk(self, i: int, out: RequestOutput, text: str) -> dict[str, Any]:
        res: dict[str, Any] = {"index": i, "content": text, "tokens": out.token_ids,
                               "stop": False, "id_slot": -1,
                               "tokens_predicted": len(self.answers[i].tokens or []),
                               "tokens_evaluated": out.metrics.num_prompt_tokens}
        if out.logprobs:
            res["completion_probabilities"] = self._probs(out.logprobs)
        return res


async def _full(c: _Completion, streams: list[RequestStream]) -> Any:
    finals: list[dict[str, Any] | None] = [None] * len(streams)
    async with aclosing(c.served.completions.merged(streams, c.stopped)) as merged:
        async for i, out in merged:
            if i in c.stopped:
                continue  # (an output that came before its stream was aborted)
            if out.error:
                raise c.served.completions.failure(out)
            c.add(i, out, streams[i])
            if out.finished or i in c.stopped:
                finals[i] = c.final(i, out, c.answers[i].text, stream=False)
    return finals[0] if len(finals) == 1 else finals


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


async def _events(c: _Completion, streams: list[RequestStream]) -> AsyncIterator[bytes]:
    """One event per step's new text (with its tokens), then the full answer with
    ``stop: true``; an error ends the stream as ``{"error": ...}``, in llama-server's shape
    (errors.llama_server_error). No ``[DONE]``."""
    async with aclosing(c.served.completions.merged(streams, c.stopped)) as merged:
        async for i, out in merged:
            if i in c.stopped:
                continue  # (an output that came before its stream was aborted)
            if out.error:
                yield _event(llama_server_error(to_api_error(c.served.completions.failure(out))))
                return
            text = c.add(i, out, streams[i])
            if text or out.token_ids:
                yield _event(c.chunk(i, out, text))
            if out.finished or i in c.stopped:
                yield _event(c.final(i, out, "", stream=True))


def _prepare(aengine: AsyncEngine, prompt: str | list[int], params: SamplingParams
             ) -> PreparedRequest:
    """An ``n_predict`` the context has no room for fills the context instead (llama-server's
    way: the answer ends ``truncated``), where OpenAI's routes refuse it."""
    try:
        return aengine.prepare(prompt, params)
    except InvalidRequestError as e:
        if e.param != "max_tokens" or params.max_tokens is None:
            raise
        return aengine.prepare(prompt, replace(params, max_tokens=None))


@post(["/completion", "/completions"], status_code=200,
      summary="llama-server's /completion: its body, sampler order and answer")
async def completion(data: JSONBody[LlamaCompletionRequest], request: Request,
                     state: State) -> Any:
    req = await decode_request(request, LlamaCompletionRequest)
    return await answer(request, _served(state), req, text_size(req.prompt),
                        lambda aengine: llama_prompts(req.prompt, aengine), "llama.completion")


async def answer(request: Request, served: Served, req: LlamaCompletionRequest, size: int,
                 prompts: Callable[[AsyncEngine], list[str | list[int]]], kind: str) -> Any:
    """A /completion-shaped request answered (``kind``: the route, for the records):
    ``prompts`` gives its prompts on a worker thread (``size``: about how much text that
    reads), each answered as /completion answers it."""
    served.completions.check_model(req.model)
    plan = check_completion(req)
    # -1 draws a seed, reported in generation_settings, so the answer can be had again
    # (any other value is taken as llama.cpp's unsigned 32-bit seed: -5 is 4294967291)
    seed = random.getrandbits(32) if req.seed == -1 else req.seed % 2**32
    aengine = served.aengine
    lora = request_lora(aengine, req.model, req.lora)

    def ready() -> list[PreparedRequest]:
        grammar = None
        if req.grammar:
            aengine.check_grammar(req.grammar, "grammar")
            grammar = req.grammar
        elif req.json_schema is not None:
            try:
                grammar = aengine.json_grammar(req.json_schema)
            except InvalidRequestError as e:
                raise InvalidRequestError(f"json_schema: {e}", param="json_schema") from None
        bias = _logit_bias(req, aengine)
        if req.ignore_eos:  # llama-server's: the end tokens can never be drawn
            bias = tuple((dict(bias) | dict.fromkeys(aengine.eog_ids(), -100.0)).items())
        params = SamplingParams(**_sampling(req, plan, seed, bias), grammar=grammar, lora=lora)
        listed = prompts(aengine)
        most = aengine.engine.config.max_queue
        if len(listed) > most:  # it could never be queued: a 400, not a 429 to retry
            raise InvalidRequestError(f"this request has {len(listed)} prompts; the server "
                                      f"queues at most {most} (--max-queue)", param="prompt")
        return [_prepare(aengine, p, params) for p in listed]

    prepared = await aengine.off_loop(size, ready)
    c = _Completion(served, req, plan, prepared, seed)
    streams = served.completions.submit(prepared, f"cmpl-{uuid.uuid4().hex}",
                                        served.completions.answered_as(
                                            origin(request, kind, req.stream), req.model))
    if req.stream:
        return sse_response(_events(c, streams))
    return await unless_disconnected(request, _full(c, streams))
