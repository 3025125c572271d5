"""A gateway's ``/metrics`` page (``justllm serve --models``) as ``justllm top`` reads it.

Written the way the gateway writes it (its own series first, then every loaded runner's page
merged family by family, as ``justllm/gateway/metrics.py`` does), trimmed to the families the
dashboard reads plus a few it must skip. Two runners, ``chat`` and ``coder``; ``embed`` is
configured but not loaded, so only the gateway's series name it.
"""

from __future__ import annotations


def gateway_page(chat_tokens: float = 1000.0, coder_tokens: float = 500.0,
                 unloaded: bool = True) -> str:
    """The page with the two runners' generation counters at the given values; without
    ``unloaded`` the gateway has only the two models."""
    embed = {name: (f'\n{name}{{model_name="embed"}} {value}' if unloaded else "")
             for name, value in (("justllm_gateway_model_loaded", 0),
                                 ("justllm_gateway_model_loads_total", 0),
                                 ("justllm_gateway_model_restarts_total", 0),
                                 ("justllm_gateway_model_unloads_total", 0))}
    return f"""\
# HELP justllm_gateway_requests_waiting_for_load Requests waiting for a model to load.
# TYPE justllm_gateway_requests_waiting_for_load gauge
justllm_gateway_requests_waiting_for_load 2
# HELP justllm_gateway_model_loaded 1 while the model's runner is up.
# TYPE justllm_gateway_model_loaded gauge
justllm_gateway_model_loaded{{model_name="chat"}} 1
justllm_gateway_model_loaded{{model_name="coder"}} 1{embed["justllm_gateway_model_loaded"]}
# HELP justllm_gateway_model_loads_total Runners started and ready.
# TYPE justllm_gateway_model_loads_total counter
justllm_gateway_model_loads_total{{model_name="chat"}} 1
justllm_gateway_model_loads_total{{model_name="coder"}} 2{embed["justllm_gateway_model_loads_total"]}
# HELP justllm_gateway_model_restarts_total Runners restarted after dying.
# TYPE justllm_gateway_model_restarts_total counter
justllm_gateway_model_restarts_total{{model_name="chat"}} 0
justllm_gateway_model_restarts_total{{model_name="coder"}} 1{embed["justllm_gateway_model_restarts_total"]}
# HELP justllm_gateway_model_unloads_total Runners stopped (idle, room, request, scaled down).
# TYPE justllm_gateway_model_unloads_total counter
justllm_gateway_model_unloads_total{{model_name="chat"}} 1
justllm_gateway_model_unloads_total{{model_name="coder"}} 0{embed["justllm_gateway_model_unloads_total"]}
# HELP justllm_gateway_model_load_seconds Seconds from starting a runner to its first 200 on /health.
# TYPE justllm_gateway_model_load_seconds summary
justllm_gateway_model_load_seconds_sum{{model_name="chat"}} 1.200
justllm_gateway_model_load_seconds_count{{model_name="chat"}} 1
justllm_gateway_model_load_seconds_sum{{model_name="coder"}} 2.400
justllm_gateway_model_load_seconds_count{{model_name="coder"}} 2
# HELP justllm_gateway_replica_up 1 while the replica is in the rotation.
# TYPE justllm_gateway_replica_up gauge
justllm_gateway_replica_up{{model_name="chat",replica="0",role="both"}} 1
justllm_gateway_replica_up{{model_name="coder",replica="0",role="prefill"}} 1
justllm_gateway_replica_up{{model_name="coder",replica="1",role="decode"}} 1
justllm_gateway_replica_up{{model_name="coder",replica="2",role="decode"}} 1
justllm_gateway_replica_up{{model_name="coder",replica="3",role="decode"}} 0
# HELP vllm:num_requests_running Requests in the running batch.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{model_name="chat"}} 2.0
vllm:num_requests_running{{model_name="coder"}} 1.0
# HELP vllm:num_requests_waiting Requests waiting to be scheduled.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{model_name="chat"}} 1.0
vllm:num_requests_waiting{{model_name="coder"}} 0.0
# HELP vllm:kv_cache_usage_perc Fraction of KV blocks in use (0-1).
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{model_name="chat"}} 0.375
vllm:kv_cache_usage_perc{{model_name="coder"}} 0.390625
# HELP vllm:generation_tokens_total Tokens generated.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{{model_name="chat"}} {chat_tokens}
vllm:generation_tokens_total{{model_name="coder"}} {coder_tokens}
# HELP justllm_kv_blocks_used KV blocks in use.
# TYPE justllm_kv_blocks_used gauge
justllm_kv_blocks_used{{model_name="chat"}} 48.0
justllm_kv_blocks_used{{model_name="coder"}} 100.0
# HELP justllm_kv_blocks_total KV blocks in the pool.
# TYPE justllm_kv_blocks_total gauge
justllm_kv_blocks_total{{model_name="chat"}} 128.0
justllm_kv_blocks_total{{model_name="coder"}} 256.0
# HELP vllm:prefix_cache_hits_total Prompt tokens found in the prefix cache.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{{model_name="chat"}} 400.0
vllm:prefix_cache_hits_total{{model_name="coder"}} 150.0
# HELP justllm_prefix_cache_hits_total Requests that reused a cached prefix.
# TYPE justllm_prefix_cache_hits_total counter
justllm_prefix_cache_hits_total{{model_name="chat"}} 3.0
justllm_prefix_cache_hits_total{{model_name="coder"}} 1.0
# HELP justllm_prefix_cache_misses_total Requests that found no cached prefix.
# TYPE justllm_prefix_cache_misses_total counter
justllm_prefix_cache_misses_total{{model_name="chat"}} 1.0
justllm_prefix_cache_misses_total{{model_name="coder"}} 3.0
# HELP justllm_prefix_cache_hit_ratio Hits / (hits + misses).
# TYPE justllm_prefix_cache_hit_ratio gauge
justllm_prefix_cache_hit_ratio{{model_name="chat"}} 0.75
justllm_prefix_cache_hit_ratio{{model_name="coder"}} 0.25
# HELP justllm_prefix_cache_blocks KV blocks held by the prefix cache.
# TYPE justllm_prefix_cache_blocks gauge
justllm_prefix_cache_blocks{{model_name="chat"}} 20.0
justllm_prefix_cache_blocks{{model_name="coder"}} 60.0
# HELP vllm:spec_decode_num_draft_tokens_total Draft tokens verified by the model.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{{model_name="chat"}} 0.0
vllm:spec_decode_num_draft_tokens_total{{model_name="coder"}} 40.0
# HELP vllm:spec_decode_num_accepted_tokens_total Draft tokens accepted.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{{model_name="chat"}} 0.0
vllm:spec_decode_num_accepted_tokens_total{{model_name="coder"}} 30.0
# HELP vllm:request_success_total Finished requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{{finished_reason="stop",model_name="chat"}} 4.0
vllm:request_success_total{{finished_reason="length",model_name="coder"}} 4.0
# HELP vllm:time_to_first_token_seconds Time to first token.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{{le="0.1",model_name="chat"}} 0.0
vllm:time_to_first_token_seconds_bucket{{le="0.25",model_name="chat"}} 2.0
vllm:time_to_first_token_seconds_bucket{{le="0.5",model_name="chat"}} 3.0
vllm:time_to_first_token_seconds_bucket{{le="1.0",model_name="chat"}} 4.0
vllm:time_to_first_token_seconds_bucket{{le="+Inf",model_name="chat"}} 4.0
vllm:time_to_first_token_seconds_count{{model_name="chat"}} 4.0
vllm:time_to_first_token_seconds_sum{{model_name="chat"}} 1.1
vllm:time_to_first_token_seconds_bucket{{le="0.1",model_name="coder"}} 0.0
vllm:time_to_first_token_seconds_bucket{{le="0.25",model_name="coder"}} 0.0
vllm:time_to_first_token_seconds_bucket{{le="0.5",model_name="coder"}} 0.0
vllm:time_to_first_token_seconds_bucket{{le="1.0",model_name="coder"}} 4.0
vllm:time_to_first_token_seconds_bucket{{le="+Inf",model_name="coder"}} 4.0
vllm:time_to_first_token_seconds_count{{model_name="coder"}} 4.0
vllm:time_to_first_token_seconds_sum{{model_name="coder"}} 3.0
# HELP vllm:time_to_first_token_seconds_created Time to first token.
# TYPE vllm:time_to_first_token_seconds_created gauge
vllm:time_to_first_token_seconds_created{{model_name="chat"}} 1.7960733674797094e+09
vllm:time_to_first_token_seconds_created{{model_name="coder"}} 1.7960733674799488e+09
"""


GATEWAY_PAGE = gateway_page()
