"""The pure parts of replicas: the autoscaler's rule, a replica's load as routing sees it,
recent TTFT from histogram readings, what a request is routed by, the replica label on relayed
metrics, and the replica keys of models.yaml (no processes)."""

from __future__ import annotations

import json

import pytest

from justllm.gateway.autoscale import AutoscaleConfig, Pending, decide, to_retire, wanted
from justllm.gateway.config import Flags, load_config
from justllm.gateway.metrics import merge_pages, with_label
from justllm.gateway.policy import gpu_for_new, prompt_tokens_estimate
from justllm.gateway.replica import Replica, recent_quantile
from justllm.gateway.routing import route_text
from justllm.tui.metrics import Histogram, parse

SCALE = AutoscaleConfig(min_replicas=1, max_replicas=4, target_ongoing=2,
                        upscale_delay=10, downscale_delay=60)


# ---- the autoscaler ---------------------------------------------------------------------------


def test_wanted_is_load_over_target_rounded_up_within_the_bounds():
    assert [wanted(SCALE, load) for load in (0, 1, 2, 2.5, 4, 5, 100)] == [1, 1, 1, 2, 2, 3, 4]
    assert wanted(AutoscaleConfig(0, 2), 0) == 1  # while loaded, one (zero is the ttl's)
    assert wanted(AutoscaleConfig(3, 5), 0) == 3


def test_scaling_up_waits_for_the_upscale_delay_and_jumps_to_the_wanted_count():
    scale, pending = decide(SCALE, 1, 7, now=100.0, pending=None)
    assert scale is None and pending == Pending(4, 100.0)
    scale, pending = decide(SCALE, 1, 5, now=105.0, pending=pending)  # still up: same wish
    assert scale is None and pending == Pending(3, 100.0)
    scale, pending = decide(SCALE, 1, 5, now=110.0, pending=pending)
    assert scale is not None and (scale.target, scale.direction) == (3, "up")
    assert "above the target of 2" in scale.reason and "10 s" in scale.reason
    assert pending is None


def test_a_scale_up_to_the_floor_says_so():
    """A pool that lost its replica was scaled up "0.0 requests per replica, above the target
    of 2": the reason is min-replicas."""
    _, pending = decide(SCALE, 0, 0, now=0.0, pending=None)
    scale, _ = decide(SCALE, 0, 0, now=10.0, pending=pending)
    assert scale is not None and scale.target == 1
    assert scale.reason == "0 serving, fewer than min-replicas 1, for 10 s"


def test_a_burst_shorter_than_the_delay_changes_nothing():
    _, pending = decide(SCALE, 1, 8, now=0.0, pending=None)
    scale, pending = decide(SCALE, 1, 2, now=5.0, pending=pending)  # back to target: forgotten
    assert scale is None and pending is None
    scale, pending = decide(SCALE, 1, 8, now=9.0, pending=pending)  # a new burst starts over
    assert scale is None and pending == Pending(4, 9.0)


def test_scaling_down_waits_for_the_downscale_delay_and_a_change_of_direction_restarts_it():
    _, pending = decide(SCALE, 3, 0, now=0.0, pending=None)
    assert pending == Pending(1, 0.0)
    scale, pending = decide(SCALE, 3, 8, now=30.0, pending=pending)  # up now: a new wish
    assert scale is None and pending == Pending(4, 30.0)
    _, pending = decide(SCALE, 3, 1, now=31.0, pending=pending)
    scale, _ = decide(SCALE, 3, 1, now=90.0, pending=pending)
    assert scale is None  # 59 s below target since the direction changed
    scale, _ = decide(SCALE, 3, 1, now=91.0, pending=pending)
    assert scale is not None and (scale.target, scale.direction) == (1, "down")


def test_a_scale_down_goes_to_the_most_replicas_wanted_during_its_delay():
    """Steady load for 3 replicas of 4, with a lull at the moment of the decision: it went to
    1 replica, and the upscale delay later back to 3."""
    current, pending, decisions = 4, None, []
    for now in range(0, 80):
        load = 1 if now == 60 else 5  # 3 replicas wanted, but at the 60th second
        scale, pending = decide(SCALE, current, load, float(now), pending)
        if scale is not None:
            decisions.append((now, scale.direction, scale.target))
            current = scale.target
    assert decisions == [(60, "down", 3)]
    # A replica lost meanwhile meets the wish: it starts over (it was a "down to 2" of 2)
    _, pending = decide(SCALE, 3, 4, now=0.0, pending=None)
    assert pending == Pending(2, 0.0)
    scale, pending = decide(SCALE, 2, 0, now=60.0, pending=pending)
    assert scale is None and pending == Pending(1, 60.0)


def test_a_scale_down_stops_replicas_out_of_the_rotation_first_then_the_least_busy():
    ready = [Replica(str(i), remote=f"http://127.0.0.1:{9000 + i}", status="ready",
                     in_flight=load) for i, load in ((0, 3), (1, 0), (2, 0))]
    # of equals, the newest; never the busiest while an idle one is there
    assert [r.id for r in to_retire(ready, 1)] == ["2", "1"]
    assert to_retire(ready, 3) == [] and to_retire(ready, 5) == []
    # A replica restarting (its process died) goes before the ready one, however idle:
    # keeping it and stopping the ready one left the model with none to serve.
    # (Both idle: the newest, the ready one, went.)
    restarting = Replica("1", remote="http://127.0.0.1:9001", status="restarting")
    serving = [restarting, Replica("3", remote="http://127.0.0.1:9003", status="ready")]
    assert to_retire(serving, 1) == [restarting]
    unhealthy = Replica("4", remote="http://127.0.0.1:9004", status="unhealthy")
    assert to_retire([*ready, unhealthy], 3) == [unhealthy]


def test_bounds_and_options_are_checked():
    for bad in (dict(min_replicas=-1, max_replicas=2), dict(min_replicas=3, max_replicas=2),
                dict(min_replicas=0, max_replicas=0),
                dict(min_replicas=1, max_replicas=2, target_ongoing=0),
                dict(min_replicas=1, max_replicas=2, upscale_delay=-1)):
        with pytest.raises(ValueError):
            AutoscaleConfig(**bad)


# ---- a replica as routing sees it ------------------------------------------------------------

PAGE = """\
vllm:num_requests_running{model_name="m"} 3.0
vllm:num_requests_waiting{model_name="m"} 2.0
justllm_kv_blocks_used{model_name="m"} 32.0
justllm_kv_blocks_total{model_name="m"} 64.0
justllm_prefix_cache_hits_total{model_name="m"} 3.0
justllm_prefix_cache_misses_total{model_name="m"} 1.0
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 4.0
vllm:time_to_first_token_seconds_bucket{le="1.0",model_name="m"} 4.0
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 4.0
vllm:time_to_first_token_seconds_count{model_name="m"} 4.0
vllm:time_to_first_token_seconds_sum{model_name="m"} 0.2
"""


def test_a_replicas_load_is_the_gateways_in_flight_plus_what_others_sent_it():
    r = Replica("0")
    r.in_flight = 2
    r.observe(parse(PAGE), now=1.0)  # 5 running + waiting, 2 of them ours
    assert r.others == 3 and r.load_total == 5
    assert r.kv_usage == 0.5 and r.hit_ratio == 0.75
    r.in_flight = 6  # a burst sent since the poll counts at once
    load = r.load()
    assert (load.running, load.waiting, load.load) == (3, 6, 9)
    assert not load.healthy  # status "starting" and no process: not in the rotation
    assert Replica("http://h:1", remote="http://h:1", status="ready").load(skip=True).skip


def test_recent_ttft_is_the_median_of_the_first_tokens_since_the_window_began():
    r = Replica("0")
    r.observe(parse(PAGE), now=0.0)
    assert r.ttft_p50 == pytest.approx(0.05)  # the first reading: everything so far
    slow = PAGE.replace('le="0.1",model_name="m"} 4.0', 'le="0.1",model_name="m"} 4.0') \
        .replace('le="1.0",model_name="m"} 4.0', 'le="1.0",model_name="m"} 8.0') \
        .replace('le="+Inf",model_name="m"} 4.0', 'le="+Inf",model_name="m"} 8.0') \
        .replace("seconds_count{model_name=\"m\"} 4.0", "seconds_count{model_name=\"m\"} 8.0")
    r.observe(parse(slow), now=1.0)
    assert 0.1 < r.ttft_p50 <= 1.0  # the four new ones were all slow
    r.observe(parse(slow), now=2.0)  # nothing new, but the slow ones are in the window
    assert 0.1 < r.ttft_p50 <= 1.0
    r.observe(parse(slow), now=40.0)  # none in the last 30 s: no recent figure (it stayed)
    assert r.ttft_p50 is None
    before = Histogram(((0.1, 4.0), (float("inf"), 4.0)), count=4)
    after = Histogram(((0.1, 1.0), (float("inf"), 1.0)), count=1)  # restarted: counts fell
    assert recent_quantile(before, after, 0.5) == pytest.approx(0.05)


def test_the_first_request_of_a_new_runner_stays_in_its_recent_ttft():
    """A runner's page has no TTFT histogram before its first request; the first page that has
    one was its own baseline at the next poll, so the median went back to none."""
    no_ttft = "\n".join(line for line in PAGE.splitlines() if "time_to_first_token" not in line)
    r = Replica("0")
    r.observe(parse(no_ttft), now=0.0)
    assert r.ttft_p50 is None
    r.observe(parse(PAGE), now=1.0)
    assert r.ttft_p50 == pytest.approx(0.05)
    r.observe(parse(PAGE), now=2.0)  # a new reading, the same counts
    assert r.ttft_p50 == pytest.approx(0.05)
    r.observe(parse(PAGE), now=40.0)
    assert r.ttft_p50 is None


# ---- what a request is routed by -------------------------------------------------------------


def test_route_text_of_chat_completions_and_embeddings():
    chat = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}
    turn2 = {"messages": [*chat["messages"], {"role": "assistant", "content": "Hello"},
                          {"role": "user", "content": "More"}]}
    assert route_text(chat) == "<system>Be brief.\n<user>Hi\n"
    assert route_text(turn2).startswith(route_text(chat))  # a follow-up extends its prefix
    assert route_text({"prompt": "Once upon"}) == "Once upon"
    assert route_text({"prompt": ["first", "second"]}) == "first"
    assert route_text({"prompt": [1, 2, 3]}) == "1,2,3,"
    assert route_text({"prompt": [1, 2, 3, 4]}).startswith(route_text({"prompt": [1, 2, 3]}))
    assert route_text({"prompt": [[5, 6], [7]]}) == "5,6,"
    assert route_text({"input": "embed me"}) == "embed me"
    assert route_text({"prompt": None}) == "" and route_text({}) == ""


# ---- metrics ----------------------------------------------------------------------------------


def test_relayed_series_get_a_replica_label_and_families_merge():
    a = with_label('# HELP x X\n# TYPE x gauge\nx{model_name="m"} 1.0\ny 2\n', "replica", "0")
    b = with_label('# HELP x X\n# TYPE x gauge\nx{model_name="m"} 3.0\n', "replica", "1")
    assert 'x{model_name="m",replica="0"} 1.0' in a and 'y{replica="0"} 2' in a
    merged = merge_pages([a, b])
    assert merged.count("# TYPE x gauge") == 1
    assert 'x{model_name="m",replica="1"} 3.0' in merged


# ---- models.yaml ------------------------------------------------------------------------------

FLAGS = Flags(frozenset({"max-seqs", "gpu"}), switches=frozenset({"gpu"}))


def model(**entry):
    return load_config({"models": {"m": {"source": "x.gguf", **entry}}}, FLAGS).models[0]


def test_replica_keys_of_a_model():
    spec = model(replicas=2, gpus=[0, 1, 2], routing="round-robin")
    assert (spec.replicas, spec.routing.policy, spec.autoscale) == (2, "round-robin", None)
    assert [spec.gpu_of(i) for i in range(4)] == [0, 1, 2, 0]
    scaled = model(**{"min-replicas": 1, "max-replicas": 3, "target-ongoing": 4,
                      "upscale-delay": 5})
    assert scaled.autoscale == AutoscaleConfig(1, 3, 4.0, 5.0, 600.0)
    assert scaled.ttl < 0 and scaled.preload  # min-replicas 1: always up
    to_zero = model(**{"min-replicas": 0, "max-replicas": 2, "ttl": 30})
    assert to_zero.ttl == 30 and not to_zero.preload and to_zero.replicas == 1
    remote = load_config({"models": {"r": {"urls": ["http://10.0.0.7:8080/"]}}}, FLAGS)
    assert remote.models[0].urls == ("http://10.0.0.7:8080",)
    assert remote.models[0].replicas == 0
    mixed = model(urls=["http://a:1"], routing={"policy": "cache-aware",
                                                "balance-abs-threshold": 8})
    assert mixed.replicas == 1 and mixed.routing.balance_abs_threshold == 8


def test_a_replica_the_autoscaler_adds_takes_the_first_gpu_slot_nobody_fills():
    assert [gpu_for_new([0, 1], held) for held in ([], [0], [1], [0, 1], [0, 0])] == \
        [0, 1, 0, 0, 1]
    assert [gpu_for_new([0, 0, 1], held) for held in ([0], [0, 0], [0, 1], [0, 0, 1])] == \
        [0, 1, 0, 0]  # a GPU listed twice takes two replicas a round


def test_a_replica_is_overloaded_by_one_batch_of_its_own():
    """balance-abs-threshold defaults to the model's max-seqs (a replica of max-seqs 4 with 28
    requests more than an idle one kept its prefixes at SGLang's 32); one given is kept."""
    assert model().routing.balance_abs_threshold == 32
    assert model(**{"max-seqs": 4}).routing.balance_abs_threshold == 4
    assert model(**{"max-seqs": 4}, routing="least-load").routing.balance_abs_threshold == 4
    given = model(**{"max-seqs": 4}, routing={"balance-abs-threshold": 10})
    assert given.routing.balance_abs_threshold == 10
    pd = model(**{"max-seqs": 6, "prefill-replicas": 1, "decode-replicas": 1})
    assert pd.routing.balance_abs_threshold == 6
    gateway_wide = load_config({"models": {"m": {"source": "x.gguf"}}},
                               Flags(FLAGS.names, {"max-seqs": 12}, switches=FLAGS.switches))
    assert gateway_wide.models[0].routing.balance_abs_threshold == 12


@pytest.mark.parametrize(("entry", "message"), [
    ({"replicas": 0}, "replicas must be >= 1 (or, in router mode, give urls)"),
    ({"replicas": "2"}, "replicas must be an integer"),
    ({"replicas": 2, "max-replicas": 3}, "not both"),
    ({"min-replicas": 3, "max-replicas": 2}, "max-replicas >= max(1, min-replicas)"),
    ({"min-replicas": 1, "ttl": 10}, "ttl unloads an idle model"),
    # (loaded at start-up all the same, without a word)
    ({"max-replicas": 2, "preload": False}, "preload: false loads the model at its first"),
    ({"max-replicas": 2, "urls": ["http://a:1"]}, "fixed set"),
    ({"urls": ["ftp://a"]}, "http(s)://"),
    ({"urls": ["http://"]}, "http(s)://HOST[:PORT]"),  # (accepted, then polled for ever)
    ({"urls": ["http://a:1", "http://a:1"]}, "listed twice"),
    ({"gpus": [0, "1"]}, "device numbers"),
    ({"routing": "fastest"}, "routing policy must be one of"),
    ({"max-replicas": 2, "target-ongoing": 0}, "target-ongoing must be > 0"),
    # Alone these made an autoscaler of one replica, always loaded, without a word.
    ({"upscale-delay": 3}, "upscale-delay tune the autoscaler, which needs its bounds"),
    ({"replicas": 2, "target-ongoing": 3}, "the autoscaler's keys (target-ongoing), not both"),
])
def test_bad_replica_keys_are_one_clear_error(entry, message):
    with pytest.raises(ValueError, match=None) as e:
        model(**entry)
    assert message in str(e.value) and "model 'm'" in str(e.value), str(e.value)


def test_prefill_and_decode_replicas():
    spec = model(**{"prefill-replicas": 1, "decode-replicas": 2})
    assert spec.pd and spec.replicas == 3 and spec.roles == ("prefill", "decode", "decode")
    assert [spec.role_of(i) for i in range(4)] == ["prefill", "decode", "decode", "both"]
    remote = load_config({"models": {"r": {"prefill-replicas": ["http://p:1"],
                                           "decode-replicas": ["http://d:1", "http://d:2"]}}},
                         FLAGS).models[0]
    assert remote.replicas == 0 and remote.urls == ("http://p:1", "http://d:1", "http://d:2")
    assert remote.url_roles == ("prefill", "decode", "decode")
    mixed = model(**{"prefill-replicas": ["http://p:1"], "decode-replicas": 1})
    assert mixed.roles == ("decode",) and mixed.url_roles == ("prefill",)
    assert not model(replicas=2).pd
    assert spec.prefill_min_tokens == 128  # shorter prompts stay on the decode replica
    assert model(**{"prefill-replicas": 1, "decode-replicas": 1,
                    "prefill-min-tokens": 0}).prefill_min_tokens == 0


def test_a_pd_roles_mapping_is_its_own_autoscaled_pool():
    spec = model(**{"prefill-replicas": 1, "decode-replicas": {
        "min-replicas": 2, "max-replicas": 4, "target-ongoing": 3, "upscale-delay": 1}})
    assert spec.roles == ("prefill", "decode", "decode") and spec.replicas == 3
    assert spec.autoscale is None
    assert spec.scaled_pools == (("decode", AutoscaleConfig(2, 4, 3.0, 1.0)),)
    both = model(**{"prefill-replicas": {"max-replicas": 2},
                    "decode-replicas": {"max-replicas": 3}})
    assert both.roles == ("prefill", "decode")
    assert [p for p, _ in both.scaled_pools] == ["prefill", "decode"]
    plain = model(**{"min-replicas": 1, "max-replicas": 2})
    assert plain.scaled_pools == (("both", AutoscaleConfig(1, 2)),)
    assert model(replicas=2).scaled_pools == ()


def test_the_gateway_estimates_a_prompt_length_without_a_tokenizer():
    assert prompt_tokens_estimate({"prompt": [1, 2, 3]}, "1 2 3") == 3  # token ids: exact
    assert prompt_tokens_estimate({"prompt": [[5, 6], [7]]}, "") == 2  # a batch: its first
    assert prompt_tokens_estimate({"prompt": "x" * 9}, "x" * 9) == 3  # 4 characters a token
    assert prompt_tokens_estimate({"messages": []}, "") == 0


@pytest.mark.parametrize(("entry", "message"), [
    ({"prefill-replicas": 1}, "give both"),
    ({"prefill-replicas": 1, "decode-replicas": 1, "replicas": 2}, "replace replicas"),
    ({"prefill-replicas": 0, "decode-replicas": 1}, "prefill-replicas must be an integer >= 1"),
    ({"prefill-replicas": ["ftp://x"], "decode-replicas": 1}, "http(s)://"),
    ({"prefill-replicas": 1, "decode-replicas": 1, "prefill-min-tokens": -1},
     "prefill-min-tokens must be an integer >= 0"),
    ({"replicas": 2, "prefill-min-tokens": 64}, "prefill-min-tokens needs prefill-replicas"),
    ({"prefill-replicas": 1, "decode-replicas": 1, "max-replicas": 3},
     "to autoscale a role, give it a mapping"),
    ({"prefill-replicas": 1, "decode-replicas": {"min-replicas": 1}}, "max-replicas required"),
    ({"prefill-replicas": 1, "decode-replicas": {"max-replicas": 2, "replicas": 1}},
     "unknown: replicas"),
    ({"prefill-replicas": 1, "decode-replicas": {"min-replicas": 0, "max-replicas": 2}},
     "min-replicas must be an integer >= 1"),
    ({"prefill-replicas": 1, "decode-replicas": {"min-replicas": 3, "max-replicas": 2}},
     "max-replicas >= max(1, min-replicas)"),
    ({"prefill-replicas": {"max-replicas": 2, "target-ongoing": 0}, "decode-replicas": 1},
     "prefill-replicas: target-ongoing must be > 0"),
])
def test_bad_pd_keys_are_one_clear_error(entry, message):
    with pytest.raises(ValueError) as e:
        model(**entry)
    assert message in str(e.value), str(e.value)


def test_a_stream_whose_runner_died_ends_in_its_own_apis_error_shape():
    from justllm.gateway.streams import stream_failure

    ollama = json.loads(stream_failure("/api/chat", "gone"))
    assert ollama == {"error": "gone"}
    event, data = stream_failure("/v1/messages", "gone").decode().strip().split("\n")
    assert event == "event: error"
    assert json.loads(data.removeprefix("data: ")) == {
        "type": "error", "error": {"type": "api_error", "message": "gone"}}
    event, data = stream_failure("/v1/responses", "gone").decode().strip().split("\n")
    assert event == "event: error" and json.loads(data.removeprefix("data: "))["type"] == "error"
    chunk, done = stream_failure("/v1/chat/completions", "gone").decode().strip().split("\n\n")
    assert json.loads(chunk.removeprefix("data: "))["error"]["code"] == "replica_failed"
    assert done == "data: [DONE]"
    for llama_route in ("/completion", "/infill"):  # llama-server's shape, and no [DONE]
        event = stream_failure(llama_route, "gone").decode()
        assert event.endswith("\n\n") and event.count("data: ") == 1, event
        assert json.loads(event.strip().removeprefix("data: ")) == {"error": {
            "code": 500, "message": "gone", "type": "server_error", "param": None}}


def test_the_gateways_last_responses_event_takes_the_number_after_the_runners_last():
    from justllm.gateway.streams import SequenceNumbers, stream_failure

    seq = SequenceNumbers()
    assert seq.next == 0  # died before its first event: the error is event 0
    frames = b"".join(b'event: response.output_text.delta\ndata: {"type":"response.output_text'
                      b'.delta","delta":"x","sequence_number":%d}\n\n' % i for i in range(12))
    cut = frames.index(b'"sequence_number":11') + len(b'"sequence_number":1')
    seq.feed(frames[:cut])  # the last number split between two chunks: "1" | "1}"
    assert seq.next == 11
    seq.feed(frames[cut:])
    assert seq.next == 12
    seq.feed(b"data: ")  # a chunk without a number keeps it
    assert seq.next == 12
    _, data = stream_failure("/v1/responses", "gone", seq.next).decode().strip().split("\n")
    assert json.loads(data.removeprefix("data: "))["sequence_number"] == 12


def test_the_gateway_lets_go_of_a_runner_connection_before_the_runner_would():
    """A request sent on a keep-alive connection the runner closes that moment fails as a
    runner that closed without an answer, which restarts it: the gateway's connections to
    runners expire well before the runners' (uvicorn's default, which justllm serve names)."""
    from justllm.server.config import KEEP_ALIVE_SECONDS, RUNNER_KEEPALIVE_EXPIRY

    assert 0 < RUNNER_KEEPALIVE_EXPIRY <= KEEP_ALIVE_SECONDS / 2
