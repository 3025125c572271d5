"""The fill-in-the-middle layout (llama-server's): other files first, then BOS, PRE prefix
prompt SUF suffix MID, each part cut to its share of a batch."""

from __future__ import annotations

from justllm.core.fim import Chunk, FimTokens, fim_prompt

PRE, SUF, MID, REP, SEP, BOS = -1, -2, -3, -4, -5, -9
BASIC = FimTokens(PRE, SUF, MID)
REPO = FimTokens(PRE, SUF, MID, REP, SEP)


def chars(text: str) -> list[int]:
    """A tokenizer with one token per character (its code point)."""
    return [ord(c) for c in text]


def text(tokens: list[int]) -> str:
    names = {PRE: "<PRE>", SUF: "<SUF>", MID: "<MID>", REP: "<REP>", SEP: "<SEP>", BOS: "<s>"}
    return "".join(names.get(t, chr(t) if t >= 0 else "?") for t in tokens)


def layout(fim=BASIC, prefix="def f():\n    ", suffix="\nf()\n", extra=(), prompt="ret",
           bos=BOS, batch=512, context=4096, n_predict=64, spm=False) -> str:
    return text(fim_prompt(fim, chars, chars(prefix), chars(suffix), list(extra),
                           chars(prompt), bos=bos, batch=batch, context=context,
                           n_predict=n_predict, spm=spm))


def test_prefix_then_prompt_then_suffix_then_the_middle():
    assert layout() == "<s><PRE>def f():\n    ret<SUF>\nf()\n<MID>"
    assert layout(bos=None) == "<PRE>def f():\n    ret<SUF>\nf()\n<MID>"
    assert FimTokens(PRE, None, MID).missing() == ["suffix"] and BASIC.missing() == []
    # --spm-infill: the suffix first, then the prefix with the prompt (llama-server's order)
    assert layout(spm=True) == "<s><SUF>\nf()\n<PRE>def f():\n    ret<MID>"


def test_other_files_come_first_with_the_models_repository_tokens_or_a_snippet_line():
    extra = [Chunk("a.py", "A = 1\n"), Chunk("b.py", "B = 2\n")]
    assert layout(REPO, extra=extra) == (
        "<REP>myproject\n<SEP>a.py\nA = 1\n<SEP>b.py\nB = 2\n<SEP>filename\n"
        "<s><PRE>def f():\n    ret<SUF>\nf()\n<MID>")
    assert layout(extra=extra) == (
        "\n\n--- snippet ---\n\nA = 1\n\n\n--- snippet ---\n\nB = 2\n"
        "<s><PRE>def f():\n    ret<SUF>\nf()\n<MID>")


def test_each_part_keeps_its_share_nearest_the_gap():
    # a batch of 16: the prefix's last 12, the suffix's first 4 - 2 - the prompt (1)
    got = layout(prefix="abcdefghijklmnopqrstuvwxyz", suffix="ABCDEFGH", prompt="!", batch=16)
    assert got == "<s><PRE>opqrstuvwxyz!<SUF>A<MID>"
    # other files: what the context has left after a batch and twice the answer (60 - 16 -
    # 2 x 10 = 24 tokens), their last ones
    extra = [Chunk("f", "0123456789" * 10)]
    got = layout(REPO, extra=extra, prefix="p", suffix="s", prompt="", batch=16, context=60,
                 n_predict=10)
    assert got == "67890123456789<SEP>filename\n<s><PRE>p<SUF>s<MID>"


def test_the_other_files_never_leave_the_answer_without_room():
    """With every share full and no n_predict, llama-server's share for the other files
    fills the context to the last token; one is left for the answer."""
    extra = [Chunk("f", "x" * 500)]
    tokens = fim_prompt(REPO, chars, chars("p" * 20), chars("s" * 20), extra, [], bos=BOS,
                        batch=16, context=100, n_predict=-1)
    assert len(tokens) == 99 and text(tokens).endswith("<s><PRE>pppppppppppp<SUF>ss<MID>")
