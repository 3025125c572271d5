"""The numbers ``vllm bench serve`` reports, from a run's per-request timings."""

from __future__ import annotations

import statistics

from rich.table import Table

from justllm.bench.runner import RunResult

PERCENTILES = (("mean", None), ("median", 50), ("p90", 90), ("p99", 99))


def _pct(values: list[float], p: int) -> float:
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _stats(prefix: str, values_s: list[float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for name, p in PERCENTILES:
        if not values_s:
            out[f"{name}_{prefix}_ms"] = None
        elif p is None:
            out[f"{name}_{prefix}_ms"] = 1000 * statistics.fmean(values_s)
        else:
            out[f"{name}_{prefix}_ms"] = 1000 * _pct(values_s, p)
    return out


def _delta(run: RunResult, name: str) -> float | None:
    """``name``'s increase over the run; None without both scrapes (a failed first one made
    the server's lifetime count this run's) or when it fell (the counter began again: a
    model unloaded and loaded again mid-run; the difference was a made-up figure)."""
    if name not in run.metrics_after or not run.metrics_before:
        return None
    grew = run.metrics_after[name] - run.metrics_before.get(name, 0.0)
    return grew if grew >= 0 else None


def summarize(run: RunResult) -> dict[str, float | int | str | None]:
    ok = [r for r in run.results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    # (a server that reports no usage: unknown, not 0, which also understated the throughput)
    counted = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    in_tokens = sum(counted) if ok and len(counted) == len(ok) else None
    d = max(run.duration, 1e-9)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    summary: dict[str, float | int | str | None] = {
        "url": run.url,
        "completed": len(ok),
        "failed": len(run.results) - len(ok),
        "duration_s": run.duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / d,
        "output_throughput": out_tokens / d,
        "total_token_throughput": None if in_tokens is None else (in_tokens + out_tokens) / d,
    }
    summary.update(_stats("ttft", [r.ttft for r in ok]))
    summary.update(_stats("tpot", tpot))
    summary.update(_stats("itl", [x for r in ok for x in r.itl]))
    summary.update(_stats("e2el", [r.e2e for r in ok]))
    hits, misses = (_delta(run, "justllm_prefix_cache_hits_total"),
                    _delta(run, "justllm_prefix_cache_misses_total"))
    summary["prefix_cache_hit_ratio"] = (hits / (hits + misses)) if hits is not None and misses is not None and hits + misses > 0 else None
    q, h = _delta(run, "vllm:prefix_cache_queries_total"), _delta(run, "vllm:prefix_cache_hits_total")
    summary["prefix_cache_token_hit_ratio"] = (h / q) if q and h is not None else None
    drafted = _delta(run, "vllm:spec_decode_num_draft_tokens_total")
    accepted = _delta(run, "vllm:spec_decode_num_accepted_tokens_total")
    summary["spec_acceptance_rate"] = (accepted / drafted) if drafted and accepted is not None else None
    errors = [r.error for r in run.results if not r.ok]
    summary["first_error"] = errors[0] if errors else None
    return summary


_ROWS = [
    ("completed", "Successful requests", "{:.0f}"), ("failed", "Failed requests", "{:.0f}"),
    ("duration_s", "Benchmark duration (s)", "{:.2f}"),
    ("total_input_tokens", "Total input tokens", "{:.0f}"),
    ("total_output_tokens", "Total generated tokens", "{:.0f}"),
    ("request_throughput", "Request throughput (req/s)", "{:.2f}"),
    ("output_throughput", "Output token throughput (tok/s)", "{:.2f}"),
    ("total_token_throughput", "Total token throughput (tok/s)", "{:.2f}"),
] + [(f"{s}_{m}_ms", f"{s.capitalize()} {label} (ms)", "{:.2f}")
     for m, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency"))
     for s, _ in PERCENTILES] + [
    ("prefix_cache_hit_ratio", "Prefix cache hit ratio (requests)", "{:.1%}"),
    ("prefix_cache_token_hit_ratio", "Prefix cache hit ratio (tokens)", "{:.1%}"),
    ("spec_acceptance_rate", "Speculation acceptance", "{:.1%}"),
]


def _fmt(fmt: str, v: object) -> str:
    return "-" if v is None else fmt.format(v)


def table(summaries: list[dict]) -> Table:
    t = Table(title="Serving benchmark", box=None, pad_edge=False)
    t.add_column("metric")
    for s in summaries:
        t.add_column(str(s["url"]), justify="right")
    if len(summaries) == 2:
        t.add_column("ratio", justify="right")
    for key, label, fmt in _ROWS:
        values = [s.get(key) for s in summaries]
        cells = [_fmt(fmt, v) for v in values]
        if len(values) == 2:
            a, b = values
            ratio = (a / b) if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None
            cells.append(_fmt("{:.2f}x", ratio))
        t.add_row(label, *cells)
    return t
