"""/health is 503 while the model loads, 200 after; /v1 routes say 'loading' meanwhile."""

import threading

from litestar.testing import TestClient

from justllm.config import EngineConfig
from justllm.engine.async_engine import AsyncEngine
from justllm.engine.engine import Engine
from justllm.server.app import ServerConfig, create_app


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
