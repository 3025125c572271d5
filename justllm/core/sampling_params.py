"""Per-request sampling parameters, validated once on construction."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from justllm.errors import InvalidRequestError

MAX_LOGPROBS = 20
# llama.cpp's nucleus keeps at least one token, so its top_p 0 keeps the best alone: a
# nucleus this small does the same (the best token's probability is at least 1/vocabulary).
TOP_P_BEST_ALONE = 1e-12
MAX_DRAFT = 16  # draft tokens per step and request
MAX_STOP = 32  # stop strings per request (a chat template's own included)
# The longest stop string: each token looks back that far for one beginning (the engine
# thread's work, for every request in the step).
MAX_STOP_CHARS = 1000
MAX_LOGIT_BIAS = 1024  # entries of logit_bias per request
MAX_LORA_SCALE = 100.0  # |scale| of one adapter: beyond it nothing but noise comes out
# OpenAI's API stops at 2; llama-server and vLLM take any (run, bench and the server: 0-100).
MAX_TEMPERATURE = 100.0
# the steps ``samplers`` orders ("infill": llama.cpp's sampler for fill-in-the-middle)
CHAIN_SAMPLERS = ("top_k", "top_p", "min_p", "temperature", "infill")
# The infill step compares every pair of the candidates it gets: a top-k before it bounds them.
MAX_INFILL_CANDIDATES = 256
MAX_SAMPLERS = 32


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    ``max_tokens=None`` generates until the request's context is full (``--ctx``); a number
    whose sum with the prompt exceeds it is refused when the request is added.
    ``temperature == 0`` means greedy (argmax). ``top_k == 0`` means no top-k cut. ``seed``
    makes a sampled request reproducible on its own: any 64-bit integer, signed or not (vLLM
    takes int64, OpenAI any integer), kept modulo 2**64 (the generator's seeds are unsigned).
    ``stop`` strings are searched in the detokenized text (across token boundaries) and are not
    part of the output, except those also in ``keep_stops`` (vLLM's
    ``include_stop_str_in_output``: the text ends with the stop string that ended it).
    ``logit_bias`` adds a bias to a token's logit before sampling, greedy included (OpenAI's
    semantics: -100 in effect bans a token, 100 forces it).
    """

    max_tokens: int | None = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # llama.cpp's rule for those two (llama-server's /completion): over the last
    # ``repeat_last_n`` tokens, the prompt's included, where OpenAI's counts the answer alone
    llama_penalties: bool = False
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    keep_stops: tuple[str, ...] = field(default_factory=tuple)
    # vLLM's: no end-of-generation token, stop token or stop string ends the answer before
    # this many tokens (the end tokens are masked out until then).
    min_tokens: int = 0
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    logprobs: int | None = None
    # The log-probability of each prompt token after the first, and of this many alternatives
    # (vLLM's prompt_logprobs; the legacy completions' echo with logprobs). Every prompt token
    # is computed, with an output row each: no prefix-cache hit, and slower.
    prompt_logprobs: int | None = None
    # False: the prompt is computed whole, taking nothing from the prefix cache (llama-server's
    # cache_prompt: a hit's KV was computed in batches of other shapes, so its logits differ
    # in the last bits from a whole computation's). What it computes is cached as any prompt.
    cache_prompt: bool = True
    # GBNF text constraining the output (structured output); None = free text.
    grammar: str | None = None
    # Regular expressions: with any, the grammar is lazy (llama-server's): the answer is free
    # until one matches its text, and held by the grammar from where the match's first group
    # begins (a tool call under tool_choice "auto": engine/lazy_grammar.py).
    grammar_triggers: tuple[str, ...] = ()
    # Speculative decoding for this request: most draft tokens per step (0: off; None: the
    # engine's --gamma) and the draft model's confidence cut-off (None: --draft-p-min).
    spec_n_max: int | None = None
    spec_p_min: float | None = None
    # llama-server's sampler order (its ``samplers``): the order in which top_k, top_p, min_p
    # and temperature apply, each cut on the distribution the steps before it left (llama.cpp
    # applies temperature last by default: the cuts see the untempered distribution); a step
    # left out does not apply. None: OpenAI's and vLLM's order (temperature, then the cuts).
    samplers: tuple[str, ...] | None = None
    # Scheduling priority (vLLM's field): lower runs first; only with --scheduling-policy
    # priority (the engine refuses a non-zero value otherwise).
    priority: int = 0
    # LoRA adapters to run under, by name, with their scales (the engine refuses names it has
    # not loaded); empty: the base model. A mapping or pairs; kept as sorted pairs.
    lora: tuple[tuple[str, float], ...] = field(default_factory=tuple)
    # A reasoning model's thinking budget (llama-server's reasoning budget): past this many
    # tokens of thinking, the tokens that close it are forced (core/thinking_budget.py); -1:
    # none. With the model's thinking tags, and whether the prompt opened the thinking (which
    # a lazy grammar reads too: its triggers count only in the answer after the thinking).
    thinking_budget: int = -1
    thinking_tags: tuple[str, str] | None = None
    thinking_open: bool = False
    # Text forced before the end tag when the budget runs out (llama-server's
    # reasoning_budget_message); only with a budget.
    thinking_message: str = ""

    def __post_init__(self) -> None:
        # The containers first (the Python API's callers pass lists, or a str for one stop):
        # anything else named, not a TypeError from deep inside.
        for name in ("stop", "keep_stops"):
            value = getattr(self, name)
            _check(isinstance(value, (str, list, tuple)), f"{name} must be a string or a list "
                   "of strings", "stop")
            object.__setattr__(self, name, (value,) if isinstance(value, str) else tuple(value))
        for name in ("stop_token_ids", "grammar_triggers"):
            value = getattr(self, name)
            _check(isinstance(value, (list, tuple)), f"{name} must be a list", name)
            object.__setattr__(self, name, tuple(value))
        _check(self.samplers is None or isinstance(self.samplers, (list, tuple)),
               "samplers must be a list of step names", "samplers")
        for name in ("logit_bias", "lora"):
            value = getattr(self, name)
            _check(isinstance(value, (dict, list, tuple)) and (isinstance(value, dict) or all(
                isinstance(p, (list, tuple)) and len(p) == 2 for p in value)),
                f"{name} must be a mapping, or (key, value) pairs", name)
        for name in ("llama_penalties", "ignore_eos", "thinking_open", "cache_prompt"):
            _check(isinstance(getattr(self, name), bool), f"{name} must be true or false",
                   name)
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple((t, b) for t, b in bias))
        lora = tuple(self.lora.items() if isinstance(self.lora, dict) else self.lora)
        _check(all(isinstance(p, (tuple, list)) and len(p) == 2 for p in lora),
               "lora must be (adapter name, scale) pairs", "lora")
        _check(all(isinstance(n, str) and n for n, _ in lora), "lora adapter names must be "
               "non-empty strings", "lora")
        object.__setattr__(self, "lora", tuple(sorted((n, s) for n, s in lora)))
        names = [n for n, _ in self.lora]
        _check(len(set(names)) == len(names), "lora names an adapter twice", "lora")
        _check(all(_is_num(s) and abs(s) <= MAX_LORA_SCALE for _, s in self.lora),
               f"lora scales must be numbers in [-{MAX_LORA_SCALE:g}, {MAX_LORA_SCALE:g}]",
               "lora")
        _check(_is_int(self.thinking_budget) and self.thinking_budget >= -1,
               "thinking_budget must be an integer >= -1", "thinking_budget")
        if self.thinking_budget >= 0:
            tags = self.thinking_tags
            _check(isinstance(tags, tuple) and len(tags) == 2
                   and all(isinstance(t, str) and t for t in tags),
                   "a thinking budget needs the model's thinking tags", "thinking_budget")
            _check(self.grammar is None or bool(self.grammar_triggers),
                   "a thinking budget cannot be combined with a grammar (the grammar holds "
                   "the whole answer; a lazy one, only what follows the thinking)",
                   "thinking_budget")
        _check(isinstance(self.thinking_message, str), "thinking_message must be a string",
               "thinking_message")
        _check(not self.thinking_message or self.thinking_budget >= 0,
               "a thinking message needs a thinking budget", "thinking_message")
        # 0: the prompt computed (into the prefix cache; scored with prompt_logprobs), nothing
        # generated. The OpenAI routes take it only with the prompt's logprobs.
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 0),
               "max_tokens must be an integer >= 0", "max_tokens")
        _check(_is_num(self.temperature) and 0.0 <= self.temperature <= MAX_TEMPERATURE,
               f"temperature must be a number in [0, {MAX_TEMPERATURE:g}]", "temperature")
        _check(_is_int(self.top_k) and self.top_k >= 0, "top_k must be an integer >= 0", "top_k")
        _check(_is_num(self.top_p) and 0.0 <= self.top_p <= 1.0,
               "top_p must be a number in [0, 1]", "top_p")
        if self.top_p == 0.0:  # llama.cpp's, OpenAI's and Ollama's 0: the best token alone
            object.__setattr__(self, "top_p", TOP_P_BEST_ALONE)
        _check(_is_num(self.min_p) and 0.0 <= self.min_p <= 1.0,
               "min_p must be a number in [0, 1]", "min_p")
        _check(_is_num(self.repeat_penalty) and self.repeat_penalty > 0.0,
               "repeat_penalty must be a finite number > 0", "repeat_penalty")
        _check(_is_int(self.repeat_last_n) and self.repeat_last_n >= 0,
               "repeat_last_n must be an integer >= 0", "repeat_last_n")
        _check(_is_num(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0,
               "presence_penalty must be a number in [-2, 2]", "presence_penalty")
        _check(_is_num(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0,
               "frequency_penalty must be a number in [-2, 2]", "frequency_penalty")
        _check(self.seed is None or (_is_int(self.seed) and -2**63 <= self.seed < 2**64),
               "seed must be an integer in [-2**63, 2**64)", "seed")
        if self.seed is not None:
            object.__setattr__(self, "seed", self.seed % 2**64)
        _check(all(isinstance(s, str) and s for s in self.stop),
               "stop must be non-empty strings", "stop")
        _check(len(self.stop) <= MAX_STOP, f"at most {MAX_STOP} stop strings", "stop")
        _check(all(len(s) <= MAX_STOP_CHARS for s in self.stop),
               f"a stop string has at most {MAX_STOP_CHARS} characters", "stop")
        _check(len(self.logit_bias) <= MAX_LOGIT_BIAS,
               f"logit_bias has at most {MAX_LOGIT_BIAS} entries", "logit_bias")
        _check(all(_is_int(t) and t >= 0 and _is_num(b) and -100.0 <= b <= 100.0
                   for t, b in self.logit_bias),
               "logit_bias maps token ids (integers >= 0) to biases in [-100, 100]", "logit_bias")
        _check(all(s in self.stop for s in self.keep_stops),
               "keep_stops must be stop strings", "stop")
        _check(self.prompt_logprobs is None or (_is_int(self.prompt_logprobs)
                                                and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
               f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}]", "prompt_logprobs")
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids must be token ids >= 0", "stop_token_ids")
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0,
               "min_tokens must be an integer >= 0", "min_tokens")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
               f"min_tokens ({self.min_tokens}) must be at most max_tokens "
               f"({self.max_tokens})", "min_tokens")
        _check(not (self.min_tokens and self.grammar is not None),
               "min_tokens cannot be combined with a grammar (structured output, tools): the "
               "grammar decides where the answer ends", "min_tokens")
        _check(self.grammar is None or (isinstance(self.grammar, str) and self.grammar.strip() != ""),
               "grammar must be non-empty GBNF text", "grammar")
        _check(isinstance(self.grammar_triggers, tuple)
               and all(isinstance(t, str) and t and _compiles(t) for t in self.grammar_triggers),
               "grammar_triggers must be regular expressions", "grammar_triggers")
        _check(not self.grammar_triggers or self.grammar is not None,
               "grammar_triggers need a grammar", "grammar_triggers")
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
               f"logprobs must be an integer in [0, {MAX_LOGPROBS}]", "logprobs")

        _check(self.spec_n_max is None or (_is_int(self.spec_n_max) and 0 <= self.spec_n_max <= MAX_DRAFT),
               f"speculative.n_max must be an integer in [0, {MAX_DRAFT}]", "speculative.n_max")
        _check(self.spec_p_min is None or (_is_num(self.spec_p_min) and 0.0 <= self.spec_p_min <= 1.0),
               "speculative.p_min must be a number in [0, 1]", "speculative.p_min")
        if self.samplers is not None:
            object.__setattr__(self, "samplers", tuple(self.samplers))
            _check(len(self.samplers) <= MAX_SAMPLERS
                   and all(s in CHAIN_SAMPLERS for s in self.samplers),
                   f"samplers: at most {MAX_SAMPLERS} of {', '.join(CHAIN_SAMPLERS)}",
                   "samplers")
            if "infill" in self.samplers:
                before = self.samplers[:self.samplers.index("infill")]
                _check("top_k" in before and _is_int(self.top_k)
                       and 1 <= self.top_k <= MAX_INFILL_CANDIDATES,
                       f"samplers: infill needs a top_k step before it, with top_k in [1, "
                       f"{MAX_INFILL_CANDIDATES}] (it compares every pair of candidates)",
                       "samplers")
        _check(_is_int(self.priority) and abs(self.priority) < 2**63,
               "priority must be an integer", "priority")

    @property
    def shown_top_p(self) -> float:
        """top_p as the request gave it (0, the best token alone, is kept as a tiny nucleus)."""
        return 0.0 if self.top_p == TOP_P_BEST_ALONE else self.top_p

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.repeat_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def _compiles(pattern: str) -> bool:
    try:
        re.compile(pattern)
    except re.error:
        return False
    return True


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_num(value: object) -> bool:
    """A finite int or float: NaN and the infinities are no value of any float parameter
    (``repeat_penalty`` inf passed its "> 0" and made NaN logits; an int too large for a
    float is refused with them)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise InvalidRequestError(message, param=param)
