"""A grammar that holds the answer only from where a trigger appears (llama-server's lazy
grammars): a tool call under ``tool_choice: "auto"`` is free text until the model writes the
call's marker (``<tool_call>``, ``[TOOL_CALLS]``), and from there a call of one of the offered
functions with arguments that follow its schema.

llama.cpp has a lazy grammar sampler, but when the token that completes a trigger carries
text the grammar refuses, its replay throws a C++ exception through the C API and aborts the
process. Here the trigger is found in Python, and the grammar (compiled when the request was
prepared, untouched until then) is fed the text from the trigger on token by token, each
checked first; text it refuses leaves the answer free (the
call is then parsed as written, as without a grammar: a malformed one is text).
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Callable, Sequence

import numpy as np

from justllm.engine.sampler import Constraint

# How far back from the new text a trigger may begin (longer markers than this are not found
# when they arrive a character at a time).
_REACH = 256


class LazyGrammar:
    """A ``Constraint`` that lets every token through until one of ``triggers`` (regular
    expressions) matches the answer's text, then follows ``grammar`` (fresh: nothing
    accepted yet) from where the match's first group begins (or the match itself, without
    groups)."""

    def __init__(self, grammar: Constraint, triggers: Sequence[str],
                 piece: Callable[[int], bytes], tokenize: Callable[[str], list[int]]) -> None:
        self._grammar: Constraint | None = grammar
        self._triggers = [re.compile(t) for t in triggers]
        self._piece = piece
        self._tokenize = tokenize
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._text = ""
        self._inner: Constraint | None = None
        self.given_up = False  # the text after the trigger broke the grammar: free from there

    @property
    def active(self) -> bool:
        """Whether the grammar holds the answer now."""
        return self._inner is not None

    def mask(self, logits: np.ndarray) -> np.ndarray:
        return logits if self._inner is None else self._inner.mask(logits)

    def allows(self, token: int) -> bool:
        return self._inner is None or self._inner.allows(token)

    def allowed_argmax(self, logits: np.ndarray) -> int:
        return int(np.argmax(logits)) if self._inner is None else (
            self._inner.allowed_argmax(logits))

    def accept(self, token: int) -> None:
        if self._inner is not None:
            self._inner.accept(token)
            return
        if self.given_up:
            return
        before = len(self._text)
        self._text += self._decoder.decode(self._piece(token))
        text = self._text
        for trigger in self._triggers:
            # An anchored trigger is tried from the start (it fails there at once once the
            # answer has gone past it); any other only where the new text could complete it.
            anchored = trigger.pattern.startswith("^")
            found = trigger.search(text, 0 if anchored else max(0, before - _REACH))
            if found is not None:
                start = next((found.start(i) for i in range(1, (found.re.groups or 0) + 1)
                              if found.start(i) >= 0), found.start())
                self._start(text[start:])
                return

    def _start(self, text: str) -> None:
        inner, self._grammar = self._grammar, None
        assert inner is not None  # (started once: accept() stops looking after)
        for t in self._tokenize(text):
            if not inner.allows(t):
                self.given_up = True
                close = getattr(inner, "close", None)
                if close is not None:
                    close()
                return
            inner.accept(t)
        self._inner = inner
