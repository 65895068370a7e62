"""What a kernel sees: validated tensors over worker memory, and the node that ties them to an op.

The graph layer builds these only after it has checked every byte range against the owning buffer,
so kernels may trust shapes, strides and offsets completely.
"""

from __future__ import annotations

import numpy as np

from wire import op_params
from wire.ggml import MAX_DIMS, PLAIN_DTYPES, TYPE_TRAITS, GGMLOp, GGMLType, row_size
from .target import AVX2, Target


class InvalidNode(ValueError):
    """A node that its op's ggml semantics reject, or that no kernel here supports."""


class Tensor:
    """A tensor whose bytes live in `mem` (a whole uint8 buffer) starting at byte `offset`."""

    __slots__ = ("type", "ne", "nb", "mem", "offset", "name")

    def __init__(self, type_: GGMLType, ne, nb, mem: np.ndarray, offset: int, name: str = ""):
        self.type = GGMLType(type_)
        self.ne = tuple(int(n) for n in ne)
        self.nb = tuple(int(n) for n in nb)
        self.mem = mem
        self.offset = int(offset)
        self.name = name

    @classmethod
    def trusted(cls, type_: GGMLType, ne: tuple, nb: tuple, mem: np.ndarray, offset: int, name: str = "") -> "Tensor":
        """As the constructor, for arguments already of their types (a GGMLType, tuples of 4 ints): the
        worker builds thousands per graph."""
        t = object.__new__(cls)
        t.type, t.ne, t.nb, t.mem, t.offset, t.name = type_, ne, nb, mem, offset, name
        return t

    @classmethod
    def new(cls, type_: GGMLType, ne, data: np.ndarray | None = None) -> "Tensor":
        """A contiguous tensor in fresh memory (tests and references); `data` fills it if given."""
        from wire.ggml import contiguous_strides

        ne = tuple(ne) + (1,) * (MAX_DIMS - len(ne))
        nb = contiguous_strides(type_, ne)
        mem = np.zeros(nb[3] * ne[3] + 64, dtype=np.uint8)
        t = cls(type_, ne, nb, mem, 0)
        if data is not None:
            raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
            mem[: raw.size] = raw
        return t

    @property
    def is_quantized(self) -> bool:
        return TYPE_TRAITS[self.type].is_quantized

    @property
    def row_bytes(self) -> int:
        return row_size(self.type, self.ne[0])

    def is_contiguous(self) -> bool:
        tt = TYPE_TRAITS[self.type]
        expect = tt.type_size
        if self.nb[0] != expect:
            return False
        expect = self.row_bytes
        for i in range(1, MAX_DIMS):
            if self.ne[i] != 1 and self.nb[i] != expect:
                return False
            expect *= self.ne[i]
        return True

    def array(self) -> np.ndarray:
        """A strided (ne3, ne2, ne1, ne0) view in the tensor's numpy dtype; plain types only."""
        ne, nb = self.ne, self.nb
        return np.ndarray(
            shape=(ne[3], ne[2], ne[1], ne[0]),
            dtype=np.dtype(PLAIN_DTYPES[self.type]),
            buffer=self.mem,
            offset=self.offset,
            strides=(nb[3], nb[2], nb[1], nb[0]),
        )

    def rows(self) -> np.ndarray:
        """A (ne3, ne2, ne1, row_bytes) uint8 view: each ggml row as its raw bytes (any type)."""
        ne, nb = self.ne, self.nb
        return np.ndarray(
            shape=(ne[3], ne[2], ne[1], self.row_bytes),
            dtype=np.uint8,
            buffer=self.mem,
            offset=self.offset,
            strides=(nb[3], nb[2], nb[1], 1),
        )

    def __repr__(self) -> str:
        return f"Tensor({self.type.name}, ne={self.ne}, nb={self.nb}, offset={self.offset})"


class Node:
    """One graph node: an op writing `dst` from `src` (positional; None where a slot is empty), computed
    as the ggml-cpu build `target` computes it."""

    __slots__ = ("op", "dst", "src", "params", "name", "target")

    def __init__(self, op: GGMLOp, dst: Tensor, src, params=None, name: str = "", target: Target = AVX2):
        self.op = GGMLOp(op)
        self.dst = dst
        self.src = tuple(src)
        p = np.zeros(16, dtype=np.int32)
        if isinstance(params, (bytes, bytearray)):  # as wire.op_params.encode writes them
            p.view(np.uint8)[: len(params)] = np.frombuffer(params, np.uint8)
        elif params is not None:
            raw = np.asarray(params)
            p[: raw.size] = raw.view(np.int32) if raw.dtype.itemsize == 4 else raw.astype(np.int32)
        self.params = p
        self.name = name
        self.target = target

    def param(self, name: str):
        """A field of the op's parameters, by its name in wire.op_params (the layout the orchestrator encodes
        with): `node.param("eps")`."""
        return getattr(op_params.decode(self.op, self.params.tobytes()), name)

    def srcs(self, n: int) -> tuple:
        """The first n sources, refusing the node if any of them is missing."""
        if len(self.src) < n or any(s is None for s in self.src[:n]):
            raise InvalidNode(f"{self.op.name} needs {n} sources")
        return self.src[:n]

    def __repr__(self) -> str:
        return f"Node({self.op.name} {self.name!r} dst={self.dst} src={self.src})"
