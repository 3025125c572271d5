"""One streamed answer split into content and tool calls as it grows.

Content is shown as soon as it cannot be part of a call: text from the first position where
a call marker may begin is held back (so no ``<tool_call>``, ``[TOOL_CALLS]`` or the ``{"name"``
of a JSON call ever reaches the content), and so are trailing blanks (a call's content ends
without them). Once a complete marker is seen, the rest of the answer is the call region; it
is parsed when the answer ends, by ``parse_answer`` on the whole text, so a stream and a
whole answer always agree (a malformed call comes out as the held-back text).

Where a grammar holds the call region (a forced call, a format beside tools, or the lazy
grammar once the marker came), the calls cannot turn out malformed, so they are streamed as
they are written (a ``CallReader``): each call opens once its name is read and its
arguments follow as canonical JSON text (``json_stream.py``), pieces of what the whole parse
gives (the XML forms': ``xml_stream.py``). Only an answer cut off inside a call (``max_tokens``, a stop string) ends otherwise:
its calls stand as far as they came (``ParsedAnswer.cut``), as OpenAI's API returns them, and
a whole answer is read the same way.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import replace

from justllm.server.tools.deltas import CallDelta, CallOpened, CallPiece
from justllm.server.tools.json_stream import JsonStream
from justllm.server.tools.parse import (
    XML_FORMATS,
    Match,
    ParsedAnswer,
    ParsedCall,
    Schemas,
    find_call_start,
    first_full_start,
    parse_answer,
)
from justllm.server.tools.xml_stream import XmlCallReader

log = logging.getLogger(__name__)

# What may stand before a call region's first call and between its calls.
_BETWEEN = re.compile(r"(?:\s|[\[\]{},;]|</?tool_call>|\[TOOL_CALLS\]|<\|python_tag\|>"
                      r"|<\|tool_calls_section_begin\|>|<\|tool_call_end\|>"
                      r"|<｜tool▁calls▁begin｜>|<｜tool▁call▁end｜>)*")
# The head of a call as the forcing grammar spells it (``tools/grammar.py``: an object with
# "name" first, then the arguments; Mistral's [TOOL_CALLS]name[ARGS]; Kimi K2's call id;
# DeepSeek V3.1's name and separator); its arguments begin where it ends.
_CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*'
                        r'"(?:arguments|parameters)"\s*:\s*'
                        r'|\[TOOL_CALLS\]\s*([A-Za-z0-9_-]+)\s*\[ARGS\]\s*'
                        r'|<\|tool_call_begin\|>\s*(?:functions\.)?([A-Za-z0-9_-]+):\d+\s*'
                        r'<\|tool_call_argument_begin\|>\s*'
                        r'|<｜tool▁call▁begin｜>\s*([A-Za-z0-9_-]+)\s*<｜tool▁sep｜>\s*')


class CallReader:
    """Reads a call region that a grammar holds, as it grows: the calls opened so far, each
    with its arguments as far as they are settled. Between calls (and before the first) only
    blanks, brackets, separators and the families' markers may stand: text of any other kind
    (a reasoning model's thinking kept in the text, where a marker it names began the
    region) stops the reader."""

    def __init__(self, names: frozenset[str] | None, parallel: bool) -> None:
        self._names, self._parallel = names, parallel
        self._calls: list[tuple[str, list[str]]] = []  # (name, pieces of its arguments)
        self._args: JsonStream | None = None  # the open call's arguments
        self._args_from = 0  # where they begin in the text
        self._fed = 0  # of the text, given to _args
        self._at = 0  # where the next call's head may begin
        self.stopped = False  # the region went where the reader does not follow

    @property
    def calls(self) -> list[tuple[str, str]]:
        """(name, arguments so far) of each call opened."""
        return [(name, "".join(pieces)) for name, pieces in self._calls]

    def feed(self, text: str, start: int) -> list[CallDelta]:
        """``text``: the answer so far (it only grows), its call region from ``start``. The
        calls' news."""
        out: list[CallDelta] = []
        self._at = max(self._at, start)
        while not self.stopped:
            if self._args is None:
                if self._calls and not self._parallel:
                    break
                head = _CALL_HEAD.search(text, self._at)
                if head is None:
                    break
                opening = text[head.end():].lstrip()[:1]
                if not opening:
                    break  # (what the arguments are is not known yet)
                try:
                    name = json.loads(head[1]) if head[1] is not None else (
                        head[2] or head[3] or head[4])
                except ValueError:
                    name = None
                # (arguments given as JSON text, a string, are read whole at the end)
                if (not _BETWEEN.fullmatch(text, self._at, head.start()) or opening != "{"
                        or not isinstance(name, str)
                        or (self._names is not None and name not in self._names)):
                    self.stopped = True
                    break
                self._calls.append((name, []))
                out.append(CallOpened(len(self._calls) - 1, name))
                self._args, self._args_from = JsonStream(), head.end()
                self._fed = head.end()
            piece = self._args.feed(text[self._fed:])
            self._fed = len(text)
            if piece:
                self._calls[-1][1].append(piece)
                out.append(CallPiece(len(self._calls) - 1, piece))
            if self._args.broken:
                self.stopped = True
            elif self._args.end is not None:
                self._at = self._args_from + self._args.end
                self._args = None
                continue
            break
        return out

    def answer(self, content: str) -> ParsedAnswer:
        """The answer when the whole text does not parse, the calls cut off (or, rarer, a
        value nested deeper than the parser goes): the calls as far as they came."""
        return ParsedAnswer(content, tuple(ParsedCall(n, a) for n, a in self.calls), cut=True)


class CallSplitter:
    """Feed an answer's text pieces, get the content that is safe to show; ``finish`` gives
    the rest of the content and the calls."""

    def __init__(self, fmt: str, names: frozenset[str] | None = None,
                 parallel: bool = True, schemas: Schemas | None = None) -> None:
        self._fmt = fmt
        self._names = names
        self._parallel = parallel
        self._schemas = schemas
        self._text = ""
        self._shown = 0  # characters of _text given out as content
        self._calls_from: int | None = None  # where the first complete call marker begins
        self._reader: CallReader | XmlCallReader | None = None  # when a grammar holds them
        self._deltas: list[CallDelta] = []

    def feed(self, piece: str, held: bool = False) -> str:
        """Append ``piece``; the content that can be shown now (maybe ""). ``held``: a
        grammar holds the answer now (the calls it holds are streamed, ``deltas``; a lazy
        grammar may take hold a little after the marker, llama3's at the ``{`` after
        ``<|python_tag|>``)."""
        self._text += piece
        shown = ""
        if self._calls_from is None:
            match, at = find_call_start(self._text, self._fmt, self._shown)
            if match is Match.FULL:
                self._calls_from = at
            safe = max(self._shown, len(self._text[:at].rstrip()))
            shown, self._shown = self._text[self._shown:safe], safe
        if self._calls_from is not None:
            if held and self._reader is None:
                self._reader = _reader(self._fmt, self._names, self._parallel, self._schemas)
            if self._reader is not None:
                self._deltas += self._reader.feed(self._text, self._calls_from)
        return shown

    def deltas(self) -> list[CallDelta]:
        """The calls' news since the last time asked."""
        out, self._deltas = self._deltas, []
        return out

    def finish(self) -> tuple[str, ParsedAnswer]:
        """The content not shown yet, and the whole answer parsed; ``deltas`` then gives
        what is left of calls streamed so far (and the calls never opened, whole)."""
        answer = parse_answer(self._text, self._fmt, self._names, self._parallel,
                              self._schemas)
        reader = self._reader
        self._deltas += rest_of_calls(reader.calls if reader else [], answer.calls)
        if reader is not None:
            assert self._calls_from is not None  # (a reader is made at a call's marker)
            answer = _held(answer, reader, self._text, self._calls_from)
        rest = answer.content[self._shown:]
        self._shown = len(answer.content)
        return rest, answer


def rest_of_calls(streamed: list[tuple[str, str]],
                   calls: tuple[ParsedCall, ...]) -> list[CallDelta]:
    """What the stream still owes of ``calls`` after ``streamed``: the rest of each open
    call's arguments, then the calls it never opened."""
    out: list[CallDelta] = []
    for k, call in enumerate(calls):
        if k < len(streamed):
            # (a prefix by construction: the same text, read the same way)
            so_far = streamed[k][1]
            if not call.arguments.startswith(so_far):
                log.warning("a streamed call's arguments %r are not the beginning of the "
                            "parsed %r", so_far, call.arguments)
                continue
            rest = call.arguments[len(so_far):]
        else:
            out.append(CallOpened(k, call.name))
            rest = call.arguments
        if rest:
            out.append(CallPiece(k, rest))
    return out


def _reader(fmt: str, names: frozenset[str] | None, parallel: bool, schemas: Schemas | None
            ) -> CallReader | XmlCallReader:
    """What reads ``fmt``'s calls as a grammar holds them."""
    if fmt in XML_FORMATS:
        return XmlCallReader(fmt, names, parallel, schemas)
    return CallReader(names, parallel)


def _held(answer: ParsedAnswer, reader: CallReader | XmlCallReader, text: str, at: int
          ) -> ParsedAnswer:
    """``answer`` (``text`` parsed) where a grammar held the calls from ``at``: cut off
    inside them, the calls as far as ``reader`` came; its content the text before them.
    (After the calls the grammar ends the answer; what an answer cut off there holds is the
    beginning of another call's marker, not words of the model's.)"""
    if reader.calls and not answer.calls:
        return reader.answer(text[:at].rstrip())
    return replace(answer, content=text[:at].rstrip()) if answer.calls else answer


def read_whole(text: str, fmt: str, names: frozenset[str] | None, parallel: bool,
               held: bool, schemas: Schemas | None = None) -> ParsedAnswer:
    """A whole answer read as its stream is: ``parse_answer``, but where a grammar held the
    calls and the answer was cut off inside them, the calls as far as they came."""
    answer = parse_answer(text, fmt, names, parallel, schemas)
    at = first_full_start(text, fmt) if held else None
    if at is None:
        return answer
    reader = _reader(fmt, names, parallel, schemas)
    reader.feed(text, at)
    return _held(answer, reader, text, at)
