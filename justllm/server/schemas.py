"""Request and response bodies of the OpenAI API, as msgspec structs (Litestar validates and
documents them; the SSE encoder writes them).

Only the fields justllm acts on are declared on requests; other OpenAI fields are accepted and
ignored, so the official clients work unchanged. Responses are shaped as OpenAI documents them.
"""

from __future__ import annotations

from typing import Any, Literal, Union

import msgspec


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: str = "response"
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Sampling(msgspec.Struct, kw_only=True):
    """Fields common to chat and text completions."""

    model: str | None = None  # optional, as in vLLM: the served model when absent
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repeat_penalty: float | None = None
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None
    # Speculative decoding per request, named as llama-server names them (0 turns it off).
    speculative_n_max: int | None = msgspec.field(default=None, name="speculative.n_max")
    speculative_p_min: float | None = msgspec.field(default=None, name="speculative.p_min")
    # vLLM's extension: lower runs first (needs --scheduling-policy priority).
    priority: int = 0


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None


class CompletionRequest(_Sampling, kw_only=True):
    # a string, a list of strings, a token array or a list of token arrays (checked by the
    # serving code: msgspec cannot tell apart unions of several list types)
    prompt: Union[str, list[Any]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    model: str | None = None  # optional, as in vLLM: the served model when absent
    input: Union[str, list[Any]]  # as CompletionRequest.prompt
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


# ---- responses -------------------------------------------------------------------------------

class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(msgspec.Struct):
    role: str
    content: str


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class ChatCompletion(msgspec.Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ChatDelta(msgspec.Struct, omit_defaults=True):
    """What a chunk adds: the role once, then content; ``{}`` for a chunk with only a reason."""

    role: str | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class ChatCompletionChunk(msgspec.Struct, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None  # only on the last chunk, with stream_options.include_usage


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class TextCompletion(msgspec.Struct, omit_defaults=True):
    """A full completion, or one streamed chunk of it (no usage but on the last)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class EmbeddingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class Embedding(msgspec.Struct):
    object: str
    index: int
    embedding: list[float] | str  # floats, or base64 of float32 with encoding_format base64


class EmbeddingList(msgspec.Struct):
    object: str
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class ModelCard(msgspec.Struct):
    id: str
    object: str
    created: int
    owned_by: str


class ModelList(msgspec.Struct):
    object: str
    data: list[ModelCard]
