"""An OpenAI Responses request as the chat completion that serves it.

``instructions`` becomes a system message; ``input`` (a string, or items) the conversation:
message items as messages (``developer`` as system), ``function_call`` items as an
assistant's ``tool_calls`` (consecutive calls, and the assistant text before them, are one
assistant turn), ``function_call_output`` items as ``tool`` messages. Function tools and
``tool_choice`` map one to one onto the chat request's; ``text.format`` is its
``response_format``.

``store`` and ``previous_response_id`` are the caller's (server/responses.py: a continued
response's input is its whole conversation by the time it comes here); ``conversation`` is
refused, as is every other field this server cannot honour, with a 400 naming it.
"""

from __future__ import annotations

import base64
import re
from typing import Any, Literal, TypeVar

import msgspec

from justllm.errors import InvalidRequestError
from justllm.server.errors import _msgspec_param
from justllm.server.json_schema import check_strict
from justllm.server.openai_serving import check_stream_options
from justllm.server.responses_schemas import (
    PART_FIELDS,
    ContentPart,
    FunctionCall,
    FunctionCallOutput,
    FunctionTool,
    Message,
    Reasoning,
    ResponseRequest,
)
from justllm.server.schemas import (
    AllowedTool,
    AllowedTools,
    ChatCompletionRequest,
    ChatMessage,
    FunctionDef,
    JsonSchemaFormat,
    MessageToolCall,
    ResponseFormat,
    Tool,
    ToolChoice,
    ToolChoiceAllowed,
    ToolChoiceFunction,
    ToolChoiceNamed,
    foreign_field,
)
from justllm.server.schemas import ContentPart as ChatPart
from justllm.server.schemas import (
    FunctionCall as ChatFunctionCall,
)

S = TypeVar("S", bound=msgspec.Struct)
ChatToolChoice = ToolChoice

_NOT_TEXT = {"input_image": "images", "input_file": "files", "input_audio": "audio"}
# Request fields refused unless absent (or at the value that means "off"), and why.
_REFUSED: dict[str, tuple[tuple[object, ...], str]] = {
    "conversation": ((None,), "conversations are not stored on this server; send the whole "
                              "conversation in input"),
    "background": ((None, False), "background responses are not supported"),
    "prompt": ((None,), "stored prompt templates are not supported"),
    "max_tool_calls": ((None,), "max_tool_calls is not supported (parallel_tool_calls: false "
                                "allows one call)"),
    "top_logprobs": ((None, 0), "logprobs are not supported on /v1/responses (use "
                                "/v1/chat/completions)"),
    "context_management": ((None,), "context management is not supported"),
    "truncation": ((None, "disabled"), "an input longer than the context is refused, not "
                                       "truncated (send truncation: disabled)"),
    "service_tier": ((None, "auto", "default"), "there is one service tier"),
    "prompt_cache_retention": ((None, "in-memory", "in_memory"), "cached prefixes live in "
                                                                 "memory only"),
}


def _convert(raw: dict[str, Any], cls: type[S], where: str) -> S:
    """An item or tool, decoded strictly once its ``type`` is known; errors name the field."""
    try:
        return msgspec.convert(raw, cls)
    except msgspec.ValidationError as e:
        inner = _msgspec_param(str(e))  # the field, relative to the item
        missing = re.search(r"missing required field `([^`]+)`", str(e))
        if missing:
            inner = f"{inner}.{missing.group(1)}" if inner else missing.group(1)
        param = f"{where}.{inner}" if inner else where
        detail = str(e).replace("`$.", f"`{where}.").replace("`$`", f"`{where}`")
        raise InvalidRequestError(f"{param}: {detail}", param=param) from None


def _text(part: ContentPart, role: str, where: str) -> str:
    allowed = ("output_text", "refusal", "input_text") if role == "assistant" else ("input_text",)
    if part.type in allowed:
        name = foreign_field(part, PART_FIELDS[part.type])  # never ignored
        if name is not None:
            raise InvalidRequestError(f"{where}.{name}: {part.type} parts have no '{name}'",
                                      param=f"{where}.{name}")
        text = part.refusal if part.type == "refusal" else part.text
        if text is None:
            raise InvalidRequestError(f"{where}: a {part.type} part needs its text", param=where)
        return text
    kind = _NOT_TEXT.get(part.type)
    if kind is not None:
        raise InvalidRequestError(f"{where}: this model reads text only and cannot take {kind} "
                                  f"(content part type '{part.type}')", param=where)
    raise InvalidRequestError(f"{where}: content part type '{part.type}' is not supported in a "
                              f"{role} message (only {' and '.join(allowed)})", param=where)


def _message(m: Message, where: str) -> ChatMessage:
    if m.phase is not None and (m.role != "assistant" or m.phase != "final_answer"):
        raise InvalidRequestError(
            f"{where}.phase: only an assistant message's 'final_answer' is taken here (a "
            "commentary phase has no place in this model's chat template)",
            param=f"{where}.phase")
    if isinstance(m.content, str):
        return ChatMessage(role=m.role, content=m.content)
    if not m.content:  # OpenAI: "expected an array with minimum length 1"
        raise InvalidRequestError(f"{where}.content: an empty list (give at least one part, "
                                  "or a string)", param=f"{where}.content")
    parts = [ChatPart(type="text", text=_text(p, m.role, f"{where}.content[{j}]"))
             for j, p in enumerate(m.content)]
    return ChatMessage(role=m.role, content=parts)


def _call(out: list[ChatMessage], item: FunctionCall) -> None:
    """A call the model made: added to the assistant turn it belongs to."""
    call = MessageToolCall(id=item.call_id,
                           function=ChatFunctionCall(name=item.name, arguments=item.arguments))
    last = out[-1] if out else None
    if last is not None and last.role == "assistant":
        last.tool_calls = [*(last.tool_calls or []), call]
    else:
        out.append(ChatMessage(role="assistant", tool_calls=[call]))


def _output(item: FunctionCallOutput, where: str, names: dict[str, str]) -> ChatMessage:
    if item.call_id not in names:  # OpenAI's rule: it answers a function_call given earlier
        raise InvalidRequestError(f"{where}.call_id: no earlier function_call item has the "
                                  f"call_id '{item.call_id}'", param=f"{where}.call_id")
    content = item.output
    if isinstance(content, list):
        content = "".join(_text(p, "tool", f"{where}.output[{j}]")
                          for j, p in enumerate(content))
    return ChatMessage(role="tool", content=content, tool_call_id=item.call_id,
                       name=names.get(item.call_id))


def _messages(req: ResponseRequest, first: int = 0) -> list[ChatMessage]:
    """The chat messages of ``req``'s input, whose first ``first`` items are an earlier
    response's conversation (``previous_response_id``): errors name this request's items."""
    out = [ChatMessage(role="system", content=req.instructions)] if req.instructions else []
    if not req.input:
        raise InvalidRequestError("input must not be empty", param="input")
    if isinstance(req.input, str):
        return [*out, ChatMessage(role="user", content=req.input)]
    names: dict[str, str] = {}  # call_id -> the function's name
    thought: list[str] = []  # reasoning items not yet given to an assistant turn
    for i, raw in enumerate(req.input):
        where = (f"input[{i - first}]" if i >= first
                 else f"previous_response_id's conversation[{i}]")
        kind = raw.get("type", "message")
        if kind == "reasoning":
            item = _convert(raw, Reasoning, where)
            if item.content:
                thought += [part.text for part in item.content]
            elif item.encrypted_content is not None:  # (a stateless client's round trip)
                thought.append(read_opaque(item.encrypted_content,
                                           f"{where}.encrypted_content"))
            else:  # another server's item may hold only its summary: read as the thinking
                thought += [_summary_text(part, f"{where}.summary[{j}]")
                            for j, part in enumerate(item.summary)]
            continue
        if kind == "message":
            out.append(_message(_convert(raw, Message, where), where))
        elif kind == "function_call":
            call = _convert(raw, FunctionCall, where)
            names[call.call_id] = call.name
            _call(out, call)
        elif kind == "function_call_output":
            out.append(_output(_convert(raw, FunctionCallOutput, where), where, names))
        else:
            raise InvalidRequestError(f"{where}: input items of type {kind!r} are not supported "
                                      "(message, function_call, function_call_output and "
                                      "reasoning are)", param=where)
        if thought and out[-1].role == "assistant":  # the thinking before this turn's answer
            out[-1].reasoning_content = "\n\n".join(thought)
            thought = []
    if thought:  # thinking with no answer after it: an assistant turn of its own
        out.append(ChatMessage(role="assistant", content="",
                               reasoning_content="\n\n".join(thought)))
    answered = {m.tool_call_id for m in out if m.role == "tool"}
    unanswered = [c for c in names if c not in answered]
    if unanswered:  # (OpenAI's 400: the model would answer as if the call had not failed)
        raise InvalidRequestError(f"No tool output found for function call {unanswered[0]}: "
                                  "each function_call item needs a function_call_output",
                                  param="input")
    return out


def _summary_text(part: Any, where: str) -> str:
    if not (isinstance(part, dict) and part.get("type") == "summary_text"
            and isinstance(part.get("text"), str) and set(part) <= {"type", "text"}):
        raise InvalidRequestError(f'{where}: a summary part is {{"type": "summary_text", '
                                  '"text": ...}', param=where)
    return part["text"]


def _tools(req: ResponseRequest) -> list[Tool] | None:
    tools = []
    for i, raw in enumerate(req.tools or []):
        where = f"tools[{i}]"
        if raw.get("type") != "function":
            raise InvalidRequestError(f"{where}.type: only function tools are supported "
                                      f"(not {raw.get('type')!r})", param=f"{where}.type")
        t = _convert(raw, FunctionTool, where)
        tools.append(Tool(type="function", function=FunctionDef(
            name=t.name, description=t.description, parameters=t.parameters, strict=t.strict)))
    return tools or None


_CHOICES: dict[str, ChatToolChoice] = {"none": "none", "auto": "auto", "required": "required"}


def _tool_choice(choice: str | dict[str, Any] | None) -> ChatToolChoice:
    if choice is None:
        return None
    if isinstance(choice, str) and choice in _CHOICES:
        return _CHOICES[choice]
    if isinstance(choice, dict) and choice.get("type") == "function":
        named = _convert(choice, _NamedChoice, "tool_choice")
        return ToolChoiceNamed(function=ToolChoiceFunction(name=named.name))
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        allowed = _convert(choice, _AllowedChoice, "tool_choice")
        return ToolChoiceAllowed(allowed_tools=AllowedTools(mode=allowed.mode, tools=[
            AllowedTool(type="function", function=ToolChoiceFunction(name=t.name))
            for t in allowed.tools]))
    raise InvalidRequestError("tool_choice must be 'none', 'auto', 'required', "
                              "{\"type\": \"function\", \"name\": ...} or {\"type\": "
                              "\"allowed_tools\", ...} (only function tools exist here)",
                              param="tool_choice")


class _NamedChoice(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    name: str


class _AllowedChoice(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[_NamedChoice]


def _response_format(req: ResponseRequest) -> ResponseFormat | None:
    if req.text is None:
        return None
    if req.text.verbosity not in (None, "medium"):
        raise InvalidRequestError("text.verbosity: this server has no verbosity control",
                                  param="text.verbosity")
    fmt = req.text.format
    if fmt is None:
        return None
    if fmt.description is not None:  # (chat's json_schema has none either)
        raise InvalidRequestError("text.format.description: a format's description is not "
                                  "supported (say what the answer is for in the "
                                  "instructions)", param="text.format.description")
    if fmt.type != "json_schema":
        for name in ("name", "schema", "strict"):
            if getattr(fmt, name) is not None:
                raise InvalidRequestError(f"text.format.{name}: only with type 'json_schema' "
                                          f"(the type is '{fmt.type}')",
                                          param=f"text.format.{name}")
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if fmt.schema is None:
        raise InvalidRequestError("text.format: a json_schema format needs its schema",
                                  param="text.format.schema")
    if fmt.strict:
        check_strict(fmt.schema, "text.format.schema")
    return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
        name=fmt.name, schema=fmt.schema, strict=fmt.strict))


# OpenAI's limits on metadata: 16 pairs, keys up to 64 characters, values up to 512.
_METADATA_PAIRS, _METADATA_KEY, _METADATA_VALUE = 16, 64, 512


def check_metadata(metadata: dict[str, str] | None) -> None:
    if not metadata:
        return
    if len(metadata) > _METADATA_PAIRS:
        raise InvalidRequestError(f"metadata: at most {_METADATA_PAIRS} pairs (got "
                                  f"{len(metadata)})", param="metadata")
    for key, value in metadata.items():
        if len(key) > _METADATA_KEY or len(value) > _METADATA_VALUE:
            raise InvalidRequestError(f"metadata.{key[:_METADATA_KEY]}: keys are at most "
                                      f"{_METADATA_KEY} characters and values at most "
                                      f"{_METADATA_VALUE}", param=f"metadata.{key[:_METADATA_KEY]}")


# The one extra output a response can include: its reasoning as ``encrypted_content``.
INCLUDABLE = ("reasoning.encrypted_content",)
_OPAQUE = "justllm-reasoning:"  # what opaque_reasoning writes before the thinking's base64


def opaque_reasoning(text: str) -> str:
    """A reasoning item's ``encrypted_content`` as this server writes it: the thinking itself,
    base64-coded behind a marker, not encrypted (there is nothing here to hide it from: the
    same text is the item's ``content``). Stateless clients (``store: false``, such as Codex)
    send it back, and :func:`read_opaque` reads it."""
    return _OPAQUE + base64.b64encode(text.encode()).decode()


def read_opaque(value: str, where: str) -> str:
    """The thinking in an ``encrypted_content`` this server wrote; a 400 for any other (an
    OpenAI-encrypted blob cannot be read here)."""
    if value.startswith(_OPAQUE):
        try:
            return base64.b64decode(value[len(_OPAQUE):], validate=True).decode()
        except (ValueError, UnicodeDecodeError):
            pass
    raise InvalidRequestError(f"{where}: not reasoning this server wrote (encrypted reasoning "
                              "from another server cannot be read here)", param=where)


def to_chat(req: ResponseRequest, first: int = 0) -> ChatCompletionRequest:
    """The Responses request as the chat completion that serves it."""
    check_metadata(req.metadata)
    for k, value in enumerate(req.include or []):
        if value not in INCLUDABLE:
            raise InvalidRequestError(f"include[{k}]: only {', '.join(INCLUDABLE)} is "
                                      f"available (not {value!r})", param=f"include[{k}]")
    for name, (off, why) in _REFUSED.items():
        if getattr(req, name) not in off:
            raise InvalidRequestError(f"{name}: {why}", param=name)
    check_stream_options(req)
    effort = req.reasoning.effort if req.reasoning else None
    tools, choice, parallel = _tools(req), _tool_choice(req.tool_choice), req.parallel_tool_calls
    if not tools and req.tool_choice is None and parallel is not None:
        raise InvalidRequestError("parallel_tool_calls is only allowed when tools are given",
                                  param="parallel_tool_calls")  # (chat's rule, OpenAI's)
    if not tools and choice in ("auto", "none"):
        # A Response says tool_choice "auto" and parallel_tool_calls true with no tools, and
        # clients send its settings back (chat's 400 for them, OpenAI's own, is not the
        # Responses API's); with nothing to call both say nothing. "required" stays a 400.
        choice, parallel = None, None
    return ChatCompletionRequest(reasoning_effort=effort,
        model=req.model, messages=_messages(req, first), max_tokens=req.max_output_tokens,
        temperature=req.temperature, top_p=req.top_p, tools=tools,
        tool_choice=choice, parallel_tool_calls=parallel,
        user=req.user or req.safety_identifier, response_format=_response_format(req))
