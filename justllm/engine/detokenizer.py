"""Incremental detokenizing with stop strings.

Token pieces are bytes; a multi-byte UTF-8 character may span tokens, so an incremental UTF-8
decoder holds incomplete tails back and nothing broken is ever emitted. Stop strings are
searched in the decoded text, so they are found across token boundaries; text that could still
be the start of a stop string is held back until it is known not to be one, and the stop string
itself is not emitted unless it is one of those to keep (vLLM's ``include_stop_str_in_output``).
"""

from __future__ import annotations

import codecs
from collections.abc import Callable


class IncrementalDetokenizer:
    def __init__(self, piece: Callable[[int], bytes], stop: tuple[str, ...] = (),
                 keep: tuple[str, ...] = ()) -> None:
        self._piece = piece
        self._keep = frozenset(keep)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = stop
        self._max_stop = max((len(s) for s in stop), default=0)
        self._firsts = frozenset(s[0] for s in stop if s)
        self.text = ""
        self._emitted = 0
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text, once found

    def add_token(self, token: int, find_stop: bool = True) -> None:
        """``find_stop`` False: not yet (``min_tokens``); a stop string that ends in a later
        token is still found, even if it began here."""
        if self.stopped:
            return
        before = len(self.text)
        self.text += self._decoder.decode(self._piece(token))
        if self._stop and len(self.text) > before and find_stop:
            self._find_stop(before)

    def _find_stop(self, before: int) -> None:
        start = max(0, before - self._max_stop + 1)
        hits = [(i, s) for s in self._stop if (i := self.text.find(s, start)) >= 0]
        if hits:
            at, self.matched = min(hits, key=lambda hit: hit[0])
            self.text = self.text[:at + (len(self.matched) if self.matched in self._keep else 0)]
            self.stopped = True

    def take_new_text(self, final: bool = False) -> str:
        """Text that is now safe to show and was not returned before."""
        if final and not self.stopped:
            self.text += self._decoder.decode(b"", final=True)
        end = len(self.text)
        if not final and not self.stopped and self._stop:
            end -= self._held_back()
        if end <= self._emitted:
            return ""
        new = self.text[self._emitted:end]
        self._emitted = end
        return new

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        tail = self.text[-(self._max_stop - 1):] if self._max_stop > 1 else ""
        for k in range(len(tail), 0, -1):
            # (only where a stop string could begin: comparing every suffix cost O(L^2) a
            # token, 23 ms for one 20,000-character stop string)
            if tail[-k] in self._firsts and any(s.startswith(tail[-k:]) for s in self._stop):
                return k
        return 0
