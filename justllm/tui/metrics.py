"""A ``/metrics`` page as a small snapshot, plus the arithmetic ``justllm top`` shows.

Pure functions, no I/O: :func:`parse` turns the Prometheus text format into a :class:`Snapshot`,
:func:`histogram_quantile` estimates a quantile from cumulative buckets the way Prometheus'
``histogram_quantile`` does, and :func:`rate` is a counter's per-second increase between two
snapshots. Series that differ only by label (``model_name``, one per served model) are summed.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

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
    """What one scrape said; ``None`` where the page had no such series."""

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


def parse(text: str, at: float = 0.0) -> Snapshot:
    """The snapshot of a ``/metrics`` page taken at ``at``; raises ``ValueError`` if malformed."""
    sums: dict[str, float] = defaultdict(float)
    series: dict[str, int] = defaultdict(int)
    buckets: dict[float, float] = defaultdict(float)
    models: list[str] = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            model = s.labels.get("model_name")
            if model is not None and model not in models:
                models.append(model)
            if s.name == TTFT + "_bucket":
                buckets[float(s.labels["le"])] += s.value
            else:
                sums[s.name] += s.value
                series[s.name] += 1

    def get(name: str) -> float | None:
        return sums[name] if name in sums else None

    hits, misses = get(HITS), get(MISSES)
    ratio = get(HIT_RATIO)
    if ratio is not None and series[HIT_RATIO] > 1:
        ratio /= series[HIT_RATIO]  # a ratio summed over models means nothing: average it...
    if hits is not None and misses is not None and (ratio is None or series[HIT_RATIO] > 1):
        ratio = hits / (hits + misses) if hits + misses else 0.0  # ...or better, recompute it
    ttft = None
    if buckets:
        ttft = Histogram(tuple(sorted(buckets.items())), count=sums.get(TTFT + "_count", 0.0),
                         sum=sums.get(TTFT + "_sum", 0.0))
    return Snapshot(
        time=at, models=tuple(models), running=get(RUNNING), waiting=get(WAITING),
        kv_used=get(KV_USED), kv_total=get(KV_TOTAL), cache_blocks=get(CACHE_BLOCKS),
        hit_ratio=ratio, hits=hits, misses=misses, generation_tokens=get(GENERATION_TOKENS),
        spec_accepted=get(SPEC_ACCEPTED), spec_draft=get(SPEC_DRAFT), ttft=ttft)


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
    counts = []
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
    series are not the same counter any more).
    """
    if prev is None:
        return None
    a, b = getattr(prev, name), getattr(cur, name)
    dt = cur.time - prev.time
    if a is None or b is None or dt <= 0 or b < a or prev.models != cur.models:
        return None
    return (b - a) / dt
