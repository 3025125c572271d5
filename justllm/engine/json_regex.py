"""A JSON schema's ``pattern`` said over the *text* of a JSON string, for the grammar converter.

A pattern constrains the decoded string, but the grammar writes the JSON text between the
quotes, where ``"``, ``\\`` and control characters appear escaped. llama-cpp-python's
converter copied the pattern as it was, so ``.`` and ``[^x]`` let the model write a raw quote,
backslash or newline (invalid JSON), a literal ``"`` ended the string early, and ``\\d``,
``\\w``, ``\\s`` and ``\\.`` were grammars llama.cpp could not parse. ``json_text_pattern``
rewrites a pattern into the converter's dialect (anchored ``^...$``, groups, ``|``,
quantifiers, character classes of ``\\u`` ranges) so that what it matches is exactly the
escaped text of the strings the pattern matches, where a character JSON must escape has one
spelling: ``\\"``, ``\\\\``, ``\\n``, ``\\r``, ``\\t``, ``\\b``, ``\\f`` or ``\\u00XX``.
JSON Schema's patterns are unanchored, so a side without ``^`` or ``$`` gets ``.*``. What a
grammar cannot say (back-references, lookaround, word boundaries) is a ``ValueError``. Pure.
"""

from __future__ import annotations

import re

_MAX = 0x10FFFF
_SHORT = {0x08: "b", 0x09: "t", 0x0A: "n", 0x0C: "f", 0x0D: "r", 0x22: '"', 0x5C: "\\"}
# Characters JSON must escape, as (lo, hi) ranges.
_UNSAFE = ((0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C), (0x7F, 0x7F))
_DIGIT = ((0x30, 0x39),)
_WORD = ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
# ECMA's \s: its white space and line terminators
_SPACE = ((0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A),
          (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000),
          (0xFEFF, 0xFEFF))
_SHORTHANDS = {"d": _DIGIT, "w": _WORD, "s": _SPACE}
_CONTROL_ESCAPES = {"n": 0x0A, "r": 0x0D, "t": 0x09, "f": 0x0C, "v": 0x0B, "0": 0x00}
# What the converter reads as syntax outside a class (it takes them back escaped).
_QUANTIFIER = re.compile(r"(\d+)(?:,(\d*))?\}")
_HEX = re.compile(r"[0-9A-Fa-f]{1,6}")
MAX_REPEAT = 1000  # as a schema's minLength and the like (engine/backend.py MAX_SCHEMA_REPEAT)

Ranges = list[tuple[int, int]]


def _normal(ranges: Ranges) -> Ranges:
    out: Ranges = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _complement(ranges: Ranges) -> Ranges:
    out, at = [], 0
    for lo, hi in _normal(ranges):
        if lo > at:
            out.append((at, lo - 1))
        at = hi + 1
    if at <= _MAX:
        out.append((at, _MAX))
    return out


def _minus(ranges: Ranges, cut: Ranges) -> Ranges:
    return _complement([*_complement(ranges), *cut])


def _escaped_text(code: int) -> str:
    """The converter-dialect pattern for the JSON text of one character JSON escapes: a
    group, so that a quantifier after it repeats all of it."""
    short = _SHORT.get(code)
    tail = ('\\"' if short == '"' else "\\\\" if short == "\\" else short
            if short else f"u00{code:02X}")
    return "(\\\\" + tail + ")"


def _char_text(code: int, unsafe: tuple[tuple[int, int], ...] = _UNSAFE) -> str:
    """The converter-dialect pattern for the JSON text of the character ``code`` (the text
    itself with no ``unsafe`` ranges)."""
    if any(lo <= code <= hi for lo, hi in unsafe):
        return _escaped_text(code)
    c = chr(code)
    if c.isalnum() or c in " !#%&',-/:;<=>@_`~" or (code > 0x7F and c.isprintable()):
        return c
    return _class([(code, code)])  # ".", "+", "^" and the like: a one-character class


def _class(ranges: Ranges) -> str:
    def one(code: int) -> str:
        return f"\\x{code:02X}" if code <= 0xFF else (
            f"\\u{code:04X}" if code <= 0xFFFF else f"\\U{code:08X}")

    return "[" + "".join(one(lo) if lo == hi else f"{one(lo)}-{one(hi)}"
                         for lo, hi in ranges) + "]"


def _set_text(ranges: Ranges, unsafe_ranges: tuple[tuple[int, int], ...] = _UNSAFE) -> str:
    """A set of characters as the converter-dialect pattern of their JSON text: the safe
    ones in one class, each unsafe one as its escape."""
    ranges = _normal(ranges)
    safe = _minus(ranges, list(unsafe_ranges))
    unsafe = [c for lo, hi in unsafe_ranges for c in range(lo, hi + 1)
              if any(a <= c <= b for a, b in ranges)]
    escapes = [_escaped_text(c) for c in unsafe]
    if all(c in unsafe for c in range(0x20)):  # (every control character: one rule for the
        escapes = [_escaped_text(c) for c in unsafe  # \u00XX forms, and the short ones)
                   if c >= 0x20 or c in _SHORT] + ["(\\\\u00[01][0-9A-Fa-f])"]
    parts = ([_class(safe)] if safe else []) + escapes
    if not parts:
        raise ValueError("a character class that matches no character")
    return parts[0] if len(parts) == 1 else "(" + "|".join(parts) + ")"


class _Reader:
    def __init__(self, pattern: str, unsafe: tuple[tuple[int, int], ...] = _UNSAFE) -> None:
        self.p = pattern
        self.i = 0
        self.unsafe = unsafe  # what the text spells escaped

    def peek(self, k: int = 0) -> str:
        j = self.i + k
        return self.p[j] if j < len(self.p) else ""

    def take(self) -> str:
        c = self.peek()
        if not c:
            raise ValueError("the pattern ends inside an escape, class or group")
        self.i += 1
        return c

    def escape(self) -> tuple[str, Ranges | int]:
        """After a backslash: ("set", ranges) or ("char", code)."""
        c = self.take()
        if c.lower() in _SHORTHANDS:
            ranges = list(_SHORTHANDS[c.lower()])
            return "set", _complement(ranges) if c.isupper() else ranges
        if c in _CONTROL_ESCAPES:
            if c == "0" and self.peek().isdigit():
                raise ValueError("octal escapes are not supported")
            return "char", _CONTROL_ESCAPES[c]
        if c in "xu":
            width = 2 if c == "x" else 4
            if c == "u" and self.peek() == "{":
                self.take()
                digits = ""
                while self.peek() != "}":
                    digits += self.take()
                self.take()
            else:
                digits = "".join(self.take() for _ in range(width))
            if not _HEX.fullmatch(digits) or int(digits, 16) > _MAX:
                raise ValueError(f"a bad \\{c} escape")
            return "char", int(digits, 16)
        if c.isdigit():
            raise ValueError("back-references are not supported")
        if c in "bB":
            raise ValueError(f"\\{c} (a word boundary) is not supported")
        if c in "pPkc":
            raise ValueError(f"\\{c} escapes are not supported")
        if c.isalnum():
            raise ValueError(f"an unknown escape \\{c}")
        return "char", ord(c)


def _class_ranges(r: _Reader) -> tuple[Ranges, bool]:
    """After '[': the class's ranges and whether it is negated (the ']' is read)."""
    negated = r.peek() == "^"
    if negated:
        r.take()
    ranges: Ranges = []
    first = True
    while True:
        c = r.take()
        if c == "]" and not first:
            break
        first = False
        if c == "\\":
            kind, value = r.escape()
            if kind == "set":
                assert isinstance(value, list)
                ranges += value
                continue
            assert isinstance(value, int)
            lo = value
        else:
            lo = ord(c)
        if r.peek() == "-" and r.peek(1) not in ("]", ""):
            r.take()
            c = r.take()
            if c == "\\":
                kind, value = r.escape()
                if kind == "set":
                    raise ValueError("a range ends in a class shorthand")
                assert isinstance(value, int)
                hi = value
            else:
                hi = ord(c)
            if hi < lo:
                raise ValueError("a range out of order in a character class")
            ranges.append((lo, hi))
        else:
            ranges.append((lo, lo))
    return ranges, negated


def _sequence(r: _Reader, depth: int) -> tuple[str, bool]:
    """Alternatives up to a ')' at ``depth`` > 0 (not read) or the end, and whether they can
    match nothing. A part that can match nothing may not be repeated (``(a?){0,200}``,
    ``(a|)*``), nor a quantifier quantified (``a**``): llama.cpp's grammar keeps a parse
    stack per way through such a repetition (one 12-character pattern held the engine for
    94 s a token) or refuses it as left recursion."""
    out = ""
    atoms: list[bool] = []  # the current alternative's parts: whether each can match nothing
    empty = False  # whether an alternative before this one can match nothing
    quantified = False  # the last thing read was a quantifier
    while r.peek() and not (r.peek() == ")" and depth):
        c = r.take()
        if c in "*+?" or (c == "{" and _QUANTIFIER.match(r.p, r.i)):
            if not atoms or quantified:
                raise ValueError("a quantifier with nothing to repeat" if not atoms
                                 else "a quantifier after a quantifier")
            least, most = 0, None
            if c == "{":
                quantifier = _QUANTIFIER.match(r.p, r.i)
                assert quantifier is not None
                body = quantifier.group(0)
                least = int(quantifier.group(1))
                most = (least if "," not in body else
                        int(quantifier.group(2)) if quantifier.group(2) else None)
                if most is not None and most < least:
                    raise ValueError(f"{{{body} repeats at least {least} but at most {most}")
                if max(least, most or 0) > MAX_REPEAT:
                    raise ValueError(f"{{{body} repeats more than {MAX_REPEAT} times (the "
                                     "grammar nests a group per repetition)")
                r.i += len(body)
                out += "{" + body
            else:
                least, most = (0, None) if c == "*" else (1, None) if c == "+" else (0, 1)
                out += c
            if atoms[-1] and (most is None or most > 1):
                raise ValueError("a repeated part that can match nothing (such as (a?)* or "
                                 "(a|){2,5}): its grammar is ambiguous without end")
            atoms[-1] = atoms[-1] or least == 0
            quantified = True
            if r.peek() == "?":  # lazy: the same strings
                r.take()
            continue
        quantified = False
        if c == "|":
            empty = empty or all(atoms)
            atoms = []
            out += "|"
        elif c == "(":
            if r.peek() == "?":
                r.take()
                if r.take() != ":":
                    raise ValueError("lookahead, lookbehind and named groups are not "
                                     "supported")
            text, nullable = _sequence(r, depth + 1)
            out += "(" + text + ")"
            atoms.append(nullable)
            if r.take() != ")":
                raise ValueError("unbalanced parentheses")
        elif c == ")":
            raise ValueError("unbalanced parentheses")
        elif c == ".":
            out += "."  # the grammar's dot: any character JSON writes raw (engine/backend.py)
            atoms.append(False)
        elif c == "[":
            ranges, negated = _class_ranges(r)
            out += _set_text(_complement(ranges) if negated else ranges, r.unsafe)
            atoms.append(False)
        elif c == "\\":
            kind, value = r.escape()
            if kind == "set":
                assert isinstance(value, list)
                out += _set_text(value, r.unsafe)
            else:
                assert isinstance(value, int)
                out += _char_text(value, r.unsafe)
            atoms.append(False)
        elif c in "^$":
            raise ValueError(f"'{c}' inside the pattern (only at the start of the pattern or "
                             "of a top-level alternative, and '$' at the end) is not "
                             "supported")
        else:
            out += _char_text(ord(c), r.unsafe)
            atoms.append(False)
    return out, empty or all(atoms)


def _top_level_alternatives(pattern: str) -> list[str]:
    parts, depth, start, i = [], 0, 0, 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":  # to its closing ']' (one right after '[' or '[^' is a member)
            i += 2 if pattern[i + 1:i + 2] == "^" else 1
            i += 1 if pattern[i:i + 1] == "]" else 0
            while i < len(pattern) and pattern[i] != "]":
                i += 2 if pattern[i] == "\\" else 1
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        elif c == "|" and depth == 0:
            parts.append(pattern[start:i])
            start = i + 1
        i += 1
    parts.append(pattern[start:])
    return parts


def json_text_pattern(pattern: str) -> str:
    """``pattern`` (a JSON Schema regex over the decoded string) as an anchored pattern over
    the string's JSON text, in llama-cpp-python's converter's dialect. ValueError for what a
    grammar cannot say."""
    return _translated(pattern, _UNSAFE, whole=False)


def raw_text_pattern(pattern: str) -> str:
    """``pattern`` as a pattern for text that it matches whole (vLLM's ``regex``: the answer
    itself, no JSON around it; anchored at both ends whether it says so or not), in the
    converter's dialect for its raw mode: every character but letters, digits and plain
    punctuation as a one-character class (the raw mode writes a quote unescaped)."""
    return _translated(pattern, (), whole=True)


def _translated(pattern: str, unsafe: tuple[tuple[int, int], ...], whole: bool) -> str:
    branches = []
    for branch in _top_level_alternatives(pattern):
        start = branch.startswith("^")
        body = branch[1:] if start else branch
        end = body.endswith("$") and not _escaped_at_end(body)
        body = body[:-1] if end else body
        text, _ = _sequence(_Reader(body, unsafe), 0)
        # an unanchored side: any text (a pattern's "." stops at a line break)
        anything = f"({_set_text([(0, _MAX)], unsafe)})*"
        branches.append(("" if start or whole else anything) + (f"({text})" if text else "")
                        + ("" if end or whole else anything))
    inner = branches[0] if len(branches) == 1 else "|".join(f"({b})" for b in branches)
    return f"^({inner})$" if inner else "^$"


def _escaped_at_end(body: str) -> bool:
    """Whether the last character of ``body`` is escaped (an odd run of backslashes)."""
    run = len(body) - 1 - len(body[:-1].rstrip("\\"))
    return run % 2 == 1
