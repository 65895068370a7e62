"""Row quantizers for the KV-cache types: what ggml-cpu's `from_float` does when SET_ROWS or CPY
stores float rows into Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 or IQ4_NL (`-ctk q8_0 -ctv q4_0` and friends).

ggml-cpu's type_traits_cpu[t].from_float is its AVX2 quantize_row_q8_0 for Q8_0 (the same as the
activation quantizer in quants.py) and the scalar reference quantize_row_<t>_ref of ggml-quants.c
for the others. That file is compiled without FMA or vector flags, so its float math is plain float32
with every operation rounded; we mirror the operation order, the first-maximum tie breaking and C's
truncating float->int casts (cvttss2si, then the low byte).

Each type has a numpy reference over block matrices (n_blocks, 32) and a numba twin per block.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from ..jit import JIT, row_loop
from wire.ggml import TYPE_Q4_0, TYPE_Q4_1, TYPE_Q5_0, TYPE_Q5_1, TYPE_Q8_0, TYPE_TRAITS, GGMLType

from ..fmath import f32_to_f16
from .kquants import DEQUANTIZE as _DEQUANTIZE_SUPER, KVALUES_IQ4NL
from .quants import QK, pack_q8, quantize_q8_ref

F32 = np.float32

KV_QUANT_TYPES = (GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.IQ4_NL)
IQ4NL_VALUES = KVALUES_IQ4NL  # one grid for the weights' and the caches' IQ4_NL
GROUP_MAX_EPS = F32(1e-15)  # IQ4_NL leaves blocks below this magnitude at scale zero

# ---------------------------------------------------------------------------------------------
# C's float -> integer casts on x86


@numba.njit(inline="always", **JIT)
def trunc_i32(value):
    """C float->int32 on x86 (cvttss2si): truncate; NaN and out-of-range give INT32_MIN."""
    v = np.float32(value)
    if v >= np.float32(-2147483648.0) and v < np.float32(2147483648.0):
        return np.int32(v)
    return np.int32(-2147483648)


def np_trunc_i32(values: np.ndarray) -> np.ndarray:
    v = np.asarray(values, dtype=np.float32)
    ok = (v >= -2147483648.0) & (v < 2147483648.0)
    return np.where(ok, np.trunc(np.where(ok, v, 0)).astype(np.int64), -2147483648).astype(np.int32)


def _np_int8(values: np.ndarray) -> np.ndarray:
    """(int8_t)(float): the low byte of the truncated int32, as a signed value."""
    return np_trunc_i32(values).astype(np.int8).astype(np.int32)


# ---------------------------------------------------------------------------------------------
# numpy references: (n, 32) float32 blocks -> (n, type_size) uint8


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return np.asarray(v, F32).astype(np.float16).reshape(-1, 1).view(np.uint8)


def _first_max_abs(xb: np.ndarray):
    """ggml's `if (amax < fabsf(v)) { amax = fabsf(v); max = v; }` from zero: (amax, signed max)."""
    ax = np.abs(xb)
    at = np.argmax(ax, axis=1)[:, None]  # the first of equal maxima, as the strict `<` keeps
    amax = np.take_along_axis(ax, at, 1)[:, 0]
    return amax, np.where(amax > 0, np.take_along_axis(xb, at, 1)[:, 0], F32(0)).astype(F32)


def _min_max(xb: np.ndarray):
    """ggml's running min/max from FLT_MAX/-FLT_MAX with strict comparisons: first of equals."""
    mn = np.take_along_axis(xb, np.argmin(xb, axis=1)[:, None], 1)[:, 0]
    mx = np.take_along_axis(xb, np.argmax(xb, axis=1)[:, None], 1)[:, 0]
    return mn, mx


def _inverse(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d != 0, F32(1) / np.where(d != 0, d, F32(1)), F32(0)).astype(F32)


def _nibble_pairs(q: np.ndarray) -> np.ndarray:
    """(n, 32) codes -> 16 bytes: element j in the low nibble of byte j, element j+16 in the high."""
    return ((q[:, :16] & 0xFF) | ((q[:, 16:] << 4) & 0xFF)).astype(np.uint8)


def _low_nibble_pairs(q: np.ndarray) -> np.ndarray:
    return ((q[:, :16] & 0x0F) | ((q[:, 16:] & 0x0F) << 4)).astype(np.uint8)


def _high_bits_word(q: np.ndarray) -> np.ndarray:
    """The fifth bit of each of 32 codes, bit e of a little-endian u32."""
    bits = ((q & 0x10) >> 4).astype(np.uint64) << np.arange(QK, dtype=np.uint64)
    return bits.sum(axis=1).astype("<u4").reshape(-1, 1).view(np.uint8)


def _q4_0_ref(xb):
    _, mx = _first_max_abs(xb)
    d = (mx / F32(-8)).astype(F32)
    x0 = (xb * _inverse(d)[:, None]).astype(F32)
    q = np.minimum(15, _np_int8(x0 + F32(8.5)))
    return np.concatenate([_f16_bytes(d), _nibble_pairs(q)], axis=1)


def _q4_1_ref(xb):
    mn, mx = _min_max(xb)
    d = ((mx - mn) / F32(15)).astype(F32)
    x0 = ((xb - mn[:, None]) * _inverse(d)[:, None]).astype(F32)
    q = np.minimum(15, _np_int8(x0 + F32(0.5)))
    return np.concatenate([_f16_bytes(d), _f16_bytes(mn), _nibble_pairs(q)], axis=1)


def _q5_0_ref(xb):
    _, mx = _first_max_abs(xb)
    d = (mx / F32(-16)).astype(F32)
    x0 = (xb * _inverse(d)[:, None]).astype(F32)
    q = np.minimum(31, _np_int8(x0 + F32(16.5))) & 0xFF
    return np.concatenate([_f16_bytes(d), _high_bits_word(q), _low_nibble_pairs(q)], axis=1)


def _q5_1_ref(xb):
    mn, mx = _min_max(xb)
    d = ((mx - mn) / F32(31)).astype(F32)
    x0 = ((xb - mn[:, None]) * _inverse(d)[:, None]).astype(F32)
    q = np_trunc_i32(x0 + F32(0.5)) & 0xFF  # (uint8_t)(float), no clamp in ggml
    return np.concatenate([_f16_bytes(d), _f16_bytes(mn), _high_bits_word(q), _low_nibble_pairs(q)], axis=1)


def _q8_0_ref(xb):
    qs, d, _ = quantize_q8_ref(xb, with_sum=False)
    return pack_q8(qs, d)


def iq4nl_best_index_ref(x: np.ndarray) -> np.ndarray:
    """ggml's best_index_int8 over the IQ4_NL grid: the nearer neighbour, ties going up."""
    val = IQ4NL_VALUES.astype(F32)
    mu = np.clip(np.searchsorted(val, x, side="right"), 1, 15)
    lo, hi = val[mu - 1], val[mu]
    idx = np.where((x - lo).astype(F32) < (hi - x).astype(F32), mu - 1, mu)
    return np.where(x <= val[0], 0, np.where(x >= val[15], 15, idx))


def _iq4_nl_ref(xb):
    """quantize_row_iq4_nl_ref: no importance weights (weight = x*x) and ntry = -1, so one pass.

    A block below GROUP_MAX_EPS gets scale 0 and codes ggml leaves as whatever its stack held; we
    write zeros there (the values decode to 0 either way)."""
    amax, mx = _first_max_abs(xb)
    live = amax >= GROUP_MAX_EPS
    d0 = np.where(live, mx, F32(1)) / F32(-127)
    al = ((F32(1) / d0).astype(F32)[:, None] * xb).astype(F32)
    L = iq4nl_best_index_ref(al)
    q = IQ4NL_VALUES.astype(F32)[L]
    w = (xb * xb).astype(F32)
    sumqx = np.zeros(len(xb), F32)
    sumq2 = np.zeros(len(xb), F32)
    for j in range(QK):  # sequential float32 sums, as the C loop
        wq = (w[:, j] * q[:, j]).astype(F32)
        sumqx = (sumqx + (wq * xb[:, j]).astype(F32)).astype(F32)
        sumq2 = (sumq2 + (wq * q[:, j]).astype(F32)).astype(F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        d = np.where(sumq2 > 0, sumqx / sumq2, F32(0)).astype(F32)
    d = np.where(live, d, F32(0))
    L = np.where(live[:, None], L, 0)
    return np.concatenate([_f16_bytes(d), _nibble_pairs(L)], axis=1)


_REFERENCE = {
    GGMLType.Q8_0: _q8_0_ref, GGMLType.Q4_0: _q4_0_ref, GGMLType.Q4_1: _q4_1_ref,
    GGMLType.Q5_0: _q5_0_ref, GGMLType.Q5_1: _q5_1_ref, GGMLType.IQ4_NL: _iq4_nl_ref,
}


def quantize_rows_reference(type_: GGMLType, x: np.ndarray) -> np.ndarray:
    """(..., k) float32 -> (..., row_bytes) uint8: ggml-cpu's from_float for `type_`, row by row."""
    x = np.asarray(x, F32)
    tt = TYPE_TRAITS[type_]
    blocks = _REFERENCE[type_](x.reshape(-1, QK))
    return blocks.reshape(*x.shape[:-1], x.shape[-1] // QK * tt.type_size)


# (n, 18) uint8 IQ4_NL blocks -> (n, 32) float32: d * kvalues[code], the weights' dequantizer
dequantize_iq4_nl_reference = _DEQUANTIZE_SUPER[GGMLType.IQ4_NL]


# ---------------------------------------------------------------------------------------------
# numba: one block of 32 floats x[o:o+32] into the bytes out[b:b+type_size]



@numba.njit(inline="always", **JIT)
def _put_f16(out, b, v):
    h = f32_to_f16(v)
    out[b] = np.uint8(h & 0xFF)
    out[b + 1] = np.uint8(h >> 8)


@numba.njit(inline="always", **JIT)
def _put_u32(out, b, w):
    for i in range(4):
        out[b + i] = np.uint8((w >> (8 * i)) & 0xFF)


@numba.njit(inline="always", **JIT)
def _signed_max(x, o):
    amax = F32(0)
    mx = F32(0)
    for j in range(QK):
        a = abs(x[o + j])
        if amax < a:
            amax = a
            mx = x[o + j]
    return amax, mx


@numba.njit(inline="always", **JIT)
def _min_max_block(x, o):
    mn = F32(3.4028234663852886e38)
    mx = F32(-3.4028234663852886e38)
    for j in range(QK):
        v = x[o + j]
        if v < mn:
            mn = v
        if v > mx:
            mx = v
    return mn, mx


@numba.njit(inline="always", **JIT)
def _int8(v):
    return np.int32(np.int8(trunc_i32(v)))


@numba.njit(**JIT)
def _block_q8_0(x, o, out, b):
    """ggml-cpu's AVX2 quantize_row_q8_0: id = 127/amax, products rounded half to even."""
    amax = F32(0)
    for j in range(QK):
        amax = max(amax, abs(x[o + j]))
    _put_f16(out, b, amax / F32(127))
    inv = F32(127) / amax if amax != 0 else F32(0)
    for j in range(QK):
        out[b + 2 + j] = np.uint8(np.int8(np.rint(x[o + j] * inv)))


@numba.njit(**JIT)
def _block_q4(x, o, out, b, with_min):
    if with_min:
        mn, mx = _min_max_block(x, o)
        d = (mx - mn) / F32(15)
        bias, top, at = F32(0.5), 15, 4
    else:
        mn = F32(0)
        _, mx = _signed_max(x, o)
        d = mx / F32(-8)
        bias, top, at = F32(8.5), 15, 2
    inv = F32(1) / d if d != 0 else F32(0)
    _put_f16(out, b, d)
    if with_min:
        _put_f16(out, b + 2, mn)
    for j in range(16):
        v0 = (x[o + j] - mn) * inv if with_min else x[o + j] * inv
        v1 = (x[o + j + 16] - mn) * inv if with_min else x[o + j + 16] * inv
        q0 = min(top, _int8(v0 + bias)) & 0xFF
        q1 = min(top, _int8(v1 + bias)) & 0xFF
        out[b + at + j] = np.uint8((q0 | (q1 << 4)) & 0xFF)


@numba.njit(**JIT)
def _block_q5(x, o, out, b, with_min):
    if with_min:
        mn, mx = _min_max_block(x, o)
        d = (mx - mn) / F32(31)
        at = 8
    else:
        mn = F32(0)
        _, mx = _signed_max(x, o)
        d = mx / F32(-16)
        at = 6
    inv = F32(1) / d if d != 0 else F32(0)
    _put_f16(out, b, d)
    if with_min:
        _put_f16(out, b + 2, mn)
    qh = np.uint32(0)
    for j in range(16):
        if with_min:  # (uint8_t)(x0 + 0.5f): no clamp
            q0 = trunc_i32((x[o + j] - mn) * inv + F32(0.5)) & 0xFF
            q1 = trunc_i32((x[o + j + 16] - mn) * inv + F32(0.5)) & 0xFF
        else:
            q0 = min(31, _int8(x[o + j] * inv + F32(16.5))) & 0xFF
            q1 = min(31, _int8(x[o + j + 16] * inv + F32(16.5))) & 0xFF
        out[b + at + j] = np.uint8((q0 & 0x0F) | ((q1 & 0x0F) << 4))
        qh |= np.uint32((q0 & 0x10) >> 4) << np.uint32(j)
        qh |= np.uint32((q1 & 0x10) >> 4) << np.uint32(j + 16)
    _put_u32(out, b + at - 4, qh)


@numba.njit(inline="always", **JIT)
def _iq4nl_index(v, values):
    """ggml best_index_int8(16, kvalues_iq4nl, v)."""
    if v <= values[0]:
        return 0
    if v >= values[15]:
        return 15
    ml, mu = 0, 15
    while mu - ml > 1:
        mav = (ml + mu) // 2
        if v < values[mav]:
            mu = mav
        else:
            ml = mav
    return mu - 1 if v - values[mu - 1] < values[mu] - v else mu


@numba.njit(**JIT)
def _block_iq4_nl(x, o, out, b, values):
    amax, mx = _signed_max(x, o)
    L = np.zeros(QK, np.int32)  # ggml leaves stale codes for near-zero blocks: zeros here
    d = F32(0)
    if amax >= GROUP_MAX_EPS:
        inv = F32(1) / (mx / F32(-127))
        sumqx = F32(0)
        sumq2 = F32(0)
        for j in range(QK):
            xj = x[o + j]
            l = _iq4nl_index(inv * xj, values)
            L[j] = l
            q = values[l]
            wq = (xj * xj) * q
            sumqx += wq * xj
            sumq2 += wq * q
        d = sumqx / sumq2 if sumq2 > 0 else F32(0)
    _put_f16(out, b, d)
    for j in range(16):
        out[b + 2 + j] = np.uint8(L[j] | (L[j + 16] << 4))


@numba.njit(**JIT)
def _quantize_row(kind, x, r, out, values):
    nb = x.shape[1] // QK
    for blk in range(nb):
        o = blk * QK
        if kind == TYPE_Q8_0:
            _block_q8_0(x[r], o, out[r], blk * 34)
        elif kind == TYPE_Q4_0:
            _block_q4(x[r], o, out[r], blk * 18, False)
        elif kind == TYPE_Q4_1:
            _block_q4(x[r], o, out[r], blk * 20, True)
        elif kind == TYPE_Q5_0:
            _block_q5(x[r], o, out[r], blk * 22, False)
        elif kind == TYPE_Q5_1:
            _block_q5(x[r], o, out[r], blk * 24, True)
        else:
            _block_iq4_nl(x[r], o, out[r], blk * 18, values)


@row_loop
def _quantize_rows(kind, x, out, values):
    for r in prange(x.shape[0]):
        _quantize_row(kind, x, np.int64(r), out, values)


def quantize_rows(type_: GGMLType, x: np.ndarray, parallel: bool = False) -> np.ndarray:
    """numba twin of quantize_rows_reference: (..., k) float32 -> (..., row_bytes) uint8."""
    x = np.ascontiguousarray(x, F32)
    flat = x.reshape(-1, x.shape[-1]) if x.size else x.reshape(0, x.shape[-1])
    out = np.empty((flat.shape[0], flat.shape[1] // QK * TYPE_TRAITS[type_].type_size), np.uint8)
    if type_ not in KV_QUANT_TYPES:
        raise KeyError(type_)
    if flat.shape[0]:
        _quantize_rows(int(type_), flat, out, IQ4NL_VALUES.astype(F32), parallel)
    return out.reshape(*x.shape[:-1], out.shape[-1])
