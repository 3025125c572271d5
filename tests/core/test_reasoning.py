"""A reasoning model's answer taken apart (core/reasoning.py): the whole reading, and the
streaming reader's pieces adding up to it however the text is cut."""

from __future__ import annotations

import random

import pytest

from justllm.core.reasoning import (
    ReasoningSplitter,
    opens_thinking,
    split_reasoning,
    thinking_tags,
)

THINK = ("<think>", "</think>")


@pytest.mark.parametrize("text, opened, reasoning, content", [
    ("<think>\nabc\n</think>\n\nhello", False, "abc", "hello"),
    ("  \n<think> a </thin b </think>x", False, "a </thin b", "x"),  # blanks before the tag
    ("hello <think>x</think>", False, None, "hello <think>x</think>"),  # not at the start
    ("<think>cut off", False, "cut off", ""),  # ended while thinking: all thinking
    ("<think>cut off\n</", False, "cut off", ""),  # but for the end tag it was cut in
    ("abc </thin", True, "abc", ""),
    ("a <", True, "a <", ""),  # (one "<" may be the thinking's own)
    ("<think></think>\n\nok", False, None, "ok"),  # an empty thinking is none
    ("<thi", False, None, "<thi"),  # a tag begun, never finished: text
    ("", False, None, ""),
    ("abc\n</think>\n\nrest", True, "abc", "rest"),  # the prompt opened it
    ("abc", True, "abc", ""),
    ("<think>abc</think>rest", True, "abc", "rest"),  # the tag written again: left out
    ("x</think>y</think>z", True, "x", "y</think>z"),  # the first end tag ends it
    ("  ", True, None, ""),
])
def test_split_reasoning(text, opened, reasoning, content):
    got = split_reasoning(text, THINK, opened)
    assert (got.reasoning, got.content) == (reasoning, content)


@pytest.mark.parametrize("tags", [THINK, ("[THINK]", "[/THINK]"),
                                  ("<|START_THINKING|>", "<|END_THINKING|>")])
def test_streamed_pieces_add_up_to_the_whole_reading(tags):
    rng = random.Random(7)
    start, end = tags
    words = ["a", " ", "\n", start, end, start[:3], end[:4], "é", "  ", "x y"]
    for _ in range(400):
        text = "".join(rng.choice(words) for _ in range(rng.randint(0, 12)))
        opened = rng.random() < 0.5
        whole = split_reasoning(text, tags, opened)
        splitter = ReasoningSplitter(tags, opened)
        thought = content = ""
        i = 0
        while i < len(text):
            n = rng.randint(1, 5)
            t, c = splitter.feed(text[i:i + n])
            thought, content = thought + t, content + c
            i += n
        t, c = splitter.finish()
        assert (thought + t or None, content + c) == (whole.reasoning, whole.content), text


def test_nothing_is_shown_that_may_still_be_a_tag_or_a_trailing_blank():
    s = ReasoningSplitter(THINK)
    assert s.feed("  <thi") == ("", "")  # may still open the thinking
    assert s.feed("nk>\nI think") == ("I think", "")
    assert s.feed(" so \n</th") == (" so", "")  # the blank and the tag's start held back
    assert s.feed("ink>\n\nYes") == ("", "Yes")
    assert s.finish() == ("", "")
    plain = ReasoningSplitter(THINK)
    assert plain.feed("Hello") == ("", "Hello")  # cannot be the tag: content at once


def test_tags_come_from_the_template_and_the_prompt():
    assert thinking_tags("{{ '<think>' }}{{ m.reasoning_content }}{{ '</think>' }}") == THINK
    assert thinking_tags("[THINK]{{ x }}[/THINK]") == ("[THINK]", "[/THINK]")
    assert thinking_tags("<start_of_turn>model\n") is None
    assert thinking_tags("only <think> opens") is None  # a pair or nothing
    assert opens_thinking("<|im_start|>assistant\n<think>\n", THINK)
    assert not opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n", THINK)
