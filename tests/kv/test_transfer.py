"""The KV transfer format, pure: what is packed comes back, and every damaged or foreign blob
is refused with a clear error before any llama.cpp call could see it."""

from __future__ import annotations

import struct

import pytest

from justllm.kv.transfer import KVIdentity, KVTransferError, check_fits, pack, unpack

ID = KVIdentity("a" * 64, "f16", 18)


def test_a_packed_blob_comes_back_in_its_chunks():
    blob = pack(ID, list(range(10)), [b"x" * 7, b"y" * 5, b"z"], 4)
    header, chunks = unpack(blob)
    assert header.identity == ID and header.tokens == tuple(range(10))
    assert header.spans() == [(0, 4), (4, 8), (8, 10)]
    assert [bytes(c) for c in chunks] == [b"x" * 7, b"y" * 5, b"z"]
    check_fits(header, ID, vocab_size=100)


@pytest.mark.parametrize(("damage", "message"), [
    (lambda b: b[:3], "truncated: 3 bytes"),  # cut short inside the magic
    (lambda b: b"", "truncated: 0 bytes"),
    (lambda b: b"JLX", "bad magic"),
    (lambda b: b"NOPE" + b[4:], "bad magic"),
    (lambda b: b[:4] + struct.pack("<I", 10**9) + b[8:], "truncated"),
    (lambda b: b[:-1], "truncated"),
    (lambda b: b[:-1] + bytes([b[-1] ^ 1]), "checksum"),
    (lambda b: b[:8] + b"#" + b[9:], "not valid JSON"),
])
def test_damaged_blobs_are_refused(damage, message):
    blob = pack(ID, [1, 2, 3], [b"abc", b"d"], 2)
    with pytest.raises(KVTransferError, match=message):
        unpack(damage(blob))


def test_headers_that_do_not_add_up_are_refused():
    blob = pack(ID, [1, 2, 3], [b"abc"], 2)  # 3 tokens in chunks of 2 need 2 chunks
    with pytest.raises(KVTransferError, match="do not add up"):
        unpack(blob)
    with pytest.raises(KVTransferError, match="non-empty list"):
        unpack(pack(ID, [], [b"a"], 1))


def test_foreign_kv_is_refused():
    header, _ = unpack(pack(ID, [5, 99], [b"ab"], 4))
    with pytest.raises(KVTransferError, match="another model file"):
        check_fits(header, KVIdentity("b" * 64, "f16", 18), 100)
    with pytest.raises(KVTransferError, match="type f16 over 18 layers"):
        check_fits(header, KVIdentity("a" * 64, "q8_0", 18), 100)
    with pytest.raises(KVTransferError, match="outside the vocabulary"):
        check_fits(header, ID, 50)
    # (flash attention off stores V transposed, which llama.cpp refuses to read the other way)
    with pytest.raises(KVTransferError, match="stores V by rows .* the same --flash-attn"):
        check_fits(header, KVIdentity("a" * 64, "f16", 18, v_trans=True), 100)
    transposed, _ = unpack(pack(KVIdentity("a" * 64, "f16", 18, v_trans=True), [5], [b"a"], 4))
    assert transposed.identity.v_trans
