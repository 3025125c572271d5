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
