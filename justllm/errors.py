"""The exceptions justllm raises, translated at the edges.

The CLI prints ``str(error)`` as one line and exits 1; the server maps each class to an
HTTP status and an OpenAI-style error body. Nothing inside the engine lets a bad request take
the engine down: request-level problems raise one of these for that request only.
"""

from __future__ import annotations


class JustLLMError(Exception):
    """Base class of every error justllm reports to a user."""


class InvalidRequestError(JustLLMError, ValueError):
    """A request (prompt, sampling values) that can never be served as given."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class HandoverError(InvalidRequestError):
    """A prefill replica's hand-over (first tokens, random state) does not fit the request it
    came with; the decode replica then serves the request whole."""


class BeyondContextError(InvalidRequestError):
    """The prompt fits the context, but not with all of ``max_tokens`` after it (OpenAI's
    and vLLM's 400; Ollama's routes answer until the context is full instead)."""


class QueueFullError(JustLLMError):
    """The waiting queue is at ``max_queue``; the caller should retry later."""


class EngineClosedError(JustLLMError):
    """The engine is shutting down and takes no new requests (a server answers 503)."""


class ModelLoadError(JustLLMError):
    """The model file is missing, not a GGUF, or llama.cpp refused it."""


class LoadCancelled(JustLLMError):
    """A model's load stopped because its caller asked (``BackendConfig.cancel``: a server
    shutting down while its model loads)."""


class GPUUnavailableError(JustLLMError):
    """``--gpu`` was asked for but the installed llama-cpp-python has no GPU backend."""


class EngineError(JustLLMError):
    """llama.cpp returned an error while computing a step."""


class GrammarDeadEndError(EngineError):
    """A request's grammar allows no token of this model next (it asks for text no token can
    spell, such as a NUL character): the request's own fault, answered as a 400."""

    code = "grammar_dead_end"


class KVConsistencyError(RuntimeError):
    """The engine's KV check found llama.cpp's cells out of step with the scheduler (a bug in
    justllm, never a user's error; the check is on in the test suite)."""
