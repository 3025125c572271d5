"""``create_app(engine, config)``: the Litestar app. No module-level state: everything a
handler needs is in ``app.state`` (``serving``, ``config``, ``metrics``)."""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, cast

import msgspec
from litestar import Litestar, Request, Response, Router, get, head, post
from litestar.connection import ASGIConnection
from litestar.datastructures import State
from litestar.exceptions import NotAuthorizedException, ServiceUnavailableException
from litestar.handlers.base import BaseRouteHandler
from litestar.openapi import OpenAPIConfig
from litestar.params import FromPath, JSONBody
from litestar.response import Stream

from justllm.core.record import RequestOrigin, RequestRecord
from justllm.engine.async_engine import AsyncEngine
from justllm.errors import LoadCancelled
from justllm.server import model_cards
from justllm.server.config import ServerConfig, served_model_id
from justllm.server.embeddings import EmbeddingServing
from justllm.server.errors import APIError, handle_exception
from justllm.server.metrics import ServerMetrics
from justllm.server.openai_serving import OpenAIServing, ServingLimits
from justllm.server.request_id import add_request_id, request_id
from justllm.server.response_store import ResponseStore
from justllm.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingList,
    EmbeddingRequest,
    ModelCard,
    ModelList,
)
from justllm.server.web_origin import cors_config, refuse_other_sites

log = logging.getLogger(__name__)

T = TypeVar("T")
CLIENT_CLOSED = 499  # nginx's status for "the client closed the request" (never read by it)


class RequestEventSink(Protocol):
    """Where finished-request records go (``justllm.plugins.events.RequestEvents``): calling
    it never blocks; ``counts()`` per plugin (delivered, failed, dropped) for /metrics;
    ``close()`` delivers what is queued at shutdown."""

    def __call__(self, record: RequestRecord) -> None: ...

    def counts(self) -> Mapping[str, Any]: ...

    def close(self, timeout: float = 5.0) -> None: ...


@dataclass
class Served:
    """What the handlers use once the model is loaded."""

    aengine: AsyncEngine
    completions: OpenAIServing
    embeddings: EmbeddingServing | None
    metrics: ServerMetrics
    model_id: str
    created: int
    responses: ResponseStore = field(default_factory=ResponseStore)  # /v1/responses' store


def build_served(aengine: AsyncEngine, config: ServerConfig,
                 events: RequestEventSink | None = None) -> Served:
    model_path = aengine.model_path
    model_id = served_model_id(model_path, config.model_name)
    metrics = ServerMetrics(aengine.stats, model_id,
                            events.counts if events is not None else None)
    if events is not None:
        aengine.observe(events, model=model_id, text=config.record_text)
    template = aengine.chat_template()
    if template.notice and aengine.generates:  # (an encoder is not chatted with)
        log.warning("%s", template.notice)
    engine_config = aengine.engine.config
    if ((engine_config.reasoning_budget >= 0 or engine_config.reasoning_budget_message)
            and aengine.generates and not template.thinks):
        log.warning("--reasoning-budget and --reasoning-budget-message have no effect here: "
                    "this model does not think (its chat template writes no thinking tags)")
    completions = OpenAIServing(aengine, model_id, template, metrics,
                                ServingLimits(max_n=config.max_n))
    embeddings = EmbeddingServing(aengine, model_id, metrics) if config.embeddings else None
    return Served(aengine, completions, embeddings, metrics, model_id,
                  int(os.path.getmtime(model_path)))


def served(request: Request) -> Served:
    """The loaded model for a route handler (a plugin's too: ``justllm.plugins.served``):
    its ``aengine`` (submit, tokenize, ...) and ``model_id``; 503 while it is loading."""
    return _served(request.app.state)


def _served(state: State) -> Served:
    served = state.get("served")
    if served is None:
        raise APIError(503, "the model is still loading", type="server_error",
                       code="model_loading", headers={"Retry-After": "1"})
    return served


def require_api_key(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """``--api-key``: ``Authorization: Bearer KEY`` (OpenAI's clients, Ollama's) or
    ``x-api-key: KEY`` (Anthropic's); either one that matches lets the request in."""
    key = connection.app.state.config.api_key
    if key is None:
        return
    auth = connection.headers.get("authorization", "")
    scheme, _sep, token = auth.partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode()):
        return
    x_api_key = connection.headers.get("x-api-key")
    if x_api_key is not None and hmac.compare_digest(x_api_key.strip().encode(), key.encode()):
        return
    raise NotAuthorizedException("invalid or missing API key (Authorization: Bearer KEY, or "
                                 "x-api-key: KEY)")


SSE_HEADERS = {
    # Explicit: Litestar lets a handler's default media type (JSON) override a Stream's own.
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_response(body: AsyncIterator[bytes], headers: dict[str, str] | None = None) -> Stream:
    return Stream(body, media_type="text/event-stream", headers={**SSE_HEADERS, **(headers or {})})


def origin(request: Request, api: str, stream: bool) -> RequestOrigin:
    """What a route knows of a request, for its record (``RequestOrigin``): its API, whether
    it streams, the client's ``traceparent`` header, the X-Request-Id and ``tracestate``."""
    return RequestOrigin(api, stream, request.headers.get("traceparent"),
                         request_id(request.scope), request.headers.get("tracestate"))


async def decode_request(request: Request, cls: type[T]) -> T:
    """The body as ``cls``, decoded strictly. Litestar converts bodies in msgspec's lax mode,
    where ``"5"`` and ``1e10`` pass for integers; a request field must have its own type."""
    return msgspec.json.decode(await request.body(), type=cls)


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away. Called once the body is read, so the only message
    left for this request is ``http.disconnect``."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | Response:
    """``work``'s result, or, if the client disconnects first, ``work`` cancelled (which aborts
    its requests and frees their KV at the next step) and a 499 nobody reads. Streaming
    responses need no watch: the stream ends when its client goes."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    return Response(b"", status_code=CLIENT_CLOSED)


@post("/chat/completions", status_code=200, summary="Create a chat completion")
async def chat_completions(data: JSONBody[ChatCompletionRequest], request: Request,
                           state: State) -> Any:
    serving = _served(state).completions
    body = await decode_request(request, ChatCompletionRequest)
    result = await unless_disconnected(request, serving.chat(
        body, origin=origin(request, "openai.chat", bool(body.stream))))
    return sse_response(result) if isinstance(result, AsyncIterator) else result


@post("/completions", status_code=200, summary="Create a text completion")
async def completions(data: JSONBody[CompletionRequest], request: Request, state: State) -> Any:
    serving = _served(state).completions
    body = await decode_request(request, CompletionRequest)
    result = await unless_disconnected(request, serving.completions(
        body, origin=origin(request, "openai.completions", bool(body.stream))))
    return sse_response(result) if isinstance(result, AsyncIterator) else result


def embedding_serving(state: State) -> tuple[Served, EmbeddingServing]:
    """The loaded model and its embeddings (rerank scores too); 404 when they are off."""
    served = _served(state)
    if served.embeddings is None:
        raise APIError(404, "embeddings are disabled on this server", type="not_found_error")
    return served, served.embeddings


@post("/embeddings", status_code=200, summary="Create embeddings")
async def embeddings(data: JSONBody[EmbeddingRequest], request: Request,
                     state: State) -> EmbeddingList:
    _, serving = embedding_serving(state)
    req = await decode_request(request, EmbeddingRequest)  # (the body read before the watch)
    # (or the 499 Response of a client that left: Litestar sends a Response as it is)
    return cast(EmbeddingList, await unless_disconnected(request, serving.create(req)))


def _model_cards(state: State) -> dict[str, Any]:
    from justllm.server.lora import adapter_cards

    served = _served(state)
    return msgspec.to_builtins(ModelList(
        "list", [ModelCard(served.model_id, "model", served.created, "justllm",
                           max_model_len=served.aengine.max_request_tokens)]
        + adapter_cards(served.aengine, served.model_id, served.created)))


@get("/models", summary="List the served models (in Anthropic's shape with anthropic-version)")
async def list_models(request: Request, state: State) -> dict:
    return model_cards.listing(request, _model_cards(state))


@get("/models/{model_id:path}", summary="One served model (or LoRA adapter)")
async def retrieve_model(model_id: FromPath[str], request: Request, state: State) -> dict:
    return model_cards.card(request, model_cards.one_model(_model_cards(state)["data"],
                                                           model_id))


@get(["/health", "/v1/health"],
     summary="200 when the model is loaded, 503 while loading (or if it failed)",
     include_in_schema=True)
async def health(state: State) -> Response:
    if state.get("served") is None:
        error = state.get("load_error")
        return Response({"status": "failed", "error": error} if error else {"status": "loading"},
                        status_code=503)
    return Response({"status": "ok", "role": state["config"].role}, status_code=200)


@head(["/health", "/v1/health"],
      summary="/health's status without its body (uptime monitors send HEAD)",
      include_in_schema=False)
async def health_head(state: State) -> None:
    if state.get("served") is None:  # Litestar's HEAD handlers return nothing: a 503 is raised
        raise ServiceUnavailableException()


@get("/metrics", summary="Prometheus metrics", media_type="text/plain; version=0.0.4")
async def metrics(state: State) -> Response:
    served = state.get("served")
    body = served.metrics.render() if served is not None else b""
    return Response(body, media_type="text/plain; version=0.0.4")


def begin_shutdown(app: Litestar, grace: float) -> threading.Timer | None:
    """The first half of a graceful shutdown (SIGTERM): new requests get 503 at once, the ones
    in flight may finish for ``grace`` seconds, then every one still running is aborted
    (a stream gets a final error event, a waiting client a 503). Returns the timer, if any."""
    served = app.state.get("served")
    if served is None:
        return None
    aengine = served.aengine
    aengine.stop_accepting()
    timer = threading.Timer(max(0.0, grace), aengine.abort_all)
    timer.daemon = True
    timer.start()
    return timer


def create_app(aengine: AsyncEngine | None, config: ServerConfig, *,
               loader: Callable[[Callable[[], bool]], AsyncEngine] | None = None,
               routes: Sequence[BaseRouteHandler] = (),
               events: RequestEventSink | None = None,
               route_owners: Mapping[int, str] | None = None) -> Litestar:
    """The app for an engine that is ready (``aengine``), or one that ``loader`` builds on a
    background thread at start-up (``/health`` answers 503 until it is ready); ``loader`` is
    given ``cancelled``, which answers True once the server stops, and may then stop early
    (raising LoadCancelled: ``Engine(cancel=)``). ``routes``:
    plugins' extra route handlers (behind ``--api-key`` like /v1; one that cannot be added,
    such as a path justllm serves, is left out with a warning naming its plugin, from
    ``route_owners``: handler id -> plugin); ``events``: where a record of each finished
    request goes (plugins' ``on_request_finished``).

    On shutdown the engine is closed: in-flight requests are aborted and the model freed.
    """
    state = State({"config": config, "served": None})
    if aengine is not None:
        state["served"] = build_served(aengine, config, events)

    def load_in_background(app: Litestar) -> None:
        if loader is None or app.state.get("served") is not None:
            return
        cancelled = threading.Event()

        def work() -> None:
            try:
                aengine = loader(cancelled.is_set)
                if cancelled.is_set():  # the server stopped as the load ended: never served
                    aengine.close()
                    return
                app.state["served"] = build_served(aengine, config, events)
            except LoadCancelled:
                pass
            except Exception as e:  # the server stops; `justllm serve` exits 1 saying why
                log.error("model loading failed: %s", e)
                app.state["load_error"] = str(e)
                stop = app.state.get("stop_server")
                if stop is not None:
                    stop()

        thread = threading.Thread(target=work, name="justllm-loader", daemon=True)
        app.state["loading"] = (thread, cancelled)
        thread.start()

    def close_engine(app: Litestar) -> None:
        # A server stopped while its model loads (Ctrl-C as it starts) waits for the load to
        # stop: the process must not exit while that thread is inside llama.cpp (a crash).
        loading = app.state.get("loading")
        if loading is not None:
            thread, cancelled = loading
            cancelled.set()
            thread.join()
        served = app.state.get("served")
        if served is not None:
            served.aengine.close()
            app.state["served"] = None
        if events is not None:
            events.close()

    # they import this module's helpers: imported late
    from justllm.server import (
        anthropic,
        llama_server,
        lora,
        ollama,
        pd,
        rerank,
        responses,
        tokenize,
    )

    v1 = Router(path="/v1", route_handlers=[chat_completions, completions, embeddings,
                                            list_models, retrieve_model, anthropic.messages,
                                            anthropic.count_tokens, responses.create_response,
                                            responses.input_tokens,
                                            responses.retrieve_response,
                                            responses.delete_response,
                                            responses.cancel_response,
                                            responses.input_items, *lora.ROUTES],
                guards=[require_api_key])
    handlers: list[Any] = [v1, ollama.ollama_router(), ollama.root, ollama.root_head, health,
                           health_head,
                           metrics, pd.pd_router(), tokenize.tokenize_router(),
                           llama_server.llama_server_router(),
                           Router(path="/", route_handlers=[rerank.rerank],
                                  guards=[require_api_key])]

    def build(extra: Sequence[BaseRouteHandler]) -> Litestar:
        return Litestar(
            route_handlers=[*handlers, *([Router(path="/", route_handlers=list(extra),
                                                 guards=[require_api_key])] if extra else [])],
            state=state,
            guards=[refuse_other_sites], cors_config=cors_config(),
            on_startup=[load_in_background],
            on_shutdown=[close_engine],
            exception_handlers={Exception: handle_exception},
            before_send=[add_request_id],
            request_max_body_size=config.max_body_bytes,
            openapi_config=OpenAPIConfig(title="justllm", version="0.1.0", path="/docs"),
            debug=False,
        )

    try:
        return build(routes)
    except Exception:  # e.g. a plugin's route on a path justllm serves: serve without it
        if not routes:
            raise
    kept: list[BaseRouteHandler] = []
    for handler in routes:  # one at a time: only the routes that cannot be added are left out
        try:
            build([*kept, handler])
        except Exception as e:
            owner = (route_owners or {}).get(id(handler))
            log.warning("%sthe route %s is left out: %s", f"plugin {owner}: " if owner else "",
                        ", ".join(sorted(getattr(handler, "paths", ()))) or handler,
                        _cause(e))
        else:
            kept.append(handler)
    return build(kept)


def _cause(e: Exception) -> str:
    """Litestar's message for a route it cannot add, without the status it prefixes."""
    text = str(e)
    return text.split(": ", 1)[1] if text[:4].rstrip(":").isdigit() else text
