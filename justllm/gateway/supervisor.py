"""The runners of every model: started on demand, unloaded when idle (ttl, keep_alive) or to
make room (max-loaded, least recently used first), restarted with backoff when they die, and
reported failed when they keep failing to start. A model is a set of replicas (local runner
processes and remote ``justllm serve``s): each request goes to the one its routing policy picks,
a replica that dies leaves the rotation at once and is restarted, every replica's ``/metrics``
is polled for its load, and the autoscaler grows and shrinks the local ones. Lives on the
gateway's event loop; the decisions are ``policy``'s, ``routing``'s and ``autoscale``'s."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import time
from collections import Counter
from collections.abc import Generator
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx

from justllm.errors import JustLLMError
from justllm.gateway import autoscale, policy
from justllm.gateway.config import GatewayConfig, ModelSpec
from justllm.gateway.lora import apply_runtime_lora, catch_up_lora
from justllm.gateway.memory import runner_memory
from justllm.gateway.replica import Replica
from justllm.gateway.routing import (
    Router,
    RouteRequest,
    RoutingConfig,
    fallback_router,
    make_router,
)
from justllm.gateway.runner import RunnerProcess
from justllm.models.gguf import read_gguf_header
from justllm.models.hub import is_local_path
from justllm.models.source import model_not_found
from justllm.server.config import RUNNER_KEEPALIVE_EXPIRY
from justllm.tui.metrics import parse as parse_metrics

log = logging.getLogger(__name__)


class ModelUnavailable(JustLLMError):
    """A model could not be loaded (now): 503 with the reason."""

    def __init__(self, message: str, *, code: str = "model_unavailable") -> None:
        super().__init__(message)
        self.code = code


@dataclass
class ModelState:
    spec: ModelSpec
    status: str = "unloaded"  # loading, loaded, failed
    replicas: list[Replica] = field(default_factory=list)  # remote ones, and local while loaded
    router: Router = field(init=False)  # for "both" replicas, or PD's decode replicas
    prefill_router: Router = field(init=False)  # PD's prefill replicas (cache-aware)
    active: int = 0
    last_used: float = field(default_factory=time.monotonic)
    keep_alive: float | None = None  # the last request's keep_alive, overriding the ttl
    failures: int = 0  # consecutive failed starts
    error: str | None = None
    loads: int = 0
    restarts: int = 0
    unloads: int = 0  # its runners stopped (idle, room, a request, scaled down)
    max_model_len: int | None = None  # a request's tokens on its runners, once one has said
    # by replica id, over every load (a replica's own count starts again with each load:
    # its counter series went backwards)
    replica_restarts: Counter[str] = field(default_factory=Counter)
    load_seconds: list[float] = field(default_factory=list)
    memory: int = 0  # estimated bytes of one local runner (only with max-memory)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # The load in progress, shared by the requests that wait for it: one that stops waiting
    # (load-timeout, a disconnect) leaves it running, so a slow model still loads.
    load_task: asyncio.Future[None] | None = None
    waiters: int = 0  # clients waiting for its load (others make way only while there are)
    detached: int = 0  # unloads so far: a start that sees this change was unloaded meanwhile
    # The autoscaler, per pool of local replicas (the role: "both" without PD): the wish it
    # is waiting on, and its decisions by (pool, direction).
    scale_pending: dict[str, autoscale.Pending] = field(default_factory=dict)
    scaled: Counter[tuple[str, str]] = field(default_factory=Counter)
    # by pool, the count it wanted and max-memory had no room for (said once, not at each
    # decision: with upscale-delay 0 that was four warnings a second)
    no_room: dict[str, int] = field(default_factory=dict)

    pd_transfers: int = 0  # requests whose prompt a prefill replica computed
    pd_bytes: int = 0
    pd_seconds: float = 0.0  # prefill + transfer through the gateway, summed
    pd_short_prompts: int = 0  # prompts under prefill-min-tokens, computed on a decode replica
    pd_fallbacks: Counter[str] = field(default_factory=Counter)  # served whole, by reason
    pd_aborted: int = 0  # clients that left while their prompt was prefilled
    # PD requests from their prefill until their decode replica took them: an unload (or a
    # shutdown) stops the model's runners only once they are handed over (or the drain is
    # up), to the decode replicas it took out of the rotation (``leaving``).
    handing_over: int = 0
    leaving: list[Replica] = field(default_factory=list)
    # LoRA adapters loaded at run time through the gateway (gateway/lora.py): name -> the
    # body each replica is sent, again whenever one starts.
    runtime_lora: dict[str, bytes] = field(default_factory=dict)
    # Replicas out of the rotation (unhealthy) while adapters were loaded or unloaded at run
    # time: replica id -> those names, applied before the replica is back (catch_up_lora).
    lora_missed: dict[str, set[str]] = field(default_factory=dict)
    # Runtime adapters a replica could not load when it started or came back (its file gone
    # since): name -> those replicas' ids, which requests for the adapter skip.
    lora_absent: dict[str, set[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        routing = self.spec.routing
        # PD: the prompt goes where its prefix is cached; generation where there is room.
        self.router = self._router(replace(routing, policy="least-load", policy_class=None)
                                   if self.spec.pd else routing)
        self.prefill_router = self._router(routing)
        self.replicas = [Replica(url, remote=url, status="ready", role=role)
                         for url, role in zip(self.spec.urls, self.spec.url_roles)]
        if self.remote_only:  # nothing to load here: in service while a replica answers
            self.status = "loaded"

    def _router(self, routing: RoutingConfig) -> Router:
        """The model's routing policy; a plugin's whose constructor raises is replaced by the
        least loaded replica (reason ``policy-failed``, as when its ``pick`` fails), with a
        warning: one bad plugin does not take every model down at start-up."""
        try:
            return make_router(routing)
        except Exception as e:
            if routing.policy_class is None:  # a built-in policy's bug: not a plugin's
                raise
            log.warning("model %s: routing policy %s could not be made (%s: %s); the least "
                        "loaded replica serves each request (reason policy-failed)",
                        self.spec.name, routing.policy, type(e).__name__, e)
            return fallback_router(routing)

    @property
    def adapters(self) -> tuple[str, ...]:
        """The model's LoRA adapter names: from models.yaml, then those loaded at run time."""
        return (*self.spec.adapters, *self.runtime_lora)

    def has_adapter(self, name: object) -> bool:
        """``name`` is one of the model's LoRA adapters: the runner's own name for it, passed
        on as the request's ``model``."""
        return name in self.adapters

    @property
    def remote_only(self) -> bool:
        return self.spec.remote_only

    @property
    def pinned(self) -> bool:
        """ModelSpec.pinned (and no ``keep_alive`` overrides it)."""
        return self.spec.pinned

    @property
    def local(self) -> list[Replica]:
        return [r for r in self.replicas if r.local]

    def pool(self, role: str) -> list[Replica]:
        """The local replicas of one autoscaled pool (``ModelSpec.scaled_pools``)."""
        return [r for r in self.local if r.role == role]

    def scaling(self, role: str) -> list[Replica]:
        """The replicas of a pool the autoscaler counts, and whose load it decides on: serving
        or starting (not those retired and draining, nor failed ones)."""
        return [r for r in self.pool(role) if r.status not in ("stopping", "failed")]

    @property
    def routable(self) -> list[Replica]:
        return [r for r in self.replicas if r.routable] if self.status == "loaded" else []

    @staticmethod
    def serves(replica: Replica, role: str) -> bool:
        """``replica`` can take ``role``'s part of a request ("prefill" or "decode"; a model
        without PD has only "both" replicas, which take either)."""
        return replica.role in (role, "both")

    def routable_for(self, role: str) -> list[Replica]:
        """Replicas in the rotation that can take ``role``'s part of a request."""
        return [r for r in self.routable if self.serves(r, role)]

    @property
    def died(self) -> list[Replica]:
        """Local replicas in the rotation whose process has exited."""
        return [r for r in self.local if r.status in ("ready", "unhealthy") and not r.alive()]

    @property
    def ttl(self) -> float:
        if self.remote_only:
            return -1.0
        return self.keep_alive if self.keep_alive is not None else self.spec.ttl

    def view(self) -> policy.Loaded:
        """The model as the policies see it; while it loads, with every replica it is about
        to start (they exist only once their start begins: two multi-replica models loading
        at once were each counted as one runner, and both fitted under max-memory). A failed
        replica's process is gone: it holds no memory. A model never unloaded (min-replicas
        >= 1) is busy: never a victim of max-loaded or max-memory."""
        runners = len([r for r in self.local if r.status != "failed"])
        if self.status == "loading":
            runners = max(runners, self.spec.replicas)
        return policy.Loaded(self.spec.name, max(self.active, 1) if self.pinned else self.active,
                             self.last_used, self.ttl, self.memory * max(1, runners))

    def replica(self, rid: str) -> Replica:
        return next(r for r in self.replicas if r.id == rid)


class Supervisor:
    def __init__(self, config: GatewayConfig, log_dir: Path, drain: float = 5.0) -> None:
        self.config = config
        self.log_dir = log_dir
        self.drain = drain  # seconds a stopping runner lets its requests run (--shutdown-timeout)
        self.models = {m.name: ModelState(m) for m in config.models}
        self.waiting = 0  # requests waiting for a load
        self._room = asyncio.Condition()
        # The loaded models each load waiting for room would unload were they idle (by the
        # loading model's name): new requests for them wait while such a load waits, so a
        # model's steady traffic cannot keep another's load waiting (Ollama's order).
        self._making_way: dict[str, set[str]] = {}
        # Runners ask every client for this key (the runner's --api-key, in its environment):
        # a runner's port is open to every user of the machine, and the gateway's own key, if
        # any, must not be bypassed there. RunnerAuth sends it, to local runners only.
        self.runner_key = secrets.token_urlsafe(24)
        self.runner_auth = RunnerAuth(self)
        # (its polls and LoRA calls: idle connections let go before a runner's, as the
        # gateway's own client does; a poll on one being closed failed the replica)
        self._http = httpx.AsyncClient(trust_env=False, auth=self.runner_auth,
                                       limits=httpx.Limits(
                                           max_connections=100, max_keepalive_connections=20,
                                           keepalive_expiry=RUNNER_KEEPALIVE_EXPIRY))
        self._tasks: list[asyncio.Task] = []
        self._closing = False
        self._closed: asyncio.Future[None] | None = None
        # Every runner started and maybe still running, replica or not: what kill_all kills
        # (an unload takes a runner off its model before it has stopped).
        self._started: list[RunnerProcess] = []
        # Runners stopping (unloaded, evicted, scaled down) and the model each served: they
        # hold their place under max-loaded and max-memory until they exit (a model unloaded
        # mid-request drains for up to --shutdown-timeout, and a new one started beside it).
        self._stopping: dict[RunnerProcess, ModelState] = {}
        self._stops: set[asyncio.Future[None]] = set()  # the stops of those (``_stop``)
        # Runners that size their KV pool from a GPU's free memory start one at a time per GPU
        # (policy.start_key).
        self._gpu_starts: dict[str, asyncio.Lock] = {}
        # One run-time LoRA load or unload at a time (gateway/lora.py): an unload during a
        # load that then failed raised a KeyError, and one that raced a load's sends left
        # the adapter on replicas the gateway had forgotten it on.
        self.lora_lock = asyncio.Lock()

    # ---- requests --------------------------------------------------------------------------

    def resolve(self, name: str | None) -> ModelState | None:
        if name is None:
            return next(iter(self.models.values())) if len(self.models) == 1 else None
        model = self.config.names.get(name)
        if model is not None:
            return self.models[model]
        return next((s for s in self.models.values() if name in s.runtime_lora), None)

    @property
    def http(self) -> httpx.AsyncClient:
        """The client the supervisor talks to its replicas with."""
        return self._http

    def end(self, state: ModelState, keep_alive: float | None = None) -> None:
        """A request on ``state`` ended; ``keep_alive`` (Ollama's) overrides the model's ttl
        from now on (0: unload once idle)."""
        state.active -= 1
        state.last_used = time.monotonic()
        if keep_alive is not None and not state.remote_only and not state.pinned:
            state.keep_alive = keep_alive
        if state.active == 0 and state.ttl == 0:
            self._unload_soon(state)
        asyncio.ensure_future(self._notify_room())

    async def _notify_room(self) -> None:
        async with self._room:
            self._room.notify_all()

    async def acquire(self, state: ModelState, *, client: bool = True) -> None:
        """The model loaded (first if need be) with a replica in the rotation, and one more
        request counted on it from now on (so it is never unloaded to make room while the
        request waits): pair each successful call with ``end``. ``client`` False: a preload,
        neither counted as a request waiting for a load nor held to max-waiting. A request
        for a model that makes way for another's load waits (uncounted: the model must go
        idle) until that load has its place."""
        if client and self._makes_way(state):
            await self._until_way_made(state)
        state.active += 1
        try:
            if state.routable:
                return
            if state.status == "loaded":  # every replica is restarting or unhealthy
                await self.wait_routable(state)
                return
            if client and self.waiting >= self.config.max_waiting:
                raise ModelUnavailable(f"{self.waiting} requests are already waiting for "
                                       "models to load; retry later", code="too_many_waiting")
            self.waiting += client
            state.waiters += client
            try:
                if state.load_task is None or state.load_task.done():
                    state.load_task = asyncio.ensure_future(self._load(state))
                    state.load_task.add_done_callback(_retrieve)
                await asyncio.wait_for(asyncio.shield(state.load_task), self.config.load_timeout)
            except TimeoutError:
                raise ModelUnavailable(f"model '{state.spec.name}' did not load within "
                                       f"{self.config.load_timeout:g} s",
                                       code="model_loading") from None
            finally:
                self.waiting -= client
                state.waiters -= client
        except BaseException:
            state.active -= 1
            # (a load waiting for room may evict this model now: it went idle without a
            # request ending on it, which is what woke such loads)
            asyncio.ensure_future(self._notify_room())
            raise

    def _makes_way(self, state: ModelState) -> bool:
        """Whether a load a client waits for waits for ``state`` to go idle (a load that no
        client waits for any more, or a preload, holds nobody back)."""
        return any(state.spec.name in names and self.models[loading].waiters > 0
                   for loading, names in self._making_way.items())

    async def _until_way_made(self, state: ModelState) -> None:
        """Until no load waits for ``state`` to go idle and unload, at most load-timeout."""
        deadline = time.monotonic() + self.config.load_timeout
        async with self._room:
            while self._makes_way(state) and not self._closing:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ModelUnavailable(f"model '{state.spec.name}' is making way for "
                                           "another model's load; retry later",
                                           code="model_loading")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._room.wait(), left)

    def _would_unload(self, state: ModelState) -> set[str]:
        """The loaded models ``state``'s load would unload were they idle (not a pinned one,
        nor one loading or stopping)."""
        def idle(view: policy.Loaded) -> policy.Loaded:
            other = self.models.get(view.name)
            movable = other is not None and other.status == "loaded" and not other.pinned
            return replace(view, active=0) if movable else view

        return set(self._victims(state, [idle(v) for v in self._places(besides=state)]) or ())

    def _victims(self, state: ModelState, places: list[policy.Loaded]) -> list[str] | None:
        """What ``policy.to_unload_for`` unloads among ``places`` for ``state``'s load."""
        return policy.to_unload_for(places, self.config.max_loaded,
                                    max_memory=self.config.max_memory,
                                    need=state.memory * state.spec.replicas)

    async def wait_routable(self, state: ModelState, role: str = "decode") -> None:
        """Until one of a loaded model's replicas for ``role`` is back in the rotation
        (restarted, or answering polls again), at most load-timeout."""
        deadline = time.monotonic() + self.config.load_timeout
        while not state.routable_for(role):
            if self._closing:
                raise ModelUnavailable("the server is shutting down", code="shutting_down")
            if state.status == "unloaded":  # (unloaded while the request waited)
                raise ModelUnavailable(f"model '{state.spec.name}' was unloaded while the "
                                       "request waited for it; retry to load it again",
                                       code="model_unloaded")
            if state.status != "loaded" or (state.local and not state.remote_only and all(
                    r.status == "failed" for r in state.local)):
                raise ModelUnavailable(f"model '{state.spec.name}' has no replica that can "
                                       f"serve: {state.error or 'all failed'}",
                                       code="model_failed")
            down = state.remote_only and all(r.status == "unhealthy" for r in state.replicas)
            if time.monotonic() > deadline or self._closing or down:
                # (servers elsewhere that do not answer: no restart here to wait for)
                why = f": {state.replicas[0].error}" if down and state.replicas[0].error else ""
                raise ModelUnavailable(f"no replica of model '{state.spec.name}' is healthy"
                                       f"{why}", code="no_healthy_replica")
            await asyncio.sleep(0.05)

    def route(self, state: ModelState, request: RouteRequest, skip: set[str],
              role: str = "decode") -> Replica:
        """The replica the model's policy picks for ``request`` among those in the rotation
        of ``role`` (a PD model's "prefill" or "decode" replicas; otherwise all) and not in
        ``skip`` (they refused it), counted in flight: pair with ``done``. Raises
        routing.NoReplica when there is none."""
        loads = [r.load(skip=r.id in skip) for r in state.replicas if state.serves(r, role)]
        router = state.prefill_router if role == "prefill" else state.router
        replica = state.replica(router.choose(request, loads).replica)
        replica.in_flight += 1
        return replica

    @staticmethod
    def done(replica: Replica) -> None:
        replica.in_flight -= 1

    def replica_failed(self, state: ModelState, replica: Replica, error: str) -> None:
        """A request could not reach ``replica`` (refused connection, or it closed without an
        answer): out of the rotation at once; a local one is restarted, a remote one returns
        when its polls succeed again."""
        if replica.status not in ("ready", "unhealthy"):
            return
        replica.error = error
        self._forget(state, replica)
        if replica.local:
            self._restart_failed(state, replica, f"failed a request ({error})")
        else:
            replica.status = "unhealthy"

    def _restart_failed(self, state: ModelState, replica: Replica, why: str) -> None:
        """A local replica that failed (a request, its process, its polls): counted, logged
        with ``why``, restarted."""
        _count_restart(state, replica, why)
        self._restart(state, replica)

    # ---- loading and unloading -------------------------------------------------------------

    async def _load(self, state: ModelState) -> None:
        async with state.lock:
            if state.routable:
                return
            if state.status == "failed" and policy.restart_delay(state.failures) is None:
                raise ModelUnavailable(f"model '{state.spec.name}' failed to load: "
                                       f"{state.error}", code="model_failed")
            # A new load starts with the model's ttl; an Ollama keep_alive sent while it loads
            # (0: unload once idle) holds after it, as the last keep_alive does in Ollama.
            state.keep_alive = None
            # An unload from here on abandons this load, even one made while it waits for
            # room (it used to be seen only once the runners started, and a model unloaded
            # while an eviction drained then started beside the next one, past the limits).
            detached = state.detached
            try:
                await self._estimate(state)
                await self._make_room(state, detached)
                await self._start(state, detached)
            finally:  # loaded (idle once its waiters left) or not: another load may fit now
                asyncio.ensure_future(self._notify_room())

    async def _estimate(self, state: ModelState) -> None:
        """With max-memory: the runner's estimated memory, once (a model that can never fit
        is refused at once rather than waited for). Without it, a source that is a file here
        has its GGUF header read: a file its runner would refuse fails its model before an
        idle one is evicted for it (a broken model unloaded a working one under max-loaded,
        at every retry)."""
        limit = self.config.max_memory
        try:
            if not limit:
                await asyncio.to_thread(_check_local_file, state.spec.source)
                return
            if not state.memory:
                state.memory = await asyncio.to_thread(runner_memory, state.spec,
                                                     self.config.model_sources)
        except (JustLLMError, OSError, ValueError) as e:
            state.status, state.error = "failed", str(e)
            state.failures = policy.MAX_FAILURES
            raise ModelUnavailable(f"model '{state.spec.name}' failed to load: {e}",
                                   code="model_failed") from None
        need = state.memory * state.spec.replicas
        if need > limit:
            raise ModelUnavailable(
                f"model '{state.spec.name}' needs about {need / 2**30:.2f} GiB "
                f"({state.spec.replicas} x weights, KV pool and logits), more than max-memory "
                f"({limit / 2**30:.2f} GiB): lower its pool-blocks or replicas, or raise "
                "max-memory", code="model_too_large")

    async def _make_room(self, state: ModelState, detached: int) -> None:
        """Claim a place under max-loaded: decided and marked (this model loading, the victims
        unloaded) without yielding to another load, so two loads never claim one place. An
        unload while it waits abandons the load."""
        async with self._room:
            try:
                while True:
                    if self._closing:
                        raise ModelUnavailable("the server is shutting down",
                                               code="shutting_down")
                    if state.detached != detached:
                        raise _unloaded_meanwhile(state)
                    victims = self._victims(state, self._places(besides=state))
                    if victims is not None:
                        break
                    # every model is busy: wait for one to go idle, new requests for the
                    # ones to unload held back meanwhile (_until_way_made)
                    way = self._would_unload(state)
                    if self._making_way.get(state.spec.name) != way:
                        self._making_way[state.spec.name] = way
                        self._room.notify_all()  # (those no longer making way go on)
                    await self._room.wait()
            finally:
                if self._making_way.pop(state.spec.name, None) is not None:
                    self._room.notify_all()
            state.status = "loading"
            stopping = [r for name in victims for r in self._detach(self.models[name])]
        if not stopping:
            return
        stop = self._stop(stopping)  # the victims drain; an unload of this model ends the wait
        while not stop.done():
            if state.detached != detached:
                raise _unloaded_meanwhile(state)
            await asyncio.wait({stop}, timeout=0.1)

    @staticmethod
    def _forget(state: ModelState, replica: Replica) -> None:
        """The replica's cache is gone (or it left): no router may count on it."""
        state.router.forget_replica(replica.id)
        state.prefill_router.forget_replica(replica.id)

    def _new_replica(self, state: ModelState, role: str | None = None) -> Replica:
        """A local replica: the ``role`` given (the autoscaler's pool, and the GPU no serving
        replica fills: ``policy.gpu_for_new``), else the spec's role and GPU for its index."""
        # The least id no replica of the model holds (a draining one too): ids that only
        # grew gave each scale-up a new log file (MODEL@7.log, ...) and a new value of every
        # series' replica label, without end; a reused id is as a restart of that replica.
        held = {r.id for r in state.replicas} | {  # (and a retired one still stopping:
            runner.replica for runner, s in self._stopping.items() if s is state}  # its log)
        rid = str(next(i for i in itertools.count() if str(i) not in held))
        gpu = state.spec.gpu_of(int(rid))
        if role is not None and state.spec.gpus:  # (by the GPUs serving replicas fill)
            gpu = policy.gpu_for_new(state.spec.gpus, [
                r.gpu for r in state.local if r.gpu is not None
                and r.status not in ("stopping", "failed")])
        replica = Replica(rid, gpu=gpu, role=role or state.spec.role_of(int(rid)))
        state.replicas.append(replica)
        return replica

    def _spawn(self, state: ModelState, replica: Replica) -> RunnerProcess:
        replica.reset()
        state.lora_missed.pop(replica.id, None)  # a new process gets the whole set at start
        replica.status = "starting"
        replica.runner = RunnerProcess(state.spec, self.log_dir, self.drain, replica.id,
                                       replica.gpu, replica.role, api_key=self.runner_key)
        self._started = [r for r in self._started if r.alive()] + [replica.runner]
        return replica.runner

    async def _spawn_ready(self, state: ModelState, replica: Replica) -> RunnerProcess:
        """Start the replica's runner and wait until it answers (raises as ``wait_ready``);
        after any other runner sizing its pool from the same GPU has started. Before it takes
        requests it loads the LoRA adapters loaded at run time through the gateway."""
        key = policy.start_key(dict(state.spec.flags), replica.gpu)
        lock = self._gpu_starts.setdefault(key, asyncio.Lock()) if key else None
        async with lock or contextlib.nullcontext():
            runner = self._spawn(state, replica)
            await runner.wait_ready(self._http, policy.start_limit(self.config.load_timeout))
        await apply_runtime_lora(self._http, state, runner.url, replica.id)
        if state.max_model_len is None:
            state.max_model_len = await self._context_of(runner.url)
        return runner

    async def _context_of(self, url: str) -> int | None:
        """The tokens one request holds on the runner at ``url``, as its /v1/models card says
        (the gateway's cards say it too: ``justllm chat --url`` fits its answers to it);
        None when it does not answer it."""
        try:
            r = await self._http.get(f"{url}/v1/models", timeout=10)
            value = r.json()["data"][0]["max_model_len"] if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, LookupError, TypeError):
            return None
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    async def _start(self, state: ModelState, detached: int) -> None:
        """Start the model's first replicas together; loaded once at least one answers (the
        others are retried with backoff), failed after MAX_FAILURES rounds with none; given up
        when the model is unloaded meanwhile (``state.detached`` no longer ``detached``)."""
        while True:
            if self._closing:  # shutting down: no new runners (close() stops the others)
                state.status = "unloaded"
                raise ModelUnavailable("the server is shutting down", code="shutting_down")
            delay = policy.restart_delay(state.failures)
            if delay is None:
                state.status = "failed"
                raise ModelUnavailable(f"model '{state.spec.name}' failed to load: "
                                       f"{state.error}", code="model_failed")
            await asyncio.sleep(delay)
            if state.detached != detached:
                raise _unloaded_meanwhile(state)
            state.status = "loading"
            t0 = time.monotonic()
            starting = [self._new_replica(state) for _ in range(state.spec.replicas)]
            try:
                results = await asyncio.gather(
                    *(self._spawn_ready(state, r) for r in starting), return_exceptions=True)
            except BaseException:
                for r in starting:
                    self._drop_replica(state, r)
                state.status = "unloaded"
                raise
            if state.detached != detached:  # unloaded (or shutting down) while it started
                for r in starting:
                    self._drop_replica(state, r)
                if self._closing:
                    raise ModelUnavailable("the server is shutting down", code="shutting_down")
                raise _unloaded_meanwhile(state)
            for r, result in zip(starting, results):
                if isinstance(result, BaseException):
                    r.error, r.failures = str(result), 1
            if all(r.error for r in starting):
                state.failures += 1
                state.error = starting[0].error
                state.status = "failed"
                for r in starting:
                    self._drop_replica(state, r)
                log.warning("model %s failed to start (%d): %s", state.spec.name,
                            state.failures, state.error)
                continue
            for r in starting:
                if r.error:  # its runner gave up: retried in the background
                    self._restart(state, r)
                else:
                    r.status = "ready"
            state.status = "loaded"
            state.failures = 0
            state.error = None
            state.loads += 1
            state.load_seconds.append(time.monotonic() - t0)
            state.last_used = time.monotonic()
            state.scale_pending.clear()
            return

    @staticmethod
    def _drop_replica(state: ModelState, replica: Replica) -> None:
        """A replica that never served: forgotten, its process killed."""
        if replica in state.replicas:  # an unload may have taken it out already
            state.replicas.remove(replica)
        Supervisor._forget(state, replica)
        if replica.runner is not None:
            replica.runner.kill_now()

    def runs_local(self, origin: str) -> bool:
        """Whether ``origin`` (``http://HOST:PORT``) is one of this supervisor's runners,
        a stopping one too (it serves what it was handed: a PD hand-over after an unload)."""
        return any(r.runner is not None and r.runner.url == origin
                   for s in self.models.values() for r in s.local) or any(
            runner.url == origin for runner in self._stopping)

    def _places(self, besides: ModelState | None = None) -> list[policy.Loaded]:
        """What holds places under max-loaded and max-memory, as the policies see it: the
        models loaded or loading here (but ``besides``), and the runners still stopping as
        busy models (never victims), one per model with their memory."""
        held = [s.view() for s in self.models.values() if s is not besides
                and not s.remote_only and s.status in ("loaded", "loading")]
        counts = Counter(state.spec.name for state in self._stopping.values())
        return held + [policy.Loaded(f"{name} (stopping)", 1, 0.0, -1.0,
                                     self.models[name].memory * n)
                       for name, n in counts.items()]

    def memory_used(self) -> int:
        """max-memory's view: the estimates of the runners loaded, loading and stopping."""
        return sum(place.memory for place in self._places())

    def _detach(self, state: ModelState) -> list[RunnerProcess]:
        """Mark the model unloaded at once, its local replicas gone; the caller stops the
        runners returned (they hold their place until they exit)."""
        runners = [r.runner for r in state.local if r.runner is not None]
        self._stopping.update((runner, state) for runner in runners)
        state.detached += 1
        if state.spec.pd:  # (the only requests that reach a replica after an unload)
            state.leaving += [r for r in state.local
                              if r.role == "decode" and r.runner is not None]
        for r in state.local:
            r.status = "stopping"
            self._forget(state, r)
        state.replicas = [r for r in state.replicas if not r.local]
        state.lora_absent.clear()  # (the next load's replicas load every adapter again)
        if state.remote_only:
            return runners
        if state.status != "failed":
            state.status = "unloaded"
        state.keep_alive = None
        if state.load_task is not None and not state.load_task.done():
            # its load may be waiting for room: it gives up now (_make_room)
            asyncio.ensure_future(self._notify_room())
        return runners

    def _stop(self, runners: list[RunnerProcess]) -> asyncio.Future[None]:
        """Stop ``runners`` (registered in ``_stopping``), each given its drain, on a task of
        the supervisor's own: a caller that stops waiting (a client gone from POST
        /models/unload) leaves the stop going, so their places always free when they exit."""
        async def stop() -> None:
            try:
                await self._handed_over([s for s in self.models.values()
                                         if any(r.runner in runners for r in s.leaving)])
                await asyncio.gather(*(r.stop(grace=self.drain + 5) for r in runners))
            finally:
                for runner in runners:
                    state = self._stopping.pop(runner, None)
                    if state is not None:
                        state.unloads += 1
                        state.leaving = [r for r in state.leaving if r.runner not in runners
                                         and r.runner is not None and r.runner.alive()]
                await self._notify_room()
        task = asyncio.ensure_future(stop())
        self._stops.add(task)
        task.add_done_callback(self._stops.discard)
        task.add_done_callback(_retrieve)
        return task

    async def _handed_over(self, states: list[ModelState]) -> None:
        """Until no PD request of ``states`` is between its prefill and its decode replica
        (at most the drain): a runner stopped now would refuse the hand-over, and the
        request, accepted before the unload, failed (a prompt's prefill takes seconds)."""
        deadline = time.monotonic() + self.drain
        while any(s.handing_over for s in states) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def leaving_decoder(self, state: ModelState, skip: set[str]) -> Replica | None:
        """For a PD request whose prompt was computed before an unload took the model's
        decode replicas out of the rotation: the least busy of them whose runner still runs
        (not stopped until it is handed over), counted in flight (pair with ``done``)."""
        alive = [r for r in state.leaving if r.id not in skip
                 and r.runner is not None and r.runner.alive()]
        if not alive:
            return None
        replica = min(alive, key=lambda r: r.in_flight)
        replica.in_flight += 1
        return replica

    async def _stop_all(self, runners: list[RunnerProcess]) -> None:
        if runners:
            await asyncio.shield(self._stop(runners))

    def _unload_soon(self, state: ModelState) -> None:
        """``unload`` without waiting for the runners to stop: the model is unloaded now,
        their places free when they exit (the watch loop goes on meanwhile)."""
        runners = self._detach(state)
        if runners:
            self._stop(runners)

    async def unload(self, state: ModelState) -> bool:
        """Stop the model's runners (they drain their requests first); False if none ran."""
        runners = self._detach(state)
        if not runners:
            return False
        await self._stop_all(runners)
        return True

    async def load(self, state: ModelState, *, client: bool = True) -> None:
        """Load without a request (POST /models/load, preload: ``client`` False); a failed
        model is retried."""
        if state.status == "failed":
            state.failures = 0
        await self.acquire(state, client=client)
        self.end(state)

    # ---- one replica: restart, scale -------------------------------------------------------

    def _restart(self, state: ModelState, replica: Replica) -> None:
        """Out of the rotation now; its process stopped and started again in the background
        (with backoff; failed after MAX_FAILURES attempts in a row)."""
        replica.status = "restarting"
        self._forget(state, replica)
        self._tasks.append(asyncio.ensure_future(self._restart_replica(state, replica)))

    async def _restart_replica(self, state: ModelState, replica: Replica) -> None:
        old = replica.runner
        if old is not None and old.alive():
            await old.stop(grace=1.0)
        while not self._closing and replica in state.replicas and state.status == "loaded":
            delay = policy.restart_delay(replica.failures)
            if delay is None:
                replica.status = "failed"
                log.warning("model %s replica %s: gave up restarting: %s", state.spec.name,
                            replica.id, replica.error)
                self._gave_up(state, replica)
                return
            await asyncio.sleep(delay)
            if self._closing or replica not in state.replicas:
                return
            try:
                runner = await self._spawn_ready(state, replica)
            except (RuntimeError, TimeoutError) as e:
                if replica.runner is not None:
                    replica.runner.kill_now()
                if self._closing or replica.status == "stopping" or replica not in state.replicas:
                    return  # stopped while it started (retired, unloaded): no failure of its
                replica.failures += 1
                replica.error = str(e)
                # (another start: counted and said, as the first was; they went unsaid)
                _count_restart(state, replica, f"restart {replica.failures} failed: {e}")
                continue
            if replica not in state.replicas or self._closing:  # unloaded meanwhile
                runner.kill_now()
                return
            replica.status, replica.failures = "ready", 0
            log.info("model %s replica %s %s", state.spec.name, replica.id,
                     "is back" if old is not None else "is up")  # (a new one was "back")
            return

    def _gave_up(self, state: ModelState, replica: Replica) -> None:
        """A local replica failed its restarts. When no replica of the model is left to
        serve, the model is ``failed`` with the runner's error (as a load that failed: 503
        with it, and POST /models/load tries again; it stayed "loaded", answering "all
        failed", and a load could not revive it). Otherwise an autoscaled pool's replica is
        dropped (the autoscaler adds another when the load asks: failed ones piled up, one
        every few seconds, each with its log and metrics); a fixed one stays ``failed``."""
        # (a replica being retired serves its last requests only: none left either; a PD
        # model's prefill replicas cannot serve a request alone)
        decoders = [r for r in state.replicas if state.serves(r, "decode")]
        if all(r.local and r.status in ("failed", "stopping") for r in decoders):
            state.status, state.error = "failed", replica.error
            state.failures = policy.MAX_FAILURES
            runners = self._detach(state)
            if runners:
                self._stop(runners)
        elif replica.role in {pool for pool, _ in state.spec.scaled_pools}:
            self._drop_replica(state, replica)

    def _scale(self, state: ModelState, now: float) -> None:
        if state.status != "loaded":
            return
        for pool, config in state.spec.scaled_pools:
            self._scale_pool(state, pool, config, now)

    def _scale_pool(self, state: ModelState, pool: str, config: autoscale.AutoscaleConfig,
                    now: float) -> None:
        """One pool of local replicas (a PD model scales its prefill and decode replicas
        apart, each by its own load) grown or shrunk as ``autoscale.decide`` says."""
        serving = state.scaling(pool)
        load = sum(r.load_total for r in serving)
        decision, pending = autoscale.decide(config, len(serving), load, now,
                                             state.scale_pending.get(pool))
        if pending is None:
            state.scale_pending.pop(pool, None)
        else:
            state.scale_pending[pool] = pending
        if decision is None:
            return
        what = state.spec.name if pool == "both" else f"{state.spec.name} ({pool})"
        target, reason = decision.target, decision.reason
        if decision.direction == "up":
            count = decision.target - len(serving)
            if self.config.max_memory and state.memory:
                room = (self.config.max_memory - self.memory_used()) // state.memory
                if room <= 0:
                    if state.no_room.get(pool) != decision.target:
                        log.warning("autoscaler: model %s wants %d replicas; no room under "
                                    "max-memory", what, decision.target)
                    state.no_room[pool] = decision.target
                    return
                if room < count:  # (the log said the count wanted, not the one started)
                    count, target = room, len(serving) + room
                    reason += f"; {decision.target} wanted, no room for more under max-memory"
            for _ in range(count):
                replica = self._new_replica(state, pool)
                self._restart(state, replica)
                replica.status = "starting"
        else:
            for replica in autoscale.to_retire(serving, decision.target):
                self._retire(state, replica)
        state.no_room.pop(pool, None)
        state.scaled[pool, decision.direction] += 1
        log.warning("autoscaler: model %s %s to %d replicas: %s", what,
                    decision.direction, target, reason)

    def _retire(self, state: ModelState, replica: Replica) -> None:
        """Scaled down: out of the rotation now; stopped once its requests are done (at
        most the drain and a minute more). One not yet started, at once. One whose polls
        went unanswered (``unhealthy``, as a busy runner's may be: it was stopped at once, its
        streams cut, as the autoscaler retires such replicas first) until it would count as
        hung, ``health-timeout`` after its last answer, and at once past that (its requests
        waited the drain and a minute more on a process that answered nothing). Requests
        that had received nothing go to another replica when its connections close."""
        now = time.monotonic()
        deadline = now + self.drain + 60
        if replica.status == "unhealthy":
            deadline = min(deadline, replica.unhealthy_since + self.config.health_timeout)
        elif replica.status != "ready":
            deadline = now
        replica.status = "stopping"
        self._forget(state, replica)

        async def retire() -> None:
            while replica.in_flight > 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            if replica in state.replicas:
                state.replicas.remove(replica)
            if replica.runner is not None:
                self._stopping[replica.runner] = state
                await self._stop_all([replica.runner])

        self._tasks.append(asyncio.ensure_future(retire()))

    # ---- the watch: ttl, crashes, autoscaling; the polls -----------------------------------

    def start(self) -> None:
        self._tasks += [asyncio.ensure_future(self._watch_loop()),
                        asyncio.ensure_future(self._poll_loop())]
        for state in self.models.values():
            if state.spec.preload:
                asyncio.ensure_future(self._preload(state))

    async def _preload(self, state: ModelState) -> None:
        try:  # (no client waits: `ps` said one did)
            await self.load(state, client=False)
        except ModelUnavailable as e:  # (said nowhere but in a request's answer, some ways)
            if e.code != "shutting_down":  # (a gateway stopped as it started: no failure)
                log.warning("model %s: preload failed: %s", state.spec.name, e)

    async def _watch_loop(self) -> None:
        while not self._closing:
            await asyncio.sleep(0.25)
            self._tasks = [t for t in self._tasks if not t.done()]
            now = time.monotonic()
            loaded = [s for s in self.models.values()
                      if s.status == "loaded" and not s.remote_only]
            for name in policy.expired([s.view() for s in loaded], now):
                # (the only unload not said: an autoscaled model's scale to zero went unlogged)
                log.info("model %s: idle for its ttl of %g s; unloading", name,
                         self.models[name].ttl)
                self._unload_soon(self.models[name])
            for state in loaded:
                for replica in state.died:
                    runner = replica.runner
                    assert runner is not None
                    replica.error = runner.killed_by() or (
                        f"runner exited with {runner.proc.returncode}: {runner.last_error()}")
                    self._restart_failed(state, replica, replica.error)
                self._scale(state, now)

    async def _poll_loop(self) -> None:
        while not self._closing:
            await asyncio.sleep(self.config.poll_interval)
            polls = [self.poll(s, r) for s in self.models.values() if s.status == "loaded"
                     for r in s.replicas if r.status in ("ready", "unhealthy") and r.alive()]
            await asyncio.gather(*polls)

    async def poll(self, state: ModelState, replica: Replica) -> None:
        """Read the replica's /metrics page: its load, cache, TTFT and the name it serves."""
        url = replica.url
        try:
            r = await self._http.get(f"{url}/metrics", timeout=max(1.0, self.config.poll_interval * 4))
            page = parse_metrics(r.text) if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            page = None
        if page is None or page.empty:
            replica.failures += 1
            now = time.monotonic()
            if replica.failures >= 2 and replica.status == "ready":
                replica.status = "unhealthy"
                # silent since its last answer (it used to count from this second failed
                # poll, which a hung runner's poll takes its whole timeout to reach)
                replica.unhealthy_since = now if replica.polled is None else replica.polled
                replica.error = f"{url}/metrics did not answer"
                log.warning("model %s replica %s is unhealthy", state.spec.name, replica.id)
            if (replica.status == "unhealthy" and replica.local
                    and now - replica.unhealthy_since >= self.config.health_timeout):
                # A hung runner (alive, answering nothing): requests would wait for it for
                # ever; Ray Serve replaces such a replica too. (A remote one cannot be.)
                replica.error = (f"{url}/metrics did not answer for "
                                 f"{self.config.health_timeout:g} s")
                replica.failures = 0  # (they count failed starts from here)
                self._restart_failed(state, replica, replica.error)
            return
        replica.observe(page)
        replica.failures = 0
        if replica.status == "unhealthy":
            if replica.id in state.lora_missed:  # (it came back without them)
                async with self.lora_lock:
                    await catch_up_lora(self._http, state, replica)
                if replica.status != "unhealthy":  # (failed or restarted meanwhile)
                    return
            replica.status = "ready"
            log.info("model %s replica %s is healthy again", state.spec.name, replica.id)

    async def close(self) -> None:
        """Stop every runner (SIGTERM, SIGKILL after the drain). A second call (the signal
        handler's, then the server's shutdown) waits for the first: it used to find nothing
        left to stop and let the server exit while the first still waited on a runner."""
        if self._closed is None:
            self._closed = asyncio.ensure_future(self._close())
        await asyncio.shield(self._closed)

    async def _close(self) -> None:
        self._closing = True
        for task in self._tasks:
            task.cancel()
        # (loads in progress end on their own: the unloads below take their replicas away)
        await asyncio.gather(*(self.unload(s) for s in self.models.values()),
                             return_exceptions=True)
        # (and those an unload, an eviction or the autoscaler had begun to stop)
        await asyncio.gather(*self._stops, return_exceptions=True)
        await self._http.aclose()

    def kill_all(self, wait: bool = True) -> None:
        """Last resort (the event loop is gone, or a second Ctrl-C: then without waiting):
        SIGKILL every runner still running, those an unload was stopping too."""
        for runner in self._started:
            runner.kill_now(wait)


def _count_restart(state: ModelState, replica: Replica, why: str) -> None:
    """A local replica's restart, counted (its own, the model's, the series by replica id)
    and logged with ``why``."""
    replica.restarts += 1
    state.restarts += 1
    state.replica_restarts[replica.id] += 1
    log.warning("model %s replica %s: %s; restarting", state.spec.name, replica.id, why)


def _unloaded_meanwhile(state: ModelState) -> ModelUnavailable:
    """What a request waiting for a load gets when the model is unloaded during it."""
    return ModelUnavailable(f"model '{state.spec.name}' was unloaded while it loaded; retry "
                            "to load it again", code="model_unloaded")


def _retrieve(task: asyncio.Future[None]) -> None:
    """A load's outcome is its waiters' to report; with none left, it is not an error of the
    event loop's ("exception was never retrieved")."""
    if not task.cancelled():
        task.exception()


class RunnerAuth(httpx.Auth):
    """``Authorization: Bearer`` the runners' key on requests to this supervisor's local
    runners (remote replicas never see it); a model's own ``api-key`` on requests to its
    ``urls``; nothing for anyone else."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        origin = f"http://{request.url.host}:{request.url.port}"
        sup = self.supervisor
        if sup.runs_local(origin):
            request.headers["authorization"] = f"Bearer {self.supervisor.runner_key}"
        else:
            key = remote_key(self.supervisor.config, str(request.url))
            if key is not None:
                request.headers["authorization"] = f"Bearer {key}"
        yield request


def remote_key(config: GatewayConfig, url: str) -> str | None:
    """The ``api-key`` of the model whose ``urls`` (or PD url lists) ``url`` is under."""
    for spec in config.models:
        if spec.url_api_key is not None and any(
                url == u or url.startswith(u + "/") for u in spec.urls):
            return spec.url_api_key
    return None


def _check_local_file(source: str) -> None:
    """Raise as the runner would for a source that is a file here and no GGUF model (a
    truncated or foreign file), or a path (``/``, ``./``, ``~``...) to no file (deleted or
    moved since the gateway started: it evicted a working model, then failed); a registry
    name or a hub repo is the runner's to resolve."""
    path = Path(source).expanduser()
    if path.is_file():
        read_gguf_header(path, vocabulary=False)
    elif is_local_path(source):
        raise model_not_found(source)
