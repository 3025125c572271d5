"""The request log's SQLite database: where it lives, its schema and migrations, writing one
record, retention, and the queries ``justllm history`` runs.

Several processes write one database (the runner processes of a router-mode gateway), so it is
in WAL mode with a busy timeout: writers wait for each other briefly instead of failing, and
readers never block them. A connection never leaves the thread that opened it (sqlite3's
rule): the writer keeps one per thread (``on_request_finished`` runs on a worker thread of its
own), the CLI opens its own.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from justllm.core.record import RequestRecord
from justllm.errors import JustLLMError

ENV_PATH = "JUSTLLM_REQUEST_LOG"
ENV_MAX_ROWS = "JUSTLLM_REQUEST_LOG_MAX_ROWS"
ENV_MAX_DAYS = "JUSTLLM_REQUEST_LOG_MAX_DAYS"
DEFAULT_MAX_ROWS = 100_000
DEFAULT_MAX_DAYS = 30.0
PRUNE_EVERY = 100  # a writer applies retention on its first insert and every 100th after
BUSY_TIMEOUT_S = 5.0  # how long a writer waits for another process's write to end

# The columns a record fills, in insert order (``id`` is SQLite's rowid).
COLUMNS = ("request_id", "model", "finish_reason", "error", "prompt_tokens",
           "completion_tokens", "cached_tokens", "arrived_at", "arrived_iso", "queued_seconds",
           "prefill_seconds", "decode_seconds", "total_seconds", "ttft_seconds", "lora",
           "params", "prompt", "output", "pid", "http_request_id")


class RequestLogError(JustLLMError):
    """The database cannot be used as it is (a newer schema, not a database): the CLI prints
    it as one red line."""


# ---- where, and how much -------------------------------------------------------------------


def db_path(environ: Mapping[str, str] | None = None) -> Path:
    """``$JUSTLLM_REQUEST_LOG``, else ``$XDG_STATE_HOME/justllm/requests.db`` (XDG: a
    relative XDG_STATE_HOME is ignored), else ``~/.local/state/justllm/requests.db``. Read on
    every call so a test or a shell can point it elsewhere at any time."""
    env = os.environ if environ is None else environ
    explicit = env.get(ENV_PATH)
    if explicit:
        return Path(explicit).expanduser()
    state = env.get("XDG_STATE_HOME", "")
    base = Path(state) if os.path.isabs(state) else Path.home() / ".local" / "state"
    return base / "justllm" / "requests.db"


@dataclass(frozen=True)
class Retention:
    """How much the log keeps: the newest ``max_rows`` rows (0: no limit) of the last
    ``max_days`` days (0: keep forever)."""

    max_rows: int = DEFAULT_MAX_ROWS
    max_days: float = DEFAULT_MAX_DAYS

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Retention:
        env = os.environ if environ is None else environ
        return cls(max_rows=int(_setting(env, ENV_MAX_ROWS, DEFAULT_MAX_ROWS, int)),
                   max_days=_setting(env, ENV_MAX_DAYS, DEFAULT_MAX_DAYS, float))

    def describe(self) -> str:
        rows = f"at most {self.max_rows} rows" if self.max_rows else "any number of rows"
        days = f"the last {self.max_days:g} days" if self.max_days else "forever"
        return f"{rows}, {days}"


_MOST = 2**63 - 1  # SQLite's largest integer


def _setting(env: Mapping[str, str], name: str, default: float,
             kind: Callable[[str], float]) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        value = -1
    if not 0 <= value <= _MOST:  # also NaN; (past SQLite's integers, an OverflowError)
        raise ValueError(f"{name} must be a number from 0 to {_MOST} (0: no limit), "
                         f"got {raw!r}")
    return value


# ---- schema ----------------------------------------------------------------------------------

_V1 = (
    """CREATE TABLE requests (
        id INTEGER PRIMARY KEY,
        request_id TEXT NOT NULL,
        model TEXT NOT NULL,
        finish_reason TEXT NOT NULL,      -- stop, length, abort or error
        error TEXT,
        prompt_tokens INTEGER NOT NULL,
        completion_tokens INTEGER NOT NULL,
        cached_tokens INTEGER NOT NULL,
        arrived_at REAL NOT NULL,         -- Unix time
        arrived_iso TEXT NOT NULL,        -- the same, ISO-8601 UTC
        queued_seconds REAL,
        prefill_seconds REAL,
        decode_seconds REAL,
        total_seconds REAL NOT NULL,
        ttft_seconds REAL,
        lora TEXT NOT NULL DEFAULT '',
        params TEXT NOT NULL DEFAULT '{}',  -- JSON object
        prompt TEXT,                      -- NULL unless the server records text
        output TEXT,
        pid INTEGER NOT NULL
    )""",
    "CREATE INDEX requests_arrived ON requests (arrived_at)",
    "CREATE INDEX requests_model ON requests (model, arrived_at)",
)

# Full-text search over the recorded text, kept by triggers (rows are never updated). The
# trigram tokenizer makes MATCH a case-insensitive substring search, as LIKE is: the same
# answers, with or without the index. Rows without text are left out of the index; the
# delete trigger's WHEN is the insert trigger's, so the two stay in step.
_FTS_V1 = (
    """CREATE VIRTUAL TABLE requests_fts USING fts5(prompt, output, content='requests',
        content_rowid='id', tokenize='trigram')""",
    """CREATE TRIGGER requests_fts_insert AFTER INSERT ON requests
        WHEN new.prompt IS NOT NULL OR new.output IS NOT NULL BEGIN
        INSERT INTO requests_fts (rowid, prompt, output) VALUES (new.id, new.prompt, new.output);
    END""",
    """CREATE TRIGGER requests_fts_delete AFTER DELETE ON requests
        WHEN old.prompt IS NOT NULL OR old.output IS NOT NULL BEGIN
        INSERT INTO requests_fts (requests_fts, rowid, prompt, output)
            VALUES ('delete', old.id, old.prompt, old.output);
    END""",
)


def _fts5_trigram(conn: sqlite3.Connection) -> bool:
    """Whether this SQLite has FTS5 with the trigram tokenizer (3.34+, compiled in)."""
    try:
        conn.execute("CREATE VIRTUAL TABLE temp.fts_probe USING fts5(x, tokenize='trigram')")
    except sqlite3.OperationalError:
        return False
    conn.execute("DROP TABLE temp.fts_probe")
    return True


def _v1(conn: sqlite3.Connection) -> None:
    for sql in _V1:
        conn.execute(sql)
    if _fts5_trigram(conn):  # otherwise `history -q` searches with LIKE
        for sql in _FTS_V1:
            conn.execute(sql)


def _v2(conn: sqlite3.Connection) -> None:
    """The HTTP request's X-Request-Id (rows written before it have NULL)."""
    conn.execute("ALTER TABLE requests ADD COLUMN http_request_id TEXT")
    conn.execute("CREATE INDEX requests_http_request_id ON requests (http_request_id)")


# Migration i takes a database from user_version i to i + 1. Append, never edit: a database
# that is at version n runs MIGRATIONS[n:].
MIGRATIONS: tuple[Callable[[sqlite3.Connection], None], ...] = (_v1, _v2)
SCHEMA_VERSION = len(MIGRATIONS)


def _migrate(conn: sqlite3.Connection) -> None:
    """Bring the schema up to SCHEMA_VERSION, in one write transaction so that two processes
    opening a new database at once migrate it once."""
    if _check_version(conn) == SCHEMA_VERSION:
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        version = _check_version(conn)  # another process may have migrated while we waited
        for step in MIGRATIONS[version:]:
            step(conn)
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def _check_version(conn: sqlite3.Connection) -> int:
    """The database's schema version; one newer than this plugin's is an error (it would
    misread it, and must not write to it)."""
    version = int(conn.execute("PRAGMA user_version").fetchone()[0])
    if version > SCHEMA_VERSION:
        raise RequestLogError(
            f"the request log's schema is version {version}, newer than this "
            f"justllm-request-log knows ({SCHEMA_VERSION}): upgrade the plugin")
    return version


def connect(path: Path) -> sqlite3.Connection:
    """Open (creating it and its directory if need be) and migrate the database. Raises
    RequestLogError, naming the path, when it cannot be: justllm logs and counts that as a
    failed record, the CLI prints it as one line."""
    try:
        return _connect(path)
    except (OSError, sqlite3.Error) as e:
        raise RequestLogError(f"cannot open the request log {path}: {e}") from e


def connect_reader(path: Path) -> sqlite3.Connection:
    """``path`` opened to read (``history``): :func:`connect` switches WAL on and migrates,
    writes that a log this user may only read (a service's) refused ("attempt to write a
    readonly database"). A log whose WAL files cannot be made here is read as it stands on
    disk (``immutable``: no writer has it open, or they would be there); a log of an older
    schema is opened as :func:`connect` opens it, migrated first, and a newer one refused."""
    uri = path.resolve().as_uri()
    conn = None
    try:
        for mode in ("mode=ro", "mode=ro&immutable=1"):
            try:
                conn = sqlite3.connect(f"{uri}?{mode}", uri=True, timeout=BUSY_TIMEOUT_S,
                                       isolation_level=None)
                conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
                version = int(conn.execute("PRAGMA user_version").fetchone()[0])
                break
            except sqlite3.OperationalError:
                if conn is not None:
                    conn.close()
                    conn = None
                if mode.endswith("immutable=1"):
                    raise
    except (OSError, sqlite3.Error) as e:
        raise RequestLogError(f"cannot open the request log {path}: {e}") from e
    assert conn is not None
    if version == SCHEMA_VERSION:
        return conn
    conn.close()
    return connect(path)


def _to_wal(conn: sqlite3.Connection) -> None:
    """The database in WAL mode. Two processes switching a new database at once: SQLite can
    answer the second "database is locked" at once, without its busy timeout (it would
    deadlock otherwise), and a runner's first record failed; tried again until the timeout."""
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    while True:
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _connect(path: Path) -> sqlite3.Connection:
    path.parent.mkdir(parents=True, exist_ok=True)
    # isolation_level=None: each statement commits by itself, transactions are explicit.
    conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
    try:
        conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
        # Only takes effect on a database without tables (a new one): lets `--prune` give
        # freed pages back to the file system.
        conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
        _to_wal(conn)  # persistent; readers never block writers
        conn.execute("PRAGMA synchronous = NORMAL")  # WAL: no fsync per insert
        _migrate(conn)
    except BaseException:
        conn.close()
        raise
    return conn


# ---- writing ---------------------------------------------------------------------------------


def row_of(record: RequestRecord, pid: int | None = None) -> tuple[Any, ...]:
    """The values of COLUMNS for one record."""
    arrived = datetime.fromtimestamp(record.arrived_at, UTC)
    return (record.request_id, record.model, record.finish_reason, record.error,
            record.prompt_tokens, record.completion_tokens, record.cached_tokens,
            record.arrived_at, arrived.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            record.queued_seconds, record.prefill_seconds, record.decode_seconds,
            record.total_seconds, record.ttft_seconds, record.lora,
            json.dumps(dict(record.params), sort_keys=True, default=str),
            record.prompt, record.output, os.getpid() if pid is None else pid,
            record.http_request_id)


_INSERT = (f"INSERT INTO requests ({', '.join(COLUMNS)}) "
           f"VALUES ({', '.join('?' for _ in COLUMNS)})")


class _Writer(threading.local):
    """This thread's connection, the path it was opened for, and its inserts so far."""

    path: Path | None = None
    conn: sqlite3.Connection | None = None
    inserts: int = 0

    def drop(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.path, self.conn, self.inserts = None, None, 0


_writer = _Writer()


def log_record(record: RequestRecord, environ: Mapping[str, str] | None = None) -> None:
    """Insert one record (one short write transaction), then apply retention on this
    connection's first insert and every PRUNE_EVERY-th: cheap enough to run per request. The
    connection is reopened when the path changes or the file was removed (``rm requests.db``
    starts a new log) and after a database error. A bad retention setting raises after the
    insert (the row is kept; justllm logs the error) whenever retention is due."""
    path = db_path(environ)
    w = _writer
    if w.conn is None or w.path != path or not path.exists():
        w.drop()
        w.conn, w.path = connect(path), path
    try:
        w.conn.execute(_INSERT, row_of(record))
    except sqlite3.Error as e:
        w.drop()
        raise RequestLogError(f"cannot write to the request log {path}: {e}") from e
    w.inserts += 1
    if w.inserts % PRUNE_EVERY == 1:
        try:
            prune(w.conn, Retention.from_env(environ))
        except sqlite3.Error as e:  # (the row is written: it said "cannot write")
            w.drop()
            raise RequestLogError(f"the request was logged, but the retention limits could "
                                  f"not be applied to {path}: {e}") from e


def prune(conn: sqlite3.Connection, retention: Retention, now: float | None = None) -> int:
    """Delete what ``retention`` does not keep; returns how many rows went."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        deleted = 0
        if retention.max_days > 0:
            cutoff = (time.time() if now is None else now) - retention.max_days * 86400
            deleted += conn.execute("DELETE FROM requests WHERE arrived_at < ?",
                                    (cutoff,)).rowcount
        if retention.max_rows > 0:  # by id: the order rows were written in
            deleted += conn.execute(
                "DELETE FROM requests WHERE id <= "
                "(SELECT id FROM requests ORDER BY id DESC LIMIT 1 OFFSET ?)",
                (retention.max_rows,)).rowcount
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
    return deleted


# ---- reading ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Search:
    """What ``justllm history`` asks for: newest first, at most ``limit`` rows (0: all)."""

    model: str | None = None
    query: str | None = None  # a substring of the prompt or output text
    since: float | None = None  # Unix time
    # A request's X-Request-Id, or its response id (``chatcmpl-...``; a request with several
    # choices has a row per choice, ``ID-0``, ``ID-1``...).
    request_id: str | None = None
    limit: int = 20


def has_fts(conn: sqlite3.Connection) -> bool:
    return conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'requests_fts'"
                        ).fetchone() is not None


def search(conn: sqlite3.Connection, s: Search) -> list[dict[str, Any]]:
    """The matching rows as dicts (``params`` parsed), newest first."""
    where: list[str] = []
    args: list[Any] = []
    if s.model is not None:
        where.append("model = ?")
        args.append(s.model)
    if s.since is not None:
        where.append("arrived_at >= ?")
        args.append(s.since)
    if s.request_id is not None:
        where.append("(http_request_id = ? OR request_id = ? OR request_id GLOB ?)")
        args += [s.request_id, s.request_id,
                 re.sub(r"([*?\[])", r"[\1]", s.request_id) + "-[0-9]*"]
    if s.query:
        # FTS5 when the database has the index; trigrams cannot match fewer than three
        # characters, so a shorter query (and a database without the index) uses LIKE.
        if len(s.query) >= 3 and has_fts(conn):
            where.append("id IN (SELECT rowid FROM requests_fts WHERE requests_fts MATCH ?)")
            args.append('"' + s.query.replace('"', '""') + '"')  # one phrase, no operators
        else:
            pattern = "%" + re.sub(r"([\\%_])", r"\\\1", s.query) + "%"
            where.append("(prompt LIKE ? ESCAPE '\\' OR output LIKE ? ESCAPE '\\')")
            args += [pattern, pattern]
    sql = f"SELECT id, {', '.join(COLUMNS)} FROM requests"
    if where:
        sql += " WHERE " + " AND ".join(where)
    sql += " ORDER BY arrived_at DESC, id DESC"
    if s.limit:
        sql += " LIMIT ?"
        args.append(s.limit)
    cur = conn.execute(sql, args)
    names = [d[0] for d in cur.description]
    rows = [dict(zip(names, values, strict=True)) for values in cur.fetchall()]
    for row in rows:
        try:
            row["params"] = json.loads(row["params"])
        except (TypeError, ValueError):
            pass  # shown as stored
    return rows


def count(conn: sqlite3.Connection) -> int:
    return int(conn.execute("SELECT count(*) FROM requests").fetchone()[0])
