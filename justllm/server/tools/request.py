"""A chat request's ``tools``, ``tool_choice``, ``parallel_tool_calls`` and tool messages,
checked once and resolved into what serving needs (``ToolPlan``). Every refusal is an
``InvalidRequestError`` naming the field, as OpenAI words them where it has one."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from justllm.engine.schema_rewrite import check_valid_schema
from justllm.errors import InvalidRequestError
from justllm.server.json_schema import check_strict
from justllm.server.schemas import (
    AllowedTool,
    ChatCompletionRequest,
    ChatMessage,
    Tool,
    ToolChoiceAllowed,
    ToolChoiceNamed,
)
from justllm.server.tools.parse import FUNCTION_NAME


@dataclass(frozen=True)
class Function:
    name: str
    description: str | None
    parameters: dict[str, Any] | None
    strict: bool

    def for_template(self) -> dict[str, Any]:
        """The tool as chat templates get it (OpenAI's shape, without ``strict``)."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.parameters if self.parameters is not None else {
            "type": "object", "properties": {}}
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolPlan:
    """What the request asks of tools. ``mode``: "none" (no tools in the prompt, nothing
    parsed), "auto" (tools in the prompt, the answer parsed), "required" (a call forced by a
    grammar over ``functions``), or "named" (``forced`` is the one function it may call).
    ``allowed``: the functions that may be called (``allowed_tools``; None: all of them);
    the prompt shows every one."""

    functions: tuple[Function, ...] = ()
    mode: str = "none"
    forced: str | None = None
    parallel: bool = True
    allowed: frozenset[str] | None = None

    @property
    def active(self) -> bool:
        return self.mode != "none"

    @property
    def enforced(self) -> bool:
        return self.mode in ("required", "named")

    @property
    def names(self) -> frozenset[str]:
        """The functions an answer's call may name (a call of another is read as text)."""
        return frozenset(f.name for f in self.callable())

    def callable(self) -> tuple[Function, ...]:
        """The functions a call may name (a forced one, or the allowed ones)."""
        return tuple(f for f in self.functions if self.forced in (None, f.name)
                     and (self.allowed is None or f.name in self.allowed))

    def for_template(self) -> list[dict[str, Any]] | None:
        return [f.for_template() for f in self.functions] if self.active else None


def tool_plan(req: ChatCompletionRequest) -> ToolPlan:
    functions = _functions(req.tools or [])
    choice = req.tool_choice
    parallel = req.parallel_tool_calls is not False
    if not functions:
        if choice not in (None, "none"):
            raise InvalidRequestError("tool_choice is only allowed when tools are given",
                                      param="tool_choice")
        return ToolPlan(parallel=parallel)
    if isinstance(choice, ToolChoiceNamed):
        name = choice.function.name
        if name not in {f.name for f in functions}:
            raise InvalidRequestError(f"tool_choice names the function '{name}', which is not "
                                      "in tools", param="tool_choice")
        plan = ToolPlan(functions, "named", name, parallel)
    elif isinstance(choice, ToolChoiceAllowed):
        plan = ToolPlan(functions, choice.allowed_tools.mode, None, parallel,
                        _allowed(choice.allowed_tools.tools, functions))
    else:
        plan = ToolPlan(functions, choice or "auto", None, parallel)
    if plan.active:
        if req.logprobs:
            raise InvalidRequestError("logprobs cannot be combined with tools (the answer may "
                                      "be a call, not text); send tool_choice 'none' or no "
                                      "logprobs", param="logprobs")
        fmt = req.response_format
        if plan.enforced and fmt is not None and fmt.type != "text":
            # (under "auto" the answer is a call or an answer in the format; a forced call
            # leaves the format nothing to hold)
            raise InvalidRequestError("response_format cannot be combined with a required "
                                      "tool call (the call is the whole answer); send "
                                      "tool_choice 'auto' or no response_format",
                                      param="response_format")
    return plan


def _allowed(tools: list[AllowedTool], functions: tuple[Function, ...]) -> frozenset[str]:
    """The names ``allowed_tools`` lists, each one of the request's tools (the errors name
    ``tool_choice``: the Responses API spells the list in another place)."""
    if not tools:
        raise InvalidRequestError("tool_choice: allowed_tools allows no tool (allow at least "
                                  "one, or send tool_choice 'none')", param="tool_choice")
    known = {f.name for f in functions}
    for tool in tools:
        if tool.function.name not in known:
            raise InvalidRequestError(f"tool_choice: allowed_tools names the function "
                                      f"'{tool.function.name}', which is not in tools",
                                      param="tool_choice")
    return frozenset(t.function.name for t in tools)


MAX_TOOLS = 128  # OpenAI's limit; each is an alternative of the call grammar (engine thread)


def _functions(tools: list[Tool]) -> tuple[Function, ...]:
    if len(tools) > MAX_TOOLS:
        raise InvalidRequestError(f"tools: {len(tools)} tools; at most {MAX_TOOLS} (as OpenAI "
                                  "allows)", param="tools")
    out: list[Function] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if tool.type != "function":
            raise InvalidRequestError(f"{where}.type: only function tools are supported (got "
                                      f"'{tool.type}')", param=f"{where}.type")
        if tool.function is None or tool.custom is not None:
            raise InvalidRequestError(f"{where}: a function tool needs 'function' (and no "
                                      "'custom')", param=f"{where}.function")
        fn = tool.function
        if not FUNCTION_NAME.fullmatch(fn.name):
            raise InvalidRequestError(f"{where}.function.name: a function name is 1 to 64 "
                                      "letters, digits, '_' or '-'",
                                      param=f"{where}.function.name")
        if any(f.name == fn.name for f in out):
            raise InvalidRequestError(f"{where}.function.name: '{fn.name}' is given twice",
                                      param=f"{where}.function.name")
        params = fn.parameters
        if params is not None and params.get("type", "object") != "object":
            raise InvalidRequestError(f"{where}.function.parameters: the parameters schema "
                                      "must describe a JSON object",
                                      param=f"{where}.function.parameters")
        if params is not None:  # (its grammar's error named the server's own call schema)
            where_params = f"{where}.function.parameters"
            try:
                check_valid_schema(params, where_params)
            except InvalidRequestError as e:
                raise InvalidRequestError(f"{where_params}: {e}", param=where_params) from None
        if fn.strict:
            check_strict(params, f"{where}.function.parameters")
        out.append(Function(fn.name, fn.description, params, bool(fn.strict)))
    return tuple(out)


def message_dict(m: ChatMessage, i: int, content: str) -> dict[str, Any]:
    """One history message as chat templates get it: an assistant's calls with their
    arguments parsed (HF templates write them with ``tojson``), a tool result's call id."""
    role = "system" if m.role == "developer" else m.role
    message: dict[str, Any] = {"role": role, "content": content}
    if m.name is not None:
        message["name"] = m.name
    if m.tool_calls:
        if role != "assistant":
            raise InvalidRequestError(f"messages[{i}].tool_calls: only assistant messages carry "
                                      "tool calls", param=f"messages[{i}].tool_calls")
        message["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
            for c in m.tool_calls]
    for name in ("reasoning_content", "reasoning"):
        if getattr(m, name) is not None and role != "assistant":
            raise InvalidRequestError(f"messages[{i}].{name}: only assistant messages carry "
                                      "thinking", param=f"messages[{i}].{name}")
    if None not in (m.reasoning, m.reasoning_content) and m.reasoning != m.reasoning_content:
        raise InvalidRequestError(f"messages[{i}].reasoning: reasoning and reasoning_content "
                                  "are one thing, and these disagree",
                                  param=f"messages[{i}].reasoning")
    thought = m.reasoning_content if m.reasoning_content is not None else m.reasoning
    if thought is not None:
        message["reasoning_content"] = thought
    if m.tool_call_id is not None:
        if role != "tool":
            raise InvalidRequestError(f"messages[{i}].tool_call_id: only tool messages answer "
                                      "a tool call", param=f"messages[{i}].tool_call_id")
        message["tool_call_id"] = m.tool_call_id
    return message


def check_tool_messages(messages: list[ChatMessage]) -> None:
    """OpenAI's rule: a tool message says which call it answers."""
    for i, m in enumerate(messages):
        if m.role == "tool" and not m.tool_call_id:
            raise InvalidRequestError(f"messages[{i}].tool_call_id: a tool message needs the "
                                      "id of the call it answers",
                                      param=f"messages[{i}].tool_call_id")


def _arguments(text: str) -> Any:
    """Arguments JSON text -> the object (kept as text when it is not JSON)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # (a client's text nested by the thousand too)
        return text
