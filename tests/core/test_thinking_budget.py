"""The thinking budget's state machine (core/thinking_budget.py): what it forces, and when,
from the text of the tokens a request emits."""

from __future__ import annotations

import pytest

from justllm.core.thinking_budget import ThinkingBudget

THINK = ("<think>", "</think>")
CLOSING = [901, 902, 903]  # stand-ins for the tokens of "\n</think>\n\n"


def run(budget: ThinkingBudget, pieces: list[bytes]) -> list[int | None]:
    """What the budget forced before each piece (which is emitted when nothing is)."""
    seen = []
    for piece in pieces:
        forced = budget.forced()
        seen.append(forced)
        budget.accept(forced if forced is not None else 1, b"" if forced else piece)
    return seen


def test_an_opened_thinking_is_closed_after_the_budget():
    b = ThinkingBudget(THINK, 3, CLOSING, opened=True)
    got = run(b, [b"a", b"b", b"c", b"", b"", b"", b"after"])
    assert got == [None, None, None, 901, 902, 903, None]
    assert b.state == "done" and b.spent


def test_a_thinking_that_ends_by_itself_is_left_alone():
    b = ThinkingBudget(THINK, 5, CLOSING, opened=True)
    assert run(b, [b"a", b"</th", b"ink>", b"x", b"y", b"z", b"w"]) == [None] * 7
    assert b.state == "done" and not b.spent


def test_the_model_opens_the_thinking_itself():
    b = ThinkingBudget(THINK, 2, CLOSING)
    assert run(b, [b" ", b"<th", b"ink>", b"one", b"two", b"", b"", b""]) == \
        [None, None, None, None, None, 901, 902, 903]
    plain = ThinkingBudget(THINK, 0, CLOSING)
    assert run(plain, [b"Hello", b"<think>", b"x"]) == [None, None, None]  # no thinking
    assert plain.state == "done"


def test_a_zero_budget():
    assert ThinkingBudget(THINK, 0, CLOSING, opened=True).forced() == 901  # at once
    b = ThinkingBudget(THINK, 0, CLOSING)
    assert run(b, [b"<think>", b"", b"", b""]) == [None, 901, 902, 903]


def test_a_character_cut_between_tokens_is_finished_first():
    b = ThinkingBudget(THINK, 1, CLOSING, opened=True)
    e_acute = "é".encode()
    got = run(b, [e_acute[:1], e_acute[1:], b"", b"", b""])
    assert got == [None, None, 901, 902, 903]  # one token over, for the whole character


def test_it_needs_closing_tokens_and_a_budget():
    with pytest.raises(ValueError):
        ThinkingBudget(THINK, -1, CLOSING)
    with pytest.raises(ValueError):
        ThinkingBudget(THINK, 3, [])
