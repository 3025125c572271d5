"""The gateway's HTTP face: the OpenAI routes forwarded by the body's ``model`` to that model's
runner (loaded first if need be), the model list with status, load/unload, health, and one
``/metrics`` page for all. No module-level state: everything lives in ``app.state``."""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import httpx
import msgspec
from litestar import Litestar, Request, Response, Router, get, head, post
from litestar.datastructures import State
from litestar.params import FromPath, FromQuery
from litestar.response import Stream

from justllm import __version__
from justllm.errors import JustLLMError
from justllm.gateway import lora
from justllm.gateway.config import GatewayConfig
from justllm.gateway.metrics import render_metrics
from justllm.gateway.policy import (
    PD_PATHS,
    lora_request,
    prompt_tokens_estimate,
    session_key,
    unstable_lora_id,
    unstable_lora_id_message,
)
from justllm.gateway.replica import Replica
from justllm.gateway.routing import NoReplica, RouteRequest, route_text
from justllm.gateway.runner import log_name
from justllm.gateway.streams import relayed
from justllm.gateway.supervisor import ModelState, ModelUnavailable, Supervisor
from justllm.models.source import log_dir
from justllm.server import model_cards
from justllm.server.app import require_api_key, sse_response, unless_disconnected
from justllm.server.config import RUNNER_KEEPALIVE_EXPIRY
from justllm.server.errors import APIError, handle_exception, json_object
from justllm.server.llama_server import router_props, slot_action, slots_body
from justllm.server.ollama import keep_alive_seconds, ollama_error, unloaded
from justllm.server.ollama_chat import ASKED_MODEL_HEADER, LOAD_SECONDS_HEADER
from justllm.server.request_checks import check_without_model
from justllm.server.request_id import HEADER as REQUEST_ID
from justllm.server.request_id import add_request_id, request_id
from justllm.server.response_store import unstored
from justllm.server.web_origin import cors_config, refuse_other_sites

# A replica that could not be reached or died before answering (refused or timed-out
# connection, a broken write or read, a protocol error): nothing reached the client, and the
# request is sent once more, to another replica or this one's successor.
_NOT_ANSWERED = httpx.TransportError
LOAD_SCOPE_KEY = "justllm.load_seconds"  # how long this request waited for its model's load
ASKED_SCOPE_KEY = "justllm.asked_model"  # an Ollama request's model, before it was rewritten


@dataclass(frozen=True)
class GatewaySettings:
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    max_body_bytes: int = 8 * 1024 * 1024
    shutdown_timeout: float = 5.0  # a stopping runner's drain (unload, ttl, SIGTERM)


def _supervisor(state: State) -> Supervisor:
    return state["supervisor"]


def _model(sup: Supervisor, name: Any, ollama: bool = False) -> ModelState:
    if name is not None and not isinstance(name, str):
        raise APIError(400, "model must be a string", param="model")
    found = sup.resolve(name)
    if found is None and name and name.endswith(":latest"):  # the tag Ollama clients add
        bare = name.removesuffix(":latest")
        found = sup.resolve(bare)
        if found is not None and not ollama and found.has_adapter(bare):
            # Off Ollama's API an adapter's NAME:latest is no model name (a single server's
            # 404): it used to run on the base model, without the adapter.
            found = None
    if found is None and ollama:
        raise APIError(404 if name else 400,
                       f'model "{name}" not found, try pulling it first' if name
                       else "model is required", param="model")
    if found is None:
        known = ", ".join([*sup.config.names, *(a for s in sup.models.values()
                                                for a in s.runtime_lora)])
        raise APIError(404 if name else 400,
                       f"the model '{name}' does not exist; this server has: {known}"
                       if name else f"model is required (one of: {known})",
                       type="not_found_error" if name else "invalid_request_error",
                       param="model", code="model_not_found" if name else None)
    return found


def _unavailable(e: ModelUnavailable) -> APIError:
    """The 503; with ``Retry-After`` unless the model has failed, which only ``POST
    /models/load`` (or a restart) tries again, or can never fit (``max-memory``): clients that
    honour it would wait in vain."""
    final = e.code in ("model_failed", "model_too_large")
    return APIError(503, str(e), type="server_error", code=e.code,
                    headers={} if final else {"Retry-After": "2"})


class _Refused(Exception):
    """A replica answered 429 or 503 before anything reached the client: try another. Its
    answer, or the error to give if none takes it (a remote replica that refused the
    gateway's key)."""

    def __init__(self, response: Response | APIError) -> None:
        self.response = response


async def _forward(request: Request, path: str, *, method: str = "POST",
                   body: dict[str, Any] | None = None) -> Any:
    """The request to its model's replica: ``body``'s ``model`` (the request's JSON body when
    not given) picks it; ``method`` GET sends no body (``/props?model=``)."""
    sup = _supervisor(request.app.state)
    if body is None:
        body = json_object(await request.body())
    body = unstored(path, body, "router mode")
    ollama = path.startswith("/api/")
    state = _model(sup, body.get("model") or (body.get("name") if ollama else None), ollama)
    keep_alive = None
    if ollama and body.get("keep_alive") is not None:  # the gateway's to honour (null: absent)
        # (Ollama's routes only: elsewhere the runner refuses the field as a single server
        # does, and a keep_alive 0 on /v1 used to unload the model)
        keep_alive = _keep_alive(state, body["keep_alive"])
        if state.remote_only:  # the remote servers' to honour or refuse: sent on as it came
            keep_alive = None  # (it used to be dropped, and keep_alive 0 answered a load)
        else:
            del body["keep_alive"]
    if keep_alive == 0 and ollama:
        done = unloaded(body.get("model") or body.get("name") or state.spec.name, path, body)
        if done is not None:  # Ollama's "unload this model": done without loading it
            state.keep_alive = 0.0
            if state.active == 0:
                await sup.unload(state)
            return done
    route = RouteRequest(route_text(body), session_key(request.headers.get("x-session-id"),
                                                       body))
    fixed = len(state.spec.adapters)
    unstable = unstable_lora_id(body, fixed)
    if unstable is not None:
        raise APIError(400, unstable_lora_id_message(unstable, state.spec.name, fixed),
                       param="lora")
    name_key = "model" if "model" in body or not ollama else "name"
    asked = body.get(name_key)
    if ollama and isinstance(asked, str):
        asked = asked.removesuffix(":latest")  # the tag Ollama clients add
    named = not state.has_adapter(asked)  # an adapter is the runner's own name
    if named:
        if ollama and body.get(name_key) != state.spec.name:  # echoed as the client wrote it
            request.scope[ASKED_SCOPE_KEY] = body.get(name_key)  # type: ignore[literal-required]
        body[name_key] = state.spec.name  # an alias becomes the runner's name
    content = msgspec.json.encode(body)
    waited = time.monotonic() if not state.routable else None
    if waited is not None:  # refused before a load it would only waste (or an eviction)
        check_without_model(path, content)  # (without the gateway's own keep_alive)
    try:  # (a client that left while its model loaded still counted against max-waiting)
        left = await unless_disconnected(request, sup.acquire(state))
    except ModelUnavailable as e:
        raise _unavailable(e) from None
    if isinstance(left, Response):  # acquire was cancelled: it counts nothing
        return left
    if waited is not None:  # for the runner's Ollama answers (load_duration)
        request.scope[LOAD_SCOPE_KEY] = time.monotonic() - waited  # type: ignore[literal-required]
    async def sent_to(replica: Replica) -> bytes:
        """The body as ``replica`` is asked it: a remote server of this model under another
        name by its own, polled for it before its first request (a PD prefill or hand-over
        too: they named the gateway's, a 404)."""
        if named and replica.remote is not None and replica.polled is None:
            await sup.poll(state, replica)
        if named and replica.serves not in (None, state.spec.name):
            return msgspec.json.encode({**body, name_key: replica.serves})
        return content

    ended = False
    handover: _Handover | None = None
    handing = _Once(lambda: None)  # a PD request's: its decode replica has it (see below)
    try:
        target = path
        if state.spec.pd and path in PD_PATHS and not lora_request(body, state.adapters):
            if prompt_tokens_estimate(body, route.text) < state.spec.prefill_min_tokens:
                state.pd_short_prompts += 1  # computed on the decode replica: cheaper
            else:
                # an unload (or a shutdown) waits for it to reach its decode replica
                state.handing_over += 1
                handing = _Once(partial(_handed, state))
                got = await unless_disconnected(
                    request, _prefill(request, sup, state, route, path, sent_to))
                if isinstance(got, Response):  # the client left: the prefill was aborted
                    state.pd_aborted += 1
                    return got
                if isinstance(got, _Refused):  # the request's own fault: the decode replica
                    return got.response  # renders and checks it alike, so it is answered now
                if got is None:  # served whole: nothing to hand over
                    handing()
                else:  # the decode replica imports the KV (its relay's end: handing), serves
                    handover, target = got, f"/pd/decode?path={path}"
                    got.relayed = handing
        skip: set[str] = set()  # replicas that refused this request (429, 503)
        deadline = time.monotonic() + sup.config.load_timeout
        refused: Response | APIError | None = None
        failed = 0  # replicas that died under this request before answering
        while True:
            # and those that could not load the runtime LoRA adapter it names when they
            # started (gateway/lora.absent; read anew: one may load it meanwhile)
            absent = state.lora_absent.get(asked, set()) if isinstance(asked, str) else set()
            replica = _routed(sup, state, route, skip | absent)
            if replica is None and handover is not None:
                # computed before an unload took the decode replicas out of the rotation:
                # one of them serves it (stopped once it has it)
                replica = sup.leaving_decoder(state, skip)
            if replica is None:
                handing()  # (an unload waits no more for this one)
                if isinstance(refused, APIError):
                    raise refused from None
                if refused is not None:  # every replica refused it: the last refusal
                    return refused
                if absent and state.routable:  # those serving lack the adapter: wait for
                    if time.monotonic() > deadline:  # one that holds it (restarting)
                        raise APIError(503, f"no replica that holds the LoRA adapter "
                                            f"'{asked}' is serving now", type="server_error",
                                       code="no_healthy_replica") from None
                    await asyncio.sleep(0.05)
                    continue
                try:
                    await sup.wait_routable(state)
                except ModelUnavailable as e:
                    raise _unavailable(e) from None
                continue
            if handover is not None and handover.spent:
                # The KV went to a replica that did not serve the request: served whole now.
                state.pd_fallbacks["decode_failed"] += 1
                await handover.close()
                handover, target = None, path
            asked_as = await sent_to(replica)
            this: bytes | AsyncIterator[bytes] = (
                asked_as if handover is None else handover.body(asked_as))
            # The replica is released once, however the try ends: by _send with its answer,
            # by its stream's relay at the stream's end, or below (an error, a cancellation).
            release = _Once(partial(sup.done, replica))
            answer: Response | Stream | None = None
            try:
                answer = await _send(request, replica, target, this, state, keep_alive, release,
                                     method)
            except _NOT_ANSWERED as e:
                # Nothing reached the client: the request goes to another replica (or to
                # this one's successor) -- once, so a request that kills runners kills two.
                release()
                sup.replica_failed(state, replica, f"{type(e).__name__}: {e}")
                failed += 1
                if failed == 2:
                    raise APIError(503, f"model '{state.spec.name}' stopped answering",
                                   type="server_error", code="replica_failed",
                                   headers={"Retry-After": "2"}) from None
                continue
            except _Refused as e:
                release()
                skip.add(replica.id)
                refused = e.response
                continue
            finally:
                if not isinstance(answer, Stream):  # (a stream's relay releases it at its end)
                    release()
                handing()  # its decode replica has it (or failed it)
                # (the hand-over's end released it already, unless the send failed first)
            ended = isinstance(answer, Stream)  # the stream's relay ends the request
            return answer
    finally:
        handing()
        if handover is not None:
            await handover.close()
        if not ended:
            sup.end(state, keep_alive)


def _handed(state: ModelState) -> None:
    state.handing_over -= 1


def _routed(sup: Supervisor, state: ModelState, route: RouteRequest,
            skip: set[str]) -> Replica | None:
    """The replica the model's policy picks (``Supervisor.route``); None: none can take it."""
    try:
        return sup.route(state, route, skip)
    except NoReplica:
        return None


def _keep_alive(state: ModelState, value: object) -> float | None:
    """A request's ``keep_alive`` in seconds, as the gateway honours it: None where the
    model's own rule holds (a model never unloaded, ``min-replicas`` >= 1, stays loaded at
    least as long as any duration asks); a 400 for what no model could honour (not a
    duration, one past Go's range, or 0 on a model never unloaded)."""
    try:
        seconds = keep_alive_seconds(value)
    except ValueError as e:
        raise APIError(400, str(e), param="keep_alive") from None
    if not state.pinned:
        return seconds
    if seconds == 0:
        raise APIError(400, f"keep_alive 0 unloads the model, and model '{state.spec.name}' "
                            "is never unloaded (min-replicas >= 1 in models.yaml); leave "
                            "keep_alive out, or POST /models/unload", param="keep_alive")
    return None


class _Once:
    """``release()`` at most once, however many of its callers get to it."""

    def __init__(self, release: Callable[[], None]) -> None:
        self.release = release
        self.called = False

    def __call__(self) -> None:
        if not self.called:
            self.called = True
            self.release()


class _Handover:
    """A prefill replica's answer, open: its KV bytes are relayed into the decode replica's
    request as they arrive (the gateway never holds a whole transfer). A transfer that breaks
    reaches the decode replica truncated; it refuses the import and computes the prompt."""

    def __init__(self, response: httpx.Response, state: ModelState, t0: float) -> None:
        self.response, self.state, self.t0 = response, state, t0
        self.spent = False  # body() was handed to a request: it cannot be sent again
        # Called once the decode replica has the whole body (the KV relayed, or cut short):
        # an unload waiting for the hand-over may stop the runners now, which let the
        # request they received run to its end (their drain).
        self.relayed: Callable[[], None] = lambda: None

    async def body(self, request_json: bytes) -> AsyncIterator[bytes]:
        """``/pd/decode``'s body: the request's length (u32 LE), the request, the KV."""
        self.spent = True
        yield struct.pack("<I", len(request_json)) + request_json
        state, n = self.state, 0
        try:
            async for piece in self.response.aiter_raw():
                n += len(piece)
                yield piece
        except httpx.HTTPError:
            state.pd_fallbacks["transfer_broken"] += 1
            return
        finally:
            self.relayed()
            await self.close()
        state.pd_transfers += 1
        state.pd_bytes += n
        state.pd_seconds += time.monotonic() - self.t0

    async def close(self) -> None:
        await self.response.aclose()


def _runner_headers(request: Request) -> dict[str, str]:
    """What a runner is sent besides the body: its type, the request's ``X-Request-Id``, how
    long it waited for the model to load (Ollama's ``load_duration``), and the client's W3C
    trace context (``traceparent``, ``tracestate``) so the runner's records continue the
    client's trace."""
    loaded_in = request.scope.get(LOAD_SCOPE_KEY)
    asked = request.scope.get(ASKED_SCOPE_KEY)
    return {"content-type": "application/json", REQUEST_ID: request_id(request.scope),
            **({LOAD_SECONDS_HEADER: f"{loaded_in:.6f}"} if loaded_in else {}),
            **({ASKED_MODEL_HEADER: quote(asked, safe="")} if isinstance(asked, str) else {}),
            **{k: v for k, v in request.headers.items() if k in ("traceparent", "tracestate")}}


async def _prefill(request: Request, sup: Supervisor, state: ModelState, route: RouteRequest,
                   path: str, sent_to: Callable[[Replica], Awaitable[bytes]]
                   ) -> _Handover | _Refused | None:
    """A PD model's first half: a prefill replica (cache-aware) computes the prompt and answers
    with its KV, which is relayed to the decode replica as it comes. None when that fails
    before the KV starts (no prefill replica, it refused or died): the request is then served
    whole by a decode replica, counted by reason. Cancelled (the client left), it closes the
    connection, and the prefill replica aborts the prompt."""
    try:
        replica = sup.route(state, route, set(), role="prefill")
    except NoReplica:
        state.pd_fallbacks["no_prefill_replica"] += 1
        return None
    http: httpx.AsyncClient = request.app.state["http"]
    t0 = time.monotonic()
    try:
        response = await http.send(http.build_request(
            "POST", f"{replica.url}/pd/prefill?path={path}", content=await sent_to(replica),
            headers=_runner_headers(request)), stream=True)
    except httpx.HTTPError as e:
        if isinstance(e, _NOT_ANSWERED):
            sup.replica_failed(state, replica, f"{type(e).__name__}: {e}")
        state.pd_fallbacks["prefill_failed"] += 1
        return None
    finally:
        sup.done(replica)
    if response.status_code == 400:  # the request's fault (a decode replica would say so)
        try:
            data = await response.aread()
        finally:
            await response.aclose()
        return _Refused(Response(data, status_code=400, media_type=response.headers.get(
            "content-type", "application/json")))
    if response.status_code != 200:
        await response.aclose()
        state.pd_fallbacks[f"prefill_{response.status_code}"] += 1
        return None
    return _Handover(response, state, t0)


async def _send(request: Request, replica: Replica, path: str,
                content: bytes | AsyncIterator[bytes],
                state: ModelState, keep_alive: float | None,
                done: Callable[[], None], method: str = "POST") -> Response | Stream:
    """One try on one replica: its answer, or a stream that relays it (whose end calls
    ``done``); raises _Refused for a 429/503 another replica may not give. The answer says
    which replica served it (``X-Replica``)."""
    http: httpx.AsyncClient = request.app.state["http"]
    # The client's query string goes with the request to the path it asked for (a plugin's
    # route may read it); PD's hand-over paths carry their own.
    query = request.url.query if path == request.url.path else ""
    asked = request.query_params.get("model")
    if method == "GET" and asked is not None and not state.has_adapter(asked):
        # /props?model= and /slots?model=: the runner knows its model by its own name, not
        # by an alias (as a body's model is rewritten: see _forward)
        query = urlencode({**dict(request.query_params),
                           "model": replica.serves or state.spec.name})
    # A runner sends the head of an answer that is not a stream only once it is done: a
    # client that leaves before then cancels the send, whose connection closes, and the
    # runner aborts the request (it used to generate to the end, holding its KV).
    response = await unless_disconnected(request, http.send(http.build_request(
        method, f"{replica.url}{path}", content=content if method == "POST" else None,
        params=query or None, headers=_runner_headers(request)), stream=True))
    if isinstance(response, Response):
        done()
        return response
    # Which replica served it, and what the runner says of it: PD's X-PD, a 503's Retry-After.
    served_by = {"x-replica": replica.id, **{k: v for k, v in response.headers.items()
                                             if k.lower() in ("x-pd", "retry-after")}}
    kind = response.headers.get("content-type", "")
    if kind.startswith(("text/event-stream", NDJSON)):
        # Its first chunk before the client gets anything: a runner that dies while the
        # request waits there for its turn has sent headers only, and the request goes to
        # another replica (the caller's retry), as one that is not a stream does.
        chunks = response.aiter_raw()
        try:
            first = await unless_disconnected(request, anext(chunks, b""))
        except BaseException:
            await response.aclose()
            raise
        if isinstance(first, Response):  # the client left; the runner aborts on our close
            await response.aclose()
            done()
            return first
        relay = _relay(response, chunks, first, request.app.state["supervisor"], state,
                       keep_alive, done, path)
        if kind.startswith(NDJSON):  # Ollama's streams
            return Stream(relay, media_type=NDJSON, headers={"Content-Type": NDJSON,
                                                             **served_by})
        return sse_response(relay, served_by)
    try:
        data = await unless_disconnected(request, response.aread())
    finally:
        await response.aclose()
    if isinstance(data, Response):  # the client left; the runner aborted on our close
        done()
        return data
    answer = Response(data, status_code=response.status_code,
                      media_type=response.headers.get("content-type", "application/json"),
                      headers=served_by)
    if response.status_code in (429, 503):
        raise _Refused(answer)
    if response.status_code in (401, 403) and replica.remote is not None:
        # The replica's key, not the client's: passed on, the client read it as its own.
        raise _Refused(APIError(502, f"the replica {replica.id} of model '{state.spec.name}' "
                                f"refused the gateway (HTTP {response.status_code}): give the "
                                "model the api-key that replica was started with "
                                "(models.yaml)", type="server_error",
                                code="replica_unauthorized"))
    done()
    return answer


async def _relay(response: httpx.Response, chunks: AsyncIterator[bytes], first: bytes,
                 sup: Supervisor, state: ModelState, keep_alive: float | None,
                 done: Callable[[], None], path: str) -> AsyncIterator[bytes]:
    """A runner's SSE (or Ollama's NDJSON) stream, byte for byte (``first``, then the rest of
    ``chunks``); if the runner dies mid-stream, a final error in the stream's own API shape
    (``streams.relayed``). Closing it (the client left) closes the runner's stream, which
    aborts."""
    try:
        async for chunk in relayed(first, chunks, path, httpx.HTTPError, state.spec.name):
            yield chunk
    finally:
        done()  # first: the await below may be cancelled (client gone)
        sup.end(state, keep_alive)
        await response.aclose()


@post("/chat/completions", status_code=200, summary="Chat completion, routed by model")
async def chat_completions(request: Request) -> Any:
    return await _forward(request, "/v1/chat/completions")


@post("/completions", status_code=200, summary="Text completion, routed by model")
async def completions(request: Request) -> Any:
    return await _forward(request, "/v1/completions")


@post("/embeddings", status_code=200, summary="Embeddings, routed by model")
async def embeddings(request: Request) -> Any:
    return await _forward(request, "/v1/embeddings")


# Anthropic's Messages API: forwarded like chat completions; the gateway's own errors (an
# unknown model, a model that cannot load) in Anthropic's shape, as the runner's are
# (errors.handle_exception, by the path).
@post("/messages", status_code=200, summary="Anthropic: create a message, routed by model")
async def anthropic_messages(request: Request) -> Any:
    return await _forward(request, "/v1/messages")


@post("/messages/count_tokens", status_code=200,
      summary="Anthropic: count a message's prompt tokens, routed by model")
async def anthropic_count_tokens(request: Request) -> Any:
    return await _forward(request, "/v1/messages/count_tokens")


@post("/responses", status_code=200, summary="OpenAI Responses (stateless), routed by model")
async def responses(request: Request) -> Any:
    return await _forward(request, "/v1/responses")


@post("/responses/input_tokens", status_code=200,
      summary="OpenAI Responses: count a request's input tokens, routed by model")
async def responses_input_tokens(request: Request) -> Any:
    return await _forward(request, "/v1/responses/input_tokens")


# llama-server's routes, at the root as on a runner (server/llama_server.py).
@get("/props", summary="llama-server's /props: a model's with ?model=, else the router's")
async def props(request: Request, model: FromQuery[str | None] = None) -> Any:
    if model is None:
        return router_props()
    return await _forward(request, "/props", method="GET", body={"model": model})


@get("/slots", summary="llama-server's /slots: a model's (?model=), from one of its replicas")
async def slots(request: Request, model: FromQuery[str | None] = None) -> Any:
    return await _forward(request, "/slots", method="GET", body=slots_body(model))


@post(["/completion", "/completions"], status_code=200,
      summary="llama-server's /completion (its body and answer), routed by model")
async def llama_completion(request: Request) -> Any:
    return await _forward(request, request.url.path)


@post("/infill", status_code=200,
      summary="llama-server's /infill (fill-in-the-middle), routed by model")
async def llama_infill(request: Request) -> Any:
    return await _forward(request, "/infill")


@post(["/embedding", "/embeddings"], status_code=200,
      summary="llama-server's native embeddings, routed by model")
async def llama_embedding(request: Request) -> Any:
    return await _forward(request, request.url.path)


@post(["/v1/rerank", "/v1/reranking", "/rerank", "/reranking"], status_code=200,
      summary="Rerank documents (a reranker model), routed by model")
async def rerank(request: Request) -> Any:
    return await _forward(request, request.url.path)


@post("/apply-template", status_code=200,
      summary="llama-server's /apply-template: a chat's prompt, routed by model")
async def apply_template(request: Request) -> Any:
    return await _forward(request, "/apply-template")


# vLLM's and llama-server's token routes, at the root as on a runner.
@post("/tokenize", status_code=200,
      summary="Tokenize (vLLM's or llama-server's body), routed by model")
async def tokenize(request: Request) -> Any:
    return await _forward(request, "/tokenize")


@post("/detokenize", status_code=200, summary="The text of token ids, routed by model")
async def detokenize(request: Request) -> Any:
    return await _forward(request, "/detokenize")


NDJSON = "application/x-ndjson"


# ---- Ollama's API: requests forwarded like /v1's, listings from the supervisor --------------

@post("/chat", status_code=200, summary="Ollama: chat, routed by model (NDJSON stream)")
async def ollama_chat(request: Request) -> Any:
    return await _forward(request, "/api/chat")


@post("/generate", status_code=200, summary="Ollama: generate, routed by model (NDJSON stream)")
async def ollama_generate(request: Request) -> Any:
    return await _forward(request, "/api/generate")


@post("/embed", status_code=200, summary="Ollama: embeddings, routed by model")
async def ollama_embed(request: Request) -> Any:
    return await _forward(request, "/api/embed")


@post("/embeddings", status_code=200, summary="Ollama (older): an embedding, routed by model")
async def ollama_embeddings(request: Request) -> Any:
    return await _forward(request, "/api/embeddings")


# Ollama's /api/show answers kept (by model and question) for an unloaded model.
SHOWN_KEPT = 256


@post("/show", status_code=200, summary="Ollama: a model's details (from its runner)")
async def ollama_show(request: Request) -> Any:
    """From the model's runner, loaded for it; once a runner has answered, the same question
    is answered from that answer while the model is unloaded and its file unchanged (Ollama's
    never loads a model for it: clients that ask it of every listed model swapped them in
    turn under max-loaded)."""
    sup = _supervisor(request.app.state)
    body = json_object(await request.body())
    state = _model(sup, body.get("model") or body.get("name"), True)
    shown: dict[bytes, tuple[Any, bytes]] = request.app.state.setdefault("shown", {})
    key = msgspec.json.encode([state.spec.name, sorted(body.items())])
    stamped = await asyncio.to_thread(_stamp, state.spec.source)
    stamp = (state.spec.source, stamped and stamped[0])
    hit = shown.get(key)
    if hit is not None and hit[0] == stamp and not state.routable:
        return Response(hit[1], media_type="application/json")
    answer = await _forward(request, "/api/show")
    if (isinstance(answer, Response) and answer.status_code == 200
            and isinstance(answer.content, bytes)):
        if len(shown) >= SHOWN_KEPT:
            del shown[next(iter(shown))]
        shown[key] = (stamp, answer.content)
    return answer


def _tag(name: str) -> str:
    return name if ":" in name else f"{name}:latest"


NEVER = 292 * 365 * 86400.0  # what /api/ps says of a model never unloaded: centuries ahead


def iso_time(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class _Listed:
    """What Ollama's listings say of a local model: its file's size and modification time
    (zeros when there is no file: a model served elsewhere, or not pulled yet), its digest
    (the registry's: a listing hashes no file; blank when unknown) and ``details``, read off
    its GGUF header (``{"format": "gguf"}`` when the file is no readable GGUF: it fails at
    its load, not here)."""

    size: int = 0
    mtime: float = 0.0
    digest: str = ""
    details: dict[str, Any] = field(default_factory=lambda: {"format": "gguf"})


def _local_file(source: str) -> tuple[Path, str | None] | None:
    """The file a source names here, found without the network or a hash (a path, a registry
    name, a pulled ``REPO:FILE``), and the registry's digest of it when it knows one."""
    from justllm.models.registry import Registry

    if not source:
        return None
    path = Path(source).expanduser()
    try:
        registry = Registry()  # (a JUSTLLM_MODELS_DIR that is a file: every listing failed)
        if path.is_file():
            return path, registry.digests.cached(path)
        m = registry.listed(source)
    except (JustLLMError, OSError, ValueError):  # (a damaged registry: a load says so)
        return None
    return None if m is None else (m.path, m.hex)


def _stamp(source: str) -> tuple[tuple[str, int, float], str | None] | None:
    """The file a source names here (:func:`_local_file`) as (path, size, modification time),
    which change when the model does, and its digest if known; None: no file here."""
    found = _local_file(source)
    if found is None:
        return None
    path, digest = found
    try:
        st = path.stat()
    except OSError:
        return None
    return (str(path), st.st_size, st.st_mtime), digest


def _listing(source: str, kept: dict[tuple[str, int, float], _Listed]) -> _Listed:
    """:class:`_Listed` of ``source``, the header read again only when its file changed."""
    from justllm.models.gguf import read_gguf_header
    from justllm.server.ollama import gguf_details

    stamped = _stamp(source)
    if stamped is None:
        return _Listed()
    stamp, digest = stamped
    if stamp not in kept:
        try:
            details = gguf_details(read_gguf_header(stamp[0]))
        except (JustLLMError, OSError, ValueError):  # (ModelLoadError: no GGUF)
            details = {"format": "gguf"}
        kept[stamp] = _Listed(stamp[1], stamp[2], "", details)
    return replace(kept[stamp], digest=digest or "")


async def _listed(state: State, source: str) -> _Listed:
    return await asyncio.to_thread(_listing, source, state.setdefault("listing_facts", {}))


@get("/tags", summary="Ollama: every model of the gateway")
async def ollama_tags(state: State) -> dict:
    sup = _supervisor(state)
    models = []
    for s in sup.models.values():
        listed = await _listed(state, s.spec.source)
        mtime = listed.mtime or state["started"]
        models.append({"name": _tag(s.spec.name), "model": _tag(s.spec.name),
                       "modified_at": iso_time(mtime), "size": listed.size,
                       "digest": listed.digest, "details": listed.details})
        # its LoRA adapters, as models made with Ollama's ADAPTER (a runner's /api/show has
        # the details)
        models += [{"name": _tag(a), "model": _tag(a), "modified_at": iso_time(mtime), "size": 0,
                    "digest": "", "details": {"format": "gguf", "parent_model": _tag(s.spec.name)}}
                   for a in s.adapters]
    return {"models": models}


@get("/ps", summary="Ollama: the models loaded now, and when they unload")
async def ollama_ps(state: State) -> dict:
    sup = _supervisor(state)
    now_mono, now = time.monotonic(), time.time()
    models = []
    for s in sup.models.values():
        if s.status != "loaded" or s.remote_only:
            continue
        left = s.ttl - (now_mono - s.last_used) if s.ttl >= 0 and s.active == 0 else NEVER
        expires = now + min(max(0.0, left), NEVER)  # (a ttl past a datetime's years: NEVER)
        listed = await _listed(state, s.spec.source)
        models.append({"name": _tag(s.spec.name), "model": _tag(s.spec.name),
                       "size": listed.size, "digest": listed.digest, "details": listed.details,
                       "expires_at": iso_time(expires), "size_vram": 0})
    return {"models": models}


@get("/version", summary="Ollama: the gateway's version (justllm's)")
async def ollama_version() -> dict:
    return {"version": __version__}


# Ollama answers HEAD on these two as on "/" (health checks use them), as a single server does.
@head(["/tags", "/version"], summary="Ollama: headers only", media_type="application/json")
async def ollama_head() -> None:
    return None


@get("/", summary="Ollama's liveness answer", media_type="text/plain", include_in_schema=False)
async def ollama_root() -> str:
    return "Ollama is running"


@head("/", summary="Ollama's liveness answer (headers only)", media_type="text/plain",
      include_in_schema=False)
async def ollama_root_head() -> None:
    return None


@get("/models", summary="Every model, with its status (loaded, loading, unloaded, failed)")
async def list_models(request: Request, state: State) -> dict:
    return model_cards.listing(request, _model_cards(state))


def _model_cards(state: State) -> dict:
    sup = _supervisor(state)
    created = int(state["started"])
    return {"object": "list", "data": [
        {"id": s.spec.name, "object": "model", "created": created, "owned_by": "justllm",
         "status": s.status, "aliases": list(s.spec.aliases), **_context(s)}
        for s in sup.models.values()] + [
        {"id": a, "object": "model", "created": created, "owned_by": "justllm",
         "status": s.status, "parent": s.spec.name, **_context(s)}
        for s in sup.models.values() for a in s.adapters]}


def _context(s: ModelState) -> dict[str, int]:
    """vLLM's ``max_model_len`` on a model's card, once a runner of it has said it (a model
    never loaded has none yet)."""
    return {} if s.max_model_len is None else {"max_model_len": s.max_model_len}


@get("/models/{model_id:path}", summary="One model (or LoRA adapter), with its status")
async def retrieve_model(model_id: FromPath[str], request: Request, state: State) -> dict:
    return model_cards.card(request, model_cards.one_model(_model_cards(state)["data"],
                                                           model_id))


def _rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _replica_row(r: Replica) -> dict:
    return {"replica": r.id, "role": r.role, "status": r.status, "pid": r.pid, "url": r.url,
            "gpu": r.gpu,
            "rss_mib": _rss_mib(r.pid) if r.pid else None, "in_flight": r.in_flight,
            "load": r.load_total, "kv_usage": round(r.kv_usage, 3),
            "hit_ratio": None if r.hit_ratio is None else round(r.hit_ratio, 3),
            "ttft_p50": r.ttft_p50, "restarts": r.restarts, "error": r.error}


def _autoscale_status(s: ModelState) -> dict | None:
    """The autoscaler's bounds, target and decisions: one pool's fields for a model without
    PD; for a PD model, a mapping of each scaled role to its own."""
    pools = {pool: {"min": c.min_replicas, "max": c.max_replicas,
                    "target_ongoing": c.target_ongoing, "up": s.scaled[pool, "up"],
                    "down": s.scaled[pool, "down"]} for pool, c in s.spec.scaled_pools}
    if not pools:
        return None
    return pools["both"] if "both" in pools else pools


@get("/models", summary="Models and their replicas in detail (justllm ps)")
async def models_status(state: State) -> dict:
    sup = _supervisor(state)
    now = time.monotonic()
    rows = []
    for s in sup.models.values():
        first = next((r for r in s.local if r.pid), None)
        idle = now - s.last_used if s.status == "loaded" and s.active == 0 else 0.0
        rows.append({
            "model": s.spec.name, "aliases": list(s.spec.aliases), "status": s.status,
            "source": s.spec.source, "pid": first.pid if first else None,
            "url": first.url if first else None,
            "rss_mib": _rss_mib(first.pid) if first and first.pid else None,
            "active": s.active, "idle_seconds": round(idle, 1),
            "unload_in": (round(max(0.0, s.ttl - idle), 1)
                          if s.status == "loaded" and s.ttl >= 0 and s.active == 0 else None),
            "ttl": s.ttl, "error": s.error, "loads": s.loads, "restarts": s.restarts,
            "estimate_mib": round(s.memory / 2**20) if s.memory else None,
            "log": str(sup.log_dir / log_name(s.spec.name)),
            # (a PD model's policy places its prompts; its decode replicas go by load)
            "routing": s.spec.routing.policy,
            "decisions": dict((s.prefill_router if s.spec.pd else s.router).counts),
            "lora": list(s.adapters),
            "autoscale": _autoscale_status(s),
            "pd": None if not s.spec.pd else {
                "transfers": s.pd_transfers, "bytes": s.pd_bytes,
                "prefill_seconds": round(s.pd_seconds, 3),
                "short_prompts": s.pd_short_prompts, "aborted": s.pd_aborted,
                "fallbacks": dict(s.pd_fallbacks), "decode_decisions": dict(s.router.counts)},
            "replicas": [_replica_row(r) for r in s.replicas]})
    return {"object": "list", "data": rows, "waiting_for_load": sup.waiting,
            "max_loaded": sup.config.max_loaded,
            "max_memory_mib": round(sup.config.max_memory / 2**20) or None}


class _ModelRef(msgspec.Struct, forbid_unknown_fields=True):
    model: str


@post("/models/load", status_code=200, summary="Load a model now")
async def load_model(request: Request, state: State) -> dict:
    sup = _supervisor(state)
    ref = msgspec.json.decode(await request.body(), type=_ModelRef)
    target = _model(sup, ref.model)
    try:
        await sup.load(target)
    except ModelUnavailable as e:
        raise _unavailable(e) from None
    return {"model": target.spec.name, "status": target.status}


@post("/models/unload", status_code=200, summary="Unload a model now")
async def unload_model(request: Request, state: State) -> dict:
    sup = _supervisor(state)
    ref = msgspec.json.decode(await request.body(), type=_ModelRef)
    target = _model(sup, ref.model)
    await sup.unload(target)
    return {"model": target.spec.name, "status": target.status}


@get(["/health", "/v1/health"], summary="200 while the gateway is up")
async def health() -> dict:
    return {"status": "ok"}


@head(["/health", "/v1/health"], summary="200 while the gateway is up (headers only)",
      media_type="application/json")
async def health_head() -> None:
    return None


@get("/metrics", summary="Prometheus metrics of the gateway and every loaded runner",
     media_type="text/plain; version=0.0.4")
async def metrics(state: State) -> Response:
    body = await render_metrics(_supervisor(state), state["http"])
    return Response(body, media_type="text/plain; version=0.0.4")


def plugin_forwarders(handlers: Sequence[Any], taken: set[str]) -> list[Any]:
    """A gateway route for each POST route plugins add to ``justllm serve`` (``register_routes``;
    the runners have them): the JSON body's ``model`` picks the runner, as for
    /v1/completions, and the runner's answer comes back as it is. Routes of other methods have
    no body to route by and stay the runners' own; a path the gateway has (``taken``) is its."""
    out = []
    for handler in handlers:
        if "POST" not in getattr(handler, "http_methods", ()):
            continue
        for path in sorted(getattr(handler, "paths", ())):
            if path not in taken:
                taken.add(path)
                out.append(_forwarder(path))
    return out


def _forwarder(path: str) -> Any:
    async def plugin_route(request: Request) -> Any:
        return await _forward(request, request.url.path)  # path parameters filled in

    return post(path, status_code=200, summary="A plugin's route, routed by model",
                name=f"plugin:{path}", guards=[require_api_key])(plugin_route)


def create_gateway(config: GatewayConfig, settings: GatewaySettings, log_dir: Path,
                   plugin_routes: Sequence[Any] = ()) -> Litestar:
    """``plugin_routes``: the route handlers plugins add to runners (``Plugins.routes()``),
    forwarded by model (:func:`plugin_forwarders`)."""
    state = State({"config": settings, "gateway": config, "started": time.time()})

    async def start(app: Litestar) -> None:
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per proxied request
        sup = Supervisor(config, log_dir, settings.shutdown_timeout)
        app.state["http"] = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10),
                                              trust_env=False, auth=sup.runner_auth,
                                              limits=httpx.Limits(
                                                  max_connections=None,
                                                  max_keepalive_connections=64,
                                                  keepalive_expiry=RUNNER_KEEPALIVE_EXPIRY))
        app.state["supervisor"] = sup
        sup.start()

    async def stop(app: Litestar) -> None:
        await app.state["supervisor"].close()
        await app.state["http"].aclose()

    v1 = Router(path="/v1", route_handlers=[chat_completions, completions, embeddings,
                                            list_models, retrieve_model, anthropic_messages,
                                            anthropic_count_tokens, responses,
                                            responses_input_tokens,
                                            *lora.ROUTES],
                guards=[require_api_key])
    admin = Router(path="/", route_handlers=[models_status, load_model, unload_model,
                                             tokenize, detokenize, props, slots,
                                             slot_action, apply_template,
                                             llama_completion, llama_infill, llama_embedding,
                                             rerank,
                                             chat_completions, responses,
                                             responses_input_tokens],
                   guards=[require_api_key])
    api = Router(path="/api", route_handlers=[
        ollama_chat, ollama_generate, ollama_embed, ollama_embeddings, ollama_show, ollama_tags,
        ollama_ps, ollama_version, ollama_head], guards=[require_api_key],
        exception_handlers={Exception: ollama_error})
    own: list[Any] = [v1, admin, api, ollama_root, ollama_root_head, health, health_head,
                      metrics]
    taken = {path for handler in own for path in (
        [route.path for route in handler.routes] if isinstance(handler, Router)
        else handler.paths)}
    forwarders = plugin_forwarders(plugin_routes, taken)
    return Litestar(route_handlers=[*own, *forwarders], state=state,
                    guards=[refuse_other_sites], cors_config=cors_config(),
                    on_startup=[start], on_shutdown=[stop],
                    exception_handlers={Exception: handle_exception},
                    before_send=[add_request_id],
                    request_max_body_size=settings.max_body_bytes, debug=False)


def default_log_dir() -> Path:
    """Where each model's runner log goes (``justllm logs MODEL`` reads it)."""
    return log_dir()


def all_runners_stopped(app: Litestar, wait: bool = True) -> None:
    """After the event loop ended (or on an unexpected exit): nothing may outlive us. From a
    signal handler (a second Ctrl-C), ``wait=False``."""
    sup = app.state.get("supervisor")
    if sup is not None:
        sup.kill_all(wait)

