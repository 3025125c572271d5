"""The /metrics parser, histogram quantiles and rates behind ``justllm top``, on fixed pages."""

from __future__ import annotations

import math

import pytest

from justllm.tui.metrics import Histogram, Snapshot, histogram_quantile, parse, rate

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
