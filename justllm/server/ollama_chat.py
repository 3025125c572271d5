"""Ollama's ``/api/chat`` with tools, as the chat completion that serves it.

The messages become chat messages: an assistant's ``tool_calls`` (``arguments`` an object) its
OpenAI-shaped calls (``arguments`` as JSON text), a ``tool`` message the result of one of them.
Ollama's history has no call ids (newer clients may send ``id`` and ``tool_call_id``), so each
call gets one here and a tool message answers the oldest unanswered call of its ``tool_name``
(or the oldest unanswered call). With tools offered, ``OpenAIServing.chat_result`` /
``chat_events`` serve the request, so tool-call parsing, the forcing grammars and the prompt's
tools are the chat route's; the answer is written back here in Ollama's shape: calls in
``message.tool_calls`` with ``arguments`` as an object, ``done_reason`` "stop", and, when
streaming, one line per call once it is complete, then the final ``done`` line.

Ollama has no ``tool_choice``: tools offered means ``auto``. justllm accepts OpenAI's
``tool_choice`` on ``/api/chat`` as an extension ("none", "auto", "required" or a named
function), which forces a call through the same grammar as ``/v1/chat/completions``.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from contextlib import aclosing
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal
from urllib.parse import unquote

import msgspec

from justllm.errors import InvalidRequestError
from justllm.server.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    JsonSchemaFormat,
    MessageToolCall,
    ResponseFormat,
    Tool,
    ToolChoiceNamed,
    Usage,
)
from justllm.server.tools.answer import (
    ChatEvent,
    ChatResult,
    ChoiceEnd,
    StreamEnd,
    StreamError,
    TextDelta,
    Timings,
    ToolCall,
    ToolCallArguments,
    ToolCallStart,
)
from justllm.server.tools.json_stream import arguments_object
from justllm.server.tools.request import tool_plan

_json = msgspec.json.Encoder()
ToolChoice = Literal["none", "auto", "required"] | ToolChoiceNamed | None


# ---- request bodies --------------------------------------------------------------------------

class _Part(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A part of an Ollama body: unknown fields are refused, as in every body of this server."""


class OllamaFunctionCall(_Part):
    name: str
    arguments: dict[str, Any] = {}
    index: int | None = None  # newer Ollama numbers a response's calls


class OllamaToolCall(_Part):
    function: OllamaFunctionCall
    id: str | None = None  # newer Ollama: the call's id, which a tool message may name
    type: Literal["function"] | None = None


class OllamaMessage(_Part):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = ""  # (null: "", as Ollama reads it; an OpenAI-style history sends it)
    images: list[str] | None = None
    tool_calls: list[OllamaToolCall] | None = None  # assistant messages
    tool_name: str | None = None  # tool messages: the tool whose result this is
    tool_call_id: str | None = None  # tool messages, newer Ollama: the call it answers
    thinking: str | None = None


# ---- request ---------------------------------------------------------------------------------

def bad_format(fmt: object) -> InvalidRequestError:
    """A ``format`` that is neither "json" nor a JSON schema."""
    return _refuse("format", f'invalid value {fmt!r}; expected "json" or a JSON schema')


def _refuse(where: str, why: str) -> InvalidRequestError:
    return InvalidRequestError(f"{where}: {why}", param=where)


def continues_last_message(messages: list[OllamaMessage], tools: object) -> bool:
    """Whether the answer continues a last assistant message, as Ollama's does (rendered as a
    closed turn, it would be answered anew). Not with tools: their call format starts the
    answer."""
    if not messages or messages[-1].role != "assistant":
        return False
    last = messages[-1]
    if last.tool_calls:
        raise _refuse(f"messages[{len(messages) - 1}]", "the last message holds tool calls: "
                      "send their results (tool messages) next")
    if tools:
        raise _refuse(f"messages[{len(messages) - 1}]", "continuing an assistant message "
                      "cannot be combined with tools on this server (end with a user or tool "
                      "message, or send no tools)")
    return True


def chat_messages(messages: list[OllamaMessage], model: str, thinks: bool = False
                  ) -> list[ChatMessage]:
    """The history as chat messages, every tool message tied to the call it answers, an
    assistant's ``thinking`` as its ``reasoning_content`` (a model that ``thinks``). Call
    ids made here are a counter's 9 digits: the same history renders the same prompt (so its
    prefix is cached), and Mistral templates, which insist on 9 letters or digits, take them."""
    out: list[ChatMessage] = []
    pending: list[tuple[str, str]] = []  # (id, name) of the calls not answered yet, in order
    made = 0
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if m.images:
            raise _refuse(f"{where}.images", "this model reads text only and cannot take images")
        if m.thinking and not thinks:
            raise _refuse(f"{where}.thinking", f'"{model}" does not support thinking')
        if m.thinking and m.role != "assistant":
            raise _refuse(f"{where}.thinking", "only assistant messages carry thinking")
        if m.role != "tool":
            for field in ("tool_name", "tool_call_id"):
                if getattr(m, field) is not None:
                    raise _refuse(f"{where}.{field}", "only tool messages carry it")
        if m.tool_calls and m.role != "assistant":
            raise _refuse(f"{where}.tool_calls", "only assistant messages carry tool calls")
        if m.role == "tool":
            answers, name = _answered(m, pending)
            if answers is None:
                made += 1
            out.append(ChatMessage(role="tool", content=m.content or "",
                                   tool_call_id=answers or f"{made:09d}", name=name))
            continue
        calls = []
        for call in m.tool_calls or []:
            if call.id is None:
                made += 1
            call_id = call.id or f"{made:09d}"
            pending.append((call_id, call.function.name))
            calls.append(MessageToolCall(id=call_id, function=FunctionCall(
                name=call.function.name,
                arguments=json.dumps(call.function.arguments, ensure_ascii=False))))
        out.append(ChatMessage(role=m.role, content=m.content or "", tool_calls=calls or None,
                               reasoning_content=m.thinking or None))
    return out


def _answered(m: OllamaMessage, pending: list[tuple[str, str]]
              ) -> tuple[str | None, str | None]:
    """The call a tool message answers (taken off ``pending``): the one it names by id, else
    the oldest of its tool's name, else the oldest. (None, its name) when there is none."""
    for k, (call_id, name) in enumerate(pending):
        if m.tool_call_id is not None and call_id != m.tool_call_id:
            continue
        if m.tool_call_id is None and m.tool_name is not None and name != m.tool_name:
            continue
        del pending[k]
        return call_id, m.tool_name or name
    return m.tool_call_id, m.tool_name


def tool_request(messages: list[ChatMessage], tools: list[Tool] | None, choice: ToolChoice,
                 fmt: object) -> ChatCompletionRequest | None:
    """The chat request (tools, tool choice and messages; sampling is the caller's) that serves
    a request offering tools, checked; None when no tool is in play (none offered, or
    ``tool_choice`` "none"), where the plain chat path serves it."""
    chat = ChatCompletionRequest(messages=messages, tools=tools or None, tool_choice=choice)
    plan = tool_plan(chat)
    if not plan.active:
        return None
    if fmt in (None, ""):
        return chat
    if plan.enforced:
        raise _refuse("format", "format cannot be combined with a required tool call (the "
                                "call is the whole answer); send tool_choice auto or no format")
    # The answer is a call or an answer in the format (Ollama's format is not strict: the
    # keywords its grammar cannot hold are left to the model, as Ollama does)
    if fmt == "json":
        return msgspec.structs.replace(chat, response_format=ResponseFormat(type="json_object"))
    if isinstance(fmt, dict):
        return msgspec.structs.replace(chat, response_format=ResponseFormat(
            type="json_schema", json_schema=JsonSchemaFormat(name="format", schema=fmt)))
    raise bad_format(fmt)


# ---- the answer ------------------------------------------------------------------------------

def created_at() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def nanoseconds(seconds: float) -> int:
    return max(0, round(seconds * 1e9))


# Router mode's gateway tells its runner how long the request waited for the model to load
# (seconds), so that Ollama's load_duration says it and total_duration counts it.
LOAD_SECONDS_HEADER = "x-justllm-load-seconds"
# ...and the model name the client sent (percent-encoded), which it rewrote to the runner's
# own (an alias, a ":latest" tag): Ollama's answers say the name the request gave.
ASKED_MODEL_HEADER = "x-justllm-asked-model"


@dataclass(frozen=True)
class Arrival:
    """When an Ollama request arrived (``perf_counter``), counting from before its model
    loaded when it had to wait for that (router mode), and how long the load took: a single
    server's model is loaded before any request."""

    at: float
    load_seconds: float = 0.0
    asked: str | None = None  # the model name the client sent, where a gateway rewrote it

    @classmethod
    def now(cls, headers: Mapping[str, str]) -> Arrival:
        try:
            waited = float(headers.get(LOAD_SECONDS_HEADER, 0))
        except ValueError:
            waited = 0.0
        waited = waited if 0 < waited < 86400 else 0.0  # nan, inf and nonsense: none
        asked = headers.get(ASKED_MODEL_HEADER)
        return cls(time.perf_counter() - waited, waited, unquote(asked) if asked else None)

    def named(self, model: str) -> str:
        """The name an answer to a request for ``model`` says (Ollama echoes the request's)."""
        return self.asked or model

    def durations(self) -> dict[str, int]:
        return {"total_duration": nanoseconds(time.perf_counter() - self.at),
                "load_duration": nanoseconds(self.load_seconds)}


def _call(call: ToolCall, index: int) -> dict[str, Any]:
    """A call as Ollama writes it: ``arguments`` an object (``arguments_object``)."""
    return {"id": call.id, "function": {"index": index, "name": call.name,
                                        "arguments": arguments_object(call.arguments)}}


def _message(content: str, calls: list[dict[str, Any]] | None = None,
             thinking: str | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if thinking:
        message["thinking"] = thinking
    if calls:
        message["tool_calls"] = calls
    return message


def _final(model: str, arrival: Arrival, message: dict[str, Any], finish: str | None,
           usage: Usage, timings: Timings | None) -> dict[str, Any]:
    """The last line, with the prompt's and the generation's own durations when the chat side
    measured them."""
    out = {"model": model, "created_at": created_at(), "message": message,
           "done_reason": "length" if finish == "length" else "stop", "done": True,
           **arrival.durations(),
           "prompt_eval_count": usage.prompt_tokens, "eval_count": usage.completion_tokens}
    if timings is not None:
        out["prompt_eval_duration"] = nanoseconds(timings.prompt_seconds)
        out["eval_duration"] = nanoseconds(timings.generation_seconds)
    return out


def answer(model: str, arrival: Arrival, result: ChatResult) -> dict[str, Any]:
    """The whole answer (``stream: false``)."""
    choice = result.choices[0]
    calls = [_call(c, k) for k, c in enumerate(choice.tool_calls)]
    return _final(model, arrival, _message(choice.content or "", calls, choice.reasoning),
                  choice.finish_reason, result.usage, result.timings)


async def answer_lines(model: str, arrival: Arrival, events: AsyncGenerator[ChatEvent, None]
                       ) -> AsyncIterator[bytes]:
    """The NDJSON stream: a line per piece of text, a line per call once it is complete
    (``content`` ""), then the ``done`` line; an ``{"error"}`` line if the request fails on
    the way. Closing it aborts the request."""
    def line(message: dict[str, Any]) -> bytes:
        return _json.encode({"model": model, "created_at": created_at(), "message": message,
                             "done": False}) + b"\n"

    def call_line(start: ToolCallStart, arguments: str) -> bytes:
        return line(_message("", [_call(ToolCall(start.id, start.name, arguments),
                                        start.call_index)]))

    finish: str | None = None
    start: ToolCallStart | None = None  # the call whose arguments are coming
    arguments = ""
    async with aclosing(events):
        async for ev in events:
            if isinstance(ev, TextDelta) and (ev.text or ev.reasoning):
                yield line(_message(ev.text, thinking=ev.reasoning))
            elif isinstance(ev, ToolCallStart):
                if start is not None:
                    yield call_line(start, arguments)
                start, arguments = ev, ""
            elif isinstance(ev, ToolCallArguments):
                arguments += ev.arguments
            elif isinstance(ev, ChoiceEnd):
                if start is not None:
                    yield call_line(start, arguments)
                    start = None
                finish = ev.finish_reason
            elif isinstance(ev, StreamEnd):
                yield _json.encode(_final(model, arrival, _message(""), finish, ev.usage,
                                          ev.timings)) + b"\n"
            elif isinstance(ev, StreamError):
                yield _json.encode({"error": ev.message}) + b"\n"
                return
