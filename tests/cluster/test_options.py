"""models.yaml -> Ray Serve deployment options (pure: no Ray): fixed replicas, the autoscaler's
fields onto autoscaling_config, CPUs and GPUs per replica, how many requests a replica takes,
the routing options for the RequestRouter, and what a cluster refuses or ignores."""

from __future__ import annotations

import pytest

from justllm.cli.options import YAML_FLAGS, YAML_SWITCHES
from justllm.cluster.options import (
    ClusterSettings,
    check_supported,
    deployment_name,
    engine_flags,
    model_options,
    router_kwargs,
)
from justllm.gateway.config import Flags, GatewayConfig, load_config
from justllm.gateway.routing import RoutingConfig

FLAGS = Flags(YAML_FLAGS, switches=YAML_SWITCHES)


def config(**models) -> GatewayConfig:
    return load_config({"models": models}, FLAGS)


def test_fixed_replicas_map_to_num_replicas_with_one_cpu_and_one_thread_each():
    spec = config(chat={"source": "/m.gguf", "replicas": 3, "max-seqs": 8}).spec("chat")
    options = model_options(spec)
    assert options["name"] == "model-chat"
    assert options["num_replicas"] == 3 and "autoscaling_config" not in options
    assert options["ray_actor_options"] == {"num_cpus": 1, "num_gpus": 0}
    assert options["max_ongoing_requests"] == 8 + 256  # max-seqs + the default max-queue
    assert options["health_check_period_s"] > 0 and options["graceful_shutdown_timeout_s"] > 0
    assert engine_flags(spec) == {"max_seqs": 8, "threads": 1}  # as `engine_config` takes them


def test_the_autoscaler_fields_map_one_to_one_onto_autoscaling_config():
    spec = config(busy={"source": "/m.gguf", "min-replicas": 0, "max-replicas": 4,
                        "target-ongoing": 3, "upscale-delay": 5, "downscale-delay": 120,
                        "threads": 4}).spec("busy")
    options = model_options(spec)
    assert "num_replicas" not in options
    assert options["autoscaling_config"] == {
        "min_replicas": 0, "max_replicas": 4, "target_ongoing_requests": 3.0,
        "upscale_delay_s": 5.0, "downscale_delay_s": 120.0}
    assert options["ray_actor_options"]["num_cpus"] == 4  # threads: the CPUs Ray reserves
    assert engine_flags(spec)["threads"] == 4


def test_the_autoscaler_defaults_are_ray_serves():
    options = model_options(config(m={"source": "/m.gguf", "max-replicas": 2}).spec("m"))
    assert options["autoscaling_config"] == {
        "min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2.0,
        "upscale_delay_s": 30.0, "downscale_delay_s": 600.0}


@pytest.mark.parametrize("entry", [{"gpus": [0, 1]}, {"gpu": True}])
def test_gpus_or_gpu_offload_reserve_one_gpu_per_replica(entry):
    options = model_options(config(m={"source": "/m.gguf", **entry}).spec("m"))
    assert options["ray_actor_options"]["num_gpus"] == 1


def test_routing_options_reach_the_router_as_json_and_come_back_equal():
    spec = config(m={"source": "/m.gguf", "routing": {"policy": "least-load",
                                                      "balance-abs-threshold": 4}}).spec("m")
    kwargs = router_kwargs(spec)
    assert kwargs["policy"] == "least-load" and kwargs["balance_abs_threshold"] == 4
    assert RoutingConfig(**kwargs) == spec.routing
    assert router_kwargs(config(m="/m.gguf").spec("m"))["policy"] == "cache-aware"


def test_deployment_names_take_only_what_ray_accepts():
    assert deployment_name("gemma3:270m") == "model-gemma3-270m"
    assert deployment_name("org/model#1") == "model-org-model-1"


def test_router_mode_only_settings_are_refused_or_warned_about():
    with pytest.raises(ValueError, match="urls are router mode's"):
        check_supported(config(m={"urls": ["http://10.0.0.7:8080"]}))
    with pytest.raises(ValueError, match="urls are router mode's"):
        check_supported(config(m={"source": "/m.gguf", "prefill-replicas": ["http://p:1"],
                                   "decode-replicas": 1}))
    warned = check_supported(load_config({"models": {"m": "/m.gguf"}, "max-loaded": 2}, FLAGS))
    assert len(warned) == 1 and "max-loaded" in warned[0]
    assert check_supported(config(m="/m.gguf")) == []
    # These were ignored without a word.
    warned = check_supported(load_config({
        "models": {"m": {"source": "/m.gguf", "ttl": 60, "preload": True}},
        "load-timeout": 5, "max-waiting": 3, "poll-interval": 2, "health-timeout": 9}, FLAGS))
    assert [w.split(" is ")[0] for w in warned] == [
        "load-timeout", "max-waiting", "poll-interval", "health-timeout", "model 'm': ttl", "model 'm': preload"]
    assert all("a Ray cluster ignores it" in w for w in warned)
    # An autoscaled model's ttl (min-replicas 0: router mode scales it to zero after it)
    # was ignored without a word too; a pinned one (min-replicas >= 1) says nothing of it.
    scaled = {"source": "/m.gguf", "min-replicas": 0, "max-replicas": 2, "ttl": 30}
    (warning,) = check_supported(load_config({"models": {"m": scaled}}, FLAGS))
    assert warning.startswith("model 'm': ttl is router mode's") and "downscale-delay" in warning
    pinned = {k: v for k, v in scaled.items() if k != "ttl"}
    assert check_supported(load_config({"models": {"m": {**pinned, "min-replicas": 1}}},
                                       FLAGS)) == []  # (its preload, implied: no warning)
    # Two models that would be one Ray deployment (Ray renamed the second model-a-b_1)
    for models in ({"a/b": "/m.gguf", "a:b": "/m.gguf"},
                   {"x": {"source": "/m.gguf", "prefill-replicas": 1, "decode-replicas": 1},
                    "x-prefill": "/m.gguf"}):
        with pytest.raises(ValueError, match="would both be the Ray deployment model-"):
            check_supported(load_config({"models": models}, FLAGS))


def test_a_pd_model_is_two_deployments_each_with_its_own_count_or_autoscaling():
    from justllm.cluster.options import model_roles

    spec = config(m={"source": "/m.gguf", "prefill-replicas": 2, "decode-replicas": {
        "min-replicas": 1, "max-replicas": 3, "target-ongoing": 4}}).spec("m")
    assert check_supported(config(m={"source": "/m.gguf", "prefill-replicas": 1,
                                     "decode-replicas": 1})) == []
    assert model_roles(spec) == ("prefill", "decode")
    prefill, decode = model_options(spec, "prefill"), model_options(spec, "decode")
    assert prefill["name"] == "model-m-prefill" and prefill["num_replicas"] == 2
    assert "autoscaling_config" not in prefill
    assert decode["name"] == "model-m" and "num_replicas" not in decode
    assert decode["autoscaling_config"]["max_replicas"] == 3
    assert decode["autoscaling_config"]["target_ongoing_requests"] == 4
    plain = config(m="/m.gguf").spec("m")
    assert model_roles(plain) == ("both",) and model_options(plain)["name"] == "model-m"


def test_cluster_settings_are_checked():
    with pytest.raises(ValueError, match="app name"):
        ClusterSettings(app="my app")
    with pytest.raises(ValueError, match="--port"):
        ClusterSettings(port=0)
    with pytest.raises(ValueError, match="--host is empty"):  # (it was taken)
        ClusterSettings(host=" ")
    for prefix in ("team", "/team/", "/a b", "/{x}", "//", ""):
        with pytest.raises(ValueError, match="--route-prefix"):
            ClusterSettings(route_prefix=prefix)
    assert ClusterSettings().url == "http://127.0.0.1:8000"
    assert ClusterSettings(route_prefix="/team/a-1", port=9000).url == \
        "http://127.0.0.1:9000/team/a-1"
