"""ggml block formats: numpy dequantizers, the activation quantizers ggml-cpu uses before dot
products, and the per-row dot products of MUL_MAT as numba intrinsics that emit LLVM vector code
(plain numba loops do not vectorize these small fixed-width lane patterns).

Block matrices are (n_blocks, bytes_per_block) uint8 arrays. Arithmetic follows the x86 AVX2+FMA
build of ggml-cpu that the reference worker runs (ggml-cpu/arch/x86/quants.c): activations are
quantized with id = 127/amax and round-half-even; a block's 32 products are summed into 8 integer
lanes of 4 consecutive elements; each lane accumulates fma(d_w*d_y, lane, acc) over the blocks and
the 8 lanes are reduced as hsum_float_8. Mirroring that order makes our results bit-identical.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ..jit import JIT
from wire.ggml import TYPE_Q4_0, TYPE_Q4_1, TYPE_Q5_0, TYPE_Q5_1, GGMLType

from ..fmath import np_bf16_bits_to_f32, round_f16
from ..llvm import (FLOAT_ELEM, HAS_VNNI, PREFETCH_AHEAD, byte_ptr, dpbusd, elem_ptr, f32_t, half_t, hsum8,
                   i8_dot_lanes, i8_t, i32_t, i64_t, llvm_fn, prefetch, shuffle, splat, to_f32, vec)

QK = 32  # elements per block of every format here

# ----------------------------------------------------------------------------------------------
# numpy reference dequantizers: (n_blocks, type_size) uint8 -> (n_blocks, block_size) float32


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[:, at : at + 2].copy().view(np.float16).astype(np.float32)  # (n, 1)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 values: element j is the low nibble of byte j, element j+16 its high nibble."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.int32)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """4 bytes (little-endian u32) -> 32 values: bit e is the fifth bit of element e."""
    word = qh.copy().view("<u4").astype(np.int64)  # (n, 1)
    return ((word >> np.arange(QK)) & 1).astype(np.int32)


# (bytes per block, offset of d, of m or None, of qh or None, of qs, bias subtracted from quants)
_LAYOUT = {
    GGMLType.Q4_0: (18, 0, None, None, 2, 8),
    GGMLType.Q4_1: (20, 0, 2, None, 4, 0),
    GGMLType.Q5_0: (22, 0, None, 2, 6, 16),
    GGMLType.Q5_1: (24, 0, 2, 4, 8, 0),
    GGMLType.Q8_0: (34, 0, None, None, 2, 0),
}
QUANT_TYPES = tuple(_LAYOUT)
# the _1 formats carry a minimum m and are dotted with q8_1 activations (which carry s = d*sum)
HAS_MIN = {t: lay[2] is not None for t, lay in _LAYOUT.items()}


def unpack_blocks(type_: GGMLType, b: np.ndarray):
    """(n, type_size) uint8 -> integer quants (n, 32) int32, scale d (n,) and minimum m (n,) or None."""
    _, d_at, m_at, qh_at, qs_at, bias = _LAYOUT[type_]
    if type_ == GGMLType.Q8_0:
        q = b[:, qs_at : qs_at + QK].view(np.int8).astype(np.int32)
    else:
        q = _nibbles(b[:, qs_at : qs_at + QK // 2])
        if qh_at is not None:
            q |= _high_bits(b[:, qh_at : qh_at + 4]) << 4
    m = None if m_at is None else _f16(b, m_at)[:, 0]
    return q - bias, _f16(b, d_at)[:, 0], m


def _dequantize_blocks(type_):
    def dequantize(b):
        q, d, m = unpack_blocks(type_, b)
        y = q.astype(np.float32) * d[:, None]  # ggml: (float)q * d (+ m), float32 throughout
        return y if m is None else y + m[:, None]

    return dequantize


DEQUANTIZE = {
    GGMLType.F32: lambda b: b.copy().view("<f4"),
    GGMLType.F16: lambda b: b.copy().view("<f2").astype(np.float32),
    GGMLType.BF16: lambda b: np_bf16_bits_to_f32(b.copy().view("<u2")),
    **{t: _dequantize_blocks(t) for t in QUANT_TYPES},
}


# ----------------------------------------------------------------------------------------------
# activation quantizers (ggml-cpu quantize_row_q8_0 / quantize_row_q8_1, AVX2 flavour)
# kept unpacked: qs int8 (rows, k), d float32 (rows, k/32) holding fp16 values, s likewise for q8_1


def quantize_q8_ref(x: np.ndarray, with_sum: bool):
    """Reference: x (rows, k) float32 -> (qs, d, s); s = fp16(d * sum(qs)) is None unless with_sum."""
    xb = np.asarray(x, np.float32).reshape(x.shape[0], -1, QK)
    amax = np.abs(xb).max(axis=2)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv[:, :, None]).astype(np.int8)  # x*id in float32, round half to even
    s = None
    if with_sum:
        s = (d * q.sum(axis=2, dtype=np.int32).astype(np.float32)).astype(np.float16).astype(np.float32)
    return q.reshape(x.shape), d.astype(np.float16).astype(np.float32), s


def pack_q8(qs: np.ndarray, d: np.ndarray, s: np.ndarray | None = None) -> np.ndarray:
    """Unpacked activations -> ggml block bytes: (n_blocks, 34) for q8_0, (n_blocks, 36) for q8_1."""
    head = [d.reshape(-1, 1).astype(np.float16).view(np.uint8)]
    if s is not None:
        head.append(s.reshape(-1, 1).astype(np.float16).view(np.uint8))
    return np.concatenate(head + [qs.reshape(-1, QK).view(np.uint8)], axis=1)


# ----------------------------------------------------------------------------------------------
# LLVM helpers for numba: vector block dot products (scalar fma/fp16/bf16 helpers are in fmath.py)


def _decode_block(builder, load, typ, base, mask_bits=False):
    """The 32 weights of the block at byte `base` as <32 x i8> (ggml element order). mask_bits: the
    fifth bits of Q5_0/Q5_1 go through a 32-bit mask register (AVX512BW) instead of vector shifts."""
    size, _, _, qh_at, qs_at, bias = _LAYOUT[typ]
    at = lambda off: builder.add(base, ir.Constant(i64_t, off))  # noqa: E731
    if typ == GGMLType.Q8_0:
        return load(at(qs_at), vec(i8_t, 32))
    qs = load(at(qs_at), vec(i8_t, 16))
    lo = builder.and_(qs, ir.Constant(vec(i8_t, 16), [15] * 16))
    hi = builder.lshr(qs, ir.Constant(vec(i8_t, 16), [4] * 16))
    w = shuffle(builder, lo, hi, list(range(32)))
    if qh_at is not None and mask_bits:
        bits = builder.bitcast(load(at(qh_at), i32_t), vec(ir.IntType(1), 32))
        w = builder.or_(w, builder.select(bits, ir.Constant(vec(i8_t, 32), [16] * 32),
                                          ir.Constant(vec(i8_t, 32), [0] * 32)))
    elif qh_at is not None:
        bits = builder.lshr(splat(builder, load(at(qh_at), i32_t), 32), ir.Constant(vec(i32_t, 32), list(range(32))))
        bits = builder.trunc(builder.and_(bits, ir.Constant(vec(i32_t, 32), [1] * 32)), vec(i8_t, 32))
        w = builder.or_(w, builder.shl(bits, ir.Constant(vec(i8_t, 32), [4] * 32)))
    if bias:
        w = builder.sub(w, ir.Constant(vec(i8_t, 32), [bias] * 32))
    return w


def _vnni_lanes(builder, w, y, unsigned_w):
    """i8_dot_lanes as one 256-bit vpdpbusd (after the sign trick for signed weights): the same sums."""
    v32 = vec(i8_t, 32)
    if not unsigned_w:
        psign = llvm_fn(builder, "llvm.x86.avx2.psign.b", v32, [v32, v32])
        w, y = builder.call(psign, [w, w]), builder.call(psign, [y, w])
    v8 = vec(i32_t, 8)
    return dpbusd(builder, ir.Constant(v8, [0] * 8), builder.bitcast(w, v8), builder.bitcast(y, v8))


def _make_row_dot(typ: GGMLType, ncols: int, vnni: bool = False):
    """Intrinsic dot(w, woff, nb, yq, yd, ys, col) -> ncols floats: the weight row of nb blocks at
    byte woff of w against activation rows col..col+ncols-1 (yq int8 and yd/ys float32, flat,
    nb blocks per row), exactly as ggml_vec_dot_<typ>_q8_<0|1> on AVX2. vnni: the integer lanes by
    vpdpbusd and Q5's fifth bits by a mask register (the same values: integer sums)."""
    size, d_at, m_at, _, _, _ = _LAYOUT[typ]
    ret = types.UniTuple(types.float32, ncols)

    @intrinsic
    def row_dot(typingctx, w, woff, nb, yq, yd, ys, col):
        sig = ret(w, types.int64, types.int64, yq, yd, ys, types.int64)

        def codegen(context, builder, signature, args):
            w_, woff_, nb_, yq_, yd_, ys_, col_ = args
            wt, _, _, yqt, ydt, yst, _ = signature.args
            load = lambda off, ty: builder.load(byte_ptr(context, builder, wt, w_, off, ty), align=1)  # noqa: E731
            fma8 = llvm_fn(builder, "llvm.fma.v8f32", vec(f32_t, 8), [vec(f32_t, 8)] * 3)
            fma1 = llvm_fn(builder, "llvm.fma.f32", f32_t, [f32_t] * 3)
            accs = [cgutils.alloca_once_value(builder, ir.Constant(vec(f32_t, 8), [0.0] * 8)) for _ in range(ncols)]
            mins = [cgutils.alloca_once_value(builder, ir.Constant(f32_t, 0.0)) for _ in range(ncols)]
            with cgutils.for_range(builder, nb_) as loop:
                b = loop.index
                base = builder.add(woff_, builder.mul(b, ir.Constant(i64_t, size)))
                prefetch(builder, byte_ptr(context, builder, wt, w_, builder.add(base, ir.Constant(i64_t, PREFETCH_AHEAD)), i8_t))
                dx = builder.fpext(load(builder.add(base, ir.Constant(i64_t, d_at)), half_t), f32_t)
                wv = _decode_block(builder, load, typ, base, mask_bits=vnni)
                mx = None if m_at is None else builder.fpext(load(builder.add(base, ir.Constant(i64_t, m_at)), half_t), f32_t)
                for c in range(ncols):
                    blk = builder.add(builder.mul(builder.add(col_, ir.Constant(i64_t, c)), nb_), b)
                    yp = builder.bitcast(elem_ptr(context, builder, yqt, yq_, builder.mul(blk, ir.Constant(i64_t, QK))),
                                         vec(i8_t, 32).as_pointer())
                    dy = builder.load(elem_ptr(context, builder, ydt, yd_, blk))
                    dot = _vnni_lanes if vnni else i8_dot_lanes
                    lanes = builder.sitofp(dot(builder, wv, builder.load(yp, align=1), unsigned_w=m_at is not None),
                                           vec(f32_t, 8))
                    d = splat(builder, builder.fmul(dx, dy))
                    builder.store(builder.call(fma8, [d, lanes, builder.load(accs[c])]), accs[c])
                    if mx is not None:  # the _1 formats add m * s per block (compiled as an fma)
                        sy = builder.load(elem_ptr(context, builder, yst, ys_, blk))
                        builder.store(builder.call(fma1, [mx, sy, builder.load(mins[c])]), mins[c])
            out = []
            for c in range(ncols):
                total = hsum8(builder, builder.load(accs[c]))
                out.append(total if m_at is None else builder.fadd(total, builder.load(mins[c])))
            return context.make_tuple(builder, ret, out)

        return sig, codegen

    return row_dot


# one, two and four activation rows per weight row read (four is the register-blocked matrix case; two
# serve the small batches of a server's decode steps, which would otherwise decode each weight twice).
# The if-chains below are written out on purpose (measured 2026-11-26, SmolLM2's 576-wide Q4_1 rows):
# one intrinsic branching on the type in IR ran 3% slower, and callers that pick the width per weight row
# (one loop over 4, 2, 1) instead of one loop per width 40% slower.
ROW_DOT = {t: (_make_row_dot(t, 1), _make_row_dot(t, 2), _make_row_dot(t, 4)) for t in QUANT_TYPES}
(_q40_1, _q40_2, _q40_4), (_q41_1, _q41_2, _q41_4), (_q50_1, _q50_2, _q50_4), (_q51_1, _q51_2, _q51_4), \
    (_q80_1, _q80_2, _q80_4) = (ROW_DOT[t] for t in (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1,
                                                     GGMLType.Q8_0))


# eight activation rows per weight row read with vpdpbusd, for an AVX-512 target on an AVX512_VNNI host
# (quant_vnni); elsewhere these are the AVX2 lanes (never called by MUL_MAT, which takes row_dot4 there)
VNNI_COLS = 8
(_q40_8, _q41_8, _q50_8, _q51_8, _q80_8) = (_make_row_dot(t, VNNI_COLS, HAS_VNNI) for t in (
    GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0))


def quant_vnni(target) -> bool:
    """Whether MUL_MAT of the legacy quants reads eight activation rows per weight row with vpdpbusd:
    for a 16-lane (AVX-512) target on a host with AVX512_VNNI. The results are the same either way."""
    return HAS_VNNI and target.lanes == 16


@numba.njit(inline="always", **JIT)
def row_dot8(kind, w, off, nb, yq, yd, ys, col):
    """row_dot1 for activation rows col..col+7 at once: a tuple of eight."""
    if kind == TYPE_Q4_0:
        return _q40_8(w, off, nb, yq, yd, ys, col)
    if kind == TYPE_Q4_1:
        return _q41_8(w, off, nb, yq, yd, ys, col)
    if kind == TYPE_Q5_0:
        return _q50_8(w, off, nb, yq, yd, ys, col)
    if kind == TYPE_Q5_1:
        return _q51_8(w, off, nb, yq, yd, ys, col)
    return _q80_8(w, off, nb, yq, yd, ys, col)


@numba.njit(inline="always", **JIT)
def row_dot1(kind, w, off, nb, yq, yd, ys, col):
    """ggml_vec_dot_<kind>_q8_0/_q8_1 of the weight row at byte `off` of w (nb blocks of the legacy
    type id `kind`) with quantized activation row `col`."""
    if kind == TYPE_Q4_0:
        return _q40_1(w, off, nb, yq, yd, ys, col)[0]
    if kind == TYPE_Q4_1:
        return _q41_1(w, off, nb, yq, yd, ys, col)[0]
    if kind == TYPE_Q5_0:
        return _q50_1(w, off, nb, yq, yd, ys, col)[0]
    if kind == TYPE_Q5_1:
        return _q51_1(w, off, nb, yq, yd, ys, col)[0]
    return _q80_1(w, off, nb, yq, yd, ys, col)[0]


@numba.njit(inline="always", **JIT)
def row_dot2(kind, w, off, nb, yq, yd, ys, col):
    """row_dot1 for activation rows col and col+1 at once: a tuple of two."""
    if kind == TYPE_Q4_0:
        return _q40_2(w, off, nb, yq, yd, ys, col)
    if kind == TYPE_Q4_1:
        return _q41_2(w, off, nb, yq, yd, ys, col)
    if kind == TYPE_Q5_0:
        return _q50_2(w, off, nb, yq, yd, ys, col)
    if kind == TYPE_Q5_1:
        return _q51_2(w, off, nb, yq, yd, ys, col)
    return _q80_2(w, off, nb, yq, yd, ys, col)


@numba.njit(inline="always", **JIT)
def row_dot4(kind, w, off, nb, yq, yd, ys, col):
    """row_dot1 for activation rows col..col+3 at once: a tuple of four."""
    if kind == TYPE_Q4_0:
        return _q40_4(w, off, nb, yq, yd, ys, col)
    if kind == TYPE_Q4_1:
        return _q41_4(w, off, nb, yq, yd, ys, col)
    if kind == TYPE_Q5_0:
        return _q50_4(w, off, nb, yq, yd, ys, col)
    if kind == TYPE_Q5_1:
        return _q51_4(w, off, nb, yq, yd, ys, col)
    return _q80_4(w, off, nb, yq, yd, ys, col)


# ----------------------------------------------------------------------------------------------
# numba activation quantizer


@numba.njit(inline="always", **JIT)
def quantize_q8_row(x, qs, d, s, with_sum):
    """One row: x (k,) float32 -> qs (k,) int8, d (k/32,) float32 and, if with_sum, s (k/32,)."""
    for b in range(x.shape[0] // QK):
        o = b * QK
        amax = np.float32(0)
        for j in range(QK):
            amax = max(amax, abs(x[o + j]))
        dv = amax / np.float32(127)
        inv = np.float32(127) / amax if amax != 0 else np.float32(0)
        total = 0
        for j in range(QK):
            q = np.int8(np.rint(x[o + j] * inv))
            qs[o + j] = q
            total += q
        d[b] = round_f16(dv)
        if with_sum:
            s[b] = round_f16(dv * np.float32(total))


@numba.njit(parallel=True, **JIT)
def quantize_q8_rows(x, qs, d, s, with_sum):
    """x (rows, k) float32 -> qs (rows, k) int8, d (rows, k/32) float32 and, if with_sum, s."""
    for r in numba.prange(x.shape[0]):
        quantize_q8_row(x[r], qs[r], d[r], s[r], with_sum)


# ----------------------------------------------------------------------------------------------
# float weights (F32/F16/BF16): fma lanes of ggml_vec_dot_* and llamafile's tinyBLAS


def _make_load_weight(typ: GGMLType):
    """Intrinsic load(w, byte_offset) -> float32 of one F32/F16/BF16 weight."""
    _, elty = FLOAT_ELEM[typ]

    @intrinsic
    def load(typingctx, w, off):
        def codegen(context, builder, signature, args):
            v = builder.load(byte_ptr(context, builder, signature.args[0], args[0], args[1], elty), align=1)
            return to_f32(builder, v, typ, 1)

        return types.float32(w, types.int64), codegen

    return load


def _make_float_lanes(typ: GGMLType, ways: int):
    """Intrinsic lanes(w, woff, y, yoff, steps) -> 8 floats. ways=1 is tinyBLAS (one 8-wide fma
    accumulator, steps of 8); ways=4 is ggml_vec_dot (four accumulators, steps of 32) already reduced
    lane-wise as (a0 + a2) + (a1 + a3). w: weight bytes at woff; y: float32 activations at yoff."""
    esize, elty = FLOAT_ELEM[typ]
    ret = types.UniTuple(types.float32, 8)

    @intrinsic
    def lanes(typingctx, w, woff, y, yoff, steps):
        sig = ret(w, types.int64, y, types.int64, types.int64)

        def codegen(context, builder, signature, args):
            w_, woff_, y_, yoff_, steps_ = args
            wt, _, yt = signature.args[:3]
            v8 = vec(f32_t, 8)
            fma8 = llvm_fn(builder, "llvm.fma.v8f32", v8, [v8] * 3)
            accs = [cgutils.alloca_once_value(builder, ir.Constant(v8, [0.0] * 8)) for _ in range(ways)]
            with cgutils.for_range(builder, steps_) as loop:
                for a in range(ways):
                    k = builder.add(builder.mul(loop.index, ir.Constant(i64_t, 8 * ways)), ir.Constant(i64_t, 8 * a))
                    wp = byte_ptr(context, builder, wt, w_, builder.add(woff_, builder.mul(k, ir.Constant(i64_t, esize))),
                                   vec(elty, 8))
                    yp = builder.bitcast(elem_ptr(context, builder, yt, y_, builder.add(yoff_, k)), v8.as_pointer())
                    wv = to_f32(builder, builder.load(wp, align=1), typ, 8)
                    builder.store(builder.call(fma8, [wv, builder.load(yp, align=4), builder.load(accs[a])]), accs[a])
            v = [builder.load(a) for a in accs]
            if ways == 4:
                v = [builder.fadd(builder.fadd(v[0], v[2]), builder.fadd(v[1], v[3]))]
            return context.make_tuple(builder, ret, [builder.extract_element(v[0], ir.Constant(i32_t, i)) for i in range(8)])

        return sig, codegen

    return lanes


FLOAT_TYPES = tuple(FLOAT_ELEM)
LOAD_WEIGHT = {t: _make_load_weight(t) for t in FLOAT_TYPES}
FLOAT_LANES = {t: (_make_float_lanes(t, 1), _make_float_lanes(t, 4)) for t in FLOAT_TYPES}
