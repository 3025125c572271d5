"""The speculation methods by name, and what each needs from the engine.

A method declares whether a draft model (``--draft-model``) proposes, whether its drafts are
trees (several candidates per level: extra sequence ids, verified in one batch), how many draft
nodes a request may put in a step, and, for a method with no model, how to build its proposer.
``EngineConfig`` validates ``--spec`` against its table of methods (these, and with plugins
every one registered through ``register_spec_methods``) and the engine builds the proposer from
it (``engine/proposers.py``), so a new model-free method is one entry here or in a plugin.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from justllm.spec.proposer import Proposer


@dataclass(frozen=True)
class SpecMethod:
    name: str
    draft_model: bool = False  # a second GGUF proposes (engine/draft_model.py)
    tree: bool = False  # ``branch`` candidates at each of the first two levels
    proposer: Callable[[], Proposer] | None = None  # a model-free method's proposer

    def max_nodes(self, gamma: int, branch: int) -> int:
        """Draft nodes one request may put in a step: a chain of ``gamma``, or a tree with
        ``branch`` candidates at each of its first two levels and chains below."""
        if not self.tree:
            return gamma
        return branch + branch * branch * max(gamma - 1, 1) if gamma > 1 else branch


def _ngram() -> Proposer:
    # (imported here: the proposers need numpy, which the CLI's commands do not load)
    from justllm.spec.proposer import NgramProposer

    return NgramProposer()


# Read-only: the built-in plugin registers these; plugins add theirs (Plugins.spec_methods).
SPEC_METHODS: Mapping[str, SpecMethod] = MappingProxyType({m.name: m for m in (
    SpecMethod("ngram", draft_model=False, proposer=_ngram),
    SpecMethod("draft", draft_model=True),
    SpecMethod("tree", draft_model=True, tree=True),
)})
