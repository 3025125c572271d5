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


def test_a_format_beside_a_pattern_is_unenforced():
    """The grammar followed the pattern alone: strict took it, and '2016' was a date."""
    assert unenforced({"type": "string", "format": "date", "pattern": "^2"}) == [
        "#: format beside pattern"]
    with pytest.raises(InvalidRequestError, match="format beside pattern"):
        check_strict({"type": "string", "format": "uuid", "pattern": "^a"}, "response_format")


def test_what_only_meets_once_a_ref_or_all_of_is_merged_is_unenforced():
    """A pattern in a definition and a maxLength beside the $ref naming it (or an enum and a
    maxLength in two allOf parts) meet only in the merged schema, where the grammar keeps one
    of them: strict answered with a 200. Each is named once, where they meet."""
    defs = {"$defs": {"p": {"type": "string", "pattern": "^a+$"}}}
    assert unenforced({**defs, "$ref": "#/$defs/p", "maxLength": 3}) == [
        "#: minLength/maxLength beside pattern"]
    assert unenforced({"allOf": [{"enum": ["abc", "x"]}, {"maxLength": 2}]}) == [
        "#: maxLength beside enum"]
    chained = {"$defs": {"p": {"type": "string", "pattern": "^a+$"},
                         "q": {"$ref": "#/$defs/p"}}, "type": "object",
               "properties": {"x": {"$ref": "#/$defs/q", "minLength": 1}}}
    assert unenforced(chained) == ["#/properties/x: minLength/maxLength beside pattern"]
    # a conflict within the definition itself is named there, not again at each $ref
    inside = {"$defs": {"p": {"type": "string", "pattern": "^a+$", "maxLength": 3}},
              "$ref": "#/$defs/p", "minLength": 1}
    assert unenforced(inside) == ["#/$defs/p: minLength/maxLength beside pattern"]
    with pytest.raises(InvalidRequestError, match="beside pattern"):
        check_strict({**defs, "$ref": "#/$defs/p", "maxLength": 3}, "response_format")
    check_strict({**defs, "$ref": "#/$defs/p", "description": "d"}, "response_format")
    check_strict({"enum": ["a", "b"], "$ref": "#/$defs/s", "$defs": {"s": {"type": "string"}}},
                 "response_format")


def test_parts_named_again_and_again_are_merged_once(monkeypatch):
    """allOf of k $refs to the root was followed anew at every level: k^8 merges (12 s of a
    prepare worker at k=5, and every worker held by a few such requests)."""
    import justllm.server.json_schema as js

    calls = []
    parts = js._parts
    monkeypatch.setattr(js, "_parts", lambda *a: calls.append(1) or parts(*a))
    assert unenforced({"type": "object", "allOf": [{"$ref": "#"}] * 7}) == []
    assert len(calls) < 20, len(calls)


def test_a_strict_one_of_whose_alternatives_may_overlap_is_unenforced():
    """The grammar takes any alternative of a oneOf, so "exactly one" holds only where no
    value matches two: ``{"oneOf": [integer, number]}`` under strict answered
    ``1000000000000000``, which matches both. Alternatives told apart by type, listed values
    or a required discriminator property pass; the rest are named."""
    assert unenforced({"oneOf": [{"type": "integer"}, {"type": "number"}]}) == [
        "#: oneOf alternatives 0 and 1 may both match"]
    defs = {"$defs": {"i": {"type": "integer"}}}
    assert unenforced({**defs, "oneOf": [{"enum": [1, "a"]}, {"type": "string"},
                                         {"$ref": "#/$defs/i"}]}) == [
        "#: oneOf alternatives 0 and 1 may both match",
        "#: oneOf alternatives 0 and 2 may both match"]
    tagged = [{"properties": {"k": {"const": "a"}, "v": {"type": "string"}}, "required": ["k"]},
              {"properties": {"k": {"enum": ["b", "c"]}, "v": {}}, "required": ["k", "v"]}]
    check_strict({"type": "object", "oneOf": tagged}, "response_format")
    # without the type beside it a string matches both (``required`` binds objects only)
    assert unenforced({"oneOf": tagged}) == ["#: oneOf alternatives 0 and 1 may both match"]
    untagged = [{**t, "required": ["v"]} for t in tagged]  # the tag may be left out
    assert unenforced({"type": "object", "oneOf": untagged}) != []
    for fine in ({"oneOf": [{"type": "integer"}, {"type": "string"}, {"type": "null"}]},
                 {"oneOf": [{"enum": [1, 2]}, {"enum": [True, "1"]}]},  # true is not 1
                 {"oneOf": [{"type": "number"}, {"const": "x"}, False]},
                 {"type": "string", "oneOf": [{"type": "integer"}, {"type": "number"}]}):
        check_strict(fine, "response_format")
    with pytest.raises(InvalidRequestError, match="oneOf alternatives 0 and 1 may both"):
        check_strict({"type": "object", "properties": {"n": {
            "oneOf": [{"type": "integer"}, {"type": "number"}]}}}, "response_format")
