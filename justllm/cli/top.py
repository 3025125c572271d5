"""``justllm top``: a live dashboard of a running server, from its ``/metrics``."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from justllm.cli.errors import cli_errors


def top(
    url: Annotated[str, typer.Option("--url", help="The server or gateway to watch (its /metrics is polled).")] = "http://127.0.0.1:8080",
    interval: Annotated[float, typer.Option("--interval", help="Seconds between polls (0.05 to 3600).")] = 1.0,
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar="JUSTLLM_API_KEY", help="Sent as 'Authorization: Bearer KEY'.")] = None,
) -> None:
    """Watch a running server: requests, KV blocks, prefix-cache hit ratio, tokens/s, TTFT (q or Ctrl-C quits, p pauses); a gateway adds a row per model (enter shows one, a all)."""
    with cli_errors():
        from justllm.chat.backends import check_url

        check_url(url)  # (as ps, chat and bench check theirs)
        if not 0.05 <= interval <= 3600:  # (a NaN fails this too, and says so)
            raise ValueError("--interval must be a number of seconds from 0.05 to 3600")
        if not (sys.stdin.isatty() and sys.stdout.isatty()):
            from justllm.tui.metrics import metrics_url

            # Textual would draw its screen into the pipe and never end.
            raise ValueError("justllm top needs a terminal; for the figures in a script, "
                             f"read {metrics_url(url)} (or justllm ps for a gateway)")
        from justllm.tui.top import TopApp

        TopApp(url=url, interval=interval, api_key=api_key).run()
