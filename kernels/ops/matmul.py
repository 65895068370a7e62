"""GGML_OP_MUL_MAT: dst[i3,i2,i1,i0] = src0 row i0 (of slice i2/r2, i3/r3) . src1 row (i1,i2,i3).

Follows ggml_compute_forward_mul_mat of the x86 AVX2+FMA ggml-cpu build, so results are
bit-identical to the reference worker:
  * src1 (f32) is first converted to the weights' vec_dot_type: q8_0 for Q4_0/Q5_0/Q8_0, q8_1 for
    Q4_1/Q5_1, fp16 for F16, bf16 for BF16 (F32 stays f32);
  * quantized weights: ggml_vec_dot_<w>_q8_<0|1> (see kernels.formats.quants); llamafile's tinyBLAS, used
    for batches, does the same arithmetic for these types;
  * float weights: when llamafile's tinyBLAS takes the batch (>= 2 columns, rows % 4 == 0, and for
    F32 a contiguous src1) each dot keeps 8 fma lanes (k mod 8); otherwise ggml_vec_dot_<f16|bf16|f32>
    keeps 32 lanes over 32-element steps, with its own reduction tree and tail handling. A node whose
    target has 16 lanes (the AVX-512 build) takes kernels.formats.float_dot512 instead.
K-quant and IQ4 weights (kernels.formats.kquants) go through Q8_K (Q8_0 for IQ4_NL) activations and integer
block sums along whichever of ggml's three routes the shape selects (tiled, vec_dot, tinyBLAS), also
bit for bit.
"""

from __future__ import annotations

from functools import partial

import numba
import numpy as np

from ..jit import JIT
from wire.ggml import TYPE_TRAITS, GGMLOp, GGMLType
from wire.op_params import HINT_SRC0_IS_HADAMARD  # ggml-cpu would run a Walsh-Hadamard transform instead

from ..formats import kquant_dot, kquants, quants
from ..formats.dequantize import dequantize_rows
from ..formats.float_dot import dot_float as _dot_float, round_activations as _activations
from ..formats.float_dot512 import SCRATCH, dot16, np_dot16, np_tail_sum
from ..formats.kquants import KQUANT_TYPES
from ..node import InvalidNode, Node
from ..fmath import np_fma
from ..formats.quants import FLOAT_TYPES, QK, QUANT_TYPES, row_dot1, row_dot2, row_dot4, row_dot8
from ..registry import OpKernel, nothing, prepared, register
from ..storage import WAKE_IS_SLOW, on_one_thread, parallel_worthwhile
from ..tasks import QUANTIZE_PARALLEL_ROWS, ROWS_PER_TASK, task_tile

T = GGMLType
# ggml-cpu's type_traits_cpu[w].vec_dot_type: the format src1 is converted to before the dots
VEC_DOT_TYPE = {T.F32: T.F32, T.F16: T.F16, T.BF16: T.BF16, T.Q4_0: T.Q8_0, T.Q4_1: T.Q8_1,
                T.Q5_0: T.Q8_0, T.Q5_1: T.Q8_1, T.Q8_0: T.Q8_0, **kquants.VEC_DOT_TYPE}
WEIGHT_TYPES = tuple(VEC_DOT_TYPE)


def check(node: Node) -> None:
    src0, src1 = node.srcs(2)
    dst = node.dst
    if src0.type not in WEIGHT_TYPES:
        raise InvalidNode(f"MUL_MAT: unsupported weight type {src0.type.name}")
    if node.param("hint") == HINT_SRC0_IS_HADAMARD:
        check_fwht(node)
        return
    if src1.type != GGMLType.F32 or dst.type != GGMLType.F32:
        raise InvalidNode("MUL_MAT: src1 and dst must be F32")
    ne0, ne1 = src0.ne, src1.ne
    if ne0[0] != ne1[0]:
        raise InvalidNode(f"MUL_MAT: row lengths differ ({ne0[0]} vs {ne1[0]})")
    if ne0[2] <= 0 or ne0[3] <= 0 or ne1[2] % ne0[2] or ne1[3] % ne0[3]:
        raise InvalidNode("MUL_MAT: src0 cannot be broadcast over src1 in dims 2/3")
    if dst.ne != (ne0[1], ne1[1], ne1[2], ne1[3]):
        raise InvalidNode(f"MUL_MAT: dst shape {dst.ne} is not {(ne0[1], ne1[1], ne1[2], ne1[3])}")
    tt = TYPE_TRAITS[src0.type]
    if ne0[0] % tt.block_size:
        raise InvalidNode(f"MUL_MAT: row length {ne0[0]} is not a multiple of {tt.block_size}")
    if src0.nb[0] != tt.type_size or src1.nb[0] != 4:
        raise InvalidNode("MUL_MAT: rows of src0 and src1 must be contiguous")
    if src0.nb[0] > src0.nb[1]:
        raise InvalidNode("MUL_MAT: src0 must not be transposed")
    nb = dst.nb
    if 0 not in dst.ne and not (nb[0] == 4 and nb[0] <= nb[1] <= nb[2] <= nb[3]):
        raise InvalidNode("MUL_MAT: dst must have contiguous rows and non-decreasing strides")


# ----------------------------------------------------------------------------------------------
# the Hadamard hint: src0 is a normalized Hadamard matrix (llama.cpp's KV-cache rotation for quantized
# caches), and ggml-cpu replaces the product by a fast Walsh-Hadamard transform of each src1 row
# (ggml_compute_forward_fwht): scale by 1/sqrt(n) first, then butterflies u+v, u-v in float32.


def check_fwht(node: Node) -> None:
    src0, src1 = node.srcs(2)
    dst = node.dst
    n = src1.ne[0]
    if src0.type != GGMLType.F32 or dst.type != GGMLType.F32 or src1.type not in (GGMLType.F32, GGMLType.F16):
        raise InvalidNode("MUL_MAT (Hadamard): src0 and dst must be F32, src1 F32 or F16")
    if n <= 0 or n & (n - 1) or src0.ne[0] != n or src0.ne[1] != n:
        raise InvalidNode(f"MUL_MAT (Hadamard): rows of {n} are not a power of two matching src0 {src0.ne}")
    if dst.ne != (n, src1.ne[1], src1.ne[2], src1.ne[3]):
        raise InvalidNode(f"MUL_MAT (Hadamard): dst shape {dst.ne} is not {(n, *src1.ne[1:])}")
    if src1.nb[0] != TYPE_TRAITS[src1.type].type_size or dst.nb[0] != 4:
        raise InvalidNode("MUL_MAT (Hadamard): rows of src1 and dst must be contiguous")


@numba.njit(parallel=True, **JIT)
def _fwht_rows(rows, scale):
    n = rows.shape[1]
    for r in numba.prange(rows.shape[0]):
        row = rows[r]
        for j in range(n):
            row[j] = row[j] * scale
        length = 1
        while length < n:
            for i in range(0, n, 2 * length):
                for j in range(i, i + length):
                    u, v = row[j], row[j + length]
                    row[j] = u + v
                    row[j + length] = u - v
            length *= 2


def _fwht_scale(n: int) -> np.float32:
    return np.float32(1) / np.sqrt(np.float32(n))  # 1.0f / sqrtf((float)n)


def forward_fwht(node: Node) -> None:
    x = node.src[1].array()
    rows = np.array(x, dtype=np.float32).reshape(-1, x.shape[-1])  # a copy: F16 widens exactly
    _fwht_rows(rows, _fwht_scale(x.shape[-1]))
    node.dst.array()[...] = rows.reshape(x.shape)


def reference_fwht(node: Node) -> None:
    x = node.src[1].array()
    n = x.shape[-1]
    y = x.astype(np.float32) * _fwht_scale(n)
    length = 1
    while length < n:
        pairs = y.reshape(*y.shape[:-1], n // (2 * length), 2, length)
        u, v = pairs[..., 0, :].copy(), pairs[..., 1, :].copy()
        pairs[..., 0, :], pairs[..., 1, :] = u + v, u - v
        length *= 2
    node.dst.array()[...] = y


def _tinyblas_takes(node: Node) -> bool:
    """Does llamafile's tinyBLAS compute this float-weight product (instead of ggml's vec_dot)?"""
    src0, src1 = node.src[:2]
    if src1.ne[1] < 2 or src0.ne[1] % 4:
        return False
    return src0.type != GGMLType.F32 or src1.is_contiguous()


# ----------------------------------------------------------------------------------------------
# numba kernels

@numba.njit(inline="always", **JIT)
def _quantize_activation_row(x, r, yq, yd, ys, with_sum):
    """Flat activation row r of x (ne13, ne12, ne11, K) into its slice of the flat q8 scratch."""
    ne11, ne12, k = x.shape[2], x.shape[1], x.shape[3]
    nblk = k // QK
    i11, i12, i13 = r % ne11, (r // ne11) % ne12, r // (ne11 * ne12)
    quants.quantize_q8_row(x[i13, i12, i11], yq[r * k:(r + 1) * k], yd[r * nblk:(r + 1) * nblk],
                           ys[r * nblk:(r + 1) * nblk], with_sum)


@numba.njit(parallel=True, **JIT)
def _mul_mat_quant(kind, w, off, nb01, nb02, nb03, ne01, ne02, ne03, nblk, x, yq, yd, ys, with_sum, vnni, out):
    """x: the (ne13, ne12, ne11, K) f32 activations, quantized first into the flat scratch yq/yd/ys;
    `vnni`: eight activation rows per weight row read first (quants.row_dot8, quants.quant_vnni)."""
    ne13, ne12, ne11, _ = x.shape
    n_rows = ne13 * ne12 * ne11
    if n_rows >= QUANTIZE_PARALLEL_ROWS:
        for r in numba.prange(n_rows):
            _quantize_activation_row(x, r, yq, yd, ys, with_sum)
    else:  # a decode step's single row: not worth waking the other threads for
        for r in range(n_rows):
            _quantize_activation_row(x, r, yq, yd, ys, with_sum)
    for task in numba.prange(ne13 * ne12 * ((ne01 + ROWS_PER_TASK - 1) // ROWS_PER_TASK)):
        i12, i13, base, col0, lo, hi = task_tile(task, ne01, ne02, ne03, ne11, ne12, ne13, off, nb02, nb03)
        i11 = 0
        while vnni and i11 + 8 <= ne11:
            for ir in range(lo, hi):
                v8 = row_dot8(kind, w, base + ir * nb01, nblk, yq, yd, ys, col0 + i11)
                for c in range(8):
                    out[i13, i12, i11 + c, ir] = v8[c]
            i11 += 8
        while i11 + 4 <= ne11:  # four activation rows per weight row read
            for ir in range(lo, hi):
                v = row_dot4(kind, w, base + ir * nb01, nblk, yq, yd, ys, col0 + i11)
                for c in range(4):
                    out[i13, i12, i11 + c, ir] = v[c]
            i11 += 4
        if i11 + 2 <= ne11:
            for ir in range(lo, hi):
                v2 = row_dot2(kind, w, base + ir * nb01, nblk, yq, yd, ys, col0 + i11)
                out[i13, i12, i11, ir], out[i13, i12, i11 + 1, ir] = v2[0], v2[1]
            i11 += 2
        for i in range(i11, ne11):
            for ir in range(lo, hi):
                out[i13, i12, i, ir] = row_dot1(kind, w, base + ir * nb01, nblk, yq, yd, ys, col0 + i)


@numba.njit(parallel=True, **JIT)
def _mul_mat_float(kind, tiny, lanes, pairs, w, off, nb01, nb02, nb03, ne01, ne02, ne03, esize, y, out):
    ne13, ne12, ne11 = out.shape[0], out.shape[1], out.shape[2]
    ne00 = y.size // max(1, ne11 * ne12 * ne13)
    for task in numba.prange(ne13 * ne12 * ((ne01 + ROWS_PER_TASK - 1) // ROWS_PER_TASK)):
        i12, i13, base, col0, lo, hi = task_tile(task, ne01, ne02, ne03, ne11, ne12, ne13, off, nb02, nb03)
        acc = np.empty(SCRATCH, np.float32)
        for i11 in range(ne11):
            yoff = (col0 + i11) * ne00
            for ir in range(lo, hi):
                if lanes == 16:
                    out[i13, i12, i11, ir] = dot16(kind, tiny, pairs, w, base + ir * nb01, esize, y, yoff, ne00, acc)
                else:
                    out[i13, i12, i11, ir] = _dot_float(kind, tiny, w, base + ir * nb01, esize, y, yoff, ne00)


# multiply-adds of MUL_MAT worth one element of a row loop (a load and a store) in parallel_worthwhile
MACS_PER_ELEMENT = 4


def prepare(node: Node):
    run = _prepare(node)
    src0, src1 = node.src[:2]
    work = src0.ne[0] * src0.ne[1] * src1.ne[1] * src1.ne[2] * src1.ne[3]  # multiply-adds
    return on_one_thread(run) if WAKE_IS_SLOW and not parallel_worthwhile(work // MACS_PER_ELEMENT) else run


def _prepare(node: Node):
    src0, src1 = node.src[:2]
    dst = node.dst
    if 0 in src0.ne or 0 in dst.ne:
        return nothing
    if node.param("hint") == HINT_SRC0_IS_HADAMARD:
        return partial(forward_fwht, node)
    x = src1.array()
    out = dst.array()
    if src0.type in FLOAT_TYPES:
        kind, tiny = int(src0.type), _tinyblas_takes(node)
        lanes, pairs = node.target.lanes, node.target.bf16_pairs

        def run_float():  # the activations are rounded to the weights' float type on every run
            _mul_mat_float(kind, tiny, lanes, pairs, src0.mem, src0.offset, src0.nb[1], src0.nb[2], src0.nb[3], src0.ne[1],
                           src0.ne[2], src0.ne[3], src0.nb[0], _activations(src0.type, x).reshape(-1), out)

        return run_float
    ne10 = src1.ne[0]
    if src0.type in KQUANT_TYPES:
        return kquant_dot.bind(src0, x, out, node.target)
    n_rows = x.shape[0] * x.shape[1] * x.shape[2]
    with_sum = VEC_DOT_TYPE[src0.type] == GGMLType.Q8_1
    qs = np.empty(n_rows * ne10, np.int8)  # scratch for the quantized activations, reused every run
    d = np.empty(n_rows * ne10 // QK, np.float32)
    s = np.empty_like(d) if with_sum else d
    return partial(_mul_mat_quant, int(src0.type), src0.mem, src0.offset, src0.nb[1], src0.nb[2], src0.nb[3],
                   src0.ne[1], src0.ne[2], src0.ne[3], ne10 // QK, x, qs, d, s, with_sum,
                   quants.quant_vnni(node.target), out)


forward = prepared(prepare)


# ----------------------------------------------------------------------------------------------
# numpy reference: the same arithmetic, vectorized over (weight rows x activation rows)


def _hsum8_np(acc):
    t = acc[..., 4:] + acc[..., :4]
    return (t[..., 0] + t[..., 2]) + (t[..., 1] + t[..., 3])


def _slice_quant(type_, rows, x):
    """rows: (R, row_bytes) weights; x: (C, K) f32 activations -> (R, C) like ggml_vec_dot."""
    q, d, m = quants.unpack_blocks(type_, rows.reshape(-1, TYPE_TRAITS[type_].type_size))
    nb = x.shape[1] // QK
    q, d = q.reshape(len(rows), nb, 8, 4), d.reshape(len(rows), nb)
    yq, yd, ys = quants.quantize_q8_ref(x, m is not None)
    yq = yq.reshape(len(x), nb, 8, 4).astype(np.int64)
    lanes = np.einsum("rblj,cblj->rcbl", q.astype(np.int64), yq).astype(np.float32)
    acc = np.zeros((len(rows), len(x), 8), np.float32)
    mins = np.zeros((len(rows), len(x)), np.float32)
    for b in range(nb):
        scale = d[:, None, b] * yd[None, :, b]  # float32 product, as ggml
        acc = np_fma(scale[..., None], lanes[:, :, b], acc)
        if m is not None:
            mins = np_fma(m.reshape(len(rows), nb)[:, None, b], ys[None, :, b], mins)
    return _hsum8_np(acc) + mins if m is not None else _hsum8_np(acc)


def _slice_float(type_, w, x, tiny):
    """w: (R, K) f32 weights, x: (C, K) activations already rounded to the vec_dot type."""
    n = w.shape[1]
    prod = lambda i, j: (w[:, None, i:j], x[None, :, i:j])  # noqa: E731
    if tiny:
        acc = np.zeros((len(w), len(x), 8), np.float32)
        for i in range(0, n, 8):
            a, b = prod(i, i + 8)
            pad = 8 - a.shape[-1]
            acc = np_fma(np.pad(a, [(0, 0)] * 2 + [(0, pad)]), np.pad(b, [(0, 0)] * 2 + [(0, pad)]), acc)
        return _hsum8_np(acc)
    full = n & ~31
    acc = np.zeros((len(w), len(x), 32), np.float32)
    for i in range(0, full, 32):
        acc = np_fma(*prod(i, i + 32), acc)
    v = (acc[..., 0:8] + acc[..., 16:24]) + (acc[..., 8:16] + acc[..., 24:32])
    t = v[..., :4] + v[..., 4:]
    if type_ == GGMLType.BF16:
        res = (t[..., 0] + t[..., 2]) + (t[..., 1] + t[..., 3])
    else:
        res = (t[..., 0] + t[..., 1]) + (t[..., 2] + t[..., 3])
    return np_tail_sum(type_, w, x, full, res)


def reference(node: Node) -> None:
    src0, src1 = node.src[:2]
    if 0 in src0.ne or 0 in node.dst.ne:
        return
    if node.param("hint") == HINT_SRC0_IS_HADAMARD:
        reference_fwht(node)
        return
    out = node.dst.array()
    x = src1.array()
    ne02, ne03 = src0.ne[2], src0.ne[3]
    ne12, ne13 = src1.ne[2], src1.ne[3]
    tiny = src0.type in FLOAT_TYPES and _tinyblas_takes(node)
    for i13 in range(ne13):
        for i12 in range(ne12):
            rows = src0.rows()[i13 // (ne13 // ne03), i12 // (ne12 // ne02)]
            if src0.type in QUANT_TYPES:
                out[i13, i12] = _slice_quant(src0.type, rows, x[i13, i12]).T
            elif src0.type in KQUANT_TYPES:
                out[i13, i12] = kquants.dot_ref(src0.type, rows, np.ascontiguousarray(x[i13, i12], np.float32)).T
            else:
                w = dequantize_rows(src0.type, rows)
                xa = _activations(src0.type, x[i13, i12])
                if node.target.lanes == 16:
                    out[i13, i12] = np_dot16(src0.type, w, xa, tiny, node.target.bf16_pairs).T
                else:
                    out[i13, i12] = _slice_float(src0.type, w, xa, tiny).T


register(GGMLOp.MUL_MAT)(OpKernel(check, forward, reference, prepare))
