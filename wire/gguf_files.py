"""Weights from the worker's own disk (protocol_spec.md §8.3, feature bit 2): the two messages and the
file digest both sides compute.

A worker started with `rpc-server --gguf-dir DIR` lists the GGUF files it holds (GGUF_FILES), each by its
size and a digest of its contents; a client whose model has the same digest names the file by its
position in that list and asks the worker to copy a tensor's bytes from it (LOAD_TENSOR) instead of
sending them. The client never sends a path.

The digest is SHA-256 over a context string, the file size and sampled ranges of the file
(`digest_ranges`): its first 16 MiB (a GGUF's header, metadata and tensor-info section, which name every
tensor with its type, shape and offset) and 64 chunks of 64 KiB spread evenly over the rest. About 20 MiB
are read whatever the file's size, so it costs a worker tens of milliseconds per file at start-up and the
orchestrator as much once. It identifies a file, it does not vouch for every byte: another model, another
quantization, other metadata or another size changes the first range; other weights under the same
header (another seed, a fine-tune) change the samples. A local edit between the samples is the one thing
it misses, and LOAD_TENSOR catches that: every load carries the tensor's FNV-1a 64 hash (the hash
SET_TENSOR_HASH uses), the worker hashes what it read, and a mismatch answers 0, so the client falls back
to SET_TENSOR for that tensor.
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass, field
from typing import Callable, ClassVar

from .record import TENSOR_SIZE, RpcTensor

DIGEST_CONTEXT = b"pyrpc-gguf-v1\0"
DIGEST_HEAD = 16 << 20  # the first range: a GGUF's header and tensor infos
DIGEST_SAMPLES = 64  # chunks spread evenly over the rest
DIGEST_CHUNK = 64 << 10
DIGEST_SIZE = 32
MAX_FILES = 1024  # entries one GGUF_FILES reply may carry


def digest_ranges(size: int) -> list[tuple[int, int]]:
    """The (offset, length) ranges of a file of `size` bytes that its digest covers, in order."""
    head = min(size, DIGEST_HEAD)
    ranges = [(0, head)] if head else []
    rest = size - head
    if rest <= DIGEST_SAMPLES * DIGEST_CHUNK:  # a small file: all of it
        return ranges + ([(head, rest)] if rest else [])
    step = (rest - DIGEST_CHUNK) // (DIGEST_SAMPLES - 1)
    return ranges + [(head + i * step, DIGEST_CHUNK) for i in range(DIGEST_SAMPLES)]


def file_digest(size: int, read_at: Callable[[int, int], bytes]) -> bytes:
    """The digest of a file of `size` bytes; read_at(offset, length) returns that many of its bytes."""
    h = hashlib.sha256(DIGEST_CONTEXT + struct.pack("<Q", size))
    for offset, length in digest_ranges(size):
        data = read_at(offset, length)
        if len(data) != length:
            raise ValueError(f"short read at {offset}: {len(data)} of {length} bytes (the file changed?)")
        h.update(data)
    return h.digest()


def path_digest(path) -> tuple[int, bytes]:
    """(size, digest) of a file on disk."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        return size, file_digest(size, lambda offset, length: os.pread(f.fileno(), length, offset))


@dataclass(frozen=True)
class GgufFile:
    """One entry of GGUF_FILES; its file id is its position in the reply."""

    size: int
    digest: bytes

    ENTRY: ClassVar[str] = "<Q32s"


def encode_gguf_files(files: list[GgufFile]) -> bytes:
    """GGUF_FILES's reply: | count u32 | count x (size u64, digest[32]) |."""
    return struct.pack("<I", len(files)) + b"".join(struct.pack(GgufFile.ENTRY, f.size, f.digest) for f in files)


def decode_gguf_files(payload: bytes) -> list[GgufFile]:
    if len(payload) < 4:
        raise ValueError(f"GGUF_FILES reply needs at least 4 bytes, got {len(payload)}")
    (count,) = struct.unpack_from("<I", payload)
    entry = struct.calcsize(GgufFile.ENTRY)
    if count > MAX_FILES or len(payload) != 4 + count * entry:
        raise ValueError(f"GGUF_FILES reply of {len(payload)} bytes does not hold {count} entries")
    return [GgufFile(*struct.unpack_from(GgufFile.ENTRY, payload, 4 + i * entry)) for i in range(count)]


@dataclass
class LoadTensorRequest:
    """| tensor (296) | offset u64 | file_id u32 | file_offset u64 | size u64 | hash u64 | (332 bytes):
    copy `size` bytes of file `file_id` from `file_offset` into the tensor at `offset`, if they hash to `hash`."""

    TAIL: ClassVar[str] = "<QIQQQ"
    tensor: RpcTensor = field(default_factory=RpcTensor)
    offset: int = 0
    file_id: int = 0
    file_offset: int = 0
    size: int = 0
    hash: int = 0

    @classmethod
    def wire_size(cls) -> int:
        return TENSOR_SIZE + struct.calcsize(cls.TAIL)

    @classmethod
    def decode(cls, payload):
        if len(payload) != cls.wire_size():
            raise ValueError(f"LoadTensorRequest is {cls.wire_size()} bytes, got {len(payload)}")
        return cls(RpcTensor.decode(payload[:TENSOR_SIZE]), *struct.unpack_from(cls.TAIL, payload, TENSOR_SIZE))

    def encode(self) -> bytes:
        return self.tensor.encode() + struct.pack(self.TAIL, self.offset, self.file_id, self.file_offset,
                                                  self.size, self.hash)
