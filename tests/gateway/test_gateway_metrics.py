"""The gateway's ``/metrics`` with two models' runners behind it: each runner's series carry
its model's name, so two models' pages merge into one valid page."""

from __future__ import annotations

import collections

import httpx

from tests.gateway.test_gateway import RUNNER_FLAGS, start_gateway, stop, wait_gone
from tests.plugins.test_loading import SITE


def test_two_models_series_stay_apart_on_the_gateways_page(tmp_path, model_path):
    """A plugin's record counts included: they carried no model_name, so the two runners'
    ``replica="0"`` series were one series twice."""
    env = {"PYTHONPATH": str(SITE), "JUSTLLM_PLUGINS": "justllm-sample",
           "JUSTLLM_SAMPLE_RECORDS": str(tmp_path / "records.jsonl")}
    gw = start_gateway(tmp_path, {name: {"source": model_path, "preload": True, **RUNNER_FLAGS}
                                  for name in ("alpha", "beta")}, env=env, **{"max-loaded": 0})
    try:
        for name in ("alpha", "beta"):
            gw.wait_status(name, "loaded")
        for name, n in (("alpha", 2), ("beta", 1)):
            for _ in range(n):
                r = httpx.post(gw.url + "/v1/completions", timeout=120, json={
                    "model": name, "prompt": "Hi", "max_tokens": 2, "ignore_eos": True})
                assert r.status_code == 200, r.text
        text = httpx.get(gw.url + "/metrics", timeout=30).text
    finally:
        pids = gw.runner_pids()
        assert stop(gw)[0] == 0
        wait_gone(pids)
    samples = [line.rsplit(" ", 1)[0] for line in text.splitlines()
               if line and not line.startswith("#")]
    # a series twice (the same name and labels) makes the page invalid: Prometheus refuses it
    assert [s for s, n in collections.Counter(samples).items() if n > 1] == []
    runners = [s for s in samples if 'replica="' in s]
    assert runners and all('model_name="' in s for s in runners)
    assert any(s.startswith("justllm_plugin_request_records_total{") for s in runners)
    success = {s: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               for s in [line.rsplit(" ", 1)[0]] if s.startswith("vllm:request_success_total")}
    assert success == {
        f'vllm:request_success_total{{finished_reason="length",model_name="{m}",replica="0"}}':
        n for m, n in (("alpha", 2.0), ("beta", 1.0))}
