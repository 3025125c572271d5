"""The harmony reading (gpt-oss's answers) as pure logic: whole and streamed at every split
agree, with or without the ``<|end|>`` a detokenizer leaves out; calls, other roles, plain
text, the thinking kept in the text; and the server's reading of calls (HarmonyText)."""

from __future__ import annotations

import pytest

from justllm.core.harmony import HarmonyReader, Reading
from justllm.server.tools.harmony_text import HarmonyText
from justllm.server.tools.stream import CallOpened

ANSWER = ("<|channel|>analysis<|message|>The user asks. <Rome> it is.  <|end|>"
          "<|start|>assistant<|channel|>final<|message|> Rome is the capital.\n")
CALL = ("<|channel|>analysis<|message|>Need the weather.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.weather <|constrain|>json"
        '<|message|>{"city": "Paris"}')


def read(text: str, cuts: list[int] | None = None, keep: bool = False
         ) -> tuple[str, str, Reading]:
    reader = HarmonyReader(keep)
    thought = content = ""
    bounds = [0, *(cuts or []), len(text)]
    for a, b in zip(bounds, bounds[1:]):
        t, c = reader.feed(text[a:b])
        thought, content = thought + t, content + c
    t, c = reader.finish()
    return thought + t, content + c, reader.reading


@pytest.mark.parametrize("text", [ANSWER, CALL, ANSWER.replace("<|end|>", ""),
                                  "Just text, <b>no</b> format.", "  to=functions.f<|channel|>"
                                  "commentary json<|message|>{}"])
def test_every_split_reads_as_the_whole(text):
    whole = read(text)
    assert whole[:2] == (whole[2].thinking, whole[2].content)
    for cut in range(len(text) + 1):
        assert read(text, [cut]) == whole, cut
    assert read(text, list(range(1, len(text)))) == whole  # a character at a time


def test_the_channels():
    thought, content, reading = read(ANSWER)
    assert (thought, content) == ("The user asks. <Rome> it is.", "Rome is the capital.")
    assert not reading.calls and not reading.plain
    # a detokenizer without special tokens leaves <|end|> out: the next header ends a body
    assert read(ANSWER.replace("<|end|>", ""))[:2] == (thought, content)
    _, _, reading = read(CALL)
    assert [(c.recipient, c.body) for c in reading.calls] == [
        ("functions.weather", '{"city": "Paris"}')]
    # the recipient in the role's part of the header, and a preamble (commentary, no
    # recipient) that is content
    text = ("<|channel|>commentary<|message|>Let me look.<|end|><|start|>assistant "
            "to=functions.weather<|channel|>commentary json<|message|>{}<|call|>")
    _, content, reading = read(text)
    assert content == "Let me look." and reading.calls[0].recipient == "functions.weather"


def test_bodies_of_a_kind_are_joined_and_other_roles_end_the_answer():
    text = ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis"
            "<|message|>b<|end|><|start|>assistant<|channel|>final<|message|>c<|end|>"
            "<|start|>user<|message|>not the assistant's<|end|><|start|>assistant"
            "<|channel|>final<|message|>nor this")
    assert read(text)[:2] == ("a\n\nb", "c")


def test_plain_text_and_text_that_may_still_be_a_header():
    reader = HarmonyReader()
    assert reader.feed("  <|chan") == ("", "")  # may still be a header
    assert reader.feed("nel|>final<|message|>Hi <|") == ("", "Hi")  # "<|" may be a marker
    assert reader.feed("x") == ("", " <|x")
    assert read("to be or not")[1:] == ("to be or not", Reading(content="to be or not",
                                                                plain=True))


def test_the_thinking_kept_in_the_text():
    thought, content, _ = read(ANSWER, keep=True)
    assert thought == ""
    assert content == ("<|channel|>analysis<|message|>The user asks. <Rome> it is.<|end|>"
                       "Rome is the capital.")
    assert read(ANSWER, [20, 60], keep=True)[1] == content


def calls_of(text: str, **kw) -> tuple[str, str, tuple]:
    answer = HarmonyText(**kw)
    thought, content = answer.feed(text)
    more, rest, calls, cut = answer.finish()
    assert not cut
    return thought + more, content + rest, tuple((c.name, c.arguments) for c in calls)


def streamed_calls(text: str, cuts: list[int], held: bool = True
                   ) -> tuple[str, str, list[tuple[str, str]], bool, list[tuple[str, str]]]:
    """``text`` fed in pieces (``held``: a grammar held it): the thinking, the content, the
    calls its deltas add up to, whether it was cut off, and the calls ``finish`` gives."""
    answer = HarmonyText(calls=True, names=frozenset({"weather", "time"}))
    thought = content = ""
    streamed: list[list[str]] = []
    bounds = [0, *cuts, len(text)]
    for a, b in zip(bounds, bounds[1:]):
        t, c = answer.feed(text[a:b], held)
        thought, content = thought + t, content + c
        for d in answer.deltas():
            if isinstance(d, CallOpened):
                streamed.append([d.name, ""])
            else:
                streamed[d.call_index][1] += d.arguments
    more, rest, calls, cut = answer.finish()
    for d in answer.deltas():
        if isinstance(d, CallOpened):
            streamed.append([d.name, ""])
        else:
            streamed[d.call_index][1] += d.arguments
    return (thought + more, content + rest, [(n, a) for n, a in streamed], cut,
            [(c.name, c.arguments) for c in calls])


def test_a_held_call_streams_as_it_is_written():
    """A call a grammar holds opens at its recipient and its arguments come as they are
    written, at any split adding up to the whole answer's; cut off inside its arguments it
    stands as far as it came; a call no grammar held comes whole at the end."""
    text = CALL.replace('{"city": "Paris"}', '{"city": "Paris", "days": [1, 2.50]}')
    want = [("weather", '{"city": "Paris", "days": [1, 2.5]}')]
    for cut in range(len(text) + 1):
        thought, content, streamed, was_cut, calls = streamed_calls(text, [cut])
        assert (thought, content, streamed, was_cut, calls) == (
            "Need the weather.", "", want, False, want), cut
    answer = HarmonyText(calls=True, names=frozenset({"weather"}))
    answer.feed(text[:text.index('"Paris"') + 3], held=True)
    assert [type(d).__name__ for d in answer.deltas()] == ["CallOpened", "CallPiece"]
    answer = HarmonyText(calls=True, names=frozenset({"weather"}))
    answer.feed(text[:text.index('"Paris"') + 3], held=False)
    assert answer.deltas() == []  # (free: whole at the end)
    # cut off inside the arguments (max_tokens): the call as far as it came
    start = text.index("<|message|>{") + len("<|message|>")
    for end in range(start + 1, len(text)):
        _, content, streamed, was_cut, calls = streamed_calls(text[:end], [end - 1])
        assert was_cut and content == "" and streamed == calls, end
        assert want[0][1].startswith(calls[0][1]) and calls[0][0] == "weather"
    # not held: the same cut text is content, as before
    _, content, streamed, was_cut, calls = streamed_calls(text[:start + 5], [], held=False)
    assert (content, streamed, was_cut, calls) == (text[start:start + 5], [], False, [])


def test_calls_as_the_server_reads_them():
    names = frozenset({"weather", "time"})
    assert calls_of(CALL, calls=True, names=names) == (
        "Need the weather.", "", (("weather", '{"city": "Paris"}'),))
    # not offered, not a function, or arguments that are no object: the body is content
    for bad in (CALL.replace("weather", "news"), CALL.replace("functions.", "browser."),
                CALL.replace('{"city": "Paris"}', '{"city": ')):
        _, content, calls = calls_of(bad, calls=True, names=names)
        assert not calls and content == bad[bad.rindex("<|message|>") + 11:].strip()
    # no tools on offer: the addressed message is dropped (llama.cpp's reading)
    assert calls_of(CALL, calls=False) == ("Need the weather.", "", ())
    two = CALL + ('<|start|>assistant<|channel|>commentary to=functions.time<|message|>{}')
    assert len(calls_of(two, calls=True, names=names)[2]) == 2
    assert calls_of(two, calls=True, names=names, parallel=False)[2] == (
        ("weather", '{"city": "Paris"}'),)
    # an answer a grammar held to a call's JSON: the generic format's call
    plain = '{"name": "time", "arguments": {}}'
    assert calls_of(plain, calls=True, names=names) == ("", "", (("time", "{}"),))


def test_a_held_call_after_a_bodiless_message_is_read_whole_not_cut():
    """A message to another recipient with no body gives no text: a held call after it was
    paired with it by position at the end, read as cut off, and the whole call lost."""
    text = ("<|channel|>commentary to=browser.search<|message|><|call|>"
            + CALL[CALL.index("<|start|>"):])
    _, _, streamed, was_cut, calls = streamed_calls(text, [len(text) // 2])
    assert (was_cut, calls) == (False, [("weather", '{"city": "Paris"}')])
    assert streamed == calls  # (whole at the end: it did not lead the reading's calls)
