"""Request and response bodies of the OpenAI API, as msgspec structs (Litestar documents them,
``decode_request`` validates them strictly; the SSE encoder writes them).

Every request field is either acted on or refused: an unknown field is a 400 naming it
(``forbid_unknown_fields``), and OpenAI fields justllm does not implement are declared only so
that a value other than their default gets a 400 that says why (``openai_serving`` checks
them). Responses are shaped as OpenAI documents them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal, Optional, Union

import msgspec
from msgspec import Meta

PositiveInt = Annotated[int, Meta(ge=1)]
NonNegativeInt = Annotated[int, Meta(ge=0)]
Seed = Annotated[int, Meta(ge=-2**63, le=2**63 - 1)]  # an int64, as vLLM takes it
def foreign_field(part: msgspec.Struct, own: frozenset[str]) -> str | None:
    """The first field set on ``part`` (a loose struct of several kinds, such as a content
    block) that is neither ``type`` nor one of ``own``, its kind's: a field of another kind,
    which the APIs' typed parts refuse (None: there is none)."""
    return next((name for name in part.__struct_fields__
                 if name != "type" and name not in own and getattr(part, name) is not None),
                None)


# OpenAI's levels of reasoning_effort (the Responses API's reasoning.effort too).
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


class _Request(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A request body part: unknown fields are refused, never silently ignored."""


# llama-server's bodies: a field typed with these takes a null and reads it as its default
# (as llama-server's json_value "falls back null to default value"), through NullAsDefault.
if TYPE_CHECKING:
    NullFloat = float
    NullInt = int
    NullBool = bool
else:
    NullFloat = Optional[float]
    NullInt = Optional[int]
    NullBool = Optional[bool]


class NullAsDefault(_Request, kw_only=True):
    """A body whose nulls read as the fields' defaults (a client that sends unset options as
    null, as llama-server takes them). Only fields whose default is a number or a bool are
    filled: a field whose default is None keeps its null."""

    def __post_init__(self) -> None:
        fields = self.__struct_fields__
        for name, default in zip(fields[len(fields) - len(self.__struct_defaults__):],
                                 self.__struct_defaults__):
            if getattr(self, name) is None and isinstance(default, (bool, int, float)):
                setattr(self, name, default)


class ContentPart(_Request, kw_only=True):
    """A part of a message's content. Only ``text`` parts are read; the others are declared so
    that an image or audio part gets a 400 saying the model cannot take it."""

    type: str
    text: str | None = None
    refusal: str | None = None  # a "refusal" part: an assistant's refusal, read as its text
    image_url: Any = None
    input_audio: Any = None
    file: Any = None


class FunctionCall(_Request, kw_only=True):
    """A call an assistant made earlier in the conversation, as OpenAI sends it back."""

    name: str
    arguments: str  # JSON text (the template gets it parsed, as HF templates expect)
    # The SDK's parse of ``arguments`` (``.parse()`` with pydantic tools): ``arguments`` is read.
    parsed_arguments: Any = None


class MessageToolCall(_Request, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall
    index: NonNegativeInt | None = None  # kept by clients that gather a stream's call deltas


class ChatMessage(_Request, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant messages only
    tool_call_id: str | None = None  # tool messages: the call this is the result of
    # What the OpenAI SDK sends back with an assistant message (``message.model_dump()``):
    # ``refusal`` is read as the assistant's text; the others must be null/empty (checked by
    # ``openai_serving.check_messages``: this server makes no audio, deprecated function calls
    # or citations, so a history holding any came from elsewhere and cannot be honoured).
    refusal: str | None = None
    audio: Any = None
    function_call: Any = None
    annotations: list[Any] | None = None
    # The SDK's parse of an assistant's ``content`` (``.parse()``): ``content`` is read.
    parsed: Any = None
    # An assistant's thinking (llama-server's and DeepSeek's field), given to the chat template
    # as ``reasoning_content`` (Qwen3's writes it for the latest turn, drops it before).
    reasoning_content: str | None = None
    reasoning: str | None = None  # vLLM's newer name (and OpenRouter's) for the same


class FunctionDef(_Request, kw_only=True):
    """A function tool. ``parameters`` is a JSON schema (None: the function takes none);
    ``strict`` asks for arguments that follow it exactly (what a forced call always gets)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Request, kw_only=True):
    """A tool the model may call. Only ``function`` tools exist here; ``custom`` is declared
    so that OpenAI's custom (free-text) tools get a 400 saying so."""

    type: str
    function: FunctionDef | None = None
    custom: Any = None


class ToolChoiceFunction(_Request, kw_only=True):
    name: str


class ToolChoiceNamed(_Request, kw_only=True, tag_field="type", tag="function"):
    """``{"type": "function", "function": {"name": ..}}``: that function's call is forced."""

    function: ToolChoiceFunction


class AllowedTool(_Request, kw_only=True):
    type: Literal["function"]
    function: ToolChoiceFunction


class AllowedTools(_Request, kw_only=True):
    mode: Literal["auto", "required"]
    tools: list[AllowedTool]


class ToolChoiceAllowed(_Request, kw_only=True, tag_field="type", tag="allowed_tools"):
    """OpenAI's ``allowed_tools``: every tool stays in the prompt (its cache too), and only
    these may be called (``mode``: may, or must, call one)."""

    allowed_tools: AllowedTools


ToolChoice = Union[Literal["none", "auto", "required"], ToolChoiceNamed, ToolChoiceAllowed,
                   None]


class StreamOptions(_Request, kw_only=True):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # only off: there is nothing to pad here


class JsonSchemaFormat(_Request, kw_only=True):
    name: str | None = None  # required, as OpenAI and vLLM require it (checked with the type)
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(_Request, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Request, kw_only=True):
    """vLLM's ``structured_outputs`` (its older ``guided_*`` fields are the same): one of a
    JSON schema (an object, or its JSON text), any JSON object, a list of choices, a GBNF
    grammar. Regular expressions are declared to be refused with a reason."""

    json: Union[dict[str, Any], str, None] = None
    json_object: bool | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    regex: str | None = None


class LoraChoice(_Request, kw_only=True):
    """llama-server's per-request adapter: by ``id`` (as GET /v1/lora_adapters lists it) or
    by ``name``, at ``scale`` (default: the adapter's own)."""

    id: NonNegativeInt | None = None
    name: str | None = None
    scale: float | None = None


# vLLM's truncate_prompt_tokens: only the prompt's last k tokens are read (-1: as many as the
# model holds); checked by openai_serving.keep_last (0 is refused there).
TruncatePrompt = Annotated[int, Meta(ge=-1)]


class _Sampling(_Request, kw_only=True):
    """Fields common to chat and text completions."""

    model: str | None = None  # optional, as in vLLM: the served model when absent
    truncate_prompt_tokens: TruncatePrompt | None = None
    max_tokens: PositiveInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: NonNegativeInt | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repeat_penalty: float | None = None
    seed: Seed | None = None
    stop: Union[str, list[str], None] = None
    # OpenAI's nullable fields take null as absent (some clients send every field): ``n`` is
    # read through the property below, the booleans as truth values.
    n_choices: PositiveInt | None = msgspec.field(default=None, name="n")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    # token id (a decimal string, as JSON object keys are) -> bias in [-100, 100]
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # an end-user id: logged with the request (--verbose)
    safety_identifier: str | None = None  # OpenAI's newer name for ``user``: the same use
    # OpenAI's hint for its prompt cache: router mode keeps requests that share one on one
    # replica (gateway/policy.session_key); one server caches every prefix anyway.
    prompt_cache_key: str | None = None
    # How long OpenAI keeps its cache (the SDK's spelling and litellm's): a hint.
    prompt_cache_retention: Literal["in-memory", "in_memory", "24h"] | None = None
    # Speculative decoding per request, named as llama-server names them (0 turns it off).
    speculative_n_max: int | None = msgspec.field(default=None, name="speculative.n_max")
    speculative_p_min: float | None = msgspec.field(default=None, name="speculative.p_min")
    # vLLM's extension: lower runs first (needs --scheduling-policy priority).
    priority: int = 0
    # llama-server's: the LoRA adapters to run under (besides one named as ``model``).
    lora: list[LoraChoice] | None = None
    # Structured output as llama-server and vLLM take it, on both routes (at most one of these,
    # response_format and tools): llama-server's GBNF ``grammar`` and ``json_schema``,
    # vLLM's ``structured_outputs`` and its older ``guided_*`` names.
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: Union[dict[str, Any], str, None] = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_regex: str | None = None
    # vLLM's: token ids that end the answer (besides the model's end-of-generation tokens).
    stop_token_ids: list[int] | None = None
    # vLLM's: nothing ends the answer before this many tokens (end tokens masked, stop
    # strings not looked for).
    min_tokens: NonNegativeInt | None = None
    # vLLM's name for a repeat penalty over the whole prompt and answer (repeat_penalty is
    # llama.cpp's, over the last 64 tokens).
    repetition_penalty: float | None = None
    # vLLM's: the text ends with the request's stop string that ended it (a chat template's
    # own end-of-turn strings are still left out).
    include_stop_str_in_output: bool | None = None
    # Accepted at the value this server always has (openai_serving._UNSUPPORTED): vLLM's
    # skip_special_tokens (true).
    skip_special_tokens: bool | None = None
    # llama-server's: false computes the prompt whole, taking nothing from the prefix cache.
    cache_prompt: bool | None = None

    @property
    def n(self) -> int:
        """The choices asked for (``n``; 1 when absent or null)."""
        return 1 if self.n_choices is None else self.n_choices


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = False
    top_logprobs: NonNegativeInt | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice = None
    parallel_tool_calls: bool | None = None  # None: True, as OpenAI
    # vLLM's: the answer continues the last (assistant) message; add_generation_prompt then
    # false (vLLM refuses both true), else left out or true
    continue_final_message: bool = False
    add_generation_prompt: bool | None = None
    # vLLM's: each prompt token's logprob and this many alternatives, in the response's own
    # ``prompt_logprobs`` (the prompt the chat template rendered; not with stream)
    prompt_logprobs: NonNegativeInt | None = None
    # vLLM's and llama-server's: extra variables for the chat template ({"enable_thinking":
    # false} for Qwen3's), besides the ones the server sets.
    chat_template_kwargs: dict[str, Any] | None = None
    # llama-server's: how a reasoning model's thinking is returned ("auto" or "deepseek": in
    # reasoning_content; "none": in the content); default the server's --reasoning-format.
    reasoning_format: str | None = None
    # llama-server's (either name): past this many tokens of thinking the model's end tag is
    # forced; -1 none; default the server's --reasoning-budget.
    reasoning_budget_tokens: Annotated[int, Meta(ge=-1)] | None = None
    thinking_budget_tokens: Annotated[int, Meta(ge=-1)] | None = None
    # llama-server's: text forced before the end tag when the budget runs out; default the
    # server's --reasoning-budget-message. Only with a budget.
    reasoning_budget_message: str | None = None
    # OpenAI's: "none" switches a reasoning model's thinking off (its template's
    # enable_thinking); a level goes to a template that takes reasoning_effort (gpt-oss's).
    reasoning_effort: ReasoningEffort | None = None
    # OpenAI fields justllm does not implement: refused unless at their "off" value.
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    verbosity: str | None = None


class CompletionRequest(_Sampling, kw_only=True):
    # a string, a list of strings, a token array or a list of token arrays (checked by the
    # serving code: msgspec cannot tell apart unions of several list types)
    prompt: Union[str, list[Any]]
    echo: bool | None = False
    logprobs: NonNegativeInt | None = None
    # 0 only with the prompt's logprobs (OpenAI's echo idiom: the prompt scored, no answer)
    max_tokens: NonNegativeInt | None = None
    # vLLM's: each prompt token's logprob and this many alternatives, in the choice's own
    # ``prompt_logprobs`` (echo with logprobs puts them in ``logprobs``, as OpenAI did).
    prompt_logprobs: NonNegativeInt | None = None
    # OpenAI fields justllm does not implement: refused unless at their "off" value.
    suffix: str | None = None  # fill-in-the-middle
    best_of: int | None = None  # only 1 (or n): no server-side best-of ranking


class EmbeddingRequest(_Request, kw_only=True):
    model: str | None = None  # optional, as in vLLM: the served model when absent
    input: Union[str, list[Any]]  # as CompletionRequest.prompt
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: PositiveInt | None = None
    user: str | None = None  # logged with the request (--verbose)
    truncate_prompt_tokens: TruncatePrompt | None = None  # vLLM's: each input's last k tokens


class TokenizeRequest(NullAsDefault, kw_only=True):
    """``POST /tokenize``, in vLLM's two forms (``prompt``, or ``messages`` rendered as the chat
    routes render them) or llama-server's (``content``); exactly one of the three."""

    model: str | None = None
    prompt: str | None = None  # vLLM's completion form
    messages: list[ChatMessage] | None = None  # vLLM's chat form, with these fields
    tools: list[Tool] | None = None
    tool_choice: ToolChoice = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = None  # vLLM's name; default true for a prompt
    return_token_strs: bool | None = False
    content: str | None = None  # llama-server's form, with these fields
    add_special: bool | None = None  # default false, as llama-server
    parse_special: NullBool = True
    with_pieces: NullBool = False


class DetokenizeRequest(_Request, kw_only=True):
    """``POST /detokenize``: vLLM's and llama-server's (the same body)."""

    model: str | None = None
    tokens: list[int]


# ---- responses -------------------------------------------------------------------------------

class Usage(msgspec.Struct, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # OpenAI's: {"cached_tokens": the prompt tokens taken from the prefix cache}
    prompt_tokens_details: dict[str, int] | None = None
    # OpenAI's: {"reasoning_tokens": a reasoning model's thinking, in tokens}; only then
    completion_tokens_details: dict[str, int] | None = None


class FunctionCallOut(msgspec.Struct):
    name: str
    arguments: str  # JSON text


class ToolCallOut(msgspec.Struct):
    id: str
    type: str
    function: FunctionCallOut


class AssistantMessage(msgspec.Struct, omit_defaults=True):
    role: str
    content: str | None  # None (JSON null) when the answer is only tool calls
    tool_calls: list[ToolCallOut] | None = None
    # A reasoning model's thinking, apart from the content (llama-server's and DeepSeek's name)
    reasoning_content: str | None = None


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
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # vLLM's, when asked for


class FunctionCallDelta(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None  # "" in a call's first delta, then pieces of the JSON text


class ToolCallDelta(msgspec.Struct, omit_defaults=True):
    """A piece of a streamed tool call: ``id``, ``type`` and the name in its first delta, only
    ``index`` and an arguments piece in the following ones (OpenAI's chunk shape)."""

    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionCallDelta | None = None


class ChatDelta(msgspec.Struct, omit_defaults=True):
    """What a chunk adds: the role once, then content or tool-call pieces; ``{}`` for a chunk
    with only a reason."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    reasoning_content: str | None = None  # a piece of the thinking


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


class ChatCompletionChunkWithUsage(ChatCompletionChunk, omit_defaults=False):
    """A chunk of a stream with ``stream_options.include_usage``: OpenAI's "all other chunks
    will also include a usage field, but with a null value"."""


class CompletionChoice(msgspec.Struct, omit_defaults=True):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: str | None
    # vLLM's, with ``prompt_logprobs`` (on a stream, in each choice's first chunk)
    prompt_logprobs: list[dict[str, Any] | None] | None = None


class TextCompletion(msgspec.Struct, omit_defaults=True):
    """A full completion, or one streamed chunk of it (no usage but on the last)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TextCompletionWithUsage(TextCompletion, omit_defaults=False):
    """A streamed chunk with ``stream_options.include_usage``: ``usage`` null but on the
    last (as ``ChatCompletionChunkWithUsage``)."""


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
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field); None for a base
    max_model_len: int | None = None  # vLLM's: the tokens one request holds, prompt and answer


class ModelList(msgspec.Struct):
    object: str
    data: list[ModelCard]
