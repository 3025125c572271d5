"""Shared fixtures: the real demo model through the real llama.cpp (never skipped)."""

from __future__ import annotations

import pytest

from justllm.config import EngineConfig


@pytest.fixture(autouse=True)
def _no_user_config(tmp_path_factory, monkeypatch):
    """A user's ~/.config/justllm/config.yaml must not change what the tests run."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path_factory.mktemp("xdg-config")))
    for name in [n for n in __import__("os").environ if n.startswith("JUSTLLM_") and n != "JUSTLLM_CACHE_DIR"]:
        monkeypatch.delenv(name)


@pytest.fixture(scope="session")
def model_path() -> str:
    from justllm.model_source import demo_model_path

    return str(demo_model_path())


@pytest.fixture(scope="session")
def engine(model_path):
    """One shared engine; tests must leave it idle (every request finished or aborted)."""
    from justllm.engine.engine import Engine

    eng = Engine(EngineConfig(model=model_path, max_seqs=16, pool_blocks=512))
    yield eng
    eng.close()
