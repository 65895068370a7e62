"""K-quant and IQ4 block formats (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS): numpy reference
unpackers and dequantizers, the Q8_K activation quantizer, and their numba twins.

Every format here unpacks to the same shape, which is what lets one dequantizer and one dot product
serve all seven: per block of QB elements (256, or 32 for IQ4_NL) integer quants q, a scale d and a
minimum scale dmin (float32), and per group of 16 elements an integer scale S and minimum M. A value
is then (d*S)*q - dmin*M in float32 — exactly the operation order of ggml's dequantize_row_* (see
ggml-quants.c), so GET_ROWS is bit-identical. MUL_MAT quantizes activations to Q8_K (Q8_0 for
IQ4_NL) and sums integer block products exactly; the float order then follows whichever ggml-cpu
route the shape selects (the tiled K-quant kernel, vec_dot, or llamafile's tinyBLAS: see `route`),
so products are bit-identical with the reference worker too. The numba dot products and the MUL_MAT
driver are in kernels/formats/kquant_dot.py; `dot_ref` here is their numpy twin.
"""

from __future__ import annotations

import numba
import numpy as np

from ..jit import JIT
from wire.ggml import (TYPE_IQ4_NL, TYPE_IQ4_XS, TYPE_Q2_K, TYPE_Q3_K, TYPE_Q4_K, TYPE_Q5_K, TYPE_Q6_K, TYPE_TRAITS,
                   GGMLType)

from . import quants
from ..fmath import np_fma
from .quants import LOAD_WEIGHT

T = GGMLType
QK_K = 256  # elements per super-block
GROUP = 16  # elements sharing one integer scale (and minimum) in the unpacked form
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)

# type -> (elements per block, has a minimum, activation format of ggml-cpu's vec_dot_type)
FORMATS = {
    T.Q2_K: (QK_K, True, T.Q8_K),
    T.Q3_K: (QK_K, False, T.Q8_K),
    T.Q4_K: (QK_K, True, T.Q8_K),
    T.Q5_K: (QK_K, True, T.Q8_K),
    T.Q6_K: (QK_K, False, T.Q8_K),
    T.IQ4_NL: (32, False, T.Q8_0),
    T.IQ4_XS: (QK_K, False, T.Q8_K),
}
KQUANT_TYPES = tuple(FORMATS)
HAS_MIN = {t: f[1] for t, f in FORMATS.items()}
VEC_DOT_TYPE = {t: f[2] for t, f in FORMATS.items()}


# ----------------------------------------------------------------------------------------------
# numpy reference unpackers: (n, type_size) uint8 -> q (n, QB) int32, S and M (n, QB/16) int32,
# d and dmin (n,) float32. Element e of a 256-block is written e = 128n + 32j + 16h + l where the
# formats interleave (n half, j quarter of the half, h which 16, l position).


def _f16(b, at):
    return b[:, at : at + 2].copy().view(np.float16).astype(np.float32)[:, 0]


def _scale_min_k4(sc):
    """Q4_K/Q5_K's 12 scale bytes -> 8 six-bit scales and 8 six-bit minimums (get_scale_min_k4)."""
    sc = sc.astype(np.int32)
    lo, mid, hi = sc[:, 0:4], sc[:, 4:8], sc[:, 8:12]
    scales = np.concatenate([lo & 63, (hi & 0xF) | ((lo >> 6) << 4)], axis=1)
    mins = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
    return np.repeat(scales, 2, axis=1), np.repeat(mins, 2, axis=1)  # per 32 -> per 16


def _crumbs(qs, n_halves=2):
    """2-bit fields of Q2_K/Q3_K: qs (n, 64) -> (n, 256) in element order 128n + 32j + 16h + l."""
    q = qs.astype(np.int32).reshape(-1, n_halves, 1, 32)  # (blk, n, -, 16h + l)
    shifts = (2 * np.arange(4)).reshape(1, 1, 4, 1)
    return ((q >> shifts) & 3).reshape(-1, 128 * n_halves)


def _unpack_q2_k(b):
    sc = b[:, 0:16].astype(np.int32)
    return _crumbs(b[:, 16:80]), sc & 0xF, sc >> 4, _f16(b, 80), _f16(b, 82)


def _unpack_q3_k(b):
    hm = b[:, 0:32].astype(np.int32)  # bit 4n + j of byte 16h + l is the high bit of element e
    bit = (np.arange(2).reshape(2, 1, 1) * 4 + np.arange(4).reshape(1, 4, 1))  # (n, j, 1)
    high = (hm[:, None, None, :] >> bit[None]) & 1  # (blk, n, j, 32)
    q = _crumbs(b[:, 32:96]) - 4 * (1 - high.reshape(-1, QK_K))
    s = b[:, 96:108].astype(np.int32)
    k = np.arange(16)
    low = (s[:, k % 8] >> (4 * (k // 8))) & 0xF
    top = (s[:, 8 + k % 4] >> (2 * (k // 4))) & 3
    return q, (low | (top << 4)) - 32, None, _f16(b, 108), np.zeros(len(b), np.float32)


def _nibble_pairs(qs, width):
    """qs (n, width*k) -> (n, 2*width*k): each run of `width` bytes gives its low nibbles, then its
    high nibbles (the order of Q4_K/Q5_K with width 32, IQ4_NL/IQ4_XS with width 16)."""
    q = qs.astype(np.int32).reshape(len(qs), -1, 1, width)
    return np.concatenate([q & 0xF, q >> 4], axis=2).reshape(len(qs), -1)


def _unpack_q4_k(b):
    s, m = _scale_min_k4(b[:, 4:16])
    return _nibble_pairs(b[:, 16:144], 32), s, m, _f16(b, 0), _f16(b, 2)


def _unpack_q5_k(b):
    s, m = _scale_min_k4(b[:, 4:16])
    qh = b[:, 16:48].astype(np.int32)  # bit i of byte l is the fifth bit of element 32i + l
    high = (qh[:, None, :] >> np.arange(8).reshape(1, 8, 1)) & 1
    q = _nibble_pairs(b[:, 48:176], 32) | (high.reshape(-1, QK_K) << 4)
    return q, s, m, _f16(b, 0), _f16(b, 2)


def _unpack_q6_k(b):
    ql = b[:, 0:128].astype(np.int32).reshape(-1, 2, 2, 32)  # (blk, n, k&1, l)
    qh = b[:, 128:192].astype(np.int32).reshape(-1, 2, 1, 32)  # (blk, n, -, l)
    low = np.stack([ql[:, :, 0] & 0xF, ql[:, :, 1] & 0xF, ql[:, :, 0] >> 4, ql[:, :, 1] >> 4], axis=2)
    high = (qh >> (2 * np.arange(4)).reshape(1, 1, 4, 1)) & 3
    q = (low | (high << 4)).reshape(-1, QK_K) - 32
    return q, b[:, 192:208].view(np.int8).astype(np.int32), None, _f16(b, 208), np.zeros(len(b), np.float32)


def _unpack_iq4_nl(b):
    q = KVALUES_IQ4NL[_nibble_pairs(b[:, 2:18], 16)].astype(np.int32)
    return q, np.ones((len(b), 2), np.int32), None, _f16(b, 0), np.zeros(len(b), np.float32)


def _unpack_iq4_xs(b):
    ib = np.arange(8)
    high = (b[:, 2:4].copy().view("<u2").astype(np.int32) >> (2 * ib)) & 3
    low = (b[:, 4 + ib // 2].astype(np.int32) >> (4 * (ib % 2))) & 0xF
    q = KVALUES_IQ4NL[_nibble_pairs(b[:, 8:136], 16)].astype(np.int32)
    return q, np.repeat((low | (high << 4)) - 32, 2, axis=1), None, _f16(b, 0), np.zeros(len(b), np.float32)


UNPACK = {T.Q2_K: _unpack_q2_k, T.Q3_K: _unpack_q3_k, T.Q4_K: _unpack_q4_k, T.Q5_K: _unpack_q5_k,
          T.Q6_K: _unpack_q6_k, T.IQ4_NL: _unpack_iq4_nl, T.IQ4_XS: _unpack_iq4_xs}


def unpack_blocks(type_: GGMLType, blocks: np.ndarray):
    """(n, type_size) uint8 -> q (n, QB), S (n, QB/16), M (n, QB/16) or None, d (n,), dmin (n,)."""
    return UNPACK[type_](np.ascontiguousarray(blocks))


def _dequantize_blocks(type_):
    def dequantize(b):
        q, s, m, d, dmin = unpack_blocks(type_, b)
        scale = np.repeat(d[:, None] * s.astype(np.float32), GROUP, axis=1)  # float32 d * S, as ggml
        y = scale * q.astype(np.float32)
        if m is None:
            return y
        return y - np.repeat(dmin[:, None] * m.astype(np.float32), GROUP, axis=1)

    return dequantize


DEQUANTIZE = {t: _dequantize_blocks(t) for t in KQUANT_TYPES}


# ----------------------------------------------------------------------------------------------
# Q8_K activations (quantize_row_q8_K_ref): per 256 values iscale = -127/max (max: the value of
# largest magnitude), q = min(127, round-half-even(iscale*x)), d = 1/iscale, bsums per 16


def quantize_q8_k_ref(x: np.ndarray):
    """x (rows, k) float32 -> qs (rows, k) int8, d (rows, k/256) float32, bsums (rows, k/16) int32."""
    rows = x.shape[0]
    xb = np.asarray(x, np.float32).reshape(rows, -1, QK_K)
    pick = np.abs(xb).argmax(axis=2)  # first of the largest magnitudes, as ggml's strict '>'
    vmax = np.take_along_axis(xb, pick[..., None], axis=2)[..., 0]
    with np.errstate(divide="ignore"):
        iscale = np.where(vmax != 0, np.float32(-127) / vmax, np.float32(0)).astype(np.float32)
    q = np.minimum(np.rint(xb * iscale[..., None]), 127).astype(np.int8)
    with np.errstate(divide="ignore"):
        d = np.where(iscale != 0, np.float32(1) / iscale, np.float32(0)).astype(np.float32)
    bsums = q.reshape(rows, -1, GROUP).sum(axis=2, dtype=np.int32)
    return q.reshape(rows, -1), d, bsums


@numba.njit(inline="always", **JIT)
def quantize_q8_k_row(x, qs, d, bsums):
    """One row of quantize_q8_k_rows: x (k,) float32 -> qs (k,) int8, d (k/256,), bsums (k/16,)."""
    for b in range(x.shape[0] // QK_K):
        o = b * QK_K
        amax = np.float32(0)
        vmax = np.float32(0)
        for j in range(QK_K):
            ax = abs(x[o + j])
            if ax > amax:
                amax = ax
                vmax = x[o + j]
        if amax == 0:
            d[b] = 0
            for j in range(QK_K):
                qs[o + j] = 0
            for g in range(QK_K // GROUP):
                bsums[b * (QK_K // GROUP) + g] = 0
            continue
        iscale = np.float32(-127) / vmax
        for g in range(QK_K // GROUP):
            total = 0
            for j in range(o + g * GROUP, o + (g + 1) * GROUP):
                v = min(np.int32(127), np.int32(np.rint(iscale * x[j])))
                qs[j] = v
                total += v
            bsums[b * (QK_K // GROUP) + g] = total
        d[b] = np.float32(1) / iscale


@numba.njit(parallel=True, **JIT)
def quantize_q8_k_rows(x, qs, d, bsums):
    """Numba twin of quantize_q8_k_ref, writing into qs, d and bsums."""
    for r in numba.prange(x.shape[0]):
        quantize_q8_k_row(x[r], qs[r], d[r], bsums[r])


def quantize_activations(type_: GGMLType, x: np.ndarray):
    """f32 rows (rows, k) -> the weights' vec_dot format, unpacked: qs int8 (rows, k), d float32
    (rows, k/QB), bsums int32 (rows, k/16) (zeros for Q8_0, whose formats have no minimum)."""
    rows, k = x.shape
    qs = np.empty((rows, k), np.int8)
    if VEC_DOT_TYPE[type_] == T.Q8_0:
        d = np.empty((rows, k // 32), np.float32)
        quants.quantize_q8_rows(x, qs, d, d, False)
        return qs, d, np.zeros((rows, k // GROUP), np.int32)
    d = np.empty((rows, k // QK_K), np.float32)
    bsums = np.empty((rows, k // GROUP), np.int32)
    quantize_q8_k_rows(x, qs, d, bsums)
    return qs, d, bsums


def quantize_activations_ref(type_: GGMLType, x: np.ndarray):
    if VEC_DOT_TYPE[type_] == T.Q8_0:
        qs, d, _ = quants.quantize_q8_ref(x, False)
        return qs, d.reshape(x.shape[0], -1), np.zeros((x.shape[0], x.shape[1] // GROUP), np.int32)
    return quantize_q8_k_ref(x)


# ----------------------------------------------------------------------------------------------
# MUL_MAT: ggml-cpu takes one of three routes, and each rounds in its own order. The integer sums
# are exact everywhere; what differs is how they are grouped into float32 values:
#   TILED (Q2_K..Q6_K, IQ4_XS when src1 has >= 8 rows: ggml-cpu/tiled): per super-block the row
#     sums s1 = sum_g S_g <q, y>_g and s2 = sum_g M_g bsum_g, r = d*s1, r = fma(-dmin, s2, r), then
#     acc = fma(r, d_y, acc): one float per output;
#   VEC (fewer rows; IQ4_NL with one row: ggml_vec_dot_<w>_q8_K / _q8_0, x86 quants.c): 8 int32
#     lanes per block (lane l holds elements 4l..4l+3 of every 32-element chunk, times their
#     scale), fma'd with d_y*d into 8 float lanes, a per-type minimum term, hsum_float_8;
#   TINYBLAS (IQ4_NL with >= 2 rows: llamafile sgemm): the same lanes, one fma per block, hsum.
TILED, VEC, TINYBLAS = 0, 1, 2
TILED_MIN_ROWS = 8  # ggml_tiled_min_batch


def route(type_: GGMLType, ne11: int) -> int:
    """Which ggml-cpu code computes MUL_MAT of these weights with src1->ne[1] == ne11."""
    if type_ == T.IQ4_NL:
        return TINYBLAS if ne11 >= 2 else VEC
    return TILED if ne11 >= TILED_MIN_ROWS else VEC


def _hsum8_np(acc):
    t = acc[..., 4:] + acc[..., :4]
    return (t[..., 0] + t[..., 2]) + (t[..., 1] + t[..., 3])


def _pairs_np(v):
    """Sum neighbouring lanes of the last axis (what _mm256_madd_epi16 does to a product)."""
    return v[..., 0::2] + v[..., 1::2]


def dot_ref(type_: GGMLType, rows: np.ndarray, x: np.ndarray, ne11: int | None = None) -> np.ndarray:
    """rows (R, row_bytes) weights . x (C, K) f32 activations -> (R, C), in the float order of the
    route ggml-cpu takes for src1->ne[1] == ne11 (default C)."""

    how = route(type_, len(x) if ne11 is None else ne11)
    qb = FORMATS[type_][0]
    n_rows, n_cols, nb = len(rows), len(x), x.shape[1] // qb
    q, s, m, d, dmin = unpack_blocks(type_, rows.reshape(-1, TYPE_TRAITS[type_].type_size))
    d, dmin = d.reshape(n_rows, nb), dmin.reshape(n_rows, nb)
    yq, yd, bsums = quantize_activations_ref(type_, x)
    if how == VEC and type_ == T.Q6_K:
        q = q + 32  # ggml's VEC Q6_K dots the unsigned codes and subtracts 32 * S * bsum per lane
    chunks = qb // 32
    prods = np.einsum("rbclj,xbclj->rxbcl", q.reshape(n_rows, nb, chunks, 8, 4).astype(np.int64),
                      yq.reshape(n_cols, nb, chunks, 8, 4).astype(np.int64))  # (R, C, nb, chunk, lane)
    scale = s.reshape(n_rows, 1, nb, chunks, 2)[..., np.arange(8) // 4]  # lane l of chunk c: group 2c + l//4
    lanes = (prods * scale).sum(axis=3)  # (R, C, nb, 8)
    ys = bsums.reshape(1, n_cols, nb, -1).astype(np.int64)
    mins = None if m is None else m.reshape(n_rows, 1, nb, -1) * ys  # (R, C, nb, 16)
    f32 = np.float32
    if how == TILED:
        acc = np.zeros((n_rows, n_cols), f32)
        for b in range(nb):
            r = d[:, None, b] * lanes[:, :, b].sum(axis=-1).astype(f32)
            if mins is not None:
                r = np_fma(-dmin[:, None, b], mins[:, :, b].sum(axis=-1).astype(f32), r)
            acc = np_fma(r, yd[None, :, b], acc)
        return acc
    if type_ == T.Q6_K:
        lanes = lanes - 32 * _pairs_np(s.reshape(n_rows, 1, nb, -1) * ys)
    d_xy = yd[None, :, :] * d[:, None, :]  # float32 products, as ggml
    acc = np.zeros((n_rows, n_cols, 8), f32)
    if how == TINYBLAS:
        for b in range(nb):
            acc = np_fma(d_xy[..., b, None], lanes[:, :, b].astype(f32), acc)
        return _hsum8_np(acc)
    if type_ == T.IQ4_NL:  # two accumulators over block pairs, then a scalar odd block (an fma: see _make_iq4_nl_dot)
        acc2 = acc.copy()
        for b in range(0, nb - 1, 2):
            acc = np_fma(d_xy[..., b, None], lanes[:, :, b].astype(f32), acc)
            acc2 = np_fma(d_xy[..., b + 1, None], lanes[:, :, b + 1].astype(f32), acc2)
        total = _hsum8_np(acc + acc2)
        if nb % 2:
            total = np_fma(d_xy[..., nb - 1], lanes[:, :, nb - 1].sum(axis=-1).astype(f32), total)
        return total
    d_min = -yd[None, :, :] * dmin[:, None, :]
    acc_m = np.zeros((n_rows, n_cols, 4), f32)  # Q4_K's four minimum lanes
    summs = np.zeros((n_rows, n_cols), f32)  # Q5_K's scalar minimum sum
    for b in range(nb):
        if type_ == T.Q2_K:
            acc = np_fma(d_min[..., b, None], _pairs_np(mins[:, :, b]).astype(f32), acc)
        elif type_ == T.Q4_K:
            acc_m = np_fma(d_min[..., b, None], _pairs_np(_pairs_np(mins[:, :, b])).astype(f32), acc_m)
        elif type_ == T.Q5_K:
            summs = np_fma(d_min[..., b], mins[:, :, b].sum(axis=-1).astype(f32), summs)
        acc = np_fma(d_xy[..., b, None], lanes[:, :, b].astype(f32), acc)
    total = _hsum8_np(acc)
    if type_ == T.Q4_K:
        total = total + ((acc_m[..., 0] + acc_m[..., 2]) + (acc_m[..., 1] + acc_m[..., 3]))
    elif type_ == T.Q5_K:
        total = total + summs
    return total


# ----------------------------------------------------------------------------------------------
# numba: decode one row into the unpacked form, then dequantize it or dot it with activations

_f16_load = LOAD_WEIGHT[T.F16]
_KV = KVALUES_IQ4NL.astype(np.int32)


@numba.njit(inline="always", **JIT)
def _scale_min(j, mem, p):
    """get_scale_min_k4 on the 12 scale bytes at p."""
    if j < 4:
        return np.int32(mem[p + j] & 63), np.int32(mem[p + j + 4] & 63)
    sc = (mem[p + j + 4] & 0xF) | ((mem[p + j - 4] >> 6) << 4)
    mn = (mem[p + j + 4] >> 4) | ((mem[p + j] >> 6) << 4)
    return np.int32(sc), np.int32(mn)


@numba.njit(inline="always", **JIT)
def _decode_scales(kind, mem, p, s, m, g0):
    """The block at byte p: group scales/minimums into s[g0:], m[g0:]; returns (d, dmin)."""
    if kind == TYPE_Q4_K or kind == TYPE_Q5_K:  # Q4_K, Q5_K: six-bit scales and minimums per 32
        for i in range(8):
            sc, mn = _scale_min(i, mem, p + 4)
            s[g0 + 2 * i] = sc
            s[g0 + 2 * i + 1] = sc
            m[g0 + 2 * i] = mn
            m[g0 + 2 * i + 1] = mn
        return _f16_load(mem, p), _f16_load(mem, p + 2)
    if kind == TYPE_Q6_K:  # Q6_K: int8 scales per 16
        for g in range(16):
            s[g0 + g] = np.int32(np.int8(mem[p + 192 + g]))
            m[g0 + g] = 0
        return _f16_load(mem, p + 208), np.float32(0)
    if kind == TYPE_Q2_K:  # Q2_K: 4-bit scale and minimum per 16
        for g in range(16):
            sc = mem[p + g]
            s[g0 + g] = np.int32(sc & 0xF)
            m[g0 + g] = np.int32(sc >> 4)
        return _f16_load(mem, p + 80), _f16_load(mem, p + 82)
    if kind == TYPE_Q3_K:  # Q3_K: six-bit scales per 16, split over 12 bytes, offset by 32
        for k in range(16):
            low = (mem[p + 96 + k % 8] >> (4 * (k // 8))) & 0xF
            top = (mem[p + 96 + 8 + k % 4] >> (2 * (k // 4))) & 3
            s[g0 + k] = np.int32(low | (top << 4)) - 32
            m[g0 + k] = 0
        return _f16_load(mem, p + 108), np.float32(0)
    if kind == TYPE_IQ4_NL:  # IQ4_NL: 32 elements, one scale
        s[g0] = 1
        s[g0 + 1] = 1
        m[g0] = 0
        m[g0 + 1] = 0
        return _f16_load(mem, p), np.float32(0)
    high = np.int32(mem[p + 2]) | (np.int32(mem[p + 3]) << 8)  # IQ4_XS
    for ib in range(8):
        ls = ((np.int32(mem[p + 4 + ib // 2]) >> (4 * (ib % 2))) & 0xF) | (((high >> (2 * ib)) & 3) << 4)
        s[g0 + 2 * ib] = ls - 32
        s[g0 + 2 * ib + 1] = ls - 32
        m[g0 + 2 * ib] = 0
        m[g0 + 2 * ib + 1] = 0
    return _f16_load(mem, p), np.float32(0)


def _chunk_layout(type_: GGMLType, c: int):
    """Where the 32 quants of chunk c (elements 32c..32c+31) of a 256-block live, relative to the
    block: bytes at a shifted right by sa, masked with ma, OR'ed with ((bytes at b) >> sb) & mb
    shifted left by hs, minus bias. Q3_K's "subtract 4 unless the hmask bit is set" is
    (low | bit << 2) - 4. Every row keeps sa + bits(ma) <= 8, sb + bits(mb) <= 8, mb << hs < 256."""
    n, k = c // 4, c % 4
    return {
        T.Q2_K: (16 + 32 * n, 2 * k, 3, 0, 0, 0, 0, 0),
        T.Q3_K: (32 + 32 * n, 2 * k, 3, 0, 4 * n + k, 1, 2, 4),
        T.Q4_K: (16 + 32 * (c // 2), 4 * (c % 2), 15, 0, 0, 0, 0, 0),
        T.Q5_K: (48 + 32 * (c // 2), 4 * (c % 2), 15, 16, c, 1, 4, 0),
        T.Q6_K: (64 * n + 32 * (k & 1), 4 * (k >> 1), 15, 128 + 32 * n, 2 * k, 3, 4, 32),
    }[type_]


BIT_TYPES = (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)  # 2- to 6-bit fields; the IQ4s index a table
# _chunk_layout as one array for numba: [type number - TYPE_Q2_K, chunk] -> the 8 fields
assert [int(t) - TYPE_Q2_K for t in BIT_TYPES] == list(range(len(BIT_TYPES)))
_CHUNKS = np.array([[_chunk_layout(t, c) for c in range(8)] for t in BIT_TYPES], np.int64)


@numba.njit(**JIT)
def _decode_quants(kind, mem, p, q, e0):
    """The block at byte p: its integer quants into q[e0:] (what the vector chunk sums see)."""
    if kind == TYPE_IQ4_NL or kind == TYPE_IQ4_XS:  # IQ4: runs of 16 bytes, low nibbles then high, via the table
        base = p + 2 if kind == TYPE_IQ4_NL else p + 8
        for r in range((32 if kind == TYPE_IQ4_NL else QK_K) // 32):
            for l in range(16):
                byte = mem[base + 16 * r + l]
                q[e0 + 32 * r + l] = _KV[byte & 0xF]
                q[e0 + 32 * r + 16 + l] = _KV[byte >> 4]
        return
    for c in range(QK_K // 32):
        a, sa, ma, b, sb, mb, hs, bias = _CHUNKS[kind - TYPE_Q2_K, c]
        for l in range(32):
            v = ((np.int32(mem[p + a + l]) >> sa) & ma) | (((np.int32(mem[p + b + l]) >> sb) & mb) << hs)
            q[e0 + 32 * c + l] = v - bias


@numba.njit(**JIT)
def decode_row_scales(kind, mem, off, nblk, block_bytes, qb, s, m, d, dmin):
    for b in range(nblk):
        d[b], dmin[b] = _decode_scales(kind, mem, off + b * block_bytes, s, m, b * (qb // GROUP))


@numba.njit(**JIT)
def decode_row(kind, mem, off, nblk, block_bytes, qb, q, s, m, d, dmin):
    decode_row_scales(kind, mem, off, nblk, block_bytes, qb, s, m, d, dmin)
    for b in range(nblk):
        _decode_quants(kind, mem, off + b * block_bytes, q, b * qb)


@numba.njit(**JIT)
def dequantize_decoded(has_min, nblk, qb, q, s, m, d, dmin, out):
    """(d*S)*q - dmin*M in float32, ggml's order."""
    for b in range(nblk):
        for g in range(qb // GROUP):
            gi = b * (qb // GROUP) + g
            scale = d[b] * np.float32(s[gi])
            low = dmin[b] * np.float32(m[gi])
            for j in range(gi * GROUP, (gi + 1) * GROUP):
                v = scale * np.float32(q[j])
                out[j] = v - low if has_min else v
