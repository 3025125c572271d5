"""Request and response bodies of Anthropic's Messages API, as msgspec structs.

As on the OpenAI side (``schemas.py``), every request field is acted on or refused: unknown
fields are a 400 naming them, and the Anthropic fields justllm does not implement are declared
only so that ``anthropic.py`` can refuse them with a message that says why. Content blocks are
one loose struct (``Block``) rather than a tagged union, so that an image or a thinking block
gets "this server cannot take images" instead of a bare "invalid tag"; ``anthropic_chat.py``
then refuses a field of another block type by name (``BLOCK_FIELDS``), as Anthropic's
per-type blocks do.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import msgspec
from msgspec import Meta


class _Body(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A request body part: unknown fields are refused, never silently ignored."""


class CacheControl(_Body, kw_only=True):
    """A prompt-caching breakpoint. Accepted: justllm caches every prompt's prefix on its own
    (the radix cache), so a breakpoint asks for nothing that is not done already."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


# Anthropic's pattern for a tool_use block's id (and a tool_result's tool_use_id): a 400
# for anything else, as Anthropic answers it.
ToolUseId = Annotated[str, Meta(pattern="^[a-zA-Z0-9_-]+$")]


class Block(_Body, kw_only=True):
    """One content block of a message or of the system prompt. ``anthropic.py`` reads
    ``text``, ``tool_use`` and ``tool_result`` blocks and refuses the others by name."""

    type: str
    cache_control: CacheControl | None = None
    # text
    text: str | None = None
    citations: list[Any] | None = None
    # tool_use
    id: ToolUseId | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    # tool_result
    tool_use_id: ToolUseId | None = None
    content: Union[str, list[Block], None] = None
    is_error: bool | None = None
    # declared to be refused by name: images, documents, thinking
    source: Any = None
    title: Any = None
    context: Any = None
    thinking: Any = None
    signature: Any = None
    data: Any = None


# The fields each block type this server reads may carry besides ``type`` (Anthropic's block
# params); any other field set on such a block is refused by name.
BLOCK_FIELDS = {"text": frozenset({"text", "citations", "cache_control"}),
                "tool_use": frozenset({"id", "name", "input", "cache_control"}),
                "tool_result": frozenset({"tool_use_id", "content", "is_error", "cache_control"}),
                "thinking": frozenset({"thinking", "signature"})}


class Message(_Body, kw_only=True):
    role: Literal["user", "assistant"]
    content: Union[str, list[Block]]


class Tool(_Body, kw_only=True):
    """A client tool. Server tools (``type`` such as ``web_search_20250305``) are refused."""

    name: str
    input_schema: dict[str, Any] | None = None
    description: str | None = None
    type: str | None = None  # "custom", or absent
    cache_control: CacheControl | None = None
    strict: bool | None = None
    # declared to be refused unless off
    # (a call a grammar holds streams its input as written: every family's but gpt-oss's,
    # whose calls come whole and where true is refused)
    eager_input_streaming: bool | None = None
    input_examples: list[Any] | None = None
    allowed_callers: list[str] | None = None
    defer_loading: bool | None = None


class ToolChoice(_Body, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Metadata(_Body, kw_only=True):
    # logged with the request; router mode keeps a user on one replica. Anthropic's limit.
    user_id: Annotated[str, Meta(max_length=256)] | None = None


class JsonOutputFormat(_Body, kw_only=True):
    type: Literal["json_schema"]
    schema: dict[str, Any]


# Anthropic's effort levels; any other is a 400 naming ``output_config.effort``.
Effort = Literal["low", "medium", "high", "xhigh", "max"]


class OutputConfig(_Body, kw_only=True):
    format: JsonOutputFormat | None = None
    effort: Effort | None = None  # a template's reasoning_effort (400 for one without)


class ThinkingConfig(_Body, kw_only=True):
    """Extended thinking: ``enabled`` with a budget, ``adaptive`` (the model decides) or
    ``disabled`` (the default)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class _Prompt(_Body, kw_only=True):
    """What ``/v1/messages`` and ``/v1/messages/count_tokens`` share: the rendered prompt."""

    model: str
    messages: list[Message]
    system: Union[str, list[Block], None] = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    cache_control: CacheControl | None = None
    output_config: OutputConfig | None = None
    thinking: ThinkingConfig | None = None
    # Anthropic fields justllm does not implement: refused unless absent.
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    mcp_servers: Any = None
    context_management: Any = None


class MessagesRequest(_Prompt, kw_only=True):
    max_tokens: Annotated[int, Meta(ge=1)]
    temperature: Annotated[float, Meta(ge=0, le=1)] | None = None  # Anthropic's range
    top_p: float | None = None
    top_k: Annotated[int, Meta(ge=0)] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # there is one tier
    # Anthropic fields justllm does not implement: refused unless absent.
    container: Any = None
    inference_geo: str | None = None
    diagnostics: Any = None


class CountTokensRequest(_Prompt, kw_only=True):
    pass


# ---- responses -------------------------------------------------------------------------------

class Usage(msgspec.Struct):
    input_tokens: int
    output_tokens: int


class AnthropicMessage(msgspec.Struct):
    """A whole answer; also, empty and with ``stop_reason`` null, ``message_start``'s."""

    id: str
    type: str
    role: str
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None
    stop_sequence: str | None
    usage: Usage


class TokenCount(msgspec.Struct):
    input_tokens: int
