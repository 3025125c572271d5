"""Tool calling on /v1/chat/completions through the real ``openai`` client against a real
server on the demo model (a base model: its template gets the fallback text, and a forced call
is what the grammar lets it write), and each family's forcing grammar on the real engine."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pydantic
import pytest

from justllm.core.sampling_params import SamplingParams
from justllm.engine.backend import grammar_from_json_schema
from justllm.engine.chat_template import ChatTemplate
from justllm.server.tools.grammar import call_schema, section_calls_grammar, wrap_call_grammar
from justllm.server.tools.parse import parse_answer
from justllm.server.tools.xml_grammar import xml_call_grammar
from tests.server.test_errors import assert_error, post

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather "
                                      "in a city.", "parameters": WEATHER, "strict": True}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                      "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def assert_valid_call(call) -> dict:
    assert call.type == "function" and call.id.startswith("call_") and len(call.id) == 29
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def test_required_call_validates_against_its_schema(client, server):
    r = client.chat.completions.create(model=server.model, messages=ASK, tools=TOOLS,
                                       tool_choice="required", parallel_tool_calls=False,
                                       max_tokens=96, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    assert_valid_call(choice.message.tool_calls[0])
    assert r.usage.completion_tokens > 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_named_call_streams_in_openai_chunk_shape(server):
    # (room for two 16-digit integers, a digit a token; computed whole: a prefix-cache hit
    # moved a near tie to such numbers on a fresh clone, and 48 tokens cut the call off)
    body = {"model": server.model, "messages": ASK, "tools": TOOLS, "max_tokens": 96,
            "tool_choice": {"type": "function", "function": {"name": "add"}}, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "cache_prompt": False}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    start, *pieces, end = deltas[1:]
    call_id = start["tool_calls"][0]["id"]
    assert start == {"tool_calls": [{"index": 0, "id": call_id, "type": "function",
                                     "function": {"name": "add", "arguments": ""}}]}
    assert len(pieces) > 3  # the arguments come as the model writes them
    assert all(d == {"tool_calls": [{"index": 0, "function": {
        "arguments": d["tool_calls"][0]["function"]["arguments"]}}]} for d in pieces)
    assert end == {} and reasons == [None] * (len(deltas) - 1) + ["tool_calls"]
    arguments = "".join(d["tool_calls"][0]["function"]["arguments"] for d in pieces)
    jsonschema.validate(json.loads(arguments), ADD)
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["completion_tokens"] > 5


def test_openai_client_stream_and_n_choices(client, server):
    stream = client.chat.completions.create(
        model=server.model, messages=ASK, tools=TOOLS, tool_choice="required", n=2,
        max_tokens=96, temperature=0, stream=True)
    calls: dict[int, dict[int, dict]] = {0: {}, 1: {}}
    reasons = {}
    for chunk in stream:
        for c in chunk.choices:
            assert not c.delta.content  # a forced call has no text
            for d in c.delta.tool_calls or []:
                call = calls[c.index].setdefault(d.index, {"name": "", "arguments": ""})
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert reasons == {0: "tool_calls", 1: "tool_calls"}
    for choice in calls.values():
        assert choice
        for call in choice.values():
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_the_sdks_stream_helper_reads_the_arguments_as_they_grow(client, server):
    """The openai SDK's chat.completions.stream() parses a strict tool's arguments as their
    pieces arrive (jiter's partial mode): each event's parsed_arguments is a part of the
    whole call, and the last is the call."""

    class Weather(pydantic.BaseModel):
        city: str
        unit: str

    tool = openai.pydantic_function_tool(Weather, name="get_weather")
    with client.chat.completions.stream(model=server.model, messages=ASK, tools=[tool],
                                        tool_choice="required", temperature=0,
                                        max_tokens=48) as stream:
        grown = [ev.parsed_arguments for ev in stream
                 if ev.type == "tool_calls.function.arguments.delta"]
        final = stream.get_final_completion().choices[0].message.tool_calls[0].function
    assert len(grown) > 3 and isinstance(final.parsed_arguments, Weather)
    assert grown[-1] == final.parsed_arguments.model_dump()
    assert any(g and len(g) < len(grown[-1]) for g in grown), grown  # (seen half-way)


def test_allowed_tools_keep_every_tool_in_the_prompt_and_call_only_the_allowed(server):
    """OpenAI's ``tool_choice: {"type": "allowed_tools"}`` was refused: every tool is in the
    prompt (the same prompt as without it: its cache holds), and a call names an allowed one."""
    base = {"model": server.model, "messages": ASK, "tools": TOOLS, "max_tokens": 96,
            "temperature": 1, "seed": 3, "n": 3}
    every = post(server, "/v1/chat/completions", {**base, "tool_choice": "required"}).json()
    for name in ("add", "get_weather"):
        choice = {"type": "allowed_tools", "allowed_tools": {
            "mode": "required", "tools": [{"type": "function", "function": {"name": name}}]}}
        r = post(server, "/v1/chat/completions", {**base, "tool_choice": choice})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["prompt_tokens"] == every["usage"]["prompt_tokens"]
        calls = [c for ch in body["choices"] for c in ch["message"]["tool_calls"]]
        assert calls and {c["function"]["name"] for c in calls} == {name}
        for c in calls:
            jsonschema.validate(json.loads(c["function"]["arguments"]), SCHEMAS[name])
        # the Responses API's spelling
        r = post(server, "/v1/responses", {
            "model": server.model, "input": ASK[0]["content"], "max_output_tokens": 96,
            "temperature": 0, "tools": [{"type": "function", **t["function"]} for t in TOOLS],
            "tool_choice": {"type": "allowed_tools", "mode": "required",
                            "tools": [{"type": "function", "name": name}]}})
        assert r.status_code == 200, r.text
        called = [o["name"] for o in r.json()["output"] if o["type"] == "function_call"]
        assert called and set(called) == {name}
    for bad in ({"mode": "required", "tools": []},
                {"mode": "auto", "tools": [{"type": "function", "function": {"name": "nope"}}]},
                {"mode": "sometimes", "tools": [{"type": "function", "function": {
                    "name": "add"}}]}):
        r = post(server, "/v1/chat/completions", {**base, "tool_choice": {
            "type": "allowed_tools", "allowed_tools": bad}})
        assert_error(r, 400, r.json()["error"]["param"])
        assert r.json()["error"]["param"].startswith("tool_choice"), r.text


def test_a_round_trip_with_a_tool_message(client, server):
    first = client.chat.completions.create(
        model=server.model, messages=ASK, tools=TOOLS, max_tokens=48, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    message = first.choices[0].message
    assert_valid_call(message.tool_calls[0])
    result = {"role": "tool", "tool_call_id": message.tool_calls[0].id,
              "content": "18 degrees and sunny"}
    history = [*ASK, message, result]  # the client sends its own message object back
    answer = client.chat.completions.create(model=server.model, messages=history, tools=TOOLS,
                                            tool_choice="none", max_tokens=12, temperature=0)
    choice = answer.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
    # The call and its result are in the prompt: without them it is shorter by their text.
    bare = client.chat.completions.create(model=server.model, messages=ASK, tools=TOOLS,
                                          tool_choice="none", max_tokens=1)
    assert answer.usage.prompt_tokens > bare.usage.prompt_tokens + 16


@pytest.mark.filterwarnings("ignore:Pydantic serializer warnings")  # the SDK's own, on parsed
def test_messages_from_the_sdks_parse_helpers_go_back_as_they_are(client, server):
    """``.parse()`` adds ``parsed`` to its message and ``parsed_arguments`` to each call; a
    streamed call carries its ``index``. Sent back as the history, each was a 400."""
    import pydantic

    class City(pydantic.BaseModel):
        city: str

    parsed = client.chat.completions.parse(
        model=server.model, messages=ASK, max_tokens=24, temperature=0, response_format=City)
    message = parsed.choices[0].message
    assert message.parsed is not None
    again = client.chat.completions.create(model=server.model, max_tokens=2, messages=[
        *ASK, message, {"role": "user", "content": "And Rome?"}])
    assert again.choices[0].message.content is not None
    called = client.chat.completions.parse(
        model=server.model, messages=ASK, max_tokens=48, temperature=0,
        tools=[openai.pydantic_function_tool(City)], tool_choice="required")
    message = called.choices[0].message
    assert message.tool_calls[0].function.parsed_arguments is not None
    dumped = message.model_dump()
    dumped["tool_calls"][0]["index"] = 0  # as a client accumulating stream deltas keeps it
    answer = client.chat.completions.create(model=server.model, max_tokens=2, messages=[
        *ASK, dumped, {"role": "tool", "tool_call_id": message.tool_calls[0].id,
                       "content": "sunny"}])
    assert answer.choices[0].finish_reason in ("stop", "length")
    for bad, param in (({"parsed": {"x": 1}, "content": None}, "messages[1].parsed"),):
        r = post(server, "/v1/chat/completions", {"model": server.model, "messages": [
            *ASK, {"role": "assistant", **bad}]})
        assert_error(r, 400, param)


def test_auto_and_none(client, server):
    auto = client.chat.completions.create(model=server.model, messages=ASK, tools=TOOLS,
                                          max_tokens=24, temperature=0)
    none = client.chat.completions.create(model=server.model, messages=ASK, tools=TOOLS,
                                          tool_choice="none", max_tokens=24, temperature=0)
    # "none": the tools stay out of the prompt and the answer is text.
    assert none.usage.prompt_tokens + 100 < auto.usage.prompt_tokens
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content
    choice = auto.choices[0]  # "auto": the model chooses; whatever it wrote is well-formed
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls:
            assert_valid_call(call)
    else:
        assert choice.finish_reason in ("stop", "length") and choice.message.content


def test_an_auto_call_the_model_starts_is_held_to_the_tools_schema(client, server):
    """tool_choice "auto": the model copies the call it made before, naming Paris, a city the
    tool's enum does not offer. Its answer was parsed as it came (a call with Paris); the call
    grammar now takes hold where the call begins (llama-server's lazy grammar), so the call
    it makes is valid for the tool, streamed or not."""
    cities = {"type": "object", "properties": {"city": {"type": "string",
                                                        "enum": ["Rome", "Oslo"]}},
              "required": ["city"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": cities}}]
    call = {"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}
    turn = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            {"role": "assistant", "content": "It is sunny in Paris."}]
    messages = [*turn, *turn, *ASK]
    kw = dict(model=server.model, messages=messages, max_tokens=40, temperature=0)
    free = client.chat.completions.create(**kw, tool_choice="none")
    assert free.choices[0].message.content.lstrip().startswith('{"name": "get_weather"')
    r = client.chat.completions.create(**kw, tools=tools)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    args = json.loads(choice.message.tool_calls[0].function.arguments)
    jsonschema.validate(args, cities)
    streamed = list(client.chat.completions.create(**kw, tools=tools, stream=True))
    pieces = [d.function.arguments or "" for c in streamed for d in (
        c.choices[0].delta.tool_calls or [])]
    assert json.loads("".join(pieces)) == args
    # (held by the grammar once the call began, its arguments stream as they are written)
    assert len([p for p in pieces if p]) > 3


ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 30}},
          "required": ["answer"], "additionalProperties": False}


def test_auto_with_a_response_format_is_a_call_or_an_answer_in_the_format(client, server):
    """OpenAI's API takes tools and a response format together (the Agents SDK's tools with
    an output type): the answer is a valid call, or content in the format. It was a 400."""
    cities = {"type": "object", "properties": {"city": {"type": "string",
                                                        "enum": ["Rome", "Oslo"]}},
              "required": ["city"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": cities,
                                               "strict": True}}]
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "strict": True,
                                                  "schema": ANSWER}}
    call = {"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}
    turn = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            {"role": "assistant", "content": "It is sunny in Paris."}]
    shots = [m for q, a in (("Say hi.", "Hi!"), ("Say bye.", "Bye!")) for m in (
        {"role": "user", "content": q},
        {"role": "assistant", "content": json.dumps({"answer": a})})]
    kw = dict(model=server.model, tools=tools, response_format=fmt, max_tokens=40,
              temperature=0)
    calls = client.chat.completions.create(messages=[*turn, *turn, *ASK], **kw).choices[0]
    assert calls.finish_reason == "tool_calls" and calls.message.content is None
    jsonschema.validate(json.loads(calls.message.tool_calls[0].function.arguments), cities)
    asked = [*shots, {"role": "user", "content": "Say hello."}]
    said = client.chat.completions.create(messages=asked, **kw).choices[0]
    assert said.finish_reason == "stop" and said.message.tool_calls is None
    jsonschema.validate(json.loads(said.message.content), ANSWER)
    streamed = list(client.chat.completions.create(messages=asked, stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == \
        said.message.content
    # the SDK's parse helper reads the answer into its model, and a call's arguments too

    class Answer(pydantic.BaseModel):
        answer: str

    parse = {**kw, "response_format": Answer}
    parsed = client.chat.completions.parse(messages=asked, **parse).choices[0].message
    assert parsed.parsed.answer and not parsed.tool_calls
    parsed = client.chat.completions.parse(messages=[*turn, *turn, *ASK], **parse)
    assert parsed.choices[0].message.tool_calls[0].function.parsed_arguments["city"] in (
        "Rome", "Oslo")


def test_a_cut_off_call_comes_back_as_text(client, server):
    kw = dict(model=server.model, messages=ASK, tools=TOOLS, tool_choice="required",
              max_tokens=6, temperature=0)
    r = client.chat.completions.create(**kw)
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.tool_calls is None
    assert text.lstrip().startswith(("{", "[")) and '"name"' in text
    streamed = list(client.chat.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == text
    assert streamed[-1].choices[0].finish_reason == "length"
    assert not any(c.choices[0].delta.tool_calls for c in streamed)


def test_a_call_cut_off_inside_its_arguments_stands_as_far_as_it_came(client, server):
    """As OpenAI's API: max_tokens that ends a call inside its arguments gives the call with
    the arguments so far and finish_reason "length", streamed or not, the stream's pieces
    joining to the same arguments."""
    kw = dict(model=server.model, messages=ASK, tools=TOOLS, temperature=0,
              tool_choice={"type": "function", "function": {"name": "get_weather"}},
              extra_body={"cache_prompt": False})
    whole = client.chat.completions.create(**kw, max_tokens=48)
    full = whole.choices[0].message.tool_calls[0].function.arguments
    r = client.chat.completions.create(**kw, max_tokens=whole.usage.completion_tokens - 3)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert full.startswith(call.function.arguments) and len(call.function.arguments) > 10
    assert call.function.arguments != full
    streamed = list(client.chat.completions.create(
        **kw, max_tokens=whole.usage.completion_tokens - 3, stream=True))
    pieces = [d.function.arguments or "" for c in streamed for d in (
        c.choices[0].delta.tool_calls or [])]
    assert "".join(pieces) == call.function.arguments
    assert streamed[-1].choices[0].finish_reason == "length"
    assert not any(c.choices[0].delta.content for c in streamed)


LOOPING = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"],
    "$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}, {"type": "string"}]}}}}}]


def test_bad_tool_requests_get_openai_errors(server):
    base = {"model": server.model, "messages": ASK}
    cases = [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"tools": [{"type": "custom", "custom": {"name": "grep"}}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]},
         "tools[0].function.name"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": TOOLS, "logprobs": True}, "logprobs"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}}}}],
          "tool_choice": "required"}, "tools"),
        # no JSON schema: its grammar's error named response_format (or the server's own call
        # schema) under auto, and a property's minLength -1 was taken
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": {"type": []}}}}}]},
         "tools[0].function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": {"type": "string", "minLength": -1}}}}}]},
         "tools[0].function.parameters"),
        # a schema that begins with itself: llama.cpp refused its grammar on the engine
        # thread, in words that named response_format
        ({"tools": LOOPING, "tool_choice": "required"}, "tools"),
        ({"tools": LOOPING}, "tools"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": LOOPING[0]["function"]["parameters"]}}},
         "response_format.json_schema.schema"),
        ({"messages": [*ASK, {"role": "tool", "content": "18C"}]}, "messages[1].tool_call_id"),
        # a tool message answering no call (OpenAI: "must be a response to a preceding
        # message with 'tool_calls'"); both were answered
        ({"messages": [*ASK, {"role": "tool", "tool_call_id": "c1", "content": "18C"}]},
         "messages[1].tool_call_id"),
        ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{
            "id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c2", "content": "18C"}]},
         "messages[2].tool_call_id"),
        ({"messages": [{"role": "user", "content": "hi", "tool_calls": [{
            "id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
         "messages[0].tool_calls"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ]
    for extra, param in cases:
        r = post(server, "/v1/chat/completions", {**base, **extra})
        assert_error(r, 400, param)
        if extra.get("tools") is LOOPING or "response_format" in extra and param != \
                "response_format":
            assert "refers back to itself" in r.json()["error"]["message"], r.text


def _run(engine, rid: str) -> tuple[str, str]:
    """Step ``engine`` until request ``rid`` ends: its text and finish reason."""
    text, finish = "", None
    while finish is None:
        for out in engine.step():
            assert out.error is None, out.error
            if out.request_id == rid:
                text += out.text
                finish = out.finish_reason if out.finished else None
    return text, finish


# ---- each family's forcing grammar on the real engine ---------------------------------------
# (generic is the server's, above; greedy: a sampled request under a grammar masks the whole
# vocabulary at every token, which is slow on a CPU)

@pytest.mark.parametrize("template, fmt", [("chatml", "hermes"), ("llama3", "llama3"),
                                           ("transcript", "mistral")])
def test_each_familys_grammar_forces_a_valid_call(engine, template, fmt):
    t = ChatTemplate.named(template)
    tools = [tool for tool in TOOLS if tool["function"]["name"] == "get_weather"]
    prompt = t.render(ASK, tools=tools)
    schema = call_schema([("get_weather", WEATHER)], fmt)
    grammar = wrap_call_grammar(grammar_from_json_schema(schema), fmt, parallel=False)
    rid = engine.add_request(prompt, SamplingParams(max_tokens=48, temperature=0,
                                                    grammar=grammar, stop=t.stop))
    text, finish = _run(engine, rid)
    answer = parse_answer(text.lstrip(), fmt, frozenset({"get_weather"}))
    assert finish == "stop" and len(answer.calls) == 1, text
    jsonschema.validate(json.loads(answer.calls[0].arguments), WEATHER)


# GLM's XML form and DeepSeek V3.1's call section (Kimi K2's is the same grammar, its head
# apart: test_xml_calls.py): the grammar writes the call as their templates do, the values held to the schema (GLM's plain string raw, up to its closing
# tag; a bounded integer as JSON), and the parser reads it back. The demo model copies the
# calls the prompt shows (a days value the schema does not allow among them: the grammar's
# work shows). Qwen3-Coder's form is served end to end in test_xml_calls.py.
TRIP = {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 2},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "days"]}
SHOWN_CALLS = {
    "glm": "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
           "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>",
    "deepseek_v3_1": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
                     '{"city": "Paris", "days": 3}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'}


@pytest.mark.parametrize("fmt", sorted(SHOWN_CALLS))
def test_glms_and_deepseeks_grammar_forces_a_call_the_parser_reads_back(engine, fmt):
    shot = f"User: What is the weather in Paris?\nAssistant: {SHOWN_CALLS[fmt]}\n"
    prompt = shot * 3 + "User: What is the weather in Paris?\nAssistant:"
    functions = [("get_weather", TRIP), ("add", ADD)]
    grammar = (xml_call_grammar(fmt, functions, grammar_from_json_schema, parallel=False,
                                compact=True) if fmt == "glm" else section_calls_grammar(
        fmt, [(n, grammar_from_json_schema(p)) for n, p in functions], parallel=False))
    rid = engine.add_request(prompt, SamplingParams(max_tokens=100, temperature=0,
                                                    grammar=grammar))
    text, finish = _run(engine, rid)
    answer = parse_answer(text.lstrip(), fmt, frozenset({"get_weather", "add"}),
                          schemas=dict(functions))
    assert finish == "stop" and answer.called and len(answer.calls) == 1, text
    args = json.loads(answer.calls[0].arguments)
    jsonschema.validate(args, TRIP)
    assert args["city"] == "Paris" and args["days"] in (1, 2), text
