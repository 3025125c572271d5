"""One streamed answer split into content and tool calls as it grows.

Content is shown as soon as it cannot be part of a call: text from the first position where
a call marker may begin is held back (so no ``<tool_call>``, ``[TOOL_CALLS]`` or the ``{"name"``
of a JSON call ever reaches the content), and so are trailing blanks (a call's content ends
without them). Once a complete marker is seen, the rest of the answer is the call region; it
is parsed when the answer ends, by ``parse_answer`` on the whole text, so a stream and a
whole answer always agree (a malformed call comes out as the held-back text).
"""

from __future__ import annotations

from justllm.server.tools.parse import Match, ParsedAnswer, find_call_start, parse_answer


class CallSplitter:
    """Feed an answer's text pieces, get the content that is safe to show; ``finish`` gives
    the rest of the content and the calls."""

    def __init__(self, fmt: str, names: frozenset[str] | None = None,
                 parallel: bool = True) -> None:
        self._fmt = fmt
        self._names = names
        self._parallel = parallel
        self._text = ""
        self._shown = 0  # characters of _text given out as content
        self._calls_from: int | None = None  # where the first complete call marker begins

    def feed(self, piece: str) -> str:
        """Append ``piece``; the content that can be shown now (maybe "")."""
        self._text += piece
        if self._calls_from is not None:
            return ""
        match, at = find_call_start(self._text, self._fmt, self._shown)
        if match is Match.FULL:
            self._calls_from = at
        safe = max(self._shown, len(self._text[:at].rstrip()))
        shown, self._shown = self._text[self._shown:safe], safe
        return shown

    def finish(self) -> tuple[str, ParsedAnswer]:
        """The content not shown yet, and the whole answer parsed."""
        answer = parse_answer(self._text, self._fmt, self._names, self._parallel)
        rest = answer.content[self._shown:]
        self._shown = len(answer.content)
        return rest, answer
