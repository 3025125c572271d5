"""The GGUF header check: a tiny file, the demo model, and the ways a file is not one."""

from pathlib import Path

import pytest

from justllm.engine.backend import BackendConfig, LlamaBackend
from justllm.errors import ModelLoadError
from justllm.models.gguf import check_gguf_file, read_gguf_header
from justllm.models.lora import check_lora_file
from justllm.models.store import describe
from tests.lora_files import write_adapter
from tests.models.ggufs import tiny_gguf


def test_header_of_a_tiny_gguf_and_of_the_demo(tmp_path, model_path):
    data = tiny_gguf(tmp_path / "t.gguf", file_type=15, context=4096)
    h = read_gguf_header(tmp_path / "t.gguf")
    assert (h.architecture, h.integer("general.file_type"), h.integer("llama.context_length"),
            h.tensor_count, h.data_end) == ("llama", 15, 4096, 1, len(data))
    demo = read_gguf_header(model_path)
    assert demo.architecture == "gemma3" and demo.integer("gemma3.context_length") == 32768
    assert demo.data_end == Path(model_path).stat().st_size


@pytest.mark.parametrize("content, says", [
    (b"", "is not a GGUF file"),
    (b"<html>", "is not a GGUF file"),
    (b"GGUF", "is truncated: 4 bytes, shorter than a GGUF header"),
    (b"GGUF" + bytes([3, 0, 0, 0]) + bytes(range(256)) * 16, "is not a readable GGUF file (the header claims"),
    (b"GGUF" + bytes([1, 0, 0, 0]) + bytes(32), "GGUF version 1"),
    ("cut-header", "its header runs past the end of the file"),
    ("cut-data", "but its tensors need"),
])
def test_corrupt_and_truncated_ggufs_are_one_line_errors_naming_the_file(tmp_path, content, says):
    data = tiny_gguf()
    content = {"cut-header": data[:100], "cut-data": data[:-1]}.get(content, content)
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError) as e:
        read_gguf_header(path)
    assert says in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)


def test_a_vocabulary_that_lists_a_token_twice_is_refused_before_llama_cpp(tmp_path,
                                                                          model_path):
    """llama.cpp asserts that every token is unique: such a file aborted the whole process
    (GGML_ASSERT in llama-vocab.cpp). The header check reads the tokens and says which."""
    path = tmp_path / "dup.gguf"
    data = Path(model_path).read_bytes()
    assert data.count(b"<unused1>") == 1  # the token's own entry, and nowhere else
    path.write_bytes(data.replace(b"<unused1>", b"<unused0>"))  # the same length: ids 6, 7
    with pytest.raises(ModelLoadError) as e:
        read_gguf_header(path)
    assert str(e.value) == (f"{path} is not a readable GGUF file (its vocabulary lists the "
                            "token '<unused0>' twice (ids 6 and 7), which llama.cpp aborts on)")
    with pytest.raises(ModelLoadError):
        LlamaBackend(BackendConfig(model_path=str(path), n_ctx=256))
    with pytest.raises(ModelLoadError, match="twice"):  # listing or showing it (vocab only)
        describe(path)
    # A reader of the header's numbers (the pool's memory check) skips the tokens; the load
    # checks them before llama.cpp reads the file.
    skipped = read_gguf_header(path, vocabulary=False)
    assert skipped.array_lengths["tokenizer.ggml.tokens"] == 262144
    assert skipped.metadata == read_gguf_header(model_path).metadata
    assert read_gguf_header(model_path).array_lengths["tokenizer.ggml.tokens"] == 262144


def test_a_lora_adapter_is_refused_as_a_model_and_read_as_an_adapter(tmp_path, model_path):
    """An adapter passed where a model goes got as far as llama.cpp, which failed in several
    lines ("key not found in model: gemma3.context_length"); now one line says what to do.
    Where an adapter is wanted (--lora) it is read as before."""
    adapter = write_adapter(tmp_path / "sql-lora.gguf", seed=1)
    says = f"{adapter} is a LoRA adapter, not a model: use --lora NAME={adapter}"
    for check in (check_gguf_file, read_gguf_header):
        with pytest.raises(ModelLoadError) as e:
            check(adapter)
        assert str(e.value) == says
    assert read_gguf_header(adapter, adapter=True).metadata["general.type"] == "adapter"
    info = check_lora_file(adapter, "gemma3")
    assert (info.rank, info.architecture) == (8, "gemma3")
    check_gguf_file(model_path)  # a model (general.type = model) passes
    tiny_gguf(tmp_path / "t.gguf")
    check_gguf_file(tmp_path / "t.gguf")  # no general.type at all passes too
    with pytest.raises(ModelLoadError, match="is a LoRA adapter, not a model"):
        LlamaBackend(BackendConfig(model_path=str(adapter), n_ctx=256))
