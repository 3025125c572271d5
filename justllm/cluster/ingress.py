"""The cluster's HTTP face, run by the ingress deployment behind Ray Serve's HTTP proxies: the
OpenAI routes (Responses too), Anthropic's Messages and Ollama's, forwarded by the body's
``model`` to that model's deployment, the model list, health, and one ``/metrics`` page for
every replica.

A thin Litestar app rather than the server's own behind ``serve.ingress``: the server's app
holds an engine, and here there is none, only a handle per model. Each request becomes one
streaming call of the model replica's ``http`` method (the whole request, bytes and headers),
whose first item is the answer's status and headers and the rest its body chunks as the
replica's app sends them; so an SSE stream is relayed event by event through Ray's object
streaming (no buffering in the handle), and a client that leaves cancels the call, which
aborts the request on the replica. The routing text is computed here once and passed beside
the request for the RequestRouter (``route=``).

A replica that dies before its answer began (or, for an answer that is not a stream, before
it ended) costs the request nothing: it is sent once more, and Ray routes it to a live
replica. A stream cut mid-way ends with an error event, as in router mode.

A PD model (prefill-replicas / decode-replicas) has two deployments. A completion or chat
request whose prompt reaches prefill-min-tokens goes first to the prefill deployment's
``prefill`` (cache-aware), whose result -- the hand-over: the first token and the prompt's
KV -- stays in Ray's object store; the decode deployment's ``pd_decode`` is called with that
reference, so Ray hands the bytes to the decode replica without the ingress ever holding
them. Any failure of the first half (no KV, the prefill replica died) and the request is
sent again to the decode deployment, whole. LoRA requests are served whole.

LoRA adapters loaded at run time (justllm/cluster/lora.py) are model names here too: a request
naming one goes to its base model's deployment with the adapter's key as Ray's multiplexed
model id, and the replica loads the adapter first if it does not hold it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import urlencode

import msgspec
from litestar import Litestar, Request, Response, Router, get, post
from litestar.datastructures import State
from litestar.params import FromPath, FromQuery
from litestar.response import Stream
from ray.exceptions import ActorUnavailableError, RayActorError, TaskCancelledError
from ray.serve.exceptions import DeploymentUnavailableError

from justllm import __version__
from justllm.cluster import lora as runtime_lora
from justllm.cluster.asgi import Head, forwardable
from justllm.cluster.lora import RuntimeAdapters
from justllm.cluster.metrics import render
from justllm.gateway.app import NEVER, iso_time, ollama_root, ollama_root_head
from justllm.gateway.policy import (
    PD_PATHS,
    lora_request,
    prompt_tokens_estimate,
    session_key,
    unstable_lora_id,
    unstable_lora_id_message,
)
from justllm.gateway.routing import route_text
from justllm.gateway.streams import relayed
from justllm.server import model_cards
from justllm.server.app import require_api_key, unless_disconnected
from justllm.server.errors import APIError, handle_exception, json_object
from justllm.server.llama_server import router_props, slot_action, slots_body
from justllm.server.ollama import ollama_error
from justllm.server.request_id import HEADER as REQUEST_ID
from justllm.server.request_id import request_id
from justllm.server.response_store import unstored
from justllm.server.web_origin import cors_config, refuse_other_sites

# The replica's process is gone or cannot be reached: nothing of the answer came from it.
REPLICA_GONE = (RayActorError, ActorUnavailableError)
NDJSON = "application/x-ndjson"
STREAMS = ("text/event-stream", NDJSON)
TRIES = 2  # a request whose replica died goes once more (a request that kills replicas: two)
# Seconds between looks at a model's deployment while a request waits for its answer: one
# that failed to deploy has no replica to come, and Ray's handle waits for it for ever.
STATUS_POLL = 5.0
# Seconds /v1/models waits for the stats board's max_model_len before listing without it.
BOARD_WAIT = 5.0


def deployment_failed(handle: Any) -> bool:
    """Whether ``handle``'s deployment failed to deploy, as Ray Serve's status says (blocking:
    it asks the controller). ``cluster status`` reads the same status."""
    from ray.serve import status

    app = status().applications.get(handle.app_name)
    deployment = None if app is None else app.deployments.get(handle.deployment_name)
    return deployment is not None and str(deployment.status.value) == "DEPLOY_FAILED"


@dataclass
class Ingress:
    """What the handlers use: a deployment handle per model, names and aliases, the board."""

    handles: dict[str, Any]  # model -> DeploymentHandle of its deployment
    names: dict[str, str]  # model name or alias -> model
    board: Any  # DeploymentHandle of the stats board
    api_key: str | None = None
    # PD models: the prefill deployment's handle and prefill-min-tokens; the hand-overs'
    # outcomes by (model, outcome): handed_over, short_prompt, prefill_refused, prefill_failed.
    prefill: dict[str, tuple[Any, int]] = field(default_factory=dict)
    pd: Counter[tuple[str, str]] = field(default_factory=Counter)
    created: int = field(default_factory=lambda: int(time.time()))
    # LoRA adapter names (models.yaml's lora): a request names one as its model, and it goes
    # to its base model's deployment under that name (the replica applies the adapter).
    adapters: frozenset[str] = frozenset()
    runtime: RuntimeAdapters = field(default_factory=RuntimeAdapters)
    # Run-time loads and unloads take turns (as router mode's do): two loads of one name
    # both said "added", and an unload beside a load was a 404 with the name loaded after
    lora_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Per model, how many adapters models.yaml gives it: ids below that are the same on every
    # replica (gateway/policy.unstable_lora_id).
    fixed_lora: dict[str, int] = field(default_factory=dict)
    # Whether a handle's deployment failed to deploy (a stand-in in the tests).
    failed: Callable[[Any], bool] = deployment_failed

    def is_adapter(self, name: str) -> bool:
        """``name`` is a LoRA adapter (models.yaml's or one loaded at run time)."""
        return name in self.adapters or name in self.runtime.loaded

    def model(self, name: Any, ollama: bool) -> str:
        """The model ``name`` means, or the error the gateway gives for it."""
        if name is not None and not isinstance(name, str):
            raise APIError(400, "model must be a string", param="model")
        found = self.names.get(name) if name else (
            next(iter(self.handles)) if len(self.handles) == 1 else None)
        if found is None and name in self.runtime.loaded:
            found = self.runtime.loaded[name].model
        if found is None and name and name.endswith(":latest"):  # Ollama clients add it
            bare = name.removesuffix(":latest")
            if ollama or not self.is_adapter(bare):
                # (off Ollama's API an adapter's NAME:latest is no model name: a single
                # server's 404; it used to run on the base model, without the adapter)
                found = self.names.get(bare) or (
                    self.runtime.loaded[bare].model if bare in self.runtime.loaded else None)
        if found is not None:
            return found
        known = ", ".join([*self.names, *self.runtime.loaded])  # (as router mode's 404)
        if ollama:
            raise APIError(404 if name else 400, f'model "{name}" not found' if name
                           else "model is required", param="model")
        raise APIError(404 if name else 400,
                       f"the model '{name}' does not exist; this cluster has: {known}"
                       if name else f"model is required (one of: {known})",
                       type="not_found_error" if name else "invalid_request_error",
                       param="model", code="model_not_found" if name else None)


@dataclass(frozen=True)
class IngressConfig:
    """What the server's API-key guard reads (``state.config.api_key``)."""

    api_key: str | None = None


def _ingress(state: State) -> Ingress:
    return state["ingress"]


async def forward(request: Request, path: str, *, method: str = "POST",
                  body: dict[str, Any] | None = None) -> Any:
    """The request to a replica of its model: ``body``'s ``model`` (the request's JSON body
    when not given) picks it; ``method`` GET sends no body (``/props?model=``)."""
    ing = _ingress(request.app.state)
    if body is None:
        body = json_object(await request.body())
    body = unstored(path, body, "the cluster")
    ollama = path.startswith("/api/")
    key = "model" if "model" in body or not ollama else "name"
    model = ing.model(body.get(key), ollama)
    route = (route_text(body), session_key(request.headers.get("x-session-id"), body))
    named = body.get(key)
    if ollama and isinstance(named, str) and named.endswith(":latest"):
        bare = named.removesuffix(":latest")  # the tag Ollama clients add, to an adapter too
        if ing.is_adapter(bare):
            named = body[key] = bare
    fixed = ing.fixed_lora.get(model, 0)
    unstable = unstable_lora_id(body, fixed)
    if unstable is not None:
        raise APIError(400, unstable_lora_id_message(unstable, model, fixed), param="lora")
    runtime = ing.runtime.requested(named, body.get("lora"))
    # Served whole: its KV is the adapter's.
    lora = runtime is not None or lora_request(body, ing.adapters)
    if named not in ing.adapters and named not in ing.runtime.loaded:
        body[key] = model  # an alias becomes the model's name, which its replicas serve under
    content = msgspec.json.encode(body) if method == "POST" else b""
    query = request.url.query or ""
    if method == "GET" and "model" in request.query_params:  # /props?model=, /slots?model=:
        query = urlencode({**dict(request.query_params), "model": body[key]})  # (as above)
    headers = [*forwardable(list(request.headers.items()),
                            drop=frozenset({"authorization", "x-api-key", REQUEST_ID})),
               (REQUEST_ID, request_id(request.scope))]
    if runtime is None:
        handle, extra = ing.handles[model].options(stream=True), {}
    else:  # Ray prefers the replicas that hold it; the one chosen loads it if it does not
        handle = ing.handles[model].options(stream=True, multiplexed_model_id=runtime.key)
        extra = {"lora": (runtime.name, runtime.path)}
    kv = None if lora else _prefill(ing, model, path, body, content, route)
    attempt = 0
    while attempt < TRIES:
        if kv is not None:  # the decode replica takes the prefill's result from Ray
            answer = handle.pd_decode.remote("POST", path, query, headers,
                                             content, kv, route=route)
        else:
            attempt += 1
            answer = handle.http.remote(method, path, query, headers,
                                        content, route=route, **extra)
        try:
            # A client that leaves while its answer is computed cancels it (an answer that is
            # not a stream sends its head only when done): the replica aborts the request.
            head = await unless_disconnected(request, _head(ing, model, answer))
            if isinstance(head, Response):
                _cancel(answer, kv)
                return head
            if not isinstance(head, Head):
                raise RuntimeError(f"model '{model}' answered without a head")
            if kv is not None:
                # The KV went over unless the prefill replica gave none (what the decode
                # replica made of it is its own import-failure count, as in router mode).
                ing.pd[model, "prefill_refused" if head.header("x-pd") in ("", "prefill-refused")
                       else "handed_over"] += 1
            kind = head.header("content-type")
            out = [(k, v) for k, v in head.headers if k != "content-type"]
            if kind.startswith(STREAMS):
                # Its first chunk before the client gets anything: a replica that dies while
                # the request waits there for its turn has sent headers only, and the
                # request goes once more, as one that is not a stream does.
                first = await unless_disconnected(request, _first_chunk(answer))
                if isinstance(first, Response):
                    _cancel(answer, kv)
                    return first
                # Content-Type explicit: Litestar lets a handler's default (JSON) override a
                # Stream's own media type (as server/app.py's sse_response says).
                return Stream(_relay(answer, model, path, first),
                              status_code=head.status, media_type=kind,
                              headers={**dict(out), "Content-Type": kind})
            chunks = await unless_disconnected(request, _collect(answer))
            if isinstance(chunks, Response):
                _cancel(answer, kv)
                return chunks
        except Exception as e:
            _cancel(answer, kv)
            if kv is not None:  # the hand-over failed before anything was sent: served whole
                kv = None
                ing.pd[model, "prefill_failed"] += 1
                continue
            if isinstance(e, DeploymentUnavailableError):  # (it was a bare 500)
                raise _failed(model) from None
            if not isinstance(e, REPLICA_GONE):
                raise
            if attempt == TRIES:
                raise APIError(503, f"model '{model}' stopped answering: {type(e).__name__}",
                               type="server_error", code="replica_failed",
                               headers={"Retry-After": "2"}) from None
            continue
        except BaseException:
            _cancel(answer, kv)  # the client left (or the ingress stops): the replica aborts
            raise
        return Response(b"".join(chunks), status_code=head.status, headers=dict(out),
                        media_type=kind or None)
    raise AssertionError("unreachable")


async def _head(ing: Ingress, model: str, answer: Any) -> Any:
    """``answer``'s first item (its head), looking at the model's deployment every
    ``STATUS_POLL`` seconds while it waits: one that failed to deploy is a 503
    ``model_failed`` (Ray raises DeploymentUnavailableError for it only sometimes; else its
    handle waits for a replica for ever, and the request hung)."""
    first = asyncio.ensure_future(answer.__anext__())
    try:
        while True:
            done, _ = await asyncio.wait({first}, timeout=STATUS_POLL)
            if done:
                return first.result()
            if await asyncio.to_thread(ing.failed, ing.handles[model]):
                raise _failed(model)
    finally:
        first.cancel()  # (done: nothing; else the wait for a head that will not come)


def _failed(model: str) -> APIError:
    return APIError(503, f"model '{model}' is unavailable: its deployment failed to deploy "
                    "(justllm cluster status says why)", type="server_error",
                    code="model_failed")


def _prefill(ing: Ingress, model: str, path: str, body: dict, content: bytes,
             route: tuple[str, str | None]) -> Any:
    """A PD model's first half, started: the prefill deployment's call (its result, the KV,
    is left in Ray's object store), or None to serve the request whole (not a PD model, not a
    completion, or a prompt under prefill-min-tokens: cheaper computed where it is decoded)."""
    found = ing.prefill.get(model)
    if found is None or path not in PD_PATHS:
        return None
    handle, min_tokens = found
    if prompt_tokens_estimate(body, route[0]) < min_tokens:
        ing.pd[model, "short_prompt"] += 1
        return None
    return handle.prefill.remote(path, content, route=route)


def pd_series(ing: Ingress) -> str:
    """The hand-overs of PD models, as router mode names them."""
    models = list(ing.prefill)
    if not models:
        return ""
    lines = []
    for name, doc, outcome in (
            ("justllm_gateway_pd_transfers_total",
             "Prompts a prefill replica computed and handed over.", "handed_over"),
            ("justllm_gateway_pd_short_prompts_total",
             "Prompts under prefill-min-tokens, computed on a decode replica.", "short_prompt")):
        lines += [f"# HELP {name} {doc}", f"# TYPE {name} counter"]
        lines += [f'{name}{{model_name="{m}"}} {ing.pd[m, outcome]}' for m in models]
    name = "justllm_gateway_pd_fallbacks_total"
    lines += [f"# HELP {name} Requests of a PD model served whole by a decode replica, by "
              "reason.", f"# TYPE {name} counter"]
    lines += [f'{name}{{model_name="{m}",reason="{r}"}} {ing.pd[m, r]}' for m in models
              for r in ("prefill_refused", "prefill_failed")]
    return "\n".join(lines) + "\n"


def _cancel(answer: Any, kv: Any) -> None:
    """The client is gone, or the call failed: its call, and a PD model's prefill if it still
    runs. Ray's cancel of a call whose replica died raises that death again; nothing is left
    to cancel then (it escaped the fallback to serving the request whole as a 500)."""
    for call in (answer, kv):
        if call is not None:
            with contextlib.suppress(Exception):
                call.cancel()


async def _first_chunk(answer: Any) -> bytes | None:
    """A stream's first chunk (None: it ended with none)."""
    try:
        return cast(bytes, await answer.__anext__())
    except StopAsyncIteration:
        return None


async def _collect(answer: Any) -> list[bytes]:
    return [chunk async for chunk in answer]


async def _relay(answer: Any, model: str, path: str,
                 first: bytes | None) -> AsyncIterator[bytes]:
    """The replica's stream, chunk by chunk (``first`` already read); if the replica dies
    mid-way, a last frame in the stream's own API shape, as router mode ends it
    (gateway/streams.py). Closed early (the client left), it cancels the call, and the replica
    aborts the request."""
    try:
        if first is not None:  # None: the stream ended before its first chunk
            async for chunk in relayed(first, answer, path, REPLICA_GONE, model):
                yield chunk
    finally:
        _cancel(answer, None)


def _route(path: str, summary: str, root: bool = False) -> Any:
    """A handler forwarding ``path`` by model, for the router of its prefix (``root``: the
    root's)."""
    async def handler(request: Request) -> Any:
        return await forward(request, path)

    # "/v1/chat/completions" is "/chat/completions" on the /v1 router
    return post(path if root else "/" + path.split("/", 2)[2], status_code=200,
                summary=summary, name=path)(handler)


@get("/models", summary="The cluster's models")
async def list_models(request: Request, state: State) -> dict:
    return model_cards.listing(request, await _model_cards(state))


async def _model_cards(state: State) -> dict:
    """The cards of ``/v1/models``: each model's ``max_model_len`` (vLLM's: the tokens one
    request holds) as its replicas report it to the board (the least, should they differ;
    absent while none has reported); an adapter's is its base model's."""
    ing = _ingress(state)
    try:  # (the cards without it while the board does not answer: it restarts with Ray)
        snapshot = await asyncio.wait_for(ing.board.snapshot.remote(), BOARD_WAIT)
    except Exception:
        snapshot = {}
    lengths = {m: min(held) for m, rows in snapshot.items()
               if (held := [e["stats"]["max_model_len"] for e in rows.values()
                            if isinstance(e.get("stats", {}).get("max_model_len"), int)])}

    def length(model: str) -> dict:
        return {"max_model_len": lengths[model]} if model in lengths else {}

    return {"object": "list", "data": [
        {"id": m, "object": "model", "created": ing.created, "owned_by": "justllm",
         "aliases": [a for a, n in ing.names.items()
                     if n == m and a != m and a not in ing.adapters]} | length(m)
        for m in ing.handles] + [
        {"id": a, "object": "model", "created": ing.created, "owned_by": "justllm",
         "parent": ing.names[a]} | length(ing.names[a]) for a in sorted(ing.adapters)] + [
        {"id": a.name, "object": "model", "created": ing.created, "owned_by": "justllm",
         "parent": a.model} | length(a.model)
        for a in sorted(ing.runtime.loaded.values(), key=lambda a: a.name)]}


@get("/models/{model_id:path}", summary="One of the cluster's models")
async def retrieve_model(model_id: FromPath[str], request: Request, state: State) -> dict:
    return model_cards.card(request, model_cards.one_model(
        (await _model_cards(state))["data"], model_id))


@get("/tags", summary="Ollama: the cluster's models (and LoRA adapters, with their base)")
async def ollama_tags(state: State) -> dict:
    cards = (await _model_cards(state))["data"]  # an adapter as a model made with Ollama's ADAPTER
    return {"models": [{"name": f"{c['id']}:latest", "model": f"{c['id']}:latest", "size": 0,
                        "digest": "", "details": {"format": "gguf"} | (
                            {"parent_model": f"{c['parent']}:latest"} if "parent" in c else {})}
                       for c in cards]}


@get("/ps", summary="Ollama: the models with replicas up (a cluster does not unload them)")
async def ollama_ps(state: State) -> dict:
    ing = _ingress(state)
    snapshot = await ing.board.snapshot.remote()
    never = iso_time(time.time() + NEVER)  # (min-replicas 0: Ray scales to zero, no ttl)
    return {"models": [{"name": f"{m}:latest", "model": f"{m}:latest", "size": 0,
                        "digest": "", "details": {"format": "gguf"}, "expires_at": never,
                        "size_vram": 0} for m in ing.handles if snapshot.get(m)]}


@get("/version", summary="Ollama: the ingress's version (justllm's)")
async def ollama_version() -> dict:
    return {"version": __version__}


@get("/props", summary="llama-server's /props: a model's with ?model=, else the cluster's")
async def props(request: Request, model: FromQuery[str | None] = None) -> Any:
    if model is None:
        return router_props()
    return await forward(request, "/props", method="GET", body={"model": model})


@get("/slots", summary="llama-server's /slots: a model's (?model=), from one of its replicas")
async def slots(request: Request, model: FromQuery[str | None] = None) -> Any:
    return await forward(request, "/slots", method="GET", body=slots_body(model))


@get(["/health", "/v1/health"], summary="200 while the ingress is up")
async def health() -> dict:
    return {"status": "ok"}


@get("/metrics", summary="Prometheus metrics of every replica, labelled model_name and replica",
     media_type="text/plain; version=0.0.4")
async def metrics(state: State) -> Response:
    ing = _ingress(state)
    snapshot = await ing.board.snapshot.remote()
    reports = {m: {r: e["stats"] for r, e in rows.items()} for m, rows in snapshot.items()}
    pages = {m: {r: e["page"] for r, e in rows.items()} for m, rows in snapshot.items()}
    return Response(render(reports, pages, list(ing.handles)) + pd_series(ing).encode(),
                    media_type="text/plain; version=0.0.4")


OPENAI = (("/v1/chat/completions", "Chat completion, routed by model"),
          ("/v1/completions", "Text completion, routed by model"),
          ("/v1/embeddings", "Embeddings, routed by model"),
          ("/v1/responses", "OpenAI Responses (stateless), routed by model"),
          ("/v1/responses/input_tokens", "OpenAI Responses: count the input tokens, routed by "
                                         "model"))
ANTHROPIC = (("/v1/messages", "Anthropic: create a message, routed by model"),
             ("/v1/messages/count_tokens", "Anthropic: count a message's tokens, routed by "
                                           "model"))
OLLAMA = (("/api/chat", "Ollama chat, routed by model"),
          ("/api/generate", "Ollama generate, routed by model"),
          ("/api/embed", "Ollama embed, routed by model"),
          ("/api/embeddings", "Ollama embeddings (legacy), routed by model"),
          ("/api/show", "Ollama show, routed by model"))
TOKENS = (("/tokenize", "Tokenize (vLLM's or llama-server's body), routed by model"),
          ("/detokenize", "The text of token ids, routed by model"))
# llama-server's routes at the root (server/llama_server.py), the replica's own paths.
LLAMA_SERVER = (("/apply-template", "llama-server's: a chat's prompt, routed by model"),
                ("/completion", "llama-server's native completion, routed by model"),
                ("/completions", "llama-server's native completion, routed by model"),
                ("/infill", "llama-server's fill-in-the-middle, routed by model"),
                ("/embedding", "llama-server's native embeddings, routed by model"),
                ("/embeddings", "llama-server's native embeddings, routed by model"),
                ("/rerank", "Rerank documents (a reranker), routed by model"),
                ("/reranking", "Rerank documents (llama-server's other path), routed by model"),
                ("/v1/rerank", "Rerank documents (a reranker), routed by model"),
                ("/v1/reranking", "Rerank documents (llama-server's other path), routed by "
                                  "model"),
                ("/chat/completions", "Chat completion (llama-server's path without /v1)"),
                ("/responses", "OpenAI Responses (llama-server's path without /v1)"),
                ("/responses/input_tokens", "Count the input tokens (llama-server's path "
                                            "without /v1)"))


def disconnect_when_cancelled(app: Any) -> Any:
    """``app`` (an ASGI app) told of a client that left as ASGI says: Ray Serve's ``receive``
    raises TaskCancelledError when its proxy stops relaying a request's messages (the client
    disconnected) where it means ``http.disconnect``. Litestar, listening for the disconnect
    during a stream, let it escape after the response had started: an ERROR traceback in the
    ingress's log for some ordinary disconnects."""
    async def wrapped(scope: Any, receive: Any, send: Any) -> None:
        async def receive_or_disconnect() -> Any:
            try:
                return await receive()
            except TaskCancelledError:
                return {"type": "http.disconnect"}
        await app(scope, receive_or_disconnect if scope["type"] == "http" else receive, send)
    return wrapped


def create_ingress(ingress: Ingress) -> Litestar:
    """The ingress's app. ``ingress.api_key``: /v1 and /api ask for it, as `justllm serve`."""
    config = IngressConfig(ingress.api_key)
    v1 = Router(path="/v1", route_handlers=[_route(p, s) for p, s in OPENAI + ANTHROPIC]
                + [list_models, retrieve_model] + runtime_lora.ROUTES,
                guards=[require_api_key])
    api = Router(path="/api", route_handlers=[_route(p, s) for p, s in OLLAMA]
                 + [ollama_tags, ollama_ps, ollama_version],
                 guards=[require_api_key], exception_handlers={Exception: ollama_error})
    tokens = Router(path="/", route_handlers=[_route(p, s, root=True)
                                              for p, s in TOKENS + LLAMA_SERVER]
                   + [props, slots, slot_action],
                    guards=[require_api_key])
    async def restore(app: Litestar) -> None:
        await runtime_lora.restore_runtime(app.state["ingress"])

    return Litestar(route_handlers=[v1, api, tokens, health, metrics, ollama_root,
                                    ollama_root_head], on_startup=[restore],
                    guards=[refuse_other_sites], cors_config=cors_config(),
                    state=State({"ingress": ingress, "config": config}),
                    exception_handlers={Exception: handle_exception},
                    before_send=[drop_request_id], openapi_config=None, debug=False)


async def drop_request_id(message: Any, scope: Any) -> None:
    """A ``before_send`` hook: no X-Request-Id on the ingress's answers. Ray Serve's proxy
    puts the request's id (the client's, or one it makes) in the request's headers, where the
    ingress and the replicas read it, and on the answer: a second one made the header
    "id, id", which the OpenAI SDK's ``_request_id`` and ``justllm history --id`` took whole."""
    if message["type"] == "http.response.start":
        message["headers"] = [(k, v) for k, v in message.get("headers") or ()
                              if bytes(k).lower() != REQUEST_ID.encode()]
