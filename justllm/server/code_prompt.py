"""The fill-in-the-middle prompt of a code model: llama-server's ``/infill``, Ollama's
``suffix`` on ``/api/generate`` and OpenAI's ``suffix`` on ``/v1/completions`` lay out the code
before and after the gap the same way (core/fim.py), with the model's FIM tokens."""

from __future__ import annotations

from justllm.core.fim import Chunk, fim_prompt
from justllm.engine.async_engine import AsyncEngine

_ROOM = 8  # tokens a batch leaves in a small context (BOS, 3 FIM tokens, the answer's first)


def code_prompt(aengine: AsyncEngine, prefix: str, suffix: str, chunks: list[Chunk],
                prompt: str, n_predict: int) -> list[int]:
    """The fill-in-the-middle prompt of a model that has the FIM tokens, in llama-server's
    layout (core/fim.py); ``n_predict`` -1: no limit. The caller checks that the model has
    the FIM tokens (``aengine.fim_tokens().missing()``)."""
    def text(s: str) -> list[int]:  # the code as it is: special tokens' text is text
        return aengine.tokenize(s, add_special=False, parse_special=False)

    context = aengine.max_request_tokens
    # The prefix and suffix share a batch; in a context smaller than one, the context (less a
    # few tokens for the FIM tokens and the answer), so a long prefix is cut, not refused.
    batch = min(aengine.engine.config.n_batch, max(context - _ROOM, 4))
    return fim_prompt(aengine.fim_tokens(), text, text(prefix), text(suffix), chunks,
                      aengine.tokenize(prompt, add_special=False, parse_special=True),
                      bos=aengine.bos_added(), batch=batch, context=context,
                      n_predict=n_predict, spm=aengine.engine.config.spm_infill)
