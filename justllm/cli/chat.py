"""``justllm chat``: interactive chat in the terminal."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from justllm.cli import options as o
from justllm.cli.errors import cli_errors
from justllm.cli.plugins import plugins_of
from justllm.cli.run import print_notice

_D = o.EngineConfig()
_POOL_BLOCKS = 256  # a chat holds one conversation: a small pool


def chat(
    context: typer.Context,
    model: o.Model = None,
    url: Annotated[Optional[str], typer.Option("--url", help="Chat with a running server instead of loading the model here.")] = None,
    system: Annotated[Optional[str], typer.Option("--system", help="System message.")] = None,
    temperature: Annotated[float, typer.Option("--temperature", help="Sampling temperature (/set temperature to change).")] = 0.7,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", help="Most tokens per answer.")] = 512,
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar="JUSTLLM_API_KEY", help="Bearer key for --url.")] = None,
    pool_blocks: o.PoolBlocks = _POOL_BLOCKS,
    threads: o.Threads = _D.threads,
    ctx: o.Ctx = _D.ctx,
    gpu: o.Gpu = False,
    chat_template: o.ChatTemplateChoice = None,
    verbose: o.Verbose = False,
) -> None:
    """Chat with a model: streaming answers, \"\"\" for multi-line input, /set, /system, /clear,
    /stats, /bye; Ctrl-C stops the current answer, not the program."""
    with cli_errors():
        from justllm.chat.backends import LocalChat, RemoteChat
        from justllm.chat.session import ChatSession, check_options

        options = {"temperature": temperature, "max_tokens": max_tokens}
        check_options(options)  # before a model loads: every message would fail
        if url:
            if chat_template:
                raise ValueError("--chat-template is for a model loaded here; with --url the "
                                 "server's own (serve --chat-template) applies")
            local_only = [name for name, given in (
                ("MODEL", model is not None), ("--gpu", gpu), ("--pool-blocks", pool_blocks != _POOL_BLOCKS),
                ("--threads", threads != _D.threads), ("--ctx", ctx != _D.ctx)) if given]
            if local_only:
                raise ValueError(f"{', '.join(local_only)}: for a model loaded here; --url chats "
                                 "with the server's model")
            backend: LocalChat | RemoteChat = RemoteChat(url, api_key)
        else:
            plugins = plugins_of(context)
            local = LocalChat(o.engine_config(model, {
                "max_seqs": 1, "pool_blocks": pool_blocks, "max_prefill": 1, "max_decode": 1,
                "max_queue": 1, "threads": threads, "ctx": ctx, "gpu": gpu,
                "chat_template": chat_template, "verbose": verbose}, plugins),
                plugins.request_events())
            if local.notice:
                print_notice(local.notice)
            backend = local
        try:
            ChatSession(backend, system=system, options=options).run()
        finally:
            backend.close()
