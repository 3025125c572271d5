"""/health is 503 while the model loads, 200 after; /v1 routes say 'loading' meanwhile; a model
that fails to load ends `justllm serve` with one error line."""

import subprocess
import sys
import threading

from litestar.testing import TestClient

from justllm.config import EngineConfig
from justllm.engine.async_engine import AsyncEngine
from justllm.engine.engine import Engine
from justllm.server.app import ServerConfig, create_app
from tests.server.conftest import free_port


def test_health_while_loading(model_path):
    release = threading.Event()

    def loader():
        release.wait(timeout=60)
        return AsyncEngine(Engine(EngineConfig(model=model_path, max_seqs=2, pool_blocks=32)))

    app = create_app(None, ServerConfig(), loader=loader)
    with TestClient(app) as client:
        assert client.get("/health").status_code == 503
        r = client.get("/v1/models")
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
        release.set()
        for _ in range(600):
            if client.get("/health").status_code == 200:
                break
            threading.Event().wait(0.05)
        assert client.get("/health").status_code == 200
        assert client.get("/v1/models").json()["data"][0]["id"] == "gemma-3-270m-q4_k_m"


def test_a_model_that_fails_to_load_ends_serve_with_one_error_line(model_path, tmp_path):
    corrupt = tmp_path / "truncated.gguf"
    with open(model_path, "rb") as f:
        corrupt.write_bytes(f.read(1_000_000))  # a valid header, then nothing
    port = free_port()
    proc = subprocess.run([sys.executable, "-m", "justllm", "serve", str(corrupt), "--port",
                           str(port)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "truncated.gguf" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
