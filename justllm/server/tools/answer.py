"""A chat answer as typed values: the whole result (``ChatResult``) or the stream's events
(``ChatEvent``), with content and tool calls already apart. ``OpenAIServing.chat_result`` and
``chat_events`` produce them; the OpenAI route renders them as JSON or SSE chunks, and the
Anthropic and Responses routes translate them, so no route parses another's wire format.

``ChoiceText`` is one choice's text on its way there: the leading blank a transcript's
"Assistant:" leaves is dropped, a reasoning model's thinking is taken apart (a
``ReasoningSplitter``), and with tools the rest goes through a ``CallSplitter``; a gpt-oss
answer (OpenAI's harmony format) is read whole by a ``HarmonyText``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Union

from justllm.core.reasoning import ReasoningSplitter, split_reasoning
from justllm.engine.engine import RequestMetrics
from justllm.server.schemas import Usage
from justllm.server.tools.harmony_text import HarmonyText
from justllm.server.tools.parse import ParsedAnswer, Schemas
from justllm.server.tools.stream import CallDelta, CallSplitter, read_whole


@dataclass(frozen=True)
class ToolCall:
    id: str  # "call_<24 hex>" (9 letters and digits for Mistral-format models)
    name: str
    arguments: str  # JSON text of an object


@dataclass(frozen=True)
class ChoiceResult:
    index: int
    content: str | None  # None when the answer is only tool calls
    tool_calls: tuple[ToolCall, ...]
    finish_reason: str | None  # "stop", "length" or "tool_calls"
    logprobs: list[Any] | None = None  # engine TokenLogprobs (only without tools)
    stop: str | None = None  # the stop string that ended it (Anthropic's stop_sequence)
    reasoning: str | None = None  # a reasoning model's thinking, when it is taken apart


@dataclass(frozen=True)
class Timings:
    """The first choice's prompt (arrival to first token) and generation (first to last
    token) seconds: what Ollama reports as prompt_eval_duration and eval_duration."""

    prompt_seconds: float
    generation_seconds: float

    @classmethod
    def of(cls, m: RequestMetrics) -> Timings:
        """A request's: from its arrival to its first token, and from there to its end (now,
        while it runs)."""
        end = m.finished_time or time.perf_counter()
        first = m.first_token_time or end
        return cls(max(0.0, first - m.arrival_time), max(0.0, end - first))


@dataclass(frozen=True)
class ChatResult:
    choices: list[ChoiceResult]
    usage: Usage
    timings: Timings | None = None
    # with prompt_logprobs: the output that carried them (the first choice's)
    prompt: Any = None


@dataclass(frozen=True)
class TextDelta:
    index: int
    text: str  # "" when it carries only thinking or logprobs
    logprobs: list[Any] | None = None
    reasoning: str = ""  # a piece of a reasoning model's thinking (before any text)


@dataclass(frozen=True)
class ToolCallStart:
    index: int  # the choice
    call_index: int  # the call within the choice (OpenAI's tool_calls[].index)
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArguments:
    index: int
    call_index: int
    arguments: str  # a piece of the call's JSON arguments


@dataclass(frozen=True)
class ChoiceEnd:
    index: int
    finish_reason: str
    stop: str | None = None  # the stop string that ended it (Anthropic's stop_sequence)


@dataclass(frozen=True)
class StreamEnd:
    usage: Usage
    timings: Timings | None = None


@dataclass(frozen=True)
class StreamError:
    message: str
    code: str | None  # "shutting_down" when a shutdown aborted the request


ChatEvent = Union[TextDelta, ToolCallStart, ToolCallArguments, ChoiceEnd, StreamEnd, StreamError]


@dataclass(frozen=True)
class Thinking:
    """How a choice's thinking is taken apart: the model's tags, and whether the prompt
    opened the thinking (``core/reasoning.py``)."""

    tags: tuple[str, str]
    opened: bool = False


class ChoiceText:
    """One choice's generated text -> thinking, content and calls (``thinking`` None: the
    thinking, if any, stays in the content; ``fmt`` None: no tools, no call parsing)."""

    def __init__(self, *, lstrip: bool, fmt: str | None, names: frozenset[str] | None = None,
                 parallel: bool = True, thinking: Thinking | None = None,
                 prefix: str = "", harmony: bool = False, schemas: Schemas | None = None
                 ) -> None:
        """``schemas``: the functions' parameters schemas (the XML call forms' values are
        typed by them). ``prefix``: text the answer is read as beginning with (the start tag a prompt
        that opened the thinking ends with, when the thinking stays in the text);
        ``harmony``: the answer is in gpt-oss's format (its thinking kept in the text unless
        ``thinking`` is given)."""
        self._harmony = (HarmonyText(calls=fmt is not None, names=names, parallel=parallel,
                                     keep_thinking=thinking is None) if harmony else None)
        self._prefix = prefix  # still to give out
        self._lstrip = lstrip  # leading blanks still to drop
        self._fmt, self._names, self._parallel = fmt, names, parallel
        self._schemas = schemas
        self._thinking = thinking
        self._reasoner = (ReasoningSplitter(thinking.tags, thinking.opened)
                          if thinking and not harmony else None)
        self._splitter = (CallSplitter(fmt, names, parallel, schemas) if fmt and not harmony
                          else None)

    def _unlead(self, text: str) -> str:
        text, self._prefix = self._prefix + text, ""
        if self._lstrip:
            text = text.lstrip()
            self._lstrip = not text
        return text

    def feed(self, piece: str, held: bool = False) -> tuple[str, str]:
        """A streamed piece -> the thinking and the content to show now. ``held``: a grammar
        holds the answer now (its calls are streamed as they grow: ``deltas``)."""
        text = self._unlead(piece)
        if self._harmony is not None:
            return self._harmony.feed(text, held)
        thought = ""
        if self._reasoner is not None:
            thought, text = self._reasoner.feed(text)
        return thought, self._splitter.feed(text, held) if self._splitter else text

    def deltas(self) -> list[CallDelta]:
        """The calls' news since the last ``feed`` or ``finish`` (only where a grammar holds
        the calls; other calls come whole from ``finish``)."""
        if self._harmony is not None:
            return self._harmony.deltas()
        return self._splitter.deltas() if self._splitter is not None else []

    def finish(self) -> tuple[str, str, ParsedAnswer | None]:
        """At the stream's end: the thinking and content not shown yet, and the answer's
        calls (None without tools). The calls streamed so far are in it whole; ``deltas``
        then gives what the stream still owes of them."""
        if self._harmony is not None:
            thought, content, calls, cut = self._harmony.finish()
            return thought, content, ParsedAnswer("", calls, cut)
        thought, text = (self._reasoner.finish() if self._reasoner is not None
                         else ("", self._unlead("")))
        if self._splitter is None:
            return thought, text, None
        shown = self._splitter.feed(text)
        rest, answer = self._splitter.finish()
        return thought, shown + rest, answer

    def whole(self, text: str, held: bool = False) -> tuple[str | None, ParsedAnswer]:
        """A whole (non-streamed) answer: its thinking and the rest parsed (``held``: a
        grammar held it at its end, so calls cut off are read as a stream reads them)."""
        text = self._unlead(text)
        thought = None
        if self._harmony is not None:
            thinking, content = self._harmony.feed(text, held)
            more, rest, calls, cut = self._harmony.finish()
            return thinking + more or None, ParsedAnswer(content + rest, calls, cut)
        if self._thinking is not None:
            reasoned = split_reasoning(text, self._thinking.tags, self._thinking.opened)
            thought, text = reasoned.reasoning, reasoned.content
        if self._fmt is None:
            return thought, ParsedAnswer(text)
        return thought, read_whole(text, self._fmt, self._names, self._parallel, held,
                                   self._schemas)
