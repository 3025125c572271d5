"""OpenAI's Responses API (``POST /v1/responses``) on ``justllm serve``, with stored responses
(``GET``/``DELETE /v1/responses/{id}``, ``previous_response_id``: server/response_store.py).

A translation layer onto chat completions: the request becomes a ``ChatCompletionRequest``
(``responses_chat.py``), ``OpenAIServing.chat_result`` / ``chat_events`` serve it, and the
typed answer is written here as a response object (a ``message`` item, then one
``function_call`` item per call) or as the Responses event stream, every event numbered
(``sequence_number``) and shaped as the openai SDK's typed events expect. Errors keep
OpenAI's shape (``server/errors.py``).
"""

from __future__ import annotations

import itertools
import logging
import re
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

import msgspec
from litestar import Request, Response, delete, get, post
from litestar.datastructures import State
from litestar.params import FromPath, FromQuery, JSONBody

from justllm.errors import InvalidRequestError
from justllm.server.anthropic import prompt_tokens
from justllm.server.app import (
    Served,
    _served,
    decode_request,
    origin,
    sse_response,
    unless_disconnected,
)
from justllm.server.errors import APIError
from justllm.server.openai_serving import SCHEMA_PARAM, OpenAIServing, text_size
from justllm.server.response_store import ResponseStore, listed
from justllm.server.responses_chat import opaque_reasoning, to_chat
from justllm.server.responses_schemas import (
    InputTokens,
    InputTokensRequest,
    OutputFunctionCall,
    OutputMessage,
    OutputReasoning,
    OutputReasoningText,
    OutputText,
    ResponseObject,
    ResponseRequest,
    ResponseUsage,
)
from justllm.server.schemas import ChatCompletionRequest, Usage
from justllm.server.tools.answer import (
    ChatEvent,
    ChatResult,
    ChoiceEnd,
    StreamEnd,
    StreamError,
    TextDelta,
    ToolCallArguments,
    ToolCallStart,
)

log = logging.getLogger(__name__)
_json = msgspec.json.Encoder()


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _skeleton(rid: str, model: str, req: ResponseRequest) -> ResponseObject:
    """The response as it starts: in progress, nothing output yet, the request's settings."""
    fmt = req.text.format if req.text and req.text.format else None
    return ResponseObject(
        id=rid, object="response", created_at=int(time.time()), status="in_progress",
        model=model, output=[], usage=None, incomplete_details=None, error=None,
        instructions=req.instructions, max_output_tokens=req.max_output_tokens,
        temperature=req.temperature, top_p=req.top_p, tools=req.tools or [],
        tool_choice=req.tool_choice or "auto",
        parallel_tool_calls=req.parallel_tool_calls is not False, metadata=req.metadata or {},
        user=req.user, safety_identifier=req.safety_identifier,
        prompt_cache_key=req.prompt_cache_key,
        text={"format": msgspec.to_builtins(fmt) if fmt else {"type": "text"},
              "verbosity": req.text.verbosity if req.text and req.text.verbosity else "medium"},
        truncation="disabled",
        reasoning=msgspec.to_builtins(req.reasoning) if req.reasoning else None)


def _finish(resp: ResponseObject, finish: str | None, usage: Usage) -> ResponseObject:
    """Completed, or incomplete when max_output_tokens cut the answer short."""
    truncated = finish == "length"
    resp.status = "incomplete" if truncated else "completed"
    resp.incomplete_details = {"reason": "max_output_tokens"} if truncated else None
    resp.usage = ResponseUsage(
        usage.prompt_tokens, {"cached_tokens": (usage.prompt_tokens_details or {}).get(
            "cached_tokens", 0), "cache_write_tokens": 0},
        usage.completion_tokens,
        {"reasoning_tokens": (usage.completion_tokens_details or {}).get("reasoning_tokens", 0)},
        usage.total_tokens)
    return resp


def _full(resp: ResponseObject, result: ChatResult, opaque: bool = False) -> ResponseObject:
    choice = result.choices[0]
    status = "incomplete" if choice.finish_reason == "length" else "completed"
    if choice.reasoning:
        resp.output.append(_reasoning_item(choice.reasoning, "completed", opaque))
    if choice.content or not choice.tool_calls:
        text = OutputText(choice.content or "", [], [])
        # (before a call the message is whole: the call is what the limit cut off)
        resp.output.append(OutputMessage(_item_id("msg"), "completed" if choice.tool_calls
                                         else status, "assistant", [text]))
    last = len(choice.tool_calls) - 1  # (cut off with the answer when it is incomplete)
    resp.output += [OutputFunctionCall(_item_id("fc"), c.id, c.name, c.arguments,
                                       status if k == last else "completed")
                    for k, c in enumerate(choice.tool_calls)]
    return _finish(resp, choice.finish_reason, result.usage)


def _reasoning_item(text: str, status: str, opaque: bool = False) -> OutputReasoning:
    """``opaque``: with the thinking as ``encrypted_content`` too (``include``)."""
    return OutputReasoning(_item_id("rs"), [], [OutputReasoningText(text)], status,
                           opaque_reasoning(text) if opaque else None)


class _Writer:
    """The events of one streamed response: each numbered, each output item added, filled and
    done in turn (the one open item is closed before the next is added)."""

    def __init__(self, resp: ResponseObject, opaque: bool = False) -> None:
        self.resp = resp
        self.opaque = opaque  # reasoning items carry encrypted_content (include)
        self._seq = itertools.count()
        self.item: OutputReasoning | OutputMessage | OutputFunctionCall | None = None  # open
        self.text = ""  # the open message's (or reasoning's) text so far
        self.truncated = False

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, **fields, "sequence_number": next(self._seq)}
        return b"event: " + kind.encode() + b"\ndata: " + _json.encode(payload) + b"\n\n"

    @property
    def index(self) -> int:
        return len(self.resp.output) - 1

    def add(self, item: OutputReasoning | OutputMessage | OutputFunctionCall) -> list[bytes]:
        frames = self.close()
        self.resp.output.append(item)
        self.item = item
        frames.append(self.event("response.output_item.added", output_index=self.index,
                                 item=item))
        if isinstance(item, OutputMessage | OutputReasoning):
            self.text = ""
            part = (OutputText("", [], []) if isinstance(item, OutputMessage)
                    else OutputReasoningText(""))
            frames.append(self.event("response.content_part.added", item_id=item.id,
                                     output_index=self.index, content_index=0, part=part))
        return frames

    def reasoning_delta(self, piece: str) -> list[bytes]:
        frames = [] if isinstance(self.item, OutputReasoning) else self.add(
            OutputReasoning(_item_id("rs"), [], [], "in_progress"))
        self.text += piece
        assert self.item is not None
        frames.append(self.event("response.reasoning_text.delta", item_id=self.item.id,
                                 output_index=self.index, content_index=0, delta=piece))
        return frames

    def text_delta(self, piece: str) -> list[bytes]:
        frames = [] if isinstance(self.item, OutputMessage) else self.add(
            OutputMessage(_item_id("msg"), "in_progress", "assistant", []))
        self.text += piece
        assert self.item is not None
        frames.append(self.event("response.output_text.delta", item_id=self.item.id,
                                 output_index=self.index, content_index=0, delta=piece,
                                 logprobs=[]))
        return frames

    def arguments_delta(self, piece: str) -> bytes:
        assert isinstance(self.item, OutputFunctionCall)
        self.item.arguments += piece
        return self.event("response.function_call_arguments.delta", item_id=self.item.id,
                          output_index=self.index, delta=piece)

    def stand(self) -> None:
        """The open item as it stands when the response fails: what was streamed of it, and
        ``incomplete`` (a failed response's items said ``in_progress`` with no content)."""
        item, self.item = self.item, None
        if isinstance(item, OutputReasoning):
            item.content = [OutputReasoningText(self.text)]
        elif isinstance(item, OutputMessage):
            item.content = [OutputText(self.text, [], [])]
        if item is not None:
            item.status = "incomplete"

    def close(self) -> list[bytes]:
        item, frames = self.item, []
        if item is None:
            return []
        self.item = None
        index = self.resp.output.index(item)
        if isinstance(item, OutputReasoning):
            done = OutputReasoningText(self.text)
            frames += [self.event("response.reasoning_text.done", item_id=item.id,
                                  output_index=index, content_index=0, text=self.text),
                       self.event("response.content_part.done", item_id=item.id,
                                  output_index=index, content_index=0, part=done)]
            item.content = [done]
            item.status = "completed"
            if self.opaque:
                item.encrypted_content = opaque_reasoning(self.text)
        elif isinstance(item, OutputMessage):
            part = OutputText(self.text, [], [])
            frames += [self.event("response.output_text.done", item_id=item.id,
                                  output_index=index, content_index=0, text=self.text,
                                  logprobs=[]),
                       self.event("response.content_part.done", item_id=item.id,
                                  output_index=index, content_index=0, part=part)]
            item.content = [part]
            item.status = "incomplete" if self.truncated else "completed"
        else:
            frames.append(self.event("response.function_call_arguments.done", item_id=item.id,
                                     output_index=index, name=item.name,
                                     arguments=item.arguments))
            # (the answer's last call, cut off by max_output_tokens: its arguments end early)
            item.status = "incomplete" if self.truncated else "completed"
        frames.append(self.event("response.output_item.done", output_index=index, item=item))
        return frames


async def _stream(resp: ResponseObject, events: AsyncGenerator[ChatEvent, None],
                  keep: Callable[[ResponseObject], None], opaque: bool = False
                  ) -> AsyncIterator[bytes]:
    """The Responses event sequence for one streamed answer: created, in_progress, the output
    items, then completed (or incomplete at max_output_tokens; or error and failed). The
    final response goes to ``keep`` before its last event is sent."""
    w = _Writer(resp, opaque)
    yield w.event("response.created", response=resp)
    yield w.event("response.in_progress", response=resp)
    finish: str | None = None
    async with aclosing(events):
        async for ev in events:
            frames: list[bytes] = []
            if isinstance(ev, TextDelta) and ev.reasoning:  # (before any text)
                frames = w.reasoning_delta(ev.reasoning)
            if isinstance(ev, TextDelta) and ev.text:
                frames += w.text_delta(ev.text)
            elif isinstance(ev, ToolCallStart):
                frames = w.add(OutputFunctionCall(_item_id("fc"), ev.id, ev.name, "",
                                                  "in_progress"))
            elif isinstance(ev, ToolCallArguments):
                frames = [w.arguments_delta(ev.arguments)]
            elif isinstance(ev, ChoiceEnd):
                finish = ev.finish_reason
                w.truncated = finish == "length"
            elif isinstance(ev, StreamEnd):
                if not resp.output:  # nothing was said: an empty message, as the whole has
                    frames = w.add(OutputMessage(_item_id("msg"), "in_progress", "assistant",
                                                 []))
                frames += w.close()
                _finish(resp, finish, ev.usage)
                keep(resp)
                frames.append(w.event(f"response.{resp.status}", response=resp))
            elif isinstance(ev, StreamError):
                w.stand()  # (the open item as far as it came: its text was streamed)
                resp.status = "failed"
                resp.error = {"code": ev.code or "server_error", "message": ev.message}
                keep(resp)
                frames = [w.event("error", code=ev.code or "server_error", message=ev.message,
                                  param=None),
                          w.event("response.failed", response=resp)]
            for frame in frames:
                yield frame


# The chat request's fields that an error may name, as a Responses request names them.
_PARAMS = {SCHEMA_PARAM: "text.format.schema", "max_tokens": "max_output_tokens",
           "response_format.json_schema.name": "text.format.name",
           "max_completion_tokens": "max_output_tokens", "prompt": "input", "messages": "input",
           "reasoning_effort": "reasoning.effort", "response_format": "text.format"}
# A function tool's field: a Responses tool has no ``function`` wrapper.
_CHAT_TOOL = re.compile(r"(tools\[\d+\])\.function\.(\w+)")


def _renamed(e: InvalidRequestError) -> InvalidRequestError | None:
    """``e``, raised by the chat side, naming the Responses request's field (its
    response_format is text.format; its max_tokens, max_output_tokens; its prompt, the input;
    ``tools[0].function.name``, ``tools[0].name``); None when it names no chat field."""
    chat = e.param or ""
    tool = _CHAT_TOOL.fullmatch(chat)
    param = f"{tool[1]}.{tool[2]}" if tool else _PARAMS.get(chat)
    if param is None:
        return None
    text = str(e)
    text = text.replace(chat, param) if chat in text else f"{param}: {text}"
    return InvalidRequestError(text, param=param)


def check_sampling(chat: ChatCompletionRequest) -> None:
    """The chat side's checks that need no model of a request made from a Responses request
    (router mode, before a load), naming the Responses request's fields."""
    try:
        OpenAIServing.check_extras(chat)
    except InvalidRequestError as e:
        raise (_renamed(e) or e) from None


def _continued(req: ResponseRequest, store: ResponseStore
               ) -> tuple[ResponseRequest, list[dict[str, Any]], int]:
    """The request with its whole conversation as ``input`` (a ``previous_response_id``'s
    conversation, then this input), that conversation's input items, and how many of them
    came from the earlier response (an error in this request's ``input[i]`` names that i)."""
    items: list[dict[str, Any]] = ([{"role": "user", "content": req.input}]
                                   if isinstance(req.input, str) else list(req.input))
    if req.previous_response_id is None:
        return req, items, 0
    past = store.get(req.previous_response_id)
    if past is None:
        raise APIError(404, f"Previous response with id '{req.previous_response_id}' not "
                       "found (never stored, deleted, or dropped from the store)",
                       type="not_found_error", param="previous_response_id")
    first = len(past.conversation)
    items = past.conversation + items
    return msgspec.structs.replace(req, input=items, previous_response_id=None), items, first


def _keeper(served: Served, items: list[dict[str, Any]]) -> Callable[[ResponseObject], None]:
    """What keeps a finished response, when it is to be stored (OpenAI's default)."""
    def keep(resp: ResponseObject) -> None:
        if resp.store:
            inputs = [listed(i) for i in items]
            served.responses.put(resp.id, _json.encode(resp),
                                 inputs + [msgspec.to_builtins(o) for o in resp.output],
                                 len(inputs))
    return keep


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found (never stored, deleted, "
                    "or dropped from the store)", type="not_found_error", param="response_id")


def _included(request: Request, include: list[str] | None) -> list[str]:
    """A query's ``include`` values, as ``include=`` or as the openai SDK sends a list,
    ``include[]=`` (which the parameter alone let through: the refusal went unsaid)."""
    return [*(include or []), *request.query_params.getall("include[]", [])]


@get("/responses/{response_id:str}", summary="A stored response")
async def retrieve_response(response_id: FromPath[str], state: State, request: Request,
                            stream: FromQuery[bool | None] = None,
                            include: FromQuery[list[str] | None] = None,
                            include_obfuscation: FromQuery[bool | None] = None,
                            starting_after: FromQuery[int | None] = None) -> Response:
    """OpenAI's retrieve: the response as it was stored. Its query parameters that shape a
    replayed stream, or add output, are refused unless off (none is available here)."""
    if stream:
        raise InvalidRequestError("stream: a stored response is given whole, not replayed",
                                  param="stream")
    if _included(request, include):  # (encrypted_content is stored with it, if it was asked)
        raise InvalidRequestError("include: no extra output is available for a stored "
                                  "response", param="include")
    if starting_after is not None:
        raise InvalidRequestError("starting_after: a stored response is given whole, not "
                                  "replayed as events", param="starting_after")
    if include_obfuscation:
        raise InvalidRequestError("include_obfuscation: a stored response is given whole, "
                                  "not streamed", param="include_obfuscation")
    found = _served(state).responses.get(response_id)
    if found is None:
        raise _not_found(response_id)
    return Response(found.response, media_type="application/json")


@delete("/responses/{response_id:str}", status_code=200, summary="Delete a stored response")
async def delete_response(response_id: FromPath[str], state: State) -> dict[str, Any]:
    if not _served(state).responses.delete(response_id):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


@post("/responses/{response_id:str}/cancel", status_code=200,
      summary="Cancel a background response (none is made here)")
async def cancel_response(response_id: FromPath[str], state: State) -> dict[str, Any]:
    """OpenAI's cancel is for a response made with ``background: true``, which this server
    refuses: a stored response is a 400 saying so, as OpenAI answers for a response that was
    not made in the background, an unknown one a 404 (the route itself was a 404)."""
    if _served(state).responses.get(response_id) is None:
        raise _not_found(response_id)
    raise InvalidRequestError("only a response created with background: true can be "
                              "cancelled, and this server makes none (it answers each "
                              "request as it comes)", param="response_id")


@get("/responses/{response_id:str}/input_items", summary="A stored response's input items")
async def input_items(response_id: FromPath[str], state: State, request: Request,
                      limit: FromQuery[int] = 20,
                      order: FromQuery[str] = "desc", after: FromQuery[str | None] = None,
                      include: FromQuery[list[str] | None] = None) -> dict[str, Any]:
    """OpenAI's list of the items a stored response answered (a continued response's whole
    conversation before its output), newest first unless ``order=asc``, ``limit`` at a
    time, from the item after ``after``."""
    if _included(request, include):
        raise InvalidRequestError("include: no extra item data is available", param="include")
    if not 1 <= limit <= 100:
        raise InvalidRequestError("limit must be in [1, 100]", param="limit")
    if order not in ("asc", "desc"):
        raise InvalidRequestError("order must be asc or desc", param="order")
    found = _served(state).responses.get(response_id)
    if found is None:
        raise _not_found(response_id)
    items = found.conversation[:found.inputs]
    if order == "desc":
        items = items[::-1]
    if after is not None:
        at = next((i for i, item in enumerate(items) if item.get("id") == after), None)
        if at is None:
            raise InvalidRequestError(f"after: no input item '{after}' in this response",
                                      param="after")
        items = items[at + 1:]
    page = items[:limit]
    return {"object": "list", "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


@post("/responses/input_tokens", status_code=200,
      summary="Count a response request's input tokens (its prompt as rendered)")
async def input_tokens(data: JSONBody[InputTokensRequest], request: Request,
                       state: State) -> InputTokens:
    """OpenAI's token count of a Responses request: the rendered prompt (instructions, input,
    tools) in tokens, what the response's ``usage.input_tokens`` would say."""
    served = _served(state)
    req = await decode_request(request, InputTokensRequest)
    served.completions.check_model(req.model)
    continued, _, first = _continued(req.as_response_request(), served.responses)
    chat = to_chat(continued, first)
    try:
        count = await served.aengine.off_loop(text_size(chat),
                                              lambda: prompt_tokens(served, chat))
    except InvalidRequestError as e:
        renamed = _renamed(e)
        if renamed is None:
            raise
        raise renamed from None
    return InputTokens(input_tokens=count)


@post("/responses", status_code=200, summary="Create a response")
async def create_response(data: JSONBody[ResponseRequest], request: Request,
                          state: State) -> Any:
    served = _served(state)
    asked = await decode_request(request, ResponseRequest)
    req, items, first = _continued(asked, served.responses)
    chat = to_chat(req, first)
    rid = _item_id("resp")
    log.info("%s: user=%s stream=%s", rid, chat.user, req.stream)
    resp = _skeleton(rid, req.model or served.model_id, req)
    resp.store = req.store is not False  # OpenAI's default: stored
    resp.previous_response_id = asked.previous_response_id
    keep = _keeper(served, items)
    opaque = "reasoning.encrypted_content" in (req.include or [])
    try:
        if req.stream:
            return sse_response(_stream(resp, await served.completions.chat_events(
                chat, rid, origin=origin(request, "openai.responses", True)), keep, opaque))
        result = await unless_disconnected(request, served.completions.chat_result(
            chat, rid, origin=origin(request, "openai.responses", False)))
    except InvalidRequestError as e:
        renamed = _renamed(e)  # the chat request's fields, as this request names them
        if renamed is None:
            raise
        raise renamed from None
    if isinstance(result, Response):
        return result
    done = _full(resp, result, opaque)
    keep(done)
    return done
