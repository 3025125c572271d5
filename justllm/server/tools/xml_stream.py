"""Qwen3-Coder's and GLM's XML calls streamed as a grammar lets the model write them.

A call opens once its function's name is read; its arguments follow as pieces of the
canonical JSON text the whole parse gives (``parse.py``: ``dumps`` of the arguments): ``{``,
each key once its tag is read, a plain string's value a character at a time (JSON escapes
one character at a time; what may still be its closing tag, or Qwen3-Coder's line break
before it, waits), any other value once it has ended (its JSON is known only then), ``}``
at the call's end. A coding agent sees a file's content as the model writes it.

Like ``stream.CallReader``, it stops at what it cannot read (a thinking kept in the text that
names the marker, where the region began): the whole answer's parse has the last word.
"""

from __future__ import annotations

import json
import re
from typing import Any

from justllm.server.tools.deltas import CallDelta, CallOpened, CallPiece
from justllm.server.tools.parse import (
    ParsedAnswer,
    ParsedCall,
    Schemas,
    dumps,
    raw_text_value,
    xml_value,
)


class _Form:
    """Where an XML form's parts begin and end (``opening``: the literal a call's head
    begins with, ``key_open`` a key's; a value ends at ``value_end``)."""

    def __init__(self, head: str, opening: str, key: str, key_open: str, value_end: str,
                 end: str) -> None:
        self.head, self.key = re.compile(head, re.S), re.compile(key, re.S)
        self.end = re.compile(r"\s*" + re.escape(end))
        self.opening, self.key_open, self.value_end, self.end_literal = (
            opening, key_open, value_end, end)


_FORMS = {
    "qwen3_coder": _Form(r"\s*<tool_call>\s*<function=([^>]*)>", "<tool_call>",
                         r"\s*<parameter=([^>]*)>", "<parameter=", "</parameter>",
                         "</function>"),
    # (GLM's name runs to the next tag)
    "glm": _Form(r"\s*<tool_call>([^<]*)(?=<)", "<tool_call>",
                 r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>", "<arg_key>", "</arg_value>",
                 "</tool_call>"),
}


_TOOL_CALL_END = re.compile(r"\s*</tool_call>")


def _may_begin(text: str, at: int, literal: str) -> bool:
    """Whether the text from ``at`` (blanks skipped) begins with ``literal``, or ends inside it."""
    rest = text[at:].lstrip()
    return rest.startswith(literal) or literal.startswith(rest)


class XmlCallReader:
    """Reads an XML form's call region as it grows, as ``stream.CallReader`` reads JSON."""

    def __init__(self, fmt: str, names: frozenset[str] | None, parallel: bool,
                 schemas: Schemas | None) -> None:
        self._fmt, self._form = fmt, _FORMS[fmt]
        self._names, self._parallel, self._schemas = names, parallel, schemas or {}
        self._calls: list[tuple[str, list[str]]] = []
        self._at = 0  # where reading goes on
        self._open = False  # inside a call (its name read)
        self._closing = False  # after Qwen3-Coder's </function>, before its </tool_call>
        self._value: tuple[Any, bool] | None = None  # the open value's schema, and if raw
        self._sent = 0  # of the open raw value's text, characters given out
        self._quoted = False  # the open raw value's opening quote was given out
        self.stopped = False

    @property
    def calls(self) -> list[tuple[str, str]]:
        """(name, arguments so far) of each call opened."""
        return [(name, "".join(pieces)) for name, pieces in self._calls]

    def answer(self, content: str) -> ParsedAnswer:
        """The calls as far as they came (the answer was cut off inside them)."""
        return ParsedAnswer(content, tuple(ParsedCall(n, a) for n, a in self.calls), cut=True)

    def feed(self, text: str, start: int) -> list[CallDelta]:
        """``text``: the answer so far (it only grows), its call region from ``start``."""
        out: list[CallDelta] = []
        self._at = max(self._at, start)
        while not self.stopped and self._step(text, out):
            pass
        return out

    def _piece(self, out: list[CallDelta], piece: str) -> None:
        if piece:
            self._calls[-1][1].append(piece)
            out.append(CallPiece(len(self._calls) - 1, piece))

    def _step(self, text: str, out: list[CallDelta]) -> bool:
        """One part further (False: the text must grow first, or the reader stopped)."""
        form = self._form
        if self._value is not None:
            return self._read_value(text, out)
        if self._closing:  # Qwen3-Coder's </tool_call> after its </function>
            close = _TOOL_CALL_END.match(text, self._at)
            if close is None and _may_begin(text, self._at, "</tool_call>"):
                return False
            self._at, self._closing = close.end() if close else self._at, False
            return True
        if not self._open:
            if self._calls and not self._parallel:
                return False
            head = form.head.match(text, self._at)
            if head is None:
                self.stopped = not _may_begin(text, self._at, form.opening)
                return False
            name = head[1].strip()
            if not name or (self._names is not None and name not in self._names):
                self.stopped = True
                return False
            self._at, self._open = head.end(), True
            self._calls.append((name, []))
            out.append(CallOpened(len(self._calls) - 1, name))
            self._piece(out, "{")
            return True
        key = form.key.match(text, self._at)
        if key is not None:
            schema = self._schemas.get(self._calls[-1][0]) or {}
            more = schema.get("additionalProperties")
            prop = (schema.get("properties") or {}).get(
                key[1].strip(), more if isinstance(more, dict) else None)
            comma = "" if self._calls[-1][1] == ["{"] else ", "
            self._piece(out, f"{comma}{json.dumps(key[1].strip(), ensure_ascii=False)}: ")
            self._at, self._value = key.end(), (prop, raw_text_value(prop))
            self._sent, self._quoted = 0, False
            return True
        end = form.end.match(text, self._at)
        if end is not None:
            self._piece(out, "}")
            self._at, self._open = end.end(), False
            self._closing = self._fmt == "qwen3_coder"
            return True
        self.stopped = not (_may_begin(text, self._at, form.key_open)
                            or _may_begin(text, self._at, form.end_literal))
        return False

    def _read_value(self, text: str, out: list[CallDelta]) -> bool:
        assert self._value is not None
        schema, raw = self._value
        closing = self._form.value_end
        end = text.find(closing, self._at)
        body = text[self._at:end if end >= 0 else len(text)]
        lines = self._fmt == "qwen3_coder"  # (a value stands on lines of its own)
        if lines:
            if not body and end < 0:  # (whether its first line break is the value's own)
                return False
            body = body.removeprefix("\n")
        if end < 0:
            if raw:  # (what may still be the closing tag, or the line break before it, waits)
                tails = (closing, "\n" + closing) if lines else (closing,)
                hold = next((k for k in range(min(len(closing) + 1, len(body)), 0, -1)
                             if any(t.startswith(body[-k:]) for t in tails)), 0)
                self._send(out, body[:len(body) - hold], last=False)
            return False
        if lines:
            body = body.removesuffix("\n")
        if raw:
            self._send(out, body, last=True)
        else:
            self._piece(out, dumps(xml_value(body, schema)))
        self._at, self._value = end + len(closing), None
        return True

    def _send(self, out: list[CallDelta], settled: str, last: bool) -> None:
        """A raw value's text settled so far as JSON string pieces (``last``: all of it)."""
        piece = dumps(settled[self._sent:])[1:-1] if len(settled) > self._sent else ""
        opening = '"' if not self._quoted and (piece or last) else ""
        self._quoted = self._quoted or bool(opening)
        self._sent = max(self._sent, len(settled))
        self._piece(out, opening + piece + ('"' if last else ""))
