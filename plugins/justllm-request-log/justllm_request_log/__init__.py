"""justllm-request-log: every finished request in a SQLite database, and ``justllm history`` to
browse and search it (after simonw/llm's ``llm logs``).

The entry point names this module: pluggy registers its two ``@hookimpl`` functions. Importing
it stays cheap (every ``justllm`` command loads the installed plugins); the command's module is
imported only when the command line is built.
"""

from __future__ import annotations

from typing import Any

from justllm.plugins import RequestRecord, hookimpl

from justllm_request_log.store import db_path, log_record

__version__ = "0.1.0"
__all__ = ["db_path", "on_request_finished", "register_commands"]


@hookimpl
def on_request_finished(record: RequestRecord) -> None:
    """One row per finished request. Runs on this plugin's own worker thread; an error (a
    database that cannot be opened or written) propagates, for justllm to log and count as a
    failed record, while serving goes on."""
    log_record(record)


@hookimpl
def register_commands(cli: Any) -> None:
    """``justllm history``."""
    from justllm_request_log.history import history

    cli.command("history")(history)
