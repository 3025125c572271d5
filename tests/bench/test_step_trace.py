"""benchmarks/step_trace.py: a real server whose every llama_decode is written down."""

import subprocess
import sys
from pathlib import Path

import httpx

from tests.server.conftest import start_server

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "step_trace.py"


def test_a_traced_server_writes_a_line_per_decode_and_the_summary_reads_them(model_path, tmp_path):
    trace = tmp_path / "trace.txt"
    s = start_server(model_path, "--max-seqs", "2", "--pool-blocks", "64",
                     launcher=(str(SCRIPT), "serve", str(trace)))
    try:
        before = len(trace.read_text().splitlines())  # (the server's own warm-up, if any)
        r = httpx.post(s.url + "/v1/completions", timeout=120, json={
            "prompt": "The capital of France is", "max_tokens": 5, "temperature": 0,
            "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        prompt = r.json()["usage"]["prompt_tokens"]
    finally:
        assert s.stop() == 0
    calls = [line.split() for line in trace.read_text().splitlines()[before:]]
    # the prompt (its last row sampled: the first token), then one row per further token
    assert [(int(c[1]), int(c[2])) for c in calls] == [(prompt, 1)] + [(1, 1)] * 4
    assert all(float(c[3]) > 0 for c in calls)
    out = subprocess.run([sys.executable, str(SCRIPT), "summary", str(trace)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"{len(calls) + before} calls" in out.stdout
    assert any(line.split()[:3] == ["1", "1", "4"] for line in out.stdout.splitlines())
    usage = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True)
    assert usage.returncode == 1 and "step_trace.py summary FILE" in usage.stderr
