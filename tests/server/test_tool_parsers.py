"""Tool-call parsing per family, whole and streamed, on outputs as models write them
(formats from the model cards and llama.cpp's chat tests; the ``generic`` ones as the demo
model writes them under the fallback), malformed ones included; the request checks and the
forcing grammar's shape. Pure: no model."""

from __future__ import annotations

import msgspec
import pytest

from justllm.errors import InvalidRequestError
from justllm.server.schemas import ChatCompletionRequest
from justllm.server.tools.grammar import call_schema, wrap_call_grammar
from justllm.server.tools.parse import ParsedAnswer, ParsedCall, parse_answer
from justllm.server.tools.request import tool_plan
from justllm.server.tools.stream import CallSplitter

NAMES = frozenset({"get_weather", "get_time"})
PARIS = ParsedCall("get_weather", '{"city": "Paris"}')
ROME = ParsedCall("get_weather", '{"city": "Rome", "unit": "celsius"}')

# (format, model output, expected content, expected calls)
CASES = [
    # Hermes 2 Pro / Qwen 2.5 / Qwen 3
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "", [PARIS]),
    ("hermes", 'Let me look that up.\n<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", '
               '"arguments": {"city": "Rome", "unit": "celsius"}}\n</tool_call>',
     "Let me look that up.", [PARIS, ROME]),
    # Hermes 2 Pro writes the arguments first; a stop on </tool_call> leaves it out
    ("hermes", '<tool_call>\n{"arguments": {"city": "Paris"}, "name": "get_weather"}\n', "",
     [PARIS]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}'
               '\n</tool_call>', "", [PARIS]),  # arguments as JSON text
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\nDone.',
     "Done.", [ParsedCall("get_time", "{}")]),
    ("hermes", "The weather is sunny.", "The weather is sunny.", []),
    # Llama 3.1 / 3.2 / 3.3
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [PARIS]),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', "",
     [PARIS]),
    ("llama3", '{"type": "function", "name": "get_weather", "parameters": {"city": "Paris"}}',
     "", [PARIS]),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": '
               '"get_weather", "parameters": {"city": "Rome", "unit": "celsius"}}', "",
     [PARIS, ROME]),
    ("llama3", 'I will check. {"name": "get_weather", "parameters": {"city": "Paris"}}',
     "I will check.", [PARIS]),
    # Mistral Nemo / Small (a list), and the newer name[ARGS]{...} form
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, '
                '"id": "a1b2c3d4e"}]', "", [PARIS]),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}]',
     "", [PARIS, ROME]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_weather[ARGS]'
                '{"city": "Rome", "unit": "celsius"}', "", [PARIS, ROME]),
    # Qwen3-Coder / Qwen3.5 (XML: a value on lines of its own, raw text)
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                    "</parameter>\n</function>\n</tool_call>", "", [PARIS]),
    ("qwen3_coder", "Let me look that up.\n\n<tool_call>\n<function=get_weather>\n"
                    "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>\n"
                    "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n"
                    "</parameter>\n<parameter=unit>\ncelsius\n</parameter>\n</function>\n"
                    "</tool_call>", "Let me look that up.", [PARIS, ROME]),
    ("qwen3_coder", "<tool_call>\n<function=get_time>\n</function>\n</tool_call>", "",
     [ParsedCall("get_time", "{}")]),
    # GLM 4.5/4.6 (its 4.7 writes no line breaks between the tags)
    ("glm", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
            "</tool_call>", "", [PARIS]),
    ("glm", "Checking.\n<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris"
            "</arg_value></tool_call>\n<tool_call>get_weather<arg_key>city</arg_key><arg_value>"
            "Rome</arg_value><arg_key>unit</arg_key><arg_value>celsius</arg_value></tool_call>",
     "Checking.", [PARIS, ROME]),
    # Kimi K2 (a call's id names its function)
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
                "<|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>"
                '{"city": "Rome", "unit": "celsius"}<|tool_call_end|><|tool_calls_section_end|>',
     "", [PARIS, ROME]),
    ("kimi_k2", "Checking. <|tool_calls_section_begin|> <|tool_call_begin|> get_weather:0 "
                '<|tool_call_argument_begin|> {"city": "Paris"} <|tool_call_end|>', "Checking.",
     [PARIS]),
    # DeepSeek V3.1
    ("deepseek_v3_1", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
                      '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_weather'
                      '<｜tool▁sep｜>{"city": "Rome", "unit": "celsius"}<｜tool▁call▁end｜>'
                      "<｜tool▁calls▁end｜>", "", [PARIS, ROME]),
    ("deepseek_v3_1", "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
                      '{"city": "Paris"}<｜tool▁call▁end｜>', "Sure.", [PARIS]),
    # generic: the fallback's format, as the demo model writes it (and fenced, and a list)
    ("generic", '{"name": "get_weather", "arguments": {"city": "Paris"}}', "", [PARIS]),
    ("generic", 'Sure.\n```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```',
     "Sure.", [PARIS]),
    ("generic", '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": '
                '"get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}]', "",
     [PARIS, ROME]),
    ("generic", '{"name": "get_weather", "arguments": {"city": "Paris\nFrance"}}', "",
     [ParsedCall("get_weather", '{"city": "Paris\\nFrance"}')]),  # a raw newline in a string
]

# Outputs that look like calls but are not: every one comes back whole, as content.
MALFORMED = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'),  # cut off
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
               '<tool_response>'),  # something else where </tool_call> belongs
    ("hermes", '<tool_call>\n{"name": "delete_everything", "arguments": {}}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": [1, 2]}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"function": "get_weather"}\n</tool_call>'),
    ("llama3", '<|python_tag|>brave_search.call(query="weather in Paris")'),  # a built-in tool
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}, "confidence": 1}'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}'),
    ("mistral", "[TOOL_CALLS]get_weather{}"),
    ("generic", '{"name": "get_weather", "arguments": {"city": }}'),
    ("generic", '{"name": "Bob", "age": 3}'),  # JSON, but not a call
    ("generic", '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\nmore'),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"),  # cut off
    ("qwen3_coder", "<tool_call>\n<function=delete_everything>\n</function>\n</tool_call>"),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                    "</parameter>\nand then\n</function>\n</tool_call>"),  # text between
    ("qwen3_coder", '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'),
    ("glm", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par"),
    ("glm", "<tool_call>get_weather\n<arg_key>city</arg_key>\nParis\n</tool_call>"),
    ("glm", "<tool_call>\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather"
                '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'),  # no index
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_begin|>'),
    ("deepseek_v3_1", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
                      '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>'),  # R1's form
    # nested past Python's recursion limit: RecursionError escaped, a 400 after the generation
    # (a stream just ended)
    ("generic", '{"name": "get_weather", "arguments": ' + "[" * 5000),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": "' + "[" * 5000 + '"}\n'
               "</tool_call>"),
]


@pytest.mark.parametrize("fmt, text, content, calls", CASES)
def test_each_family_parses_whole(fmt, text, content, calls):
    assert parse_answer(text, fmt, NAMES) == ParsedAnswer(content, tuple(calls))


@pytest.mark.parametrize("fmt, text", MALFORMED)
def test_a_malformed_call_is_content(fmt, text):
    assert parse_answer(text, fmt, NAMES) == ParsedAnswer(text)


def test_parallel_false_keeps_the_first_call_and_names_none_accepts_any():
    text = '[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}]'
    assert parse_answer(text, "generic", None, parallel=False).calls == (ParsedCall("a", "{}"),)
    assert [c.name for c in parse_answer(text, "generic", None).calls] == ["a", "b"]
    assert parse_answer(text, "generic", frozenset({"a"})).calls == ()  # b was not offered


def test_xml_values_are_typed_by_the_schema():
    """A plain string is the raw text (a "3" stays text, a line break inside stays), any other
    value is JSON (Python's True/None as Qwen3-Coder's template writes them), and a value
    that is not JSON stays text (the client's validation sees it, as vLLM passes it on)."""
    schemas = {"f": {"type": "object", "properties": {
        "s": {"type": "string"}, "n": {"type": "integer"}, "b": {"type": "boolean"},
        "o": {"type": "object"}, "e": {"enum": ["a", "b"]}, "d": {"type": "string",
                                                                  "format": "date"}}}}
    values = {"s": "3\n  x", "n": "3", "b": "True", "o": '{"k": [1, null]}', "e": "a",
              "d": '"2024-01-01"', "x": "[1]", "y": "not json"}
    qwen = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
    glm = "".join(f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>" for k, v in values.items())
    expected = ('{"s": "3\\n  x", "n": 3, "b": true, "o": {"k": [1, null]}, "e": "a", '
                '"d": "2024-01-01", "x": [1], "y": "not json"}')
    for fmt, text in (("qwen3_coder", f"<tool_call>\n<function=f>\n{qwen}</function>\n"
                                      "</tool_call>"),
                      ("glm", f"<tool_call>f{glm}</tool_call>")):
        answer = parse_answer(text, fmt, None, schemas=schemas)
        assert answer == ParsedAnswer("", (ParsedCall("f", expected),)), fmt
    # a key the schema does not name is typed by its additionalProperties
    loose = {"f": {"type": "object", "additionalProperties": {"type": "string"}}}
    assert parse_answer("<tool_call>f<arg_key>k</arg_key><arg_value>3</arg_value></tool_call>",
                        "glm", None, schemas=loose).calls == (ParsedCall("f", '{"k": "3"}'),)
    # a name is a function's name, whatever was offered (GLM's is the text before a tag)
    hermes_like = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert parse_answer(hermes_like, "glm", None).calls == ()


MARKERS = {"hermes": ("<tool_call>", "<"), "qwen3_coder": ("<tool_call>", "<"),
           "glm": ("<tool_call>", "<"), "kimi_k2": ("<|tool_calls", "<"),
           "deepseek_v3_1": ("<｜tool",), "llama3": ("<|python_tag|>", '"name"', "{"),
           "mistral": ("[TOOL_CALLS]", "["), "generic": ('"name"', "{", "```")}


def _stream(fmt: str, text: str, size: int) -> tuple[list[str], str, ParsedAnswer]:
    splitter = CallSplitter(fmt, NAMES)
    shown = [splitter.feed(text[i:i + size]) for i in range(0, len(text), size)]
    rest, answer = splitter.finish()
    return shown, rest, answer


@pytest.mark.parametrize("fmt, text", [(c[0], c[1]) for c in CASES] + MALFORMED)
@pytest.mark.parametrize("size", [1, 3, 7])
def test_streaming_agrees_with_the_whole_answer_and_leaks_no_marker(fmt, text, size):
    shown, rest, answer = _stream(fmt, text, size)
    whole = parse_answer(text, fmt, NAMES)
    assert answer == whole
    assert "".join(shown) + rest == whole.content
    if whole.calls:  # no piece of a call marker was shown while it streamed
        streamed = "".join(shown)
        assert not any(m in streamed for m in MARKERS[fmt]), streamed


def test_streaming_holds_back_only_what_may_start_a_call():
    s = CallSplitter("hermes", NAMES)
    assert [s.feed(p) for p in ("Hello", " <", "tool", "_c")] == ["Hello", "", "", ""]
    assert s.feed("at is near") == " <tool_cat is near"  # not a marker after all: shown
    assert s.feed("  ") == ""  # trailing blanks wait for what follows
    assert s.finish() == ("  ", ParsedAnswer("Hello <tool_cat is near  "))
    g = CallSplitter("generic", NAMES)
    assert [g.feed(p) for p in ("a {", " \"na", "sty\" }")] == ["a", "", ' { "nasty" }']
    end = CallSplitter("mistral", NAMES)
    assert end.feed("ok [TOOL_") == "ok"
    assert end.finish() == (" [TOOL_", ParsedAnswer("ok [TOOL_"))  # a cut-off marker is text


# ---- grammar -----------------------------------------------------------------------------

def test_call_schema_one_alternative_per_function_with_definitions_hoisted():
    item = {"type": "object", "properties": {"n": {"type": "integer"}}}
    schema = call_schema([("get_weather", {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}),
        ("add", {"type": "object", "$defs": {"Item": item},
                 "properties": {"x": {"$ref": "#/$defs/Item"}}}),
        ("noop", None)], "generic")
    first, second, third = schema["anyOf"]
    assert first["properties"]["name"] == {"const": "get_weather"}
    assert first["required"] == ["name", "arguments"] and not first["additionalProperties"]
    assert "$defs" not in second["properties"]["arguments"]
    assert schema["$defs"] == {"Item": item}
    assert third["properties"]["arguments"] == {"type": "object", "properties": {},
                                                "additionalProperties": False}
    llama = call_schema([("noop", None)], "llama3")  # one function: no anyOf
    assert set(llama["properties"]) == {"name", "parameters"}
    with pytest.raises(InvalidRequestError, match="define \\$defs/Item differently") as e:
        call_schema([("a", {"$defs": {"Item": item}}), ("b", {"$defs": {"Item": {}}})],
                    "generic")
    assert e.value.param == "tools"


def test_wrapped_grammar_per_family():
    gbnf = 'root ::= "{" space "}" space\nspace ::= " "?\n'
    hermes = wrap_call_grammar(gbnf, "hermes", parallel=True)
    assert hermes.startswith('root ::= " "? ("<tool_call>\\n" justllm-tool-call "\\n</tool_call>"'
                             ' ("\\n" "<tool_call>\\n" justllm-tool-call "\\n</tool_call>")*)\n')
    assert "\njustllm-tool-call ::= \"{\" space" in hermes and "\nroot ::= \"{\"" not in hermes
    assert wrap_call_grammar(gbnf, "generic", parallel=False).startswith(
        'root ::= " "? (justllm-tool-call)\n')
    assert wrap_call_grammar(gbnf, "mistral", parallel=False).startswith(
        'root ::= " "? ("[TOOL_CALLS][" justllm-tool-call "]")\n')
    assert wrap_call_grammar(gbnf, "llama3", parallel=True).startswith(
        'root ::= " "? (justllm-tool-call)\n')  # Llama 3 calls one function per turn


# ---- request checks ------------------------------------------------------------------------

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def _plan(**body):
    return tool_plan(msgspec.convert({"messages": [{"role": "user", "content": "hi"}], **body},
                                     ChatCompletionRequest))


def test_tool_plan_modes():
    assert _plan().mode == "none" and not _plan(tool_choice="none").active
    auto = _plan(tools=[TOOL])
    assert (auto.mode, auto.parallel, auto.names) == ("auto", True, frozenset({"get_weather"}))
    assert auto.for_template() == [TOOL]
    assert _plan(tools=[TOOL], tool_choice="none").for_template() is None
    named = _plan(tools=[TOOL, {"type": "function", "function": {"name": "f"}}],
                  tool_choice={"type": "function", "function": {"name": "f"}},
                  parallel_tool_calls=False)
    assert (named.mode, named.enforced, named.parallel) == ("named", True, False)
    assert [f.name for f in named.callable()] == ["f"]
    assert named.for_template()[1] == {"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]},
     "tools[0].function.name"),
    ({"tools": [TOOL, TOOL]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "string"}}}]}, "tools[0].function.parameters"),
    ({"tools": [TOOL], "logprobs": True}, "logprobs"),
    ({"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),  # (under "auto" the answer is a call or an answer in the format)
])
def test_tool_plan_refusals(body, param):
    with pytest.raises(InvalidRequestError) as e:
        _plan(**body)
    assert e.value.param == param


@pytest.mark.parametrize("arguments", ['{"x": NaN}', '{"x": Infinity}', '{"x": -Infinity}',
                                       '{"x": 1e400}', '"{\\"x\\": NaN}"'])
def test_arguments_no_json_parser_reads_make_the_call_content(arguments):
    """NaN and Infinity (Python's json reads them; 1e400 overflows to it) were passed on as
    the call's arguments: '{"x": NaN}', which no client's JSON parser reads (Anthropic's
    route turned it into null)."""
    text = f'<tool_call>\n{{"name": "get_time", "arguments": {arguments}}}\n</tool_call>'
    assert parse_answer(text, "hermes", NAMES) == ParsedAnswer(text)
    fine = text.replace("NaN", "1.5").replace("-Infinity", "-2").replace(
        "Infinity", "2").replace("1e400", "1e300")
    assert parse_answer(fine, "hermes", NAMES).calls


def test_references_inside_a_functions_parameters_follow_them_into_the_call_schema():
    """A parameters schema referring to itself ('#/properties/b', '#') was a 400 once nested
    under the call's arguments: 'Error resolving ref'."""
    from justllm.engine.backend import grammar_from_json_schema

    params = {"type": "object", "properties": {"a": {"$ref": "#/properties/b"},
                                               "b": {"type": "integer"},
                                               "self": {"$ref": "#"}}}
    one = call_schema([("f", params)], "hermes")
    assert one["properties"]["arguments"] == {"$ref": "#/$defs/justllm-tool-call-arguments-0"}
    moved = one["$defs"]["justllm-tool-call-arguments-0"]["properties"]
    assert moved["a"] == {"$ref": "#/$defs/justllm-tool-call-arguments-0/properties/b"}
    assert moved["self"] == {"$ref": "#/$defs/justllm-tool-call-arguments-0"}
    two = call_schema([("g", {"$defs": {"x": {"type": "string"}},
                              "properties": {"y": {"$ref": "#/$defs/x"}}}), ("f", params)],
                      "hermes")
    assert two["anyOf"][0]["properties"]["arguments"]["properties"]["y"] == {
        "$ref": "#/$defs/x"}  # (into definitions: left as it was)
    assert two["anyOf"][1]["properties"]["arguments"] == {
        "$ref": "#/$defs/justllm-tool-call-arguments-1"}
    for schema in (one, two):
        assert "::=" in grammar_from_json_schema(schema)


def test_prefixed_rules_rename_rule_names_only():
    """Two JSON-schema grammars share one union (tools beside a response format): every rule
    name of one is prefixed, and nothing inside literals, classes, counts or comments."""
    from justllm.server.tools.grammar import prefixed_rules

    gbnf = ('root ::= "{" space name-kv "}" # a comment: root space\n'
            'name-kv ::= "\\"root\\" x" [a-z\\]-] item{2,5} space\n'
            'item ::= [0-9]\nspace ::= " "?')
    assert prefixed_rules(gbnf, "p-") == (
        'p-root ::= "{" p-space p-name-kv "}" # a comment: root space\n'
        'p-name-kv ::= "\\"root\\" x" [a-z\\]-] p-item{2,5} p-space\n'
        'p-item ::= [0-9]\np-space ::= " "?')
