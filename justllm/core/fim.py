"""Fill-in-the-middle prompts: the code before and after a gap, laid out with a model's FIM
tokens so the model writes the middle (llama-server's ``/infill``, which editor plugins such as
llama.vim and llama.vscode call).

The layout is llama-server's, so a client tuned against it gets the same prompt: other files'
chunks first (with the model's repository and file-separator tokens when it has them, the
repo-level pattern of Qwen2.5-Coder's report, arXiv:2409.12186; else each after a plain
``--- snippet ---`` line), then BOS if the model adds one, then ``PRE prefix SUF suffix MID
prompt``. What fits is chosen as llama-server chooses it: the prefix's last three quarters of
a batch, the suffix's first quarter less the prompt, and the other files' last tokens in what
the context has left after a batch and twice the answer (and never more than leaves the
answer room).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

_SNIPPET = "\n\n--- snippet ---\n\n"  # llama-server's chunk separator without file tokens


@dataclass(frozen=True)
class FimTokens:
    """A model's fill-in-the-middle tokens (None: the model has none). ``pre``, ``suf`` and
    ``mid`` are what infilling needs; ``rep`` and ``sep`` give the repo-level layout."""

    pre: int | None
    suf: int | None
    mid: int | None
    rep: int | None = None
    sep: int | None = None

    def missing(self) -> list[str]:
        """The tokens infilling needs that the model lacks (empty: it can infill)."""
        return [name for name, t in (("prefix", self.pre), ("suffix", self.suf),
                                     ("middle", self.mid)) if t is None]


@dataclass(frozen=True)
class Chunk:
    """Context from another file: its name and text."""

    filename: str
    text: str


def fim_prompt(fim: FimTokens, tokenize: Callable[[str], list[int]], prefix: list[int],
               suffix: list[int], extra: Sequence[Chunk], prompt: list[int], *, bos: int | None,
               batch: int, context: int, n_predict: int, spm: bool = False) -> list[int]:
    """The prompt's tokens (module docstring). ``tokenize``: text to tokens without BOS and
    with special tokens' text read as text; ``prefix``, ``suffix``, ``prompt``: tokens so
    read; ``bos``: the model's BOS if it adds one; ``batch``: the tokens one decode takes;
    ``n_predict``: the answer's most tokens (-1: none given); ``spm``: the suffix first
    (SUF suffix PRE prefix prompt MID, llama-server's ``--spm-infill``, for models trained
    that way)."""
    assert fim.pre is not None and fim.suf is not None and fim.mid is not None
    extra_tokens: list[int] = []
    if fim.rep is not None:
        extra_tokens += [fim.rep, *tokenize("myproject\n")]
    for chunk in extra:
        if fim.sep is not None:
            extra_tokens += [fim.sep, *tokenize(chunk.filename + "\n")]
        else:
            extra_tokens += tokenize(_SNIPPET)
        extra_tokens += tokenize(chunk.text)
    if fim.sep is not None:
        extra_tokens += [fim.sep, *tokenize("filename\n")]
    n_prefix = min(len(prefix), 3 * (batch // 4))
    n_suffix = min(len(suffix), max(0, batch // 4 - (2 + len(prompt))))
    head = [bos] if bos is not None else []
    before = [fim.pre, *prefix[len(prefix) - n_prefix:], *prompt]
    after = [fim.suf, *suffix[:n_suffix]]
    rest = [*head, *(after + before if spm else before + after), fim.mid]
    # llama-server's share for the other files, and never more than leaves the answer room
    # (its own share can overfill the context when n_predict is -1)
    answer = max(n_predict, 1)
    n_extra = max(0, min(context - batch - 2 * answer, context - answer - len(rest),
                         len(extra_tokens)))
    return [*extra_tokens[len(extra_tokens) - n_extra:], *rest]
