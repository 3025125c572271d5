"""A --url no request could go to is one error line for every command that takes one, before
anything runs (justllm.chat.backends.check_url): a malformed one was an httpx.InvalidURL
traceback (ps, chat, bench), a port beyond 65535 an ExceptionGroup traceback (bench), and a
URL without http:// a table of dashes before the error (bench)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from justllm.cli import app

runner = CliRunner()

BAD = [
    ("http://[::1", "--url 'http://[::1' is not a valid URL: Invalid port"),
    ("http://127.0.0.1:99999", "--url 'http://127.0.0.1:99999': the port must be in 1-65535 "
                               "(got 99999)"),
    ("notaurl", "--url must start with http:// or https://, got 'notaurl'"),
    ("http://", "--url 'http://' names no host"),
    ("http://a..b", "--url 'http://a..b': 'a..b' is not a valid host name"),
]


def _one_error_line(r) -> str:
    assert r.exit_code == 1, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    return lines[0]


@pytest.mark.parametrize("command", [["ps"], ["chat"], ["bench", "-n", "1"]])
@pytest.mark.parametrize("url, says", BAD)
def test_a_bad_url_is_one_line(command, url, says):
    r = runner.invoke(app, [*command, "--url", url], input="hi\n")
    assert _one_error_line(r).startswith(f"error: {says}")


def test_bench_checks_vs_too_before_running():
    r = runner.invoke(app, ["bench", "--url", "http://127.0.0.1:9", "--vs", "http://[::1",
                            "-n", "1"])
    assert "error: --vs 'http://[::1' is not a valid URL" in _one_error_line(r)


def test_a_good_url_still_reaches_the_network():
    """An IPv6 address, a path, an upper-case scheme pass the check (and nothing listens)."""
    for url in ("http://[::1]:9", "HTTP://127.0.0.1:9/v1"):
        assert "cannot reach" in _one_error_line(runner.invoke(app, ["ps", "--url", url]))


def test_logs_refuses_a_negative_line_count():
    """(``-n -1`` printed nothing and exited 0, as if the log were empty.)"""
    r = runner.invoke(app, ["logs", "any", "-n", "-1"])
    assert _one_error_line(r) == "error: --lines must be 0 or more (got -1)"


@pytest.mark.parametrize("replica, says", [
    ("abc", "valid integer"), ("-1", "greater than or equal")])
def test_logs_refuses_a_replica_that_is_no_number(replica, says):
    """(``--replica abc`` was taken, and said there was no log for "replica abc".)"""
    r = runner.invoke(app, ["logs", "any", "--replica", replica])
    assert r.exit_code != 0 and "--replica" in r.output and says in r.output, r.output

