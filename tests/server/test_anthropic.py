"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) through the real
``anthropic`` client and raw httpx, against a real ``justllm serve``: whole and streamed
messages (the SDK assembles the final message from the events), stop reasons, token counts,
errors in Anthropic's shape, ``x-api-key``, and a tool_use round trip."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from tests.server.conftest import start_server

KEY = "anthropic-test-key"
GREEDY = {"temperature": 0}  # the SDK has no temperature argument: sent as extra_body
HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", timeout=120,
                               max_retries=0)


def raw(server, path: str, body: object, **headers: str) -> httpx.Response:
    return httpx.post(server.url + path, content=json.dumps(body), timeout=120,
                      headers={"content-type": "application/json", **headers})


def test_a_message(client, server):
    m = client.messages.create(model=server.model, max_tokens=8, system="Be brief.",
                               messages=HELLO, extra_body=GREEDY)
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant"
    assert m.model == server.model
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    assert 1 <= m.usage.output_tokens <= 8 and m.usage.input_tokens > 5


def test_max_tokens_stops_with_max_tokens(client, server):
    m = client.messages.create(model=server.model, max_tokens=3, extra_body=GREEDY,
                               messages=[{"role": "user", "content": "Tell me a long story."}])
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3


def test_a_stop_sequence_is_reported(client, server):
    stops = ["e", "a", "o", " "]
    m = client.messages.create(model=server.model, max_tokens=40, stop_sequences=stops,
                               extra_body=GREEDY,
                               messages=[{"role": "user", "content": "Tell me a long story."}])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence in stops
    assert not any(s in m.content[0].text for s in stops)  # the stop itself is not shown
    whole = client.messages.create(model=server.model, max_tokens=40, extra_body=GREEDY,
                                   messages=[{"role": "user", "content": "Tell me a long story."}])
    assert whole.content[0].text.startswith(m.content[0].text + m.stop_sequence)
    with client.messages.stream(model=server.model, max_tokens=40, stop_sequences=stops,
                                extra_body=GREEDY, messages=[
                                    {"role": "user", "content": "Tell me a long story."}]) as s:
        streamed = s.get_final_message()
    assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", m.stop_sequence)
    assert streamed.content[0].text == m.content[0].text


def test_an_answer_that_says_nothing_has_no_blocks(client, server):
    """As Anthropic answers a turn that says nothing: ``content: []``, no block streamed (an
    empty or blank text block was refused when an agent loop sent it back)."""
    ask = [{"role": "user", "content": "Tell me a long story."}]
    first = client.messages.create(model=server.model, max_tokens=4, extra_body=GREEDY,
                                   messages=ask).content[0].text
    stop = [first.strip()[0]]  # the answer stops before its first letter: nothing is said
    m = client.messages.create(model=server.model, max_tokens=8, stop_sequences=stop,
                               extra_body=GREEDY, messages=ask)
    assert (m.stop_reason, m.stop_sequence, m.content) == ("stop_sequence", stop[0], [])
    with client.messages.stream(model=server.model, max_tokens=8, stop_sequences=stop,
                                extra_body=GREEDY, messages=ask) as s:
        kinds = [e.type for e in s]
        streamed = s.get_final_message()
    assert streamed.content == [] and "content_block_start" not in kinds
    assert kinds[-1] == "message_stop"


def test_system_blocks_and_a_conversation(client, server):
    m = client.messages.create(
        model=server.model, max_tokens=4, extra_body=GREEDY,
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hi."},
                                               {"type": "text", "text": " Who are you?"}]},
                  {"role": "assistant", "content": "A model."},
                  {"role": "user", "content": "Say more."},
                  {"role": "user", "content": "Please."}])  # combined with the turn before
    assert m.content[0].text and m.usage.output_tokens <= 4


def test_streaming_assembles_the_message(client, server):
    with client.messages.stream(model=server.model, max_tokens=8, messages=HELLO,
                                extra_body=GREEDY) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    whole = client.messages.create(model=server.model, max_tokens=8, messages=HELLO,
                                   extra_body=GREEDY)
    assert final.content[0].text == "".join(pieces) == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_the_event_sequence(client, server):
    events = list(client.messages.create(model=server.model, max_tokens=5, messages=HELLO,
                                         stream=True, extra_body=GREEDY))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    body = [k for k in kinds[1:-2] if k != "ping"]
    assert body[0] == "content_block_start" and body[-1] == "content_block_stop"
    assert set(body[1:-1]) == {"content_block_delta"}
    start = events[0].message
    assert start.content == [] and start.stop_reason is None and start.usage.input_tokens > 5
    # the count of the prompt queued: what count_tokens says of it
    assert start.usage.input_tokens == client.messages.count_tokens(
        model=server.model, messages=HELLO).input_tokens
    assert all(e.delta.type == "text_delta" for e in events if e.type == "content_block_delta")
    delta = events[-2]
    assert delta.delta.stop_reason in ("end_turn", "max_tokens")
    assert 1 <= delta.usage.output_tokens <= 5
    r = httpx.post(server.url + "/v1/messages", timeout=60, json={
        "model": server.model, "max_tokens": 2, "stream": True, "messages": HELLO})
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.text.startswith("event: message_start\ndata: {")


def test_count_tokens_is_what_a_message_reports(client, server):
    kw = {"model": server.model, "system": "Be brief.",
          "messages": [{"role": "user", "content": "Count these tokens, please."}]}
    count = client.messages.count_tokens(**kw)
    m = client.messages.create(max_tokens=1, **kw)
    assert count.input_tokens == m.usage.input_tokens > 5


# ---- errors ----------------------------------------------------------------------------------

def assert_anthropic_error(r: httpx.Response, status: int, kind: str, says: str = "") -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert body["error"]["type"] == kind and says in body["error"]["message"], body


def test_an_unknown_model_is_not_found(client, server):
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="nope", max_tokens=4, messages=HELLO)
    assert e.value.status_code == 404 and e.value.body["error"]["type"] == "not_found_error"
    assert_anthropic_error(raw(server, "/v1/messages/count_tokens",
                               {"model": "nope", "messages": HELLO}), 404, "not_found_error")


def test_a_missing_max_tokens_is_a_bad_request(client, server):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.post("/v1/messages", body={"model": server.model, "messages": HELLO},
                    cast_to=anthropic.types.Message)
    assert e.value.status_code == 400
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in e.value.body["error"]["message"]


@pytest.mark.parametrize("extra, says", [
    # (thinking is allowed, and this model thinks within any budget: see test_reasoning.py)
    ({"thinking": {"type": "enabled", "budget_tokens": 1000}}, "at least 1024"),
    ({"thinking": {"type": "enabled"}}, "budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}, "max_tokens": 1024},
     "greater than"),
    ({"thinking": {"type": "sometimes"}}, "thinking.type"),
    ({"messages": [{"role": "user", "content": [{"type": "thinking", "thinking": "hm",
                                                 "signature": ""}]}]}, "assistant turns"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [
        {"type": "redacted_thinking", "data": "abc"}, {"type": "text", "text": "A"}]},
                   {"role": "user", "content": "Go on"}]}, "redacted"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}, "max_tokens": 2000,
      "tools": [{"name": "f", "input_schema": {"type": "object"}}],
      "tool_choice": {"type": "any"}}, "forces tool use"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]}, "images"),
    ({"messages": [{"role": "user", "content": "Hi"},  # Anthropic's rule for a prefill
                   {"role": "assistant", "content": "The answer is "}]}, "trailing whitespace"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_a", "name": "f", "input": {}}]}],
      "tools": [{"name": "f", "input_schema": {"type": "object"}}],
      "tool_choice": {"type": "none"}}, "text blocks only"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "A"}],
      "tools": [{"name": "f", "input_schema": {"type": "object"}}]},
     "cannot be combined with tools"),
    ({"messages": []}, "messages"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"top_k": -1}, "top_k"),
    ({"temperature": -1}, "temperature"),
    ({"stop_sequences": ["x"] * 17}, "stop"),
    ({"metadata": {"user_id": "u" * 257}}, "length <= 256"),  # Anthropic's limit (was taken)
    ({"colour": "red"}, "colour"),
    ({"messages": [{"role": "user", "content": "Hi", "colour": "red"}]}, "colour"),
    ({"messages": [{"role": "system", "content": "Hi"}]}, "role"),
    ({"output_config": {"effort": "high"}}, "effort"),
    # Anthropic's effort levels only (any string reached the chat template)
    ({"output_config": {"effort": "banana"}}, "output_config.effort: Invalid enum value"),
    ({"output_config": {"effort": "none"}}, "output_config.effort: Invalid enum value"),
    # Anthropic refuses these too (they were accepted):
    ({"temperature": 1.5}, "temperature"),
    ({"messages": [{"role": "user", "content": ""}]}, "content"),
    ({"messages": [{"role": "user", "content": []}]}, "content"),
    ({"tools": [{"name": "f"}]}, "input_schema"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_nowhere", "content": "42"}]}]},
     "toolu_nowhere"),
    # found by an audit: accepted (the first ambiguous; the second Anthropic's rule)
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "  "}]}]},
     "text content blocks must contain non-whitespace text"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}},
        {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]},
                   {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "1"},
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "2"}]}],
      "tools": [{"name": "f", "input_schema": {"type": "object"}}]},
     "ids must be unique: toolu_1"),
])
def test_bad_requests_get_anthropics_error_shape(server, extra, says):
    body = {"model": server.model, "max_tokens": 4, "messages": HELLO, **extra}
    assert_anthropic_error(raw(server, "/v1/messages", body), 400, "invalid_request_error", says)


def test_a_prefilled_assistant_turn_is_continued(client, server):
    """Anthropic's prefill: the answer goes on from the last assistant message and holds only
    the new text (it was refused)."""
    msgs = [{"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": [{"type": "text", "text": "The capital"},
                                              {"type": "text", "text": " of France is"}]}]
    m = client.messages.create(model=server.model, max_tokens=6, messages=msgs,
                               extra_body=GREEDY)
    said = m.content[0].text
    assert "Paris" in said and not said.lstrip().startswith("The capital"), said
    assert client.messages.count_tokens(model=server.model, messages=msgs).input_tokens == \
        m.usage.input_tokens
    with client.messages.stream(model=server.model, max_tokens=6, messages=msgs,
                                extra_body=GREEDY) as stream:
        assert "".join(stream.text_stream) == said


def test_a_body_that_is_not_json_is_a_bad_request(server):
    r = httpx.post(server.url + "/v1/messages", content=b"{not json", timeout=30)
    assert_anthropic_error(r, 400, "invalid_request_error")


# ---- the API key -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def keyed(model_path):
    s = start_server(model_path, "--max-seqs", "2", "--pool-blocks", "64",
                     "--chat-template", "gemma", "--api-key", KEY)
    yield s
    assert s.stop() == 0


def test_x_api_key_and_bearer_are_both_accepted(keyed):
    for c in (anthropic.Anthropic(base_url=keyed.url, api_key=KEY, max_retries=0),
              anthropic.Anthropic(base_url=keyed.url, auth_token=KEY, max_retries=0)):
        assert c.messages.create(model=keyed.model, max_tokens=1, messages=HELLO).content
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=keyed.url, api_key="wrong", max_retries=0).messages.create(
            model=keyed.model, max_tokens=1, messages=HELLO)
    assert e.value.body["error"]["type"] == "authentication_error"
    assert_anthropic_error(raw(keyed, "/v1/messages/count_tokens",
                               {"model": keyed.model, "messages": HELLO}),
                           401, "authentication_error")
    ok = httpx.get(keyed.url + "/v1/models", headers={"x-api-key": KEY}, timeout=30)
    assert ok.status_code == 200  # x-api-key opens every route the key guards


# ---- tools -----------------------------------------------------------------------------------

WEATHER = {"name": "get_weather", "description": "Get the current weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_a_tool_use_round_trip(client, server):
    """A named tool_choice makes even the tiny base model call the tool (a grammar holds it to
    the schema); the call goes back with its tool_result, which the next prompt carries."""
    m = client.messages.create(model=server.model, max_tokens=60, tools=[WEATHER],
                               tool_choice={"type": "tool", "name": "get_weather"},
                               messages=ASK, extra_body=GREEDY)
    assert m.stop_reason == "tool_use"
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather" and isinstance(use.input["city"], str)
    assert use.id.startswith("toolu_")  # Anthropic's ids (the chat side's are call_...)
    history = [*ASK, {"role": "assistant", "content": m.content}]

    def turn(result: str) -> list:
        return [*history, {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": use.id, "content": result}]}]

    answer = client.messages.create(model=server.model, max_tokens=4, tools=[WEATHER],
                                    messages=turn("Sunny, 21 C"), extra_body=GREEDY)
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    short = client.messages.count_tokens(model=server.model, tools=[WEATHER],
                                         messages=turn("Sunny"))
    long = client.messages.count_tokens(model=server.model, tools=[WEATHER],
                                        messages=turn("Sunny, 21 C, a light breeze from the west"))
    assert long.input_tokens > short.input_tokens  # the result is in the prompt
    assert answer.usage.input_tokens > m.usage.input_tokens
    error = client.messages.count_tokens(model=server.model, tools=[WEATHER], messages=[
        *history, {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": use.id, "content": "Sunny", "is_error": True},
            {"type": "text", "text": "Thanks."}]}])
    assert error.input_tokens > short.input_tokens


def test_a_streamed_tool_use(client, server):
    with client.messages.stream(model=server.model, max_tokens=60, tools=[WEATHER],
                                tool_choice={"type": "any"}, messages=ASK,
                                extra_body=GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events if e.type.startswith("content_block")]
    assert kinds[0] == "content_block_start" and kinds[-1] == "content_block_stop"
    starts = [e for e in events if e.type == "content_block_start"]
    assert starts[-1].content_block.type == "tool_use" and starts[-1].content_block.input == {}
    pieces = [e.delta.partial_json for e in events
              if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
    assert json.loads("".join(pieces)) == final.content[-1].input
    assert len(pieces) > 3  # the grammar holds the call: its input streams as it is written
    eager = {**WEATHER, "eager_input_streaming": True}  # (what it asks: it was a 400)
    with client.messages.stream(model=server.model, max_tokens=60, tools=[eager],
                                tool_choice={"type": "any"}, messages=ASK,
                                extra_body=GREEDY) as again:
        assert again.get_final_message().content[-1].input == final.content[-1].input
    assert final.stop_reason == "tool_use" and final.content[-1].name == "get_weather"
    assert starts[-1].content_block.id == final.content[-1].id
    assert final.content[-1].id.startswith("toolu_")
    assert isinstance(final.content[-1].input["city"], str)


def test_a_tool_use_cut_off_by_max_tokens_keeps_what_is_complete_of_its_input(client,
                                                                             server):
    kw = dict(model=server.model, tools=[WEATHER], tool_choice={"type": "any"}, messages=ASK,
              extra_body=GREEDY)
    whole = client.messages.create(max_tokens=60, **kw)
    unit = {**WEATHER, "input_schema": {**WEATHER["input_schema"], "properties": {
        "city": {"type": "string"}, "unit": {"type": "string"}}, "required": ["city", "unit"]}}
    both = client.messages.create(**{**kw, "tools": [unit]}, max_tokens=60)
    assert set(both.content[-1].input) == {"city", "unit"}, both
    for limit in range(both.usage.output_tokens - 1, 3, -1):  # until the unit is cut off
        cut = client.messages.create(**{**kw, "tools": [unit]}, max_tokens=limit)
        if cut.stop_reason == "max_tokens" and "unit" not in cut.content[-1].input:
            break
    assert cut.stop_reason == "max_tokens" and cut.content[-1].type == "tool_use"
    # (an object: what is complete of it, the city unless that was cut off too)
    assert set(cut.content[-1].input) <= {"city"}, cut
    assert all(isinstance(v, str) for v in cut.content[-1].input.values()), cut
    assert whole.stop_reason == "tool_use"


def test_a_format_with_tools_is_a_tool_use_or_text_in_the_format(client, server):
    """output_config.format with tools under tool_choice auto (it was a 400): here the model
    answers, in the format."""
    answer = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 30}},
              "required": ["answer"], "additionalProperties": False}
    shots = [m for q, a in (("Say hi.", "Hi!"), ("Say bye.", "Bye!")) for m in (
        {"role": "user", "content": q},
        {"role": "assistant", "content": json.dumps({"answer": a})})]
    m = client.messages.create(model=server.model, max_tokens=40, tools=[WEATHER],
                               messages=[*shots, {"role": "user", "content": "Say hello."}],
                               extra_body={**GREEDY, "output_config": {"format": {
                                   "type": "json_schema", "schema": answer}}})
    assert m.stop_reason == "end_turn" and [b.type for b in m.content] == ["text"]
    assert json.loads(m.content[0].text)["answer"]


def test_tool_choice_none_and_bad_tools(client, server):
    m = client.messages.create(model=server.model, max_tokens=3, tools=[WEATHER],
                               tool_choice={"type": "none"}, messages=ASK)
    assert m.stop_reason in ("end_turn", "max_tokens")
    for extra, says in [
            ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tools"),
            ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
            ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
            ({"messages": [{"role": "user", "content": [
                {"type": "tool_use", "id": "x", "name": "get_weather", "input": {}}]}]},
             "assistant")]:
        body = {"model": server.model, "max_tokens": 4, "messages": ASK, **extra}
        assert_anthropic_error(raw(server, "/v1/messages", body), 400, "invalid_request_error",
                               says)


def test_models_list_and_retrieve_in_anthropics_shape(client, server):
    """The Anthropic SDK's models.list()/retrieve() got OpenAI's cards: no type, display_name
    or created_at (``m.created_at.isoformat()`` raised)."""
    page = client.models.list()
    ids = [m.id for m in page.data]
    assert ids[0] == server.model and page.has_more is False
    m = client.models.retrieve(server.model)
    assert m.type == "model" and m.display_name == server.model and m.created_at.year >= 2025
    assert client.models.list(limit=1).data[0].id == server.model
    r = httpx.get(server.url + "/v1/models?limit=0", headers={"anthropic-version": "2023-06-01"},
                  timeout=30)
    assert r.status_code == 400
    r = httpx.get(server.url + "/v1/models", timeout=30).json()  # OpenAI's, without the header
    assert r["object"] == "list" and r["data"][0]["object"] == "model"


def test_anthropics_model_pages():
    from justllm.server.model_cards import anthropic_page

    cards = [{"id": name, "created": 0} for name in "abcde"]

    def ids(**query):
        page = anthropic_page({k: str(v) for k, v in query.items()}, cards)
        return [m["id"] for m in page["data"]], page["has_more"], page["first_id"]

    assert ids() == (list("abcde"), False, "a")
    assert ids(limit=2) == (["a", "b"], True, "a")
    assert ids(limit=2, after_id="b") == (["c", "d"], True, "c")
    assert ids(limit=2, after_id="c") == (["d", "e"], False, "d")
    assert ids(limit=2, before_id="d") == (["b", "c"], True, "b")
    assert ids(limit=5, before_id="c") == (["a", "b"], False, "a")
    for bad in ({"limit": "x"}, {"limit": "1001"}, {"after_id": "zz"}):
        with pytest.raises(Exception, match="limit|after_id"):
            anthropic_page(bad, cards)


# ---- the review's defects: Anthropic's own rules and names -----------------------------------

USE = {"type": "tool_use", "id": "toolu_a", "name": "get_weather", "input": {"city": "Paris"}}
USE_B = {**USE, "id": "toolu_b"}


def _result(use_id: str) -> dict:
    return {"type": "tool_result", "tool_use_id": use_id, "content": "Sunny"}


def _history(*turns: list) -> list:
    roles = ["user", "assistant"]
    return [{"role": roles[k % 2], "content": c} for k, c in enumerate(turns)]


MULTIPLE = {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 1000}},
           "required": ["n"]}


@pytest.mark.parametrize("extra, says", [
    # structured output is always strict: what the grammar cannot enforce is refused
    ({"output_config": {"format": {"type": "json_schema", "schema": MULTIPLE}}},
     "output_config.format.schema: structured output follows its schema exactly, but the "
     "output grammar cannot enforce #/properties/n: multipleOf"),
    # a strict tool too, named as Anthropic names it
    ({"tools": [{**WEATHER, "strict": True, "input_schema": MULTIPLE}]},
     "tools[0].input_schema: strict is true, but the output grammar cannot enforce "
     "#/properties/n: multipleOf"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]},
     "messages[0].content[0].text: text content blocks must be non-empty"),
    ({"system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": ""}]},
     "system[1].text: text content blocks must be non-empty"),
    ({"tools": [WEATHER], "messages": _history(ASK[0]["content"], [USE], "Thanks.")},
     "`tool_use` ids were found without `tool_result` blocks immediately after: toolu_a"),
    ({"tools": [WEATHER], "messages": _history(
        ASK[0]["content"], [USE, USE_B], [_result("toolu_a")])},
     "immediately after: toolu_b"),
    ({"tools": [WEATHER], "messages": _history(
        ASK[0]["content"], [USE], [_result("toolu_a")], "Sure.", [_result("toolu_a")])},
     "unexpected tool_use_id 'toolu_a'"),
    ({"messages": _history(ASK[0]["content"], [USE], [_result("toolu_a")])},
     "requests which include `tool_use` or `tool_result` blocks must define tools"),
    # Anthropic's order in the turn that answers: the results first (both were taken)
    ({"tools": [WEATHER], "messages": _history(
        ASK[0]["content"], [USE], [{"type": "text", "text": "Here:"}, _result("toolu_a")])},
     "messages[2].content[0]: in the user turn that answers `tool_use` blocks, the "
     "`tool_result` blocks come first"),
    ({"tools": [WEATHER], "messages": _history(
        ASK[0]["content"], [USE], [_result("toolu_a"), _result("toolu_a")])},
     "a second tool_result block for 'toolu_a'"),
    # Anthropic's pattern for a tool_use id (taken)
    ({"tools": [WEATHER], "messages": _history(
        ASK[0]["content"], [{**USE, "id": "toolu a!"}], [_result("toolu a!")])},
     "matching regex '^[a-zA-Z0-9_-]+$'"),
    ({"stop_sequences": [""]}, "stop_sequences: stop sequences must be non-empty strings"),
    ({"stop_sequences": ["x"] * 17}, "stop_sequences: at most 16"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].name: tool names must be unique"),
    ({"tools": [WEATHER, {**WEATHER, "name": "bad name"}]}, "tools[1].name: a tool name"),
    ({"tools": [{**WEATHER, "input_schema": {"type": "string"}}]}, "tools[0].input_schema"),
    ({"tools": [WEATHER], "tool_choice": {"type": "any"},
      "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
     "output_config.format: structured output cannot be combined with a forced tool call"),
    # the chat side's refusals, named as Anthropic names the field (they named
    # reasoning_effort, or no field at all)
    ({"output_config": {"effort": "high"}},
     "output_config.effort: this model's chat template cannot take a reasoning effort"),
    ({"stop_sequences": ["x" * 1001]},
     "stop_sequences: a stop string has at most 1000 characters"),
    # a field of another block type on a block (each was accepted and ignored)
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi",
                                                 "is_error": True}]}]},
     "messages[0].content[0].is_error: a text block has no 'is_error'"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi", "title": "x"}]}]},
     "messages[0].content[0].title: a text block has no 'title'"),
    ({"system": [{"type": "text", "text": "Be brief.", "source": {"a": 1}}]},
     "system[0].source: a text block has no 'source'"),
    ({"tools": [WEATHER], "messages": _history(
        ASK[0]["content"], [{**USE, "text": "x"}], [_result("toolu_a")])},
     "messages[1].content[0].text: a tool_use block has no 'text'"),
    ({"tools": [WEATHER], "messages": _history(
        ASK[0]["content"], [USE], [{**_result("toolu_a"), "text": "x"}])},
     "messages[2].content[0].text: a tool_result block has no 'text'"),
    ({"tools": [WEATHER], "messages": _history(
        ASK[0]["content"], [USE], [{**_result("toolu_a"), "title": "x"}])},
     "messages[2].content[0].title: a tool_result block has no 'title'"),
    ({"tools": [WEATHER], "messages": _history(
        ASK[0]["content"], [USE], [{**_result("toolu_a"), "content": [
            {"type": "text", "text": "Sunny", "is_error": True}]}])},
     "messages[2].content[0].content[0].is_error: a text block has no 'is_error'"),
    ({"messages": _history("Hi", [{"type": "thinking", "thinking": "hm", "signature": "",
                                   "text": "x"}, {"type": "text", "text": "A"}], "Go on")},
     "messages[1].content[0].text: a thinking block has no 'text'"),
])
def test_anthropics_rules_and_names(server, extra, says):
    """Each was accepted (or refused naming OpenAI's fields: ``stop``,
    ``tools[1].function.name``, ``tools[0].function.parameters``)."""
    body = {"model": server.model, "max_tokens": 4, "messages": HELLO, **extra}
    r = raw(server, "/v1/messages", body)
    assert_anthropic_error(r, 400, "invalid_request_error", says)
    assert "function" not in r.json()["error"]["message"]
    if "stop_sequences" not in extra:  # the prompt's rules hold for a token count too
        del body["max_tokens"]
        assert_anthropic_error(raw(server, "/v1/messages/count_tokens", body), 400,
                               "invalid_request_error", says)


BAD_SCHEMA = {"type": "object", "properties": {"n": {"type": "no such type"}}}


@pytest.mark.parametrize("extra, says", [
    ({"output_config": {"format": {"type": "json_schema", "schema": BAD_SCHEMA}}},
     "output_config.format.schema: not a valid JSON schema"),
    ({"tools": [WEATHER, {**WEATHER, "name": "bad", "input_schema": BAD_SCHEMA}],
      "tool_choice": {"type": "any"}}, "tools[1].input_schema: not a valid JSON schema"),
    ({"tools": [WEATHER, {**WEATHER, "name": "bad", "input_schema": BAD_SCHEMA}],
      "tool_choice": {"type": "tool", "name": "bad"}},
     "tools[1].input_schema: not a valid JSON schema"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_the_grammar_cannot_take_is_named(server, extra, says, stream):
    """The output grammar's refusal (the chat side's, when it builds the grammar) named no
    field ("unsupported JSON schema: ..."); a streamed request is refused before its stream."""
    body = {"model": server.model, "max_tokens": 4, "messages": HELLO, "stream": stream,
            **extra}
    r = raw(server, "/v1/messages", body)
    assert_anthropic_error(r, 400, "invalid_request_error", says)
    assert r.json()["error"]["message"].startswith(says)


def test_tool_results_may_span_the_next_turn(client, server):
    """The user turn after the calls answers each, over consecutive user messages (one turn,
    as Anthropic combines them); a strict tool without unenforced keywords is taken."""
    count = client.messages.count_tokens(
        model=server.model, tools=[{**WEATHER, "strict": True}],
        messages=[*ASK, {"role": "assistant", "content": [USE, USE_B]},
                  {"role": "user", "content": [_result("toolu_b")]},
                  {"role": "user", "content": [_result("toolu_a"), {"type": "text",
                                                                    "text": "And?"}]}])
    assert count.input_tokens > 5


def test_structured_output_without_unenforced_keywords(client, server):
    m = client.messages.create(
        model=server.model, max_tokens=6, messages=HELLO, extra_body={
            **GREEDY, "output_config": {"format": {"type": "json_schema", "schema": {
                "type": "object", "properties": {"n": {"type": "integer"}},
                "required": ["n"]}}}})
    assert m.content[0].text.lstrip().startswith("{")


def test_tool_use_ids_round_trip():
    from justllm.server.anthropic import tool_use_id
    from justllm.server.anthropic_chat import _chat_id

    assert tool_use_id("call_0123456789abcdef01234567") == "toolu_0123456789abcdef01234567"
    assert tool_use_id("toolu_x") == "toolu_x"
    # a Mistral-format template's 9 letters and digits come back to the chat side whole
    assert tool_use_id("a1B2c3D4e") == "toolu_a1B2c3D4e"
    assert _chat_id("toolu_a1B2c3D4e") == "a1B2c3D4e"
    assert _chat_id("toolu_0123456789abcdef01234567") == "toolu_0123456789abcdef01234567"
