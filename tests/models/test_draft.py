"""``justllm draft make``: exact copies checked on a tiny hand-built GGUF (instant to parse),
and a 6-of-18-layer draft of the demo model, written once per session (tests/conftest.py's
``cli_draft6``, shared with tests/spec), that llama.cpp loads with the same vocabulary."""

import os
import signal
import stat
import struct
import subprocess
import sys
import time

import gguf
import numpy as np
import pytest
from typer.testing import CliRunner

from justllm.cli import app
from justllm.engine.backend import BackendConfig, LlamaBackend, read_gguf_info
from justllm.errors import ModelLoadError
from justllm.models.draft import make_draft

runner = CliRunner()
SAMPLE = "Speculative decoding: the draft proposes, the target verifies. 12345 ünïcødé 🙂"
Q8_0 = gguf.GGMLQuantizationType.Q8_0


@pytest.fixture
def tiny(tmp_path):
    """Four blocks, one per-layer metadata array, F32 and Q8_0 tensors, a vocabulary with a
    piece that is not valid UTF-8."""
    path = tmp_path / "tiny.gguf"
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, arch="llama")
    w.add_block_count(4)
    w.add_context_length(64)
    w.add_array("llama.attention.head_count_kv", [1, 1, 2, 2])
    w.add_array("general.tags", ["a", "b", "c", "d"])  # length 4, but not per-layer
    w.add_key_value("tokenizer.ggml.tokens", ["<s>", "hi", b"\xff\xfe"], gguf.GGUFValueType.ARRAY,
                    sub_type=gguf.GGUFValueType.STRING)
    w.add_array("tokenizer.ggml.scores", [0.0, -1.5, -2.5])
    w.add_tensor("token_embd.weight", rng.standard_normal((3, 32), dtype=np.float32))
    for i in range(4):
        w.add_tensor(f"blk.{i}.attn_norm.weight", rng.standard_normal(32, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_down.weight",
                     gguf.quants.quantize(rng.standard_normal((8, 32), dtype=np.float32), Q8_0),
                     raw_dtype=Q8_0)
    w.add_tensor("output_norm.weight", rng.standard_normal(32, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_tiny_draft_keeps_first_blocks_bytes_and_metadata(tiny, tmp_path):
    info = make_draft(tiny, tmp_path / "d.gguf", 2)
    assert (info.layers, info.source_layers) == (2, 4)
    assert info.size_bytes == (tmp_path / "d.gguf").stat().st_size
    src, out = gguf.GGUFReader(tiny), gguf.GGUFReader(info.path)
    assert out.get_field("llama.block_count").contents() == 2
    assert out.get_field("llama.attention.head_count_kv").contents() == [1, 1]
    assert out.get_field("general.tags").contents() == ["a", "b", "c", "d"]
    tokens = out.get_field("tokenizer.ggml.tokens")
    assert [bytes(tokens.parts[i]) for i in tokens.data] == [b"<s>", b"hi", b"\xff\xfe"]
    assert out.get_field("tokenizer.ggml.scores").contents() == [0.0, -1.5, -2.5]
    assert ([f for f in src.fields if f != "llama.block_count" and not f.startswith("GGUF.")]
            == [f for f in out.fields if f != "llama.block_count" and not f.startswith("GGUF.")])
    kept = {t.name: t for t in out.tensors}
    assert list(kept) == ["token_embd.weight", "blk.0.attn_norm.weight", "blk.0.ffn_down.weight",
                          "blk.1.attn_norm.weight", "blk.1.ffn_down.weight", "output_norm.weight"]
    for t in src.tensors:
        if t.name in kept:
            u = kept[t.name]
            assert (u.tensor_type, list(u.shape)) == (t.tensor_type, list(t.shape))
            assert np.array_equal(u.data, t.data)
    assert kept["blk.0.ffn_down.weight"].tensor_type == Q8_0
    assert list(kept["blk.0.ffn_down.weight"].shape) == [32, 8]


def test_a_draft_written_meanwhile_by_another_run_is_not_replaced(tiny, tmp_path,
                                                                   monkeypatch):
    """Two runs to one output both wrote DST.part and both renamed it into place: the later
    replaced the earlier's draft, though neither had --force."""
    import justllm.models.draft as draft

    out = tmp_path / "d.gguf"
    real = draft._write

    def and_another_run(reader, part, *args):
        real(reader, part, *args)
        out.write_bytes(b"the other run's draft")  # (it finished first)

    monkeypatch.setattr(draft, "_write", and_another_run)
    with pytest.raises(ValueError, match="another run wrote it while this one ran"):
        make_draft(tiny, out, 2)
    assert out.read_bytes() == b"the other run's draft"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.gguf", "tiny.gguf"]
    out.unlink()
    make_draft(tiny, out, 2, force=True)  # (--force replaces what appeared)
    assert gguf.GGUFReader(out).get_field("llama.block_count").contents() == 2


def test_tiny_draft_refuses_bad_requests(tiny, tmp_path):
    out = tmp_path / "d.gguf"
    with pytest.raises(ValueError, match="overwrite its source"):
        make_draft(tiny, tiny, 2, force=True)
    make_draft(tiny, out, 3)
    with pytest.raises(ValueError, match="already exists"):
        make_draft(tiny, out, 2)
    assert make_draft(tiny, out, 2, force=True).layers == 2
    assert gguf.GGUFReader(out).get_field("llama.block_count").contents() == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.gguf", "tiny.gguf"]  # no .part left
    fifo = tmp_path / "fifo.gguf"
    os.mkfifo(fifo)  # (--force replaced it with the draft)
    with pytest.raises(ValueError, match="is not a regular file"):
        make_draft(tiny, fifo, 2, force=True)
    assert stat.S_ISFIFO(fifo.lstat().st_mode)


def every_kind_of_value(path, endianess) -> None:
    """A GGUF with a value of every type, arrays of each (strings with an empty one and one
    that is not UTF-8) and one tensor, in ``endianess``."""
    w = gguf.GGUFWriter(path, arch="llama", endianess=endianess)
    t = gguf.GGUFValueType
    numbers = {t.UINT8: [0, 255], t.INT8: [-128, 127], t.UINT16: [65535, 1], t.INT16: [-2, 3],
               t.UINT32: [2**32 - 1, 7], t.INT32: [-(2**31), 5], t.FLOAT32: [1.5, -0.25],
               t.BOOL: [True, False, True], t.UINT64: [2**64 - 1, 9], t.INT64: [-(2**63), 1],
               t.FLOAT64: [0.1, -2.5]}
    for kind, values in numbers.items():
        w.add_key_value(f"test.{kind.name}", values[0], kind)
        w.add_key_value(f"test.{kind.name}s", values, t.ARRAY, sub_type=kind)
    w.add_key_value("test.strings", ["a", "", b"\xff\xfe", "ünï🙂" * 50], t.ARRAY, sub_type=t.STRING)
    w.add_key_value("test.string", "x", t.STRING)
    w.add_tensor("token_embd.weight", np.arange(64, dtype=np.float32).reshape(2, 32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_with_tensors(writer, reader) -> None:
    """``reader``'s tensors added to ``writer``, and the file written."""
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_shape=tensor.data.shape,
                          raw_dtype=tensor.tensor_type, tensor_endianess=reader.endianess)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("endianess", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG],
                         ids=["little", "big"])
def test_the_fast_parse_and_write_are_the_gguf_packages_own(tmp_path, endianess):
    """draft.py's reader and writer take shortcuts through arrays (10 s → 2 s for the demo
    model's 262k-token vocabulary): every field, part and byte must be what gguf gives."""
    from justllm.models.draft import _read, copying_writer

    src = tmp_path / "src.gguf"
    every_kind_of_value(src, endianess)
    fast, slow = _read(src), gguf.GGUFReader(src)
    assert list(fast.fields) == list(slow.fields) and len(fast.fields) > 25
    for name, ours in fast.fields.items():
        theirs = slow.fields[name]
        assert (ours.offset, ours.data, ours.types) == (theirs.offset, theirs.data, theirs.types)
        assert [(p.dtype, p.shape, p.tobytes()) for p in ours.parts] == \
            [(p.dtype, p.shape, p.tobytes()) for p in theirs.parts], name
    assert fast.fields["test.strings"].contents(slice(0, 2)) == ["a", ""]
    for reader, out in ((fast, tmp_path / "fast.gguf"), (slow, tmp_path / "slow.gguf")):
        write_with_tensors(copying_writer(reader, out, "llama"), reader)  # the fast writer
    assert (tmp_path / "fast.gguf").read_bytes() == (tmp_path / "slow.gguf").read_bytes()
    plain = gguf.GGUFWriter(tmp_path / "plain.gguf", arch="llama", endianess=endianess)
    for name, field in slow.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = ([bytes(field.parts[i]) for i in field.data] if sub == gguf.GGUFValueType.STRING
                 else field.contents())
        plain.add_key_value(name, value, kind, sub_type=sub)
    write_with_tensors(plain, slow)
    assert (tmp_path / "fast.gguf").read_bytes() == (tmp_path / "plain.gguf").read_bytes()


@pytest.mark.parametrize("key, values", [("test.words", [f"w{i}" for i in range(200)]),
                                         ("test.scores", [float(i) for i in range(200)])])
def test_an_array_cut_short_is_a_model_load_error(tmp_path, key, values):
    """The fast parse's own walk through an array: past the end of the file is the one-line
    error gguf's parse gave (struct's own error, or a numpy reshape, escaped it)."""
    from justllm.models.draft import _read

    path = tmp_path / "cut.gguf"
    w = gguf.GGUFWriter(path, arch="llama")
    w.add_array(key, values)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    with pytest.raises(ModelLoadError, match="is not a readable GGUF file"):
        _read(path)


def test_a_vocabulary_listing_a_token_twice_is_refused_before_the_draft(tmp_path):
    """llama.cpp aborts on such a vocabulary: a draft of it would be a file nothing loads."""
    twice = tmp_path / "twice.gguf"
    w = gguf.GGUFWriter(twice, arch="llama")
    w.add_block_count(4)
    w.add_key_value("tokenizer.ggml.tokens", ["<s>", "hi", "hi"], gguf.GGUFValueType.ARRAY,
                    sub_type=gguf.GGUFValueType.STRING)
    w.add_tensor("token_embd.weight", np.zeros((3, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="lists the token 'hi' twice"):
        make_draft(twice, tmp_path / "d.gguf", 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["twice.gguf"]


@pytest.fixture
def made(cli_draft6):
    """The CLI's success path with the default output: next to a (writable) source."""
    return cli_draft6


def one_line_error(result) -> str:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1
    return result.output.strip()


@pytest.mark.model
def test_cli_writes_next_to_the_source_and_says_so(made):
    src, draft, output = made
    assert draft.is_file() and f"wrote {draft}" in output and "6 of 18 layers" in output
    assert draft.stat().st_size < src.stat().st_size
    assert not list(draft.parent.glob("*.partial-*"))


def tensor_count(path) -> int:
    """From the GGUF header (magic, version, tensor count): no 262k-string parse needed."""
    with open(path, "rb") as f:
        return struct.unpack("<4sIQ", f.read(16))[2]


@pytest.mark.model
def test_draft_has_six_blocks_and_all_other_metadata(made):
    src, draft, _ = made
    meta, src_meta = read_gguf_info(str(draft)), read_gguf_info(str(src))
    assert meta["gemma3.block_count"] == "6"
    assert {k: v for k, v in meta.items() if k != "gemma3.block_count"} == {
        k: v for k, v in src_meta.items() if k != "gemma3.block_count"}
    # 13 tensors per block plus token_embd and output_norm; which ones: the tiny test above.
    assert (tensor_count(src), tensor_count(draft)) == (2 + 18 * 13, 2 + 6 * 13)


@pytest.mark.model
def test_draft_loads_in_llama_cpp_with_the_same_vocabulary_and_decodes(made):
    src, draft, _ = made
    cfg = dict(n_ctx=128, n_batch=64, n_seq_max=1, n_outputs_max=1, n_threads=2)
    target = LlamaBackend(BackendConfig(model_path=str(src), **cfg))
    try:
        target_vocab, target_tokens = target.n_vocab, target.tokenize(SAMPLE)
    finally:
        target.close()
    backend = LlamaBackend(BackendConfig(model_path=str(draft), **cfg))
    try:
        assert backend.n_vocab == target_vocab == 262144
        tokens = backend.tokenize(SAMPLE)
        assert tokens == target_tokens
        out, pos = [], 0
        for _ in range(4):
            n = len(tokens)
            backend.batch_tokens[:n] = tokens
            backend.batch_pos[:n] = np.arange(pos, pos + n)
            backend.batch_seq[:n] = 0
            backend.batch_logits[:n] = 0
            backend.batch_logits[n - 1] = 1
            logits = backend.decode(n)
            assert logits.shape == (1, target_vocab) and np.isfinite(logits).all()
            pos += n
            tokens = [int(np.argmax(logits[0]))]
            out.append(tokens[0])
        assert all(0 <= t < target_vocab for t in out)
    finally:
        backend.close()


@pytest.mark.model
def test_existing_output_needs_force(made):
    src, draft, _ = made
    msg = one_line_error(runner.invoke(app, ["draft", "make", str(src), "-l", "6"]))
    assert msg == f"error: {draft} already exists (--force overwrites it)"


@pytest.mark.parametrize("layers, message", [
    ("0", "error: layers must be at least 1 (got 0)"),
    ("4", "error: layers must be below the source's 4 (got 4)"),
    ("99", "error: layers must be below the source's 4 (got 99)"),
])
def test_cli_layers_out_of_range(tiny, tmp_path, layers, message):
    out = tmp_path / "d.gguf"
    result = runner.invoke(app, ["draft", "make", str(tiny), "-l", layers, "-o", str(out)])
    assert one_line_error(result) == message
    assert list(tmp_path.iterdir()) == [tiny]
    # -o into folders made for it: all removed again (a/b was left of a/b/c/)
    result = runner.invoke(app, ["draft", "make", str(tiny), "-l", layers, "-o",
                                 f"{tmp_path / 'a' / 'b' / 'c'}/"])
    assert one_line_error(result) == message
    assert list(tmp_path.iterdir()) == [tiny]


def test_cli_not_a_gguf_and_missing_model(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all" * 4)
    msg = one_line_error(runner.invoke(app, ["draft", "make", str(bad), "-l", "2"]))
    assert msg == f"error: {bad} is not a GGUF file (no GGUF magic at its start)"
    msg = one_line_error(runner.invoke(app, ["draft", "make", str(tmp_path / "nope.gguf"), "-l", "2"]))
    assert msg.startswith("error: model not found")


@pytest.mark.model
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_terminated_draft_make_leaves_nothing(model_path, tmp_path, sig):
    """SIGTERM's and SIGHUP's defaults ended the process with its d6.gguf.part left for
    good (Ctrl-C cleaned up), and the folder -o DIR/ made with it."""
    out = tmp_path / "new" / "dir"
    proc = subprocess.Popen([sys.executable, "-m", "justllm", "draft", "make", model_path,
                             "--layers", "6", "-o", f"{out}/"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not list(out.glob("*.partial-*")):
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.005)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + sig and "terminated: no output written" in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.model
def test_force_over_a_registered_file_replaces_its_version(model_path, tmp_path, monkeypatch):
    """draft make --force over a registered file left the registry naming its old digest,
    and `run NAME` then refused the file as changed on disk."""
    from justllm.models.manifest import Source
    from justllm.models.registry import Registry

    monkeypatch.setenv("JUSTLLM_MODELS_DIR", str(tmp_path / "models"))
    dst = tmp_path / "d.gguf"
    assert runner.invoke(app, ["draft", "make", model_path, "--layers", "2", "-o",
                                    str(dst)]).exit_code == 0
    registry = Registry()
    old = registry.register(dst, Source("file", file=str(dst)))
    registry.tag(old.digest, "mydraft")
    r = runner.invoke(app, ["draft", "make", model_path, "--layers", "3", "-o", str(dst),
                                 "--force"])
    assert r.exit_code == 0, r.output
    assert f"replaced sha256:{old.short} (its file was overwritten); mydraft:latest now " \
           "points to sha256:" in " ".join(r.output.split())
    (m,) = Registry().manifests().values()
    assert m.hex != old.hex and Registry().resolve("mydraft")[1].path == dst
