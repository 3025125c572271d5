"""A ``/metrics`` page as a small snapshot, plus the arithmetic ``justllm top`` shows.

Pure functions, no I/O: :func:`parse` turns the Prometheus text format into a :class:`Snapshot`,
:func:`histogram_quantile` estimates a quantile from cumulative buckets the way Prometheus'
``histogram_quantile`` does, and :func:`rate` is a counter's per-second increase between two
snapshots. Series that differ only by label (``model_name``, one per served model) are summed
into the snapshot, which also holds one snapshot per model (:attr:`Snapshot.per_model`): a
gateway's page (``justllm serve --models``) carries every loaded runner's series, each under its
``model_name``, and its own ``justllm_gateway_*`` series, which name every configured model,
loaded or not.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from prometheus_client.parser import text_string_to_metric_families

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USED = "justllm_kv_blocks_used"
KV_TOTAL = "justllm_kv_blocks_total"
CACHE_BLOCKS = "justllm_prefix_cache_blocks"
HIT_RATIO = "justllm_prefix_cache_hit_ratio"
HITS = "justllm_prefix_cache_hits_total"
MISSES = "justllm_prefix_cache_misses_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
SPEC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
SPEC_DRAFT = "vllm:spec_decode_num_draft_tokens_total"
TTFT = "vllm:time_to_first_token_seconds"
GATEWAY = "justllm_gateway_"
MODEL_LOADED = "justllm_gateway_model_loaded"
REPLICA_UP = "justllm_gateway_replica_up"
WAITING_FOR_LOAD = "justllm_gateway_requests_waiting_for_load"



def metrics_url(url: str) -> str:
    """The ``/metrics`` page of the server at ``url`` (given bare, as its ``/v1``, or as
    the page itself)."""
    url = url.rstrip("/")
    return url if url.endswith("/metrics") else url.removesuffix("/v1") + "/metrics"

@dataclass(frozen=True)
class Histogram:
    """Cumulative buckets ``(upper bound, observations <= bound)``, sorted, ``+Inf`` last."""

    buckets: tuple[tuple[float, float], ...]
    count: float = 0.0
    sum: float = 0.0

    def quantile(self, q: float) -> float | None:
        return histogram_quantile(q, self.buckets)


@dataclass(frozen=True)
class Snapshot:
    """What one scrape said, summed over models; ``None`` where the page had no such series.

    ``models`` names the models whose own (runner) series are on the page, in page order: the
    summed counters are the same counter only while it stays the same. ``per_model`` has one
    snapshot per model the page names, a gateway's unloaded models included (``loaded`` False,
    no numbers); ``gateway`` says the page has a gateway's own series.
    """

    time: float = 0.0  # when it was taken (a monotonic clock), for rates
    models: tuple[str, ...] = ()
    running: float | None = None
    waiting: float | None = None
    kv_used: float | None = None
    kv_total: float | None = None
    cache_blocks: float | None = None
    hit_ratio: float | None = None
    hits: float | None = None
    misses: float | None = None
    generation_tokens: float | None = None
    spec_accepted: float | None = None
    spec_draft: float | None = None
    ttft: Histogram | None = field(default=None)
    loaded: bool | None = None  # per model: the gateway's word, else True (its series are here)
    waiting_for_load: float | None = None  # requests the gateway holds until a model loads
    # per model, from a gateway: replicas in the rotation by role (both, prefill, decode)
    replicas_up: tuple[tuple[str, int], ...] = ()
    # (model, replica) of each runner whose token counter is in the sums: a replica that a
    # gateway's page leaves out for a poll makes the sum another counter
    counted: frozenset[tuple[str, str]] = frozenset()
    gateway: bool = False
    per_model: Mapping[str, Snapshot] = field(
        default_factory=lambda: MappingProxyType({}), hash=False, repr=False)

    @property
    def empty(self) -> bool:
        """True for a page with none of the series above (e.g. a server still loading)."""
        return all(getattr(self, name) is None for name in (
            "running", "waiting", "kv_used", "kv_total", "hit_ratio", "hits", "misses",
            "generation_tokens")) and self.ttft is None

    @property
    def spec_acceptance(self) -> float | None:
        """Accepted / drafted tokens, or ``None`` without speculation metrics or drafts."""
        if self.spec_accepted is None or not self.spec_draft:
            return None
        return self.spec_accepted / self.spec_draft

    @property
    def kv_usage(self) -> float | None:
        if self.kv_used is None or not self.kv_total:
            return None
        return self.kv_used / self.kv_total

    def ttft_quantile(self, q: float) -> float | None:
        return self.ttft.quantile(q) if self.ttft is not None else None


class _Series:
    """The samples of one view (every model, or one), summed by name as they come."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)
        self.count: dict[str, int] = defaultdict(int)
        self.buckets: dict[float, float] = defaultdict(float)
        self.counted: set[tuple[str, str]] = set()  # (model, replica) of the token counters

    def add(self, name: str, labels: Mapping[str, str], value: float) -> None:
        if not math.isfinite(value):  # (a NaN gauge: no reading, not a number to draw)
            return
        if name == GENERATION_TOKENS:
            self.counted.add((labels.get("model_name", ""), labels.get("replica", "")))
        if name == TTFT + "_bucket":
            self.buckets[float(labels["le"])] += value
        else:
            self.sums[name] += value
            self.count[name] += 1

    def get(self, name: str) -> float | None:
        return self.sums[name] if name in self.sums else None

    def snapshot(self, at: float, **extra) -> Snapshot:
        hits, misses = self.get(HITS), self.get(MISSES)
        ratio = self.get(HIT_RATIO)
        several = self.count[HIT_RATIO] > 1
        if ratio is not None and several:
            ratio /= self.count[HIT_RATIO]  # a ratio summed over models means nothing: average...
        if hits is not None and misses is not None and (ratio is None or several):
            ratio = hits / (hits + misses) if hits + misses else 0.0  # ...or better, recompute it
        ttft = None
        if self.buckets:
            ttft = Histogram(tuple(sorted(self.buckets.items())),
                             count=self.sums.get(TTFT + "_count", 0.0),
                             sum=self.sums.get(TTFT + "_sum", 0.0))
        get = self.get
        return Snapshot(
            time=at, running=get(RUNNING), waiting=get(WAITING), kv_used=get(KV_USED),
            kv_total=get(KV_TOTAL), cache_blocks=get(CACHE_BLOCKS), hit_ratio=ratio, hits=hits,
            misses=misses, generation_tokens=get(GENERATION_TOKENS),
            spec_accepted=get(SPEC_ACCEPTED), spec_draft=get(SPEC_DRAFT), ttft=ttft,
            counted=frozenset(self.counted), **extra)


def parse(text: str, at: float = 0.0) -> Snapshot:
    """The snapshot of a ``/metrics`` page taken at ``at``; raises ``ValueError`` if malformed.

    The page's series summed over models, and in :attr:`Snapshot.per_model` each model's own:
    its runner's series and the gateway's about it.
    """
    total = _Series()
    per_model: dict[str, _Series] = {}
    serving: list[str] = []  # models with series of their own, not only the gateway's
    loaded: dict[str, bool] = {}
    up: dict[str, Counter[str]] = defaultdict(Counter)  # model -> role -> replicas up
    gateway = False
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            model = s.labels.get("model_name")
            own = s.name.startswith(GATEWAY)
            gateway |= own
            total.add(s.name, s.labels, s.value)
            if model is None:
                continue
            per_model.setdefault(model, _Series()).add(s.name, s.labels, s.value)
            if s.name == MODEL_LOADED:
                loaded[model] = s.value > 0
            elif s.name == REPLICA_UP and s.value > 0:
                up[model][s.labels.get("role", "both")] += 1
            elif not own and model not in serving:
                serving.append(model)
    models = {
        name: series.snapshot(at, models=(name,), gateway=gateway,
                              loaded=loaded.get(name, name in serving),
                              replicas_up=tuple(sorted(up[name].items())))
        for name, series in per_model.items()}
    return total.snapshot(at, models=tuple(serving), per_model=MappingProxyType(models),
                          gateway=gateway, waiting_for_load=total.get(WAITING_FOR_LOAD))


def histogram_quantile(q: float, buckets: tuple[tuple[float, float], ...] | list) -> float | None:
    """The ``q`` quantile (0..1) from cumulative ``(le, count)`` buckets, as Prometheus computes it.

    Linear interpolation inside the bucket the rank falls in (the first bucket starts at 0 when
    its bound is positive); a rank in the ``+Inf`` bucket gives the highest finite bound.
    ``None`` when there are no observations or no ``+Inf`` bucket (Prometheus says NaN).
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    b = sorted(buckets)
    if len(b) < 2 or not math.isinf(b[-1][0]):
        return None
    # Counts must not decrease; Prometheus fixes small inconsistencies the same way.
    counts: list[float] = []
    for _, c in b:
        counts.append(max(c, counts[-1]) if counts else c)
    total = counts[-1]
    if total <= 0:
        return None
    rank = q * total
    i = next(i for i, c in enumerate(counts) if c >= rank)
    if i == len(b) - 1:
        return b[-2][0]
    upper = b[i][0]
    if i == 0 and upper <= 0:
        return upper
    lower = 0.0 if i == 0 else b[i - 1][0]
    below = 0.0 if i == 0 else counts[i - 1]
    in_bucket = counts[i] - below
    if in_bucket <= 0:
        return upper
    return lower + (upper - lower) * (rank - below) / in_bucket


def rate(prev: Snapshot | None, cur: Snapshot, name: str = "generation_tokens") -> float | None:
    """Per-second increase of counter ``name`` (a :class:`Snapshot` field) from ``prev`` to ``cur``.

    ``None`` where ``cur`` can only be a new baseline: no ``prev`` (the first reading), a value
    missing on either side, no elapsed time, a counter that went down (the server restarted:
    unlike Prometheus' ``rate``, whose new value is not counted as the increase, since it holds
    everything generated before the dashboard saw it) or a changed set of models (the summed
    series are not the same counter any more), or of the replicas counted (a gateway leaves a
    replica slow to answer off one page: counted again, its whole counter looked new). A sum is no counter either once one model's
    counter went down (its runner restarted), even if the others' increase hides it.
    """
    if prev is None:
        return None
    a, b = getattr(prev, name), getattr(cur, name)
    dt = cur.time - prev.time
    if a is None or b is None or dt <= 0 or b < a or prev.models != cur.models \
            or prev.counted != cur.counted:
        return None
    for model, now in cur.per_model.items():
        before = prev.per_model.get(model)
        x, y = (getattr(before, name), getattr(now, name)) if before is not None else (None, None)
        if x is not None and y is not None and y < x:
            return None
    return (b - a) / dt
