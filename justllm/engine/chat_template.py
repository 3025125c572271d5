"""Chat messages -> prompt text, through the model's own Jinja2 chat template (GGUF metadata).

Rendered in a sandboxed Jinja2 environment, with the helpers HF templates expect
(``raise_exception``, ``strftime_now``) and the model's BOS/EOS strings.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from justllm.errors import InvalidRequestError

# Used when a GGUF carries no chat template (base models such as the demo Gemma 3 270M):
# the model family's own turn format where we know it, else ChatML.
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


def _raise(message: str) -> None:
    raise InvalidRequestError(message, param="messages")


@dataclass
class ChatTemplate:
    source: str
    bos_token: str = ""
    eos_token: str = ""

    def __post_init__(self) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            undefined=jinja2.StrictUndefined)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        self._template = env.from_string(self.source)

    @classmethod
    def from_backend(cls, backend: Any) -> "ChatTemplate":
        source = backend.chat_template()
        if not source:
            arch = backend.metadata().get("general.architecture", "")
            source = GEMMA_TEMPLATE if arch.startswith("gemma") else CHATML_TEMPLATE
        return cls(source, backend.special_text("bos"), backend.special_text("eos"))

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
