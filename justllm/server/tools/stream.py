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
gives. The XML forms (``qwen3_coder``, ``glm``: their values' JSON is known only once a value
has ended) stream each call whole once its ``</tool_call>`` is written. Only an answer cut off
inside a call (``max_tokens``, a stop string) ends otherwise:
its calls stand as far as they came (``ParsedAnswer.cut``), as OpenAI's API returns them, and
a whole answer is read the same way.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, replace

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


@dataclass(frozen=True)
class CallOpened:
    call_index: int
    name: str


@dataclass(frozen=True)
class CallPiece:
    call_index: int
    arguments: str  # a piece of the call's arguments (canonical JSON text)


CallDelta = CallOpened | CallPiece


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
        self._closed: tuple[ParsedCall, ...] = ()  # XML calls streamed whole (held)
        self._closed_end = -1  # where the last </tool_call> read for them begins
        self._xml_held = False  # a grammar held the XML calls
        self._text = ""
        self._shown = 0  # characters of _text given out as content
        self._calls_from: int | None = None  # where the first complete call marker begins
        self._reader: CallReader | None = None  # when a grammar holds the calls
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
        if self._calls_from is not None and self._fmt in XML_FORMATS:
            self._xml_held |= held
            end = self._text.rfind("</tool_call>")
            if held and end != self._closed_end:
                self._closed_end = end
                closed = closed_xml_calls(self._text, self._calls_from, self._fmt, self._names,
                                          self._parallel, self._schemas)
                self._deltas += rest_of_calls([(c.name, c.arguments) for c in self._closed],
                                              closed)
                self._closed = closed
        elif self._calls_from is not None:
            if held and self._reader is None:
                self._reader = CallReader(self._names, self._parallel)
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
        if self._xml_held:
            assert self._calls_from is not None
            answer = _held_xml(answer, self._closed, self._text, self._calls_from)
        streamed = reader.calls if reader else [(c.name, c.arguments) for c in self._closed]
        self._deltas += rest_of_calls(streamed, answer.calls)
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


def _held(answer: ParsedAnswer, reader: CallReader, text: str, at: int) -> ParsedAnswer:
    """``answer`` (``text`` parsed) where a grammar held the calls from ``at``: cut off
    inside them, the calls as far as ``reader`` came; its content the text before them.
    (After the calls the grammar ends the answer; what an answer cut off there holds is the
    beginning of another call's marker, not words of the model's.)"""
    if reader.calls and not answer.calls:
        return reader.answer(text[:at].rstrip())
    return replace(answer, content=text[:at].rstrip()) if answer.calls else answer


def _held_xml(answer: ParsedAnswer, closed: tuple[ParsedCall, ...], text: str, at: int
              ) -> ParsedAnswer:
    """``answer`` (``text`` parsed) where a grammar held XML calls from ``at``, as ``_held``
    reads JSON ones: cut off inside a call, the ``closed`` ones before it."""
    if closed and not answer.calls:
        return ParsedAnswer(text[:at].rstrip(), closed, cut=True)
    return replace(answer, content=text[:at].rstrip()) if answer.calls else answer


def closed_xml_calls(text: str, at: int, fmt: str, names: frozenset[str] | None,
                     parallel: bool, schemas: Schemas | None) -> tuple[ParsedCall, ...]:
    """The calls of an XML form's region (from ``at``) up to its last ``</tool_call>``: those
    a grammar has closed, which stand whatever follows them."""
    end = text.rfind("</tool_call>", at)
    if end < 0:
        return ()
    return parse_answer(text[at:end + len("</tool_call>")], fmt, names, parallel,
                        schemas).calls


def read_whole(text: str, fmt: str, names: frozenset[str] | None, parallel: bool,
               held: bool, schemas: Schemas | None = None) -> ParsedAnswer:
    """A whole answer read as its stream is: ``parse_answer``, but where a grammar held the
    calls and the answer was cut off inside them, the calls as far as they came."""
    answer = parse_answer(text, fmt, names, parallel, schemas)
    at = first_full_start(text, fmt) if held else None
    if at is None:
        return answer
    if fmt in XML_FORMATS:
        return _held_xml(answer, closed_xml_calls(text, at, fmt, names, parallel, schemas),
                         text, at)
    reader = CallReader(names, parallel)
    reader.feed(text, at)
    return _held(answer, reader, text, at)
