"""Chat messages -> prompt text, through a Jinja2 chat template.

Which template (``ChatTemplate.resolve``): the ``--chat-template`` choice (a built-in name or a
Jinja file) > the model's own (GGUF metadata) > ``transcript``. A model without a template is
most likely a base model, which has never seen any turn format: it continues a plain
``User:`` / ``Assistant:`` transcript sensibly (the demo Gemma 3 270M answers "The capital of
France is Paris." there, and babbles in Gemma's own turn format), so that is the fallback, with
a ``notice`` the CLI and the server show once.

Rendered in a sandboxed Jinja2 environment, with the helpers HF templates expect
(``raise_exception``, ``strftime_now``) and the model's BOS/EOS strings.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from justllm.errors import InvalidRequestError

# A system message opens the transcript as its own paragraph (without one, TRANSCRIPT_PREAMBLE
# does); every other message is one "Speaker: text" line. The generation prompt ends with
# "Assistant:" and no space: the model writes the space itself. Measured greedily on the demo
# model (Gemma 3 270M, base): "What is the capital of France?" gets "The capital of France is
# Paris." this way, and "19th century" or a run of digits with a trailing space; "What colour is
# the sky?" gets "Blue." with the preamble and an echo of the question without it.
TRANSCRIPT_PREAMBLE = ("Transcript of a dialog, where the User interacts with an Assistant. The "
                       "Assistant is helpful, honest, and answers the User's questions "
                       "precisely.")
TRANSCRIPT_TEMPLATE = (
    "{% set speakers = {'user': 'User', 'assistant': 'Assistant', 'system': 'System',"
    " 'tool': 'Tool'} %}"
    "{% if messages[0]['role'] != 'system' %}" + TRANSCRIPT_PREAMBLE + "{{ '\\n\\n' }}{% endif %}"
    "{% for m in messages %}"
    "{% set text = (m['content'] or '') | trim %}"
    "{% if loop.first and m['role'] == 'system' %}"
    "{{ text }}{{ '\\n\\n' }}"
    "{% else %}"
    "{{ speakers.get(m['role'], m['role'] | capitalize) }}: {{ text }}{{ '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% set sys = messages[0]['content'] if messages[0]['role'] == 'system' else '' %}"
    "{% for m in messages if m['role'] != 'system' %}"
    "{% set role = 'model' if m['role'] == 'assistant' else 'user' %}"
    "<start_of_turn>{{ role }}\n"
    "{% if loop.first and sys %}{{ sys }}\n\n{% endif %}"
    "{{ m['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

# name -> (Jinja source, stop strings a request formatted with it must stop at). A model
# trained on the format ends its turn with an end-of-generation token anyway; the stop strings
# are for a model that was not (a base model given `--chat-template chatml`).
BUILTIN_TEMPLATES: dict[str, tuple[str, tuple[str, ...]]] = {
    "chatml": (CHATML_TEMPLATE, ("<|im_end|>",)),
    "gemma": (GEMMA_TEMPLATE, ("<end_of_turn>",)),
    "llama3": (LLAMA3_TEMPLATE, ("<|eot_id|>",)),
    # The earliest match ends the text: "\n\nUser:" keeps a blank line out of the answer.
    "transcript": (TRANSCRIPT_TEMPLATE, ("\nUser:", "\n\nUser:")),
}
# A template file gets the stop strings of the turn markers it uses.
_TURN_ENDS = tuple(stop for _, stops in BUILTIN_TEMPLATES.values() for stop in stops
                   if stop.startswith("<"))

NO_TEMPLATE_NOTICE = ("this model has no chat template and looks like a base model: chats are "
                      "sent as a plain 'User:/Assistant:' transcript (choose another with "
                      "--chat-template)")


def _raise(message: str) -> None:
    raise InvalidRequestError(message, param="messages")


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        undefined=jinja2.StrictUndefined)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


@dataclass
class ChatTemplate:
    """A compiled template and what goes with it.

    ``stop``: strings a request rendered with this template must stop at (callers add them to
    the request's own). ``name``: the built-in name, the file path, or "model" (the GGUF's
    own). ``notice``: set when the model has no template and ``transcript`` was chosen for it.
    """

    source: str
    bos_token: str = ""
    eos_token: str = ""
    stop: tuple[str, ...] = ()
    name: str = "model"
    notice: str | None = None

    def __post_init__(self) -> None:
        try:
            self._template = _environment().from_string(self.source)
        except jinja2.TemplateSyntaxError as e:
            where = "the model's chat template" if self.name == "model" else self.name
            raise ValueError(f"{where} is not a valid Jinja template: {e.message} "
                             f"(line {e.lineno})") from None

    @classmethod
    def named(cls, choice: str, *, bos_token: str = "", eos_token: str = "") -> "ChatTemplate":
        """A ``--chat-template`` value: a built-in name, else a path to a Jinja file."""
        if choice in BUILTIN_TEMPLATES:
            source, stop = BUILTIN_TEMPLATES[choice]
            return cls(source, bos_token, eos_token, stop, choice)
        path = Path(choice).expanduser()
        if not path.is_file():
            raise ValueError(f"--chat-template {choice!r} is neither a built-in template "
                             f"({', '.join(BUILTIN_TEMPLATES)}) nor a Jinja file")
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read the chat template {choice}: {e}") from None
        stop = tuple(s for s in _TURN_ENDS if s in source)
        return cls(source, bos_token, eos_token, stop, choice)

    @classmethod
    def resolve(cls, choice: str | None, model_source: str | None, *, bos_token: str = "",
                eos_token: str = "") -> "ChatTemplate":
        """The template to use: ``choice`` > the model's own (``model_source``) > transcript."""
        if choice:
            return cls.named(choice, bos_token=bos_token, eos_token=eos_token)
        if model_source:
            return cls(model_source, bos_token, eos_token)
        source, stop = BUILTIN_TEMPLATES["transcript"]
        return cls(source, bos_token, eos_token, stop, "transcript", NO_TEMPLATE_NOTICE)

    @classmethod
    def from_backend(cls, backend: Any, choice: str | None = None) -> "ChatTemplate":
        return cls.resolve(choice, backend.chat_template(), bos_token=backend.special_text("bos"),
                           eos_token=backend.special_text("eos"))

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               **extra: Any) -> str:
        if not messages:
            raise InvalidRequestError("messages must not be empty", param="messages")
        try:
            text = self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token, eos_token=self.eos_token, **extra)
        except InvalidRequestError:
            raise
        except jinja2.TemplateError as e:
            raise InvalidRequestError(f"the chat template failed on these messages: {e}",
                                      param="messages") from e
        # The tokenizer adds BOS itself; a template that writes it too would double it.
        if self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token):]
        return text


def with_template_stops(stop: tuple[str, ...], template: ChatTemplate) -> tuple[str, ...]:
    """A request's stop strings followed by the template's (each once)."""
    return stop + tuple(s for s in template.stop if s not in stop)


class AnswerText:
    """A chat answer streamed without its leading and trailing blanks: after a transcript's
    "Assistant:" the model writes the separating space itself, and the line break before the
    next "User:" is not part of the answer. Blanks inside the answer are held back until
    more text follows them."""

    def __init__(self) -> None:
        self._begun = False
        self._held = ""

    def feed(self, piece: str) -> str:
        """The part of the answer that is safe to show now."""
        text = self._held + piece
        if not self._begun:
            text = text.lstrip()
            self._begun = bool(text)
        shown = text.rstrip()
        self._held = text[len(shown):]
        return shown
