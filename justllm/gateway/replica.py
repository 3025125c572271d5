"""One replica of a model as the gateway sees it: a local runner process (or the address of a
``justllm serve`` elsewhere), whether it is in the rotation, the requests the gateway has in
flight on it, and what its last ``/metrics`` page said (load, KV use, prefix-cache hit ratio,
recent TTFT). The supervisor owns the processes; this is the bookkeeping the routing policy
reads (``load``)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from justllm.gateway.routing import ReplicaLoad
from justllm.gateway.runner import RunnerProcess
from justllm.tui.metrics import Histogram, Snapshot, histogram_quantile

TTFT_WINDOW = 30.0  # seconds of first tokens the recent TTFT is the median of

# A replica's life: starting -> ready <-> unhealthy (polls or a request failed), then
# restarting (its process died) -> ready, or stopping (scaled down or unloaded), or failed
# (it kept failing to start).
STATUSES = ("starting", "ready", "unhealthy", "restarting", "stopping", "failed")


@dataclass
class Replica:
    id: str  # "0", "1", ... for local replicas; the address for a remote one
    runner: RunnerProcess | None = None
    remote: str | None = None
    gpu: int | None = None
    role: str = "both"  # prefill/decode disaggregation: "prefill", "decode" or "both"
    status: str = "starting"
    in_flight: int = 0  # requests the gateway sent it and has not seen end
    others: int = 0  # at the last poll, its running + waiting beyond the gateway's in flight
    running: int = 0
    kv_usage: float = 0.0
    hit_ratio: float | None = None
    ttft_p50: float | None = None
    failures: int = 0  # consecutive failed starts (local) or polls
    unhealthy_since: float = 0.0  # (monotonic) when its polls stopped being answered
    restarts: int = 0
    error: str | None = None
    polled: float | None = None  # when its last page was read
    serves: str | None = None  # the model name its pages carry (a remote one may differ)
    _ttft: deque[tuple[float, Histogram]] = field(default_factory=deque, repr=False)

    @property
    def local(self) -> bool:
        return self.remote is None

    @property
    def url(self) -> str | None:
        return self.remote if self.remote is not None else (
            self.runner.url if self.runner is not None else None)

    @property
    def pid(self) -> int | None:
        return self.runner.pid if self.runner is not None else None

    def alive(self) -> bool:
        """Its process is up (a remote one is judged by polls and requests, not here)."""
        return self.remote is not None or (self.runner is not None and self.runner.alive())

    @property
    def routable(self) -> bool:
        return self.status == "ready" and self.alive()

    @property
    def load_total(self) -> int:
        return self.in_flight + self.others

    def load(self, skip: bool = False) -> ReplicaLoad:
        """The routing policy's view. The gateway's own in-flight count is exact and current;
        a poll adds only what it says beyond it (requests from other clients of a remote
        replica), so a burst between two polls is spread, not sent to one replica."""
        total = self.load_total
        running = min(self.running, total)
        return ReplicaLoad(self.id, healthy=self.routable, running=running,
                           waiting=total - running, kv_usage=self.kv_usage,
                           ttft_p50=self.ttft_p50, skip=skip)

    def observe(self, page: Snapshot, now: float | None = None) -> None:
        """What a ``/metrics`` page of this replica says (one model per runner page)."""
        now = time.monotonic() if now is None else now
        self.polled = now
        if page.models:
            self.serves = page.models[0]
        total = int((page.running or 0) + (page.waiting or 0))
        self.running = int(page.running or 0)
        self.others = max(0, total - self.in_flight)
        self.kv_usage = page.kv_usage or 0.0
        self.hit_ratio = page.hit_ratio
        # A page without the histogram has had no first token yet: an empty reading, so the
        # first one that has it counts whole against it (the first reading used to be its
        # own baseline at the next poll, and the window's first request was lost).
        ttft = page.ttft if page.ttft is not None else _NO_TTFT
        self._ttft.append((now, ttft))
        while len(self._ttft) > 2 and now - self._ttft[1][0] >= TTFT_WINDOW:
            self._ttft.popleft()
        # None once no first token came in the window: an idle replica has no recent TTFT
        # (keeping the last figure kept a replica slow once penalised in routing ties,
        # and showed a "last 30 s" median from long ago).
        self.ttft_p50 = recent_quantile(self._ttft[0][1], ttft, 0.5)

    def reset(self) -> None:
        """A new process: nothing polled yet, no cache."""
        self.others = self.running = 0
        self.kv_usage = 0.0
        self.hit_ratio = self.ttft_p50 = self.polled = None
        self._ttft.clear()


_NO_TTFT = Histogram(())


def recent_quantile(before: Histogram, after: Histogram, q: float) -> float | None:
    """The ``q`` quantile of the observations between two readings of one histogram; the
    later reading alone when the counts went down (the process restarted) or there was no
    earlier one."""
    if before is after or after.count < before.count:
        return histogram_quantile(q, after.buckets)
    old = dict(before.buckets)
    delta = [(le, count - old.get(le, 0.0)) for le, count in after.buckets]
    return histogram_quantile(q, delta)
