"""justllm: serve GGUF language models with continuous batching over one llama.cpp context.

``from justllm import LLM, SamplingParams``. Imports are lazy so that ``justllm --help`` does
not load llama.cpp.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
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


def _global_cxx_runtime() -> None:
    """Put the C++ runtime in the process's global symbol scope before numpy or llama.cpp load
    it. On an H200 with a CUDA build of llama-cpp-python (CUDA 13, numpy 2.5), every process
    that imported numpy, which links libstdc++, before llama.cpp segfaulted in its first model
    load; with libstdc++ global (LD_PRELOAD, or llama.cpp loaded first) the same load worked.
    justllm's own processes import this package before numpy; where numpy came first, loading
    it here with RTLD_GLOBAL promotes the copy already loaded (not yet seen on a GPU:
    benchmarks/gpu_check.sh checks both orders and falls back to LD_PRELOAD)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):  # no libstdc++.so.6 (a musl libc): nothing to do
            ctypes.CDLL("libstdc++.so.6", mode=os.RTLD_GLOBAL)


_global_cxx_runtime()


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
