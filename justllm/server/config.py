"""The server's settings, apart from the app so that ``justllm serve`` can read them before it
imports the web framework (justllm/server/loading.py says why)."""

from __future__ import annotations

import os
from dataclasses import dataclass

# Seconds an idle keep-alive connection stays open (uvicorn's default, named here): a router
# mode gateway keeps its connections to runners for less (RUNNER_KEEPALIVE_EXPIRY), so it never
# sends a request on a connection the runner is closing that moment, which reads as a runner
# that closed without an answer and restarted a healthy one.
KEEP_ALIVE_SECONDS = 5
# The gateway's keep-alive for its connections to runners and urls: well inside the runners'
# and inside what a proxy in front of a remote server would keep (nginx 75 s, most balancers
# 60 s); a new loopback connection costs well under a millisecond.
RUNNER_KEEPALIVE_EXPIRY = 2.0


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
    # A router-mode runner (started by its gateway, which alone holds its API key): it reads
    # what the gateway says of a request in its headers (Ollama's load time, the name the
    # client asked for). A server of its own takes no client's word for those.
    gateway_headers: bool = False


def served_model_id(model_path: str, model_name: str | None) -> str:
    """The id clients use for the model: ``--served-model-name``, else the file's stem."""
    return model_name or os.path.splitext(os.path.basename(model_path))[0]
