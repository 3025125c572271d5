"""Incremental detokenizing with a byte-level fake vocabulary (pure logic, no model)."""

from justllm.engine.detokenizer import IncrementalDetokenizer

# token id -> bytes; "é" is two bytes split over tokens 3 and 4, "🙂" four bytes over 5..6
VOCAB = {1: b"Hel", 2: b"lo", 3: b"\xc3", 4: b"\xa9!", 5: b"\xf0\x9f", 6: b"\x99\x82", 7: b" EN",
         8: b"D here", 9: b" E", 10: b"nough", 11: b"\xff"}


def run(tokens, stop=(), keep=()):
    d = IncrementalDetokenizer(VOCAB.__getitem__, stop, keep)
    pieces = []
    for t in tokens:
        d.add_token(t)
        pieces.append(d.take_new_text())
        if d.stopped:
            break
    pieces.append(d.take_new_text(final=True))
    return pieces, d


def test_never_emits_half_a_character():
    pieces, _ = run([1, 2, 3, 4, 5, 6])
    assert pieces == ["Hel", "lo", "", "é!", "", "🙂", ""]
    assert all("\ufffd" not in p for p in pieces)


def test_invalid_bytes_become_replacement_not_crash():
    pieces, _ = run([1, 11, 2])
    assert "".join(pieces) == "Hel\ufffdlo"


def test_stop_string_across_token_boundary_is_not_emitted():
    pieces, d = run([1, 2, 7, 8], stop=("END",))
    assert d.stopped
    assert "".join(pieces) == "Hello "
    assert d.text == "Hello "


def test_a_stop_string_to_keep_ends_the_text_and_only_that_one():
    """vLLM's include_stop_str_in_output: the text ends with the stop string (found across
    tokens, held back until then), and not with what followed it in the token; a stop string
    not to keep (a chat template's own) is still left out."""
    pieces, d = run([1, 2, 7, 8], stop=("END", "xyz"), keep=("END",))
    assert d.stopped and d.matched == "END"
    assert pieces[:2] == ["Hel", "lo"] and "".join(pieces) == "Hello END"
    _, d = run([1, 2, 7, 8], stop=("END", "lo E"), keep=("END",))
    assert d.matched == "lo E" and d.text == "Hel"


def test_possible_stop_prefix_is_held_back_then_released():
    pieces, d = run([1, 2, 9, 10], stop=("END",))
    assert not d.stopped
    assert pieces[2] == " "  # "E" could be the start of "END": held back
    assert "".join(pieces) == "Hello Enough"


def test_final_flushes_held_text():
    pieces, d = run([1, 9], stop=("END",))
    assert "".join(pieces) == "Hel E"


def test_the_stop_string_that_matched_is_kept():
    _, d = run([1, 2, 7, 8], stop=("here", "ND", "END"))  # "END" and "ND" both end "Hello END"
    assert d.matched == "END"  # the earliest in the text wins, as the text is cut there
    _, d = run([1, 2, 9, 10], stop=("END",))
    assert d.matched is None
