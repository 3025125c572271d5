"""An Anthropic Messages request as the chat completion that serves it.

``system`` becomes a system message; each turn's text blocks become text parts, its
``tool_use`` blocks an assistant's ``tool_calls`` (``input`` as JSON text), its ``tool_result``
blocks ``tool`` messages (named after the tool the call used, for templates that want it);
``tools`` and ``tool_choice`` map one to one (``any`` is ``required``, ``tool`` a named
function, ``disable_parallel_tool_use`` is ``parallel_tool_calls: false``).

Every field is honoured or refused with a 400 that names it, never silently ignored. Prompt
caching hints (``cache_control``) are accepted because justllm caches every prompt's prefix on
its own; ``metadata.user_id`` is the chat request's ``user``.
"""

from __future__ import annotations

import json
from typing import Literal

import msgspec

from justllm.errors import InvalidRequestError
from justllm.server.anthropic_schemas import Block, Message, MessagesRequest, Tool, _Prompt
from justllm.server.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    ContentPart,
    FunctionCall,
    FunctionDef,
    JsonSchemaFormat,
    MessageToolCall,
    ResponseFormat,
    ToolChoiceFunction,
    ToolChoiceNamed,
)
from justllm.server.schemas import Tool as ChatTool

ChatToolChoice = Literal["none", "auto", "required"] | ToolChoiceNamed | None

_NOT_TEXT = {"image": "images", "document": "documents", "search_result": "search results",
             "container_upload": "files"}
# Fields refused unless absent, and why.
_REFUSED = (("thinking", "extended thinking is not supported by this server"),
            ("speed", "there is one inference speed"),
            ("user_profile_id", "there are no user profiles on this server"),
            ("workspace_id", "there are no workspaces on this server"),
            ("mcp_servers", "MCP servers are not supported"),
            ("context_management", "context management is not supported"),
            ("container", "containers (code execution) are not supported"),
            ("inference_geo", "there is one inference location"),
            ("diagnostics", "prompt-cache diagnostics are not supported"))


def _refuse(where: str, why: str) -> InvalidRequestError:
    return InvalidRequestError(f"{where}: {why}", param=where)


def _text(block: Block, where: str) -> str:
    """A text block's text; a 400 naming any other kind."""
    if block.type == "text":
        if block.text is None:
            raise _refuse(where, "a text block needs 'text'")
        if block.citations:
            raise _refuse(f"{where}.citations", "citations are not supported")
        return block.text
    kind = _NOT_TEXT.get(block.type)
    if kind is not None:
        raise _refuse(where, f"this model reads text only and cannot take {kind} "
                             f"(block type '{block.type}')")
    if block.type in ("thinking", "redacted_thinking"):
        raise _refuse(where, "thinking blocks are not supported (this server does not think)")
    raise _refuse(where, f"block type '{block.type}' is not supported here (text, tool_use "
                         "and tool_result are)")


def _system(req: _Prompt) -> list[ChatMessage]:
    if not req.system:
        return []
    if isinstance(req.system, str):
        return [ChatMessage(role="system", content=req.system)]
    parts = [ContentPart(type="text", text=_text(b, f"system[{i}]"))
             for i, b in enumerate(req.system)]
    return [ChatMessage(role="system", content=parts)]


def _tool_result(block: Block, where: str, names: dict[str, str]) -> ChatMessage:
    """A ``tool_result`` block as a ``tool`` message; an error result says it is one."""
    if not block.tool_use_id:
        raise _refuse(f"{where}.tool_use_id", "a tool_result block needs the id of its tool_use")
    if block.tool_use_id not in names:  # Anthropic's rule: it answers an earlier tool_use
        raise _refuse(f"{where}.tool_use_id", f"no earlier tool_use block has the id "
                                              f"'{block.tool_use_id}'")
    content = block.content
    if isinstance(content, list):
        content = "".join(_text(b, f"{where}.content[{k}]") for k, b in enumerate(content))
    text = content or ""
    if block.is_error:
        text = f"Error: {text}"
    return ChatMessage(role="tool", content=text, tool_call_id=block.tool_use_id,
                       name=names.get(block.tool_use_id))


def _tool_call(block: Block, where: str) -> MessageToolCall:
    if not block.id or not block.name or block.input is None:
        raise _refuse(where, "a tool_use block needs id, name and input")
    return MessageToolCall(id=block.id, function=FunctionCall(
        name=block.name, arguments=json.dumps(block.input, ensure_ascii=False)))


def _append(out: list[ChatMessage], m: ChatMessage) -> None:
    """Add a user or assistant message, combined with the one before if it has the same role
    (as Anthropic combines consecutive turns; chat templates insist on alternating roles)."""
    last = out[-1] if out else None
    if last is None or last.role != m.role:
        out.append(m)
        return
    if isinstance(m.content, list) and not isinstance(last.content, str):
        last.content = [*(last.content or []), *m.content]
    if m.tool_calls:
        last.tool_calls = [*(last.tool_calls or []), *m.tool_calls]


def _turn(m: Message, i: int, out: list[ChatMessage], names: dict[str, str]) -> None:
    where = f"messages[{i}].content"
    if not m.content:  # Anthropic refuses an empty turn too
        raise _refuse(where, "a message needs content (a non-empty string or blocks)")
    blocks = [Block(type="text", text=m.content)] if isinstance(m.content, str) else m.content
    parts: list[ContentPart] = []
    calls: list[MessageToolCall] = []
    for j, b in enumerate(blocks):
        at = f"{where}[{j}]"
        if b.type == "tool_use":
            if m.role != "assistant":
                raise _refuse(at, "tool_use blocks belong to assistant turns")
            calls.append(_tool_call(b, at))
            names[b.id or ""] = b.name or ""
        elif b.type == "tool_result":
            if m.role != "user":
                raise _refuse(at, "tool_result blocks belong to user turns")
            if parts:  # text before the results: its own user message, in order
                _append(out, ChatMessage(role="user", content=parts))
                parts = []
            out.append(_tool_result(b, at, names))
        else:
            parts.append(ContentPart(type="text", text=_text(b, at)))
    if parts or calls or not blocks:
        _append(out, ChatMessage(role=m.role, content=parts if parts or not calls else None,
                                 tool_calls=calls or None))


def _messages(req: _Prompt) -> list[ChatMessage]:
    if not req.messages:
        raise _refuse("messages", "at least one message is required")
    if req.messages[-1].role == "assistant":
        raise _refuse("messages", "the last message is the assistant's: continuing a "
                                  "prefilled assistant turn is not supported (end with a user "
                                  "message)")
    out = _system(req)
    names: dict[str, str] = {}  # tool_use id -> the tool's name
    for i, m in enumerate(req.messages):
        _turn(m, i, out, names)
    return out


def _tool(tool: Tool, i: int) -> ChatTool:
    where = f"tools[{i}]"
    if tool.type not in (None, "custom"):
        raise _refuse(f"{where}.type", f"server tools ('{tool.type}') are not supported; only "
                                       "client tools (name, description, input_schema) are")
    if tool.input_examples:
        raise _refuse(f"{where}.input_examples", "tool input examples are not supported (put "
                                                 "them in the description)")
    if tool.allowed_callers not in (None, [], ["direct"]):
        raise _refuse(f"{where}.allowed_callers", "only direct calls exist here")
    if tool.defer_loading:
        raise _refuse(f"{where}.defer_loading", "deferred tool loading is not supported")
    if tool.input_schema is None:
        raise _refuse(f"{where}.input_schema", "a client tool needs its input_schema")
    return ChatTool(type="function", function=FunctionDef(
        name=tool.name, description=tool.description, parameters=tool.input_schema,
        strict=tool.strict))


def _tools(req: _Prompt) -> tuple[list[ChatTool] | None, ChatToolChoice, bool | None]:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of the chat request."""
    tools = [_tool(t, i) for i, t in enumerate(req.tools or [])] or None
    choice = req.tool_choice
    if choice is None:
        return tools, None, None
    if choice.type == "tool" and not choice.name:
        raise _refuse("tool_choice.name", "tool_choice of type 'tool' needs the tool's name")
    if choice.type != "tool" and choice.name is not None:
        raise _refuse("tool_choice.name", f"tool_choice of type '{choice.type}' takes no name")
    mapped: ChatToolChoice = (
        ToolChoiceNamed(type="function", function=ToolChoiceFunction(name=choice.name or ""))
        if choice.type == "tool" else "required" if choice.type == "any" else choice.type)
    return tools, mapped, False if choice.disable_parallel_tool_use else None


def _response_format(req: _Prompt) -> ResponseFormat | None:
    fmt = req.output_config.format if req.output_config else None
    if fmt is None:
        return None
    return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(schema=fmt.schema))


def to_chat(req: _Prompt) -> ChatCompletionRequest:
    """The Anthropic request (a message, or a token count's prompt) as a chat completion."""
    for name, why in _REFUSED:
        if getattr(req, name, None) is not None:
            raise _refuse(name, why)
    if req.output_config is not None and req.output_config.effort is not None:
        raise _refuse("output_config.effort", "this server has no effort control")
    tools, choice, parallel = _tools(req)
    chat = ChatCompletionRequest(model=req.model, messages=_messages(req), tools=tools,
                                 tool_choice=choice, parallel_tool_calls=parallel,
                                 response_format=_response_format(req))
    if not isinstance(req, MessagesRequest):
        return chat
    return msgspec.structs.replace(
        chat, max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
        top_k=req.top_k, stop=req.stop_sequences,
        user=req.metadata.user_id if req.metadata else None)
