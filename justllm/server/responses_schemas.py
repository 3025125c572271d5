"""Request and response bodies of OpenAI's Responses API, as msgspec structs.

The request's ``input`` items and ``tools`` are typed per kind (``Message``, ``FunctionCall``,
``FunctionCallOutput``, ``FunctionTool``) but decoded from plain objects by ``responses.py``,
after it has read their ``type``: Responses defines some twenty item and tool kinds, and one
this server does not implement (a web search, an image) should get a 400 that says so, not a
union-decoding error. As everywhere in the server, unknown fields are refused.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import msgspec
from msgspec import Meta

from justllm.server.schemas import ReasoningEffort


class _Body(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A request body part: unknown fields are refused, never silently ignored."""


class ContentPart(_Body, kw_only=True):
    """A part of a message item's content: ``input_text`` (and, in an assistant's turn sent
    back, ``output_text`` or ``refusal``). Images, files and audio are refused by name, as is
    a field of another part type on a text part (``PART_FIELDS``)."""

    type: str
    text: str | None = None
    annotations: list[Any] | None = None  # an output_text sent back: dropped with the turn
    logprobs: list[Any] | None = None  # likewise
    refusal: str | None = None
    # declared to be refused by name
    image_url: Any = None
    file_id: Any = None
    file_data: Any = None
    file_url: Any = None
    filename: Any = None
    detail: Any = None
    input_audio: Any = None
    prompt_cache_breakpoint: Any = None


# The fields each part type this server reads may carry besides ``type``; any other field set
# on such a part is refused by name.
PART_FIELDS = {"input_text": frozenset({"text"}),
               "output_text": frozenset({"text", "annotations", "logprobs"}),
               "refusal": frozenset({"refusal"})}


class Message(_Body, kw_only=True):
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, list[ContentPart]]
    type: Literal["message"] = "message"
    id: str | None = None
    status: str | None = None
    # gpt-5's label of an assistant message: "final_answer" is every assistant message here;
    # "commentary" (a preamble before tool calls) has no place in these chat templates
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCall(_Body, kw_only=True):
    """A call the model made, sent back with its output in the next request."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutput(_Body, kw_only=True):
    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, list[ContentPart]]
    id: str | None = None
    status: str | None = None


class ReasoningText(_Body, kw_only=True):
    type: Literal["reasoning_text"]
    text: str


class Reasoning(_Body, kw_only=True):
    """A reasoning model's thinking, as a response gave it (a ``reasoning`` output item) and
    a client sends it back: read as the next assistant turn's thinking."""

    type: Literal["reasoning"]
    content: list[ReasoningText] | None = None
    summary: list[Any] = []  # (this server writes none; read when there is no content)
    # What this server wrote there (``responses.opaque_reasoning``): the thinking, read back
    encrypted_content: str | None = None
    id: str | None = None
    status: str | None = None


class ReasoningConfig(_Body, kw_only=True):
    """``reasoning``: ``effort`` as chat completions' ``reasoning_effort`` ("none" switches
    thinking off); ``summary`` only "auto" (no summary is written: the thinking is given
    whole)."""

    effort: ReasoningEffort | None = None  # (any other level is a 400)
    summary: Literal["auto"] | None = None
    generate_summary: Literal["auto"] | None = None  # (its older name)


class FunctionTool(_Body, kw_only=True):
    type: Literal["function"]
    name: str
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class TextFormat(_Body, kw_only=True):
    """``text.format``: ``name``, ``schema`` and ``strict`` only with ``json_schema``;
    ``description`` is declared to be refused by name (nothing would read it)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class TextConfig(_Body, kw_only=True):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class StreamOptions(_Body, kw_only=True):
    include_obfuscation: bool | None = None


class ResponseRequest(_Body, kw_only=True):
    model: str | None = None  # optional, as in vLLM: the served model when absent
    # a string, or a list of items (objects with a ``type``; a message's may be left out)
    input: Union[str, list[dict[str, Any]]]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    stream: bool | None = False  # null: absent, as OpenAI takes it
    stream_options: StreamOptions | None = None
    # Absent is OpenAI's default, true: the response is kept (server/response_store.py);
    # router mode and the cluster send it as false.
    store: bool | None = None
    metadata: dict[str, str] | None = None  # echoed back on the response
    user: str | None = None  # logged; router mode keeps a user on one replica
    safety_identifier: str | None = None  # logged, as ``user``
    text: TextConfig | None = None
    service_tier: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # A hint for OpenAI's prompt cache; justllm caches every prompt's prefix on its own.
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    # OpenAI fields justllm does not implement: refused unless absent (or off).
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    include: list[str] | None = None
    reasoning: ReasoningConfig | None = None
    prompt: Any = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    context_management: Any = None


class InputTokensRequest(_Body, kw_only=True):
    """``POST /v1/responses/input_tokens``: the fields of a request that shape its prompt,
    OpenAI's list (sampling and output fields are not among them: an unknown field there)."""

    model: str | None = None
    input: Union[str, list[dict[str, Any]]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    truncation: Literal["auto", "disabled"] | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    reasoning: ReasoningConfig | None = None

    def as_response_request(self) -> ResponseRequest:
        """The request whose prompt this counts (the same checks then hold: what
        ``/v1/responses`` refuses is refused here). Converted, not constructed: a struct's
        constructor checks no types, and each field must have the type the request's has."""
        return msgspec.convert(msgspec.to_builtins(self), ResponseRequest)


class InputTokens(msgspec.Struct, kw_only=True):
    object: str = "response.input_tokens"
    input_tokens: int


# ---- responses -------------------------------------------------------------------------------

class OutputText(msgspec.Struct, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class OutputMessage(msgspec.Struct, tag_field="type", tag="message"):
    id: str
    status: str
    role: str
    content: list[OutputText]


class OutputReasoningText(msgspec.Struct, tag_field="type", tag="reasoning_text"):
    text: str


class OutputReasoning(msgspec.Struct, tag_field="type", tag="reasoning", omit_defaults=True):
    """A reasoning model's thinking, whole (as vLLM gives gpt-oss's): no summary; with
    ``include: ["reasoning.encrypted_content"]`` the same thinking as ``encrypted_content``."""

    id: str
    summary: list[Any]
    content: list[OutputReasoningText]
    status: str
    encrypted_content: str | None = None


class OutputFunctionCall(msgspec.Struct, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(msgspec.Struct):
    """The response, whole (``status`` completed or incomplete) or, in a stream's first events,
    as it starts (in_progress, no output yet)."""

    id: str
    object: str
    created_at: int
    status: str
    model: str
    output: list[Union[OutputReasoning, OutputMessage, OutputFunctionCall]]
    usage: ResponseUsage | None
    incomplete_details: dict[str, str] | None
    error: dict[str, str] | None
    instructions: str | None
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    tools: list[dict[str, Any]]
    tool_choice: Union[str, dict[str, Any]]
    parallel_tool_calls: bool
    metadata: dict[str, str]
    user: str | None
    text: dict[str, Any]
    truncation: str
    store: bool = False
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    background: bool = False
    service_tier: str = "default"
    # (the request's, echoed as OpenAI's Response states them)
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
