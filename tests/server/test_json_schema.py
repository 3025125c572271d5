"""What a strict schema asks that the grammar cannot enforce (pure: no model)."""

from __future__ import annotations

import pytest

from justllm.errors import InvalidRequestError
from justllm.server.json_schema import check_strict, unenforced


def test_a_required_name_without_a_property_is_unenforced():
    """The converter requires only the properties it has: ``{"required": ["zz"]}`` alone made
    a grammar that admits ``{}``, and strict answered it with a 200."""
    assert unenforced({"type": "object", "required": ["zz"]}) == ["#: required 'zz' (not in "
                                                                  "properties)"]
    nested = {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "string"}}, "required": ["b", "c"]}}, "required": ["a"]}
    assert unenforced(nested) == ["#/properties/a: required 'c' (not in properties)"]
    with pytest.raises(InvalidRequestError, match="required 'zz'"):
        check_strict({"type": "object", "required": ["zz"]}, "response_format")
    check_strict({"type": "object", "properties": {"zz": {}}, "required": ["zz"]}, "x")


def test_keywords_beside_an_enum_are_unenforced_but_its_type_and_annotations():
    """An enum's values are written as listed: a maxLength beside it was not checked, and
    strict answered with a 200."""
    assert unenforced({"type": "string", "enum": ["abc"], "maxLength": 2,
                       "description": "x"}) == ["#: maxLength beside enum"]
    assert unenforced({"type": ["string", "null"], "enum": ["a", None], "title": "t"}) == []
    assert unenforced({"const": 1, "minimum": 0}) == ["#: minimum"]


def test_keywords_the_rewrite_now_enforces_pass_strict():
    """Beside a type list, a $ref, anyOf and allOf, and prefixItems with items and counts:
    engine/schema_rewrite.py says them in the converter's shapes."""
    for schema in ({"type": ["string", "null"], "maxLength": 3},
                   {"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "maxLength": 2},
                   {"allOf": [{"type": "string"}, {"maxLength": 5}]},
                   {"prefixItems": [{"type": "string"}], "items": {"type": "integer"},
                    "maxItems": 3}):
        check_strict(schema, "response_format")
