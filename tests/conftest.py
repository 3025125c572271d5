"""Shared fixtures: the real demo model through the real llama.cpp (never skipped)."""

from __future__ import annotations

import pytest

from justllm.config import EngineConfig


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
