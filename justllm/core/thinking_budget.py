"""A reasoning model's thinking held to a token budget, as llama.cpp's reasoning-budget sampler
holds it (``common/reasoning-budget.cpp``): past the budget, the tokens that close the thinking
are forced one by one, and the answer follows.

The state machine reads the answer's bytes as they are drawn (a token's text, which is how
the thinking tags are found whatever tokens the model spells them with) and agrees with
``core/reasoning.py``'s reading of the text: thinking opens with the start tag at the very
beginning of the answer (blanks before it allowed), or is open from the start when the prompt
opened it, and ends at the first end tag.

- ``waiting``: the answer has not shown yet whether it opens with the start tag;
- ``counting``: thinking (from the first token when the prompt opened it); each token
  counts, until the end tag (``done``) or the budget;
- ``closing``: the budget is spent, but the last token ended inside a UTF-8 character: tokens
  are drawn until it is whole (llama.cpp's WAITING_UTF8), so the thinking does not end in a
  broken character;
- ``forcing``: the closing tokens are forced (the sampler draws nothing);
- ``done``: no thinking, or it has ended; nothing is forced any more.
"""

from __future__ import annotations

import codecs


class ThinkingBudget:
    """One request's budget. ``accept`` every token the request emits, in order; ``forced``
    says which token must come next (None: the sampler draws as usual)."""

    def __init__(self, tags: tuple[str, str], budget: int, closing: list[int],
                 opened: bool = False) -> None:
        """``closing``: the tokens forced when the budget is spent (the end tag's, with the
        blank lines around it); ``opened``: the prompt opened the thinking."""
        if budget < 0 or not closing:
            raise ValueError("a thinking budget needs budget >= 0 and closing tokens")
        self._start, self._end = (t.encode() for t in tags)
        self._budget = budget
        self._closing = list(closing)
        self._opened = opened
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._head = b""  # the answer's bytes while waiting
        self._tail = b""  # the thinking's last bytes (to find the end tag across tokens)
        self._count = 0  # thinking tokens so far
        self._forced = 0  # closing tokens forced so far
        # A prompt that opened the thinking: every token counts from the first (as in
        # llama.cpp), and a budget of 0 closes it at once.
        self.state = ("forcing" if budget == 0 else "counting") if opened else "waiting"

    @property
    def spent(self) -> bool:
        """Whether the budget ran out (the closing tokens were, or are being, forced)."""
        return self.state in ("closing", "forcing") or self._forced > 0

    def forced(self) -> int | None:
        """The token that must come next, or None."""
        if self.state == "forcing":
            return self._closing[self._forced]
        return None

    def accept(self, token: int, piece: bytes) -> None:
        """Note that ``token`` (whose text is ``piece``) was emitted."""
        if self.state == "forcing":
            self._forced += 1
            if self._forced == len(self._closing):
                self.state = "done"
            return
        if self.state == "done":
            return
        if self.state == "waiting":
            self._head += piece
            lead = self._head.lstrip()
            if lead.startswith(self._start):
                self.state = "counting"  # (the tag's own tokens do not count)
                self._see(lead[len(self._start):])
            elif not self._start.startswith(lead):
                self.state = "done"  # no thinking
            return
        self._count += 1
        self._see(piece)

    def _see(self, piece: bytes) -> None:
        """The thinking grew by ``piece``: has it ended, or run out of budget?"""
        self._tail = (self._tail + piece)[-(len(self._end) + len(piece)):]
        self._utf8.decode(piece)
        if self._end in self._tail:
            self.state = "done"
        elif self._count >= self._budget:
            # a character cut between tokens: draw on until it is whole
            self.state = "closing" if self._utf8.getstate()[0] else "forcing"
