"""``justllm history``: browse and search the logged requests (``justllm logs`` is taken: the
runner logs of a router-mode gateway)."""

from __future__ import annotations

import json
import re
import sqlite3
import time
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from justllm.cli.errors import cli_errors
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from justllm_request_log import store

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*([smhdw])", re.IGNORECASE)
TEXT_WIDTH = 60  # characters of prompt and output the table shows, at most
TIME_FORMAT = "%m-%d %H:%M:%S"  # local time; no year: the log keeps 30 days by default
_FINISH_STYLE = {"stop": "green", "length": "yellow", "abort": "dim", "error": "red"}


def parse_since(value: str, now: float | None = None) -> float:
    """``30m``, ``2h``, ``7d``, ``1w`` (ago), or an ISO date or time (``2024-05-01``,
    ``2024-05-01T09:30``; local time unless it names a zone), as Unix time."""
    text = value.strip()
    m = _DURATION.fullmatch(text)
    if m:
        return (time.time() if now is None else now) - float(m[1]) * _UNITS[m[2].lower()]
    try:
        return datetime.fromisoformat(text).timestamp()  # a naive datetime is local time
    except (ValueError, OverflowError, OSError):  # (0001-01-01 said "year 0 is out of range")
        raise ValueError(f"--since: expected a duration (30m, 2h, 7d, 1w) or an ISO date "
                         f"(2024-05-01, 2024-05-01T09:30) this machine's clock can hold, got "
                         f"{value!r}") from None


def history(
    count: Annotated[int, typer.Option("-n", "--count", help="Show the newest N requests (0: all).")] = 20,
    model: Annotated[Optional[str], typer.Option("--model", help="Only this model's requests (the id clients send).")] = None,
    query: Annotated[Optional[str], typer.Option("-q", "--query", help="Only requests whose prompt or output contains TEXT (case-insensitive; text is recorded with 'justllm serve --record-text').")] = None,
    since: Annotated[Optional[str], typer.Option("--since", help="Only requests that arrived since: a duration ago (30m, 2h, 7d, 1w) or an ISO date or time.")] = None,
    request_id: Annotated[Optional[str], typer.Option("--id", help="Only the request with this X-Request-Id (the header its answer carried) or response id (chatcmpl-..., cmpl-...).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON array of the rows, every column.")] = False,
    path: Annotated[bool, typer.Option("--path", help="Print the database's path and exit.")] = False,
    prune: Annotated[bool, typer.Option("--prune", help="Apply the retention limits now (JUSTLLM_REQUEST_LOG_MAX_ROWS, JUSTLLM_REQUEST_LOG_MAX_DAYS) and give the space back.")] = False,
) -> None:
    """Browse and search the requests justllm-request-log recorded, newest first. The database
    is JUSTLLM_REQUEST_LOG, else $XDG_STATE_HOME/justllm/requests.db."""
    with cli_errors():
        db = store.db_path()
        if path:
            print(db)
            return
        if not 0 <= count < 2**63:  # (past SQLite's integers: an OverflowError traceback)
            raise ValueError(f"--count must be 0 (all) to {2**63 - 1}, got {count}")
        wanted = store.Search(model=model, query=query, limit=count, request_id=request_id,
                              since=parse_since(since) if since is not None else None)
        retention = store.Retention.from_env() if prune else None
        if db.exists() and not db.is_file():
            raise ValueError(f"{db} is not a file: JUSTLLM_REQUEST_LOG names the database "
                             "file itself")
        if not db.is_file():
            if as_json and not prune:
                print("[]")
            else:
                Console().print(f"no requests logged yet at {escape(str(db))}",
                                highlight=False, soft_wrap=True)
            return
        try:
            conn = store.connect(db) if retention is not None else store.connect_reader(db)
            try:
                if retention is not None:
                    _prune(conn, retention, db)
                    return
                rows = store.search(conn, wanted)
                empty = not rows and store.count(conn) == 0
            finally:
                conn.close()
        except sqlite3.Error as e:
            raise store.RequestLogError(f"{db}: {e}") from None
        if as_json:
            print(json.dumps(rows, indent=2, ensure_ascii=False))
        elif empty:
            Console().print(f"no requests logged yet at {escape(str(db))}", highlight=False,
                            soft_wrap=True)
        elif not rows:
            Console().print("no matching requests", highlight=False)
        else:
            Console().print(_table(rows), highlight=False)


def _prune(conn: sqlite3.Connection, retention: store.Retention, db: Path) -> None:
    deleted = store.prune(conn, retention)
    conn.execute("PRAGMA incremental_vacuum")  # the freed pages back to the file system
    Console().print(f"pruned {deleted} request(s) from {escape(str(db))}; it keeps "
                    f"{retention.describe()} ({store.count(conn)} now)", highlight=False,
                    soft_wrap=True)


def _table(rows: list[dict[str, Any]]) -> Table:
    """Time (local), model, tokens in and out, TTFT, total seconds, finish reason, and the
    prompt and output, cut short, when any row has them."""
    text = any(r["prompt"] is not None or r["output"] is not None for r in rows)
    # The text columns share what the others leave of the terminal's width (expand + ratio);
    # the others keep their natural width.
    table = Table(box=None, pad_edge=False, expand=text)
    table.add_column("TIME", no_wrap=True)
    table.add_column("MODEL", no_wrap=True)
    for name in ("IN", "OUT", "TTFT", "TOTAL"):
        table.add_column(name, justify="right", no_wrap=True)
    table.add_column("FINISH", no_wrap=True)
    if text:
        for name in ("PROMPT", "OUTPUT"):
            table.add_column(name, no_wrap=True, overflow="ellipsis", ratio=1)
    for r in rows:
        finish = escape(r["finish_reason"])
        style = _FINISH_STYLE.get(r["finish_reason"])
        cells = [datetime.fromtimestamp(r["arrived_at"]).strftime(TIME_FORMAT),
                 escape(r["model"] + (f" +{r['lora']}" if r["lora"] else "")),
                 str(r["prompt_tokens"]), str(r["completion_tokens"]),
                 _seconds(r["ttft_seconds"]), _seconds(r["total_seconds"]),
                 f"[{style}]{finish}[/{style}]" if style else finish]
        if text:
            output = r["output"] if r["error"] is None else f"error: {r['error']}"
            cells += [_short(r["prompt"]), _short(output)]
        table.add_row(*cells)
    return table


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


def _short(value: str | None) -> str:
    """One line of at most TEXT_WIDTH characters (whitespace runs become one space)."""
    if value is None:
        return "[dim]-[/dim]"
    line = " ".join(value.split())
    if len(line) > TEXT_WIDTH:
        line = line[:TEXT_WIDTH - 1] + "…"
    return escape(line)
