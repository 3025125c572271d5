"""llama-server's two stops for code completion, which editor plugins (llama.vim,
llama.vscode) send with ``/infill`` and ``/completion``:

- ``n_indent``: every line after the first must be indented by at least that many spaces or
  tabs; the first line that is not (an empty line included) ends the answer, cut where its
  indentation ends (the indentation stays, as llama-server leaves it). A suggestion so ends
  where the block the cursor is in ends.
- ``t_max_predict_ms``: once that long has passed since the first token, the next text with a
  newline ends the answer (that text kept): a suggestion ends on a whole line when it takes
  too long.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LineLimits:
    """One answer's text so far against the two limits (0: off)."""

    n_indent: int = 0
    t_max_predict_ms: int = 0
    text: str = ""
    started: float | None = None  # when the first text came (perf_counter seconds)
    _scan: int = 0  # where to look for the next line to check

    @property
    def active(self) -> bool:
        return self.n_indent > 0 or self.t_max_predict_ms > 0

    def feed(self, new: str, now: float) -> tuple[str, bool]:
        """The part of ``new`` the answer keeps, and whether the answer ends with it."""
        if self.started is None:
            self.started = now
        start = len(self.text)
        self.text += new
        if self.n_indent > 0:
            cut = self._short_line()
            if cut is not None:
                self.text = self.text[:cut]
                return self.text[start:], True
        late = (now - self.started) * 1e3 > self.t_max_predict_ms
        return new, self.t_max_predict_ms > 0 and "\n" in new and late

    def _short_line(self) -> int | None:
        """Where the first line under ``n_indent`` ends its indentation, if one has begun;
        a line of nothing but spaces so far is not decided yet."""
        text = self.text
        while (nl := text.find("\n", self._scan)) >= 0:
            line = pos = nl + 1
            while pos < len(text) and text[pos] in " \t":
                pos += 1
            if pos == len(text):
                return None  # (looked at again when more text comes)
            if pos - line < self.n_indent:
                return pos
            self._scan = line
        return None
