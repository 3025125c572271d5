"""EngineConfig defaults that come from the environment."""

from justllm.config import EngineConfig


def test_justllm_gpu_turns_gpu_on_for_engines_built_in_python(monkeypatch):
    monkeypatch.delenv("JUSTLLM_GPU", raising=False)
    assert EngineConfig().gpu is False
    monkeypatch.setenv("JUSTLLM_GPU", "1")
    assert EngineConfig().gpu is True
    assert EngineConfig(gpu=False).gpu is False  # an explicit value wins
    monkeypatch.setenv("JUSTLLM_GPU", "0")
    assert EngineConfig().gpu is False
