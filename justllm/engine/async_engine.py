"""The step loop on one background thread, with ``async for`` over a request's outputs.

design.md: llama.cpp compute must happen on a single OS thread, so the engine thread is the only
caller of ``Engine.step()``; the event loop only adds and aborts requests (cheap, under the
engine's lock) and receives outputs through ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from justllm.core.sampling_params import SamplingParams
from justllm.engine.engine import Engine, RequestOutput

log = logging.getLogger(__name__)


@dataclass
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput]


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._sinks: dict[str, _Sink] = {}
        self._sinks_lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="justllm-engine", daemon=True)
        self._thread.start()

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as steps produce them; the last one has ``finished``.

        Validation and queue-full errors raise here, before the first output. Leaving the loop
        early (or cancelling the task) aborts the request and frees its KV within one step.
        """
        if self._stopping:
            raise RuntimeError("the engine is shutting down")
        sink = _Sink(asyncio.get_running_loop(), asyncio.Queue())
        request_id = self.engine.add_request(prompt, params, request_id)
        with self._sinks_lock:
            self._sinks[request_id] = sink
        self._wake.set()
        finished = False
        try:
            while not finished:
                out = await sink.queue.get()
                finished = out.finished
                yield out
        finally:
            with self._sinks_lock:
                self._sinks.pop(request_id, None)
            if not finished:
                self.engine.abort(request_id)
                self._wake.set()

    def abort(self, request_id: str) -> bool:
        aborted = self.engine.abort(request_id)
        self._wake.set()
        return aborted

    def _loop(self) -> None:
        while not self._stopping:
            if not self.engine.has_work():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception:  # a bug must not kill the thread that serves everyone
                log.exception("engine step failed")
                continue
            for out in outputs:
                with self._sinks_lock:
                    sink = self._sinks.get(out.request_id)
                if sink is not None:
                    sink.loop.call_soon_threadsafe(sink.queue.put_nowait, out)

    def close(self) -> None:
        """Stop the engine thread; unfinished requests are aborted. Frees the model."""
        self._stopping = True
        self._wake.set()
        self._thread.join()
        with self._sinks_lock:
            pending = list(self._sinks)
        for request_id in pending:
            self.engine.abort(request_id)
        self.engine.close()
