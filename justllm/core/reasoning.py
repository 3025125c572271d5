"""A reasoning model's answer -> (its thinking, the rest), whole or as it streams.

Reasoning models (DeepSeek R1, Qwen3, QwQ, Magistral, Command R7B, Seed-OSS...) write their
thinking first, between a pair of tags, then the answer. Which pair is read off the chat
template (``thinking_tags``), as Ollama infers them from its templates: a template that writes
the pair (to show an earlier turn's thinking, or to open the answer with it) belongs to a
model that writes them.

The reading follows llama.cpp's (``--reasoning-format deepseek``) and Ollama's parsers:

- the thinking opens with the start tag at the very beginning of the answer (blanks before it
  allowed), or is already open when the prompt ends with the start tag (a template that makes
  the model think: DeepSeek R1's, Qwen3's thinking models);
- (a start tag the model writes although the prompt opened the thinking is left out, as
  llama.cpp leaves it);
- it ends at the end tag; the thinking is the text between, stripped of surrounding blanks,
  and the content is what follows, without the blanks that lead it;
- an answer that ends while still thinking (its token limit) is all thinking, no content,
  but for a beginning of the end tag it was cut off in (``</`` ...);
- an answer that does not open with the start tag is all content, tags and all.

The streaming reader shows thinking and content as soon as they cannot change: it holds back
text that may still be the start of a tag and trailing blanks (which end up stripped), so the
pieces it gives always add up to the whole reading.
"""

from __future__ import annotations

from dataclasses import dataclass

# Start and end tags of the reasoning models' families, in the order they are looked for.
THINKING_TAGS: tuple[tuple[str, str], ...] = (
    ("<think>", "</think>"),  # DeepSeek R1, Qwen3, QwQ, GLM 4.5, Granite, Hunyuan, MiniMax...
    ("<seed:think>", "</seed:think>"),  # ByteDance Seed-OSS
    ("[THINK]", "[/THINK]"),  # Magistral
    ("<|START_THINKING|>", "<|END_THINKING|>"),  # Command R7B / Command A Reasoning
)

# The chat-template variable that turns thinking on or off (Qwen3's, GLM's, Granite's...), as
# vLLM and llama-server pass it (``chat_template_kwargs: {"enable_thinking": false}``).
THINKING_SWITCH = "enable_thinking"

# The chat-template variable a thinking level is given as (gpt-oss's; llama-server gives
# OpenAI's reasoning_effort to the template as it).
EFFORT_VARIABLE = "reasoning_effort"

# How an answer's thinking is returned (llama-server's --reasoning-format): "auto" and
# "deepseek" apart from the content (``reasoning_content``); "none" left in the content as the
# model wrote it.
REASONING_FORMATS = ("auto", "deepseek", "none")


def thinking_tags(template_source: str) -> tuple[str, str] | None:
    """The start and end tags a model whose chat template is ``template_source`` thinks
    between; None when the template writes no known pair (not a reasoning model)."""
    for start, end in THINKING_TAGS:
        if start in template_source and end in template_source:
            return start, end
    return None


def opens_thinking(prompt: str, tags: tuple[str, str]) -> bool:
    """Whether ``prompt`` ends inside the thinking (its last non-blank text is the start tag):
    the answer then begins with thinking, without a start tag of its own."""
    return prompt.rstrip().endswith(tags[0])


@dataclass(frozen=True)
class Reasoned:
    reasoning: str | None  # None: the answer has no thinking (or an empty one)
    content: str


def split_reasoning(text: str, tags: tuple[str, str], opened: bool = False) -> Reasoned:
    """A whole answer's thinking and content (``opened``: the prompt opened the thinking)."""
    start, end = tags
    lead = text.lstrip()
    if lead.startswith(start):  # (a model may write the tag the prompt already opened)
        text = lead[len(start):]
    elif not opened:
        return Reasoned(None, text)
    thought, closed, rest = text.partition(end)
    if not closed:  # cut off while thinking, maybe inside the end tag: that is no thinking
        cut = partial_tail(thought, end)
        if cut >= 2:  # (one "<" may be the thinking's own)
            thought = thought[:-cut]
    return Reasoned(thought.strip() or None, rest.lstrip() if closed else "")


def partial_tail(text: str, *tags: str) -> int:
    """How many characters at the end of ``text`` may still begin one of ``tags`` (a streamed
    reader holds them back)."""
    for n in range(min(max(map(len, tags)) - 1, len(text)), 0, -1):
        tail = text[-n:]
        if any(tag.startswith(tail) for tag in tags):
            return n
    return 0


class ReasoningSplitter:
    """Feed an answer's text pieces, get (thinking, content) pieces safe to show; ``finish``
    gives what was held back. The pieces add up to :func:`split_reasoning` of the whole."""

    def __init__(self, tags: tuple[str, str], opened: bool = False) -> None:
        self._tags = tags
        self._opened = opened
        self._text = ""  # the answer so far
        self._state = "undecided"
        self._body = 0  # where the thinking starts in _text (after the start tag)
        self._shown = 0  # characters of the (stripped) thinking given out
        self._content_from = 0  # where content starts in _text, once past the thinking
        self._content_shown = 0  # characters of _text[_content_from:] given out

    def feed(self, piece: str) -> tuple[str, str]:
        """Append ``piece``; the thinking and the content that can be shown now."""
        self._text += piece
        start, end = self._tags
        if self._state == "undecided":
            lead = self._text.lstrip()
            if lead.startswith(start):
                self._state = "thinking"
                self._body = len(self._text) - len(lead) + len(start)
            elif not start.startswith(lead):  # cannot become the start tag
                self._state = "thinking" if self._opened else "content"
            else:
                return "", ""
        thought = ""
        if self._state == "thinking":
            body = self._text[self._body:]
            at = body.find(end)
            if at < 0:
                safe = body[:len(body) - partial_tail(body, end)].strip()
                thought = self._take(safe)
                return thought, ""
            thought = self._take(body[:at].strip())
            self._state = "after"
            self._content_from = self._body + at + len(end)
        if self._state == "after":
            rest = self._text[self._content_from:]
            lead = rest.lstrip()
            if not lead:
                return thought, ""
            self._content_from += len(rest) - len(lead)
            self._state = "content"
        content = self._text[self._content_from + self._content_shown:]
        self._content_shown += len(content)
        return thought, content

    def _take(self, safe: str) -> str:
        """The part of the thinking ``safe`` (stripped so far) not given out yet."""
        out = safe[self._shown:]
        self._shown = max(self._shown, len(safe))
        return out

    def finish(self) -> tuple[str, str]:
        """At the answer's end: the thinking and content not shown yet."""
        whole = split_reasoning(self._text, self._tags, self._opened)
        return (whole.reasoning or "")[self._shown:], whole.content[self._content_shown:]
