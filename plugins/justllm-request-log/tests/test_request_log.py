"""justllm-request-log against the real demo model: an engine in this process, a real
``justllm serve`` with the plugin loaded from its entry point, and ``justllm history`` run as
the console script."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from justllm.config import EngineConfig
from justllm.core.record import RequestRecord
from justllm.core.sampling_params import SamplingParams
from justllm.engine.engine import Engine, RequestOutput
from justllm.models.source import demo_model_path
from justllm.plugins import load_plugins
from prometheus_client.parser import text_string_to_metric_families

from justllm_request_log import on_request_finished, store

JUSTLLM = str(Path(sys.executable).with_name("justllm"))
PLUGIN = "justllm-request-log"


# ---- fixtures and helpers ---------------------------------------------------------------------


@pytest.fixture
def db(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Only this plugin, logging to a fresh database; nothing from the user's settings."""
    for name in [n for n in os.environ if n.startswith("JUSTLLM_") and n != "JUSTLLM_CACHE_DIR"]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("JUSTLLM_PLUGINS", PLUGIN)
    path = tmp_path / "log" / "requests.db"
    monkeypatch.setenv("JUSTLLM_REQUEST_LOG", str(path))
    yield path
    store._writer.drop()  # this thread's connection, if a test wrote from it


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    eng = Engine(EngineConfig(model=str(demo_model_path()), max_seqs=4, pool_blocks=64))
    yield eng
    eng.close()


def rows(path: Path) -> list[dict[str, Any]]:
    """Every row, oldest first, straight from SQLite."""
    conn = sqlite3.connect(path)
    conn.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in conn.execute("SELECT * FROM requests ORDER BY id")]
    finally:
        conn.close()


def history(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([JUSTLLM, "history", *args], capture_output=True, text=True,
                          timeout=60)


def history_json(*args: str) -> list[dict[str, Any]]:
    done = history("--json", *args)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def record(i: int, arrived_at: float | None = None) -> RequestRecord:
    return RequestRecord(
        request_id=f"r{i}", model="m", finish_reason="stop", prompt_tokens=3,
        completion_tokens=i, cached_tokens=0,
        arrived_at=time.time() if arrived_at is None else arrived_at, queued_seconds=0.0,
        prefill_seconds=0.1, decode_seconds=0.2, total_seconds=0.3)


def drive(engine: Engine, abort_after_first_step: str | None = None
          ) -> dict[str, list[RequestOutput]]:
    """Step until every request is done; ``abort_after_first_step`` is aborted after the
    first step (it has been scheduled, maybe produced a token)."""
    outputs: dict[str, list[RequestOutput]] = {}
    first = True
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        if first and abort_after_first_step is not None:
            assert engine.abort(abort_after_first_step)
        first = False
    return outputs


# ---- in process -------------------------------------------------------------------------------


def test_engine_records_become_rows(db: Path, engine: Engine) -> None:
    plugins = load_plugins()
    assert [p.name for p in plugins.info()] == [PLUGIN], plugins.problems
    events = plugins.request_events()
    assert events is not None
    engine.observe(events, text=True)
    try:
        stop = engine.add_request("The capital of France is",
                                  SamplingParams(max_tokens=24, stop=["."]))
        length = engine.add_request("Once upon a time", SamplingParams(max_tokens=6,
                                                                     ignore_eos=True))
        aborted = engine.add_request("Count: 1, 2, 3,", SamplingParams(max_tokens=50))
        outputs = drive(engine, abort_after_first_step=aborted)
    finally:
        engine.observe(None)
    events.close()
    assert events.counts()[PLUGIN].delivered == 3

    logged = {r["request_id"]: r for r in rows(db)}
    assert set(logged) == {stop, length, aborted}
    for rid, reason in ((stop, "stop"), (length, "length")):
        outs, row = outputs[rid], logged[rid]
        assert outs[-1].finished and outs[-1].finish_reason == row["finish_reason"] == reason
        assert row["completion_tokens"] == sum(len(o.token_ids) for o in outs)
        assert row["prompt_tokens"] == outs[-1].metrics.num_prompt_tokens
        assert row["cached_tokens"] == outs[-1].metrics.num_cached_tokens
        assert row["output"] == "".join(o.text for o in outs)
        assert row["ttft_seconds"] == pytest.approx(row["queued_seconds"]
                                                    + row["prefill_seconds"])
        assert 0 < row["ttft_seconds"] <= row["total_seconds"]
    assert logged[length]["completion_tokens"] == 6
    assert logged[stop]["prompt"] == "The capital of France is"
    assert json.loads(logged[length]["params"])["max_tokens"] == 6
    row = logged[aborted]
    assert row["finish_reason"] == "abort" and row["prompt"] == "Count: 1, 2, 3,"
    assert row["completion_tokens"] == sum(len(o.token_ids) for o in outputs.get(aborted, []))
    for r in logged.values():
        assert r["model"] == "gemma-3-270m-q4_k_m" and r["pid"] == os.getpid()
        assert r["error"] is None and r["lora"] == ""
        assert abs(r["arrived_at"] - time.time()) < 120
        assert r["arrived_iso"].endswith("Z") and r["arrived_iso"].startswith(
            time.strftime("%Y-%m-%dT%H", time.gmtime(r["arrived_at"])))

    # Without --record-text the text columns are NULL.
    events = plugins.request_events()
    assert events is not None
    engine.observe(events, text=False)
    try:
        quiet = engine.add_request("Hello", SamplingParams(max_tokens=2, ignore_eos=True))
        drive(engine)
    finally:
        engine.observe(None)
    events.close()
    row = {r["request_id"]: r for r in rows(db)}[quiet]
    assert row["prompt"] is None and row["output"] is None and row["completion_tokens"] == 2

    conn = sqlite3.connect(db)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA user_version").fetchone()[0] == store.SCHEMA_VERSION
    finally:
        conn.close()


# ---- a real server ----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    model: str

    def records(self, outcome: str) -> float:
        """justllm_plugin_request_records_total for this plugin and ``outcome``."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "justllm_plugin_request_records_total" and \
                        s.labels == {"plugin": PLUGIN, "outcome": outcome,
                                     "model_name": self.model}:
                    return s.value
        raise AssertionError(f"no justllm_plugin_request_records_total for {outcome}")

    def wait_records(self, outcome: str, n: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self.records(outcome) < n:
            assert time.monotonic() < deadline, f"fewer than {n} {outcome} records"
            time.sleep(0.1)


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Any]:
    """``serve(*args)`` starts ``justllm serve`` (the demo model) with the test's environment;
    every server started is stopped (SIGTERM, then SIGKILL) when the test ends."""
    started: list[subprocess.Popen[bytes]] = []

    def start(*args: str) -> Server:
        port = free_port()
        with open(tmp_path / f"serve-{port}.log", "wb") as log:  # the child keeps its copy
            proc = subprocess.Popen([JUSTLLM, "serve", "--port", str(port), *args],
                                    stdout=log, stderr=subprocess.STDOUT)
        started.append(proc)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (tmp_path / f"serve-{port}.log").read_text()
            assert time.monotonic() < deadline, "the server did not become healthy"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        return Server(proc, url, model)

    try:
        yield start
    finally:
        for proc in started:
            stop(proc)


def stop(proc: subprocess.Popen[bytes]) -> int | None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None


def test_serve_logs_requests_and_history_finds_them(db: Path, serve: Any) -> None:
    server = serve("--record-text")
    with httpx.Client(base_url=server.url, timeout=120) as client:
        completion = client.post("/v1/completions", json={
            "model": server.model, "prompt": "The capital of France is", "max_tokens": 8,
        }).json()
        chat_answer = client.post("/v1/chat/completions", headers={"X-Request-Id": "trace-42"}, json={
            "model": server.model, "max_tokens": 8,
            "messages": [{"role": "user", "content": "Say hello to Zanzibar."}],
        })
        chat = chat_answer.json()
        ollama = client.post("/api/generate", json={  # Ollama's answers carry no id
            "model": server.model, "prompt": "Name a colour.", "stream": False,
            "options": {"num_predict": 4}})
        assert ollama.status_code == 200, ollama.text
        with client.stream("POST", "/v1/completions", json={
            "model": server.model, "prompt": "Count to a thousand: 1, 2,", "max_tokens": 400,
            "ignore_eos": True, "stream": True,
        }) as streamed:
            assert streamed.status_code == 200
            for line in streamed.iter_lines():
                if line.startswith("data: "):
                    break  # one chunk, then the client goes away
    server.wait_records("delivered", 4)  # the abort has reached the plugin
    assert stop(server.proc) == 0  # SIGTERM: what is still queued is written first

    logged = history_json()
    assert len(logged) == 4
    told = next(r for r in logged if r["prompt"] and "Name a colour." in r["prompt"])
    # its own id, unique across restarts (it was the engine's req-N, from 1 in every process)
    assert told["request_id"].startswith("ollama-") and len(told["request_id"]) == 39
    assert told["http_request_id"] == ollama.headers["x-request-id"]
    logged.remove(told)
    aborted = logged[0]  # newest first: the streamed one came last
    assert aborted["finish_reason"] == "abort"
    assert aborted["prompt"] == "Count to a thousand: 1, 2,"
    assert 1 <= aborted["completion_tokens"] < 400
    plain = next(r for r in logged if r["prompt"] == "The capital of France is")
    talk = next(r for r in logged if r["prompt"] and "Zanzibar" in r["prompt"])
    for row, answer, text in ((plain, completion, completion["choices"][0]["text"]),
                              (talk, chat, chat["choices"][0]["message"]["content"])):
        assert row["prompt_tokens"] == answer["usage"]["prompt_tokens"]
        assert row["completion_tokens"] == answer["usage"]["completion_tokens"]
        assert row["finish_reason"] == answer["choices"][0]["finish_reason"]
        assert row["output"].strip() == text.strip()
        assert row["model"] == server.model and row["pid"] == server.proc.pid

    found = history_json("-q", "zanzibar")  # any case
    assert [r["id"] for r in found] == [talk["id"]]
    # the X-Request-Id the answer carried: the client's own, else the server's
    assert chat_answer.headers["x-request-id"] == talk["http_request_id"] == "trace-42"
    assert plain["http_request_id"].startswith("req_")
    assert [r["id"] for r in history_json("--id", "trace-42")] == [talk["id"]]
    assert [r["id"] for r in history_json("--id", completion["id"])] == [plain["id"]]
    assert history_json("--id", "trace-4") == []
    assert history_json("-q", "no such text anywhere") == []
    assert len(history_json("--model", server.model)) == 4
    assert history_json("--model", "another-model") == []
    assert [r["id"] for r in history_json("-n", "1")] == [logged[0]["id"]]
    assert len(history_json("--since", "1h")) == 4

    table = history()
    assert table.returncode == 0 and server.model in table.stdout
    assert "abort" in table.stdout


def test_each_justllm_run_is_its_own_request(db: Path) -> None:
    """Every run was recorded as request "run": ``history --id run`` found them all."""
    for prompt in ("The capital of France is", "Two plus two is"):
        done = subprocess.run([JUSTLLM, "run", str(demo_model_path()), "-p", prompt, "--raw",
                               "-n", "2", "--pool-blocks", "64", "--record-text"],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
    logged = history_json()
    ids = [r["request_id"] for r in logged]
    assert len(set(ids)) == 2 and all(i.startswith("run-") for i in ids), ids
    assert [r["prompt"] for r in history_json("--id", ids[0])] == ["Two plus two is"]


def test_each_chat_answer_is_its_own_request_with_its_text(db: Path) -> None:
    """Every chat began again at req-0 (history --id req-0 found answers of every chat), and
    JUSTLLM_RECORD_TEXT was ignored: no prompt or answer text."""
    for _ in range(2):
        done = subprocess.run([JUSTLLM, "chat", str(demo_model_path()), "-n", "2",
                               "--pool-blocks", "64", "--record-text"],
                              input="Hello\nAgain\n", capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
    logged = history_json()
    ids = [r["request_id"] for r in logged]
    assert len(set(ids)) == 4 and all(i.startswith("chat-") for i in ids), ids
    sessions = {i.rsplit("-", 1)[0] for i in ids}
    assert len(sessions) == 2 and sorted(i.rsplit("-", 1)[1] for i in ids) == ["0", "0", "1", "1"]
    assert all(r["prompt"] and "Hello" in r["prompt"] and r["output"] is not None
               for r in logged)


def test_unwritable_log_does_not_break_serving(tmp_path: Path, db: Path, serve: Any,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("JUSTLLM_REQUEST_LOG", str(blocker / "requests.db"))
    server = serve()
    r = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": server.model, "prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    server.wait_records("failed", 1)
    assert server.records("delivered") == 0
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


# ---- retention, concurrency, the command line -------------------------------------------------


def test_retention_by_rows_and_days(db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JUSTLLM_REQUEST_LOG_MAX_ROWS", "5")
    old = time.time() - 40 * 86400
    on_request_finished(record(0, arrived_at=old))  # the first insert prunes: by days
    assert [r["request_id"] for r in rows(db)] == []
    for i in range(1, 151):  # and every 100th: by rows
        on_request_finished(record(i))
    kept = [r["request_id"] for r in rows(db)]
    # the 101st insert (r100) kept r96..r100; r101..r150 came after
    assert kept == [f"r{i}" for i in range(96, 151)]

    monkeypatch.setenv("JUSTLLM_REQUEST_LOG_MAX_ROWS", "3")
    done = history("--prune")
    assert done.returncode == 0 and "pruned 52 request(s)" in done.stdout
    assert [r["request_id"] for r in rows(db)] == ["r148", "r149", "r150"]

    monkeypatch.setenv("JUSTLLM_REQUEST_LOG_MAX_DAYS", "0")  # forever
    monkeypatch.setenv("JUSTLLM_REQUEST_LOG_MAX_ROWS", "0")  # any number
    store._writer.drop()
    on_request_finished(record(200, arrived_at=old))
    assert len(rows(db)) == 4


def test_several_processes_write_one_database(db: Path) -> None:
    """Router mode: runner processes log to one file at once (WAL and a busy timeout)."""
    script = textwrap.dedent("""
        import sys, time
        from justllm.core.record import RequestRecord
        from justllm_request_log import on_request_finished
        for i in range(200):
            on_request_finished(RequestRecord(
                request_id=f"{sys.argv[1]}-{i}", model="m", finish_reason="stop",
                prompt_tokens=1, completion_tokens=1, cached_tokens=0, arrived_at=time.time(),
                queued_seconds=None, prefill_seconds=None, decode_seconds=None,
                total_seconds=0.0))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script, name]) for name in ("a", "b")]
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    logged = rows(db)
    assert len(logged) == 400 and len({r["pid"] for r in logged}) == 2


@pytest.mark.parametrize("args", [("--since", "yesterday-ish"), ("-n", "-1"),
                                  ("--since", "0001-01-01"),  # (a year-0 error)
                                  ("-n", str(10**23))])  # (an OverflowError traceback)
def test_bad_history_input_is_one_error_line(db: Path, args: tuple[str, ...]) -> None:
    done = history(*args)
    assert done.returncode == 1 and done.stdout == ""
    assert len(done.stderr.splitlines()) == 1 and done.stderr.startswith("error:")
    if args[0] == "--since":  # (the year-0 one did not say which option)
        assert done.stderr.startswith("error: --since: "), done.stderr


def test_history_without_a_database(db: Path) -> None:
    done = history()
    assert done.returncode == 0 and f"no requests logged yet at {db}" in done.stdout
    assert history_json() == []
    assert history("--path").stdout.strip() == str(db)
    assert not db.exists()
    db.mkdir(parents=True)  # a directory given for the file: said, not "nothing logged yet"
    done = history()
    assert done.returncode == 1 and done.stderr.startswith(f"error: {db} is not a file"), done


def test_newer_schema_is_refused(db: Path) -> None:
    db.parent.mkdir()
    conn = sqlite3.connect(db)
    conn.execute(f"PRAGMA user_version = {store.SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(store.RequestLogError, match="newer"):
        on_request_finished(record(1))
    done = history()
    assert done.returncode == 1 and "newer" in done.stderr


def test_a_first_version_database_is_migrated_and_keeps_its_rows(db: Path) -> None:
    """Version 2 added the X-Request-Id column; a version 1 log is brought up to date."""
    db.parent.mkdir()
    conn = sqlite3.connect(db)
    store.MIGRATIONS[0](conn)
    conn.execute("PRAGMA user_version = 1")
    old = dict(zip(store.COLUMNS, store.row_of(record(1)), strict=True))
    del old["http_request_id"]
    conn.execute(f"INSERT INTO requests ({', '.join(old)}) VALUES "
                 f"({', '.join('?' * len(old))})", list(old.values()))
    conn.commit()
    conn.close()
    on_request_finished(record(2))
    rows = history_json()
    assert [r["request_id"] for r in rows] == ["r2", "r1"]
    assert rows[1]["http_request_id"] is None
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == store.SCHEMA_VERSION == 2
    conn.close()


def test_default_path_follows_xdg_state_home(tmp_path: Path) -> None:
    assert store.db_path({"XDG_STATE_HOME": str(tmp_path)}) == \
        tmp_path / "justllm" / "requests.db"
    assert store.db_path({"XDG_STATE_HOME": "relative"}) == \
        Path.home() / ".local" / "state" / "justllm" / "requests.db"
    assert store.db_path({"JUSTLLM_REQUEST_LOG": "~/x.db"}) == Path.home() / "x.db"


def test_bad_retention_setting_keeps_the_row_and_says_so(db: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JUSTLLM_REQUEST_LOG_MAX_ROWS", "lots")
    with pytest.raises(ValueError, match="JUSTLLM_REQUEST_LOG_MAX_ROWS"):
        on_request_finished(record(1))
    assert len(rows(db)) == 1
    done = history("--prune")
    assert done.returncode == 1 and len(done.stderr.splitlines()) == 1
    assert "JUSTLLM_REQUEST_LOG_MAX_ROWS must be a number from 0 to 9223372036854775807" \
        in done.stderr
    # past SQLite's integers: an OverflowError traceback, on history and in a server
    monkeypatch.setenv("JUSTLLM_REQUEST_LOG_MAX_ROWS", str(10**23))
    with pytest.raises(ValueError, match="JUSTLLM_REQUEST_LOG_MAX_ROWS must be a number from"):
        store.Retention.from_env()
    done = history("--prune")
    assert done.returncode == 1 and len(done.stderr.splitlines()) == 1, done.stderr


def test_a_retention_failure_says_the_row_was_written(db: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A prune that met a locked database said "cannot write", though the row was in."""
    def locked(*args: Any, **kwargs: Any) -> int:
        raise sqlite3.OperationalError("database is locked")

    monkeypatch.setattr(store, "prune", locked)
    monkeypatch.setattr(store._writer, "inserts", 0)  # the next insert prunes
    with pytest.raises(store.RequestLogError, match="the request was logged, but the "
                                                     "retention limits could not be applied"):
        on_request_finished(record(7))
    assert [r["request_id"] for r in rows(db)] == ["r7"]


def test_history_reads_a_log_this_user_may_only_read(db: Path) -> None:
    """A service's log, readable by others: `history` opened it as the writer does (WAL
    switch, migration) and said "attempt to write a readonly database"."""
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        pytest.skip("root without setpriv: a permission cannot be denied")
    on_request_finished(record(1))
    on_request_finished(record(2))
    store._writer.drop()  # (the last connection: its WAL files go)
    unprivileged = ([shutil.which("setpriv") or "", "--bounding-set",
                     "-dac_override,-dac_read_search"] if os.geteuid() == 0 else [])
    folder = db.parent
    db.chmod(0o444)
    folder.chmod(0o555)  # (no WAL files can be made beside it either)
    try:
        done = subprocess.run([*unprivileged, JUSTLLM, "history", "--json"],
                              capture_output=True, text=True, timeout=60)
    finally:
        folder.chmod(0o755)
        db.chmod(0o644)
    assert done.returncode == 0, done.stderr
    assert [r["request_id"] for r in json.loads(done.stdout)] == ["r2", "r1"]
