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
import re
from itertools import groupby
from typing import Any, Literal

import msgspec

from justllm.core.reasoning import THINKING_SWITCH
from justllm.errors import InvalidRequestError
from justllm.server.anthropic_schemas import (
    BLOCK_FIELDS,
    Block,
    Message,
    MessagesRequest,
    Tool,
    _Prompt,
)
from justllm.server.json_schema import check_strict, unenforced
from justllm.server.openai_serving import MAX_REQUEST_STOP
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
    foreign_field,
)
from justllm.server.schemas import Tool as ChatTool
from justllm.server.tools.parse import FUNCTION_NAME

ChatToolChoice = Literal["none", "auto", "required"] | ToolChoiceNamed | None

_NOT_TEXT = {"image": "images", "document": "documents", "search_result": "search results",
             "container_upload": "files"}
# Fields refused unless absent, and why.
_REFUSED = (("speed", "there is one inference speed"),
            ("user_profile_id", "there are no user profiles on this server"),
            ("workspace_id", "there are no workspaces on this server"),
            ("mcp_servers", "MCP servers are not supported"),
            ("context_management", "context management is not supported"),
            ("container", "containers (code execution) are not supported"),
            ("inference_geo", "there is one inference location"),
            ("diagnostics", "prompt-cache diagnostics are not supported"))
# A call id this server made for a Mistral-format template (9 letters and digits), as this
# route returns it (``anthropic.tool_use_id``); the chat side gets the 9 back.
_MISTRAL_ID = re.compile(r"toolu_([A-Za-z0-9]{9})")


def _chat_id(tool_use_id: str) -> str:
    """A ``tool_use`` id as the chat side knows it: the same, except that the ``toolu_`` put
    before a Mistral-format call's id is taken off again (its templates insist on the 9)."""
    m = _MISTRAL_ID.fullmatch(tool_use_id)
    return m.group(1) if m else tool_use_id


def _refuse(where: str, why: str) -> InvalidRequestError:
    return InvalidRequestError(f"{where}: {why}", param=where)


def _own_fields(block: Block, where: str) -> None:
    """A 400 naming any field of another block type set on ``block``: Anthropic's blocks are
    typed ("Extra inputs are not permitted"), and a field this server would not read is
    never ignored."""
    name = foreign_field(block, BLOCK_FIELDS[block.type])
    if name is not None:
        raise _refuse(f"{where}.{name}", f"a {block.type} block has no '{name}' (extra "
                                         "inputs are not permitted)")


def _text(block: Block, where: str) -> str:
    """A text block's text; a 400 naming any other kind."""
    if block.type == "text":
        _own_fields(block, where)
        if block.text is None:
            raise _refuse(where, "a text block needs 'text'")
        if not block.text:  # Anthropic's rules
            raise _refuse(f"{where}.text", "text content blocks must be non-empty")
        if not block.text.strip():
            raise _refuse(f"{where}.text", "text content blocks must contain non-whitespace text")
        if block.citations:
            raise _refuse(f"{where}.citations", "citations are not supported")
        return block.text
    kind = _NOT_TEXT.get(block.type)
    if kind is not None:
        raise _refuse(where, f"this model reads text only and cannot take {kind} "
                             f"(block type '{block.type}')")
    if block.type == "redacted_thinking":
        raise _refuse(where, "redacted (encrypted) thinking cannot be read by this server")
    raise _refuse(where, f"block type '{block.type}' is not supported here (text, thinking, "
                         "tool_use and tool_result are)")


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
    _own_fields(block, where)
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
    return ChatMessage(role="tool", content=text, tool_call_id=_chat_id(block.tool_use_id),
                       name=names.get(block.tool_use_id))


def _tool_call(block: Block, where: str) -> MessageToolCall:
    _own_fields(block, where)
    if not block.id or not block.name or block.input is None:
        raise _refuse(where, "a tool_use block needs id, name and input")
    return MessageToolCall(id=_chat_id(block.id), function=FunctionCall(
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
    if m.reasoning_content:
        last.reasoning_content = "\n\n".join(filter(None, (last.reasoning_content,
                                                            m.reasoning_content)))


def _turn(m: Message, i: int, out: list[ChatMessage], names: dict[str, str]) -> None:
    where = f"messages[{i}].content"
    if not m.content:  # Anthropic refuses an empty turn too
        raise _refuse(where, "a message needs content (a non-empty string or blocks)")
    blocks = [Block(type="text", text=m.content)] if isinstance(m.content, str) else m.content
    parts: list[ContentPart] = []
    calls: list[MessageToolCall] = []
    thoughts: list[str] = []
    for j, b in enumerate(blocks):
        at = f"{where}[{j}]"
        if b.type == "thinking":  # the assistant's thinking: its reasoning_content
            if m.role != "assistant":
                raise _refuse(at, "thinking blocks belong to assistant turns")
            _own_fields(b, at)
            if b.thinking is None or not isinstance(b.thinking, str):
                raise _refuse(f"{at}.thinking", "a thinking block needs its thinking text")
            thoughts.append(b.thinking)
        elif b.type == "tool_use":
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
    if parts or calls or thoughts or not blocks:
        _append(out, ChatMessage(role=m.role, content=parts if parts or not calls else None,
                                 tool_calls=calls or None,
                                 reasoning_content="\n\n".join(thoughts) or None))


def _messages(req: _Prompt) -> list[ChatMessage]:
    if not req.messages:
        raise _refuse("messages", "at least one message is required")
    if req.messages[-1].role == "assistant":
        _check_prefill(req.messages[-1], len(req.messages) - 1)
    out = _system(req)
    names: dict[str, str] = {}  # tool_use id -> the tool's name
    for i, m in enumerate(req.messages):
        _turn(m, i, out, names)
    if names and not req.tools:  # a tool_result answers a tool_use: names has it
        raise _refuse("tools", "requests which include `tool_use` or `tool_result` blocks "
                               "must define tools")
    _check_pairs(req.messages)
    return out


def _check_prefill(m: Message, i: int) -> None:
    """A last assistant message is a prefill: the answer continues its text (Anthropic's
    rules: text only, and no trailing whitespace)."""
    blocks = [Block(type="text", text=m.content)] if isinstance(m.content, str) else m.content
    blocks = [b for b in blocks if b.type != "thinking"]  # (its thinking, then the text)
    if any(b.type != "text" for b in blocks):
        raise _refuse(f"messages[{i}].content", "a prefilled assistant turn (the last message) "
                                               "continues text: it can hold text blocks only")
    text = blocks[-1].text if blocks else None
    if text is not None and text != text.rstrip():
        raise _refuse("messages", "final assistant content cannot end with trailing whitespace")


def _check_pairs(messages: list[Message]) -> None:
    """Anthropic's pairing of tool blocks, turn by turn (consecutive messages of one role are
    one turn, as Anthropic combines them): the user turn right after an assistant turn with
    ``tool_use`` blocks has a ``tool_result`` for each of them, and a ``tool_result`` answers
    a ``tool_use`` of the assistant turn right before it."""
    asked: list[str] = []  # the tool_use ids of the assistant turn before
    for role, group in groupby(enumerate(messages), key=lambda e: e[1].role):
        turn = list(group)
        blocks = [(f"messages[{i}].content[{j}]", b) for i, m in turn
                  if not isinstance(m.content, str) for j, b in enumerate(m.content)]
        if role == "assistant":
            asked = [b.id or "" for _, b in blocks if b.type == "tool_use"]
            twice = sorted({u for u in asked if asked.count(u) > 1})
            if twice:  # a tool_result could not say which it answers
                raise _refuse(f"messages[{turn[0][0]}].content",
                              f"`tool_use` ids must be unique: {', '.join(twice)}")
            continue
        answered = set()
        other = None  # the first block of another type, where tool_results must lead
        for where, b in blocks:
            if b.type != "tool_result":
                other = other or where
                continue
            if asked and other is not None:  # (Anthropic's rule: results first, text after)
                raise _refuse(other, "in the user turn that answers `tool_use` blocks, the "
                                     "`tool_result` blocks come first and any other content "
                                     "after them")
            if b.tool_use_id in answered:
                raise _refuse(f"{where}.tool_use_id", f"a second tool_result block for "
                                                      f"'{b.tool_use_id}': each tool_use has "
                                                      "one")
            if b.tool_use_id not in asked:
                raise _refuse(f"{where}.tool_use_id", f"unexpected tool_use_id "
                                                      f"'{b.tool_use_id}': each tool_result block "
                                                      "must answer a tool_use block of the "
                                                      "assistant turn right before it")
            answered.add(b.tool_use_id)
        missing = [u for u in asked if u not in answered]
        if missing:
            raise _refuse(f"messages[{turn[0][0]}].content", "`tool_use` ids were found "
                          f"without `tool_result` blocks immediately after: "
                          f"{', '.join(missing)}. Each `tool_use` block must have a "
                          "corresponding `tool_result` block in the next message")
        asked = []


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
    if not FUNCTION_NAME.fullmatch(tool.name):  # (a tool's name: the chat side's rule)
        raise _refuse(f"{where}.name", "a tool name is 1 to 64 letters, digits, '_' or '-'")
    if tool.input_schema is None:
        raise _refuse(f"{where}.input_schema", "a client tool needs its input_schema")
    if tool.input_schema.get("type", "object") != "object":
        raise _refuse(f"{where}.input_schema", "the input schema must describe a JSON object "
                                               "(type 'object')")
    if tool.strict:
        check_strict(tool.input_schema, f"{where}.input_schema")
    return ChatTool(type="function", function=FunctionDef(
        name=tool.name, description=tool.description, parameters=tool.input_schema,
        strict=tool.strict))


def _tools(req: _Prompt) -> tuple[list[ChatTool] | None, ChatToolChoice, bool | None]:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of the chat request."""
    tools = [_tool(t, i) for i, t in enumerate(req.tools or [])] or None
    seen: set[str] = set()
    for i, t in enumerate(req.tools or []):
        if t.name in seen:
            raise _refuse(f"tools[{i}].name", f"tool names must be unique: '{t.name}' is "
                                              "given twice")
        seen.add(t.name)
    choice = req.tool_choice
    if choice is None:
        return tools, None, None
    if choice.type == "tool" and not choice.name:
        raise _refuse("tool_choice.name", "tool_choice of type 'tool' needs the tool's name")
    if choice.type == "tool" and choice.name not in seen:
        raise _refuse("tool_choice.name", f"tool_choice names the tool '{choice.name}', which "
                                          "is not in tools")
    if choice.type != "tool" and choice.name is not None:
        raise _refuse("tool_choice.name", f"tool_choice of type '{choice.type}' takes no name")
    mapped: ChatToolChoice = (
        ToolChoiceNamed(function=ToolChoiceFunction(name=choice.name or ""))
        if choice.type == "tool" else "required" if choice.type == "any" else choice.type)
    return tools, mapped, False if choice.disable_parallel_tool_use else None


def _response_format(req: _Prompt) -> ResponseFormat | None:
    fmt = req.output_config.format if req.output_config else None
    if fmt is None:
        return None
    # Anthropic's structured output is always strict: a keyword the grammar would pass over
    # is refused, never silently dropped.
    found = unenforced(fmt.schema)
    if found:
        more = f" and {len(found) - 3} more" if len(found) > 3 else ""
        raise _refuse("output_config.format.schema",
                      f"structured output follows its schema exactly, but the output grammar "
                      f"cannot enforce {'; '.join(found[:3])}{more} (leave it out of the "
                      "schema, or say it in the prompt)")
    return ResponseFormat(type="json_schema",
                          json_schema=JsonSchemaFormat(name="output", schema=fmt.schema,
                                                       strict=True))


MIN_THINKING_BUDGET = 1024  # Anthropic's least budget_tokens


def _thinking(req: _Prompt) -> dict[str, Any]:
    """``thinking`` and ``output_config.effort`` as the chat request's fields. Thinking is
    off unless enabled (Anthropic's default): a reasoning model's template gets
    ``enable_thinking`` (a template without the switch thinks as it always does); its
    thinking comes back as thinking blocks either way. ``budget_tokens`` (Anthropic's rules:
    at least 1,024, less than ``max_tokens``) is the thinking budget: past it, the model's
    end of thinking is forced (a model that does not think stays within any budget)."""
    t = req.thinking
    on = t is not None and t.type != "disabled"
    budget = None
    if t is not None:
        if t.type == "enabled":
            if t.budget_tokens is None:
                raise _refuse("thinking.budget_tokens", "enabled thinking needs budget_tokens")
            if t.budget_tokens < MIN_THINKING_BUDGET:
                raise _refuse("thinking.budget_tokens", f"must be at least "
                                                        f"{MIN_THINKING_BUDGET}")
            max_tokens = getattr(req, "max_tokens", None)
            if max_tokens is not None and t.budget_tokens >= max_tokens:
                raise _refuse("thinking.budget_tokens", "`max_tokens` must be greater than "
                                                        "`thinking.budget_tokens`")
            budget = t.budget_tokens
        elif t.budget_tokens is not None:
            raise _refuse("thinking.budget_tokens", f"only with thinking of type 'enabled' "
                                                    f"(the type is '{t.type}')")
    effort = req.output_config.effort if req.output_config else None
    return {"chat_template_kwargs": {THINKING_SWITCH: on}, "reasoning_format": "deepseek",
            "thinking_budget_tokens": budget, "reasoning_effort": effort}


def to_chat(req: _Prompt) -> ChatCompletionRequest:
    """The Anthropic request (a message, or a token count's prompt) as a chat completion."""
    for name, why in _REFUSED:
        if getattr(req, name, None) is not None:
            raise _refuse(name, why)
    tools, choice, parallel = _tools(req)
    fmt = _response_format(req)
    if req.thinking is not None and req.thinking.type != "disabled":
        if choice == "required" or isinstance(choice, ToolChoiceNamed):
            raise _refuse("thinking", "thinking may not be enabled when tool_choice forces "
                                      "tool use")  # (Anthropic's rule too)
        if fmt is not None:
            raise _refuse("thinking", "thinking cannot be combined with output_config.format "
                                      "on this server (the format holds the answer from its "
                                      "first token)")
    if fmt is not None and tools and (choice == "required"
                                      or isinstance(choice, ToolChoiceNamed)):
        # (with tool_choice auto the answer is a call or text in the format)
        raise _refuse("output_config.format", "structured output cannot be combined with a "
                                              "forced tool call (the call is the whole "
                                              "answer): send tool_choice {\"type\": "
                                              "\"auto\"} or no output_config.format")
    prefill = bool(req.messages) and req.messages[-1].role == "assistant"
    if prefill and tools and choice != "none":
        raise _refuse("messages", "a prefilled assistant turn cannot be combined with tools on "
                                  "this server (the tool call format starts the answer): send "
                                  "tool_choice {\"type\": \"none\"} or end with a user message")
    chat = ChatCompletionRequest(model=req.model, messages=_messages(req), tools=tools,
                                 tool_choice=choice, parallel_tool_calls=parallel,
                                 response_format=fmt, continue_final_message=prefill,
                                 **_thinking(req))
    if not isinstance(req, MessagesRequest):
        return chat
    stops = req.stop_sequences or []
    if not all(stops):
        raise _refuse("stop_sequences", "stop sequences must be non-empty strings")
    if len(stops) > MAX_REQUEST_STOP:
        raise _refuse("stop_sequences", f"at most {MAX_REQUEST_STOP} stop sequences")
    return msgspec.structs.replace(
        chat, max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
        top_k=req.top_k, stop=req.stop_sequences,
        user=req.metadata.user_id if req.metadata else None)
