"""Registry names and digests: pure parsing, no files."""

import pytest

from justllm.models.refs import (
    InvalidRefError,
    could_be_name,
    is_explicit_digest,
    name_for_file,
    new_ref,
    parse_digest,
    parse_ref,
)

HEX = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def test_parse_ref_defaults_the_tag_and_lowercases():
    assert parse_ref("qwen:q4") == ("qwen", "q4")
    assert parse_ref("qwen") == ("qwen", "latest")
    assert parse_ref(" Qwen2.5-0.5B_x:Q4_K_M ") == ("qwen2.5-0.5b_x", "q4_k_m")
    for bad in ("", ":q4", "qwen:", "a/b", "a/b:c.gguf", "-x", "x:-y", "a b", "x:y:z", "é"):
        with pytest.raises(InvalidRefError, match="is not a model name"):
            parse_ref(bad)
    assert parse_ref("a" * 128) == ("a" * 128, "latest")
    with pytest.raises(InvalidRefError, match="at most 128 characters each"):  # (all letters:
        parse_ref("a" * 129)                             # the message named only the letters)


def test_parse_digest_takes_sha256_or_a_long_enough_hex_prefix():
    assert parse_digest(f"sha256:{HEX}") == HEX
    assert parse_digest(f"SHA256:{HEX[:12].upper()}") == HEX[:12]
    assert parse_digest(HEX[:12]) == HEX[:12]
    assert parse_digest(HEX[:11]) is None and parse_digest("qwen:q4") is None
    assert parse_digest(HEX + "0") is None  # longer than a sha256
    for bad in ("sha256:", f"sha256:{HEX[:11]}", "sha256:xyzxyzxyzxyzxyz"):
        with pytest.raises(InvalidRefError, match="is not a digest"):
            parse_digest(bad)
    assert is_explicit_digest(f"sha256:{HEX}") and not is_explicit_digest(HEX)


def test_the_colon_rule_and_names_for_files():
    """A slash means a Hugging Face repo (or a path), never a registry name."""
    assert could_be_name("qwen:q4") and could_be_name(f"sha256:{HEX}")
    assert not could_be_name("owner/repo:file.gguf") and not could_be_name(r"C:\models\x.gguf")
    assert name_for_file("Qwen2.5 Coder+Q4_K_M") == "qwen2.5-coder-q4_k_m"
    assert name_for_file("gemma-3-270m-q4_k_m") == "gemma-3-270m-q4_k_m"
    assert name_for_file("__x__") == "x__" and name_for_file("+++") == "model"
    assert parse_ref(name_for_file("a:b/c d")) == ("a-b-c-d", "latest")


def test_a_new_name_may_not_read_as_a_digest():
    """A tag ``sha256:0b6d7a9d554b`` was accepted: listed as a name, but ``rm`` took it for the
    digest of another model and deleted that one."""
    for bad in ("sha256:0b6d7a9d554b", "SHA256:latest", "sha256", "0b6d7a9d554b", HEX,
                f"{HEX[:20]}:v1"):
        with pytest.raises(InvalidRefError, match=r"cannot be a model name: it reads as a "
                                                  r"digest"):
            new_ref(bad)
    assert parse_ref("sha256:latest") == ("sha256", "latest")  # reading stays as it was
    for good in ("x:0b6d7a9d554b", "sha256-x", "0b6d7a9d554", "0b6d7a9d554g", "q:sha256"):
        assert new_ref(good) == parse_ref(good)
    # Names made from file names never read as digests either.
    assert name_for_file("0B6D7A9D554B") == "model-0b6d7a9d554b"
    assert name_for_file("sha256") == "model-sha256" and name_for_file("sha256-ab") == "sha256-ab"
