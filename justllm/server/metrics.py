"""Prometheus metrics with vLLM's names (so existing dashboards work) and justllm's own.

Each app owns its registry (no global state). Gauges are read from the engine at scrape time by
a collector, with the engine's token counters; request counters and histograms are fed as
requests finish.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from justllm.engine.engine import EngineStats, RequestMetrics, RequestOutput

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
# vLLM's build_1_2_5_buckets, up to a million tokens (vLLM stops at max_model_len)
_TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(6) for m in (1, 2, 5)) + (1e6,)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats], model: str,
                 embedded_tokens: Callable[[], int] = lambda: 0) -> None:
        self._stats = stats
        self._model = model
        self._embedded_tokens = embedded_tokens  # /v1/embeddings' (not the engine's)

    def collect(self) -> Iterator:
        s = self._stats()
        labels = ["model_name"]
        v = [self._model]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(v, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(v, value)
            return c

        yield gauge("vllm:num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        # As vLLM counts it: blocks running requests use. The prefix cache's blocks that no
        # request uses are freed on demand, so they count as free (an idle server read 100%).
        in_use = s.kv_blocks.used - s.prefix_cache.idle_blocks
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks running requests use "
                    "(0-1; the prefix cache's idle blocks count as free, as in vLLM).",
                    in_use / s.kv_blocks.total if s.kv_blocks.total else 0.0)
        # Counted by the engine as tokens are computed and generated, aborted requests included.
        yield counter("vllm:prompt_tokens", "Prompt tokens processed (embedding inputs too).",
                      s.prompt_tokens_total + self._embedded_tokens())
        yield counter("vllm:generation_tokens", "Tokens generated.", s.generation_tokens_total)
        yield counter("vllm:num_preemptions", "Requests preempted for lack of KV blocks.",
                      s.num_preemptions_total)
        yield gauge("justllm_kv_blocks_used", "KV blocks in use.", s.kv_blocks.used)
        yield gauge("justllm_kv_blocks_free", "KV blocks free.", s.kv_blocks.free)
        yield gauge("justllm_kv_blocks_total", "KV blocks in the pool.", s.kv_blocks.total)
        pc = s.prefix_cache
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      pc.queried_tokens)
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      pc.hit_tokens)
        yield counter("justllm_prefix_cache_hits", "Requests that reused a cached prefix.", pc.hits)
        yield counter("justllm_prefix_cache_misses", "Requests that found no cached prefix.",
                      pc.misses)
        yield gauge("justllm_prefix_cache_hit_ratio", "Hits / (hits + misses).", pc.hit_ratio)
        yield gauge("justllm_prefix_cache_blocks", "KV blocks held by the prefix cache.", pc.blocks)
        yield gauge("justllm_prefix_cache_idle_blocks", "Prefix-cache blocks no running request "
                    "uses (freed on demand).", pc.idle_blocks)
        hc = s.host_cache
        yield gauge("justllm_host_cache_bytes", "Bytes of cached prefixes in host memory "
                    "(--cache-ram).", hc.bytes)
        yield gauge("justllm_host_cache_tokens", "Tokens of the prefixes in host memory.",
                    hc.tokens)
        yield counter("justllm_host_cache_stored", "Prefixes moved from the KV to host memory.",
                      hc.stored)
        yield counter("justllm_host_cache_restored", "Prefixes copied back into the KV for a "
                      "request.", hc.restored)
        sp = s.spec
        yield counter("vllm:spec_decode_num_drafts", "Drafts verified (one per request and step).",
                      sp.num_drafts)
        yield counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified by the model.",
                      sp.num_draft_tokens)
        yield counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                      sp.num_accepted_tokens)
        yield gauge("justllm_spec_decode_acceptance_rate", "Accepted / draft tokens.",
                    sp.acceptance_rate)
        yield gauge("justllm_lora_adapters", "LoRA adapters loaded.", s.lora_adapters)
        yield counter("justllm_lora_switches", "Changes of the LoRA adapter set applied to the "
                      "context (each step serves one set).", s.lora_switches)


class _PluginCollector(Collector):
    """``on_request_finished`` deliveries per plugin and outcome (plugins/events.py)."""

    def __init__(self, counts: Callable[[], Mapping[str, Any]], model: str) -> None:
        self._counts = counts
        self._model = model  # (as on every series: router mode merges models' pages)

    def collect(self) -> Iterator:
        family = CounterMetricFamily(
            "justllm_plugin_request_records", "Finished-request records handed to plugins' "
            "on_request_finished, by outcome (delivered, failed: the plugin raised, dropped: "
            "its queue was full).", labels=["model_name", "plugin", "outcome"])
        for plugin, c in self._counts().items():
            for outcome in ("delivered", "failed", "dropped"):
                family.add_metric([self._model, plugin, outcome], getattr(c, outcome))
        yield family


class ServerMetrics:
    def __init__(self, stats: Callable[[], EngineStats], model: str,
                 plugin_counts: Callable[[], Mapping[str, Any]] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._embedded_tokens = 0  # tokens of /v1/embeddings inputs (a second context's)
        self.registry.register(_EngineCollector(stats, model, lambda: self._embedded_tokens))
        if plugin_counts is not None:
            self.registry.register(_PluginCollector(plugin_counts, model))
        lab = ["model_name"]
        r = self.registry
        self._model = model
        self.request_success = Counter("vllm:request_success", "Finished requests.",
                                       lab + ["finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", lab,
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between tokens.", lab,
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency.", lab,
                             buckets=_E2E_BUCKETS, registry=r)
        # A finished request's phases and sizes, as vLLM's V1 engine reports them (its Grafana
        # dashboard draws them): queued until first scheduled, then the prefill until the
        # first token, the decode until the last, and the two together.
        self.phases = {name: Histogram(f"vllm:request_{name}_time_seconds", doc, lab,
                                       buckets=_E2E_BUCKETS, registry=r)
                       for name, doc in (
                           ("queue", "Time in the waiting queue before first scheduled."),
                           ("prefill", "Time from first scheduled to the first token."),
                           ("decode", "Time from the first token to the last."),
                           ("inference", "Time from first scheduled to the last token."))}
        self.request_prompt_tokens = Histogram(
            "vllm:request_prompt_tokens", "Prompt tokens of finished requests.", lab,
            buckets=_TOKEN_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram(
            "vllm:request_generation_tokens", "Generated tokens of finished requests.", lab,
            buckets=_TOKEN_BUCKETS, registry=r)
        # Prefill/decode disaggregation (server/pd.py).
        self.pd_exports = Counter("justllm_pd_exports", "Prompts prefilled and exported.", lab,
                                  registry=r)
        self.pd_imports = Counter("justllm_pd_imports", "Exported prompts imported.", lab,
                                  registry=r)
        self.pd_prefills_aborted = Counter(
            "justllm_pd_prefills_aborted", "Prompts whose prefill stopped because the "
            "gateway (its client) left.", lab, registry=r)
        self.pd_import_failures = Counter(
            "justllm_pd_import_failures", "Hand-overs refused: the KV (reason refused or "
            "truncated: the prompt computed here) or the first tokens (handover: the request "
            "served whole here).",
            lab + ["reason"], registry=r)
        # Requests that ran under LoRA adapters, by adapter set ("a", or "a+b" for several).
        lora = lab + ["lora_name"]
        self.lora_requests = Counter("justllm_lora_requests", "Finished requests per LoRA "
                                     "adapter set.", lora, registry=r)
        self.lora_prompt_tokens = Counter("justllm_lora_prompt_tokens", "Prompt tokens of "
                                          "finished requests per LoRA adapter set.", lora,
                                          registry=r)
        self.lora_generation_tokens = Counter("justllm_lora_generation_tokens", "Generated "
                                              "tokens per LoRA adapter set.", lora, registry=r)
        self.pd_bytes = Counter("justllm_pd_bytes", "KV bytes exported or imported.",
                                lab + ["direction"], registry=r)
        self.pd_seconds = Histogram("justllm_pd_transfer_seconds",
                                    "Export or import time (llama.cpp state and checks).",
                                    lab + ["direction"], buckets=_ITL_BUCKETS, registry=r)

    def observe_finished(self, m: RequestMetrics, finish_reason: str | None,
                         error: bool = False, end: float | None = None) -> None:
        """A request the engine ended: ``finish_reason`` stop or length, else error or abort
        (as vLLM labels them; a failed request's output says ``abort`` beside its error).
        ``end``: when it ended, for one the server ended itself (the engine, which aborted it,
        set no finish time); one failed or ended by a shutdown, with none either, ended now."""
        lab = self._model
        end = (m.finished_time if m.finished_time is not None else end if end is not None
               else time.perf_counter())
        self.request_success.labels(lab, "error" if error else finish_reason or "abort").inc()
        if m.lora:
            self.lora_requests.labels(lab, m.lora).inc()
            self.lora_prompt_tokens.labels(lab, m.lora).inc(m.num_prompt_tokens)
            self.lora_generation_tokens.labels(lab, m.lora).inc(m.num_generated_tokens)
        self._observe_gaps(m)
        self.e2e.labels(lab).observe(end - m.arrival_time)
        self.request_prompt_tokens.labels(lab).observe(m.num_prompt_tokens)
        self.request_generation_tokens.labels(lab).observe(m.num_generated_tokens)
        for name, seconds in _phases(m, end).items():
            self.phases[name].labels(lab).observe(seconds)

    def observe_first_token(self, m: RequestMetrics | None) -> bool:
        """The time to first token, once that token is out (as vLLM observes it), whether
        the request then ends or its client leaves: observed at the end, a long answer's slow
        start stayed out of the gateway's recent TTFT (and ``justllm ps``) until it ended.
        True once observed."""
        if m is None or m.ttft is None:
            return False
        self.ttft.labels(self._model).observe(m.ttft)
        return True

    def observe_embeddings(self, tokens: int, seconds: float) -> None:
        """An embeddings request that was answered: counted as vLLM counts a pooling request
        (a finished request, its latency, its input in the prompt tokens)."""
        self._embedded_tokens += tokens
        self.request_success.labels(self._model, "stop").inc()
        self.e2e.labels(self._model).observe(seconds)

    def observe_aborted(self, arrival: float, m: RequestMetrics | None = None) -> None:
        """A request whose client left before it ended (vLLM's ``abort``): counted, with its
        latency until then (``arrival``: perf_counter time) and, with its metrics ``m``, the
        gaps between the tokens it had (vLLM observes them as they come: a client that left
        a stream took its gaps out of the histogram)."""
        self.request_success.labels(self._model, "abort").inc()
        self.e2e.labels(self._model).observe(time.perf_counter() - arrival)
        if m is not None:
            self._observe_gaps(m)

    def _observe_gaps(self, m: RequestMetrics) -> None:
        """The inter-token latencies of ``m``'s tokens: once per step that gave the request
        tokens, as vLLM observes it (a verified draft's tokens share their step's time, and
        each gap of 0 between them read as a latency)."""
        times = sorted(set(m.token_times))
        for a, b in zip(times, times[1:]):
            self.itl.labels(self._model).observe(b - a)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def failed(out: RequestOutput) -> bool:
    """Whether a finished output counts as vLLM's ``error``: the engine ended the request
    with an error; a shutdown's abort (503 shutting_down) is an ``abort``, as in vLLM and the
    request's record."""
    return bool(out.error) and out.error_code != "shutting_down"


def _phases(m: RequestMetrics, end: float) -> dict[str, float]:
    """The phases of a request that ended at ``end`` (one never scheduled only queued; one
    without a token has no decode)."""
    scheduled, first = m.scheduled_time, m.first_token_time
    if scheduled is None:
        return {"queue": end - m.arrival_time}
    if first is not None and first < scheduled:
        scheduled = first  # resumed from a PD hand-over: its prefill (and first token) was
        # on the prefill replica; here it waited for nothing before that token (as records)
    out = {"queue": scheduled - m.arrival_time, "inference": end - scheduled}
    if first is not None:
        out |= {"prefill": first - scheduled, "decode": end - first}
    return out
