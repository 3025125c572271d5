"""Structured output through llama-server's and vLLM's own fields (server/structured.py), on
/v1/completions and /v1/chat/completions, and vLLM's stop_token_ids: the answers follow the
constraint on real weights, and every conflict or bad value is a 400 naming its field."""

from __future__ import annotations

import json
import re

import httpx
import pytest

# Bounded, so every sampled answer completes within max_tokens (an unbounded string or integer
# let a sampled choice run on to the length limit now and then).
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0,
                                                   "maximum": 150}},
          "required": ["name", "age"]}
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
HI = [{"role": "user", "content": "Describe a person."}]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def texts(server, path: str, ended: bool = True, **body) -> list[str]:
    payload = {"max_tokens": 60, "temperature": 0.9, "seed": 3, "n": 2, **body}
    if path == CHAT:
        payload.setdefault("messages", HI)
    else:
        payload.setdefault("prompt", "A person:")
    r = post(server, path, payload)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert not ended or all(c["finish_reason"] == "stop" for c in choices), choices
    return [c["text"] if path == COMPLETIONS else c["message"]["content"] for c in choices]


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("field", [
    {"json_schema": PERSON},  # llama-server's
    {"structured_outputs": {"json": PERSON}},  # vLLM's
    {"structured_outputs": {"json": json.dumps(PERSON)}},  # the schema as JSON text
    {"guided_json": PERSON},  # vLLM's older name
])
def test_a_json_schema_is_followed(server, path, field):
    for text in texts(server, path, max_tokens=120, **field):
        person = json.loads(text)
        assert set(person) == {"name", "age"} and isinstance(person["age"], int), text


@pytest.mark.parametrize("field", [{"structured_outputs": {"choice": ["yes", "no", 'a "b"\n']}},
                                   {"guided_choice": ["yes", "no", 'a "b"\n']}])
def test_a_choice_is_one_of_them(server, field):
    for path in (COMPLETIONS, CHAT):
        assert set(texts(server, path, **field)) <= {"yes", "no", 'a "b"\n'}


@pytest.mark.parametrize("field", ["guided_regex", "regex"])
def test_a_regular_expression_is_matched_by_the_whole_answer(server, field):
    """vLLM's guided_regex (and structured_outputs.regex) was a 400: no regex translation."""
    pattern = r'\d{3}-[A-Z]{2} "(yes|no)"'
    body = ({field: pattern} if field == "guided_regex"
            else {"structured_outputs": {field: pattern}})
    for path in (COMPLETIONS, CHAT):
        for text in texts(server, path, **body):
            assert re.fullmatch(pattern, text), text


@pytest.mark.parametrize("field", ["grammar", "guided_grammar"])
def test_a_gbnf_grammar_is_followed(server, field):
    gbnf = 'root ::= [1-9] [0-9]? " apples"'
    for text in texts(server, COMPLETIONS, **{field: gbnf}):
        number, _, rest = text.partition(" ")
        assert number.isdigit() and 1 <= int(number) <= 99 and rest == "apples", text
    objects = texts(server, COMPLETIONS, ended=False, temperature=0, n=1, max_tokens=200,
                    structured_outputs={"json_object": True})
    assert isinstance(json.loads(objects[0]), dict), objects


def test_a_grammar_at_the_limits_is_served(server):
    """4,096 chained rules around 1,024 nested groups: within what llama.cpp's recursion
    takes (server/structured.py's limits), and parentheses in literals do not count."""
    gbnf = ("root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(4094))
            + "r4094 ::= " + "(" * 1024 + '"(((" [(]' + ")" * 1024 + "\n")
    assert texts(server, COMPLETIONS, grammar=gbnf, n=1, max_tokens=8) == ["(((("]


def test_stop_token_ids_end_the_answer(server):
    body = {"prompt": "One, two, three, four,", "max_tokens": 20, "temperature": 0}
    free = post(server, COMPLETIONS, {**body, "logprobs": 0}).json()["choices"][0]
    assert free["finish_reason"] == "length"
    tokens = httpx.post(server.url + "/tokenize", timeout=60, json={
        "prompt": free["text"], "add_special_tokens": False}).json()["tokens"]
    stopped = post(server, COMPLETIONS, {**body, "stop_token_ids": [tokens[2]]}).json()
    choice = stopped["choices"][0]
    assert choice["finish_reason"] == "stop" and stopped["usage"]["completion_tokens"] == 3
    assert free["text"].startswith(choice["text"]) and len(choice["text"]) < len(free["text"])
    # as in vLLM, the stop token's own text ends the answer
    upto = httpx.post(server.url + "/detokenize", json={"tokens": tokens[:3]}, timeout=60)
    assert choice["text"] == upto.json()["prompt"]


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_include_stop_str_in_output_ends_the_text_with_the_stop_string(server, path):
    """vLLM's include_stop_str_in_output: the same answer, now ending with the request's stop
    string; the chat template's end-of-turn string is never written."""
    body = {"max_tokens": 24, "temperature": 0}
    if path == COMPLETIONS:
        body["prompt"] = "One, two, three, four,"
    else:
        body["messages"] = [{"role": "user", "content": "Count from one to ten in words."}]
    free = post(server, path, body).json()["choices"][0]
    free = free.get("text", free.get("message", {}).get("content"))
    assert len(free) > 8, free
    stop = free[4:7]  # a stop string the greedy answer meets
    cut = free[:free.index(stop)]

    def answer(**extra):
        out = post(server, path, {**body, "stop": [stop], **extra}).json()["choices"][0]
        assert out["finish_reason"] == "stop", out
        return out.get("text", out.get("message", {}).get("content"))

    assert answer() == cut
    assert answer(include_stop_str_in_output=True) == cut + stop
    assert answer(include_stop_str_in_output=False) == cut
    if path == CHAT:  # the turn's own end is not the request's: still left out
        short = post(server, path, {**body, "max_tokens": 200, "include_stop_str_in_output": True}
                     ).json()["choices"][0]
        assert "<end_of_turn>" not in short["message"]["content"]


@pytest.mark.parametrize("path, body, param, says", [
    (COMPLETIONS, {"grammar": "root ::= undefined-rule"}, "grammar",
     "could not parse the grammar: Undefined rule identifier 'undefined-rule'"),
    (COMPLETIONS, {"grammar": 'root ::= "a'}, "grammar",
     "could not parse the grammar: unexpected end of input"),
    (COMPLETIONS, {"grammar": ""}, "grammar", "could not parse"),
    (COMPLETIONS, {"grammar": 'root ::= root "a" | "a"'}, "grammar",
     "could not parse the grammar: unsupported grammar, left recursion detected"),
    (COMPLETIONS, {"grammar": 'x ::= "a"'}, "grammar", "does not contain a 'root' symbol"),
    # a 9-byte maxLength made a grammar nested a million deep: a segfault
    (COMPLETIONS, {"json_schema": {"type": "string", "maxLength": 1_000_000}}, "json_schema",
     "maxLength is 1000000; at most 1000"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "items": {"type": "string"}, "maxItems": 100_000}}}},
     "response_format.json_schema.schema", "maxItems is 100000; at most 1000"),
    (COMPLETIONS, {"guided_json": {"type": "string", "pattern": "^a{5000}$"}}, "guided_json",
     "{5000} repeats more than 1000 times"),
    # 5,000 alternatives held every other request for seconds a token
    (COMPLETIONS, {"guided_choice": [f"w{i}" for i in range(2000)]}, "guided_choice",
     "2000 choices; at most 1024"),
    (COMPLETIONS, {"grammar": "root ::= " + " | ".join(f'"w{i}"' for i in range(2000))},
     "grammar", "1999 alternatives ('|'); at most 1024"),
    (COMPLETIONS, {"json_schema": {"enum": list(range(2000))}}, "json_schema",
     "enum has 2000 values; at most 1024"),
    (COMPLETIONS, {"json_schema": {"anyOf": [{"const": i} for i in range(2000)]}},
     "json_schema", "anyOf has 2000 schemas; at most 1024"),
    # each keyword within its limit, but together 25 x 25 x 25 live choices
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "anyOf": [{"type": "object", "properties": {
            f"p{i}": {"enum": [f"v{j}" for j in range(25)]} for i in range(25)}}
            for _ in range(25)]}}}},
     "response_format.json_schema.schema",
     "the grammar made from the schema: 15624 alternatives ('|'); at most 8192"),
    (COMPLETIONS, {"json_schema": {"anyOf": [{"type": "object", "properties": {
        f"p{i}": {"enum": [f"v{j}" for j in range(50)]} for i in range(50)}}
        for _ in range(50)]}}, "json_schema",
     "json_schema: the grammar made from the schema: 124999 alternatives ('|'); at most 8192"),
    (CHAT, {"tools": [{"type": "function", "function": {"name": f"f{i}"}}
                      for i in range(129)]}, "tools", "129 tools; at most 128"),
    # 100,000 of either overflowed llama.cpp's stack: the server died
    (COMPLETIONS, {"grammar": "root ::= " + "(" * 100_000 + '"a"' + ")" * 100_000}, "grammar",
     "groups nested 100000 deep; at most 1024"),
    (COMPLETIONS, {"guided_grammar": "root ::= r0\n" + "".join(
        f"r{i} ::= r{i + 1}\n" for i in range(100_000)) + 'r100000 ::= "a"\n'},
     "guided_grammar", "100002 rules; at most 4096"),
    # a quote or bracket in a comment hid what followed from the limits: the server died
    (COMPLETIONS, {"grammar": '# "\nroot ::= ' + "(" * 30_000 + '"a"' + ")" * 30_000},
     "grammar", "groups nested 30000 deep; at most 1024"),
    (COMPLETIONS, {"structured_outputs": {"grammar": "# [\nroot ::= " + "(" * 2000 + '"a"'
                                          + ")" * 2000 + "\n# ]\n"}},
     "structured_outputs.grammar", "groups nested 2000 deep; at most 1024"),
    (COMPLETIONS, {"grammar": '# "\nroot ::= ' + " | ".join(f'"w{i}"' for i in range(2000))},
     "grammar", "1999 alternatives ('|'); at most 1024"),
    # rules apart by "\r" (llama.cpp reads it as a line's end) went uncounted
    (COMPLETIONS, {"grammar": "root ::= r0\r" + "".join(
        f"r{i} ::= r{i + 1}\r" for i in range(5000)) + 'r5000 ::= "a"\r'},
     "grammar", "5002 rules; at most 4096"),
    (COMPLETIONS, {"guided_regex": "(a)\\1"}, "guided_regex", "back-references"),
    (COMPLETIONS, {"structured_outputs": {"regex": "a(?=b)"}}, "structured_outputs.regex",
     "lookahead"),
    (COMPLETIONS, {"guided_regex": "^$"}, "guided_regex", "empty"),
    (COMPLETIONS, {"structured_outputs": {}}, "structured_outputs", "exactly one of"),
    (COMPLETIONS, {"structured_outputs": {"choice": ["a"], "grammar": "root ::= \"a\""}},
     "structured_outputs", "exactly one of"),
    (COMPLETIONS, {"structured_outputs": {"choice": []}}, "structured_outputs.choice",
     "non-empty"),
    (COMPLETIONS, {"structured_outputs": {"json": "{nope"}}, "structured_outputs.json",
     "not JSON"),
    (COMPLETIONS, {"guided_json": "[1, 2]"}, "guided_json", "a JSON schema is an object"),
    (COMPLETIONS, {"structured_outputs": {"whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern", "unknown field"),
    (COMPLETIONS, {"grammar": "root ::= \"a\"", "guided_choice": ["a"]}, "guided_choice",
     "give one way"),
    (COMPLETIONS, {"stop_token_ids": [-1]}, "stop_token_ids", "is not a token id"),
    (CHAT, {"json_schema": PERSON, "response_format": {"type": "json_object"}}, "json_schema",
     "response_format and json_schema"),
    (CHAT, {"guided_choice": ["a"], "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object"}}}]}, "guided_choice",
     "tools and guided_choice"),
])
def test_bad_structured_fields_are_400s(server, path, body, param, says):
    payload = {"max_tokens": 4, **body}
    payload.update({"messages": HI} if path == CHAT else {"prompt": "x"})
    r = post(server, path, payload)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], error


def test_a_grammar_no_token_can_continue_is_the_requests_own_400(server):
    """llama.cpp has no token starting with NUL: the request can never go on. It was a 500."""
    body = {"grammar": 'root ::= "a" [\\x00]', "max_tokens": 4}
    r = post(server, COMPLETIONS, {"prompt": "x", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "grammar_dead_end"
    with httpx.stream("POST", server.url + CHAT, timeout=60, json={
            "messages": HI, "stream": True, **body}) as streamed:
        events = [json.loads(line[6:]) for line in streamed.iter_lines()
                  if line.startswith("data: {")]
    assert events[-1]["error"]["type"] == "invalid_request_error"
    assert events[-1]["error"]["code"] == "grammar_dead_end"


def test_schema_strings_hold_no_raw_control_characters(server):
    """The schema converter let a string hold a raw newline: invalid JSON."""
    newline = post(server, "/tokenize", {"content": "\n"}).json()["tokens"][0]
    r = post(server, COMPLETIONS, {"prompt": "JSON:", "max_tokens": 30, "temperature": 0,
                                   "json_schema": {"type": "string", "maxLength": 2},
                                   "logit_bias": {str(newline): 100}})
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    assert isinstance(json.loads(text), str) and "\n" not in text, text
