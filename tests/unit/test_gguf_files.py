"""Weights from the worker's disk (protocol_spec.md §8.3): the codec, the file digest, and the worker's
checks of LOAD_TENSOR in-process (every hostile range refused before a byte moves)."""

import os
import struct

import numpy as np
import pytest

from rpcserver.gguf_dir import GgufDir
from rpcserver.memory import MemoryBudget
from rpcserver.session import Session, WorkerConfig
from wire import gguf_files as g, protocol as p
from wire.ggml import GGMLType, contiguous_strides
from wire.hashing import fnv1a64_reference
from wire.protocol import Command, ProtocolError


def test_load_tensor_layout_matches_the_spec():
    """| tensor (296) | offset u64 | file_id u32 | file_offset u64 | size u64 | hash u64 |, 332 bytes."""
    req = p.LoadTensorRequest(p.RpcTensor(id=5), 7, 3, 1 << 33, 4096, 0x0123456789ABCDEF)
    raw = req.encode()
    assert len(raw) == 332 == p.COMMANDS[Command.LOAD_TENSOR].request_size
    assert struct.unpack_from("<QIQQQ", raw, 296) == (7, 3, 1 << 33, 4096, 0x0123456789ABCDEF)
    assert p.LoadTensorRequest.decode(raw) == req
    with pytest.raises(ValueError):
        p.LoadTensorRequest.decode(raw[:-1])


def test_gguf_files_reply_round_trips_and_refuses_a_wrong_count():
    files = [g.GgufFile(123, bytes(range(32))), g.GgufFile(1 << 40, bytes(32))]
    raw = g.encode_gguf_files(files)
    assert raw[:4] == struct.pack("<I", 2) and len(raw) == 4 + 2 * 40
    assert struct.unpack_from("<Q32s", raw, 44) == (1 << 40, bytes(32))
    assert g.decode_gguf_files(raw) == files
    assert g.decode_gguf_files(g.encode_gguf_files([])) == []
    for bad in (raw[:-1], raw + b"\0", b"\x01\0\0", struct.pack("<I", 0xFFFFFFFF)):
        with pytest.raises(ValueError):
            g.decode_gguf_files(bad)


def test_digest_ranges_cover_the_head_and_spread_samples():
    assert g.digest_ranges(0) == []
    assert g.digest_ranges(1000) == [(0, 1000)]
    small = g.DIGEST_HEAD + g.DIGEST_SAMPLES * g.DIGEST_CHUNK
    assert g.digest_ranges(small) == [(0, g.DIGEST_HEAD), (g.DIGEST_HEAD, small - g.DIGEST_HEAD)]
    for size in (small + 1, 300 << 20, 17 << 30, (1 << 44) + 12345):
        ranges = g.digest_ranges(size)
        assert ranges[0] == (0, g.DIGEST_HEAD) and len(ranges) == 1 + g.DIGEST_SAMPLES
        assert all(length == g.DIGEST_CHUNK for _, length in ranges[1:])
        assert ranges[-1][0] + g.DIGEST_CHUNK <= size and size - (ranges[-1][0] + g.DIGEST_CHUNK) < g.DIGEST_SAMPLES
        assert all(a[0] + a[1] <= b[0] for a, b in zip(ranges, ranges[1:]))  # in order, apart


def test_digest_sees_the_head_the_samples_and_the_size_but_not_between_samples(tmp_path):
    rng = np.random.default_rng(1)
    data = rng.integers(0, 256, g.DIGEST_HEAD + (8 << 20), dtype=np.uint8)
    path = tmp_path / "m.gguf"

    def digest(d):
        d.tofile(path)
        return g.path_digest(path)

    base = digest(data)
    assert base[0] == data.size
    second_sample = g.digest_ranges(data.size)[2][0]
    between = second_sample - 1  # a byte no range covers: the per-tensor hash is what catches it
    for index, changes in ((100, True), (g.DIGEST_HEAD + 5, True), (second_sample + 10, True), (between, False)):
        other = data.copy()
        other[index] ^= 0xFF
        assert (digest(other) != base) == changes, index
    assert digest(data[:-1])[1] != base[1]


# -- the worker's LOAD_TENSOR in-process -------------------------------------------------------------

F32 = GGMLType.F32


@pytest.fixture
def served(tmp_path):
    """A session of a worker whose --gguf-dir holds a.gguf (4 KiB), with a 1 KiB buffer."""
    content = np.arange(4096, dtype=np.uint32).astype(np.uint8)
    content.tofile(tmp_path / "a.gguf")
    (tmp_path / "notes.txt").write_bytes(b"not offered")
    outside = tmp_path.parent / f"{tmp_path.name}-outside.gguf"
    outside.write_bytes(b"secret" * 100)
    os.symlink(outside, tmp_path / "link.gguf")  # a link out of DIR is never offered
    (tmp_path / "sub.gguf").mkdir()
    files = GgufDir(tmp_path)
    session = Session(WorkerConfig(MemoryBudget(64 << 20), gguf_dir=files))
    handle = p.AllocBufferResponse.decode(session.handle(Command.ALLOC_BUFFER, p.AllocBufferRequest(0, 1024))).remote_ptr
    base = p.U64Response.decode(session.handle(Command.BUFFER_GET_BASE, p.BufferRequest(handle))).value
    yield session, content, handle, base
    session.close()
    files.close()


def tensor(handle, base, n, at=0):
    ne = (n, 1, 1, 1)
    return p.RpcTensor(id=1, type=F32, buffer=handle, ne=ne, nb=contiguous_strides(F32, ne), data=base + at)


def load(session, rec, file_id, file_offset, size, digest, offset=0):
    reply = session.handle(Command.LOAD_TENSOR, p.LoadTensorRequest(rec, offset, file_id, file_offset, size, digest))
    return p.U8Response.decode(reply).result


def read(session, rec, size):
    return np.frombuffer(session.handle(Command.GET_TENSOR, p.GetTensorRequest(rec, 0, size)), np.uint8)


def test_the_worker_offers_only_regular_gguf_files_in_its_directory(served):
    session, content, _, _ = served
    files = g.decode_gguf_files(session.handle(Command.GGUF_FILES, p.Empty()))
    assert len(files) == 1 and files[0].size == content.size
    assert files[0].digest == g.file_digest(content.size, lambda o, n: content[o:o + n].tobytes())
    ext = p.ExtHelloResponse.decode(session.handle(Command.EXT_HELLO, p.Empty()))
    assert ext.features & p.FEATURE_GGUF_FILES


def test_load_copies_bytes_that_hash_right_and_answers_0_otherwise(served):
    session, content, handle, base = served
    rec = tensor(handle, base, 64, at=256)  # 256 bytes
    want = content[1000:1256]
    assert load(session, rec, 0, 1000, 256, fnv1a64_reference(want.tobytes())) == 1
    assert np.array_equal(read(session, rec, 256), want)
    assert load(session, rec, 0, 2000, 128, 12345, offset=128) == 0  # another hash: the client sends them
    assert load(session, rec, 0, 4096, 0, fnv1a64_reference(b"")) == 1  # the empty range at the file's end


@pytest.mark.parametrize("file_id, file_offset, size, at, offset, reason", [
    (1, 0, 16, 0, 0, "no GGUF file 1"),  # unknown file id
    (0xFFFFFFFF, 0, 16, 0, 0, "no GGUF file"),
    (0, 4097, 0, 0, 0, "outside GGUF file"),  # offset past the file
    (0, 4000, 200, 0, 0, "outside GGUF file"),  # range past the file's end
    (0, 16, (1 << 64) - 8, 0, 0, "outside GGUF file"),  # offset + size wraps a u64
    (0, (1 << 64) - 1, 2, 0, 0, "outside GGUF file"),
    (0, 0, 512, 768, 0, "outside"),  # the tensor runs past the 1 KiB buffer
    (0, 0, 300, 0, 0, "exceeds tensor"),  # more than the 256-byte tensor holds
    (0, 0, 16, 0, 250, "exceeds tensor"),  # offset + size past the tensor
])
def test_hostile_loads_are_refused_before_a_byte_moves(served, file_id, file_offset, size, at, offset, reason):
    session, _, handle, base = served
    rec = tensor(handle, base, 128 if at else 64, at=at)
    before = session.buffers.get(handle).mem.copy()
    with pytest.raises(ProtocolError, match=reason):
        load(session, rec, file_id, file_offset, size, 0, offset=offset)
    assert np.array_equal(session.buffers.get(handle).mem, before)


def test_a_tensor_of_another_connection_is_refused(served):
    session, _, handle, base = served
    with pytest.raises(ProtocolError, match="LOAD_TENSOR"):
        load(session, tensor(handle + 1, base, 4), 0, 0, 16, 0)


def test_a_worker_without_gguf_dir_offers_nothing_and_refuses_loads():
    session = Session(WorkerConfig(MemoryBudget(64 << 20)))
    assert g.decode_gguf_files(session.handle(Command.GGUF_FILES, p.Empty())) == []
    assert not p.ExtHelloResponse.decode(session.handle(Command.EXT_HELLO, p.Empty())).features & p.FEATURE_GGUF_FILES
    with pytest.raises(ProtocolError, match="without --gguf-dir"):
        load(session, p.RpcTensor(), 0, 0, 0, 0)
    session.close()
