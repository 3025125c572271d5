"""Router mode under max-loaded: a model's steady traffic does not keep another model's load
waiting. Requests for the model that must make way wait while that load waits for it to go
idle, as Ollama's scheduler takes requests in order (before, the load waited as long as the
traffic lasted, and its request failed with "did not load within" load-timeout)."""

from __future__ import annotations

import threading
import time

import httpx

from tests.gateway.test_gateway import RUNNER_FLAGS, start_gateway, stop


def test_a_busy_model_makes_way_for_another_models_load(tmp_path, model_path):
    gw = start_gateway(tmp_path, {"a": {"source": model_path, **RUNNER_FLAGS},
                                  "c": {"source": model_path, **RUNNER_FLAGS}},
                       **{"max-loaded": 1, "load-timeout": 40})
    stop_traffic = threading.Event()
    codes: list[int] = []

    def traffic() -> None:  # back-to-back requests for a, two at a time
        with httpx.Client(timeout=120) as http:
            while not stop_traffic.is_set():
                r = http.post(gw.url + "/v1/completions", json={
                    "model": "a", "prompt": "Count:", "max_tokens": 4, "ignore_eos": True})
                codes.append(r.status_code)

    try:
        assert httpx.post(gw.url + "/v1/completions", timeout=120, json={
            "model": "a", "prompt": "Hi", "max_tokens": 1}).status_code == 200
        loops = [threading.Thread(target=traffic) for _ in range(2)]
        for t in loops:
            t.start()
        while len(codes) < 4:  # a serves its steady traffic
            time.sleep(0.05)
        r = httpx.post(gw.url + "/v1/completions", timeout=120, json={
            "model": "c", "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200, r.text  # (a 503 after load-timeout, a's traffic going on)
        assert gw.status()["c"]["loads"] == 1
        served_before = len(codes)
        deadline = time.monotonic() + 60
        while len(codes) < served_before + 2 and time.monotonic() < deadline:
            time.sleep(0.05)  # and a's traffic goes on after (a loads again)
        stop_traffic.set()
        for t in loops:
            t.join(timeout=120)
        assert len(codes) >= served_before + 2 and set(codes) == {200}, codes
    finally:
        stop_traffic.set()
        stop(gw)
