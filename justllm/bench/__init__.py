"""``justllm bench``: a serving benchmark against any OpenAI-compatible endpoint."""
