"""How kernels see tensor memory: storage kinds (F32, F16/BF16 as uint16 bits, I32) with their scalar
load/store, numba-friendly strided views, F16 widening, and the row-loop policy (`parallel_worthwhile`).
The core every op module uses; it imports no op module.
"""

from __future__ import annotations

import os
from typing import Callable

import numba
import numpy as np
from numba import prange, types
from numba.core import cgutils
from numba.core.imputils import impl_ret_borrowed
from numba.extending import intrinsic

from .fmath import (bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16, np_bf16_bits_to_f32, np_f16_bits_to_f32,
                    np_f32_to_bf16_bits, np_f32_to_f16_bits)
from wire.ggml import TYPE_BF16, TYPE_F16, TYPE_F32, TYPE_I32, TYPE_TRAITS, GGMLType
from .jit import JIT, row_loop
from .llvm import prefetch
from .formats.kv_quants import np_trunc_i32 as np_f32_to_i32
from .formats.kv_quants import trunc_i32 as f32_to_i32
from .node import Tensor

F32 = np.float32

# ---------------------------------------------------------------------------------------------
# storage kinds: how a kernel reads/writes the elements of an array

# A kind is the ggml type number (ggml.TYPE_F32, TYPE_F16, TYPE_BF16, TYPE_I32: pass int(t.type)), or
# RAW_BITS, which is no ggml type: copy the elements' bits unconverted.
RAW_BITS = -1


# numpy views numba can handle: half floats travel as their uint16 bit patterns
_STORAGE = {GGMLType.F32: np.float32, GGMLType.F16: np.uint16, GGMLType.BF16: np.uint16, GGMLType.I32: np.int32}
_RAW_UINTS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def storage(t: Tensor) -> np.ndarray:
    """The tensor's (ne3, ne2, ne1, ne0) strided view in a numba-friendly dtype (F16/BF16 as uint16)."""
    return t.array().view(_STORAGE[t.type])


def raw_storage(t: Tensor) -> np.ndarray:
    """A plain type's elements as unsigned integers of the same width: copies without conversion."""
    return t.array().view(_RAW_UINTS[TYPE_TRAITS[t.type].type_size])


@intrinsic
def contiguous_row(typingctx, a, i):
    """Row i of a 2-D view whose rows the node's check found contiguous (ne0 elements 1 apart), typed
    as a C-contiguous 1-D array: numba cannot know that of a strided view, and loops over a row it
    types as strided do not vectorize. The row shares a's memory; i is not bounds-checked."""
    if not isinstance(a, types.Array) or a.ndim != 2:
        return None
    ret = types.Array(a.dtype, 1, "C")

    def codegen(context, builder, signature, args):
        src = context.make_array(signature.args[0])(context, builder, args[0])
        shape, strides = cgutils.unpack_tuple(builder, src.shape), cgutils.unpack_tuple(builder, src.strides)
        byte = builder.gep(builder.bitcast(src.data, cgutils.voidptr_t), [builder.mul(args[1], strides[0])])
        itemsize = context.get_constant(types.intp, context.get_abi_sizeof(context.get_data_type(a.dtype)))
        row = context.make_array(ret)(context, builder)
        context.populate_array(row, data=builder.bitcast(byte, src.data.type), shape=[shape[1]], strides=[itemsize],
                               itemsize=itemsize, meminfo=src.meminfo, parent=src.parent)
        return impl_ret_borrowed(context, builder, ret, row._getvalue())  # a new reference to a's memory

    return ret(a, types.intp), codegen


CACHE_LINE = 64


@intrinsic
def _prefetch_byte(typingctx, a, at):
    """A read hint for the line holding byte `at` of a's memory (never faults: any address is harmless)."""
    if not isinstance(a, types.Array):
        return None

    def codegen(context, builder, signature, args):
        src = context.make_array(signature.args[0])(context, builder, args[0])
        prefetch(builder, builder.gep(builder.bitcast(src.data, cgutils.voidptr_t), [args[1]]))
        return context.get_dummy_value()

    return types.void(a, types.intp), codegen


@numba.njit(inline="always", **JIT)
def prefetch_span(a, at, n):
    """Asks for bytes [at, at + n) of a's memory (n > 0) to be brought into the cache: one hint every
    CACHE_LINE bytes and one for the last byte, so every line the span touches, however it is aligned."""
    for off in range(at, at + n, CACHE_LINE):
        _prefetch_byte(a, off)
    _prefetch_byte(a, at + n - 1)


@numba.njit(inline="always", **JIT)
def prefetch_row(a, i):
    """prefetch_span of row i of a 2-D view whose rows are contiguous."""
    prefetch_span(a, i * a.strides[0], a.shape[1] * a.itemsize)


@numba.njit(inline="always", **JIT)
def load_f32(v, kind):
    """One stored element as float32."""
    if kind == TYPE_F16:
        return f16_to_f32(np.uint32(v))
    if kind == TYPE_BF16:
        return bf16_to_f32(np.uint32(v))
    return np.float32(v)


@numba.njit(inline="always", **JIT)
def store_f32(dst, i3, i2, i1, i0, f, kind):
    """Write float32 `f` into dst[i3, i2, i1, i0], converting to the storage kind."""
    if kind == TYPE_F16:
        dst[i3, i2, i1, i0] = f32_to_f16(f)
    elif kind == TYPE_BF16:
        dst[i3, i2, i1, i0] = f32_to_bf16(f)
    elif kind == TYPE_I32:
        dst[i3, i2, i1, i0] = f32_to_i32(f)
    else:
        dst[i3, i2, i1, i0] = f
# ---------------------------------------------------------------------------------------------
# row loops. Each kernel is a per-row body plus one driver (a prange loop, `jit.row_loop`) whose last
# argument, `parallel`, picks its threaded or its serial compilation: threads pay off only on big
# tensors, on small ones (decode steps) waking them costs more than the work.

# Threads that sleep as soon as a parallel loop ends (OMP_WAIT_POLICY=PASSIVE: local workers sharing the
# cores, orchestrator.pipeline.local_workers) take a wake-up to start each loop: then MUL_MAT too runs on the
# calling thread below PARALLEL_MIN_WORK, and that is 4x higher (a decode step's attention too). Two such
# workers at -t 2 decoded SmolLM2 at 48-62 tok/s before, 63-65 with MUL_MAT gated, 68-75 with the higher
# threshold, 64-82 at -t 1, while reading a prompt 1.8x as fast as at -t 1 throughout. Spinning threads
# (the default) start at once: one worker at -t 2 decoded at 91-104 tok/s, 74-78 with MUL_MAT gated.
WAKE_IS_SLOW = os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE"
PARALLEL_MIN_WORK = 1 << 20 if WAKE_IS_SLOW else 1 << 18


def parallel_worthwhile(n_elements: int, cost: int = 1) -> bool:
    """Whether to use threads; `cost` weighs an element's work (1 = a load and a store)."""
    return n_elements * cost >= PARALLEL_MIN_WORK


def on_one_thread(run: Callable[[], None]) -> Callable[[], None]:
    """run() with numba's threads limited to the calling one, for a kernel compiled only parallel (MUL_MAT)
    on work too small to wake the other threads for."""
    def serial() -> None:
        n = numba.get_num_threads()
        numba.set_num_threads(1)
        try:
            run()
        finally:
            numba.set_num_threads(n)

    return serial


@numba.njit(inline="always", **JIT)
def row_coords(r, n1, n2):
    """(i1, i2, i3) of flat row r in a (n3, n2, n1, n0) array."""
    return r % n1, (r // n1) % n2, r // (n1 * n2)


def rows_contiguous(t: Tensor) -> bool:
    return t.ne[0] == 1 or t.nb[0] == TYPE_TRAITS[t.type].type_size


# ---------------------------------------------------------------------------------------------
# converting copies between storage kinds: ggml's dup order (source read in row-major order of its own
# shape, destination filled in row-major order of its shape), through float32

@numba.njit(inline="always", **JIT)
def _unflatten(flat, d2, d1, d0):
    """(j3, j2, j1, j0) of the row-major element index `flat` in a (.., d2, d1, d0) array."""
    rest = flat // d0
    return rest // (d1 * d2), (rest // d1) % d2, rest % d1, flat % d0


@numba.njit(inline="always", **JIT)
def _convert(src, dst, skind, dkind, i3, i2, i1, i0, j3, j2, j1, j0):
    if skind == RAW_BITS:
        dst[j3, j2, j1, j0] = src[i3, i2, i1, i0]
    else:
        store_f32(dst, j3, j2, j1, j0, load_f32(src[i3, i2, i1, i0], skind), dkind)


@numba.njit(**JIT)
def _copy_row(src, dst, skind, dkind, r):
    """Source row r into the destination elements that follow it in row-major order."""
    n0, d0 = src.shape[3], dst.shape[3]
    i1, i2, i3 = row_coords(r, src.shape[2], src.shape[1])
    j3, j2, j1, j0 = _unflatten(r * n0, dst.shape[1], dst.shape[2], d0)
    if n0 == d0:  # rows of equal length map onto each other whole
        for i0 in range(n0):
            _convert(src, dst, skind, dkind, i3, i2, i1, i0, j3, j2, j1, i0)
        return
    for i0 in range(n0):
        if j0 == d0:
            j3, j2, j1, j0 = _unflatten(r * n0 + i0, dst.shape[1], dst.shape[2], d0)
        _convert(src, dst, skind, dkind, i3, i2, i1, i0, j3, j2, j1, j0)
        j0 += 1


@row_loop
def _copy_rows(src, dst, skind, dkind):
    n_rows = src.shape[0] * src.shape[1] * src.shape[2]
    for r in prange(n_rows):
        _copy_row(src, dst, skind, dkind, np.int64(r))


def copy_arrays(src: np.ndarray, dst: np.ndarray, skind: int, dkind: int) -> None:
    if src.size:
        _copy_rows(src, dst, skind, dkind, parallel_worthwhile(src.size))


def convert_into(src: np.ndarray, dst: np.ndarray, skind: int, dkind: int) -> None:
    """Row-major converting copy between storage arrays (for other kernels' widen/narrow steps)."""
    copy_arrays(src, dst, skind, dkind)


def widen_f32(t: Tensor) -> np.ndarray:
    """A fresh contiguous float32 (ne3, ne2, ne1, ne0) copy of an F32/F16/BF16 tensor."""
    out = np.empty((t.ne[3], t.ne[2], t.ne[1], t.ne[0]), dtype=np.float32)
    copy_arrays(storage(t), out, int(t.type), TYPE_F32)
    return out


def to_f32_reference(t: Tensor) -> np.ndarray:
    a = storage(t)
    if t.type == GGMLType.F16:
        return np_f16_bits_to_f32(a)
    if t.type == GGMLType.BF16:
        return np_bf16_bits_to_f32(a)
    return a.astype(np.float32)


def from_f32_reference(values: np.ndarray, type_: GGMLType) -> np.ndarray:
    if type_ == GGMLType.F16:
        return np_f32_to_f16_bits(values)
    if type_ == GGMLType.BF16:
        return np_f32_to_bf16_bits(values)
    if type_ == GGMLType.I32:
        return np_f32_to_i32(values)
    return np.asarray(values, dtype=np.float32)


# ---------------------------------------------------------------------------------------------
# F16 tensors widened to float32 (exact), for kernels that compute on F32 copies

@numba.njit(**JIT)
def _widen_row(r, buf, off, ne, st, out):
    i3, i2, i1 = r // (ne[2] * ne[1]), (r // ne[1]) % ne[2], r % ne[1]
    base = off + i3 * st[3] + i2 * st[2] + i1 * st[1]
    src = buf[base : base + ne[0]]  # a slice keeps the loop free of negative-index checks
    row = out[i3, i2, i1]
    for t in range(ne[0]):
        row[t] = f16_to_f32(src[t])


@numba.njit(**JIT)
def _widen_plane_transposed(r, buf, off, ne, st, out):
    # out[i3, i2, i0, i1]: widen 16 rows at a time into a small buffer, then write it out by columns
    block = 16
    i3, i2 = r // ne[2], r % ne[2]
    plane = out[i3, i2]
    tmp = np.empty((block, ne[0]), F32)
    for j0 in range(0, ne[1], block):
        m = min(block, ne[1] - j0)
        for u in range(m):
            b = off + i3 * st[3] + i2 * st[2] + (j0 + u) * st[1]
            src = buf[b : b + ne[0]]
            row = tmp[u]
            for t in range(ne[0]):
                row[t] = f16_to_f32(src[t])
        for t in range(ne[0]):
            col = plane[t, j0 : j0 + m]
            for u in range(m):
                col[u] = tmp[u, t]


@row_loop
def _widen(buf, off, ne, st, out, transpose):
    n = ne[3] * ne[2] if transpose else ne[3] * ne[2] * ne[1]
    for r in prange(n):
        if transpose:
            _widen_plane_transposed(np.int64(r), buf, off, ne, st, out)
        else:
            _widen_row(np.int64(r), buf, off, ne, st, out)


def u16_view(t: Tensor) -> np.ndarray:
    """The raw bits of an F16 tensor as a strided (ne3, ne2, ne1, ne0) uint16 array."""
    ne, nb = t.ne, t.nb
    return np.ndarray((ne[3], ne[2], ne[1], ne[0]), np.uint16, t.mem, t.offset, (nb[3], nb[2], nb[1], nb[0]))


def widen_f16(t: Tensor, transpose: bool = False) -> np.ndarray:
    """An F16 tensor (rows contiguous) as a new C-contiguous float32 (ne3, ne2, ne1, ne0) array, or
    (ne3, ne2, ne0, ne1) if transpose."""
    ne = t.ne
    shape = (ne[3], ne[2], ne[0], ne[1]) if transpose else (ne[3], ne[2], ne[1], ne[0])
    out = np.empty(shape, F32)
    if t.offset % 2 or any(n % 2 for n in t.nb) or t.mem.size % 2:
        src = u16_view(t).view(np.float16)  # odd byte layout: let numpy do it
        out[...] = src.transpose(0, 1, 3, 2) if transpose else src
        return out
    buf = t.mem.view(np.uint16)
    _widen(buf, t.offset // 2, np.array(ne, np.int64), np.array(t.nb, np.int64) // 2, out, transpose,
           parallel_worthwhile(out.size, cost=2))
    return out


def as_f32(t: Tensor) -> np.ndarray:
    """An F32 or F16 tensor's values as float32 (a copy for F16; the conversion is exact)."""
    return t.array() if t.type == GGMLType.F32 else widen_f16(t)
