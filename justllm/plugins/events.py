"""``on_request_finished`` delivery: each plugin gets its records on a worker thread of its own.

The engine builds a record while it holds its lock, so handing it over must never block: each
plugin has a bounded queue, and a record that finds it full is dropped and counted. A plugin
that raises is logged and counted; one that blocks fills only its own queue.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from justllm.core.record import RequestRecord

log = logging.getLogger("justllm.plugins")

MAX_PENDING = 1000  # records waiting for one plugin before new ones are dropped
_STOP = object()


@dataclass
class DeliveryCounts:
    delivered: int = 0
    failed: int = 0  # the plugin raised
    dropped: int = 0  # its queue was full


class _Worker:
    def __init__(self, plugin: str, fn: Callable[..., object], max_pending: int) -> None:
        self.plugin = plugin
        self.fn = fn
        self.counts = DeliveryCounts()
        self._queue: queue.Queue[object] = queue.Queue(max_pending)
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def put(self, record: RequestRecord) -> None:
        if self._thread is None:  # started on the first record: commands that serve nothing
            with self._start_lock:  # start no threads
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, daemon=True,
                                                    name=f"justllm-plugin-{self.plugin}")
                    self._thread.start()
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self.counts.dropped += 1
            if self.counts.dropped == 1 or self.counts.dropped % 1000 == 0:
                log.warning("plugin %s: on_request_finished is behind; %d record(s) dropped",
                            self.plugin, self.counts.dropped)

    def _run(self) -> None:
        while True:
            record = self._queue.get()
            if record is _STOP:
                return
            try:
                self.fn(record=record)
            # (sys.exit(), or a CancelledError a plugin's asyncio leaks, would end this
            # thread for good: every later record dropped, counted as the plugin being slow)
            except BaseException as e:
                self.counts.failed += 1
                n = self.counts.failed
                if n == 1 or n % 1000 == 0:  # a broken plugin must not flood the log
                    log.warning("plugin %s: on_request_finished failed (%d so far): %s: %s",
                                self.plugin, n, type(e).__name__, e)
            else:
                self.counts.delivered += 1

    def close(self, timeout: float) -> bool:
        """Deliver what is queued, within ``timeout`` seconds; True when all of it was."""
        if self._thread is None:
            return True
        deadline = time.monotonic() + timeout  # (the put, then the join, each took it all)
        try:
            self._queue.put(_STOP, timeout=timeout)
        except queue.Full:
            return False
        self._thread.join(max(0.0, deadline - time.monotonic()))
        return not self._thread.is_alive()


class RequestEvents:
    """Calls every plugin's ``on_request_finished`` with each record, each plugin on its own
    thread. Callable: ``events(record)`` never blocks and never raises."""

    def __init__(self, impls: list[tuple[str, Callable[..., object]]],
                 max_pending: int = MAX_PENDING) -> None:
        self._workers = [_Worker(name, fn, max_pending) for name, fn in impls]

    def __call__(self, record: RequestRecord) -> None:
        for worker in self._workers:
            # each its own params (the record's one mutable part): a plugin that changed
            # them changed what the next one stored (a read-only mapping would break the
            # dataclasses.asdict plugins write records with)
            worker.put(replace(record, params=dict(record.params)))

    def counts(self) -> dict[str, DeliveryCounts]:
        return {w.plugin: w.counts for w in self._workers}

    def close(self, timeout: float = 5.0) -> None:
        """Deliver the queued records (each plugin within ``timeout``) and stop the threads:
        a server's shutdown, the end of ``justllm run``."""
        for worker in self._workers:
            if not worker.close(timeout):
                log.warning("plugin %s: on_request_finished did not finish within %.0f s",
                            worker.plugin, timeout)
