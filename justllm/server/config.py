"""The server's settings, apart from the app so that ``justllm serve`` can read them before it
imports the web framework (justllm/server/loading.py says why)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    model_name: str | None = None  # the id clients send; default: the GGUF file's stem
    max_n: int = 16
    max_body_bytes: int = 8 * 1024 * 1024
    embeddings: bool = True
    role: str = "both"  # prefill/decode disaggregation: which /pd endpoint it serves
    # Finished-request records (plugins' on_request_finished) carry the prompt and output text.
    record_text: bool = False


def served_model_id(model_path: str, model_name: str | None) -> str:
    """The id clients use for the model: ``--served-model-name``, else the file's stem."""
    return model_name or os.path.splitext(os.path.basename(model_path))[0]
