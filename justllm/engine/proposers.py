"""The proposer an engine configuration asks for.

Lives in ``engine`` because a draft model is a second llama.cpp context (``draft_model.py``);
``spec`` stays free of llama.cpp and of the engine (proposer interface, n-gram lookup,
verification, windows)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from justllm.errors import ModelLoadError
from justllm.spec.proposer import Proposer

if TYPE_CHECKING:
    from justllm.config import EngineConfig
    from justllm.engine.backend import LlamaBackend


def make_proposer(config: EngineConfig, target: LlamaBackend) -> Proposer | None:
    """None without ``--spec``; a draft model is loaded here and checked against the target's
    vocabulary (raises ModelLoadError when they differ)."""
    method = config.spec_method
    if method is None:
        return None
    if method.proposer is not None:
        try:
            made = method.proposer()
        except Exception as e:  # a plugin's factory: one line, not a traceback
            raise ModelLoadError(f"--spec {method.name}: its proposer could not be made: "
                                 f"{type(e).__name__}: {e}") from None
        if not callable(getattr(made, "propose", None)):
            raise ModelLoadError(f"--spec {method.name}: its proposer factory gave a "
                                 f"{type(made).__name__}, which has no propose() method")
        return made
    from justllm.engine.draft_model import DraftModelProposer

    return DraftModelProposer.load(config, target)
