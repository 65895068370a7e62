"""GGML_OP_GET_ROWS: dst[i12, i11, i10] = src0 row idx[i12, i11, i10] of slice (i12, i11), as float32.

ggml_get_rows: src0 (ne00, ne01, ne02, ne03), indices src1 I32 (ne10, ne11, ne12, 1) with
ne02 == ne11 and ne03 == ne12; dst (ne00, ne10, ne11, ne12) is F32, or I32 when src0 is I32 (a plain
copy). Rows are dequantized like ggml's to_float (float32 q * d (+ m), no fma); the K-quant and IQ4
formats through kernels.formats.kquants' decoded form, which keeps ggml's (d*S)*q - dmin*M order.
"""

from __future__ import annotations

from functools import partial

import numba
import numpy as np

from ..jit import JIT, row_loop
from wire.ggml import (TYPE_BF16, TYPE_F16, TYPE_Q4_0, TYPE_Q4_1, TYPE_Q5_0, TYPE_Q5_1, TYPE_Q8_0, TYPE_TRAITS, GGMLOp,
                   GGMLType)

from ..formats import kquants
from ..formats.dequantize import dequantize_rows
from ..formats.kquants import KQUANT_TYPES
from ..node import InvalidNode, Node
from ..fmath import bf16_to_f32, f16_to_f32
from ..formats.quants import LOAD_WEIGHT, QK, QUANT_TYPES
from ..registry import OpKernel, prepared, register
from ..storage import parallel_worthwhile

PLAIN_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.I32)
SOURCE_TYPES = PLAIN_TYPES + QUANT_TYPES + KQUANT_TYPES


def check(node: Node) -> None:
    src0, src1 = node.srcs(2)
    dst = node.dst
    if src0.type not in SOURCE_TYPES:
        raise InvalidNode(f"GET_ROWS: unsupported source type {src0.type.name}")
    if src1.type != GGMLType.I32:
        raise InvalidNode("GET_ROWS: row indices must be I32")
    want = GGMLType.I32 if src0.type == GGMLType.I32 else GGMLType.F32
    if dst.type != want:
        raise InvalidNode(f"GET_ROWS: dst must be {want.name} for a {src0.type.name} source")
    if src0.ne[2] != src1.ne[1] or src0.ne[3] != src1.ne[2] or src1.ne[3] != 1:
        raise InvalidNode(f"GET_ROWS: index shape {src1.ne} does not match source {src0.ne}")
    expect = (src0.ne[0], src1.ne[0], src1.ne[1], src1.ne[2])
    if dst.ne != expect:
        raise InvalidNode(f"GET_ROWS: dst shape {dst.ne} is not {expect}")
    tt = TYPE_TRAITS[src0.type]
    if src0.ne[0] % tt.block_size:
        raise InvalidNode(f"GET_ROWS: row length {src0.ne[0]} is not a multiple of {tt.block_size}")
    if src0.nb[0] != tt.type_size or dst.nb[0] != 4:
        raise InvalidNode("GET_ROWS: source and dst rows must be contiguous")


def _indices(node: Node) -> np.ndarray:
    """The (ne12, ne11, ne10) row indices, refused unless every one names a row of src0."""
    return _checked(node.src[1].array()[0], node.src[0].ne[1])


def _checked(idx: np.ndarray, n_rows: int) -> np.ndarray:
    if not _in_range(idx, n_rows):
        raise InvalidNode(f"GET_ROWS: row index out of range [0, {n_rows})")
    return idx


@numba.njit(**JIT)
def _in_range(idx, n):
    for i in idx.flat:
        if i < 0 or i >= n:
            return False
    return True


# ----------------------------------------------------------------------------------------------
# numba kernels

_f16_load = LOAD_WEIGHT[GGMLType.F16]
# block bytes indexed by the type number (Q4_0=2 ... Q8_0=8), from TYPE_TRAITS; a 4-bit block's quants
# are its last QK/2 bytes
_BLOCK_BYTES = tuple(TYPE_TRAITS[GGMLType(t)].type_size if t in QUANT_TYPES else 0 for t in range(TYPE_Q8_0 + 1))


@numba.njit(inline="always", **JIT)
def _dequantize_row(kind, mem, off, nblk, out):
    """One row of nblk blocks at byte `off` of mem into out (float32), like dequantize_row_q*."""
    for b in range(nblk):
        p = off + b * _BLOCK_BYTES[kind]
        d = _f16_load(mem, p)
        o = b * QK
        if kind == TYPE_Q8_0:
            for j in range(QK):
                out[o + j] = np.float32(np.int8(mem[p + 2 + j])) * d
            continue
        m = _f16_load(mem, p + 2) if kind == TYPE_Q4_1 or kind == TYPE_Q5_1 else np.float32(0)
        qs = p + _BLOCK_BYTES[kind] - QK // 2
        qh = np.int64(0)
        if kind == TYPE_Q5_0 or kind == TYPE_Q5_1:
            h = qs - 4
            qh = (np.int64(mem[h]) | (np.int64(mem[h + 1]) << 8) | (np.int64(mem[h + 2]) << 16)
                  | (np.int64(mem[h + 3]) << 24))
        for j in range(QK // 2):
            byte = np.int64(mem[qs + j])
            lo = (byte & 15) | (((qh >> j) & 1) << 4)
            hi = (byte >> 4) | (((qh >> (j + 16)) & 1) << 4)
            if kind == TYPE_Q4_0:
                out[o + j] = np.float32(lo - 8) * d
                out[o + j + 16] = np.float32(hi - 8) * d
            elif kind == TYPE_Q5_0:
                out[o + j] = np.float32(lo - 16) * d
                out[o + j + 16] = np.float32(hi - 16) * d
            else:  # Q4_1, Q5_1
                out[o + j] = np.float32(lo) * d + m
                out[o + j + 16] = np.float32(hi) * d + m


@numba.njit(parallel=True, **JIT)
def _get_rows_quant(kind, mem, off, nb01, nb02, nb03, nblk, idx, out):
    ne12, ne11, ne10 = idx.shape
    for r in numba.prange(ne12 * ne11 * ne10):
        i12, i11, i10 = r // (ne11 * ne10), (r // ne10) % ne11, r % ne10
        row = off + idx[i12, i11, i10] * nb01 + i11 * nb02 + i12 * nb03
        _dequantize_row(kind, mem, row, nblk, out[i12, i11, i10])


@numba.njit(parallel=True, **JIT)
def _get_rows_kquant(kind, has_min, block_bytes, qb, mem, off, nb01, nb02, nb03, nblk, idx, out):
    ne12, ne11, ne10 = idx.shape
    for r in numba.prange(ne12 * ne11 * ne10):
        i12, i11, i10 = r // (ne11 * ne10), (r // ne10) % ne11, r % ne10
        row = off + idx[i12, i11, i10] * nb01 + i11 * nb02 + i12 * nb03
        q = np.empty(nblk * qb, np.int8)
        s = np.empty(nblk * qb // kquants.GROUP, np.int32)
        m = np.empty_like(s)
        d = np.empty(nblk, np.float32)
        dmin = np.empty_like(d)
        kquants.decode_row(kind, mem, row, nblk, block_bytes, qb, q, s, m, d, dmin)
        kquants.dequantize_decoded(has_min, nblk, qb, q, s, m, d, dmin, out[i12, i11, i10])


@row_loop
def _get_rows_plain(kind, src, idx, out):
    """src: (ne03, ne02, ne01, ne00) view, F16/BF16 as their uint16 bits; any other kind copies as is."""
    ne12, ne11, ne10 = idx.shape
    ne00 = src.shape[3]
    for r in numba.prange(ne12 * ne11 * ne10):
        i12, i11, i10 = r // (ne11 * ne10), (r // ne10) % ne11, r % ne10
        s = src[i12, i11, idx[i12, i11, i10]]
        o = out[i12, i11, i10]
        for i in range(ne00):
            if kind == TYPE_F16:
                o[i] = f16_to_f32(s[i])
            elif kind == TYPE_BF16:
                o[i] = bf16_to_f32(s[i])
            else:
                o[i] = s[i]


def prepare(node: Node):
    src0 = node.src[0]
    out = node.dst.array()  # (ne12, ne11, ne10, ne00): one output row per index
    if 0 in node.dst.ne:
        return partial(_indices, node)  # nothing to gather, but the indices are still checked
    if src0.type in QUANT_TYPES:
        gather = partial(_get_rows_quant, int(src0.type), src0.mem, src0.offset, src0.nb[1], src0.nb[2], src0.nb[3],
                         src0.ne[0] // QK)
    elif src0.type in KQUANT_TYPES:
        tt = TYPE_TRAITS[src0.type]
        gather = partial(_get_rows_kquant, int(src0.type), kquants.HAS_MIN[src0.type], tt.type_size, tt.block_size,
                         src0.mem, src0.offset, src0.nb[1], src0.nb[2], src0.nb[3], src0.ne[0] // tt.block_size)
    else:
        src = src0.array()
        half = src0.type in (GGMLType.F16, GGMLType.BF16)
        plain = partial(_get_rows_plain, int(src0.type), src.view(np.uint16) if half else src)
        threads = parallel_worthwhile(out.size)  # a few rows (the serving engine's streams): no threads
        gather = lambda idx, out: plain(idx, out, threads)  # noqa: E731
    idx, n_rows = node.src[1].array()[0], src0.ne[1]  # a view: the indices come with each run's inputs
    return lambda: gather(_checked(idx, n_rows), out)


forward = prepared(prepare)


def reference(node: Node) -> None:
    src0 = node.src[0]
    idx = _indices(node)
    ne12, ne11, ne10 = idx.shape
    out = node.dst.array()
    rows = src0.rows()
    for i12 in range(ne12):
        for i11 in range(ne11):
            picked = rows[i12, i11, idx[i12, i11]]  # (ne10, row_bytes)
            if src0.type == GGMLType.I32:
                out[i12, i11] = np.ascontiguousarray(picked).view("<i4")
            else:
                out[i12, i11] = dequantize_rows(src0.type, picked)


register(GGMLOp.GET_ROWS)(OpKernel(check, forward, reference, prepare))
