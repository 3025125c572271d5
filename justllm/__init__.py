"""justllm: serve GGUF language models with continuous batching over one llama.cpp context.

``from justllm import LLM, SamplingParams``. Imports are lazy so that ``justllm --help`` does
not load llama.cpp.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["LLM", "SamplingParams", "EngineConfig", "CompletionOutput"]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from justllm.config import EngineConfig
    from justllm.core.sampling_params import SamplingParams
    from justllm.engine.llm import LLM, CompletionOutput

_WHERE = {
    "LLM": "justllm.engine.llm",
    "CompletionOutput": "justllm.engine.llm",
    "SamplingParams": "justllm.core.sampling_params",
    "EngineConfig": "justllm.config",
}


def build_info() -> str:
    """``justllm VERSION (llama-cpp-python VERSION)``, read from the installed packages'
    metadata without loading llama.cpp (``--version``, llama-server's ``/props``)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        llama = version("llama-cpp-python")
    except PackageNotFoundError:
        llama = "not installed"
    return f"justllm {__version__} (llama-cpp-python {llama})"


def __getattr__(name: str) -> object:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'justllm' has no attribute {name!r}")
