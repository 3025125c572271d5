"""The JSON grammars of response_format end at the top-level value (backend.without_trailing_space):
llama-cpp-python's end every value with an optional space, the top one too."""

from __future__ import annotations

import pytest

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


@pytest.mark.parametrize("schema, texts", [
    # (an anyOf, a type list or any value at the root kept its space: '{"a": 1} ')
    ({"anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}},
                 "required": ["a"]}, {"type": "null"}]}, ['{"a": 1}', "null"]),
    ({"type": ["integer", "null"]}, ["6", "null"]),
    ({}, ["[0]", '{"a": true}', "null", '"x"', "1.5"]),
])
def test_no_root_alternative_ends_with_a_space(accepts, schema, texts):
    for text in texts:
        assert accepts(schema, text), text
        assert not accepts(schema, text + " ") and not accepts(schema, text + "\n"), text


def test_json_tells_true_from_1_and_counts_items_without_an_items_schema(accepts):
    """An allOf of two enums kept 1 where only true was allowed (Python's 1 == True); an
    array's minItems/maxItems without items were not followed."""
    both = {"allOf": [{"enum": [1, True, "z"]}, {"enum": [True, "z"]}]}
    assert accepts(both, "true") and accepts(both, '"z"') and not accepts(both, "1")
    falsy = {"allOf": [{"enum": [0, False]}, {"enum": [False]}]}
    assert accepts(falsy, "false") and not accepts(falsy, "0")
    assert accepts({"allOf": [{"const": "b"}, {"enum": ["b", "c"]}]}, '"b"')
    counted = {"type": "array", "minItems": 2, "maxItems": 3}
    assert accepts(counted, '[1, "x"]') and accepts(counted, "[1, 2, 3]")
    assert not accepts(counted, "[1]") and not accepts(counted, "[1, 2, 3, 4]")


def test_boolean_schemas_are_read(accepts):
    """true and false subschemas (JSON Schema's any and no value) were a 400 in Python's words
    ("argument of type 'bool' is not iterable")."""
    props = {"type": "object", "properties": {"a": True, "b": False, "c": {"type": "integer"}},
             "additionalProperties": False}
    assert accepts(props, '{"a": [1], "c": 2}') and accepts(props, '{"a": "x"}')
    assert not accepts(props, '{"b": 1}')
    either = {"anyOf": [False, {"type": "integer"}]}
    assert accepts(either, "5") and not accepts(either, '"x"')
    items = {"type": "array", "items": True, "maxItems": 2}
    assert accepts(items, '[1, "x"]') and not accepts(items, "[1, 2, 3]")


def test_json_objects_numbers_keep_a_doubles_range():
    """json_object's grammar (llama.cpp's) allowed a 16-digit exponent: 1e999999."""
    assert "[0-9] [1-9]{0,15}" not in JSON_GRAMMAR and "[0-9] [0-9]?)? ws" in JSON_GRAMMAR


def test_an_integers_bounds_become_its_rule_wherever_it_is():
    gbnf = grammar_from_json_schema({"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 5, "maximum": 7},
        "xs": {"type": "array", "items": {"type": "integer", "exclusiveMaximum": 0}}}})
    assert rule(gbnf, "n") == "n ::= ([5-7]) space"
    assert rule(gbnf, "xs-item") == 'xs-item ::= ("-" [1-9] | "-" [1-9] [0-9]{1,15}) space'
    root = grammar_from_json_schema({"type": "integer", "minimum": 10, "maximum": 12})
    assert rule(without_trailing_space(root), "root") == 'root ::= ("1" [0-2])'


# ---- what a schema's grammar accepts, through llama.cpp's own grammar sampler ----------------

import json  # noqa: E402

from justllm.engine.backend import grammar_from_regex  # noqa: E402
from justllm.errors import InvalidRequestError  # noqa: E402
from tests.engine.grammar_text import takes  # noqa: E402


@pytest.fixture(scope="module")
def accepts(engine):
    """accepts(schema, text): whether the schema's grammar (as response_format builds it) lets
    the model write exactly ``text`` and end there, fed character by character."""
    def check(schema: dict | str, text: str) -> bool:
        """(a str is a regular expression, as vLLM's guided_regex)"""
        gbnf = (grammar_from_regex(schema) if isinstance(schema, str)
                else without_trailing_space(grammar_from_json_schema(schema)))
        return takes(engine.backend, gbnf, text)

    return check


def test_enum_and_const_strings_are_written_as_json_escapes(accepts):
    """An enum value with a newline, tab, quote or backslash was written raw (invalid JSON;
    a quote was a 400), and one past U+FFFF as six replacement characters."""
    schema = {"enum": ["a\nb", "c\td", 'q"x', "C:\\dir", "😀"]}
    for value in schema["enum"]:
        assert accepts(schema, json.dumps(value, ensure_ascii=False)), value
    assert not accepts(schema, '"a\nb"') and not accepts(schema, '"C:\\dir"')
    emoji = {"type": "object", "properties": {"😀": {"const": "😀"}}, "required": ["😀"],
             "additionalProperties": False}
    assert accepts(emoji, '{"😀": "😀"}')


@pytest.mark.parametrize("pattern, good, bad", [
    (r"^\d{3}-\d{2}$", ["123-45"], ["12-345", "abc-de"]),
    (r"^\w+\.txt$", ["a_1.txt"], ["a-1.txt", "a_1xtxt"]),
    (r"^\s?x$", ["x", " x", "\nx"], ["  x"]),
    (r"^[^x]+$", ["ab", 'a"b', "a\\b", "a\tb"], ["axb"]),
    (r"^.{1,5}$", ["abc", 'a"c'], ["abcdef"]),
    (r'^say "(hi|yo)"$', ['say "hi"'], ['say hi']),
    (r"^a|b$", ["a", "b", "abc", "cab"], ["c"]),
    (r"abc", ["abc", "xabcx", "x\nabc"], ["ab"]),
    (r"\S", ["two\nlines"], [" ", "\u3000"]),  # (ECMA's \s holds U+3000)
    (r"^(?:ab)+?$", ["abab"], ["aba"]),
    (r"^[a-c\-]\+$", ["a+", "-+"], ["d+", "a"]),
    (r"^[ -~]+$", ['x"\\y'], ["é"]),
])
def test_a_pattern_constrains_the_decoded_string_and_the_text_stays_json(accepts, pattern,
                                                                          good, bad):
    """Patterns ran over the JSON text as it was: '.' and '[^x]' let a raw quote, backslash
    or control character through (invalid JSON), a '"' in the pattern ended the string, and
    \\d, \\w, \\s, \\. were grammars llama.cpp could not parse (a 400)."""
    schema = {"type": "string", "pattern": pattern}
    for value in good:
        assert accepts(schema, json.dumps(value, ensure_ascii=False)), value
    for value in bad:
        assert not accepts(schema, json.dumps(value, ensure_ascii=False)), value
    assert not accepts(schema, '"a\tb"')  # a raw tab is never JSON


@pytest.mark.parametrize("pattern", [r"^(a)\1$", r"^a(?=b)", r"^\bword$", r"^[a$",
                                     r"^a{2,1}$", r"^a{0,100000}$", "^a\\",
                                     # (94 s a token on the engine thread; left recursion)
                                     r"^(a?){0,200}$", r"^(a|)*$", r"^()*$", r"^a?+$",
                                     r"^a**$", r"^\u+041$"])
def test_what_a_grammar_cannot_say_in_a_pattern_is_a_400(pattern):
    with pytest.raises(InvalidRequestError, match="unsupported JSON schema|repeats more than|is not a 'regex'"):
        grammar_from_json_schema({"type": "string", "pattern": pattern})
    with pytest.raises(InvalidRequestError, match="unsupported regular expression"):
        grammar_from_regex(pattern.strip("^$"))


def test_optional_properties_beside_additional_properties_keep_their_commas(accepts):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}},
              "additionalProperties": {"type": "string"}}
    for text in ('{"a": 1, "b": "x"}', '{"a": 5}', '{"b": "x", "c": "y"}', "{}"):
        assert accepts(schema, text), text
    assert not accepts(schema, '{"a": 1"b": "x"}')
    two = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
           "required": ["b"], "additionalProperties": True}
    for text in ('{"b": 1}', '{"b": 1, "a": 2}', '{"b": 1, "a": 2, "z": [null]}',
                 '{"b": 1, "z": true}'):
        assert accepts(two, text), text
    assert not accepts(two, '{"a": 2}')


def test_an_additional_key_does_not_repeat_a_named_one(accepts):
    """{"a": 1, "a": "x"} was allowed (a duplicate key, which parsers read as the last
    value: the named property's schema was then not the one the value met)."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"},
                                               "ab": {"type": "integer"},
                                               "b-c": {"type": "integer"},
                                               "é": {"type": "integer"}},
              "additionalProperties": {"type": "string"}}
    for key in ("a", "ab", "b-c", "é"):
        assert not accepts(schema, f'{{"{key}": 1, "{key}": "x"}}'), key
        assert not accepts(schema, f'{{"{key}": "x"}}'), key
    for key in ("", "b", "abc", "aa", "b-", "b-cd", "c", "éa", "x y", "\\n", "a\\n"):
        assert accepts(schema, f'{{"a": 1, "{key}": "x"}}'), key
    assert accepts(schema, '{"ab": 2, "b-c": 3, "é": 4, "z": "x", "y": "w"}')


def test_a_type_list_keeps_the_keywords_beside_it(accepts):
    """OpenAI's strict mode writes a nullable field as a type list; every keyword beside it
    was dropped."""
    color = {"type": ["string", "null"], "enum": ["red", "green", None]}
    assert accepts(color, '"red"') and accepts(color, "null")
    assert not accepts(color, '"blue"')
    short = {"type": ["string", "null"], "maxLength": 3}
    assert accepts(short, '"abc"') and accepts(short, "null") and not accepts(short, '"hello"')
    addr = {"type": ["object", "null"], "properties": {"city": {"type": "string"}},
            "required": ["city"], "additionalProperties": False}
    assert accepts(addr, '{"city": "x"}') and accepts(addr, "null")
    assert not accepts(addr, "{}")
    assert not accepts({"type": "string", "enum": ["a", 1]}, "1")


def test_prefix_items_with_items_and_counts(accepts):
    schema = {"type": "array", "prefixItems": [{"type": "string"}], "items": {"type": "integer"}}
    for text in ('["a"]', '["a", 1, 2]', "[]"):
        assert accepts(schema, text), text
    assert not accepts(schema, "[1]") and not accepts(schema, '["a", "b"]')
    counted = {"prefixItems": [{"type": "string"}, {"type": "integer"}], "minItems": 2}
    assert accepts(counted, '["a", 1]') and not accepts(counted, '["a"]')
    more = {"prefixItems": [{"type": "string"}], "items": {"type": "integer"}, "minItems": 3,
            "maxItems": 3}
    assert accepts(more, '["a", 1, 2]') and not accepts(more, '["a", 1]')
    assert not accepts(more, '["a", 1, 2, 3]')


def test_an_old_drafts_tuple_items_keep_their_counts(accepts):
    """Draft 7's ``items: [..]`` (with ``additionalItems``) was written as exactly its
    positions: ``maxItems: 1`` got two items, ``minItems: 3`` two."""
    pair = [{"type": "string"}, {"type": "integer"}]
    short = {"type": "array", "items": pair, "maxItems": 1}
    assert accepts(short, '["a"]') and not accepts(short, '["a", 1]')
    longer = {"type": "array", "items": pair, "additionalItems": {"type": "null"},
              "minItems": 3}
    assert accepts(longer, '["a", 1, null]') and accepts(longer, '["a", 1, null, null]')
    assert not accepts(longer, '["a", 1]') and not accepts(longer, '["a", 1, 2]')
    assert accepts({"items": pair}, '["a"]') and not accepts({"items": pair}, "[1]")


def test_keywords_beside_ref_all_of_and_any_of_are_kept(accepts):
    beside_ref = {"$defs": {"s": {"type": "string"}}, "type": "object",
                  "properties": {"x": {"$ref": "#/$defs/s", "maxLength": 2}},
                  "required": ["x"], "additionalProperties": False}
    assert accepts(beside_ref, '{"x": "ab"}') and not accepts(beside_ref, '{"x": "abc"}')
    all_of = {"allOf": [{"type": "string"}, {"maxLength": 5}]}
    assert accepts(all_of, '"abc"') and not accepts(all_of, "{}")
    assert not accepts(all_of, '"abcdefg"')
    required = {"type": "object", "properties": {"a": {"type": "integer"}},
                "allOf": [{"required": ["a"]}], "additionalProperties": False}
    assert accepts(required, '{"a": 1}') and not accepts(required, "{}")
    closed = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}},
                         "additionalProperties": False},
                        {"properties": {"b": {"type": "integer"}}}]}
    assert accepts(closed, '{"a": 1}') and not accepts(closed, '{"b": 1}')  # (it was taken)
    any_of = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
              "additionalProperties": False,
              "anyOf": [{"required": ["a"]}, {"required": ["b"]}]}
    assert accepts(any_of, '{"a": 1}') and accepts(any_of, '{"b": 1}')
    assert not accepts(any_of, "{}")


def test_a_root_ref_into_definitions_that_refer_to_each_other(accepts):
    """Pydantic v2's shape for a recursive model: a 400 ('unsupported JSON schema')."""
    schema = {"$defs": {"node": {"type": "object", "properties": {
        "name": {"type": "string"},
        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["name", "kids"], "additionalProperties": False}},
        "$ref": "#/$defs/node"}
    assert accepts(schema, '{"name": "a", "kids": [{"name": "b", "kids": []}]}')
    assert not accepts(schema, '{"name": "a"}')
    pair = {"$defs": {"a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}},
                            "required": ["b"]}, "b": {"type": "integer"}},
            "$ref": "#/$defs/a"}
    assert accepts(pair, '{"b": 3}') and not accepts(pair, '{"b": "x"}')


def test_a_ref_to_the_whole_schema_recurses(accepts):
    """``{"$ref": "#"}`` (a tree's children, as JSON Schema's own examples write one) was a 400
    ("Unsupported ref #"): it names a copy of the root now; the root's other references still
    resolve, and a definition already called ``root`` keeps its name."""
    tree = {"type": "object", "properties": {
        "name": {"type": "string"},
        "kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}},
        "required": ["name", "kids"], "additionalProperties": False}
    assert accepts(tree, '{"name": "a", "kids": [{"name": "b", "kids": []}]}')
    assert not accepts(tree, '{"name": "a", "kids": [{"name": "b"}]}')
    assert not accepts(tree, '{"name": "a", "kids": [1]}')
    mixed = {"type": "object", "$defs": {"root": {"type": "string"}}, "properties": {
        "n": {"type": "integer"}, "m": {"$ref": "#/properties/n"},
        "s": {"$ref": "#/$defs/root"}, "next": {"anyOf": [{"$ref": "#/"}, {"type": "null"}]}},
        "required": ["n", "m", "s", "next"]}
    one = '{"n": 1, "m": 2, "s": "x", "next": null}'
    assert accepts(mixed, one)
    assert accepts(mixed, one.replace("null", one))
    assert not accepts(mixed, one.replace('"x"', "3"))


def test_a_property_named_ref_is_a_clear_400():
    """llama-cpp-python's converter takes any "$ref" key for a reference: a property so named
    was refused in Python's words ("unhashable type: 'dict'")."""
    with pytest.raises(InvalidRequestError, match='a property named "\\$ref" is not'):
        grammar_from_json_schema({"type": "object", "properties": {"$ref": {"type": "string"}}})


def test_a_schema_that_only_annotates_matches_any_value(accepts):
    """A tool's {"description": ..} parameter was a 400 ('Unrecognized schema'), and {} took
    only objects."""
    for schema in ({}, {"description": "anything"}):
        for text in ("1", '"x"', "[1, {}]", "null", '{"a": true}'):
            assert accepts(schema, text), (schema, text)
    tool = {"type": "object", "properties": {"q": {"description": "query"}}, "required": ["q"]}
    assert accepts(tool, '{"q": "x"}') and accepts(tool, '{"q": 5}')


@pytest.mark.parametrize("schema, says", [
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "no value in common"),
    ({"anyOf": [{"type": "string"}], "oneOf": [{"type": "integer"}]}, "anyOf beside oneOf"),
    ({"type": "string", "enum": [1, 2]}, "no value of the enum"),
    ({"prefixItems": [{"type": "string"}], "minItems": 2}, "no items schema"),
    # (const won, unchecked: every answer was the const, which the enum did not allow)
    ({"allOf": [{"const": "a"}, {"enum": ["b", "c"]}]}, "const is not one of the enum's"),
    ({"$defs": {"e": {"enum": ["p", "q"]}}, "$ref": "#/$defs/e", "const": "z"},
     "const is not one of the enum's"),
    ({"allOf": [{"const": 0}, {"const": False}]}, "give const different values"),
    # what is no JSON schema: read as something else, or Python's own words
    ({"type": "object", "required": "ab"}, "at #/required: 'ab' is not of type 'array'"),
    ({"enum": "abc"}, "at #/enum: 'abc' is not of type 'array'"),
    ({"type": "object", "properties": {"a": {"type": "string", "minLength": -1}}},
     "at #/properties/a/minLength: -1 is less than the minimum of 0"),
    ({"anyOf": {"a": {}}}, "at #/anyOf: .* is not of type 'array'"),
    ({"allOf": [{"properties": {"a": {}}, "additionalProperties": False},
                {"properties": {"b": {}}, "required": ["b"]}]}, "'b' is required"),
])
def test_schemas_no_value_can_match_or_that_cannot_be_merged_are_a_400(schema, says):
    with pytest.raises(InvalidRequestError, match=says):
        grammar_from_json_schema(schema)


@pytest.mark.parametrize("pattern, good, bad", [
    (r'say "(hi|yo)"\\', ['say "hi"\\'], ['say "hi"', 'say hi\\']),
    (r"\d+\.\d*", ["3.14", "10."], ["3", ".5", "3.14x"]),
    (r"[^x]+", ['a"\tb'], ["axb"]),
    (r".+", ["abc"], ["a\nb"]),
    (r"^(yes|no)$", ["yes", "no"], ["yesno", " yes"]),
])
def test_a_regular_expression_is_matched_by_the_whole_raw_text(accepts, pattern, good, bad):
    """vLLM's guided_regex: the answer itself, no JSON around it (quotes and backslashes
    raw), matched whole."""
    for text in good:
        assert accepts(pattern, text), text
    for text in bad:
        assert not accepts(pattern, text), text


def test_long_property_names_and_an_empty_one(accepts):
    """A 496-character name beside additionalProperties was a 400 (Python's recursion limit
    in the key trie); a property named "" named its value's rule "root": the grammar was an
    integer, and every object was refused."""
    long = "k" * 600
    schema = {"type": "object", "properties": {long: {"type": "integer"}, "a": {}},
              "additionalProperties": True}
    assert accepts(schema, f'{{"{long}": 1, "b": 2}}')
    assert not accepts(schema, '{"a": 1, "a": 2}')  # (the short names are still kept apart)
    empty = {"type": "object", "properties": {"": {"type": "integer"}}}
    for text in ('{"": 1}', "{}"):
        assert accepts(empty, text), text
    assert not accepts(empty, '{"": "x"}')


def test_a_numbers_exponent_stays_within_a_doubles_range(accepts):
    """llama.cpp's number allowed a 16-digit exponent: 1e400, which no client's JSON parser
    reads as a number (a forced call's arguments were then malformed)."""
    schema = {"type": "object", "properties": {"x": {"type": "number"}}}
    assert accepts(schema, '{"x": -1.5e-99}') and accepts(schema, '{"x": 12E+3}')
    assert not accepts(schema, '{"x": 1e400}') and not accepts(schema, '{"x": 1e100}')
    assert accepts({}, '[1e99, {"a": 2.5}]') and not accepts({}, "1e308")


def test_a_date_is_a_real_calendar_date(accepts):
    """``format: date`` took any day 01-31 in any month (llama-cpp-python's rule): an answer
    could say 2023-02-31, which no date parser reads."""
    date = {"type": "string", "format": "date"}
    for good in ("2023-01-31", "2023-04-30", "2023-02-28", "2024-02-29", "2000-02-29",
                 "1600-02-29", "0004-02-29", "2023-12-31"):
        assert accepts(date, f'"{good}"'), good
    for bad in ("2023-02-31", "2023-02-30", "2023-02-29", "1900-02-29", "2100-02-29",
                "2023-04-31", "2023-11-31", "2023-13-01", "2023-00-10", "2023-01-00"):
        assert not accepts(date, f'"{bad}"'), bad
    stamp = {"type": "string", "format": "date-time"}
    assert accepts(stamp, '"2024-02-29T12:00:00Z"')
    assert not accepts(stamp, '"2023-02-29T12:00:00Z"')
