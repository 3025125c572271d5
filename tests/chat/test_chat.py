"""``justllm chat`` in a pseudo-terminal against a real server, and in-process."""

from __future__ import annotations

import contextlib
import io
import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.server.conftest import start_server

LEFT, UP = "\x1b[D", "\x1b[A"  # what a terminal sends for the arrow keys


class Terminal:
    """A child process on a pseudo-terminal; ``expect`` reads until a text shows up.
    ``cache_dir``: its JUSTLLM_CACHE_DIR, where the chat keeps its input history (never the
    user's own)."""

    def __init__(self, *args: str, cache_dir: Path, env: dict[str, str] | None = None) -> None:
        self.master, slave = pty.openpty()
        env = {**os.environ, "JUSTLLM_CACHE_DIR": str(cache_dir), "TERM": "xterm", **(env or {})}
        # SIGINT back to its default: a test run started in the background (``cmd &`` without
        # job control) ignores it, the child would inherit that, and Ctrl-C would do nothing.
        self.proc = subprocess.Popen([sys.executable, "-m", "justllm", *args], stdin=slave,
                                     stdout=slave, stderr=slave, close_fds=True, env=env,
                                     preexec_fn=lambda: signal.signal(signal.SIGINT,
                                                                      signal.SIG_DFL))
        os.close(slave)
        self.buffer = ""

    def expect(self, text: str, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while text not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{text!r} not seen; screen so far:\n{self.buffer}")
            ready, _, _ = select.select([self.master], [], [], left)
            if ready:
                try:
                    self.buffer += os.read(self.master, 65536).decode("utf-8", "replace")
                except OSError:
                    break
        before, _, self.buffer = self.buffer.partition(text)
        return before

    def read_some(self, n: int, timeout: float = 120) -> str:
        """What has been printed, once it is ``n`` characters at least (left in the buffer)."""
        deadline = time.monotonic() + timeout
        while len(self.buffer) < n and time.monotonic() < deadline:
            ready, _, _ = select.select([self.master], [], [], deadline - time.monotonic())
            if ready:
                self.buffer += os.read(self.master, 65536).decode("utf-8", "replace")
        return self.buffer

    def send(self, line: str) -> None:
        os.write(self.master, (line + "\n").encode())

    def keys(self, keys: str) -> None:
        """Keystrokes as they are, without Enter."""
        os.write(self.master, keys.encode())

    def close(self) -> int:
        try:
            return self.proc.wait(timeout=60)
        finally:
            os.close(self.master)


@pytest.fixture(scope="module")
def server(model_path):
    # Gemma's turn format, not the transcript the demo model gets by default: in it the base
    # model rambles on, so an answer is still streaming when the test presses Ctrl-C.
    s = start_server(model_path, "--max-seqs", "2", "--pool-blocks", "128",
                     "--chat-template", "gemma")
    yield s
    assert s.stop() == 0


def test_chat_against_a_server_in_a_terminal(server, tmp_path):
    t = Terminal("chat", "--url", server.url, "-n", "400", "--temperature", "0",
                 cache_dir=tmp_path)
    t.expect(">>> ")
    t.send("/set max_tokens 6")
    assert "(max_tokens = 6)" in t.expect(">>> ")
    t.send("Hello there!")
    answer = t.expect(">>> ")
    assert answer.strip()
    t.send("/stats")
    assert "generation 6 tok" in t.expect(">>> ")
    t.send('"""')
    t.send("first line")
    t.send('second line"""')
    t.expect(">>> ")
    t.send("/stats")
    stats = t.expect(">>> ")
    prompt_tokens = int(stats.split("prompt ")[1].split(" tok")[0])
    assert prompt_tokens > 20  # history: two user turns and one answer
    t.send("/clear")
    assert "(conversation cleared)" in t.expect(">>> ")
    t.send("/set max_tokens 400")
    t.expect(">>> ")
    for _ in range(3):  # Ctrl-C once an answer is streaming (a short one may end first: again)
        t.send("Write a very long story.")
        t.expect("Write a very long story.\r\n")  # the terminal's echo
        if ">>> " not in t.read_some(20):
            break
        t.expect(">>> ")
    else:
        pytest.fail("three answers ended within 20 characters")
    t.proc.send_signal(signal.SIGINT)  # what Ctrl-C does
    assert "(stopped)" in t.expect(">>> ")
    # The server counts tokens only at the end: none for a stopped answer, and never the
    # figures of the answer before it.
    t.send("/stats")
    assert "(no figures for the last answer: it did not finish)" in t.expect(">>> ")
    t.send("/nope")
    assert "unknown command" in t.expect(">>> ")
    t.send("/bye")
    assert t.close() == 0


def test_chat_in_process_with_pipes(model_path):
    r = subprocess.run([sys.executable, "-m", "justllm", "chat", model_path, "-n", "4",
                        "--system", "Be brief.", "--pool-blocks", "64"],
                       # Seeded, so that the answer cannot end (EOS or "User:") before its 4
                       # tokens: unseeded, one CI run in many stopped at 3.
                       input="/stats\n/set top_p 5\n/set top_p 0.9\n/set max_tokens 0\n"
                             "/set seed 1\nHi!\n/stats\n/system\n/bye\n",
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "(no answer yet)" in r.stdout and "generation 4 tok" in r.stdout
    # A value out of range is refused at /set (it was taken, and then every message failed).
    assert "not a valid top_p: top_p must be a number in [0, 1]" in r.stdout
    assert "(top_p = 0.9)" in r.stdout
    assert "not a valid max_tokens: max_tokens must be >= 1 (got 0)" in r.stdout
    assert "(system message removed)" in r.stdout
    assert r.stderr.count("this model has no chat template and looks like a base model") == 1
    one = subprocess.run([sys.executable, "-m", "justllm", "chat", model_path, "-n", "1",
                          "--pool-blocks", "64"], input="/set seed 1\nHi!\n/stats\n/bye\n",
                         capture_output=True, text=True, timeout=300)
    assert "generation 1 tok · TTFT" in one.stdout, one.stdout  # not "0.0 tok/s"


def test_chat_refuses_a_sampling_value_out_of_range_before_loading(model_path):
    r = subprocess.run([sys.executable, "-m", "justllm", "chat", model_path, "--temperature",
                        "-1"], capture_output=True, text=True, timeout=120,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 1 and r.stderr.strip() == "error: temperature must be a number in [0, 100]"


def test_chat_with_url_refuses_what_only_a_local_model_would_use(model_path):
    for extra in (["--gpu"], ["--ctx", "512"]):  # they were dropped
        r = subprocess.run([sys.executable, "-m", "justllm", "chat", "--url",
                            "http://127.0.0.1:9", *extra], capture_output=True, text=True,
                           timeout=120, stdin=subprocess.DEVNULL)
        assert r.returncode == 1 and "for a model loaded here" in r.stderr, (extra, r.stderr)


def test_chat_bad_url_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "justllm", "chat", "--url", "http://127.0.0.1:9"],
                       capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode == 1 and r.stderr.startswith("error: cannot reach")


def test_local_chat_on_the_demo_model_answers_and_stops_at_the_next_turn(model_path):
    import io

    from justllm.chat.backends import LocalChat
    from justllm.chat.session import ChatSession
    from justllm.config import EngineConfig

    backend = LocalChat(EngineConfig(model=model_path, max_seqs=1, pool_blocks=64,
                                     max_prefill=1, max_decode=1, max_queue=1))
    lines = iter(["What is the capital of France?", "What is 2+2?"])

    def read(prompt: str) -> str:
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    out = io.StringIO()
    try:
        assert backend.template.name == "transcript" and "base model" in backend.notice
        session = ChatSession(backend, system=None, options={"temperature": 0.0,
                                                              "max_tokens": 24}, read=read, out=out)
        session.run()
    finally:
        backend.close()
    answers = [m["content"] for m in session.history if m["role"] == "assistant"]
    assert answers[0] == "The capital of France is Paris."
    assert "4" in answers[1] and len(answers) == 2
    assert "User:" not in out.getvalue()
    assert backend.last.generated_tokens < 24  # stopped at the stop string, not by the limit


def test_chat_edits_lines_and_keeps_a_private_history_in_a_terminal(server, tmp_path):
    t = Terminal("chat", "--url", server.url, cache_dir=tmp_path)
    t.expect(">>> ")
    t.send(f"/clr{LEFT}ea")  # an arrow key edits the line; it used to be part of the message
    assert "(conversation cleared)" in t.expect(">>> ")
    t.send(UP)  # the line before, again
    assert "(conversation cleared)" in t.expect(">>> ")
    t.keys("\x04")  # Ctrl-D
    assert t.close() == 0
    history = tmp_path / "chat_history"
    assert "/clear" in history.read_text() and history.stat().st_mode & 0o777 == 0o600
    again = Terminal("chat", "--url", server.url, cache_dir=tmp_path)
    again.expect(">>> ")
    again.send(UP)  # the last session's last line
    assert "(conversation cleared)" in again.expect(">>> ")
    again.send("/bye")
    assert again.close() == 0


def test_justllm_nohistory_keeps_no_history(server, tmp_path):
    """As OLLAMA_NOHISTORY: the up arrow recalls this session's lines, and nothing is read
    or written."""
    history = tmp_path / "chat_history"
    history.write_text("/clear\n")
    history.chmod(0o600)
    t = Terminal("chat", "--url", server.url, cache_dir=tmp_path, env={"JUSTLLM_NOHISTORY": "1"})
    t.expect(">>> ")
    t.send(UP)  # the file's line is not offered: an empty line
    assert "(conversation cleared)" not in t.expect(">>> ")
    t.send("/clear")
    assert "(conversation cleared)" in t.expect(">>> ")
    t.send(UP)  # this session's line is
    assert "(conversation cleared)" in t.expect(">>> ")
    t.send("/bye")
    assert t.close() == 0
    assert history.read_text() == "/clear\n"  # nothing written


def test_chat_url_may_end_in_v1_as_openai_clients_are_configured(server):
    from justllm.chat.backends import RemoteChat

    for url in (server.url + "/v1", server.url + "/v1/"):
        backend = RemoteChat(url)  # it asked for .../v1/v1/models
        try:
            assert backend.model == server.model
            assert "".join(backend.stream([{"role": "user", "content": "Hi"}],
                                          {"max_tokens": 2, "temperature": 0}))
        finally:
            backend.close()


def test_a_url_that_is_no_openai_server_is_one_error(tmp_path):
    """/v1/models answering 200 without OpenAI's listing was a KeyError traceback."""
    import http.server
    import threading

    from justllm.chat.backends import RemoteChat
    from justllm.errors import JustLLMError

    class Plain(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802  (http.server's name)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"status": "ok"}')

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Plain)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        with pytest.raises(JustLLMError, match="did not list a model"):
            RemoteChat(f"http://127.0.0.1:{httpd.server_port}")
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_remote_chat_leaves_out_old_turns_and_survives_errors(model_path):
    """Against a server whose context holds 80 tokens: old exchanges are left out when the
    conversation outgrows it; a message too long even alone, undecodable input and a server
    gone are each one error line (or none), and the conversation stays as it was."""
    import io

    from justllm.chat.backends import RemoteChat
    from justllm.chat.session import ChatSession

    s = start_server(model_path, "--ctx", "80", "--max-seqs", "1", "--pool-blocks", "64")
    backend = None
    try:
        backend = RemoteChat(s.url)
        out = io.StringIO()
        seen: list[list[dict]] = []  # the history at each prompt
        questions = ["What is the capital of France?", "And of Germany?", "And of Spain?",
                     "And of Italy?", "And of Portugal?"]
        lines = iter([*questions, "word " * 100, "caf\udce9 \udcff", "stop the server"])

        def read(prompt: str) -> str:
            seen.append(list(session.history))
            line = next(lines, None)
            if line is None:
                raise EOFError
            if line == "stop the server":
                assert s.stop() == 0
                return "And of Italy?"
            out.write(f"[{line[:20]}]\n")
            return line

        session = ChatSession(backend, system="Be brief.",
                              options={"temperature": 0.0, "max_tokens": 16}, read=read,
                              out=out)
        session.run()  # nothing escapes it
    finally:
        if backend is not None:
            backend.close()
        s.stop()
    said = out.getvalue()
    assert "maximum context length" not in said.split("[word")[0], said
    assert said.count("(left out the oldest exchange of the conversation to fit the model's "
                      "context)") >= 1
    errors = [line for line in said.splitlines() if line.startswith("error:")]
    assert len(errors) == 2, said
    assert errors[0].startswith("error: the server answered 400: ")
    assert errors[1].startswith(f"error: cannot reach {s.url}")
    k = len(questions)
    assert seen[k + 1] == seen[k]  # the message that fits in no context: history kept
    assert seen[k + 1][-2]["content"] == "And of Portugal?"
    assert seen[k + 2][-2]["content"] == "caf\udce9 \udcff"  # answered, not refused
    assert seen[k + 3] == seen[k + 2]  # the server gone: history kept


def test_an_openai_context_length_refusal_is_recognised():
    from justllm.chat.backends import ContextFull, refusal

    openai = (b'{"error": {"message": "This model\'s maximum context length is 8192 tokens.",'
              b' "type": "invalid_request_error", "param": "messages",'
              b' "code": "context_length_exceeded"}}')
    assert isinstance(refusal(400, openai), ContextFull)
    # llama-server's and vLLM's refusals (vLLM's with param null): the chat stayed stuck
    llama_server = (b'{"error": {"code": 400, "message": "request (9000 tokens) exceeds the '
                    b'available context size (8192 tokens)", "type": '
                    b'"exceed_context_size_error"}}')
    vllm = (b'{"error": {"message": "This model\'s maximum context length is 2048 tokens. '
            b'However, you requested 3000 tokens.", "type": "BadRequestError", "param": null, '
            b'"code": 400}}')
    assert isinstance(refusal(400, llama_server), ContextFull)
    assert isinstance(refusal(400, vllm), ContextFull)
    other = b'{"error": {"message": "top_p must be a number in (0, 1]", "param": "top_p"}}'
    e = refusal(400, other)
    assert not isinstance(e, ContextFull)
    assert str(e) == "the server answered 400: top_p must be a number in (0, 1]"


def test_local_chat_leaves_out_old_turns_to_fit_the_context(model_path):
    long = "word " * 100
    r = subprocess.run([sys.executable, "-m", "justllm", "chat", model_path, "--ctx", "80",
                        "-n", "16", "--temperature", "0"],
                       input=("What is the capital of France?\nAnd of Germany?\nAnd of Spain?\n"
                              f"{long}\nAnd of Italy?\n"),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    # Every message fits but the one that cannot fit alone: one line for it, then on.
    errors = [line for line in out.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith(">>> error: the prompt has "), out
    assert "(left out the oldest exchange of the conversation to fit the model's context)" in out
    assert out.endswith(">>> \n")  # end of input: the shell's prompt on a line of its own
    assert out.count(">>> ") == 6


def test_a_max_tokens_no_message_fits_beside_is_refused_at_start(model_path):
    """Every message was an error line (the answer alone asked for the whole context)."""
    r = subprocess.run([sys.executable, "-m", "justllm", "chat", model_path, "--ctx", "80",
                        "-n", "80"], input="Hello\n", capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 1 and r.stdout == "", r.stdout
    assert r.stderr == ("error: --max-tokens 80 leaves no room for a message in this model's "
                        "context of 80 tokens (--ctx, --pool-blocks or its training context): "
                        "ask for fewer, or a larger --ctx\n"), r.stderr
    # not typed, the default (512) becomes half the context, and the chat answers
    r = subprocess.run([sys.executable, "-m", "justllm", "chat", model_path, "--ctx", "80",
                        "--temperature", "0"], input="Hi\n", capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "error" not in r.stdout, r.stdout
    assert "answers stop at 40 tokens, half of this model's context of 80" in r.stderr


def test_chat_refuses_options_it_would_ignore(model_path):
    def chat(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "justllm", "chat", *args],
                              capture_output=True, text=True, timeout=120,
                              stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})})

    url = ["--url", "http://127.0.0.1:9"]
    for extra in (["--verbose"], ["--threads", "2"], ["--pool-blocks", "256"],
                  ["--chat-template", "gemma"]):  # --verbose was taken and did nothing
        r = chat(*url, *extra)
        assert r.returncode == 1 and r.stderr.startswith(f"error: {extra[0]}: for a model "
                                                         "loaded here"), (extra, r.stderr)
    r = chat("--api-key", "K", model_path)  # a key for no server
    assert r.returncode == 1 and r.stderr.strip() == (
        "error: --api-key is the key of a server (--url); a model loaded here needs none")
    # The environment is not the command line: JUSTLLM_* set for `serve` are no mistake.
    r = chat(*url, env={"JUSTLLM_CTX": "512", "JUSTLLM_THREADS": "1"})
    assert r.returncode == 1 and r.stderr.startswith("error: cannot reach"), r.stderr
    r = chat(model_path, "--pool-blocks", "64", env={"JUSTLLM_API_KEY": "K"})
    assert r.returncode == 0, r.stderr


def test_chat_help_for_pool_blocks_is_about_chat():
    import typer

    from justllm.cli import app

    params = {p.name: p for p in typer.main.get_command(app).commands["chat"].params}
    help_text = params["pool_blocks"].help
    assert params["pool_blocks"].default == 256 and "(256: 4096 tokens)" in help_text


def test_a_reasoning_models_thinking_is_shown_apart_and_kept_apart(model_path, tmp_path):
    """A model that thinks (tests/server/test_reasoning.py's template and conversation): the
    chat writes its thinking, then the answer as a paragraph of its own, and keeps the
    thinking out of the answer's text, as the message's reasoning_content, in process and
    against a server alike."""
    import io

    from justllm.chat.backends import LocalChat, RemoteChat
    from justllm.chat.session import ChatSession
    from justllm.config import EngineConfig
    from tests.models.ggufs import with_chat_template
    from tests.server.test_reasoning import CHAT, TEMPLATE

    path = with_chat_template(model_path, tmp_path / "think.gguf", TEMPLATE)
    options = {"temperature": 0.0, "max_tokens": 30, "stop": ["<|im_end|>"]}

    def ask(backend) -> tuple[dict, str]:
        out = io.StringIO()
        lines = iter([CHAT[-1]["content"]])

        def read(prompt: str) -> str:
            line = next(lines, None)
            if line is None:
                raise EOFError
            return line

        session = ChatSession(backend, system=None, options=options, read=read, out=out)
        session.history = [dict(m) for m in CHAT[:-1]]  # three answers with their thinking
        session.run()
        return session.history[-1], out.getvalue()

    local = LocalChat(EngineConfig(model=str(path), max_seqs=1, pool_blocks=64))
    try:
        said, shown = ask(local)
    finally:
        local.close()
    assert said["reasoning_content"] and said["content"]  # it thought, then answered
    assert "think>" not in said["content"] and "think>" not in shown
    assert f"{said['reasoning_content']}\n\n{said['content']}" in shown
    s = start_server(str(path), "--max-seqs", "1", "--pool-blocks", "64")
    try:
        remote = RemoteChat(s.url)
        try:
            again, _ = ask(remote)
        finally:
            remote.close()
    finally:
        assert s.stop() == 0
    assert again["reasoning_content"] and again["content"]
    assert "think>" not in again["content"]


# ---- a stand-in OpenAI server (no model): what a server may send, exactly ------------------

@contextlib.contextmanager
def fake_openai(models: list[str], streams: list[bytes | tuple[int, str, bytes]],
                aliases: dict[str, list[str]] | None = None,
                card: dict | None = None) -> Iterator[tuple[str, list[dict]]]:
    """A server whose /v1/models lists ``models`` (with their ``aliases`` on their cards, as
    router mode lists them) and whose chat completions answer with ``streams``, one per
    request, in order (the last one again when they run out; a ``(status, content type,
    body)`` answers so); ``card``: more fields of every card. Yields its URL and the request
    bodies it got."""
    import http.server
    import threading

    asked: list[dict] = []
    listing = json.dumps({"object": "list", "data": [
        {"id": m, "object": "model", **(card or {}),
         **({"aliases": aliases[m]} if m in (aliases or {}) else {})}
        for m in models]}).encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def _send(self, body: bytes, kind: str, status: int = 200) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802  (http.server's name)
            self._send(listing, "application/json")

        def do_POST(self) -> None:  # noqa: N802
            asked.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            answer = streams[min(len(asked), len(streams)) - 1]
            if isinstance(answer, tuple):
                self._send(answer[2], answer[1], answer[0])
            else:
                self._send(answer, "text/event-stream")

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_port}", asked
    finally:
        httpd.shutdown()
        httpd.server_close()


def sse(*events: dict | str) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode()
                    for e in events)


def said(text: str) -> dict:
    return {"choices": [{"index": 0, "delta": {"content": text}}]}


def remote_chat_lines(url: str, lines: list[str]) -> tuple[Any, str]:
    """``chat_lines`` through a RemoteChat of the server at ``url``, closed afterwards."""
    from justllm.chat.backends import RemoteChat

    backend = RemoteChat(url)
    try:
        return chat_lines(backend, lines)
    finally:
        backend.close()


def chat_lines(backend, lines: list[str], **options) -> tuple[Any, str]:
    """A ChatSession fed ``lines``, run to the end of its input: (the session, its output)."""
    from justllm.chat.session import ChatSession

    out = io.StringIO()
    feed = iter(lines)

    def read(prompt: str) -> str:
        line = next(feed, None)
        if line is None:
            raise EOFError
        return line

    session = ChatSession(backend, system=None, read=read, out=out,
                          options={"temperature": 0.0, "max_tokens": 8, **options})
    session.run()
    return session, out.getvalue()


@pytest.mark.parametrize("bad", ['{"choices": [null]}', '{"choices": [{"delta": null}]}',
                                 '{"choices": [{"delta": "Hi"}]}', '{"choices": {"0": {}}}',
                                 '{"choices": [7]}'])
def test_a_stream_chunk_that_is_no_chat_chunk_is_one_error_line(bad):
    """A null choice or delta was an AttributeError traceback out of the chat."""
    with fake_openai(["m"], [sse(said("Hel"), bad, "[DONE]"), sse(said("Hello"), "[DONE]")]) \
            as (url, _):
        session, out = remote_chat_lines(url, ["hi", "again"])
    errors = [line for line in out.splitlines() if "error:" in line]
    assert errors == [f"error: {url} sent something that is not a chat stream: choices "
                      f"{json.dumps(json.loads(bad)['choices'])} are not objects with a delta "
                      "object each"], out
    # the failed turn left the conversation as it was; the next one answered
    assert session.history == [{"role": "user", "content": "again"},
                               {"role": "assistant", "content": "Hello"}]


def test_an_error_event_in_the_stream_fails_the_turn(tmp_path):
    """justllm's server sends ``data: {"error": ...}`` when a request fails mid-answer: the
    partial answer was printed as complete and kept in the history, with no error line."""
    error = {"error": {"message": "KV cache exhausted", "type": "server_error", "param": None,
                       "code": "kv_exhausted"}}
    with fake_openai(["m"], [sse(said("Hel"), error, "[DONE]"), sse(said("Hello"), "[DONE]")]) \
            as (url, asked):
        session, out = remote_chat_lines(url, ["hi", "again"])
        assert "Hel\nerror: the server failed during the answer: KV cache exhausted\n" in out
        # the failed turn is not in the next request, nor in the history
        assert [m["content"] for m in asked[1]["messages"]] == ["again"]
        assert session.history == [{"role": "user", "content": "again"},
                                   {"role": "assistant", "content": "Hello"}]
    # and the CLI: one error line, no traceback, the chat goes on
    with fake_openai(["m"], [sse(said("Hel"), error, "[DONE]")]) as (url, _):
        r = subprocess.run([sys.executable, "-m", "justllm", "chat", "--url", url],
                           input="hi\n/bye\n", capture_output=True, text=True, timeout=120,
                           env={**os.environ, "JUSTLLM_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert r.stdout.count("error: ") == 1 and "KV cache exhausted" in r.stdout, r.stdout


def test_a_remote_answer_is_trimmed_and_an_html_error_page_is_one_line():
    """A server's answer kept its leading and trailing blanks (a local model's are trimmed),
    and a proxy's HTML error page was printed raw, many lines of it."""
    page = (b"<html>\n<head><title>502 Bad Gateway</title></head>\n<body>\n<center><h1>502 "
            b"Bad Gateway</h1></center>\n<hr><center>nginx</center>\n</body>\n</html>\n")
    with fake_openai(["m"], [sse(said(" \n"), said(" Hello"), said(" world"), said(" \n"),
                                 "[DONE]"), (502, "text/html", page)]) as (url, _):
        session, out = remote_chat_lines(url, ["hi", "again"])
    assert session.history[-2:] == [{"role": "user", "content": "hi"},
                                    {"role": "assistant", "content": "Hello world"}]
    assert "error: the server answered 502: Bad Gateway\n" in out and "<" not in out, out


def test_data_lines_without_a_space_and_streams_without_usage_are_read():
    """``data:{...}`` (the SSE spec allows no space) was skipped: an empty answer, kept in
    the history, no error; without usage, /stats said the finished answer did not finish."""
    raw = b"".join(f"data:{json.dumps(e)}\n\n".encode() for e in (said("He"), said("llo")))
    with fake_openai(["m"], [raw + b"data:[DONE]\n\n"]) as (url, _):
        session, out = remote_chat_lines(url, ["hi", "/stats"])
    assert session.history[-1] == {"role": "assistant", "content": "Hello"}
    assert "did not finish" not in out and "(no answer yet)" in out, out


def test_exchanges_left_out_are_kept_when_the_answer_then_fails():
    """Left out to fit the context, the oldest exchanges were forgotten as the answer began:
    when it then failed, the conversation had lost them."""
    from justllm.chat.backends import AnswerStats, ContextFull
    from justllm.errors import JustLLMError

    class Small:
        """Fits two messages; the third answer fails half-way."""
        last = AnswerStats()
        answers = 0

        def stream(self, messages: list[dict], options: dict) -> Iterator[str]:
            if len(messages) > 2:
                raise ContextFull("too long")
            Small.answers += 1
            yield "part"
            if Small.answers == 2:
                raise JustLLMError("the connection failed")

    session, out = chat_lines(Small(), ["one", "two", "three"])
    assert "error: the connection failed" in out
    # "two" failed: "one" and its answer, left out for it, are still there; "three" then
    # leaves them out again, and is answered
    assert [m["content"] for m in session.history] == ["three", "part"]
    assert out.count("(left out the oldest exchange") == 2


def test_a_refused_model_listing_says_why():
    import http.server
    import threading

    class Locked(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            body = b'{"error": {"message": "Invalid API key", "type": "auth"}}'
            self.send_response(401)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    from justllm.chat.backends import RemoteChat
    from justllm.errors import JustLLMError

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Locked)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_port}"
    try:
        with pytest.raises(JustLLMError) as e:
            RemoteChat(url)
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert str(e.value) == (f"{url}/v1/models answered 401: Invalid API key (--api-key, or "
                            "JUSTLLM_API_KEY?)")


def test_chat_url_takes_model_as_the_servers_model_to_ask_for(tmp_path):
    """MODEL with --url was refused, and the chat always asked for the first model listed."""
    from justllm.chat.backends import RemoteChat
    from justllm.errors import JustLLMError

    env = {**os.environ, "JUSTLLM_CACHE_DIR": str(tmp_path)}
    with fake_openai(["base", "sql"], [sse(said("ok"), "[DONE]")]) as (url, asked):
        backend = RemoteChat(url, model="sql")
        try:
            assert "".join(backend.stream([{"role": "user", "content": "x"}], {})) == "ok"
        finally:
            backend.close()
        assert asked[-1]["model"] == "sql"
        with pytest.raises(JustLLMError) as e:
            RemoteChat(url, model="nope")
        assert str(e.value) == (f"{url} serves no model named 'nope' (its /v1/models lists: "
                                "base, sql)")

        def chat(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "justllm", "chat", *args],
                                  input="hi\n/bye\n", capture_output=True, text=True,
                                  timeout=120, env=env)

        r = chat("sql", "--url", url)
        assert r.returncode == 0 and asked[-1]["model"] == "sql", r.stderr
        r = chat("--url", url)  # the first, said (which one is not obvious with two)
        assert r.returncode == 0 and asked[-1]["model"] == "base", r.stderr
        assert " ".join(r.stderr.split()) == (
            f"note: chatting with base, the first of the 2 models {url} lists (name another: "
            "justllm chat MODEL --url URL)")
        r = chat("nope", "--url", url)
        assert r.returncode == 1 and r.stderr.strip() == (
            f"error: {url} serves no model named 'nope' (its /v1/models lists: base, sql)")
    with fake_openai(["only"], [sse(said("ok"), "[DONE]")]) as (url, asked):
        r = chat("--url", url)
        assert r.returncode == 0 and r.stderr == "" and asked[-1]["model"] == "only"


class Echo:
    """A backend without a model: answers "ok", and keeps the messages it was asked with."""

    def __init__(self) -> None:
        from justllm.chat.backends import AnswerStats

        self.asked: list[list[dict]] = []
        self.last = AnswerStats()

    def stream(self, messages: list[dict], options: dict) -> Iterator[str]:
        self.asked.append(messages)
        yield "ok"


def test_a_block_is_always_a_message_and_commands_follow_one_rule():
    """A \"\"\" block whose first line began with / ran as a command (a block of /bye ended
    the chat); "  /bye" left while "  /clear" went to the model; extra words were ignored by
    some commands and made others unknown; /set split on a space only."""
    backend = Echo()
    session, out = chat_lines(backend, [
        '"""', "/usr/bin/env python", 'what does this line do?"""',
        '"""/bye"""',
        "/clear now", "/stats please", "/? me", "/help me", "/bye now",
        "  /clear",
        "/set temperature\t0.25", "/set  top_k   7 ", "/set top_p 0.5 0.6", "/set top_p",
        "/system \t Be brief.  Please. ",
        "hello",
        "   /bye   ",
        "never read"])
    assert [m[-1]["content"] for m in backend.asked] == [
        "/usr/bin/env python\nwhat does this line do?", "/bye", "hello"]
    lines = out.splitlines()
    for command in ("/clear", "/stats", "/?", "/help", "/bye"):
        assert f"usage: {command} (it takes no words after it)" in lines, out
    assert lines.count("(conversation cleared)") == 1  # "  /clear": the command, no message
    assert "(temperature = 0.25)" in lines and "(top_k = 7)" in lines
    usage = "usage: /set temperature|top_p|top_k|min_p|max_tokens|seed|repeat_penalty VALUE"
    assert lines.count(usage) == 2
    assert "top_p" not in session.options  # neither /set top_p was taken
    assert session.system == "Be brief.  Please."
    assert backend.asked[-1][0] == {"role": "system", "content": "Be brief.  Please."}
    assert "unknown command" not in out
    assert session.history == [{"role": "user", "content": "hello"},
                               {"role": "assistant", "content": "ok"}]
    _, out = chat_lines(Echo(), ["/usr/bin/env python"])
    assert ("unknown command /usr/bin/env (/? for help; a \"\"\" block sends text that starts "
            "with / as a message)") in out


def test_set_refuses_infinite_values():
    """/set repeat_penalty inf was taken; every message then failed (with --url blamed on the
    server: httpx cannot send inf), and in process the logits went NaN."""
    session, out = chat_lines(Echo(), ["/set repeat_penalty inf", "/set temperature -inf",
                                       "/set repeat_penalty 1e999", "/set repeat_penalty 1.1"])
    lines = out.splitlines()
    assert lines.count("not a valid repeat_penalty: repeat_penalty must be a finite number > 0"
                       ) == 2
    assert "not a valid temperature: temperature must be a number in [0, 100]" in lines
    assert session.options["repeat_penalty"] == 1.1


def test_a_seed_once_set_can_be_taken_back():
    """/set seed 7 could not be undone: every answer after it drew the same way."""
    session, out = chat_lines(Echo(), ["/set seed 7", "/set seed none", "/set seed x"])
    assert "(seed = 7)" in out and "(seed = None)" in out and "not a valid seed: x" in out
    assert session.options["seed"] is None


def test_a_chunks_content_that_is_not_text_is_one_error_line():
    """A number as a delta's content was written out: a TypeError traceback."""
    bad = '{"choices": [{"delta": {"content": 5}}]}'
    with fake_openai(["m"], [sse(said("Hel"), bad, "[DONE]"), sse(said("Hello"), "[DONE]")]) \
            as (url, _):
        session, out = remote_chat_lines(url, ["hi", "again"])
    errors = [line for line in out.splitlines() if "error:" in line]
    assert errors == [f"error: {url} sent something that is not a chat stream: its content "
                      "is a int, not text"], out
    assert session.history[-1] == {"role": "assistant", "content": "Hello"}


def test_a_model_named_by_an_alias_of_a_gateway_is_served(tmp_path):
    """Router mode lists a model's aliases on its card, and serves them: chat refused them
    (it read the ids alone)."""
    from justllm.chat.backends import RemoteChat

    with fake_openai(["g1"], [sse(said("ok"), "[DONE]")], aliases={"g1": ["gpt-4o-mini"]}) \
            as (url, asked):
        backend = RemoteChat(url, model="gpt-4o-mini")
        try:
            assert "".join(backend.stream([{"role": "user", "content": "x"}], {})) == "ok"
        finally:
            backend.close()
        assert asked[-1]["model"] == "gpt-4o-mini"


def test_stats_of_an_answer_without_text_do_not_make_up_its_ttft():
    """With no text, no first token could be timed: TTFT said 0 ms, and tok/s counted the
    prompt's time as generation's."""
    usage = {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3,
                                      "total_tokens": 7}}
    with fake_openai(["m"], [sse(said(""), usage, "[DONE]")]) as (url, _):
        _, out = remote_chat_lines(url, ["hi", "/stats"])
    assert "prompt 4 tok · generation 3 tok · TTFT not seen" in out, out
    assert "tok/s" not in out


def test_piped_bytes_outside_the_encoding_do_not_end_the_chat(tmp_path):
    """Under a UTF-8 locale a pipe's stray byte failed the whole read: the chat ended with an
    error, and the good lines read with it were never answered."""
    env = {**os.environ, "JUSTLLM_CACHE_DIR": str(tmp_path), "PYTHONIOENCODING": "utf-8"}
    with fake_openai(["m"], [sse(said("ok"), "[DONE]")]) as (url, asked):
        r = subprocess.run([sys.executable, "-m", "justllm", "chat", "--url", url],
                           input=b"hello\ncaf\xe9\n", capture_output=True, timeout=120,
                           env=env)
    assert r.returncode == 0, r.stderr
    assert [a["messages"][-1]["content"] for a in asked] == ["hello", "caf\ufffd"]


def test_max_tokens_fits_the_context_a_servers_card_says(tmp_path):
    """The default --max-tokens (512) failed every message on a server with a small
    context; a local model's is halved to fit: so is a server's, where its /v1/models card
    says its max_model_len (vLLM's and justllm's cards do)."""
    env = {**os.environ, "JUSTLLM_CACHE_DIR": str(tmp_path)}

    def chat(url: str, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "justllm", "chat", "--url", url, *args],
                              input="hi\n", capture_output=True, text=True, timeout=120,
                              env=env)

    with fake_openai(["m"], [sse(said("ok"), "[DONE]")], card={"max_model_len": 160}) \
            as (url, asked):
        r = chat(url)
        assert r.returncode == 0 and asked[-1]["max_tokens"] == 80, r.stderr
        assert "answers stop at 80 tokens, half of this server's context of 160" in " ".join(
            r.stderr.split())
        r = chat(url, "-n", "200")
        assert r.returncode == 1 and len(asked) == 1
        assert r.stderr.startswith("error: --max-tokens 200 leaves no room for a message in "
                                   "this server's context of 160 tokens"), r.stderr
        assert chat(url, "-n", "100").returncode == 0 and asked[-1]["max_tokens"] == 100

