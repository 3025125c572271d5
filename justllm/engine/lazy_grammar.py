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
                 piece: Callable[[int], bytes], tokenize: Callable[[str], list[int]],
                 thinking: tuple[tuple[str, str], bool] | None = None) -> None:
        """``thinking``: a reasoning model's tags, and whether the prompt opened the
        thinking; the triggers then count only in the answer after it (its thinking may
        name a call's marker), read as ``core/reasoning.py`` reads it: an answer that opens
        with the start tag (or follows an opened one) thinks until the end tag."""
        self._grammar: Constraint | None = grammar
        # An anchored trigger is tried where the answer begins (a match there, not a search).
        self._triggers = [(re.compile(t[1:]), True) if t.startswith("^")
                          else (re.compile(t), False) for t in triggers]
        self._piece = piece
        self._tokenize = tokenize
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._text = ""
        self._inner: Constraint | None = None
        self.given_up = False  # the text after the trigger broke the grammar: free from there
        self._thinking = thinking
        self._answer_from: int | None = None if thinking else 0  # where the answer begins
        self._end_from = 0  # where the end tag is still to be looked for

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
        if self._answer_from is None:
            self._answer_from = self._answer_start(text)
            if self._answer_from is None:
                return
            before = self._answer_from
        base = self._answer_from
        for trigger, anchored in self._triggers:
            # An anchored trigger is tried where the answer begins (it fails there at once
            # once the answer has gone past it); any other only where the new text could
            # complete it.
            found = (trigger.match(text, base) if anchored
                     else trigger.search(text, max(base, before - _REACH)))
            if found is not None:
                start = next((found.start(i) for i in range(1, (found.re.groups or 0) + 1)
                              if found.start(i) >= 0), found.start())
                self._start(text[start:])
                return

    def _answer_start(self, text: str) -> int | None:
        """Where the answer after the thinking begins in ``text``; None while the thinking
        goes on (or may still open)."""
        assert self._thinking is not None
        (start_tag, end_tag), opened = self._thinking
        if not opened and self._end_from == 0:
            lead = len(text) - len(text.lstrip())
            rest = text[lead:]
            if not rest.startswith(start_tag):
                # (no thinking: the answer is all of it; or the start tag may still come)
                return None if start_tag.startswith(rest) else 0
            self._end_from = lead + len(start_tag)
        end = text.find(end_tag, self._end_from)
        if end < 0:
            self._end_from = max(self._end_from, len(text) - len(end_tag) + 1)
            return None
        return end + len(end_tag)

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
