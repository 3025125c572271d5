"""The runners of every model: started on demand, unloaded when idle (ttl, keep_alive) or to
make room (max-loaded, least recently used first), restarted with backoff when they die, and
reported failed when they keep failing to start. Lives on the gateway's event loop; the
decisions are ``policy``'s."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from justllm.errors import JustLLMError
from justllm.gateway import policy
from justllm.gateway.config import GatewayConfig, ModelSpec
from justllm.gateway.memory import runner_memory
from justllm.gateway.runner import RunnerProcess, last_error_line

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
    runner: RunnerProcess | None = None
    active: int = 0
    last_used: float = field(default_factory=time.monotonic)
    keep_alive: float | None = None  # the last request's keep_alive, overriding the ttl
    failures: int = 0  # consecutive failed starts
    error: str | None = None
    loads: int = 0
    restarts: int = 0
    load_seconds: list[float] = field(default_factory=list)
    memory: int = 0  # estimated bytes of its runner (only with max-memory)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def live_runner(self) -> RunnerProcess | None:
        """The runner, when the model is loaded and its process is up."""
        r = self.runner
        return r if self.status == "loaded" and r is not None and r.alive() else None

    @property
    def died(self) -> bool:
        """Loaded, but its runner's process has exited."""
        return self.status == "loaded" and self.runner is not None and not self.runner.alive()

    @property
    def ttl(self) -> float:
        return self.keep_alive if self.keep_alive is not None else self.spec.ttl

    def view(self) -> policy.Loaded:
        return policy.Loaded(self.spec.name, self.active, self.last_used, self.ttl,
                             self.memory)


class Supervisor:
    def __init__(self, config: GatewayConfig, log_dir: Path, drain: float = 5.0) -> None:
        self.config = config
        self.log_dir = log_dir
        self.drain = drain  # seconds a stopping runner lets its requests run (--shutdown-timeout)
        self.models = {m.name: ModelState(m) for m in config.models}
        self.waiting = 0  # requests waiting for a load
        self.unloads = 0
        self._room = asyncio.Condition()
        self._http = httpx.AsyncClient(trust_env=False)
        self._watch: asyncio.Task | None = None
        self._closing = False

    # ---- requests --------------------------------------------------------------------------

    def resolve(self, name: str | None) -> ModelState | None:
        if name is None:
            return next(iter(self.models.values())) if len(self.models) == 1 else None
        model = self.config.names.get(name)
        return self.models[model] if model is not None else None

    def end(self, state: ModelState, keep_alive: float | None = None) -> None:
        """A request on ``state`` ended; ``keep_alive`` (Ollama's) overrides the model's ttl
        from now on (0: unload once idle)."""
        state.active -= 1
        state.last_used = time.monotonic()
        if keep_alive is not None:
            state.keep_alive = keep_alive
        if state.active == 0 and state.ttl == 0:
            asyncio.ensure_future(self.unload(state))
        asyncio.ensure_future(self._notify_room())

    async def _notify_room(self) -> None:
        async with self._room:
            self._room.notify_all()

    async def acquire(self, state: ModelState) -> RunnerProcess:
        """The model's runner, loaded first if need be, with one more request counted on it
        from now on (so it is never unloaded to make room while the request waits): pair
        each successful call with ``end``."""
        state.active += 1
        try:
            if (runner := state.live_runner) is not None:
                return runner
            if self.waiting >= self.config.max_waiting:
                raise ModelUnavailable(f"{self.waiting} requests are already waiting for "
                                       "models to load; retry later", code="too_many_waiting")
            self.waiting += 1
            try:
                return await asyncio.wait_for(self._load(state), self.config.load_timeout)
            except TimeoutError:
                raise ModelUnavailable(f"model '{state.spec.name}' did not load within "
                                       f"{self.config.load_timeout:.0f} s",
                                       code="model_loading") from None
            finally:
                self.waiting -= 1
        except BaseException:
            state.active -= 1
            raise

    # ---- loading and unloading -------------------------------------------------------------

    async def _load(self, state: ModelState) -> RunnerProcess:
        async with state.lock:
            if (runner := state.live_runner) is not None:
                return runner
            if state.status == "failed" and policy.restart_delay(state.failures) is None:
                raise ModelUnavailable(f"model '{state.spec.name}' failed to load: "
                                       f"{state.error}", code="model_failed")
            await self._estimate(state)
            await self._make_room(state)
            return await self._start(state)

    async def _estimate(self, state: ModelState) -> None:
        """With max-memory: the runner's estimated memory, once (a model that can never fit
        is refused at once rather than waited for)."""
        limit = self.config.max_memory
        if not limit:
            return
        if not state.memory:
            try:
                state.memory = await asyncio.to_thread(runner_memory, state.spec)
            except (JustLLMError, OSError, ValueError) as e:
                state.status, state.error = "failed", str(e)
                state.failures = policy.MAX_FAILURES
                raise ModelUnavailable(f"model '{state.spec.name}' failed to load: {e}",
                                       code="model_failed") from None
        if state.memory > limit:
            raise ModelUnavailable(
                f"model '{state.spec.name}' needs about {state.memory / 2**30:.2f} GiB "
                f"(weights, KV pool and logits), more than max-memory "
                f"({limit / 2**30:.2f} GiB): lower its pool-blocks or raise max-memory",
                code="model_too_large")

    async def _make_room(self, state: ModelState) -> None:
        """Claim a place under max-loaded: decided and marked (this model loading, the victims
        unloaded) without yielding to another load, so two loads never claim one place."""
        async with self._room:
            while True:
                loaded = [s.view() for s in self.models.values()
                          if s is not state and s.status in ("loaded", "loading")]
                victims = policy.to_unload_for(loaded, self.config.max_loaded,
                                               max_memory=self.config.max_memory,
                                               need=state.memory)
                if victims is not None:
                    break
                await self._room.wait()  # every model is busy: wait for one to go idle
            state.status = "loading"
            stopping = [self._detach(self.models[name]) for name in victims]
        await self._stop_all([r for r in stopping if r is not None])

    async def _start(self, state: ModelState) -> RunnerProcess:
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
            state.status = "loading"
            t0 = time.monotonic()
            runner = RunnerProcess(state.spec, self.log_dir, self.drain)
            state.runner = runner
            try:
                await runner.wait_ready(self._http, self.config.load_timeout)
            except (RuntimeError, TimeoutError) as e:
                state.failures += 1
                state.error = str(e)
                state.status = "failed"
                runner.kill_now()
                state.runner = None
                log.warning("model %s failed to start (%d): %s", state.spec.name,
                            state.failures, e)
                continue
            except BaseException:
                runner.kill_now()
                state.runner = None
                state.status = "unloaded"
                raise
            state.status = "loaded"
            state.failures = 0
            state.error = None
            state.loads += 1
            state.load_seconds.append(time.monotonic() - t0)
            state.last_used = time.monotonic()
            state.keep_alive = None
            return runner

    def _detach(self, state: ModelState) -> RunnerProcess | None:
        """Mark the model unloaded at once; the caller stops the runner it had."""
        runner, state.runner = state.runner, None
        if state.status != "failed":
            state.status = "unloaded"
        state.keep_alive = None
        return runner

    async def _stop_all(self, runners: list[RunnerProcess]) -> None:
        await asyncio.gather(*(r.stop(grace=self.drain + 5) for r in runners))
        self.unloads += len(runners)
        if runners:
            await self._notify_room()

    async def unload(self, state: ModelState) -> bool:
        """Stop the model's runner (it drains its requests first); False if none ran."""
        runner = self._detach(state)
        if runner is None:
            return False
        await self._stop_all([runner])
        return True

    async def load(self, state: ModelState) -> None:
        """Load without a request (POST /models/load, preload); a failed model is retried."""
        if state.status == "failed":
            state.failures = 0
        await self.acquire(state)
        self.end(state)

    # ---- the watch: ttl, crashes -----------------------------------------------------------

    def start(self) -> None:
        self._watch = asyncio.ensure_future(self._watch_loop())
        for state in self.models.values():
            if state.spec.preload:
                asyncio.ensure_future(self._preload(state))

    async def _preload(self, state: ModelState) -> None:
        with contextlib.suppress(ModelUnavailable):
            await self.load(state)

    async def _watch_loop(self) -> None:
        while not self._closing:
            await asyncio.sleep(0.5)
            now = time.monotonic()
            loaded = [s for s in self.models.values() if s.status == "loaded"]
            for name in policy.expired([s.view() for s in loaded], now):
                await self.unload(self.models[name])
            for state in loaded:
                if state.died:
                    asyncio.ensure_future(self._restart(state))

    async def _restart(self, state: ModelState) -> None:
        """A loaded runner died: start it again (with backoff; failed after MAX_FAILURES)."""
        async with state.lock:
            if not state.died or state.runner is None:
                return
            state.error = (f"runner exited with {state.runner.proc.returncode}: "
                           f"{last_error_line(state.runner.log_path)}")
            log.warning("model %s: %s; restarting", state.spec.name, state.error)
            state.runner = None
            state.status = "loading"
            state.restarts += 1
            with contextlib.suppress(ModelUnavailable):
                await self._start(state)

    async def wait_restarted(self, state: ModelState, runner: RunnerProcess) -> RunnerProcess:
        """After ``runner`` failed a request: the model's next runner (retry once). The
        request stays counted as in ``acquire``."""
        if runner.alive():
            await runner.stop(grace=1.0)
        if state.runner is runner:
            state.runner = None
            state.status = "loading"
            state.restarts += 1
        runner = await self.acquire(state)
        state.active -= 1  # acquire counted the request a second time
        return runner

    async def close(self) -> None:
        self._closing = True
        if self._watch is not None:
            self._watch.cancel()
        await asyncio.gather(*(self.unload(s) for s in self.models.values()),
                             return_exceptions=True)
        await self._http.aclose()

    def kill_all(self) -> None:
        """Last resort (the event loop is gone): SIGKILL every runner."""
        for s in self.models.values():
            if s.runner is not None:
                s.runner.kill_now()
