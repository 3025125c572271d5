"""The /metrics parser, histogram quantiles and rates behind ``justllm top``, on fixed pages."""

from __future__ import annotations

import math

import pytest

from justllm.tui.metrics import Histogram, Snapshot, histogram_quantile, parse, rate
from tests.tui.pages import GATEWAY_PAGE, gateway_page

M = 'model_name="gemma-3-270m-q4_k_m"'

# The shape justllm's server writes (prometheus_client's generate_latest), trimmed.
PAGE = f"""\
# HELP vllm:num_requests_running Requests in the running batch.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{{M}}} 2.0
# HELP vllm:num_requests_waiting Requests waiting to be scheduled.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{{M}}} 1.0
# HELP justllm_kv_blocks_used KV blocks in use.
# TYPE justllm_kv_blocks_used gauge
justllm_kv_blocks_used{{{M}}} 48.0
# HELP justllm_kv_blocks_total KV blocks in the pool.
# TYPE justllm_kv_blocks_total gauge
justllm_kv_blocks_total{{{M}}} 128.0
# HELP justllm_prefix_cache_hits Requests that reused a cached prefix.
# TYPE justllm_prefix_cache_hits counter
justllm_prefix_cache_hits_total{{{M}}} 3.0
# HELP justllm_prefix_cache_misses Requests that found no cached prefix.
# TYPE justllm_prefix_cache_misses counter
justllm_prefix_cache_misses_total{{{M}}} 1.0
# HELP justllm_prefix_cache_hit_ratio Hits / (hits + misses).
# TYPE justllm_prefix_cache_hit_ratio gauge
justllm_prefix_cache_hit_ratio{{{M}}} 0.75
# HELP justllm_prefix_cache_blocks KV blocks held by the prefix cache.
# TYPE justllm_prefix_cache_blocks gauge
justllm_prefix_cache_blocks{{{M}}} 20.0
# HELP vllm:generation_tokens_total Tokens generated.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{{{M}}} 1000.0
# HELP vllm:generation_tokens_created Tokens generated.
# TYPE vllm:generation_tokens_created gauge
vllm:generation_tokens_created{{{M}}} 1.7e+09
# HELP vllm:time_to_first_token_seconds Time to first token.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{{le="0.1",{M}}} 0.0
vllm:time_to_first_token_seconds_bucket{{le="0.25",{M}}} 2.0
vllm:time_to_first_token_seconds_bucket{{le="0.5",{M}}} 3.0
vllm:time_to_first_token_seconds_bucket{{le="+Inf",{M}}} 4.0
vllm:time_to_first_token_seconds_count{{{M}}} 4.0
vllm:time_to_first_token_seconds_sum{{{M}}} 2.1
"""


def test_parse_reads_every_series_the_dashboard_shows():
    s = parse(PAGE, at=10.0)
    assert s.time == 10.0
    assert s.models == ("gemma-3-270m-q4_k_m",)
    assert (s.running, s.waiting) == (2.0, 1.0)
    assert (s.kv_used, s.kv_total, s.cache_blocks) == (48.0, 128.0, 20.0)
    assert s.kv_usage == 0.375
    assert (s.hit_ratio, s.hits, s.misses) == (0.75, 3.0, 1.0)
    assert s.generation_tokens == 1000.0  # the sample keeps _total though the family drops it
    assert s.ttft == Histogram(((0.1, 0.0), (0.25, 2.0), (0.5, 3.0), (math.inf, 4.0)),
                               count=4.0, sum=2.1)
    assert s.spec_acceptance is None and s.spec_accepted is None
    assert not s.empty


def test_ttft_quantiles_interpolate_inside_buckets():
    s = parse(PAGE)
    assert s.ttft_quantile(0.5) == pytest.approx(0.25)   # rank 2 ends the (0.1, 0.25] bucket
    assert s.ttft_quantile(0.25) == pytest.approx(0.175)  # halfway into (0.1, 0.25]
    assert s.ttft_quantile(0.75) == pytest.approx(0.5)
    assert s.ttft_quantile(0.99) == 0.5  # in the +Inf bucket: the highest finite bound


def test_histogram_quantile_edge_cases():
    # The first bucket starts at 0.
    assert histogram_quantile(0.5, [(1.0, 4.0), (2.0, 4.0), (math.inf, 4.0)]) == 0.5
    assert histogram_quantile(0.9, [(1.0, 0.0), (2.0, 10.0), (math.inf, 10.0)]) == \
        pytest.approx(1.9)
    # No observations, or no +Inf bucket: no answer (Prometheus: NaN).
    assert histogram_quantile(0.5, [(1.0, 0.0), (math.inf, 0.0)]) is None
    assert histogram_quantile(0.5, [(1.0, 3.0), (2.0, 4.0)]) is None
    assert histogram_quantile(0.5, []) is None
    with pytest.raises(ValueError):
        histogram_quantile(1.5, [(1.0, 1.0), (math.inf, 1.0)])


def test_an_empty_page_is_an_empty_snapshot_with_dashes():
    s = parse("", at=1.0)
    assert s.empty
    assert s.models == ()
    assert s.hit_ratio is None and s.kv_usage is None and s.ttft is None
    assert s.ttft_quantile(0.5) is None


def test_ttft_without_observations_has_no_quantile():
    page = "\n".join(
        f'vllm:time_to_first_token_seconds_bucket{{le="{le}",{M}}} 0.0'
        for le in ("0.1", "1.0", "+Inf")) + "\n"
    s = parse("# TYPE vllm:time_to_first_token_seconds histogram\n" + page)
    assert s.ttft is not None and s.ttft_quantile(0.5) is None and s.ttft_quantile(0.99) is None


def test_speculation_acceptance():
    page = PAGE + (
        "# TYPE vllm:spec_decode_num_accepted_tokens counter\n"
        f"vllm:spec_decode_num_accepted_tokens_total{{{M}}} 30.0\n"
        "# TYPE vllm:spec_decode_num_draft_tokens counter\n"
        f"vllm:spec_decode_num_draft_tokens_total{{{M}}} 40.0\n")
    assert parse(page).spec_acceptance == 0.75
    no_drafts = page.replace("_draft_tokens_total{" + M + "} 40.0", "_draft_tokens_total{" + M + "} 0.0")
    assert parse(no_drafts).spec_acceptance is None


def test_series_of_several_models_are_summed_and_the_ratio_recomputed():
    page = (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{model_name="a"} 1.0\n'
        'vllm:num_requests_running{model_name="b"} 2.0\n'
        "# TYPE justllm_prefix_cache_hits counter\n"
        'justllm_prefix_cache_hits_total{model_name="a"} 1.0\n'
        'justllm_prefix_cache_hits_total{model_name="b"} 0.0\n'
        "# TYPE justllm_prefix_cache_misses counter\n"
        'justllm_prefix_cache_misses_total{model_name="a"} 1.0\n'
        'justllm_prefix_cache_misses_total{model_name="b"} 2.0\n'
        "# TYPE justllm_prefix_cache_hit_ratio gauge\n"
        'justllm_prefix_cache_hit_ratio{model_name="a"} 0.5\n'
        'justllm_prefix_cache_hit_ratio{model_name="b"} 0.0\n'
        "# TYPE vllm:time_to_first_token_seconds histogram\n"
        'vllm:time_to_first_token_seconds_bucket{le="1.0",model_name="a"} 1.0\n'
        'vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="a"} 1.0\n'
        'vllm:time_to_first_token_seconds_bucket{le="1.0",model_name="b"} 0.0\n'
        'vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="b"} 1.0\n')
    s = parse(page)
    assert s.models == ("a", "b")
    assert s.running == 3.0
    assert (s.hits, s.misses, s.hit_ratio) == (1.0, 3.0, 0.25)
    assert s.ttft.buckets == ((1.0, 1.0), (math.inf, 2.0))


def test_hit_ratio_from_counters_when_the_gauge_is_missing():
    page = PAGE.replace("justllm_prefix_cache_hit_ratio{" + M + "} 0.75\n", "")
    assert parse(page).hit_ratio == 0.75


def test_malformed_page_raises_value_error():
    with pytest.raises(ValueError):
        parse("vllm:num_requests_running{model_name=} not-a-number\n")


def test_rate_between_two_snapshots():
    a = Snapshot(time=10.0, generation_tokens=1000.0)
    b = Snapshot(time=12.0, generation_tokens=1100.0)
    assert rate(a, b) == 50.0
    assert rate(None, b) is None
    assert rate(b, b) is None  # no time elapsed
    assert rate(Snapshot(time=10.0), b) is None  # the counter was missing
    assert rate(parse(PAGE, at=1.0), parse(PAGE.replace("} 1000.0", "} 1250.0"), at=1.5)) == 500.0


def test_a_rate_needs_a_baseline_of_the_same_counter():
    """What the server generated before a baseline was seen is never a sample."""
    running = Snapshot(time=10.0, generation_tokens=100_000.0)
    assert rate(None, running) is None  # the first reading only sets the baseline
    assert rate(Snapshot(time=9.0), running) is None  # the page had no counter yet (loading)
    # The counter went down: the server restarted. Its new count holds everything generated
    # since, before the dashboard saw it; it is the new baseline, not an increase.
    restarted = Snapshot(time=12.0, generation_tokens=5000.0)
    assert rate(running, restarted) is None
    assert rate(restarted, Snapshot(time=14.0, generation_tokens=5128.0)) == 64.0
    # A model's series appeared (or went): the sum is not the same counter any more.
    one = Snapshot(time=10.0, models=("a",), generation_tokens=100.0)
    two = Snapshot(time=11.0, models=("a", "b"), generation_tokens=90_164.0)
    assert rate(one, two) is None
    assert rate(two, Snapshot(time=12.0, models=("a", "b"), generation_tokens=90_228.0)) == 64.0


def test_a_single_model_page_has_that_model_alone_per_model():
    s = parse(PAGE, at=3.0)
    assert not s.gateway and s.loaded is None and s.waiting_for_load is None
    assert list(s.per_model) == ["gemma-3-270m-q4_k_m"]
    m = s.per_model["gemma-3-270m-q4_k_m"]
    assert m.loaded is True  # its series are on the page: it is up
    assert (m.time, m.models) == (3.0, ("gemma-3-270m-q4_k_m",))
    assert (m.running, m.kv_usage, m.hit_ratio, m.generation_tokens) == (2.0, 0.375, 0.75, 1000.0)
    assert m.ttft == s.ttft


def test_a_gateway_page_sums_every_model_and_keeps_each_one():
    s = parse(GATEWAY_PAGE, at=5.0)
    assert s.gateway and s.waiting_for_load == 2.0
    assert s.models == ("chat", "coder")  # the models with series of their own: the runners
    assert list(s.per_model) == ["chat", "coder", "embed"]  # every configured model, page order
    # All models: sums, the hit ratio recomputed from the counters, the histograms merged.
    assert (s.running, s.waiting, s.kv_used, s.kv_total, s.cache_blocks) == (3, 1, 148, 384, 80)
    assert (s.hits, s.misses, s.hit_ratio) == (4.0, 4.0, 0.5)
    assert s.generation_tokens == 1500.0 and s.spec_acceptance == 0.75
    assert s.ttft.buckets == ((0.1, 0.0), (0.25, 2.0), (0.5, 3.0), (1.0, 8.0), (math.inf, 8.0))
    chat, coder, embed = (s.per_model[m] for m in ("chat", "coder", "embed"))
    assert (chat.time, chat.models, chat.loaded, chat.gateway) == (5.0, ("chat",), True, True)
    assert (chat.running, chat.waiting, chat.kv_used, chat.kv_total) == (2, 1, 48, 128)
    assert (chat.hits, chat.misses, chat.hit_ratio, chat.cache_blocks) == (3, 1, 0.75, 20)
    assert chat.generation_tokens == 1000.0 and chat.spec_acceptance is None
    assert chat.ttft == Histogram(((0.1, 0.0), (0.25, 2.0), (0.5, 3.0), (1.0, 4.0),
                                   (math.inf, 4.0)), count=4.0, sum=1.1)
    assert (coder.running, coder.waiting, coder.kv_usage) == (1, 0, 100 / 256)
    assert (coder.hits, coder.misses, coder.hit_ratio) == (1, 3, 0.25)
    assert coder.generation_tokens == 500.0 and coder.spec_acceptance == 0.75
    assert coder.ttft_quantile(0.5) == pytest.approx(0.75)
    # Configured, not loaded: the gateway names it, nothing else does.
    assert embed.loaded is False and embed.empty and embed.models == ("embed",)
    # Replicas in the rotation, by role (a disaggregated model's prefill and decode replicas).
    assert chat.replicas_up == (("both", 1),) and embed.replicas_up == ()
    assert coder.replicas_up == (("decode", 2), ("prefill", 1))
    assert embed.running is None and embed.hit_ratio is None and embed.ttft is None


def test_the_gateway_says_which_models_are_loaded():
    page = GATEWAY_PAGE.replace('model_loaded{model_name="coder"} 1',
                                'model_loaded{model_name="coder"} 0')
    s = parse(page)
    assert [m.loaded for m in s.per_model.values()] == [True, False, False]
    # Its runner's series are still on the page (it is stopping): they are shown.
    assert s.per_model["coder"].running == 1.0


def test_a_rate_per_model_follows_the_same_baseline_rules():
    a = parse(gateway_page(1000, 500), at=10.0)
    b = parse(gateway_page(1640, 820), at=20.0)
    assert rate(a, b) == 96.0
    assert rate(a.per_model["chat"], b.per_model["chat"]) == 64.0
    assert rate(a.per_model["coder"], b.per_model["coder"]) == 32.0
    assert rate(a.per_model["embed"], b.per_model["embed"]) is None  # not loaded: no counter
    assert rate(None, b.per_model["chat"]) is None  # the first reading only sets the baseline
    # coder's runner restarted: its counter went down. The sum went up (chat's tokens hide
    # the drop) but is no counter across a restart either; chat's own rate is unaffected.
    c = parse(gateway_page(2640, 10), at=30.0)
    assert c.generation_tokens > b.generation_tokens
    assert rate(b, c) is None
    assert rate(b.per_model["coder"], c.per_model["coder"]) is None
    assert rate(b.per_model["chat"], c.per_model["chat"]) == 100.0
    # embed loads: the sum gains a counter (a new baseline); the others go on.
    loaded = (GATEWAY_PAGE.replace('model_loaded{model_name="embed"} 0',
                                   'model_loaded{model_name="embed"} 1')
              .replace('vllm:generation_tokens_total{model_name="coder"} 500.0',
                       'vllm:generation_tokens_total{model_name="coder"} 500.0\n'
                       'vllm:generation_tokens_total{model_name="embed"} 7.0'))
    d = parse(loaded, at=20.0)
    assert d.models == ("chat", "coder", "embed") and d.per_model["embed"].loaded
    assert rate(parse(GATEWAY_PAGE, at=10.0), d) is None
    assert rate(a.per_model["coder"], d.per_model["coder"]) == 0.0
    assert rate(a.per_model["embed"], d.per_model["embed"]) is None


def test_a_replica_left_off_one_page_is_no_spike():
    """A gateway leaves a replica slow to answer off one page: the model's sum dipped (a new
    baseline), then the replica came back and its whole counter counted as new tokens."""
    def page(*counts: float | None) -> str:
        return "# TYPE vllm:generation_tokens counter\n" + "".join(
            f'vllm:generation_tokens_total{{model_name="m",replica="{i}"}} {c}\n'
            for i, c in enumerate(counts) if c is not None)

    a, b, c = parse(page(110, 50010), at=1.0), parse(page(120, None), at=2.0), \
        parse(page(130, 50030), at=3.0)
    assert rate(a, b) is None and rate(b, c) is None  # (it read 50030 tok/s)
    assert rate(a.per_model["m"], b.per_model["m"]) is None
    assert rate(c, parse(page(140, 50070), at=4.0)) == 50.0


def test_a_nan_gauge_is_no_reading():
    """top crashed drawing the KV bar: cannot convert float NaN to integer."""
    s = parse(PAGE.replace("justllm_kv_blocks_total{" + M + "} 128.0",
                           "justllm_kv_blocks_total{" + M + "} NaN"))
    assert s.kv_total is None and s.kv_usage is None and s.running == 2.0
