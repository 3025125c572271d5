"""EngineConfig defaults that come from the environment."""

import pytest

from justllm.config import EngineConfig


def test_justllm_gpu_turns_gpu_on_for_engines_built_in_python(monkeypatch):
    monkeypatch.delenv("JUSTLLM_GPU", raising=False)
    assert EngineConfig().gpu is False
    monkeypatch.setenv("JUSTLLM_GPU", "1")
    assert EngineConfig().gpu is True
    assert EngineConfig(gpu=False).gpu is False  # an explicit value wins
    monkeypatch.setenv("JUSTLLM_GPU", "0")
    assert EngineConfig().gpu is False


def test_zero_means_the_devices_default_and_explicit_values_win(monkeypatch):
    monkeypatch.delenv("JUSTLLM_GPU", raising=False)
    cpu = EngineConfig()
    assert (cpu.n_batch, cpu.n_ubatch, cpu.chunk_size, cpu.pool_blocks) == (512, 512, 256, 1024)
    gpu = EngineConfig(gpu=True)
    # llama-server's batch and micro-batch; the pool waits for free VRAM (engine/vram.py)
    assert (gpu.n_batch, gpu.n_ubatch, gpu.chunk_size, gpu.pool_blocks) == (2048, 512, 512, 0)
    with pytest.raises(ValueError, match="sized from free VRAM"):
        _ = gpu.pool_tokens
    # A smaller explicit batch brings the defaulted chunk and micro-batch down with it...
    small = EngineConfig(gpu=True, n_batch=256)
    assert (small.n_batch, small.n_ubatch, small.chunk_size) == (256, 256, 256)
    mine = EngineConfig(gpu=True, n_batch=1024, n_ubatch=128, chunk_size=64, pool_blocks=8)
    assert (mine.n_batch, mine.n_ubatch, mine.chunk_size, mine.pool_tokens) == (1024, 128, 64, 128)
    # ...but an explicit micro-batch larger than the batch is refused, not cut quietly.
    with pytest.raises(ValueError, match=r"n_ubatch \(512\) must be <= n_batch \(256\)"):
        EngineConfig(n_batch=256, n_ubatch=512)
    with pytest.raises(ValueError, match="pool_blocks must be an integer >= 0"):
        EngineConfig(pool_blocks=-1)


def test_a_draft_model_alone_means_draft_speculation_and_is_refused_where_nothing_drafts(
        model_path):
    """--draft-model without --spec was checked and then not used."""
    from justllm.cli.options import engine_config

    assert engine_config(model_path, {"draft_model": model_path}).spec == "draft"
    assert engine_config(model_path, {"draft_model": model_path, "spec": "tree"}).spec == "tree"
    for spec in ("", "ngram"):
        with pytest.raises(ValueError, match="--draft-model is for a method that drafts"):
            EngineConfig(model=model_path, spec=spec, draft_model=model_path)


@pytest.mark.parametrize("given, says", [
    (dict(gamma=8), "--gamma is for --spec, and no --spec is given"),
    (dict(spec="ngram", branch=3), "--branch is for --spec tree, not --spec ngram"),
    (dict(spec="draft", draft_model="d.gguf", branch=3), "--branch is for --spec tree"),
    (dict(spec="ngram", draft_p_min=0.5), "--draft-p-min is for --spec draft or tree"),
    (dict(draft_p_min=0.5), "--draft-p-min is for --spec draft or tree")])
def test_speculation_settings_without_their_method_are_refused(given, says):
    """Each was taken and did nothing."""
    with pytest.raises(ValueError, match=says):
        EngineConfig(model="m.gguf", **given)


def test_speculation_settings_with_their_method_are_taken():
    c = EngineConfig(model="m.gguf", spec="tree", draft_model="d.gguf", gamma=6, branch=3,
                     draft_p_min=0.2)
    assert (c.gamma, c.branch, c.draft_p_min) == (6, 3, 0.2)
    assert EngineConfig(model="m.gguf", spec="ngram", gamma=2).gamma == 2


def test_settings_typed_for_what_is_off_are_refused_whatever_their_value():
    """--gamma 4 without --spec ran (4 is the default) where --gamma 3 was refused, and
    --cache-ram sized a prefix cache --no-prefix-cache had turned off. The same from a
    JUSTLLM_* variable or a config file (not typed) is passed over: the default is used."""
    from justllm.cli.options import config_values, fit_engine_values
    from justllm.spec.methods import SPEC_METHODS

    def fit(typed, **flags):
        return fit_engine_values(config_values(flags), typed, SPEC_METHODS)

    for typed, flags, says in (
            ({"gamma"}, dict(gamma=4), "--gamma is for --spec, and no --spec is given"),
            ({"branch"}, dict(spec="draft", draft_model="d.gguf", branch=2),
             "--branch is for --spec tree, not --spec draft"),
            ({"branch"}, dict(draft_model="d.gguf", branch=2), "not --spec draft"),
            ({"draft_p_min"}, dict(spec="ngram", draft_p_min=0.0),
             "--draft-p-min is for --spec draft or tree"),
            ({"cache_ram"}, dict(no_prefix_cache=True, cache_ram=8192),
             "--cache-ram: for the prefix cache, which --no-prefix-cache turns off"),
            ({"cache_ram", "prefix_cache_blocks"},
             dict(no_prefix_cache=True, prefix_cache_blocks=0, cache_ram=1),
             "--prefix-cache-blocks and --cache-ram: for the prefix cache")):
        with pytest.raises(ValueError, match=says):
            fit(typed, **flags)
    # not typed: passed over, so that EngineConfig does not refuse them either
    v = fit(set(), gamma=3, branch=3, draft_p_min=0.5, no_prefix_cache=True, cache_ram=5)
    assert (v["gamma"], v["branch"], v["draft_p_min"], v["cache_ram"]) == (4, 2, 0.0, 5)
    EngineConfig(model="m.gguf", **v | {"lora": ()})  # (the CLI resolves --lora to files)
    # what the method uses is kept, typed or not
    v = fit({"gamma", "branch"}, spec="tree", draft_model="d.gguf", gamma=6, branch=3,
            draft_p_min=0.2)
    assert (v["gamma"], v["branch"], v["draft_p_min"]) == (6, 3, 0.2)
    assert fit({"gamma"}, spec="ngram", gamma=4, branch=3)["branch"] == 2
    assert fit({"cache_ram"}, cache_ram=4)["cache_ram"] == 4  # the cache is on


def test_more_threads_than_cores_is_said(model_path, capsys):
    """--threads 1000 on 2 cores ran at 0.4 tok/s without a word."""
    from justllm.cli.options import engine_config
    from justllm.config import usable_cpus

    engine_config(model_path, {"threads": usable_cpus()})
    assert "warning" not in capsys.readouterr().err
    engine_config(model_path, {"threads": usable_cpus() + 1})
    assert f"--threads {usable_cpus() + 1} is more than the {usable_cpus()} cores" in \
        " ".join(capsys.readouterr().err.split())
    # Past ggml's limit it is refused, without the warning first (one line at the CLI).
    with pytest.raises(ValueError, match="--threads must be at most 512"):
        engine_config(model_path, {"threads": 99999})
    assert "warning" not in capsys.readouterr().err


def test_threads_are_refused_past_ggmls_limit():
    """--threads 99999 aborted in std::bad_alloc, 40000 failed in libgomp, 20000 hung."""
    import importlib.util
    import re
    from pathlib import Path

    from justllm.config import MAX_THREADS

    assert EngineConfig(threads=MAX_THREADS).threads == MAX_THREADS == 512
    for threads in (MAX_THREADS + 1, 20000, 99999):
        with pytest.raises(ValueError) as e:
            EngineConfig(threads=threads)
        assert str(e.value) == (f"--threads must be at most 512, ggml's GGML_MAX_N_THREADS "
                                f"(got {threads})")
    with pytest.raises(ValueError, match="threads must be >= 0"):
        EngineConfig(threads=-1)
    # the same number as the llama.cpp this llama-cpp-python was built from, where its header is
    spec = importlib.util.find_spec("llama_cpp")
    header = Path(spec.origin).parent.parent / "include" / "ggml.h" if spec and spec.origin \
        else None
    if header is not None and header.is_file():
        found = re.search(r"#define\s+GGML_MAX_N_THREADS\s+(\d+)", header.read_text())
        assert found and int(found.group(1)) == MAX_THREADS


def test_a_pool_that_cannot_fit_is_refused_before_anything_is_allocated(model_path):
    """--pool-blocks 99999999 was OOM-killed at 23 GB (exit 137)."""
    from justllm.cli.options import engine_config
    from justllm.config import MAX_POOL_TOKENS, check_pool_memory, physical_memory
    from justllm.models.gguf import ModelShape, read_gguf_header

    # llama.cpp's n_ctx is 32 bits (ctypes cut a larger one to its low bits without a word)
    assert EngineConfig(pool_blocks=MAX_POOL_TOKENS // 16).pool_tokens <= MAX_POOL_TOKENS
    for blocks, size in ((MAX_POOL_TOKENS // 16 + 1, 16), (2**28, 16), (1024, 2**21)):
        with pytest.raises(ValueError) as e:
            EngineConfig(pool_blocks=blocks, block_size=size)
        assert str(e.value) == (f"--pool-blocks {blocks} x --block-size {size} is "
                                f"{blocks * size} tokens; a KV pool may have at most "
                                f"2147483647 (llama.cpp's context size is 32-bit)")
    # The KV cache alone larger than memory: refused, saying how much it needs.
    config = EngineConfig(pool_blocks=64)  # 1024 tokens
    check_pool_memory(config, 1000, memory_bytes=1024 * 1000)
    with pytest.raises(ValueError) as e:
        check_pool_memory(config, 1000, memory_bytes=1024 * 1000 - 1)
    assert str(e.value) == ("--pool-blocks 64: a KV pool of 1024 tokens needs 0.0 GiB (1000 "
                            "bytes a token), more than the 0.0 GiB of memory this machine has")
    check_pool_memory(EngineConfig(gpu=True), 10**9, memory_bytes=1)  # sized from VRAM later
    memory = physical_memory()
    assert memory is not None and memory > 2**30
    per_token = ModelShape.of(read_gguf_header(model_path)).kv_bytes_per_token
    blocks = memory // (per_token * 16) + 1  # the smallest pool that cannot fit
    with pytest.raises(ValueError) as e:
        engine_config(model_path, {"pool_blocks": blocks})
    assert str(e.value).startswith(f"--pool-blocks {blocks}: a KV pool of {blocks * 16} tokens "
                                   f"needs {blocks * 16 * per_token / 2**30:,.1f} GiB "
                                   f"({per_token} bytes a token), more than the ")
    with pytest.raises(ValueError, match="--pool-blocks 99999999: .* needs 27,465.8 GiB"):
        engine_config(model_path, {"pool_blocks": 99999999})
    # the draft model's KV counts too
    with pytest.raises(ValueError, match=f"{2 * per_token} bytes a token"):
        engine_config(model_path, {"pool_blocks": blocks, "draft_model": model_path})
    assert engine_config(model_path, {"pool_blocks": blocks - 1}).pool_blocks == blocks - 1


def test_read_yaml_refuses_a_key_given_twice(tmp_path):
    """PyYAML keeps the last of two equal keys without a word: a models.yaml with two entries
    of one name silently lost the first (and its aliases)."""
    from justllm.config import read_yaml

    f = tmp_path / "m.yaml"
    f.write_text("max-loaded: 1\nmodels:\n  a: {source: /x}\n  b: /y\n")
    assert read_yaml(f) == {"max-loaded": 1, "models": {"a": {"source": "/x"}, "b": "/y"}}
    for text, said in (("max-loaded: 1\nmax-loaded: 0\n", "'max-loaded' is given twice (line 2, column 1)"),
                       ("models:\n  a: {source: /x}\n  a: {source: /y}\n", "'a' is given twice (line 3, column 3)")):
        f.write_text(text)
        with pytest.raises(ValueError) as e:
            read_yaml(f)
        assert str(e.value) == f"{f} is not valid YAML: the key {said}"
    with pytest.raises(ValueError, match="cannot read .*: No such file"):
        read_yaml(tmp_path / "none.yaml")
    f.write_bytes(b"port: \xf0\x28\n")  # ("'utf-8' codec can't decode byte 0xf0 ...")
    with pytest.raises(ValueError, match=f"^{f} is not a UTF-8 text file$"):
        read_yaml(f)


def test_yaml_on_and_off_are_words_for_the_options_that_take_them(tmp_path):
    """YAML reads a bare on/off as a boolean: `flash-attn: on` was refused as True, in a
    config file and in models.yaml."""
    from typer.testing import CliRunner

    from justllm.cli import app
    from justllm.config import yaml_on_off
    from justllm.gateway.config import Flags, load_config

    assert [yaml_on_off(k, v) for k, v in (("flash-attn", True), ("repack", False),
                                           ("flash_attn", "auto"), ("gpu", True))] == [
        "on", "off", "auto", True]
    f = tmp_path / "c.yaml"
    f.write_text("flash-attn: on\nrepack: off\n")
    r = CliRunner().invoke(app, ["config", "show", "--config", str(f)])
    rows = {line.split()[0]: line.split()[1:3] for line in r.output.splitlines()
            if line.startswith("--")}
    assert r.exit_code == 0 and rows["--flash-attn"] == ["on", "file"], r.output
    assert rows["--repack"] == ["off", "file"]
    config = load_config({"models": {"m": {"source": "demo", "flash-attn": True,
                                           "repack": False}}},
                         Flags(frozenset({"flash-attn", "repack"}), {}))
    flags = dict(config.models[0].flags)
    assert (flags["flash-attn"], flags["repack"]) == ("on", "off")


def test_a_gpu_pool_is_checked_against_the_gpus_memory_alone(model_path, monkeypatch):
    """Every layer offloaded: the KV is on the GPUs, so host memory does not make room for
    it (a pool past the GPU's passed the check and failed in llama.cpp's context)."""
    import justllm.engine.backend as backend
    from justllm.cli.options import check_pool_fits
    from justllm.models.gguf import ModelShape, read_gguf_header

    per_token = ModelShape.of(read_gguf_header(model_path)).kv_bytes_per_token
    gpu = backend.GpuDevice("a GPU", free_bytes=2**30, total_bytes=2**30)
    monkeypatch.setattr(backend, "gpu_devices", lambda: [gpu])
    fits = 2**30 // (per_token * 16)
    check_pool_fits(EngineConfig(model=model_path, gpu=True, pool_blocks=fits))
    with pytest.raises(ValueError) as e:
        check_pool_fits(EngineConfig(model=model_path, gpu=True, pool_blocks=fits + 1))
    assert str(e.value).endswith("more than the 1.0 GiB of memory its GPUs have")
    monkeypatch.setattr(backend, "gpu_devices", lambda: [])  # (the engine says there is none)
    check_pool_fits(EngineConfig(model=model_path, gpu=True, pool_blocks=fits + 1))


def test_too_many_sequences_name_what_the_user_set():
    """Past 128 sequences the message named spare_seq_ids, which no flag sets (its default
    gives way first): only max_seqs is over then; spare ids chosen in Python are named."""
    with pytest.raises(ValueError, match=r"^max_seqs must be <= 128, got 200 "):
        EngineConfig(model="m.gguf", max_seqs=200)
    with pytest.raises(ValueError, match=r"^max_seqs \+ spare_seq_ids must be <= 128, got 140"):
        EngineConfig(model="m.gguf", max_seqs=100, spare_seq_ids=40)
    assert EngineConfig(model="m.gguf", max_seqs=128).spare_seq_ids == 0
