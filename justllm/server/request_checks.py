"""The checks of a request body that need no model, by route.

Router mode runs these before it loads a model for a request (``gateway/app.py``): a body no
model could serve is refused at once, in the route's own error shape, instead of starting a
runner -- and, under ``max-loaded``, evicting a model other clients are using -- only to be
refused by it. Ollama checks a body's JSON before it schedules a load in the same way.

These are the route's own first checks (the strict decoding, then the field rules that read
nothing but the request); the route runs them again where the model is, with the rest.
"""

from __future__ import annotations

import msgspec

from justllm.server import (
    anthropic_chat,
    infill,
    llama_completion,
    llama_embedding,
    llama_server,
    ollama,
    rerank,
    responses,
    responses_chat,
    tokenize,
)
from justllm.server.anthropic_schemas import CountTokensRequest, MessagesRequest
from justllm.server.ollama import (
    OllamaChatRequest,
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    OllamaShowRequest,
)
from justllm.server.openai_serving import (
    OpenAIServing,
    check_chat_request,
    check_stream_options,
    prompt_list,
)
from justllm.server.responses_schemas import InputTokensRequest, ResponseRequest
from justllm.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
)


def check_without_model(path: str, raw: bytes) -> None:
    """Raise what the route at ``path`` raises first for ``raw`` (msgspec's errors,
    ``InvalidRequestError``), without a model. A path not listed here is not checked."""
    match path:
        case "/v1/chat/completions":
            chat = msgspec.json.decode(raw, type=ChatCompletionRequest)
            check_chat_request(chat)
            OpenAIServing.check_supported(chat)
            OpenAIServing.check_extras(chat)
        case "/v1/completions":
            completion = msgspec.json.decode(raw, type=CompletionRequest)
            prompt_list(completion.prompt, "prompt")
            check_stream_options(completion)
            OpenAIServing.check_supported(completion)
            OpenAIServing.check_extras(completion)
        case "/v1/embeddings":
            msgspec.json.decode(raw, type=EmbeddingRequest)
        case "/v1/messages":
            anthropic_chat.to_chat(msgspec.json.decode(raw, type=MessagesRequest))
        case "/v1/messages/count_tokens":
            anthropic_chat.to_chat(msgspec.json.decode(raw, type=CountTokensRequest))
        case "/tokenize":
            tokenize.check_tokenize(msgspec.json.decode(raw, type=TokenizeRequest))
        case "/apply-template":
            llama_server.check_apply_template(
                msgspec.json.decode(raw, type=ChatCompletionRequest))
        case "/completion" | "/completions":
            llama_completion.check_completion(
                msgspec.json.decode(raw, type=llama_completion.LlamaCompletionRequest))
        case "/embedding" | "/embeddings":
            llama_embedding.check_embedding(
                msgspec.json.decode(raw, type=llama_embedding.LlamaEmbeddingRequest))
        case "/infill":
            infill.check_infill(msgspec.json.decode(raw, type=infill.LlamaInfillRequest))
        case "/v1/rerank" | "/v1/reranking" | "/rerank" | "/reranking":
            # (the route's own check of the documents, texts and truncate)
            rerank.rerank_texts(msgspec.json.decode(raw, type=rerank.RerankRequest))
        case "/detokenize":
            tokenize.check_detokenize(msgspec.json.decode(raw, type=DetokenizeRequest))
        case "/v1/responses":
            responses.check_sampling(
                responses_chat.to_chat(msgspec.json.decode(raw, type=ResponseRequest)))
        case "/v1/responses/input_tokens":
            responses_chat.to_chat(msgspec.json.decode(
                raw, type=InputTokensRequest).as_response_request())
        case "/api/chat":
            ollama.check_options(msgspec.json.decode(raw, type=OllamaChatRequest).options)
        case "/api/generate":
            ollama.check_options(msgspec.json.decode(raw, type=OllamaGenerateRequest).options)
        case "/api/embed":
            msgspec.json.decode(raw, type=OllamaEmbedRequest)
        case "/api/embeddings":
            msgspec.json.decode(raw, type=OllamaEmbeddingsRequest)
        case "/api/show":
            msgspec.json.decode(raw, type=OllamaShowRequest)
