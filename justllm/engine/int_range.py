"""A JSON schema's integer bounds as a grammar rule.

llama-cpp-python's schema converter (``engine/backend.grammar_from_json_schema``) passes over
``minimum``/``maximum`` and the exclusive ones; llama.cpp's own C++ converter, which Ollama and
llama-server use, enforces them for integers. This module gives the same: the rule that spells
exactly the integers in ``[lo, hi]`` (either end may be open) the way JSON writes them, with no
leading zeros and no ``-0``.

A range splits into its negative and non-negative parts (a negative part is a ``-`` and a range
of magnitudes), a non-negative range into ranges of one digit count, and such a range, digit by
digit, into alternatives that are digit classes (``1`` ``[3-9]`` ``[0-9]{2}``). An open end
stops at 16 digits, as the converter's own integers do.
"""

from __future__ import annotations

import math
from typing import Any

from justllm.errors import InvalidRequestError

_MAX_DIGITS = 16
# Keywords whose presence makes the converter build some other rule for the schema than its
# plain integer (they come first in its visit); the bounds are then not enforced.
_OTHER_RULES = ("$ref", "oneOf", "anyOf", "const", "enum")
BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")

# (lowest digit, highest digit, least count, most count): one digit class and its repetition.
Piece = tuple[int, int, int, int]
# The sign ("-" or ""), then the digits.
Alternative = tuple[str, tuple[Piece, ...]]


def bounded_integer(schema: Any) -> bool:
    """Whether the grammar enforces ``schema``'s bounds: a plain integer schema that has one."""
    return (isinstance(schema, dict) and schema.get("type") == "integer"
            and not any(k in schema for k in _OTHER_RULES)
            and any(k in schema for k in BOUNDS))


def integer_bounds(schema: dict[str, Any]) -> tuple[int | None, int | None]:
    """The least and greatest integer ``schema`` allows (None: no bound), from ``minimum``,
    ``maximum`` and the exclusive ones (numbers, or draft 4's booleans beside ``minimum`` and
    ``maximum``). Raises InvalidRequestError when a bound is not a number or none is left."""
    lo = _bound(schema, "minimum", math.ceil)
    hi = _bound(schema, "maximum", math.floor)
    ex_lo, ex_hi = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
    if ex_lo is True and lo is not None and lo == schema["minimum"]:
        lo += 1
    elif ex_lo is not None and not isinstance(ex_lo, bool):  # (0 == False: not a membership)
        e = _bound(schema, "exclusiveMinimum", math.floor) or 0
        lo = e + 1 if lo is None else max(lo, e + 1)
    if ex_hi is True and hi is not None and hi == schema["maximum"]:
        hi -= 1
    elif ex_hi is not None and not isinstance(ex_hi, bool):
        e = _bound(schema, "exclusiveMaximum", math.ceil) or 0
        hi = e - 1 if hi is None else min(hi, e - 1)
    if lo is not None and hi is not None and lo > hi:
        raise InvalidRequestError(f"no integer satisfies the schema's bounds ({_shown(schema)})")
    return lo, hi


def _bound(schema: dict[str, Any], key: str, to_int: Any) -> int | None:
    value = schema.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidRequestError(f"the schema's {key} must be a number, not {value!r}")
    return int(to_int(value))


def _shown(schema: dict[str, Any]) -> str:
    return ", ".join(f"{k} {schema[k]}" for k in BOUNDS if k in schema)


def integer_alternatives(lo: int | None, hi: int | None) -> list[Alternative]:
    """The spellings of the integers in [lo, hi] (None: open), as alternatives."""
    out: list[Alternative] = []
    if lo is None or lo < 0:  # the negatives: a sign and their magnitudes
        top = None if lo is None else -lo
        least = 1 if hi is None or hi >= 0 else -hi
        out += [("-", p) for p in _non_negative(least, top)]
    if hi is None or hi >= 0:
        out += [("", p) for p in _non_negative(max(lo or 0, 0), hi)]
    return out


def _non_negative(a: int, b: int | None) -> list[tuple[Piece, ...]]:
    """[a, b] for 0 <= a <= b (b None: open, to 16 digits or a's count if more)."""
    n = len(str(a))
    if b is None:
        most = max(_MAX_DIGITS, n)
        out = _same_length(str(a), "9" * n)
        if most > n:  # every longer number is larger than a
            out.append(((1, 9, 1, 1), (0, 9, n, most - 1)))
        return out
    out = []
    for count in range(n, len(str(b)) + 1):
        first = max(a, 10 ** (count - 1) if count > 1 else 0)
        out += _same_length(str(first), str(min(b, 10 ** count - 1)))
    return out


def _same_length(x: str, y: str) -> list[tuple[Piece, ...]]:
    """The numbers from x to y, both of one digit count, as digit-class sequences."""
    if x == y:
        return [tuple((int(d), int(d), 1, 1) for d in x)]
    head_x, head_y, n = int(x[0]), int(y[0]), len(x) - 1
    if head_x == head_y:
        return [((head_x, head_x, 1, 1), *rest) for rest in _same_length(x[1:], y[1:])]
    tail: tuple[Piece, ...] = ((0, 9, n, n),) if n else ()
    out: list[tuple[Piece, ...]] = []
    low_full = x[1:] == "0" * n  # x's head takes every tail: it joins the middle
    high_full = y[1:] == "9" * n
    if not low_full:
        out += [((head_x, head_x, 1, 1), *rest) for rest in _same_length(x[1:], "9" * n)]
    first, last = head_x + (not low_full), head_y - (not high_full)
    if first <= last:
        out.append(((first, last, 1, 1), *tail))
    if not high_full:
        out += [((head_y, head_y, 1, 1), *rest) for rest in _same_length("0" * n, y[1:])]
    return out


def integer_rule(lo: int | None, hi: int | None) -> str:
    """The GBNF body for the integers in [lo, hi], followed by the converter's ``space``."""
    alts = [" ".join(([f'"{sign}"'] if sign else []) + [_piece(p) for p in pieces])
            for sign, pieces in integer_alternatives(lo, hi)]
    return f"({' | '.join(alts)}) space"


def _piece(p: Piece) -> str:
    low, high, least, most = p
    one = f'"{low}"' if low == high else f"[{low}-{high}]"
    if (least, most) == (1, 1):
        return one
    return f"{one}{{{least}}}" if least == most else f"{one}{{{least},{most}}}"
