"""One JSON value's text -> its canonical text, piece by piece as the text arrives.

A tool call's arguments are given to clients re-serialised (``parse.py``: ``json.dumps`` with
``ensure_ascii=False``, every key as written), so that a streamed and a whole answer agree.
To stream them while the model writes them, each piece given out must be a prefix of that
final text. Token by token it is: ``{`` ``[`` ``}`` ``]`` as written, ``, `` and ``: ``
between, a number or ``true``/``false``/``null`` once it is complete (``1.50`` is ``1.5``),
and a string a character at a time (``json.dumps`` escapes each character on its own), except
that an escape is given once it is whole (a ``\\ud83d`` waits for the ``\\ude00`` that may
pair with it).

Nothing here checks that the text is JSON beyond what it needs to read it: the stream is used
where a grammar holds the text, and the whole answer's parse has the last word. Text it
cannot read stops it (``broken``).
"""

from __future__ import annotations

import json
import re
from typing import Any

from justllm.server.tools.parse import DECODER, JSON_ERRORS, dumps

_BLANK = " \t\n\r"
_NUMBER = frozenset("+-0123456789.eE")
_LITERALS = ("true", "false", "null")
_SEPARATORS = {",": ", ", ":": ": "}
_LOW_SURROGATE = re.compile(r"\\u[dD][c-fC-F][0-9a-fA-F]{2}")
_LOW_SURROGATE_START = ("\\", "u", "dD", "cdefCDEF")


def _may_become_low_surrogate(text: str) -> bool:
    """Whether ``text`` (under 6 characters) can still grow into a ``\\udc00``-``\\udfff``."""
    for k, ch in enumerate(text):
        allowed = _LOW_SURROGATE_START[k] if k < 4 else "0123456789abcdefABCDEF"
        if ch not in allowed:
            return False
    return True


class JsonStream:
    """Feed one JSON value's text (from its first character) in pieces; each ``feed`` gives
    the canonical text that is settled now. ``end`` is where the value ended in the text fed
    (None until it has)."""

    def __init__(self) -> None:
        self._raw = ""
        self._at = 0  # the next character of _raw to read
        self._depth = 0
        self._in_string = False  # _at is inside a string (what came before it given out)
        self._offset = 0  # where _raw begins in the text fed (what was read is let go)
        self.end: int | None = None
        self.broken = False

    def feed(self, text: str) -> str:
        self._raw += text
        out = []
        while self.end is None and not self.broken:
            piece = self._next()
            if not piece:
                break
            out.append(piece)
        if self._at:  # (so that a long value is not copied again with every piece)
            self._raw, self._offset = self._raw[self._at:], self._offset + self._at
            self._at = 0
        return "".join(out)

    def _next(self) -> str | None:
        raw, i = self._raw, self._at
        if self._in_string:
            return self._string(i)
        while i < len(raw) and raw[i] in _BLANK:
            i += 1
        self._at = i
        if i == len(raw):
            return None
        ch = raw[i]
        if ch in "{[":
            self._depth += 1
            return self._took(i + 1, ch)
        if ch in "}]":
            self._depth -= 1
            return self._took(i + 1, ch)
        if ch in _SEPARATORS and self._depth:
            return self._took(i + 1, _SEPARATORS[ch])
        if ch == '"':
            return self._string(i)
        if ch in _NUMBER:
            j = i
            while j < len(raw) and raw[j] in _NUMBER:
                j += 1
            if j == len(raw) and self._depth:  # more digits may come
                return None
            return self._value(i, j)
        for literal in _LITERALS:
            if raw.startswith(literal, i):
                return self._took(i + len(literal), literal)
            if literal.startswith(raw[i:]):
                return None
        self.broken = True
        return None

    def _took(self, at: int, piece: str) -> str:
        self._at = at
        if self._depth == 0:
            self.end = self._offset + at
        return piece

    def _value(self, i: int, j: int) -> str | None:
        try:
            return self._took(j, dumps(DECODER.decode(self._raw[i:j])))
        except JSON_ERRORS:
            self.broken = True
            return None

    def _string(self, i: int) -> str | None:
        """A string from ``i`` (its opening quote, or where the part given out ends): its
        characters that are whole, the closing quote once it comes."""
        raw, opening = self._raw, not self._in_string
        j = i + 1 if opening else i
        start, closed = j, False
        while j < len(raw):
            ch = raw[j]
            if ch == '"':
                closed = True
                break
            if ch != "\\":
                j += 1
                continue
            if j + 1 == len(raw):
                break
            if raw[j + 1] != "u":
                j += 2
                continue
            if j + 6 > len(raw):
                break
            tail = raw[j + 6:j + 12]
            if raw[j + 2] in "dD" and raw[j + 3] in "89abAB":  # a high surrogate
                if _LOW_SURROGATE.fullmatch(tail):
                    j += 12
                    continue
                if len(tail) < 6 and _may_become_low_surrogate(tail):
                    break
            j += 6
        try:
            # (a part that begins and ends between characters reads as a string of its own)
            text = dumps(DECODER.decode('"' + raw[start:j] + '"'))
        except JSON_ERRORS:
            self.broken = True
            return None
        piece = ('"' if opening else "") + text[1:-1]
        if closed:
            self._in_string = False
            return self._took(j + 1, piece + '"')
        self._in_string, self._at = True, j
        return piece or None


def healed(text: str) -> Any:
    """What a cut-off canonical JSON text (a ``JsonStream``'s pieces, as a call cut off by
    ``max_tokens`` has them) holds so far: its complete values, the containers still open
    closed; a key without its value and a string, number or literal cut off are left out.
    None when not even the outer container has begun."""
    stack: list[str] = []
    safe, safe_stack = -1, ""  # where the text may be cut and closed, and what is open there
    key_next = False  # the next string is an object's key
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch in "{[":
            stack.append(ch)
            i += 1
            key_next = ch == "{"
        elif ch in "}]":
            if not stack:
                return None  # (not a JsonStream's text after all)
            stack.pop()
            i += 1
        elif ch in ",:":
            key_next = ch == "," and bool(stack) and stack[-1] == "{"
            i += 2  # (", " and ": ")
            continue
        elif ch == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            if j >= n:
                break  # a string cut off
            i = j + 1
            if key_next:
                key_next = False
                continue  # (a key is no value)
        else:
            j = i
            while j < n and text[j] not in ",}]":
                j += 1
            if j == n:
                break  # a number or literal that may go on
            i = j
        safe, safe_stack = i, "".join(stack)
    if safe < 0:
        return None
    closers = "".join("}" if c == "{" else "]" for c in reversed(safe_stack))
    try:
        return DECODER.decode(text[:safe] + closers)
    except JSON_ERRORS:  # (not a JsonStream's text after all)
        return None


def arguments_object(text: str) -> dict[str, Any]:
    """A call's arguments as the object Anthropic's ``input`` and Ollama's ``arguments`` are:
    a JSON object's text (the chat side returns anything else as content), or, cut off by
    ``max_tokens``, what is complete of it (:func:`healed`); should one be neither (nested by
    the thousand, say), kept whole as ``{"arguments": text}``."""
    try:
        value = json.loads(text)
    except JSON_ERRORS:
        value = healed(text)
    return value if isinstance(value, dict) else {"arguments": text}
