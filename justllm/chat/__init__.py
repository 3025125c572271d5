"""``justllm chat``: an interactive terminal chat with a local model or a running server."""
