"""Integer bounds as grammar rules (engine/int_range.py): the alternatives, read as a regular
expression, match exactly the JSON spellings of the integers in range."""

from __future__ import annotations

import random
import re

import pytest

from justllm.engine.int_range import (
    bounded_integer,
    integer_alternatives,
    integer_bounds,
    integer_rule,
)
from justllm.errors import InvalidRequestError


def as_regex(lo: int | None, hi: int | None) -> re.Pattern[str]:
    alts = [re.escape(sign) + "".join(f"[{a}-{b}]{{{m},{n}}}" for a, b, m, n in pieces)
            for sign, pieces in integer_alternatives(lo, hi)]
    return re.compile("|".join(alts))


def _ranges() -> list[tuple[int | None, int | None]]:
    fixed: list[tuple[int | None, int | None]] = [
        (0, 0), (5, 5), (-5, -5), (0, 9), (1, 10), (-10, 10), (-1, -1), (None, None),
        (None, 5), (5, None), (None, -7), (-7, None), (99, 101), (123, 4567), (-4567, -123),
        (0, None), (None, 0), (10, 99), (100, 100000), (-999, -100)]
    rng = random.Random(7)
    for _ in range(150):
        lo = rng.randint(-10 ** rng.randint(0, 6), 10 ** rng.randint(0, 6))
        fixed.append((lo, lo + rng.randint(0, 10 ** rng.randint(0, 6))))
    return fixed


@pytest.mark.parametrize("lo, hi", _ranges())
def test_the_rule_spells_exactly_the_integers_in_range(lo, hi):
    r = as_regex(lo, hi)
    rng = random.Random(f"{lo},{hi}")
    near = [v for edge in (lo, hi, 0) if edge is not None for v in range(edge - 120, edge + 121)]
    far = [rng.randint(-10 ** 15, 10 ** 15) for _ in range(100)]
    for v in near + far + [10 ** 15, -10 ** 15, 10 ** 16 - 1, -(10 ** 16 - 1)]:
        inside = (lo is None or v >= lo) and (hi is None or v <= hi)
        assert bool(r.fullmatch(str(v))) == inside, (lo, hi, v)
    for spelling in ("-0", "00", "01", "-01", "+1", "", "1.0", "1e2"):
        assert not r.fullmatch(spelling), (lo, hi, spelling)


def test_an_open_side_stops_at_sixteen_digits_as_the_converters_integers_do():
    r = as_regex(None, None)
    assert r.fullmatch("9" * 16) and r.fullmatch("-" + "9" * 16)
    assert not r.fullmatch("1" + "0" * 16)
    assert as_regex(10 ** 20, None).fullmatch(str(10 ** 20 + 5))  # a longer bound: its length


def test_the_gbnf_rule():
    assert integer_rule(5, 7) == "([5-7]) space"
    assert integer_rule(-3, 12) == '("-" [1-3] | [0-9] | "1" [0-2]) space'
    assert integer_rule(0, None) == "([0-9] | [1-9] [0-9]{1,15}) space"


@pytest.mark.parametrize("schema, bounds", [
    ({"type": "integer", "minimum": 5}, (5, None)),
    ({"type": "integer", "maximum": -5}, (None, -5)),
    ({"type": "integer", "minimum": 1.5, "maximum": 7.9}, (2, 7)),
    ({"type": "integer", "exclusiveMinimum": 5, "exclusiveMaximum": 9}, (6, 8)),
    ({"type": "integer", "exclusiveMinimum": 4.5, "minimum": 3}, (5, None)),
    ({"type": "integer", "minimum": 3, "exclusiveMinimum": 8}, (9, None)),
    ({"type": "integer", "maximum": 10, "exclusiveMaximum": 10}, (None, 9)),
    ({"type": "integer", "exclusiveMaximum": 0}, (None, -1)),  # 0, not draft 4's false
    # draft 4: booleans beside minimum/maximum
    ({"type": "integer", "minimum": 5, "exclusiveMinimum": True, "maximum": 9,
      "exclusiveMaximum": True}, (6, 8)),
    ({"type": "integer", "minimum": 5.5, "exclusiveMinimum": True}, (6, None)),
    ({"type": "integer", "minimum": 5, "exclusiveMinimum": False}, (5, None)),
])
def test_bounds(schema, bounds):
    assert bounded_integer(schema)
    assert integer_bounds(schema) == bounds


@pytest.mark.parametrize("schema, says", [
    ({"type": "integer", "minimum": 8, "maximum": 7}, "no integer satisfies the schema's bounds"),
    ({"type": "integer", "minimum": 1.2, "maximum": 1.8}, "minimum 1.2, maximum 1.8"),
    ({"type": "integer", "exclusiveMinimum": 3, "exclusiveMaximum": 4}, "no integer"),
    ({"type": "integer", "exclusiveMinimum": 0, "maximum": 0.5}, "no integer"),
    ({"type": "integer", "minimum": "5"}, "minimum must be a number, not '5'"),
    ({"type": "integer", "maximum": True}, "maximum must be a number"),
])
def test_bounds_that_cannot_be_met_or_read_are_refused(schema, says):
    with pytest.raises(InvalidRequestError, match=re.escape(says)):
        integer_bounds(schema)


@pytest.mark.parametrize("schema", [
    {"type": "integer"},
    {"type": "number", "minimum": 1},
    {"type": ["integer", "null"], "minimum": 1},
    {"type": "integer", "minimum": 1, "enum": [1, 2]},
    {"type": "integer", "minimum": 1, "anyOf": [{"maximum": 3}]},
    {"minimum": 1},
])
def test_only_a_plain_integer_with_a_bound_gets_the_rule(schema):
    assert not bounded_integer(schema)
