"""Worker memory: a worker-wide budget and each connection's own buffers.

A buffer is one private anonymous memory mapping seen as a numpy array: the kernel hands out its
pages zero-filled on first touch, so untouched pages cost no RSS, no client ever sees another's old
bytes, and a freed buffer goes straight back to the system (no allocator heuristics in between).
Clients address memory by the buffer handles and virtual addresses we hand out; every address they
send is resolved here, against buffers of their own connection only.

A wire tensor record becomes memory in one checked step, as ggml-rpc's deserialize_tensor does it:
`BufferTable.locate` checks its type, its buffer and its byte range once, and `BufferTable.tensor` turns
it into the kernels' Tensor. Whatever a request may not touch raises RequestError, the one error the
session turns into a closed connection.
"""

from __future__ import annotations

import itertools
import mmap
import os
import threading
from dataclasses import dataclass

import numpy as np

from kernels import Tensor
from wire.ggml import TYPE_OF_NUMBER, TypeTraits, nbytes, type_traits
from wire.protocol import RpcTensor

ALIGNMENT = 32  # as ggml's CPU buffers (TENSOR_ALIGNMENT)
_ADDRESS_SPACE_START = 0x1000_0000
_PAGE = 4096


NO_MEMORY = np.zeros(0, dtype=np.uint8)  # what a tensor without a buffer points at; never computed on


class RequestError(ValueError):
    """A request this connection may not make: an invalid type, another connection's buffer, a range
    outside its buffer, a graph the worker refuses. The session closes the connection on it."""


def tensor_label(rec: RpcTensor) -> str:
    return f"'{rec.name}'" if rec.name else f"id 0x{rec.id:x}"


def checked_type(rec: RpcTensor) -> TypeTraits:
    """The traits of a record's type, which must be a live type with ne[0] a whole number of blocks."""
    traits = type_traits(rec.type)
    if traits is None or traits.block_size == 0:
        raise RequestError(f"tensor {tensor_label(rec)} has invalid type {rec.type}")
    if rec.ne[0] % traits.block_size:
        raise RequestError(f"tensor {tensor_label(rec)}: ne[0]={rec.ne[0]} is not a multiple of the block "
                           f"size {traits.block_size}")
    return traits


def system_memory() -> tuple[int, int]:
    """(available, total) physical memory in bytes."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    available = total
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    return available, total


class MemoryBudget:
    """What the worker reports and enforces, shared by all connections (thread-safe)."""

    def __init__(self, limit: int | None = None):
        self.limit = limit  # None: the machine's physical memory
        self.used = 0
        self._lock = threading.Lock()
        self._next_address = _ADDRESS_SPACE_START
        self._handles = itertools.count(1)

    def free_and_total(self) -> tuple[int, int]:
        with self._lock:
            if self.limit is not None:
                return max(self.limit - self.used, 0), self.limit
            available, total = system_memory()
            return available, total

    def reserve(self, size: int) -> tuple[int, int] | None:
        """Account `size` bytes; gives (handle, base address) or None if they do not fit."""
        with self._lock:
            if self.limit is not None:
                fits = size <= self.limit - self.used
            else:
                fits = size <= system_memory()[0]
            if not fits:
                return None
            self.used += size
            base = self._next_address
            # leave a gap of at least one page so no two buffers' address ranges touch
            self._next_address += (size + 2 * _PAGE - 1) // _PAGE * _PAGE
            return next(self._handles), base

    def release(self, size: int) -> None:
        with self._lock:
            self.used -= size


@dataclass(eq=False)
class Buffer:
    handle: int
    base: int
    size: int
    mem: np.ndarray  # uint8, `size` bytes
    mapping: mmap.mmap | None = None  # what `mem` lives in (None for an empty buffer)

    def clear(self, value: int) -> None:
        if value == 0 and self.mapping is not None:
            # dropping the pages zeroes them without touching them: a cleared KV cache costs RSS
            # only as far as it is used (ggml's CPU buffer memsets, touching every page)
            self.mapping.madvise(mmap.MADV_DONTNEED)
        else:
            self.mem.fill(value)


def _map(size: int) -> tuple[np.ndarray, mmap.mmap | None]:
    if size == 0:
        return np.zeros(0, dtype=np.uint8), None
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(mapping, dtype=np.uint8), mapping


class BufferTable:
    """The buffers one connection owns; freed together when it closes."""

    def __init__(self, budget: MemoryBudget):
        self.budget = budget
        self.buffers: dict[int, Buffer] = {}

    def alloc(self, size: int) -> Buffer | None:
        reserved = self.budget.reserve(size)
        if reserved is None:
            return None
        handle, base = reserved
        try:
            mem, mapping = _map(size)
        except (MemoryError, OSError):
            self.budget.release(size)
            return None
        buf = Buffer(handle, base, size, mem, mapping)
        self.buffers[handle] = buf
        return buf

    def owns(self, handle: int) -> bool:
        return handle in self.buffers

    def get(self, handle: int) -> Buffer:
        buf = self.buffers.get(handle)
        if buf is None:
            raise RequestError(f"buffer 0x{handle:x} is not one of this connection's")
        return buf

    def free(self, handle: int) -> None:
        buf = self.get(handle)
        del self.buffers[handle]
        self.budget.release(buf.size)

    def close(self) -> None:
        for buf in self.buffers.values():
            self.budget.release(buf.size)
        self.buffers.clear()

    @property
    def total(self) -> int:
        """The bytes of all this connection's buffers: no tensor of a graph may hold more elements (a
        view with zero or overlapping strides could, and a kernel's scratch grows with its elements)."""
        return sum(b.size for b in self.buffers.values())

    @property
    def largest(self) -> int:
        return max((b.size for b in self.buffers.values()), default=0)

    def locate(self, tensor: RpcTensor) -> tuple[Buffer, int, int]:
        """(buffer, byte offset of the tensor's data in it, tensor byte size), all checked."""
        checked_type(tensor)
        return self._span(tensor)

    def _span(self, tensor: RpcTensor) -> tuple[Buffer, int, int]:
        buf = self.get(tensor.buffer)
        size = nbytes(TYPE_OF_NUMBER[tensor.type], tensor.ne, tensor.nb)
        offset = tensor.data - buf.base
        if not (0 <= offset <= buf.size and size <= buf.size - offset):
            raise RequestError(
                f"tensor '{tensor.name}' data [0x{tensor.data:x}, +{size}) lies outside its buffer "
                f"[0x{buf.base:x}, +{buf.size})"
            )
        return buf, offset, size

    def region(self, tensor: RpcTensor, offset: int, size: int) -> np.ndarray:
        """The bytes [offset, offset+size) of a tensor, checked against the tensor and its buffer."""
        buf, start, tensor_size = self.locate(tensor)
        if not (offset <= tensor_size and size <= tensor_size - offset):
            raise RequestError(f"region (offset={offset}, size={size}) exceeds tensor '{tensor.name}' of {tensor_size} bytes")
        return buf.mem[start + offset : start + offset + size]

    def tensor(self, rec: RpcTensor) -> Tensor:
        """The kernels' view of a record, checked so a kernel may trust it: a live type, whole blocks laid
        out contiguously, data inside a buffer of this connection and aligned to its elements.

        As in ggml-rpc, a tensor may come without memory (buffer 0 and data 0, or a buffer this
        connection does not own: it lives on another server); it gets NO_MEMORY, and the graph refuses
        it wherever a node would read or write it. A data pointer without a buffer is refused here."""
        traits = checked_type(rec)
        type_ = TYPE_OF_NUMBER[rec.type]  # checked_type found it live
        if traits.is_quantized and rec.nb[0] != traits.type_size:
            raise RequestError(f"quantized tensor {tensor_label(rec)} must have contiguous blocks (nb[0]={rec.nb[0]})")
        if rec.buffer not in self.buffers:
            if rec.data != 0:
                raise RequestError(f"tensor {tensor_label(rec)} has a data pointer but no buffer of this connection")
            return Tensor.trusted(type_, rec.ne, rec.nb, NO_MEMORY, 0, rec.name)
        buf, offset, _ = self._span(rec)
        itemsize = traits.type_size if not traits.is_quantized else 1
        nb = rec.nb
        if itemsize > 1 and (offset % itemsize or nb[0] % itemsize or nb[1] % itemsize or nb[2] % itemsize
                             or nb[3] % itemsize):
            raise RequestError(f"tensor {tensor_label(rec)} is not aligned to its element size {itemsize}")
        return Tensor.trusted(type_, rec.ne, rec.nb, buf.mem, offset, rec.name)
