"""``justllm bench`` against a real server: every field printed, JSON that parses."""

import json
import signal

import pytest
from typer.testing import CliRunner

from justllm.cli import app
from tests.server.conftest import start_server

runner = CliRunner()
FIELDS = ["Successful requests", "Failed requests", "Request throughput", "Output token throughput",
          "Total token throughput", "Mean TTFT", "Median TTFT", "P90 TTFT", "P99 TTFT",
          "Mean TPOT", "P99 TPOT", "Mean ITL", "P99 ITL", "Mean E2E latency", "P99 E2E latency",
          "Prefix cache hit ratio", "Speculation acceptance"]


@pytest.fixture(scope="module")
def server(model_path):
    s = start_server(model_path, "--max-seqs", "4", "--pool-blocks", "256")
    yield s
    assert s.stop() == 0


def test_bench_random_prints_every_field_and_json(server, tmp_path):
    out = tmp_path / "bench.json"
    r = runner.invoke(app, ["bench", "--url", server.url, "-n", "6", "-c", "3", "--output-len", "5",
                            "--input-len", "12", "--json", str(out)])
    assert r.exit_code == 0, r.output
    for field in FIELDS:
        assert field in r.output, field
    data = json.loads(out.read_text())
    assert data["completed"] == 6 and data["failed"] == 0
    assert data["total_output_tokens"] == 30
    assert data["mean_ttft_ms"] > 0 and data["p99_e2el_ms"] >= data["median_e2el_ms"]
    assert data["output_throughput"] > 0


def test_bench_shared_prefix_reports_cache_hits_and_vs(server, tmp_path):
    out = tmp_path / "vs.json"
    r = runner.invoke(app, ["bench", "--url", server.url, "--vs", server.url, "--workload",
                            "shared-prefix", "--prefix-len", "200", "-n", "4", "-c", "2",
                            "--output-len", "3", "--input-len", "5", "--request-rate", "50",
                            "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert "ratio" in r.output
    first, second = json.loads(out.read_text())
    assert first["completed"] == second["completed"] == 4
    assert second["prefix_cache_hit_ratio"] == 1.0  # the second run finds the prefix cached
    assert second["prefix_cache_token_hit_ratio"] > 0.8


def test_bench_sharegpt_file_and_errors(server, tmp_path):
    data = [{"conversations": [{"from": "human", "value": f"Hello number {i}"},
                               {"from": "gpt", "value": "Hi there friend"}]} for i in range(3)]
    f = tmp_path / "sg.json"
    f.write_text(json.dumps(data))
    out = tmp_path / "sg-out.json"
    r = runner.invoke(app, ["bench", "--url", server.url, "--dataset", str(f), "-n", "3",
                            "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text())["total_output_tokens"] == 9  # 3 replies of 3 words
    bad = runner.invoke(app, ["bench", "--url", server.url, "--workload", "nope"])
    assert bad.exit_code == 1 and bad.output.startswith("error: unknown workload")
    dead = runner.invoke(app, ["bench", "--url", "http://127.0.0.1:9", "-n", "2", "--json",
                               str(tmp_path / "dead.json")])
    # Nothing measured is a failed benchmark (it exited 0), its results still written.
    assert dead.exit_code == 1 and "every request failed at http://127.0.0.1:9" in dead.output
    assert json.loads((tmp_path / "dead.json").read_text())["failed"] == 2
    # Found out before a run: --output-len 0 (it became 128), a --json in no directory (the
    # run's results were lost to a traceback at the end).
    for args in (["--output-len", "0"], ["--json", str(tmp_path / "nowhere" / "x.json")],
                 ["x.gguf"], ["--max-seqs", "4"]):  # with --url both were dropped
        r = runner.invoke(app, ["bench", "--url", server.url, "-n", "1", *args])
        assert r.exit_code == 1 and r.output.startswith("error: "), r.output
    # An OpenAI-style base URL, as clients are given it (it was a 404 on every request).
    r = runner.invoke(app, ["bench", "--url", server.url + "/v1/", "-n", "1", "--output-len", "2",
                            "--json", str(tmp_path / "v1.json")])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "v1.json").read_text())["completed"] == 1


def test_bench_sends_the_sampling_fields_it_is_given_and_only_those(server, tmp_path):
    from justllm.bench.runner import request_body
    from justllm.bench.workloads import BenchRequest

    req = BenchRequest("hi", 4)
    assert request_body(req, None, {})["temperature"] == 0
    body = request_body(req, "m", {"temperature": 0.8, "top_p": 0.95})
    assert body["temperature"] == 0.8 and body["top_p"] == 0.95 and body["model"] == "m"
    assert "top_k" not in body and "min_p" not in body
    out = tmp_path / "sampled.json"
    r = runner.invoke(app, ["bench", "--url", server.url, "-n", "2", "-c", "2", "--output-len",
                            "4", "--temperature", "0.8", "--top-p", "0.95", "--top-k", "40",
                            "--min-p", "0.05", "--json", str(out)])
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    assert data["completed"] == 2 and data["total_output_tokens"] == 8
    assert data["sampling"] == {"temperature": 0.8, "top_p": 0.95, "top_k": 40, "min_p": 0.05}
    bad = runner.invoke(app, ["bench", "--url", server.url, "--top-p", "1.5"])
    assert bad.exit_code == 1 and bad.output.startswith("error: --top-p must be in [0, 1]")


def test_bench_without_a_url_serves_the_model_itself_and_stops_it(model_path, tmp_path):
    """``justllm bench MODEL`` starts ``justllm serve`` on a free port, measures it and stops
    it; a model the server cannot load is one error line naming the server's own."""
    import os

    from tests.helpers import children

    before = children(os.getpid())
    out = tmp_path / "local.json"
    r = runner.invoke(app, ["bench", model_path, "--max-seqs", "2", "-n", "2", "-c", "2",
                            "--input-len", "8", "--output-len", "3", "--json", str(out)])
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    assert data["completed"] == 2 and data["total_output_tokens"] == 6
    assert data["url"].startswith("http://127.0.0.1:")
    assert children(os.getpid()) == before
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model at all")
    r = runner.invoke(app, ["bench", str(bad), "-n", "1"])
    last = r.output.strip().splitlines()[-1]
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert last == (f"error: the local server failed: {bad} is not a GGUF file (no GGUF magic "
                    "at its start)"), r.output
    assert children(os.getpid()) == before


def test_prompt_lengths_are_bounded_and_refused_before_anything_is_built(monkeypatch):
    """Every prompt is built before the run: --input-len 999999999 hung building them, and
    --prefix-len -5 was taken without a word. Nothing listens at the --url: a refusal is the
    only line, before any request."""
    from justllm.bench import workloads

    url = ["--url", "http://127.0.0.1:9", "-n", "1"]
    for args, says in (
            (["--input-len", str((1 << 20) + 1)], "--input-len must be at most 1048576 words"),
            (["--workload", "shared-prefix", "--prefix-len", str((1 << 20) + 1)],
             "--prefix-len must be at most 1048576 words"),
            (["--prefix-len", "-5"], "--prefix-len must be >= 0"),
            # found by an audit: each ran the bench first (nan ran to its end)
            (["--request-rate", "nan"], "--request-rate must be a finite number of requests "
                                        "per second, at least 0.001"),
            (["--json", "/proc/x.json"], "--json: cannot write to /proc: "),
            (["--json", "/tmp"], "--json: /tmp is a directory; give a file path"),
            # (each is a task made before the run: 67 million passed the checks)
            (["-n", "100001"], "--num-requests must be at most 100000"),
            (["--workload", "shared-prefix", "--prefix-len", "1048000", "--input-len", "1000"],
             "--prefix-len + --input-len must be at most 1048576 words (about a token each: "
             "more than any model's context), got 1049000")):
        r = runner.invoke(app, ["bench", *url, *args])
        assert r.exit_code == 1 and r.output.startswith(f"error: {says}"), (args, r.output)
        assert len(r.output.strip().splitlines()) == 1, r.output
    assert workloads.MAX_PROMPT_WORDS == 1 << 20  # more than any model's context
    # All prompts together are bounded too (the real bound, 2**26 words, is ~400 MB of text).
    monkeypatch.setattr(workloads, "MAX_TOTAL_WORDS", 1000)
    r = runner.invoke(app, ["bench", *url[:2], "-n", "11", "--input-len", "100"])
    assert r.exit_code == 1 and r.output.startswith(
        "error: --num-requests 11 prompts of 100 words are 1100 words, more than the 1000"), r.output
    r = runner.invoke(app, ["bench", *url[:2], "-n", "10", "--workload", "shared-prefix",
                            "--prefix-len", "50", "--input-len", "51"])
    assert r.output.startswith("error: --num-requests 10 prompts of 101 words"), r.output


def test_max_seqs_below_one_is_refused_before_a_server_starts():
    """--max-seqs 0 became 8 (`max_seqs or 8`) and a negative one failed in the server."""
    for value in ("0", "-3"):
        r = runner.invoke(app, ["bench", "--max-seqs", value, "-n", "1"])
        assert r.exit_code == 1 and r.output.strip() == "error: --max-seqs must be >= 1", r.output


def test_sharegpt_takes_the_first_human_turn_and_its_reply(tmp_path):
    """A system turn first was sent as the prompt, and the question as the reply's length."""
    from justllm.bench.workloads import sharegpt_prompts

    data = [{"conversations": [{"from": "system", "value": "You are a helpful assistant."},
                               {"from": "human", "value": "What is two plus two?"},
                               {"from": "gpt", "value": "Four, of course"}]},
            {"conversations": [{"value": "no roles at all"}, {"value": "a b"}]},  # vLLM's way
            {"conversations": [{"from": "gpt", "value": "only a reply"}]}]
    f = tmp_path / "sg.json"
    f.write_text(json.dumps(data))
    got = sorted({(r.prompt, r.max_tokens) for r in sharegpt_prompts(f, 10, None, seed=0)})
    assert got == [("What is two plus two?", 3), ("no roles at all", 2)]


def fake_stream_server(body: bytes, status: int = 200,
                       content_type: str = "text/event-stream"):
    """A server whose every POST answers ``status`` with ``body`` (an event stream unless
    ``content_type`` says otherwise)."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802  (/metrics: none)
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


@pytest.mark.parametrize("events, error", [
    (b'data: {"error": "boom as string"}\n\n', "boom as string"),  # (an AttributeError
    (b'data: [1, 2]\n\n', "ValueError: a stream event that is no object: [1, 2]"),  # traceback)
])
def test_odd_stream_events_fail_the_request_not_bench(events, error, tmp_path):
    r, data = bench_two_requests(fake_stream_server(events), tmp_path)
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert data["failed"] == 2 and data["first_error"] == error


def _chunk(text: str) -> bytes:
    return b"data: " + json.dumps({"choices": [{"index": 0, "text": text}]}).encode() + b"\n\n"


def test_a_stream_cut_off_fails_and_odd_usage_is_read(tmp_path):
    # no [DONE]: a cut-off answer was a success of 3 tokens
    r, data = bench_two_requests(fake_stream_server(_chunk("a") + _chunk("b") + _chunk("c")),
                                 tmp_path)
    assert data["failed"] == 2 and data["first_error"] == (
        "the stream ended without its [DONE], after 3 piece(s) of text"), data
    # a usage chunk whose choices are null (a TypeError failed every request), its usage
    # without prompt_tokens: unknown, not 0
    usage = b'data: {"choices": null, "usage": {"completion_tokens": 2}}\n\n'
    r, data = bench_two_requests(fake_stream_server(
        _chunk("a") + _chunk("b") + usage + b"data: [DONE]\n\n"), tmp_path)
    assert (data["completed"], data["failed"]) == (2, 0), data
    assert data["total_input_tokens"] is None and data["total_output_tokens"] == 4


def test_metrics_count_only_the_benched_model_and_a_counter_begun_again_is_unknown():
    from justllm.bench.report import summarize
    from justllm.bench.runner import RequestResult, RunResult, parse_metrics

    page = ('# TYPE vllm:prefix_cache_queries counter\n'
            'vllm:prefix_cache_queries_total{model_name="a"} 22\n'
            'vllm:prefix_cache_queries_total{model_name="b"} 543\n'
            '# TYPE vllm:prefix_cache_hits counter\n'
            'vllm:prefix_cache_hits_total{model_name="a"} 0\n'
            'vllm:prefix_cache_hits_total{model_name="b"} 360\n'
            '# TYPE justllm_up gauge\njustllm_up 1\n')
    assert parse_metrics(page, "a") == {"vllm:prefix_cache_queries_total": 22.0,
                                        "vllm:prefix_cache_hits_total": 0.0, "justllm_up": 1.0}
    assert parse_metrics(page)["vllm:prefix_cache_queries_total"] == 565.0  # (one model)
    ok = [RequestResult(ok=True, prompt_tokens=5, output_tokens=2, ttft=0.1, e2e=0.2)]
    # b unloaded mid-run: its counters left the page, the sum fell (a 69% hit ratio was shown)
    run = RunResult("u", 1.0, ok, parse_metrics(page), parse_metrics(page, "a"))
    assert summarize(run)["prefix_cache_token_hit_ratio"] is None
    run = RunResult("u", 1.0, ok, {"vllm:prefix_cache_queries_total": 2.0,
                                   "vllm:prefix_cache_hits_total": 0.0},
                    parse_metrics(page, "a"))
    assert summarize(run)["prefix_cache_token_hit_ratio"] == 0.0


@pytest.mark.parametrize("args, says", [
    (["--url", "http://127.0.0.1:9?x=1"], "a server's address has no query or fragment"),
    (["--url", "http://127.0.0.1:9/#f"], "a server's address has no query or fragment"),
    (["--url", "http://127.0.0.1:9", "--request-rate", "1e-320"],
     "--request-rate must be a finite number of requests per second, at least 0.001"),
])
def test_urls_with_a_query_and_vanishing_rates_are_refused(args, says):
    # (every request went to ".../?x=1/v1/completions"; 1e-320 drew an infinite wait)
    r = runner.invoke(app, ["bench", *args])
    assert r.exit_code == 1 and says in r.output, r.output


def bench_two_requests(httpd, tmp_path):
    """``justllm bench -n 2`` against a stand-in server (stopped after): its result and JSON."""
    try:
        out = tmp_path / "bench.json"
        r = runner.invoke(app, ["bench", "--url", f"http://127.0.0.1:{httpd.server_port}",
                                "-n", "2", "--json", str(out)])
    finally:
        httpd.shutdown()
        httpd.server_close()
    return r, json.loads(out.read_text())


NGINX_502 = (b"<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>\r\n"
             b"<center><h1>502 Bad Gateway</h1></center>\r\n<hr><center>nginx</center>\r\n"
             b"</body>\r\n</html>\r\n")


@pytest.mark.parametrize("body, content_type, error", [
    (NGINX_502, "text/html", "HTTP 502: Bad Gateway"),  # (the page came whole, 7 lines)
    (b'{"error": {"message": "model\\nis loading", "code": 502}}', "application/json",
     "HTTP 502: model is loading"),
    (b"", "text/plain", "HTTP 502: Bad Gateway"),  # the status's own reason
    (b"5020 ms: timed out", "text/plain", "HTTP 502: 5020 ms: timed out"),  # (its digits stay)
])
def test_a_refused_request_is_one_line_of_status_and_reason(body, content_type, error,
                                                            tmp_path):
    httpd = fake_stream_server(body, status=502, content_type=content_type)
    r, data = bench_two_requests(httpd, tmp_path)
    assert r.exit_code == 1 and "<" not in r.output, r.output
    assert data["first_error"] == error
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert lines == [f"http://127.0.0.1:{httpd.server_port}: 2 failed; first error: {error}",
                     f"error: every request failed at http://127.0.0.1:{httpd.server_port}"], \
        r.stderr


def test_bench_takes_the_temperatures_the_server_takes():
    """--temperature 5 was refused ("must be in [0, 2]", OpenAI's range) where the server and
    run take 0-100."""
    from justllm.bench.runner import sampling_fields

    for t in (0.0, 5.0, 100.0):
        assert sampling_fields(t, None, None, None) == {"temperature": t}
    for t in (-0.5, 100.5, float("nan")):
        with pytest.raises(ValueError, match=r"^--temperature must be in \[0, 100\]$"):
            sampling_fields(t, None, None, None)


def test_data_lines_without_a_space_are_read_and_no_wait_follows_the_last_request(tmp_path):
    """``data:{...}`` (the SSE spec allows no space) was "no tokens received"; with
    --request-rate the wait drawn after the last request was counted in the duration."""
    chunk = {"choices": [{"index": 0, "text": "hi"}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
    body = f"data:{json.dumps(chunk)}\n\ndata:{json.dumps(usage)}\n\ndata:[DONE]\n\n"
    httpd = fake_stream_server(body.encode())
    try:
        out = tmp_path / "nospace.json"
        r = runner.invoke(app, ["bench", "--url", f"http://127.0.0.1:{httpd.server_port}",
                                "-n", "1", "--request-rate", "0.01", "--json", str(out)])
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    assert data["completed"] == 1 and data["total_input_tokens"] == 3
    assert data["duration_s"] < 60  # (one request: the 186 s wait drawn after it was counted)


@pytest.mark.parametrize("sig, when", [(signal.SIGTERM, "loading"), (signal.SIGINT, "loading"),
                                       (signal.SIGHUP, "running")])
def test_bench_stopped_by_a_signal_stops_its_own_server(model_path, sig, when):
    """SIGTERM or SIGHUP ended bench and left its `justllm serve` running; so did Ctrl-C
    while that server was still loading."""
    import os
    import subprocess
    import sys
    import time

    from tests.gateway.test_gateway import alive
    from tests.helpers import children, default_sigint

    proc = subprocess.Popen([sys.executable, "-m", "justllm", "bench", model_path, "-n", "64",
                             "-c", "2", "--output-len", "64"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=default_sigint)
    server: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not (server := children(proc.pid)):
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        if when == "running":  # the requests go once the server answers
            args = open(f"/proc/{server[0]}/cmdline").read().split("\0")
            url = f"http://127.0.0.1:{args[args.index('--port') + 1]}"
            while not _answers(url + "/health"):
                assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
                time.sleep(0.1)
            time.sleep(1)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=90)
        assert proc.returncode == 128 + sig if sig != signal.SIGINT else 130, err
        assert "Traceback" not in err, err
        deadline = time.monotonic() + 30
        while any(alive(p) for p in server) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in server if alive(p)], "bench left its server running"
    finally:
        for p in [proc.pid, *server]:
            if alive(p):
                os.kill(p, signal.SIGKILL)
        proc.wait()


def _answers(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_failed_first_scrape_reports_no_cache_figures():
    """/metrics unanswered before the run and answered after: the server's lifetime hits
    were reported as this run's."""
    from justllm.bench.report import summarize
    from justllm.bench.runner import RequestResult, RunResult

    after = {"justllm_prefix_cache_hits_total": 900.0, "justllm_prefix_cache_misses_total": 100.0}
    ok = [RequestResult(ok=True, prompt_tokens=3, output_tokens=2, ttft=0.1, e2e=0.2)]
    assert summarize(RunResult("u", 1.0, ok, {}, after))["prefix_cache_hit_ratio"] is None
    before = {"justllm_prefix_cache_hits_total": 890.0, "justllm_prefix_cache_misses_total": 90.0}
    assert summarize(RunResult("u", 1.0, ok, before, after))["prefix_cache_hit_ratio"] == 0.5
    # A server that reports no usage: its input tokens are unknown (they read 0, and the
    # total token throughput was the output's alone)
    silent = [RequestResult(ok=True, output_tokens=2, ttft=0.1, e2e=0.2)]
    summary = summarize(RunResult("u", 1.0, silent, before, after))
    assert summary["total_input_tokens"] is None and summary["total_token_throughput"] is None
    assert summary["output_throughput"] == 2.0


def test_workload_flags_that_would_be_ignored_are_refused():
    """--dataset over a typed --workload, --prefix-len outside shared-prefix and --input-len
    with sharegpt ran another workload than asked, exit 0 (found by a CLI audit)."""
    url = ["--url", "http://127.0.0.1:9"]  # (refused before any request)
    for flags, said in (
            (["--dataset", "d.json", "--workload", "shared-prefix"],
             "--dataset is the sharegpt workload's prompts: not with --workload shared-prefix"),
            (["--prefix-len", "5"], "--prefix-len is the shared-prefix workload's"),
            (["--dataset", "d.json", "--input-len", "500"],
             "--input-len is for the random and shared-prefix workloads")):
        r = runner.invoke(app, ["bench", *url, "-n", "1", *flags])
        assert r.exit_code == 1 and r.output.strip() == f"error: {said}" or said in r.output, \
            (flags, r.output)
        assert len(r.output.strip().splitlines()) == 1, r.output


def test_a_signal_while_the_local_server_starts_leaves_no_server(monkeypatch):
    """bench's SIGTERM handler raises SystemExit; a SIGTERM that came while Popen started the
    server (after the fork) raised inside Popen, which never returned: the server was left
    running (a CI run saw bench hang there). Held until Popen returns, it ends the wait for
    the server, which is killed."""
    import os
    import signal
    import subprocess
    import sys

    from justllm.bench.local_server import LocalServer
    from tests.gateway.test_gateway import alive

    started: list[int] = []
    real = subprocess.Popen

    def popen(*args, **kwargs):
        proc = real([sys.executable, "-c", "import time; time.sleep(60)"], **{
            k: v for k, v in kwargs.items() if k in ("stdout", "stderr")})
        started.append(proc.pid)
        os.kill(os.getpid(), signal.SIGTERM)  # as if it came while Popen ran
        return proc

    def exit_on(signum, frame):
        raise SystemExit(128 + signum)

    monkeypatch.setattr(subprocess, "Popen", popen)
    previous = signal.signal(signal.SIGTERM, exit_on)
    try:
        with pytest.raises(SystemExit):
            LocalServer.launch(lambda port: ["unused"], timeout=30)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert started and not alive(started[0])
