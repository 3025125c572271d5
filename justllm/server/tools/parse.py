"""A model's answer -> (content, tool calls), per tool-call format.

The format is the one the prompt asked for (``ChatTemplate.tool_format``):

- ``hermes`` (Hermes 2 Pro, Qwen 2.5/3, the ``chatml`` built-in): one
  ``<tool_call>{"name": .., "arguments": {..}}</tool_call>`` block per call;
- ``llama3`` (Llama 3.1/3.2/3.3, the ``llama3`` built-in): ``{"name": .., "parameters": {..}}``,
  bare or after ``<|python_tag|>``, several separated by ``;`` or blank space;
- ``mistral`` (Mistral Nemo/Small/Large): ``[TOOL_CALLS][{"name": .., "arguments": {..}}, ..]``,
  or the newer ``[TOOL_CALLS]name[ARGS]{..}`` per call;
- ``qwen3_coder`` (Qwen3-Coder, Qwen3.5, Nemotron 3 Nano): ``<tool_call>`` around
  ``<function=NAME>`` and a ``<parameter=KEY>`` block per argument, its value on lines of its own;
- ``glm`` (GLM 4.5 to 4.7): ``<tool_call>NAME`` then ``<arg_key>KEY</arg_key>`` and
  ``<arg_value>VALUE</arg_value>`` per argument, then ``</tool_call>``;
- ``kimi_k2`` (Kimi K2): ``<|tool_calls_section_begin|>``, then per call
  ``<|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{..}<|tool_call_end|>``,
  then ``<|tool_calls_section_end|>``;
- ``deepseek_v3_1`` (DeepSeek V3.1): ``<｜tool▁calls▁begin｜>``, then per call
  ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{..}<｜tool▁call▁end｜>``, then ``<｜tool▁calls▁end｜>``;
- ``generic`` (the fallback text of templates without tools): ``{"name": .., "arguments":
  {..}}`` or a JSON array of them, possibly in a ```` ```json ```` fence.

The two XML forms write a value as raw text: a plain string parameter's value is the text as
it is, any other's is JSON for its schema (``xml_value``), so they need the functions'
parameters schemas (``schemas``).

Text before the first call stays content. A call that does not parse (bad JSON, no name, a
function that was not offered, arguments that are not an object) makes the whole answer
content: the caller returns it as text, never as an error. Arguments are re-serialised as JSON
text, so a streamed and a whole answer give the same string.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

# A function's name -> its parameters schema (None: it takes none).
Schemas = Mapping[str, dict[str, Any] | None]
XML_FORMATS = frozenset({"qwen3_coder", "glm"})


class Match(Enum):
    NO = 0
    PARTIAL = 1  # the text ends inside what may still become a call marker
    FULL = 2


def _generic_starts() -> tuple[tuple[str, ...], ...]:
    starts = []
    for fence in ((), ("```json",), ("```",)):
        for array in ((), ("[",)):
            starts.append((*fence, *array, "{", '"name"', ":"))
    return tuple(starts)


# Where a call begins: sequences of literal pieces, blank space allowed between pieces.
CALL_STARTS: dict[str, tuple[tuple[str, ...], ...]] = {
    "hermes": (("<tool_call>",),),
    "qwen3_coder": (("<tool_call>",),),
    "glm": (("<tool_call>",),),
    "kimi_k2": (("<|tool_calls_section_begin|>",),),
    "deepseek_v3_1": (("<｜tool▁calls▁begin｜>",),),
    "mistral": (("[TOOL_CALLS]",),),
    "llama3": (("<|python_tag|>",), ("{", '"name"', ":"),
               ("{", '"type"', ":", '"function"', ",", '"name"', ":")),
    "generic": _generic_starts(),
}

def _no_constant(name: str) -> Any:
    raise Malformed(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):  # 1e400: JSON text, but no client's parser reads it back
        raise Malformed(f"the number {text} is out of range")
    return value


class _AsWritten(dict):  # type: ignore[type-arg]
    """A JSON object as the model wrote it: a key given twice is read as its last value (as
    ``json.loads`` reads it), and ``json.dumps`` writes every pair in its place, so arguments
    are re-serialised as written and a stream's pieces (``json_stream.py``) join to them."""

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        super().__init__(pairs)
        self._pairs = pairs

    def items(self) -> Any:  # (json's encoder writes a dict subclass's items())
        return self._pairs


# A model may write raw newlines inside strings; NaN and Infinity are Python's, not JSON's
# (they were passed on as arguments no JSON parser reads).
DECODER = json.JSONDecoder(strict=False, parse_constant=_no_constant, parse_float=_finite,
                           object_pairs_hook=_AsWritten)
# What reading a model's JSON may raise: a decode error, Malformed, a number too long for
# Python's int (ValueError), brackets nested by the thousand.
JSON_ERRORS = (ValueError, RecursionError)
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def dumps(value: Any) -> str:
    """``value`` as JSON text, as arguments are given out: characters as they are but a lone
    surrogate (a model's ``"\\ud83d"`` without its pair), which stays an escape, since no
    UTF-8 can carry it (the response could not be written). Character by character, so a
    stream's pieces of a string (``json_stream.py``) join to the same text."""
    return _LONE_SURROGATE.sub(lambda m: f"\\u{ord(m[0]):04x}",
                               json.dumps(value, ensure_ascii=False))


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object


@dataclass(frozen=True)
class ParsedAnswer:
    content: str
    calls: tuple[ParsedCall, ...] = ()
    # The answer ended inside its calls (a grammar held them; max_tokens or a stop string cut
    # them off): the last one's arguments are as far as they came, not JSON.
    cut: bool = False

    @property
    def called(self) -> bool:
        """Whether the answer ends in whole calls (finish_reason "tool_calls")."""
        return bool(self.calls) and not self.cut


class Malformed(ValueError):
    """A call marker followed by something that is not a call."""


def match_at(text: str, i: int, pieces: tuple[str, ...]) -> Match:
    """Whether a call marker (``pieces``) starts at ``i``."""
    for k, piece in enumerate(pieces):
        if k:
            i = _skip_blank(text, i)
        seen = text[i:i + len(piece)]
        if seen != piece[:len(seen)]:
            return Match.NO
        if len(seen) < len(piece):
            return Match.PARTIAL
        i += len(piece)
    return Match.FULL


def find_call_start(text: str, fmt: str, start: int = 0) -> tuple[Match, int]:
    """The first position at or after ``start`` where a call marker begins (FULL) or may
    still begin (PARTIAL); ``(NO, len(text))`` when there is none."""
    patterns = CALL_STARTS[fmt]
    firsts = {p[0][0] for p in patterns}
    for i in range(start, len(text)):
        if text[i] not in firsts:
            continue
        best = max((match_at(text, i, p) for p in patterns), key=lambda m: m.value)
        if best is not Match.NO:
            return best, i
    return Match.NO, len(text)


def first_full_start(text: str, fmt: str) -> int | None:
    """Where the first complete call marker begins (a marker cut off at the end is text)."""
    i = 0
    while True:
        m, at = find_call_start(text, fmt, i)
        if m is Match.FULL:
            return at
        if m is Match.NO:
            return None
        i = at + 1


def parse_answer(text: str, fmt: str, names: frozenset[str] | None = None,
                 parallel: bool = True, schemas: Schemas | None = None) -> ParsedAnswer:
    """``text`` split into content and calls. ``names``: the functions that were offered (a
    call to any other is malformed; None: any). ``parallel`` False keeps only the first call.
    ``schemas``: the functions' parameters schemas, which type the XML forms' values."""
    at = first_full_start(text, fmt)
    if at is None:
        return ParsedAnswer(text)
    try:
        if fmt in XML_FORMATS:
            objs, end = _xml_calls(text, at, fmt, schemas or {})
        elif fmt in SECTIONS:
            objs, end = _section_calls(text, at, SECTIONS[fmt])
        else:
            objs, end = _PARSERS[fmt](text, at)
        calls = tuple(checked_call(c, names) for c in objs)
    except Malformed:
        return ParsedAnswer(text)
    if not calls:
        return ParsedAnswer(text)
    if not parallel:
        calls = calls[:1]
    head, tail = text[:at].rstrip(), text[end:].strip()
    return ParsedAnswer(head + ("\n" if head and tail else "") + tail, calls)


# ---- the formats ------------------------------------------------------------------------------

def _skip_blank(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _json_at(text: str, i: int) -> tuple[Any, int]:
    i = _skip_blank(text, i)
    try:
        return DECODER.raw_decode(text, i)
    except ValueError as e:
        raise Malformed(str(e)) from None
    except RecursionError:  # (a model's answer can open brackets by the thousand)
        raise Malformed("JSON nested too deeply") from None


def _literal(text: str, i: int, lit: str) -> int:
    """``i`` past ``lit`` (blank space before it skipped). At the end of the text ``lit`` may
    be missing: generation stopped on it, or just before it."""
    i = _skip_blank(text, i)
    if text.startswith(lit, i):
        return i + len(lit)
    if i == len(text):
        return i
    raise Malformed(f"expected {lit!r}")


def _hermes(text: str, i: int) -> tuple[list[Any], int]:
    calls = []
    while text.startswith("<tool_call>", i):
        obj, i = _json_at(text, i + len("<tool_call>"))
        calls.append(obj)
        i = _skip_blank(text, _literal(text, i, "</tool_call>"))
    return calls, i


def _llama3(text: str, i: int) -> tuple[list[Any], int]:
    if text.startswith("<|python_tag|>", i):
        i += len("<|python_tag|>")
    calls = []
    while True:
        obj, i = _json_at(text, i)
        calls.append(obj)
        j = _skip_blank(text, i)
        if text.startswith(";", j):
            j = _skip_blank(text, j + 1)
        if not text.startswith("{", j):
            return calls, i
        i = j


def _mistral(text: str, i: int) -> tuple[list[Any], int]:
    calls: list[Any] = []
    while text.startswith("[TOOL_CALLS]", i):
        i = _skip_blank(text, i + len("[TOOL_CALLS]"))
        if text.startswith(("[", "{"), i):  # a JSON list of calls (or one call)
            value, i = _json_at(text, i)
            calls.extend(value if isinstance(value, list) else [value])
        else:  # name[ARGS]{arguments}
            j = text.find("[ARGS]", i)
            if j < 0:
                raise Malformed("expected [ARGS]")
            name = text[i:j].strip()
            args, i = _json_at(text, j + len("[ARGS]"))
            calls.append({"name": name, "arguments": args})
        i = _skip_blank(text, i)
    return calls, i


@dataclass(frozen=True)
class Section:
    """A family whose calls stand in a section of special tokens: ``begin``, then per call
    ``call`` + its name (as ``name`` reads it: group 1) + ``args`` + JSON arguments + ``end``,
    then ``close``."""

    begin: str
    call: str
    args: str
    end: str
    close: str
    name: re.Pattern[str]


SECTIONS = {
    # (Kimi K2 writes the call's id, functions.NAME:INDEX)
    "kimi_k2": Section("<|tool_calls_section_begin|>", "<|tool_call_begin|>",
                       "<|tool_call_argument_begin|>", "<|tool_call_end|>",
                       "<|tool_calls_section_end|>",
                       re.compile(r"\s*(?:functions\.)?([A-Za-z0-9_-]+):\d+\s*")),
    "deepseek_v3_1": Section("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
                             "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>",
                             re.compile(r"\s*([A-Za-z0-9_-]+)\s*")),
}


def _section_calls(text: str, i: int, section: Section) -> tuple[list[Any], int]:
    calls = []
    i += len(section.begin)
    while True:
        i = _skip_blank(text, i)
        if text.startswith(section.call, i):
            head, i = _until(text, i + len(section.call), section.args)
            named = section.name.fullmatch(head)
            if named is None:
                raise Malformed(f"{head!r} does not name a function as {section.call} does")
            args, i = _json_at(text, i)
            calls.append({"name": named[1], "arguments": args})
            i = _literal(text, i, section.end)
        else:  # (the section's end may be cut off where the text ends)
            return calls, _skip_blank(text, _literal(text, i, section.close))


def _generic(text: str, i: int) -> tuple[list[Any], int]:
    fenced = text.startswith("```", i)
    if fenced:
        i += len("```json") if text.startswith("```json", i) else len("```")
    value, i = _json_at(text, i)
    if fenced:
        i = _literal(text, i, "```")
    return (value if isinstance(value, list) else [value]), i


_PARSERS = {"hermes": _hermes, "llama3": _llama3, "mistral": _mistral, "generic": _generic}


# What a plain string parameter's schema may say besides its type: its value is then any raw
# text (or one of its enum's). One that bounds the text (a pattern, a format, a length) gets
# its value as a JSON string, which the grammar can hold to the schema.
_PLAIN_STRING_KEYS = frozenset({"type", "enum", "const", "title", "description", "examples",
                                "default", "deprecated", "$comment"})


def raw_text_value(schema: Any) -> bool:
    """Whether an XML call writes the value of a parameter of ``schema`` as raw text (a plain
    string, as the families' templates write one) rather than as JSON."""
    if not isinstance(schema, dict) or not set(schema) <= _PLAIN_STRING_KEYS:
        return False
    if "type" in schema:
        return schema["type"] in ("string", ["string"])
    choices = schema["enum"] if "enum" in schema else [schema.get("const", None)]
    return isinstance(choices, list) and bool(choices) and all(
        isinstance(c, str) for c in choices)


# Python's literals, as Qwen3-Coder's own template writes a boolean or a null (``| string``).
_PYTHON_LITERALS: dict[str, Any] = {"True": True, "False": False, "None": None}


def xml_value(raw: str, schema: Any) -> Any:
    """A value as an XML call writes it -> the argument: raw text for a plain string
    (``raw_text_value``), else JSON, else (a model's slip, or a parameter the schema does not
    name) the text as a string, as vLLM's and llama.cpp's parsers read it."""
    if raw_text_value(schema):
        return raw
    text = raw.strip()
    try:
        return DECODER.decode(text)
    except JSON_ERRORS:
        return _PYTHON_LITERALS.get(text, raw)


FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names


def _until(text: str, i: int, end: str) -> tuple[str, int]:
    """The text from ``i`` to ``end``, and where ``end`` ends."""
    j = text.find(end, i)
    if j < 0:
        raise Malformed(f"expected {end!r}")
    return text[i:j], j + len(end)


def _xml_calls(text: str, i: int, fmt: str, schemas: Schemas) -> tuple[list[Any], int]:
    calls = []
    while text.startswith("<tool_call>", i):
        i += len("<tool_call>")
        if fmt == "qwen3_coder":
            name, i = _until(text, _literal(text, i, "<function="), ">")
            key_open, key_close, value_open, value_close = "<parameter=", ">", "", "</parameter>"
            call_close = "</function>"
        else:
            j = text.find("<", i)
            name, i = text[i:j if j >= 0 else len(text)], j if j >= 0 else len(text)
            key_open, key_close = "<arg_key>", "</arg_key>"
            value_open, value_close, call_close = "<arg_value>", "</arg_value>", "</tool_call>"
        name = name.strip()
        if not FUNCTION_NAME.fullmatch(name):  # (GLM's is the text up to a tag)
            raise Malformed(f"{name!r} is not a function's name")
        schema = schemas.get(name) or {}
        params = dict(schema.get("properties") or {})
        more = schema.get("additionalProperties")  # (the schema of a key it does not name)
        args: dict[str, Any] = {}
        while True:
            i = _skip_blank(text, i)
            if text.startswith(key_open, i):
                key, i = _until(text, i + len(key_open), key_close)
                i = _literal(text, i, value_open) if value_open else i
                raw, i = _until(text, i, value_close)
                if fmt == "qwen3_coder":  # (the value stands on lines of its own)
                    raw = raw.removeprefix("\n").removesuffix("\n")
                key = key.strip()
                args[key] = xml_value(raw, params.get(key, more if isinstance(more, dict)
                                                      else None))
            elif text.startswith(call_close, i):  # (not at the end of the text: a call
                # cut off after a value may be cut off before its other values)
                i += len(call_close)
                break
            else:
                raise Malformed(f"expected {key_open!r} or {call_close!r}")
        if fmt == "qwen3_coder":
            i = _literal(text, i, "</tool_call>")
        calls.append({"name": name, "arguments": args})
        i = _skip_blank(text, i)
    return calls, i


def checked_call(obj: Any, names: frozenset[str] | None) -> ParsedCall:
    """One call object -> ParsedCall, or Malformed. Accepts ``arguments`` or ``parameters``
    (an object, or JSON text of one; absent: no arguments) and Llama's ``"type": "function"``."""
    if not isinstance(obj, dict):
        raise Malformed("a call is not a JSON object")
    name = obj.get("name")
    if not isinstance(name, str) or not name or (names is not None and name not in names):
        raise Malformed(f"no function named {name!r} was offered")
    extra = set(obj) - {"name", "arguments", "parameters", "type", "id"}
    if extra:
        raise Malformed(f"unexpected keys {sorted(extra)}")
    args = obj.get("arguments", obj.get("parameters", {}))
    try:
        if isinstance(args, str):
            args = DECODER.decode(args)
        text = dumps(args)
    except JSON_ERRORS:
        raise Malformed("arguments are not JSON, or nested too deeply") from None
    if not isinstance(args, dict):
        raise Malformed("arguments are not a JSON object")
    return ParsedCall(name, text)
