"""``justllm run``: one prompt, tokens streamed to the terminal, a speed summary at the end."""

from __future__ import annotations

import contextlib
import re
import secrets
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Annotated, Optional, cast

import typer
from rich.console import Console
from rich.markup import escape

from justllm.cli import options as o
from justllm.cli.errors import cli_errors
from justllm.cli.plugins import plugins_of, warn_problems
from justllm.config import EngineConfig
from justllm.core.reasoning import opens_thinking
from justllm.core.sampling_params import SamplingParams
from justllm.errors import EngineError, InvalidRequestError

if TYPE_CHECKING:
    from justllm.engine.chat_template import ChatTemplate

_S = SamplingParams()
MAX_USER_STOP = 16  # --stop strings; the chat template may add its own


@o.engine_options
def run(
    context: typer.Context,
    model: o.Model = None,
    text: Annotated[Optional[str], typer.Argument(metavar="PROMPT", help="The prompt, after the model (as `ollama run MODEL PROMPT`); or -p.", show_default=False)] = None,
    prompt: Annotated[Optional[str], typer.Option("--prompt", "-p", help="The prompt (default: read from stdin).")] = None,
    raw: Annotated[bool, typer.Option("--raw", help="Send the prompt as is, without a chat template (and without its stop strings).")] = False,
    system: Annotated[Optional[str], typer.Option("--system", help="A system message (chat template only).")] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", help="Most tokens to generate (left out: at most what the context holds after the prompt).")] = cast(int, _S.max_tokens),
    temperature: Annotated[float, typer.Option("--temperature", help="0 = greedy.")] = _S.temperature,
    top_k: Annotated[int, typer.Option("--top-k", help="0 = off.")] = _S.top_k,
    top_p: Annotated[float, typer.Option("--top-p")] = _S.top_p,
    min_p: Annotated[float, typer.Option("--min-p")] = _S.min_p,
    repeat_penalty: Annotated[float, typer.Option("--repeat-penalty")] = _S.repeat_penalty,
    presence_penalty: Annotated[float, typer.Option("--presence-penalty")] = _S.presence_penalty,
    frequency_penalty: Annotated[float, typer.Option("--frequency-penalty")] = _S.frequency_penalty,
    seed: Annotated[Optional[int], typer.Option("--seed", help="Makes sampling reproducible.")] = None,
    stop: Annotated[Optional[list[str]], typer.Option("--stop", help="Stop string (repeatable).")] = None,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Keep generating past end-of-sequence.")] = False,
    record_text: Annotated[bool, typer.Option("--record-text", help="The finished-request record (plugins' on_request_finished) carries the prompt and output text.", envvar="JUSTLLM_RECORD_TEXT")] = False,
    engine_flags: dict | None = None,
    config_file: o.ConfigFile = None,
) -> None:
    """Generate from one prompt, streaming tokens, then print prompt/generation speed and TTFT."""
    with cli_errors(), _said_as_flags():
        if sys.stdout is None:  # (started with stdout closed: the answer had nowhere to go)
            raise ValueError("standard output is closed: nowhere to write the answer")
        if text is not None and prompt is not None:
            raise ValueError("give the prompt once: after the model or with -p, not both")
        prompt = text if prompt is None else prompt
        if prompt is None and model is not None and looks_like_a_prompt(model):
            raise ValueError(f"'{model}' is no model file or name; the prompt goes after the "
                             "model (justllm run MODEL PROMPT) or in -p")
        if prompt is None:
            if sys.stdin is None or sys.stdin.isatty():
                raise ValueError("no prompt: pass -p TEXT or pipe text on stdin")
            from justllm.chat.line_editing import piped_stdin

            piped_stdin()
            prompt = sys.stdin.read()
        if not prompt.strip():
            raise ValueError("the prompt is empty")
        if max_tokens < 1:  # (0, the prompt computed and nothing drawn, is for servers)
            raise ValueError(f"--max-tokens must be >= 1 (got {max_tokens})")
        if raw and system:
            raise ValueError("--system goes into the chat template, which --raw leaves out: "
                             "put it in the prompt")
        if raw and o.typed(context, "chat_template"):  # (a JUSTLLM_* one is serve's as well)
            raise ValueError("--chat-template chooses the chat template, which --raw leaves "
                             "out: give one or the other")
        params = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
            min_p=min_p, repeat_penalty=repeat_penalty, presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty, seed=seed, stop=tuple(stop or ()),
            ignore_eos=ignore_eos)
        if len(params.stop) > MAX_USER_STOP:
            raise ValueError(f"at most {MAX_USER_STOP} --stop strings")
        _refuse_server_flags(context)
        plugins = plugins_of(context)
        config = o.engine_config(model, engine_flags or {}, plugins, o.typed_flags(context))
        if o.typed(context, "reasoning_format") and config.reasoning_format != "none":
            raise ValueError("--reasoning-format: run writes the model's text as it comes, its "
                             "thinking included (none); serve and chat take the thinking apart")
        events = plugins.request_events()
        warn_problems(plugins)  # what resolving the model and --spec found wrong in plugins
        # The prompt runs under every --lora adapter at its scale, as llama-cli applies them
        # (a server lets each request choose).
        params = replace(params, lora=tuple((a.name, a.scale) for a in config.lora))
        from justllm.engine.chat_template import ChatTemplate, with_template_stops
        from justllm.engine.engine import Engine

        try:
            with held_model(config.model):  # `justllm rm` refuses the model meanwhile
                engine = Engine(config)
                # the id a server would answer to (ollama:llama3.2: llama3.2, not the blob's
                # sha256-... stem)
                engine.observe(events, model=plugins.served_name(model), text=record_text)
                try:
                    text_prompt = prompt
                    if not raw:
                        template = ChatTemplate.from_backend(engine.backend,
                                                             config.chat_template)
                        if template.notice:
                            print_notice(template.notice)
                        messages = ([{"role": "system", "content": system}] if system else [])
                        messages.append({"role": "user", "content": prompt})
                        text_prompt = template.render(messages, add_generation_prompt=True)
                        params = replace(params, stop=with_template_stops(params.stop, template))
                        params = _budgeted(params, template, text_prompt, config,
                                           _asks_budget(context, config))
                    elif _asks_budget(context, config):
                        raise ValueError("--reasoning-budget holds a model's thinking, which "
                                         "--raw leaves to the prompt: give one or the other")
                    if not o.typed(context, "max_tokens"):
                        params = _within_context(engine, text_prompt, params)
                    _stream(engine, text_prompt, params, answer=not raw)
                finally:
                    engine.close()
        finally:
            if events is not None:
                events.close()


# The request fields run's options set, as their flags (the engine's words name the fields).
_FLAGS = {name: "--" + name.replace("_", "-") for name in (
    "max_tokens", "temperature", "top_k", "top_p", "min_p", "repeat_penalty",
    "presence_penalty", "frequency_penalty", "seed", "stop")}


@contextlib.contextmanager
def _said_as_flags() -> Iterator[None]:
    """A refused value named by the flag that set it: ``--temperature must be a number in
    [0, 100]``, not the API's ``temperature must be ...``, nor "reduce the prompt or
    max_tokens" for ``-n``."""
    try:
        yield
    except InvalidRequestError as e:
        text = re.sub(r"\b(" + "|".join(_FLAGS) + r")\b", lambda m: _FLAGS[m[1]], str(e))
        raise ValueError(text) from None


def held_model(model_path: str | None) -> contextlib.AbstractContextManager:
    """A lease on the model file for as long as it is loaded (as ``serve`` holds its model):
    ``justllm rm`` refuses to delete it meanwhile, registered yet or not."""
    if not model_path:
        return contextlib.nullcontext()
    from justllm.models.registry import lease_for_path

    return lease_for_path(model_path)


# Engine flags that mean something only to a server: refused when typed for run's one prompt
# (a config file or JUSTLLM_* variable shared with serve may set them: those are passed over).
_SERVER_FLAGS = {
    "enable_lora_runtime": "--enable-lora-runtime is for serve (adapters loaded over HTTP); "
                           "run applies --lora adapters",
    "scheduling_policy": "--scheduling-policy orders a server's many requests; run has one",
    "max_queue": "--max-queue bounds a server's waiting requests; run has one",
    "lora_max_steps": "--lora-max-steps shares a server's steps between requests of several "
                      "adapter sets; run's one prompt has one set",
    "pooling": "--pooling is how a server pools embeddings; run generates text",
    "spm_infill": "--spm-infill lays out a server's fill-in-the-middle prompts (/infill); run "
                  "sends its prompt as it is or through the chat template",
}


def _refuse_server_flags(context: typer.Context) -> None:
    for name, why in _SERVER_FLAGS.items():
        if o.typed(context, name):
            raise ValueError(why)


def _within_context(engine, prompt: str, params: SamplingParams) -> SamplingParams:
    """-n's default is the most run draws, not a request for that many: in a context with
    less room after the prompt, the answer fills it (as llama-cli's does) instead of being
    refused. (A typed -n that does not fit is refused, as a server refuses it.)"""
    room = engine.max_request_tokens - len(engine.tokenize(prompt))
    return replace(params, max_tokens=room) if 0 < room < cast(int, params.max_tokens) \
        else params


def _asks_budget(context: typer.Context, config: EngineConfig) -> bool:
    """Whether the command line asks for a thinking budget (or its message)."""
    return ((o.typed(context, "reasoning_budget") and config.reasoning_budget >= 0)
            or (o.typed(context, "reasoning_budget_message")
                and bool(config.reasoning_budget_message)))


def _budgeted(params: SamplingParams, template: ChatTemplate, prompt: str,
              config: EngineConfig, asked: bool) -> SamplingParams:
    """``params`` held to ``--reasoning-budget``, as a server holds a request to it: past
    the budget the end of the model's thinking is forced (after the budget's message). A
    budget (or its message) ``asked`` for on the command line for a model that does not
    think is refused, not ignored (one a JUSTLLM_* variable or config file sets for every
    command is let be)."""
    tags = template.budget_tags
    if config.reasoning_budget < 0 or tags is None:
        if asked and config.reasoning_budget < 0:
            raise ValueError("--reasoning-budget-message needs --reasoning-budget")
        if asked:
            raise ValueError("--reasoning-budget: this model does not think (its chat "
                             "template writes no thinking tags)")
        return params
    return replace(params, thinking_budget=config.reasoning_budget, thinking_tags=tags,
                   thinking_open=opens_thinking(prompt, tags),
                   thinking_message=config.reasoning_budget_message)


def looks_like_a_prompt(model: str) -> bool:
    """Words with spaces that are no file: what ``ollama run``'s habit, a prompt without a
    model, puts where the model goes."""
    import os

    return " " in model.strip() and not os.path.exists(os.path.expanduser(model))


def print_notice(notice: str) -> None:
    Console(stderr=True, emoji=False).print(f"[dim]note: {escape(notice)}[/dim]", highlight=False,
                               soft_wrap=True)


def _stream(engine, prompt: str, params: SamplingParams, *, answer: bool) -> None:
    """Stream one request's text to stdout; an ``answer`` (a chat turn, not a raw
    continuation) without its leading and trailing blanks."""
    from justllm.engine.chat_template import AnswerText

    out = sys.stdout
    start = time.perf_counter()
    # Its own id, as a server's completion has (a plugin's record of it, justllm history
    # --id, told every run apart by time alone: each was "run").
    request_id = f"run-{secrets.token_hex(8)}"
    engine.add_request(prompt, params, request_id=request_id)
    last = None
    trim = AnswerText() if answer else None
    try:
        while engine.has_unfinished():
            for o_ in engine.step():
                if o_.error:
                    raise EngineError(o_.error)
                out.write(trim.feed(o_.text) if trim else o_.text)
                out.flush()
                last = o_
    except KeyboardInterrupt:
        out.write("\n")  # "interrupted" on a line of its own, not after the partial text
        out.flush()
        engine.abort(request_id)  # its plugins' record says so (abort), as a server's would
        raise
    out.write("\n")
    out.flush()
    if last is None:
        return
    m = last.metrics
    end = m.finished_time or time.perf_counter()
    ttft = m.ttft or 0.0
    gen_time = end - (m.first_token_time or end)
    # The decode rate: the tokens after the first over the time after it (one token has none).
    gen_rate = (f", {(m.num_generated_tokens - 1) / gen_time:.1f} tok/s"
                if m.num_generated_tokens > 1 and gen_time > 0 else "")
    prompt_rate = m.num_prompt_tokens / ttft if ttft > 0 else 0.0
    # soft_wrap: one line whatever the width (a log or a pipe got it cut at 80 columns).
    Console(stderr=True, emoji=False).print(
        f"[dim]prompt {m.num_prompt_tokens} tok, {prompt_rate:.1f} tok/s · "
        f"generation {m.num_generated_tokens} tok{gen_rate} · "
        f"TTFT {ttft * 1000:.0f} ms · total {end - start:.2f} s · "
        f"finish: {last.finish_reason}[/dim]", highlight=False, soft_wrap=True)
    spec = engine.stats().spec
    if engine.spec is not None:  # (said with no draft too: that speculation was on)
        accepted = (f", {spec.num_accepted_tokens} of {spec.num_draft_tokens} draft tokens "
                    f"accepted ({spec.acceptance_rate:.0%})" if spec.num_drafts else
                    " (nothing was drafted for this answer)")
        Console(stderr=True, emoji=False).print(
            f"[dim]speculation: {spec.num_drafts} drafts{accepted}[/dim]", highlight=False,
            soft_wrap=True)
