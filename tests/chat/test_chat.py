"""``justllm chat`` in a pseudo-terminal against a real server, and in-process."""

from __future__ import annotations

import os
import pty
import select
import signal
import subprocess
import sys
import time

import pytest

from tests.server.conftest import start_server


class Terminal:
    """A child process on a pseudo-terminal; ``expect`` reads until a text shows up."""

    def __init__(self, *args: str) -> None:
        self.master, slave = pty.openpty()
        # SIGINT back to its default: a test run started in the background (``cmd &`` without
        # job control) ignores it, the child would inherit that, and Ctrl-C would do nothing.
        self.proc = subprocess.Popen([sys.executable, "-m", "justllm", *args], stdin=slave,
                                     stdout=slave, stderr=slave, close_fds=True,
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


def test_chat_against_a_server_in_a_terminal(server):
    t = Terminal("chat", "--url", server.url, "-n", "400", "--temperature", "0")
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
    t.send("/nope")
    assert "unknown command" in t.expect(">>> ")
    t.send("/bye")
    assert t.close() == 0


def test_chat_in_process_with_pipes(model_path):
    r = subprocess.run([sys.executable, "-m", "justllm", "chat", model_path, "-n", "4",
                        "--system", "Be brief.", "--pool-blocks", "64"],
                       input="/stats\n/set top_p 5\n/set top_p 0.9\nHi!\n/stats\n/system\n/bye\n",
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "(no answer yet)" in r.stdout and "generation 4 tok" in r.stdout
    # A value out of range is refused at /set (it was taken, and then every message failed).
    assert "not a valid top_p: top_p must be a number in (0, 1]" in r.stdout
    assert "(top_p = 0.9)" in r.stdout
    assert "(system message removed)" in r.stdout
    assert r.stderr.count("this model has no chat template and looks like a base model") == 1


def test_chat_refuses_a_sampling_value_out_of_range_before_loading(model_path):
    r = subprocess.run([sys.executable, "-m", "justllm", "chat", model_path, "--temperature",
                        "-1"], capture_output=True, text=True, timeout=120,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 1 and r.stderr.strip() == "error: temperature must be a number in [0, 100]"


def test_chat_with_url_refuses_what_only_a_local_model_would_use(model_path):
    for extra in ([model_path], ["--gpu"], ["--ctx", "512"]):  # they were dropped
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
