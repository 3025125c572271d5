"""``justllm run`` through Typer's CliRunner, on the real model."""

import subprocess
import sys

from typer.testing import CliRunner

from justllm.cli import app
from justllm.engine.backend import gpu_offload_supported
from tests.helpers import default_sigint
from tests.lora_files import write_adapter

runner = CliRunner()


NOTICE = "this model has no chat template and looks like a base model"


def test_run_streams_and_summarises(model_path):
    r = runner.invoke(app, ["run", model_path, "-p", "What is the capital of France?", "-n", "4",
                            "--pool-blocks", "64", "--max-seqs", "2"])
    assert r.exit_code == 0, r.output
    assert "generation 4 tok" in r.output and "TTFT" in r.output and "tok/s" in r.output
    assert "finish: length" in r.output
    # One line, whatever the width (it was cut at 80 columns into a pipe).
    assert any(line.startswith("prompt ") and "finish: length" in line
               for line in r.stderr.splitlines()), r.stderr
    one = runner.invoke(app, ["run", model_path, "-p", "Hi", "-n", "1", "--pool-blocks", "64"])
    assert one.exit_code == 0 and "generation 1 tok ·" in one.stderr, one.stderr  # no 0.0 tok/s


def test_first_question_on_the_demo_model_gets_a_sensible_answer(model_path):
    """The demo model has no chat template: a plain transcript, stopped at the next "User:"."""
    r = runner.invoke(app, ["run", model_path, "-p", "What is the capital of France?",
                            "--temperature", "0", "-n", "24", "--pool-blocks", "64"])
    assert r.exit_code == 0, r.output
    assert r.stdout == "The capital of France is Paris.\n"
    assert "finish: stop" in r.stderr
    assert r.stderr.count(NOTICE) == 1 and "--chat-template" in r.stderr


def test_the_prompt_may_follow_the_model_as_in_ollama_run(model_path):
    r = runner.invoke(app, ["run", model_path, "What is the capital of France?",
                            "--temperature", "0", "-n", "24", "--pool-blocks", "64"])
    assert r.exit_code == 0 and r.stdout == "The capital of France is Paris.\n", r.output
    r = runner.invoke(app, ["run", model_path, "Hi", "-p", "Hi"])
    assert r.exit_code == 1 and "give the prompt once" in r.output
    # a prompt where the model goes: said, before anything loads (it read an empty stdin)
    r = runner.invoke(app, ["run", "What is the capital of France?"], input="")
    assert r.exit_code == 1 and "the prompt goes after the model" in r.output, r.output


def test_chat_template_choice(model_path, tmp_path):
    r = runner.invoke(app, ["run", model_path, "-p", "Hi", "-n", "2", "--pool-blocks", "64",
                            "--chat-template", "chatml"])
    assert r.exit_code == 0, r.output
    assert "prompt 25 tok" in r.stderr and NOTICE not in r.output  # ChatML, not the transcript
    qa = tmp_path / "qa.jinja"
    qa.write_text("{% for m in messages %}Q: {{ m['content'] }}\n{% endfor %}A:")
    r = runner.invoke(app, ["run", model_path, "-p", "What is the capital of France?", "-n", "2",
                            "--pool-blocks", "64"], env={"JUSTLLM_CHAT_TEMPLATE": str(qa)})
    assert r.exit_code == 0, r.output
    assert "prompt 13 tok" in r.stderr and NOTICE not in r.output
    # (the demo model's greedy first words here are a near tie: "Paris" on some CPUs, "The
    # capital" on others; the token count above is what shows the template)
    assert r.stdout.strip() and "Q:" not in r.stdout


def test_bad_chat_template_is_one_line_before_the_model_loads(tmp_path):
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    missing = str(tmp_path / "missing.gguf")  # the template is checked first
    cases = [
        (["--chat-template", "bogus"], "neither a built-in template (chatml, gemma, llama3, "
                                       "transcript) nor a Jinja file"),
        (["--chat-template", str(tmp_path / "nope.jinja")], "nope.jinja"),
        (["--chat-template", str(bad)], "bad.jinja is not a valid Jinja template"),
    ]
    for command in (["run", missing, "-p", "hi"], ["chat", missing], ["serve", missing]):
        for extra, needle in cases:
            r = runner.invoke(app, [*command, *extra])
            assert r.exit_code == 1, (command, extra, r.output)
            lines = [line for line in r.output.splitlines() if line.strip()]
            assert len(lines) == 1 and lines[0].startswith("error:"), (command, r.output)
            assert needle in lines[0], (command, extra, r.output)


def test_run_raw_prompt_from_stdin(model_path):
    r = runner.invoke(app, ["run", model_path, "--raw", "-n", "3", "--pool-blocks", "64",
                            "--n-ubatch", "2", "--flash-attn", "off"], input="The moon is")
    assert r.exit_code == 0, r.output
    assert "prompt 4 tok" in r.output  # BOS + 3 tokens, no chat template
    assert NOTICE not in r.output


def test_errors_are_one_line_and_exit_1(tmp_path, model_path):
    cases = [
        ["run", str(tmp_path / "missing.gguf"), "-p", "hi"],
        ["run", model_path, "-p", "hi", "--max-tokens", "0"],
        ["run", model_path, "-p", "hi", "--chunk-size", "4096"],
        ["run", model_path, "-p", "hi", "--temperature", "-1"],
        ["run", model_path, "-p", "hi", "--n-batch", "256", "--n-ubatch", "512"],
        ["run", model_path, "-p", "hi", "--flash-attn", "yes"],
        ["run", model_path, "-p", "hi", "--repack", "yes"],
        ["run", model_path, "-p", "hi", "--backend-sampling", "--spec", "ngram"],
    ]
    if not gpu_offload_supported():  # a CPU build must say so in one line
        cases += [["run", model_path, "-p", "hi", "--gpu"], ["serve", model_path, "--gpu"]]
    for args in cases:
        r = runner.invoke(app, args)
        assert r.exit_code == 1, (args, r.output)
        lines = [line for line in r.output.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error:"), (args, r.output)
        assert "Traceback" not in r.output
    # a refused value is named by its flag, not the API's field
    for args, says in ((["--temperature", "-1"], "error: --temperature must be a number"),
                       (["--top-k", "-3"], "error: --top-k must be an integer >= 0"),
                       (["-n", "100000"], "100000 in --max-tokens): reduce the prompt or "
                                          "--max-tokens"),
                       (["--stop", ""], "error: --stop must be non-empty strings")):
        r = runner.invoke(app, ["run", model_path, "-p", "hi", "--pool-blocks", "64", *args])
        assert r.exit_code == 1 and says in r.output, (args, r.output)


def test_prefix_cache_flags(model_path):
    # (with --no-prefix-cache, --prefix-cache-blocks is refused: see
    # test_flags_typed_for_what_is_off_are_refused_whatever_their_value)
    r = runner.invoke(app, ["run", model_path, "--raw", "-p", "The moon is", "-n", "2",
                            "--prefix-cache-blocks", "4", "--pool-blocks", "64"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["run", model_path, "-p", "x", "--prefix-cache-blocks", "-1"])
    assert r.exit_code == 1 and "--prefix-cache-blocks must be >= 0" in r.output


REPEATING = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef add(a, b):\n"


def test_run_with_speculation_reports_acceptance(model_path):
    r = runner.invoke(app, ["run", model_path, "--raw", "-p", REPEATING, "-n", "24",
                            "--ignore-eos", "--pool-blocks", "64", "--spec", "ngram",
                            "--gamma", "3"])
    assert r.exit_code == 0, r.output
    assert "generation 24 tok" in r.output
    assert "speculation:" in r.output and "draft tokens accepted" in r.output
    # nothing to draft (one token): still said, so that speculation was on is not in doubt
    r = runner.invoke(app, ["run", model_path, "--raw", "-p", "hi", "-n", "1",
                            "--pool-blocks", "64", "--spec", "ngram"])
    assert r.exit_code == 0, r.output
    assert "speculation: 0 drafts (nothing was drafted for this answer)" in r.output


def test_speculation_flag_errors_are_one_line(tmp_path, model_path):
    cases = [
        (["--spec", "draft"], "needs --draft-model"),
        (["--spec", "bogus"], "--spec must be one of ngram, draft, tree"),
        (["--spec", "ngram", "--gamma", "0"], "--gamma must be an integer in [1, 16]"),
        (["--spec", "tree", "--draft-model", str(tmp_path / "nope.gguf")], "nope.gguf"),
    ]
    for extra, needle in cases:
        r = runner.invoke(app, ["run", model_path, "-p", "hi", "--pool-blocks", "64", *extra])
        assert r.exit_code == 1, (extra, r.output)
        lines = [line for line in r.output.splitlines() if line.strip()]
        assert len(lines) == 1 and needle in lines[0], (extra, r.output)


def test_verbose_shows_llama_cpps_own_log(model_path):
    """--verbose crashed with a ctypes traceback: these bindings take no NULL log sink."""
    r = subprocess.run([sys.executable, "-m", "justllm", "run", model_path, "--verbose", "-p", "Hi",
                        "-n", "2", "--pool-blocks", "64"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "llama_model_loader: loaded meta data" in r.stderr and "Traceback" not in r.stderr
    assert "generation 2 tok" in r.stderr
    quiet = subprocess.run([sys.executable, "-m", "justllm", "run", model_path, "-p", "Hi",
                            "-n", "2", "--pool-blocks", "64"], capture_output=True, text=True,
                           timeout=300)
    assert quiet.returncode == 0 and "llama_model_loader" not in quiet.stderr, quiet.stderr


def test_run_applies_its_lora_adapters_and_refuses_a_system_message_with_raw(model_path,
                                                                             tmp_path):
    """--lora loaded the adapter and never applied it (the same text as without); --system
    with --raw was dropped without a word."""
    adapter = write_adapter(tmp_path / "a.gguf", seed=3)
    args = ["run", model_path, "--raw", "-p", "The capital of France is", "-n", "12",
            "--temperature", "0", "--pool-blocks", "64"]
    plain = runner.invoke(app, args)
    zero = runner.invoke(app, [*args, "--lora", f"a={adapter}:0"])
    tuned = runner.invoke(app, [*args, "--lora", f"a={adapter}:3"])
    assert plain.exit_code == zero.exit_code == tuned.exit_code == 0, tuned.output
    assert zero.stdout == plain.stdout  # scale 0: the base model's own text
    assert tuned.stdout != plain.stdout
    r = runner.invoke(app, [*args, "--system", "You are a pirate"])
    assert r.exit_code == 1 and "--system" in r.output and "--raw" in r.output
    # A scale that is no number: it said the file (PATH:abc) was not found.
    r = runner.invoke(app, [*args, "--lora", f"a={adapter}:abc"])
    assert r.exit_code == 1 and "'abc' is not a scale" in r.output, r.output


def test_ctrl_c_ends_the_partial_answer_with_a_newline(model_path):
    """'interrupted' came straight after the partial text, on its line."""
    import signal

    p = subprocess.Popen([sys.executable, "-m", "justllm", "run", model_path, "--raw", "-p",
                          "Once upon a time", "-n", "2000", "--ignore-eos", "--pool-blocks",
                          "256"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         # a test worker may ignore SIGINT, and its children inherit that
                         preexec_fn=default_sigint)
    try:
        first = p.stdout.read(8)  # generation has begun
        p.send_signal(signal.SIGINT)
        rest, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 130 and first, err
    assert (first + rest).endswith(b"\n") and b"interrupted" in err, (first + rest, err)


def test_server_flags_typed_for_run_are_refused_and_shared_settings_passed_over(model_path):
    """They were accepted and meant nothing (--max-queue 0 loaded the model, then refused the
    prompt)."""
    for flag in (["--enable-lora-runtime"], ["--scheduling-policy", "priority"],
                 ["--max-queue", "0"],
                 # (each was taken and did nothing: run pools no embeddings, lays out no
                 # fill-in-the-middle prompt, and has one adapter set; at their defaults too)
                 ["--pooling", "mean"], ["--spm-infill"], ["--lora-max-steps", "4"]):
        r = runner.invoke(app, ["run", model_path, "-p", "Hi", *flag])
        assert r.exit_code == 1 and f"{flag[0]} " in r.output and "run" in r.output, r.output
        assert len(r.output.strip().splitlines()) == 1, r.output
    r = runner.invoke(app, ["run", model_path, "-p", "Hi", "-n", "1", "--pool-blocks", "64"],
                      env={"JUSTLLM_SCHEDULING_POLICY": "priority", "JUSTLLM_MAX_QUEUE": "4",
                           "JUSTLLM_POOLING": "mean", "JUSTLLM_SPM_INFILL": "1",
                           "JUSTLLM_LORA_MAX_STEPS": "2"})
    assert r.exit_code == 0, r.output


def test_flags_typed_for_what_is_off_are_refused_whatever_their_value(model_path, tmp_path):
    """--gamma 4 without --spec ran (4 is the default) where --gamma 3 was refused; --branch 2
    with --spec draft likewise; --raw took a --chat-template it leaves out, and
    --no-prefix-cache a --cache-ram or --prefix-cache-blocks for the cache it turns off."""
    for command, extra, says in (
            ("run", ["--gamma", "4"], "--gamma is for --spec, and no --spec is given"),
            ("run", ["--spec", "draft", "--draft-model", model_path, "--branch", "2"],
             "--branch is for --spec tree, not --spec draft"),
            ("run", ["--spec", "ngram", "--draft-p-min", "0"], "--draft-p-min is for --spec "
                                                               "draft or tree"),
            ("serve", ["--gamma", "4"], "--gamma is for --spec, and no --spec is given"),
            ("run", ["--raw", "--chat-template", "chatml"],
             "--chat-template chooses the chat template, which --raw leaves out"),
            ("run", ["--no-prefix-cache", "--cache-ram", "8192"],
             "--cache-ram: for the prefix cache, which --no-prefix-cache turns off"),
            ("serve", ["--no-prefix-cache", "--prefix-cache-blocks", "0"],
             "--prefix-cache-blocks: for the prefix cache")):
        args = [command, model_path, *extra] + (["-p", "Hi"] if command == "run" else [])
        r = runner.invoke(app, args)
        assert r.exit_code == 1, (args, r.output)
        lines = r.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], (
            args, r.output)
    # From a config file or a JUSTLLM_* variable (defaults shared with commands that use
    # them), they are passed over: the run goes ahead.
    cfg = tmp_path / "c.yaml"
    cfg.write_text("gamma: 3\nbranch: 3\ncache-ram: 5\n")
    r = runner.invoke(app, ["run", model_path, "--raw", "-p", "Hi", "-n", "1", "--pool-blocks",
                            "64", "--no-prefix-cache", "--config", str(cfg)],
                      env={"JUSTLLM_CHAT_TEMPLATE": "chatml", "JUSTLLM_DRAFT_P_MIN": "0.5"})
    assert r.exit_code == 0 and "generation 1 tok" in r.stderr, r.output


def test_rm_refuses_a_model_run_is_generating_with(model_path, tmp_path):
    """`justllm run` took no lease on its model: `rm` could delete it mid-answer."""
    import os
    import shutil
    import signal

    models = tmp_path / "models"
    models.mkdir()
    path = models / "held.gguf"
    path.symlink_to(model_path)  # (rm deletes the link, never the demo model)
    shutil.copyfile(model_path + ".sha256", str(path) + ".sha256")  # no hashing
    env = {**os.environ, "JUSTLLM_MODELS_DIR": str(models)}
    proc = subprocess.Popen([sys.executable, "-m", "justllm", "run", str(path), "--raw", "-p",
                             "Once upon a time", "-n", "1500", "--ignore-eos",
                             "--pool-blocks", "128"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env,
                            # (a test worker may ignore SIGINT, and its children inherit that:
                            # the answer then ran its 1,500 tokens, a minute, before it ended)
                            preexec_fn=default_sigint)
    try:
        assert proc.stdout.read(1), proc.stderr.read()  # generating
        rm = subprocess.run([sys.executable, "-m", "justllm", "rm", "held"], env=env,
                            capture_output=True, text=True, timeout=120)
        assert proc.poll() is None  # it still ran while rm looked
        assert rm.returncode == 1 and rm.stderr.startswith(
            "error: cannot remove held:latest: its version sha256:"), rm.stderr
        assert rm.stderr.strip().endswith(f"is in use by a running model (pid {proc.pid}); "
                                          "stop that model first"), rm.stderr
        assert path.is_symlink()
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=120)
    assert proc.returncode == 130  # ended by the Ctrl-C, not by running out of tokens
    rm = subprocess.run([sys.executable, "-m", "justllm", "rm", "held"], env=env,
                        capture_output=True, text=True, timeout=120)
    assert rm.returncode == 0 and not path.is_symlink(), rm.stderr
    assert os.path.isfile(model_path)


def test_run_holds_a_thinking_model_to_its_reasoning_budget(model_path, tmp_path):
    """--reasoning-budget was taken by run and ignored: a model that thinks now has the end
    of its thinking forced past it, as a server forces it; a budget for a model that does
    not think, or with --raw, and --reasoning-format other than none are refused (one line),
    and a budget a JUSTLLM_* variable sets for every command is let be there."""
    thinks = tmp_path / "think.jinja"  # (the generation prompt opens the thinking)
    thinks.write_text("{% for m in messages %}User: {{ m['content'] }}\n{% if m.thinking %}"
                      "<think>{{ m.thinking }}</think>{% endif %}{% endfor %}"
                      "Assistant: <think>\n")
    base = ["run", model_path, "-p", "Why is the sky blue?", "-n", "12", "--pool-blocks",
            "64", "--chat-template", str(thinks)]
    r = runner.invoke(app, [*base, "--reasoning-budget", "0",
                            "--reasoning-budget-message", "Enough."])
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("Enough.\n</think>"), r.stdout  # forced at once
    r = runner.invoke(app, [*base, "--reasoning-budget", "3"])
    assert r.exit_code == 0, r.output
    assert "</think>" in r.stdout and r.stdout.index("</think>") < 40, r.stdout
    for flags in (["--reasoning-budget", "5"], ["--reasoning-budget-message", "x"],
                  ["--reasoning-budget", "5", "--raw"], ["--reasoning-format", "deepseek"]):
        r = runner.invoke(app, ["run", model_path, "-p", "Hi", "-n", "2", "--pool-blocks",
                                "64", *flags])
        assert r.exit_code == 1, (flags, r.output)
        assert r.output.strip().splitlines()[-1].startswith("error: --reasoning-"), r.output
    r = runner.invoke(app, ["run", model_path, "-p", "Hi", "-n", "1", "--pool-blocks", "64"],
                      env={"JUSTLLM_REASONING_BUDGET": "5",
                           "JUSTLLM_REASONING_FORMAT": "deepseek"})
    assert r.exit_code == 0, r.output


def test_run_with_its_output_closed_says_so_in_one_line(model_path):
    """Started with stdout closed (``>&-``), run ended in a traceback."""
    r = subprocess.run(["bash", "-c", f'"{sys.executable}" -m justllm run "{model_path}" '
                        '-p Hi -n 1 >&-'], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip() == "error: standard output is closed: nowhere to write the answer"


def test_a_small_context_holds_the_default_max_tokens_to_the_room_it_leaves(model_path):
    """-n's default (256) is what run draws at most, not a request for that many: with a
    context of 64 tokens it was an error ("the request asks for 293"), though nothing asked
    for them; it now fills the context, as llama-cli does. A typed -n is held to as before."""
    r = runner.invoke(app, ["run", model_path, "-p", "Tell me a story.", "--ignore-eos", "--raw",
                            "--ctx", "64", "--pool-blocks", "64"])
    assert r.exit_code == 0, r.output
    summary = next(line for line in r.stderr.splitlines() if line.startswith("prompt "))
    prompt = int(summary.split()[1])
    assert f"generation {64 - prompt} tok" in summary and "finish: length" in summary
    typed = runner.invoke(app, ["run", model_path, "-p", "Tell me a story.", "-n", "256",
                                "--ctx", "64", "--pool-blocks", "64"])
    assert typed.exit_code == 1 and "maximum context length is 64 tokens" in typed.output
