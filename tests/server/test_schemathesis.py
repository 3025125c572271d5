"""Schema-driven fuzzing of the server's own OpenAPI document (schemathesis): its coverage
phase (every documented field at its boundaries, valid and invalid) and a bounded fuzzing phase,
checking that no request body ever gets a 5xx and that the server is still up afterwards."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import start_server

ST = str(Path(sys.executable).with_name("st"))
HOOKS_DIR = str(Path(__file__).parent)


@pytest.fixture(scope="module")
def small(model_path):
    # A short context bounds every accepted request (max_tokens beyond it is a 400).
    s = start_server(model_path, "--max-seqs", "8", "--pool-blocks", "64", "--ctx", "64",
                     "--max-queue", "64")
    yield s
    assert s.stop() == 0


def schemathesis(server, tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": HOOKS_DIR, "SCHEMATHESIS_HOOKS": "st_hooks"}
    return subprocess.run(
        [ST, "--no-color", "run", server.url + "/docs/openapi.json", "--checks",
         "not_a_server_error", "--no-shrink", "--request-timeout", "60", "--seed", "7",
         "--workers", "1", *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("phase, args", [
    ("coverage", ("--phases", "coverage", "--mode", "all")),
    ("fuzzing", ("--phases", "fuzzing", "--mode", "all", "--max-examples", "10")),
    ("fuzzing-positive", ("--phases", "fuzzing", "--mode", "positive", "--max-examples", "5")),
])
def test_no_generated_request_gets_a_5xx(small, tmp_path, phase, args):
    run = schemathesis(small, tmp_path, *args)
    summary = run.stdout[-3000:]
    assert run.returncode == 0, summary + run.stderr[-2000:]
    assert "generated" in summary and " 0 generated" not in summary, summary
    assert httpx.get(small.url + "/health", timeout=30).status_code == 200
