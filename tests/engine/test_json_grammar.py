"""The JSON grammars of response_format end at the top-level value (backend.without_trailing_space):
llama-cpp-python's end every value with an optional space, the top one too."""

from __future__ import annotations

from justllm.engine.backend import JSON_GRAMMAR, grammar_from_json_schema, without_trailing_space


def rule(gbnf: str, name: str) -> str:
    return next(line for line in gbnf.splitlines() if line.startswith(f"{name} ::="))


def test_an_inline_root_loses_its_last_space_and_nothing_else_changes():
    gbnf = grammar_from_json_schema({"type": "object", "properties": {"n": {"type": "integer"}}})
    out = without_trailing_space(gbnf)
    assert rule(gbnf, "root").endswith('"}" space')
    assert rule(out, "root").endswith('"}"')
    assert [x for x in out.splitlines() if not x.startswith("root")] == \
        [x for x in gbnf.splitlines() if not x.startswith("root")]


def test_a_root_naming_a_rule_gets_a_copy_of_it_without_the_space():
    out = without_trailing_space(JSON_GRAMMAR)
    assert rule(out, "root") == "root ::= object-top"
    top = out.split("object-top ::=", 1)[1]
    assert top.rstrip().endswith('"}"') and "object ::=" in out  # nested objects keep theirs


def test_a_grammar_of_another_shape_is_left_as_it_is():
    for gbnf in ('root ::= "a" | "b"\n', 'start ::= "x" ws\nws ::= " "?\n'):
        assert without_trailing_space(gbnf) == gbnf


def test_an_integers_bounds_become_its_rule_wherever_it_is():
    gbnf = grammar_from_json_schema({"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 5, "maximum": 7},
        "xs": {"type": "array", "items": {"type": "integer", "exclusiveMaximum": 0}}}})
    assert rule(gbnf, "n") == "n ::= ([5-7]) space"
    assert rule(gbnf, "xs-item") == 'xs-item ::= ("-" [1-9] | "-" [1-9] [0-9]{1,15}) space'
    root = grammar_from_json_schema({"type": "integer", "minimum": 10, "maximum": 12})
    assert rule(without_trailing_space(root), "root") == 'root ::= ("1" [0-2])'
