"""``justllm quantize`` on the demo model through llama.cpp's real quantizer (seconds each)."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from justllm.cli import app
from justllm.core.sampling_params import SamplingParams
from justllm.engine.llm import LLM
from justllm.models.gguf import read_gguf_header

runner = CliRunner()


@pytest.fixture
def models_dir(tmp_path, monkeypatch):
    d = tmp_path / "models"
    d.mkdir()
    monkeypatch.setenv("JUSTLLM_MODELS_DIR", str(d))
    return d


def error_line(r) -> str:
    assert r.exit_code == 1, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


def files(d) -> list[str]:
    """Everything in ``d`` (hidden files included) but the registry's lock file."""
    return sorted(p.name for p in d.iterdir() if p.name != ".lock")


def generates(path) -> bool:
    llm = LLM(str(path), max_seqs=2, pool_blocks=32)
    try:
        (out,) = llm.generate("The capital of France is",
                              SamplingParams(max_tokens=4, ignore_eos=True))
        return len(out.token_ids) == 4
    finally:
        llm.close()


def test_quantize_to_q8_0_into_the_models_directory(model_path, models_dir):
    r = runner.invoke(app, ["quantize", model_path, "Q8_0", "--allow-requantize"])
    assert r.exit_code == 0, r.output
    out = models_dir / "gemma-3-270m-q8_0.gguf"
    assert f"wrote {out} (Q8_0" in r.stdout and "registered as gemma-3-270m-q8_0:latest" in r.stdout
    assert read_gguf_header(out).integer("general.file_type") == 7  # LLAMA_FTYPE_MOSTLY_Q8_0
    listed = runner.invoke(app, ["models"])
    assert listed.stdout.splitlines()[1].split()[:1] == ["gemma-3-270m-q8_0:latest"]
    assert "Q8_0" in listed.stdout.splitlines()[1].split()
    assert generates(out)
    assert [p.name for p in models_dir.glob(".*partial*")] == []
    # where it came from (it said only "file")
    shown = runner.invoke(app, ["show", "gemma-3-270m-q8_0"])
    said = " ".join(shown.stdout.split())
    assert f"source: quantized from {Path(model_path).resolve()} (sha256:" in said, said


def test_force_over_a_version_a_running_model_holds_is_refused(model_path, models_dir):
    """rm refused a version in use while quantize --force overwrote it."""
    from justllm.models.registry import lease_for_path

    out = models_dir / "gemma-3-270m-q8_0.gguf"
    assert runner.invoke(app, ["quantize", model_path, "Q8_0", "--allow-requantize"]).exit_code == 0
    before = out.read_bytes()
    with lease_for_path(out):  # this process serves it, as `justllm serve` would
        line = error_line(runner.invoke(app, ["quantize", model_path, "Q4_0",
                                              "--allow-requantize", "-o", str(out), "--force"]))
    assert f"cannot overwrite {out}: its version sha256:" in line
    assert f"is in use by a running model (pid {os.getpid()})" in line
    assert out.read_bytes() == before


def test_quantize_to_q4_0_at_a_path(model_path, models_dir, tmp_path):
    out = tmp_path / "elsewhere" / "small.gguf"
    out.parent.mkdir()
    r = runner.invoke(app, ["quantize", model_path, "q4_0", "--allow-requantize", "-o", str(out),
                            "--threads", "2"])
    assert r.exit_code == 0, r.output
    assert "registered" not in r.stdout  # --output: not added to the models directory
    assert read_gguf_header(out).integer("general.file_type") == 2  # Q4_0
    assert generates(out)
    assert not list(models_dir.glob("*.gguf"))


def test_list_shows_llama_cpps_types_and_descriptions():
    r = runner.invoke(app, ["quantize", "--list"])
    assert r.exit_code == 0
    rows = {line.split()[0]: line for line in r.stdout.splitlines()[1:] if line.strip()}
    assert "4.58G, +0.1754 ppl @ Llama-3-8B" in rows["Q4_K_M"]
    assert "needs --imatrix" in rows["IQ2_XXS"] and "needs --imatrix" not in rows["IQ4_XS"]
    assert {"Q2_K", "Q8_0", "F16", "BF16", "IQ4_NL"} <= rows.keys()
    assert "only for ternary models" in rows["TQ1_0"]
    assert "only for 1-bit models" in rows["Q1_0"] and "only for" not in rows["Q2_K"]
    # a MODEL or TYPE beside --list was ignored (the list came, nothing was quantized)
    for args in (["m.gguf", "Q8_0"], ["m.gguf"]):
        r = runner.invoke(app, ["quantize", *args, "--list"])
        assert r.exit_code == 1 and r.stderr.strip() == (
            "error: --list lists the types and quantizes nothing: give it without MODEL and "
            "TYPE"), r.output


def test_a_type_for_models_trained_in_it_is_said_to_be(tmp_path):
    """TQ1_0, TQ2_0, Q1_0 and Q2_0 are for models trained in them: the demo model in any of
    them answered gibberish, and neither llama.cpp nor justllm said a word."""
    r = runner.invoke(app, ["quantize", str(tmp_path / "missing.gguf"), "TQ2_0"])
    assert r.exit_code == 1
    assert ("warning: TQ2_0 is for models trained with ternary weights; "
            "any other model quantized to it answers gibberish") in " ".join(r.stderr.split())
    r = runner.invoke(app, ["quantize", str(tmp_path / "missing.gguf"), "Q2_K"])
    assert r.exit_code == 1 and "warning" not in r.stderr


def test_bad_inputs_are_one_line_and_write_nothing(model_path, models_dir, tmp_path,
                                                    monkeypatch):
    existing = tmp_path / "taken.gguf"
    existing.write_bytes(b"x")
    fifo = tmp_path / "fifo.gguf"
    os.mkfifo(fifo)
    text = tmp_path / "notes.txt"  # (read as the legacy format: a raw struct error)
    text.write_text("hello\n")
    negative = tmp_path / "negative.dat"  # (an "offset -363220611 out of range" error)
    negative.write_bytes(struct.pack("<ii", 1, -5) + bytes(16))
    foreign = tmp_path / "foreign.dat"  # (quantized without it, saying nothing)
    write_legacy_imatrix(foreign, {"model.layers.0.q_proj": np.ones(640, dtype=np.float32)})
    below = tmp_path / "below.dat"  # (IQ2_XS: ggml's assert, a deadlock and a 185 MB partial)
    write_legacy_imatrix(below, {"blk.0.attn_q.weight": -np.ones(640, dtype=np.float32)})
    cases = [
        (["IQ2_XS", "--allow-requantize", "--imatrix", str(below)],
         "below.dat: the importance of blk.0.attn_q.weight has negative or non-finite values"),
        (["Q8_0", "--allow-requantize", "--imatrix", str(text)],
         "not GGUF, and as a legacy .dat it ends early: 8 bytes needed, the file has 6"),
        (["Q8_0", "--allow-requantize", "--imatrix", str(negative)],
         "not GGUF, and as a legacy .dat it has a negative length at byte 4"),
        (["Q8_0", "--allow-requantize", "--imatrix", str(foreign)],
         "the importance matrix foreign.dat has none of gemma-3-270m-q4_k_m.gguf's tensors "
         "(its 1 entries name e.g. model.layers.0.q_proj): it was made for another model"),
        # (the FIFO was replaced by a 291 MB file; as root, /dev/null would have been too)
        (["Q8_0", "--allow-requantize", "-o", str(fifo), "--force"],
         f"--output {fifo} is not a regular file; give the path of a file"),
        (["Q9_9"], "unknown quantization type 'Q9_9'"),
        (["Q8_0", "--allow-requantize", "-o", str(existing)], "already exists (--force"),
        (["Q8_0"], "is quantized already (Q4_K_M)"),
        (["IQ2_XXS", "--allow-requantize"], "IQ2_XXS needs an importance matrix"),
        (["Q8_0", "--allow-requantize", "--imatrix", str(tmp_path / "no.dat")],
         "imatrix file not found"),
        # (an empty path meant none, and the model was quantized without one)
        (["Q8_0", "--allow-requantize", "--imatrix", ""], "--imatrix is empty: give the "
         "importance matrix file"),
        # (it said "imatrix file not found" for a folder)
        (["Q8_0", "--allow-requantize", "--imatrix", str(tmp_path)],
         f"--imatrix {tmp_path} is a directory; pass the importance matrix file"),
        # (llama.cpp said only "failed to quantize: basic_ios::clear: iostream error")
        (["Q8_0", "--allow-requantize", "-o", "/proc/x.gguf"], "cannot write to /proc: "),
        (["Q8_0", "--allow-requantize", "-o", "/proc/x/"], "cannot write to /proc: "),  # (it
        # said there was not enough disk space)
        # (it meant no -o: Q8_0 went into the models directory, registered)
        (["Q8_0", "--allow-requantize", "-o", ""], "--output is empty: give a file or folder"),
        (["Q8_0", "--allow-requantize", "--threads", "513"],
         "--threads must be in [0, 512] (ggml's most)"),
    ]
    for args, words in cases:
        r = runner.invoke(app, ["quantize", model_path, *args])
        assert words in error_line(r), r.stderr
    r = runner.invoke(app, ["quantize", str(tmp_path / "missing.gguf"), "Q8_0"])
    assert "not found" in error_line(r)
    from tests.lora_files import write_adapter  # (it was told to use quantize's --lora)
    adapter = write_adapter(tmp_path / "ad.gguf", seed=1)
    assert "is a LoRA adapter: quantize takes models" in error_line(
        runner.invoke(app, ["quantize", str(adapter), "Q8_0"]))
    r = runner.invoke(app, ["quantize", model_path])
    assert "give MODEL and TYPE" in error_line(r)
    monkeypatch.setattr("justllm.models.quantize.disk_free", lambda d: 50_000_000)
    r = runner.invoke(app, ["quantize", model_path, "Q8_0", "--allow-requantize"])
    assert "not enough disk space" in error_line(r) and "50 MB free" in r.stderr
    assert files(models_dir) == [] and existing.read_bytes() == b"x"


def write_legacy_imatrix(path, entries: dict[str, np.ndarray]) -> None:
    """llama-imatrix's legacy .dat format: entries (name, ncall, values), chunks, dataset."""
    with open(path, "wb") as f:
        f.write(struct.pack("<i", len(entries)))
        for name, values in entries.items():
            raw = name.encode()
            f.write(struct.pack("<i", len(raw)) + raw + struct.pack("<ii", 1, values.size))
            f.write(values.astype("<f4").tobytes())
        f.write(struct.pack("<i", 10) + struct.pack("<i", 4) + b"test")


def test_a_failed_run_leaves_no_partial_file(model_path, models_dir, tmp_path):
    """llama.cpp stops half-way (an importance matrix whose size does not fit a tensor, found
    when that tensor's turn comes): one error line, nothing left in the models directory."""
    bad = tmp_path / "bad.dat"
    write_legacy_imatrix(bad, {"blk.3.attn_q.weight": np.ones(7, dtype=np.float32)})
    r = runner.invoke(app, ["quantize", model_path, "Q4_0", "--allow-requantize", "--imatrix",
                            str(bad)])
    assert "imatrix size 7 is different from tensor size 640" in error_line(r)
    assert files(models_dir) == []
    # -o into folders made for it: all of them removed again (it left new/ behind)
    r = runner.invoke(app, ["quantize", model_path, "Q4_0", "--allow-requantize", "--imatrix",
                            str(bad), "-o", f"{tmp_path / 'new' / 'dir'}/"])
    assert "imatrix size 7 is different" in error_line(r)
    assert not (tmp_path / "new").exists()


def write_imatrix_gguf(path) -> None:
    """llama-imatrix's GGUF output, one entry."""
    import gguf

    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_type("imatrix")
    w.add_tensor("blk.0.attn_q.weight.in_sum2", np.full((1, 640), 2.0, dtype=np.float32))
    w.add_tensor("blk.0.attn_q.weight.counts", np.full((1, 1), 2.0, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_an_importance_matrix_given_as_a_model_says_what_it_is(tmp_path):
    """llama.cpp said "key not found in model: gemma3.context_length"."""
    path = tmp_path / "imatrix.gguf"
    write_imatrix_gguf(path)
    says = f"{path} is an importance matrix, not a model: use it with justllm quantize"
    for args in (["run", str(path), "-p", "hi"], ["show", str(path)],
                 ["quantize", str(path), "Q8_0", "-o", str(tmp_path / "out.gguf")]):
        r = runner.invoke(app, args)
        assert r.exit_code == 1 and says in r.output, (args, r.output)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["imatrix.gguf"]


def test_an_importance_matrix_is_used_and_recorded(model_path, models_dir, tmp_path):
    path = tmp_path / "imatrix.gguf"
    write_imatrix_gguf(path)
    out = tmp_path / "q4km.gguf"
    r = runner.invoke(app, ["quantize", model_path, "Q4_K_M", "--allow-requantize", "--imatrix",
                            str(path), "-o", str(out)])
    assert r.exit_code == 0, r.output
    meta = read_gguf_header(out).metadata
    assert meta["quantize.imatrix.file"] == str(path)
    assert meta["quantize.imatrix.entries_count"] == 1
    assert read_gguf_header(out).integer("general.file_type") == 15


def table(models_dir) -> list[list[str]]:
    """``justllm models`` rows: NAME, DIGEST, QUANT."""
    r = runner.invoke(app, ["models"])
    assert r.exit_code == 0, r.output
    return [[row[0], row[1], row[4]] for row in (line.split() for line in
                                                r.stdout.splitlines()[1:])]


def test_force_over_a_registered_file_replaces_its_version(model_path, models_dir):
    """``--force`` onto a registered file left its old version listed (old digest and type),
    and every use of it failed with a digest mismatch; the default output left the old version
    as <untagged>. The registry follows the disk: the old version goes, its tags follow the
    file. A tag quantize moves from another version is reported, as tag and pull do."""
    from justllm.models.registry import Registry

    q8 = models_dir / "gemma-3-270m-q8_0.gguf"
    assert runner.invoke(app, ["quantize", model_path, "Q8_0", "--allow-requantize"]).exit_code == 0
    assert runner.invoke(app, ["tag", "gemma-3-270m-q8_0", "mine"]).exit_code == 0
    old = Registry().resolve("mine")[1].short
    r = runner.invoke(app, ["quantize", model_path, "Q4_0", "--allow-requantize", "-o", str(q8),
                            "--force"])
    assert r.exit_code == 0, r.output
    new = Registry().resolve("mine")[1].short
    assert " ".join(r.stdout.split()).endswith(
        f"replaced sha256:{old} (its file was overwritten); gemma-3-270m-q8_0:latest, "
        f"mine:latest now point to sha256:{new}")
    assert table(models_dir) == [["gemma-3-270m-q8_0:latest", new, "Q4_0"],
                                 ["mine:latest", new, "Q4_0"]]
    assert runner.invoke(app, ["show", "mine"]).exit_code == 0
    # --force onto the default output: no <untagged> row for the bytes that are gone.
    r = runner.invoke(app, ["quantize", model_path, "Q8_0", "--allow-requantize", "--force"])
    assert r.exit_code == 0, r.output
    assert f"replaced sha256:{new} (its file was overwritten)" in " ".join(r.stdout.split())
    rows = table(models_dir)
    assert [row[0] for row in rows] == ["gemma-3-270m-q8_0:latest", "mine:latest"]
    assert {row[2] for row in rows} == {"Q8_0"} and rows[0][1] == rows[1][1] == old
    # The default output's tag pointed to another version (kept): quantize says it moved.
    assert runner.invoke(app, ["tag", model_path, "gemma-3-270m-q4_0"]).exit_code == 0
    r = runner.invoke(app, ["quantize", model_path, "Q4_0", "--allow-requantize"])
    assert r.exit_code == 0, r.output
    assert " ".join(r.stdout.split()).endswith(
        "registered as gemma-3-270m-q4_0:latest (justllm run gemma-3-270m-q4_0); moved from "
        "sha256:a5fd3b62230a, which is kept")


def test_output_directory_and_the_disk_space_it_needs(model_path, models_dir, tmp_path,
                                                      monkeypatch):
    """``-o newdir/`` wrote a file called newdir; an existing directory was refused. Both get
    the default file name inside. The disk check said "needs about 0 MB, 1 MB free", hiding
    the margin it also keeps free."""
    import justllm.models.quantize as quantize_module

    real = quantize_module.disk_free
    monkeypatch.setattr(quantize_module, "disk_free", lambda d: 1_000_000)
    r = runner.invoke(app, ["quantize", model_path, "Q8_0", "--allow-requantize", "-o",
                            f"{tmp_path / 'newdir'}/"])
    line = error_line(r)
    assert f"not enough disk space in {tmp_path / 'newdir'}: the output needs about " in line
    assert " MB estimated plus 17 MB kept free), 1 MB free" in line
    assert not (tmp_path / "newdir").exists()
    monkeypatch.setattr(quantize_module, "disk_free", real)
    for output in (f"{tmp_path / 'newdir'}/", str(tmp_path / "newdir")):
        r = runner.invoke(app, ["quantize", model_path, "Q8_0", "--allow-requantize", "--force",
                                "-o", output])
        assert r.exit_code == 0, r.output
        out = tmp_path / "newdir" / "gemma-3-270m-q8_0.gguf"
        assert f"wrote {out} (Q8_0" in " ".join(r.stdout.split())
        assert read_gguf_header(out).integer("general.file_type") == 7
    assert files(models_dir) == []


def test_an_output_another_run_wrote_meanwhile_is_not_replaced(model_path, models_dir,
                                                               tmp_path):
    """Two runs to one output, both checked before either wrote: the later rename replaced
    the earlier's file, though neither had --force, and both said they wrote it."""
    from justllm.models.quantize import prepare, quant_type

    out = tmp_path / "out.gguf"
    job = prepare(Path(model_path), quant_type("Q8_0"), out, allow_requantize=True)
    out.write_bytes(b"the other run's model")
    with pytest.raises(ValueError, match=r"out.gguf already exists \(--force overwrites it\): "
                                         "another run wrote it while this one ran"):
        job.run()
    assert out.read_bytes() == b"the other run's model"
    assert files(tmp_path) == ["models", "out.gguf"]
    job = prepare(Path(model_path), quant_type("Q8_0"), out, allow_requantize=True, force=True)
    assert job.run() == out and read_gguf_header(out).integer("general.file_type") == 7


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_leaves_no_temporary_file_and_killed_runs_are_swept(model_path, tmp_path, sig):
    """SIGTERM's default ended the process with its hidden .partial file left beside the
    output (SIGHUP's, a closed terminal, still did); one left by a killed run (SIGKILL) is
    removed by the next run to that output."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = tmp_path / f".out.gguf.partial-{gone.pid}"
    stale.write_bytes(b"half a model")
    proc = subprocess.Popen([sys.executable, "-m", "justllm", "quantize", model_path, "Q8_0",
                             "--allow-requantize", "-o", str(tmp_path / "out.gguf")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while stale.exists() or not list(tmp_path.glob(".out.gguf.partial-*")):
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.01)
        proc.send_signal(sig)  # it is writing its own now, the stale one swept
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + sig and "terminated: no output written" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_terminated_run_into_new_folders_leaves_none_of_them(model_path, tmp_path):
    """-o new/dir/ and SIGTERM: the partial file went, the folders made for it stayed (the
    process ends under llama.cpp's C call, without unwinding to the folder's cleanup)."""
    proc = subprocess.Popen([sys.executable, "-m", "justllm", "quantize", model_path, "Q8_0",
                             "--allow-requantize", "-o", f"{tmp_path / 'new' / 'dir'}/"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not list((tmp_path / "new" / "dir").glob(".*.partial-*")):
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert list(tmp_path.iterdir()) == []
