"""llama-server's code-completion stops, on text fed piece by piece (pure logic)."""

from __future__ import annotations

from justllm.server.line_limits import LineLimits


def feed(limits: LineLimits, pieces: list[str], times: list[float] | None = None
         ) -> tuple[str, int | None]:
    """The text kept and the index of the piece the answer ended with (None: it goes on)."""
    kept = ""
    for i, piece in enumerate(pieces):
        text, stop = limits.feed(piece, times[i] if times else 0.0)
        kept += text
        if stop:
            return kept, i
    return kept, None


def test_the_first_line_under_the_indentation_ends_the_answer_where_its_indentation_ends():
    pieces = ["x = 1", "\n    y", " = 2\n", "  z = 3\n", "w"]
    assert feed(LineLimits(n_indent=4), pieces) == ("x = 1\n    y = 2\n  ", 3)
    # the first line is not checked; a tab is one; deeper lines pass; an empty line ends it
    assert feed(LineLimits(n_indent=1), ["a\n\tb\n        c\n", "\nd"]) == (
        "a\n\tb\n        c\n", 1)
    assert feed(LineLimits(n_indent=2), ["a\n\tb\n"]) == ("a\n\t", 0)
    assert feed(LineLimits(n_indent=0), pieces) == ("".join(pieces), None)


def test_a_line_of_spaces_so_far_waits_for_its_first_character():
    limits = LineLimits(n_indent=4)
    assert limits.feed("if x:\n  ", 0.0) == ("if x:\n  ", False)
    assert limits.feed("  ", 0.0) == ("  ", False)  # four spaces: it may still pass
    assert limits.feed("pass\nno", 0.0) == ("pass\n", True)
    assert limits.text == "if x:\n    pass\n"


def test_past_the_time_limit_the_next_newline_ends_the_answer():
    pieces, times = ["a\n", "b", "c\nd", "e\n"], [10.0, 10.1, 10.3, 10.4]
    assert feed(LineLimits(t_max_predict_ms=200), pieces, times) == ("a\nbc\nd", 2)
    assert feed(LineLimits(t_max_predict_ms=1000), pieces, times) == ("a\nbc\nde\n", None)
    assert not LineLimits().active and LineLimits(t_max_predict_ms=5).active
