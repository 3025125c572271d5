"""OpenAI's Responses API (``/v1/responses``, stateless) through the real ``openai`` client
against a real ``justllm serve``: text and streamed responses (the SDK's typed events and its
stream helper), instructions, max_output_tokens, a function call round trip, and the 400s for
what is not supported."""

from __future__ import annotations

import json

import httpx
import msgspec
import openai
import pydantic
import pytest

from justllm.server.response_store import ResponseStore
from justllm.server.responses_chat import to_chat
from justllm.server.responses_schemas import ResponseRequest

HELLO = "Say hello."


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120,
                         max_retries=0)


def test_a_text_response(client, server):
    r = client.responses.create(model=server.model, input=HELLO, max_output_tokens=8,
                                temperature=0, store=False, metadata={"run": "test"},
                                user="tester", safety_identifier="safe-1",
                                prompt_cache_key="key-1")
    assert r.id.startswith("resp_") and r.object == "response" and r.model == server.model
    assert r.status in ("completed", "incomplete") and r.error is None
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == r.status
    assert item.content[0].type == "output_text" and item.content[0].annotations == []
    assert r.output_text == item.content[0].text != ""
    assert 1 <= r.usage.output_tokens <= 8 and r.usage.input_tokens > 3
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.metadata == {"run": "test"} and r.user == "tester"
    # (echoed as OpenAI's Response states them: they came back null)
    assert (r.safety_identifier, r.prompt_cache_key) == ("safe-1", "key-1")


def test_usage_counts_the_prompt_tokens_the_prefix_cache_held(client, server):
    """input_tokens_details.cached_tokens was always 0."""
    text = "Tell me about the sea, " * 6
    client.responses.create(model=server.model, input=text, max_output_tokens=2)
    again = client.responses.create(model=server.model, input=text, max_output_tokens=2)
    assert 16 <= again.usage.input_tokens_details.cached_tokens < again.usage.input_tokens


def test_message_items_and_instructions(client, server):
    plain = client.responses.create(model=server.model, input=HELLO, max_output_tokens=1)
    r = client.responses.create(
        model=server.model, max_output_tokens=4, temperature=0,
        instructions="Answer in one short sentence.",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi."}]},
               {"role": "assistant", "content": [{"type": "output_text", "text": "Hello.",
                                                  "annotations": []}]},
               {"type": "message", "role": "user", "content": HELLO}])
    assert r.instructions == "Answer in one short sentence."
    assert r.output_text and r.usage.input_tokens > plain.usage.input_tokens + 6
    with_instructions = client.responses.create(model=server.model, input=HELLO,
                                                max_output_tokens=1,
                                                instructions="Answer in one short sentence.")
    assert with_instructions.usage.input_tokens > plain.usage.input_tokens


def test_max_output_tokens_makes_it_incomplete(client, server):
    r = client.responses.create(model=server.model, input="Tell me a long story.",
                                max_output_tokens=3, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete"


def test_streaming_events(client, server):
    events = list(client.responses.create(model=server.model, input=HELLO, stream=True,
                                          max_output_tokens=6, temperature=0))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{events[-1].response.status}"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == text == events[-4].text
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    whole = client.responses.create(model=server.model, input=HELLO, max_output_tokens=6,
                                    temperature=0)
    assert whole.output_text == text and whole.usage.output_tokens == final.usage.output_tokens


class Verdict(pydantic.BaseModel):
    ok: bool


def test_the_sdk_stream_helper_with_a_text_format(client, server):
    """A JSON schema (``text.format``) ends the answer where the object closes: the response
    completes, and the SDK parses it into the model it was given."""
    with client.responses.stream(model=server.model, input=HELLO, max_output_tokens=40,
                                 temperature=0, text_format=Verdict) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == "".join(deltas)
    assert isinstance(final.output_parsed, Verdict)
    assert final.text.format.type == "json_schema"


# ---- tools -----------------------------------------------------------------------------------

WEATHER = {"type": "function", "name": "get_weather", "strict": True,
           "description": "Get the current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"], "additionalProperties": False}}
ASK = "What is the weather in Paris?"


def test_a_function_call_round_trip(client, server):
    """A forced tool_choice makes even the tiny base model call the function (a grammar holds
    it to the schema); the call and its function_call_output go back in the next input."""
    r = client.responses.create(model=server.model, input=ASK, tools=[WEATHER],
                                tool_choice={"type": "function", "name": "get_weather"},
                                max_output_tokens=60, temperature=0)
    assert r.status == "completed"
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.id.startswith("fc_") and call.call_id and call.status == "completed"
    assert isinstance(json.loads(call.arguments)["city"], str)
    assert r.tool_choice.name == "get_weather" and r.tools[0].name == "get_weather"
    follow = client.responses.create(model=server.model, tools=[WEATHER], max_output_tokens=4,
                                     temperature=0, input=[
        {"role": "user", "content": ASK}, call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}])
    assert follow.output_text and follow.usage.input_tokens > r.usage.input_tokens
    # a call sent back without its output is OpenAI's 400 (it was answered as if it had
    # not been made)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=server.model, tools=[WEATHER], max_output_tokens=4,
                                input=[{"role": "user", "content": ASK},
                                       call.model_dump(exclude_none=True),
                                       {"role": "user", "content": "And Rome?"}])
    assert e.value.body["param"] == "input"
    assert e.value.body["message"].startswith(f"No tool output found for function call "
                                              f"{call.call_id}")


def test_a_streamed_function_call(client, server):
    events = list(client.responses.create(model=server.model, input=ASK, tools=[WEATHER],
                                          tool_choice="required", max_output_tokens=60,
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress",
                         "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[3:-3]) == {"response.function_call_arguments.delta"}
    assert len(kinds[3:-3]) > 3  # (the arguments stream as the model writes them)
    assert events[2].item.type == "function_call" and events[2].item.arguments == ""
    pieces = "".join(e.delta for e in events if e.type.endswith("arguments.delta"))
    final = events[-1].response.output[0]
    assert pieces == events[-3].arguments == final.arguments
    assert events[-3].item_id == final.id and final.name == "get_weather"
    assert isinstance(json.loads(final.arguments)["city"], str)
    with client.responses.stream(model=server.model, input=ASK, tools=[WEATHER],
                                 tool_choice="required", max_output_tokens=60,
                                 temperature=0) as stream:
        parsed = stream.get_final_response().output[0]
    assert parsed.parsed_arguments == json.loads(parsed.arguments)  # strict: the SDK parses


# ---- what is refused -------------------------------------------------------------------------

@pytest.mark.parametrize("extra, param", [
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),  # (no effort control here)
    ({"reasoning": {"summary": "detailed"}}, "reasoning.summary"),  # (no summaries)
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "x"}]},
     "input[0].encrypted_content"),  # (not one this server wrote)
    ({"include": ["reasoning.encrypted_content", "message.output_text.logprobs"]},
     "include[1]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image",
                                              "image_url": "https://x/y.png"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0]"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"input": [{"type": "function_call_output", "call_id": "c1"}]}, "input[0].output"),
    ({"input": [{"type": "function_call_output", "call_id": "c1", "output": "42"}]},
     "input[0].call_id"),  # answering no function_call given earlier (it was accepted)
    ({"input": []}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"truncation": "auto"}, "truncation"),
    # found by a review: each was a 200, or named the chat request's field
    ({"input": [{"role": "user", "content": []}]}, "input[0].content"),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
     "text.format.name"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"k": "v" * 513}}, "metadata.k"),
    ({"max_output_tokens": 10**6}, "max_output_tokens"),
    ({"input": "word " * 40000}, "input"),
    # found by an audit: each was a 200 (the field ignored, a format's echoed back), or named
    # the chat request's field
    ({"text": {"format": {"type": "text", "name": "x"}}}, "text.format.name"),
    ({"text": {"format": {"type": "json_object"}}, "tool_choice": "required", "tools": [
        {"type": "function", "name": "f", "parameters": {"type": "object"}}]}, "text.format"),
    ({"text": {"format": {"type": "text", "strict": True}}}, "text.format.strict"),
    ({"text": {"format": {"type": "json_object", "schema": {"type": "object"}}}},
     "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"},
                          "description": "An object."}}}, "text.format.description"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi",
                                              "image_url": "https://x/y.png"}]}]},
     "input[0].content[0].image_url"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi",
                                              "detail": "high"}]}]},
     "input[0].content[0].detail"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi",
                                              "prompt_cache_breakpoint": {"a": 1}}]}]},
     "input[0].content[0].prompt_cache_breakpoint"),
    ({"input": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [
        {"type": "output_text", "text": "Hello.", "input_audio": {"data": "x"}}]}]},
     "input[1].content[0].input_audio"),
    ({"tools": [{**WEATHER, "name": "bad name"}]}, "tools[0].name"),
    ({"tools": [{**WEATHER, "strict": False, "parameters": {"type": "string"}}]},
     "tools[0].parameters"),
    # found by an audit: accepted whatever it said, on any role, and dropped
    ({"input": [{"role": "user", "content": "Hi", "phase": "final_answer"}]},
     "input[0].phase"),
    ({"input": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello.",
                                                    "phase": "commentary"}]}, "input[1].phase"),
    ({"input": [{"type": "reasoning", "summary": [{"type": "summary_text"}]}]},
     "input[0].summary[0]"),
])
def test_unsupported_requests_are_a_400(client, server, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**{"model": server.model, "input": HELLO, **extra})
    assert e.value.status_code == 400
    assert e.value.body["type"] == "invalid_request_error", e.value.body
    assert e.value.body["param"] == param, e.value.body


def test_unknown_fields_are_a_400(client, server):
    for extra, param in [({"colour": "red"}, "colour"),
                         ({"input": [{"role": "user", "content": "Hi", "colour": "red"}]},
                          "input[0].colour")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=server.model, input=HELLO, extra_body=extra)
        assert param in e.value.body["message"], e.value.body


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/responses/input_tokens"])
def test_reasoning_effort_is_one_of_openais_levels(server, path):
    """Any string reached the chat template as its reasoning_effort (and the token count
    answered 500 for any reasoning at all: see the next test)."""
    r = httpx.post(server.url + path, timeout=60,
                   json={"input": HELLO, "reasoning": {"effort": "banana"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning.effort", r.text
    assert "Invalid enum value 'banana'" in r.json()["error"]["message"], r.text


def test_an_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="nope", input=HELLO)
    assert e.value.body["code"] == "model_not_found"


def test_raw_framing(server):
    r = httpx.post(server.url + "/v1/responses", timeout=60, content=json.dumps({
        "input": HELLO, "max_output_tokens": 2, "stream": True}))
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.text.startswith("event: response.created\ndata: {")


def test_a_reasoning_items_summary_is_read_when_it_has_no_content():
    """Another server's reasoning item may carry only its summary: read as the thinking, as
    its content would be (it was dropped), and an assistant's final_answer phase is taken."""
    def thinking(item):
        req = msgspec.convert({"input": [item, {"role": "assistant", "content": "Hello.",
                                                "phase": "final_answer"}]}, ResponseRequest)
        return [m.reasoning_content for m in to_chat(req).messages]

    summary = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Be kind."}]}
    content = {"type": "reasoning", "summary": [], "content": [
        {"type": "reasoning_text", "text": "Be kind."}]}
    assert thinking(summary) == thinking(content) == ["Be kind."]


def test_input_tokens_counts_what_the_response_would_bill(client, server):
    """OpenAI's POST /v1/responses/input_tokens (the SDK's responses.input_tokens.count): the
    count the response's usage.input_tokens gives for the same instructions, input and tools."""
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Hi."}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Hello.",
                                                "annotations": []}]},
             {"type": "message", "role": "user", "content": ASK}]
    for shape in ({"input": HELLO}, {"input": items, "instructions": "Be brief."},
                  {"input": ASK, "tools": [WEATHER], "tool_choice": "auto"}):
        counted = client.responses.input_tokens.count(model=server.model, **shape)
        assert counted.object == "response.input_tokens"
        billed = client.responses.create(model=server.model, max_output_tokens=1, **shape)
        assert counted.input_tokens == billed.usage.input_tokens > 3, shape
    bare = httpx.post(server.url + "/responses/input_tokens", timeout=60,  # llama-server's path
                      json={"input": HELLO}).json()
    assert bare == {"object": "response.input_tokens", "input_tokens": client.responses.
                    input_tokens.count(input=HELLO).input_tokens}
    # reasoning on the same terms as /v1/responses (it was a 500: the object went unchecked)
    plain = client.responses.input_tokens.count(model=server.model, input=HELLO).input_tokens
    for reasoning in ({"effort": "none"}, {"summary": "auto"}, {"effort": None}):
        r = httpx.post(server.url + "/v1/responses/input_tokens", timeout=60,
                       json={"input": HELLO, "reasoning": reasoning})
        assert r.status_code == 200 and r.json()["input_tokens"] == plain, (reasoning, r.text)
    for extra, param in [({"temperature": 0}, "temperature"), ({"stream": True}, "stream"),
                         ({"truncation": "auto"}, "truncation"),
                         ({"reasoning": "x"}, "reasoning"),
                         ({"reasoning": {"summary": "detailed"}}, "reasoning.summary"),
                         ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
                         ({"tools": [{**WEATHER, "name": "bad name"}]}, "tools[0].name"),
                         ({"text": {"format": {"type": "text", "name": "x"}}},
                          "text.format.name")]:
        r = httpx.post(server.url + "/v1/responses/input_tokens", timeout=60,
                       json={"input": HELLO, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(server.url + "/v1/responses/input_tokens", timeout=60,
                   json={"input": HELLO, "previous_response_id": "resp_1"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.input_tokens.count(model="nope", input=HELLO)


def test_stored_responses_and_previous_response_id(client, server):
    """OpenAI's default store: a response is kept, retrieved and deleted by id, and
    previous_response_id continues its conversation exactly as sending it whole does."""
    first = client.responses.create(model=server.model, input="My name is Ada.",
                                    instructions="Be brief.", max_output_tokens=6,
                                    temperature=0)
    assert first.store is True
    kept = client.responses.retrieve(first.id)
    assert (kept.id, kept.output_text, kept.usage.input_tokens) == (
        first.id, first.output_text, first.usage.input_tokens)
    follow = client.responses.create(model=server.model, input="What is my name?",
                                     previous_response_id=first.id, max_output_tokens=6,
                                     temperature=0)
    assert follow.previous_response_id == first.id
    # the same as the whole conversation sent (the instructions are not carried over)
    whole = client.responses.create(model=server.model, max_output_tokens=6, temperature=0,
                                    store=False, input=[
        {"role": "user", "content": "My name is Ada."}, first.output[0].model_dump(),
        {"role": "user", "content": "What is my name?"}])
    # (not compared by text: the second computes on the first's cached prefix, which moves
    # logits enough to flip a greedy near tie; the prompt is what must be the same, and the
    # prefix cache holding all of it but the last token shows it is)
    assert follow.usage.input_tokens == whole.usage.input_tokens
    cached = whole.usage.input_tokens_details.cached_tokens
    assert cached >= whole.usage.input_tokens - 1, cached
    assert client.responses.input_tokens.count(
        model=server.model, input="What is my name?",
        previous_response_id=first.id).input_tokens == whole.usage.input_tokens
    # the items it answered, as OpenAI lists them (newest first by default; pages)
    listed = list(client.responses.input_items.list(follow.id, order="asc"))
    assert [(i.type, i.role) for i in listed] == [("message", "user"),
                                                  ("message", "assistant"), ("message", "user")]
    assert listed[0].content[0].text == "My name is Ada." and listed[1].id == first.output[0].id
    assert listed[2].content[0].type == "input_text" and all(i.id for i in listed)
    newest = client.responses.input_items.list(follow.id, limit=2)
    assert [i.id for i in newest.data] == [listed[2].id, listed[1].id] and newest.has_more
    rest = client.responses.input_items.list(follow.id, limit=2, after=newest.data[-1].id)
    assert [i.id for i in rest.data] == [listed[0].id] and not rest.has_more
    for query, param in [("limit=0", "limit"), ("order=up", "order"), ("after=nope", "after")]:
        r = httpx.get(f"{server.url}/v1/responses/{follow.id}/input_items?{query}", timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    # a chain: the third continues the second, which continued the first
    third = client.responses.create(model=server.model, input="Again?", max_output_tokens=2,
                                    previous_response_id=follow.id)
    assert third.usage.input_tokens > follow.usage.input_tokens + follow.usage.output_tokens
    # store: false is not kept; a streamed response is kept once it ends
    assert whole.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(whole.id)
    events = list(client.responses.create(model=server.model, input=HELLO,
                                          max_output_tokens=3, stream=True))
    done = events[-1].response
    assert client.responses.retrieve(done.id).output_text == done.output_text
    # cancel is for background responses, which are refused here: a 400 (the route was a 404)
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.cancel(first.id)
    # deleted: gone for retrieval, cancelling and continuing
    client.responses.delete(first.id)
    for call in (lambda: client.responses.retrieve(first.id),
                 lambda: client.responses.delete(first.id),
                 lambda: client.responses.cancel(first.id),
                 lambda: client.responses.create(model=server.model, input="x",
                                                 previous_response_id=first.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    # an error in this request's input names its own index, not the joined conversation's
    r = httpx.post(server.url + "/v1/responses", timeout=60, json={
        "previous_response_id": follow.id, "max_output_tokens": 1, "input": [
            {"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].content[0]", r.text
    r = httpx.get(f"{server.url}/v1/responses/{follow.id}?stream=true", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
    # OpenAI's other query parameters of a retrieve: refused, not ignored (they were)
    for query, param in [("include=reasoning.encrypted_content", "include"),
                         ("include_obfuscation=true", "include_obfuscation"),
                         ("starting_after=2", "starting_after")]:
        r = httpx.get(f"{server.url}/v1/responses/{follow.id}?{query}", timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert client.responses.retrieve(follow.id, include_obfuscation=False).id == follow.id
    # the SDK sends a list as include[]= (which was let through: a 200 for any value)
    for call in (lambda: client.responses.retrieve(follow.id, include=["foo"]),
                 lambda: client.responses.input_items.list(follow.id, include=["foo"])):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.body["param"] == "include"


def test_the_store_is_bounded_least_recently_used_first():
    store = ResponseStore(max_responses=3, max_bytes=10_000)
    for i in range(4):
        store.put(f"r{i}", b"{}", [{"role": "user", "content": str(i)}])
    assert store.get("r0") is None and len(store) == 3  # the oldest went
    assert store.get("r1") is not None  # used: now the most recent
    store.put("r4", b"{}", [])
    assert store.get("r2") is None and store.get("r1") is not None
    store.put("big", b"x" * 9_996, [])  # past the bytes: the least recent go until it fits
    assert store.get("big") is not None and len(store) == 1
    store.put("huge", b"x" * 20_000, [])  # larger than the whole store: not kept
    assert store.get("huge") is None and store.get("big") is not None
    assert store.delete("big") and not store.delete("big") and len(store) == 0


def test_a_responses_own_tool_settings_without_tools_are_taken(client, server):
    """A Response says tool_choice "auto" and parallel_tool_calls true with no tools, and
    clients send them back (they were chat's 400s); "required" with nothing to call is not."""
    kw = dict(model=server.model, input=HELLO, max_output_tokens=4, temperature=0)
    plain = client.responses.create(**kw)
    echoed = client.responses.create(**kw, tools=[], tool_choice="auto",
                                     parallel_tool_calls=True)
    assert echoed.output_text == plain.output_text and echoed.tool_choice == "auto"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**kw, tool_choice="required")
    assert e.value.body["param"] == "tool_choice"
    # parallel_tool_calls alone, with no tools (no Response's echo: it states a tool_choice
    # too) is chat's 400, as the README says (it was taken)
    for parallel in (True, False):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(**kw, parallel_tool_calls=parallel)
        assert e.value.body["param"] == "parallel_tool_calls"


def test_a_failed_stream_keeps_what_it_had_said():
    """A stream that fails (the server shutting down) ends with response.failed, whose open
    message holds the text already streamed, incomplete (it said in_progress, no content)."""
    import asyncio

    from justllm.server.responses import _skeleton, _stream
    from justllm.server.responses_schemas import ResponseRequest
    from justllm.server.tools.answer import StreamError, TextDelta

    async def events():
        yield TextDelta(0, "", reasoning="Thinking.")
        yield TextDelta(0, "Hel")
        yield TextDelta(0, "lo")
        yield StreamError("the server is shutting down", "shutting_down")

    async def run() -> list[dict]:
        resp = _skeleton("resp_x", "m", ResponseRequest(input="hi"))
        kept = []
        frames = [f async for f in _stream(resp, events(), kept.append)]
        return [json.loads(f.split(b"\ndata: ", 1)[1]) for f in frames]

    payloads = asyncio.run(run())
    assert [p["type"] for p in payloads[-2:]] == ["error", "response.failed"]
    failed = payloads[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "shutting_down"
    thinking, message = failed["output"]
    assert thinking["status"] == "completed"
    assert message["status"] == "incomplete"
    assert message["content"][0]["text"] == "Hello"
