"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) on ``justllm serve``.

A translation layer onto chat completions: the request becomes a ``ChatCompletionRequest``
(``anthropic_chat.py``), ``OpenAIServing.chat_result`` / ``chat_events`` serve it (so sampling,
the chat template, tool-call parsing and grammars, metrics and aborts are the chat route's),
and the typed result is written here as Anthropic's message or SSE event sequence. What is
Anthropic's own lives in these two modules: content blocks, ``stop_reason``, the event names,
and errors as ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import replace
from typing import Any

import msgspec
from litestar import Request, Response, post
from litestar.datastructures import State
from litestar.params import JSONBody

from justllm.errors import InvalidRequestError
from justllm.server.anthropic_chat import to_chat
from justllm.server.anthropic_schemas import (
    AnthropicMessage,
    CountTokensRequest,
    MessagesRequest,
    TokenCount,
    Usage,
    _Prompt,
)
from justllm.server.app import (
    Served,
    _served,
    decode_request,
    origin,
    sse_response,
    unless_disconnected,
)
from justllm.server.errors import to_api_error
from justllm.server.openai_serving import SCHEMA_PARAM, error_status, text_size
from justllm.server.schemas import ChatCompletionRequest
from justllm.server.tools.answer import (
    ChatEvent,
    ChatResult,
    ChoiceEnd,
    StreamEnd,
    StreamError,
    TextDelta,
    ToolCall,
    ToolCallArguments,
    ToolCallStart,
)
from justllm.server.tools.grammar import call_schema
from justllm.server.tools.json_stream import arguments_object

log = logging.getLogger(__name__)
_json = msgspec.json.Encoder()

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error"}


# ---- errors ----------------------------------------------------------------------------------

def error_body(status: int, message: str) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def anthropic_error(_: Request, exc: Exception) -> Response:
    """Anthropic's error shape, with the status the OpenAI side would give (503 while the
    model loads or the server stops: ``overloaded_error``; 429 when the queue is full)."""
    e = to_api_error(exc)
    return Response(error_body(e.status, e.message), status_code=e.status, headers=e.headers)


# The chat request's fields that an error of the chat side may name, as an Anthropic request
# names them (``anthropic_chat.py`` words its own refusals with Anthropic's names already).
_PARAMS = {SCHEMA_PARAM: "output_config.format.schema", "response_format": "output_config.format",
           "stop": "stop_sequences", "reasoning_effort": "output_config.effort",
           "thinking_budget_tokens": "thinking.budget_tokens",
           "reasoning_budget_tokens": "thinking.budget_tokens",
           "max_completion_tokens": "max_tokens", "prompt": "messages"}
_CHAT_TOOL = re.compile(r"(tools\[\d+\])\.function\.(name|parameters)")
_SWITCH = "chat_template_kwargs.enable_thinking"  # what Anthropic's ``thinking`` sets


def _tool_param(req: _Prompt, served: Served) -> str:
    """The tool whose ``input_schema`` the call grammar could not be built from (``tools``
    when none fails alone)."""
    fmt = served.completions.template.tool_format
    for i, tool in enumerate(req.tools or []):
        try:
            served.aengine.json_grammar(call_schema([(tool.name, tool.input_schema)], fmt))
        except InvalidRequestError:
            return f"tools[{i}].input_schema"
    return "tools"


async def _renamed(e: InvalidRequestError, req: _Prompt, served: Served
                   ) -> InvalidRequestError | None:
    """``e``, raised by the chat side, with the Anthropic request's field as its param and at
    the head of its message (None: it names no chat field)."""
    chat, text = e.param or "", str(e)
    tool = _CHAT_TOOL.fullmatch(chat)
    if tool:
        param: str | None = f"{tool[1]}.{'name' if tool[2] == 'name' else 'input_schema'}"
    elif chat == "tools" and not text.startswith("tools"):  # a schema the grammar cannot take
        param = await served.aengine.off_loop(text_size(req.tools),
                                              lambda: _tool_param(req, served))
    else:
        param = _PARAMS.get(chat)
    if param is None:
        return None
    text = param + text[len(chat):] if text.startswith(chat) else f"{param}: {text}"
    return InvalidRequestError(text.replace(_SWITCH, "thinking"), param=param)


@asynccontextmanager
async def _anthropic_names(req: _Prompt, served: Served) -> AsyncIterator[None]:
    """Errors of the chat side that serves ``req`` name Anthropic's fields, not its own."""
    try:
        yield
    except InvalidRequestError as e:
        renamed = await _renamed(e, req, served)
        if renamed is None:
            raise
        raise renamed from None


# ---- the answer ------------------------------------------------------------------------------

def prompt_tokens(served: Served, chat: ChatCompletionRequest) -> int:
    """The rendered prompt's length in tokens, tools included (what usage reports)."""
    return len(served.aengine.tokenize(served.completions.request_prompt(chat)))


def _stop(finish: str | None, matched: object, stops: list[str] | None
          ) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence``. A stop string ends the choice with
    ``stop_sequence`` only when it is one of the request's own (the chat template's end-of-turn
    strings are stop strings too, and they mean ``end_turn``)."""
    if finish == "stop" and isinstance(matched, str) and matched in (stops or ()):
        return "stop_sequence", matched
    return _STOP_REASONS.get(finish or "stop", "end_turn"), None


def tool_use_id(call_id: str) -> str:
    """A call's id as Anthropic writes one, ``toolu_...``: the chat side's ``call_<hex>`` with
    the prefix changed, or ``toolu_`` before a Mistral-format call's 9 letters and digits
    (``anthropic_chat._chat_id`` takes those off again when the call comes back)."""
    if call_id.startswith("toolu_"):
        return call_id
    return "toolu_" + call_id.removeprefix("call_")


def _tool_use(call: ToolCall) -> dict[str, Any]:
    """A call as a ``tool_use`` block, its input an object (``arguments_object``)."""
    return {"type": "tool_use", "id": tool_use_id(call.id), "name": call.name,
            "input": arguments_object(call.arguments)}


def _message(mid: str, model: str, result: ChatResult, stops: list[str] | None
             ) -> AnthropicMessage:
    choice = result.choices[0]
    content: list[dict[str, Any]] = []
    if choice.reasoning:
        content.append(_thinking_block(choice.reasoning))
    if said(choice.content):
        content.append({"type": "text", "text": choice.content})
    content += [_tool_use(c) for c in choice.tool_calls]
    reason, sequence = _stop(choice.finish_reason, getattr(choice, "stop", None), stops)
    return AnthropicMessage(mid, "message", "assistant", model, content, reason, sequence,
                            Usage(result.usage.prompt_tokens, result.usage.completion_tokens))


def said(text: str | None) -> bool:
    """Whether an answer's text makes a text block. Empty or blank, it makes none (``content:
    []``, as Anthropic answers a turn that says nothing): a text block must hold more than
    blank space, in a request too, so one given back with the conversation (as agent loops
    send ``response.content``) was refused."""
    return bool(text and text.strip())


def _thinking_block(text: str) -> dict[str, Any]:
    """A reasoning model's thinking as a thinking block. Its ``signature`` is empty: it
    vouches for nothing here (a thinking block sent back is read as it is)."""
    return {"type": "thinking", "thinking": text, "signature": ""}


def _event(name: str, payload: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + _json.encode({"type": name, **payload}) \
        + b"\n\n"


class _Blocks:
    """The content blocks of a streamed message: opened in turn, each closed before the next
    (a text block first if there is text, then one ``tool_use`` block per call)."""

    def __init__(self) -> None:
        self.index = -1  # of the last block opened
        self.open = False

    def start(self, block: dict[str, Any]) -> list[bytes]:
        frames = self.stop()
        self.index += 1
        self.open = True
        return [*frames, _event("content_block_start",
                                {"index": self.index, "content_block": block})]

    def delta(self, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", {"index": self.index, "delta": delta})

    def stop(self) -> list[bytes]:
        if not self.open:
            return []
        self.open = False
        return [_event("content_block_stop", {"index": self.index})]


async def _events(mid: str, model: str, input_tokens: int, stops: list[str] | None,
                  events: AsyncGenerator[ChatEvent, None]) -> AsyncIterator[bytes]:
    """Anthropic's event sequence for one streamed answer: ``message_start``, a ``ping``, each
    content block started, filled (``text_delta``, ``input_json_delta``) and stopped,
    ``message_delta`` with the stop reason and usage, ``message_stop``; or an ``error`` event
    if the request fails on the way."""
    start = AnthropicMessage(mid, "message", "assistant", model, [], None, None,
                             Usage(input_tokens, 0))
    yield _event("message_start", {"message": start})
    yield _event("ping", {})
    blocks, text_open, thinking_open = _Blocks(), False, False
    blank = ""  # text held back until more than blank space is said (:func:`said`)
    reason, sequence, output_tokens = "end_turn", None, 0
    async with aclosing(events):
        async for ev in events:
            if isinstance(ev, TextDelta) and ev.reasoning:  # (before any text)
                if not thinking_open:
                    thinking_open = True
                    for frame in blocks.start(_thinking_block("")):
                        yield frame
                yield blocks.delta({"type": "thinking_delta", "thinking": ev.reasoning})
            if isinstance(ev, TextDelta) and ev.text:
                if not text_open:
                    blank += ev.text
                    if not said(blank):
                        continue
                    text_open = True
                    for frame in blocks.start({"type": "text", "text": ""}):
                        yield frame
                    ev, blank = replace(ev, text=blank), ""
                yield blocks.delta({"type": "text_delta", "text": ev.text})
            elif isinstance(ev, ToolCallStart):
                text_open, blank = False, ""
                for frame in blocks.start({"type": "tool_use", "id": tool_use_id(ev.id),
                                           "name": ev.name, "input": {}}):
                    yield frame
            elif isinstance(ev, ToolCallArguments):
                yield blocks.delta({"type": "input_json_delta", "partial_json": ev.arguments})
            elif isinstance(ev, ChoiceEnd):
                reason, sequence = _stop(ev.finish_reason, getattr(ev, "stop", None), stops)
            elif isinstance(ev, StreamEnd):
                input_tokens = ev.usage.prompt_tokens
                output_tokens = ev.usage.completion_tokens
            elif isinstance(ev, StreamError):
                yield _event("error", error_body(
                    503 if ev.code == "shutting_down" else error_status(ev.code), ev.message))
                return
    for frame in blocks.stop():
        yield frame
    yield _event("message_delta", {
        "delta": {"stop_reason": reason, "stop_sequence": sequence},
        "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens}})
    yield _event("message_stop", {})


# ---- routes ----------------------------------------------------------------------------------

def _for_model(chat: ChatCompletionRequest, served: Served) -> ChatCompletionRequest:
    """A model that does not think keeps within any thinking budget: none is set for it."""
    if not served.completions.template.thinks:
        return msgspec.structs.replace(chat, thinking_budget_tokens=None)
    return chat


# Errors in Anthropic's shape: errors.handle_exception answers so under /v1/messages.
@post("/messages", status_code=200, summary="Anthropic: create a message")
async def messages(data: JSONBody[MessagesRequest], request: Request, state: State) -> Any:
    served = _served(state)
    req = await decode_request(request, MessagesRequest)
    served.completions.check_model(req.model)
    chat = _for_model(to_chat(req), served)
    mid = f"msg_{uuid.uuid4().hex}"
    log.info("%s: user=%s stream=%s", mid, chat.user, req.stream)
    async with _anthropic_names(req, served):
        if req.stream:
            # message_start says it, before the answer: the count of the prompt just queued
            events, input_tokens = await served.completions.counted_chat_events(
                chat, mid, origin=origin(request, "anthropic.messages", True))
            return sse_response(_events(mid, req.model, input_tokens, req.stop_sequences,
                                        events))
        result = await unless_disconnected(request, served.completions.chat_result(
            chat, mid, origin=origin(request, "anthropic.messages", False)))
    if isinstance(result, Response):
        return result
    return _message(mid, req.model, result, req.stop_sequences)


@post("/messages/count_tokens", status_code=200,
      summary="Anthropic: count the tokens of a message's prompt")
async def count_tokens(data: JSONBody[CountTokensRequest], request: Request,
                       state: State) -> TokenCount:
    served = _served(state)
    req = await decode_request(request, CountTokensRequest)
    served.completions.check_model(req.model)
    chat = _for_model(to_chat(req), served)
    async with _anthropic_names(req, served):
        return TokenCount(await served.aengine.off_loop(text_size(chat),
                                                        lambda: prompt_tokens(served, chat)))
