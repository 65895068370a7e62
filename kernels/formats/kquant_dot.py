"""K-quant and IQ4 dot products for MUL_MAT as numba/LLVM vector code, and the MUL_MAT driver over
ggml-cpu's three routes (kernels.formats.kquants.route): tiled super-block sums, ggml_vec_dot_<w>_q8_K lanes,
and llamafile's tinyBLAS for IQ4_NL. The formats, their decoders, the Q8_K activation quantizer and the
numpy twin of all this (`dot_ref`) are in kernels/formats/kquants.py.
"""

from __future__ import annotations

from functools import partial

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from wire.ggml import TYPE_IQ4_NL, TYPE_Q2_K, TYPE_Q3_K, TYPE_Q4_K, TYPE_Q5_K, TYPE_Q6_K, TYPE_TRAITS, GGMLType
from ..jit import JIT
from .kquant_lanes import (Args, block_lanes, block_scales, chunk_quants, column_sums, column_vector, f32_t, fma_fn,
                           i64c, iq4_quants, isum, pairs, product_pairs, scaled_lanes, spreader, unsigned_quants,
                           weighted_bsums)
from . import quants
from .kquant_vnni import HAS_VNNI, quantize_block_major, vnni_tile
from .kquants import BIT_TYPES, GROUP, HAS_MIN, QK_K, TILED, TINYBLAS, VEC, quantize_q8_k_row, route
from ..llvm import PREFETCH_AHEAD, byte_ptr, hsum8, i8_dot_lanes, i8_t, i32_t, prefetch, splat, vec
from ..target import AVX2, Target
from ..tasks import QUANTIZE_PARALLEL_ROWS, ROWS_PER_TASK, task_tile

T = GGMLType

TILE_COLS = 8  # activation rows the TILED route dots with one decoded weight block


def _make_tiled_dot(type_: GGMLType, ncol: int):
    """Intrinsic dot(w, off, nblk, yq, yd, ybs, col) -> ncol float32: the TILED route for the weight row
    at byte off and activation rows col..col+ncol-1. Per block and row s1 = sum_g S_g <q, y>_g and
    s2 = sum_g M_g bsum_g, r = d*s1, r = fma(-dmin, s2, r), acc = fma(r, d_y, acc); the block's
    quants and scales are decoded once for all ncol activation rows."""
    size = TYPE_TRAITS[type_].type_size
    ret = types.UniTuple(types.float32, ncol)

    @intrinsic
    def tiled(typingctx, w, off, nblk, yq, yd, ybs, col):
        sig = ret(w, types.int64, types.int64, yq, yd, ybs, types.int64)

        def codegen(context, builder, signature, args):
            a = Args(context, builder, signature, args)
            off_, nb_, col_ = args[1], args[2], args[6]
            fma = fma_fn(builder, ncol)
            acc = cgutils.alloca_once_value(builder, column_vector(builder, [ir.Constant(f32_t, 0.0)] * ncol))
            with cgutils.for_range(builder, nb_) as loop:
                b = loop.index
                p = builder.add(off_, builder.mul(b, i64c(size)))
                prefetch(builder, byte_ptr(context, builder, a.types[0], a.values[0],
                                           builder.add(p, i64c(PREFETCH_AHEAD)), i8_t))
                at = lambda o, ty: a.bytes_at(0, builder.add(p, i64c(o)), ty)  # noqa: E731
                scales, mins, d, dmin = block_scales(builder, type_, at)
                ybk = [builder.add(builder.mul(builder.add(col_, i64c(j)), nb_), b) for j in range(ncol)]
                lanes = [ir.Constant(vec(i32_t, 8), [0] * 8)] * ncol
                spread = spreader(builder, scales)
                for c in range(QK_K // 32):
                    q = chunk_quants(builder, at, type_, c)
                    sc = spread(c)
                    for j in range(ncol):
                        y = a.y32(3, builder.add(builder.mul(ybk[j], i64c(QK_K)), i64c(32 * c)))
                        lanes[j] = builder.add(lanes[j], scaled_lanes(builder, q, y, sc, unsigned_quants(type_)))
                to_f32 = lambda v: builder.sitofp(v, f32_t if ncol == 1 else vec(f32_t, ncol))  # noqa: E731
                wide = lambda x: x if ncol == 1 else splat(builder, x, ncol)  # noqa: E731
                r = builder.fmul(wide(d), to_f32(column_sums(builder, lanes)))
                if HAS_MIN[type_]:
                    prods = [weighted_bsums(builder, type_, mins, a.ivec(5, builder.mul(yb, i64c(16)), 16))
                             for yb in ybk]
                    r = builder.call(fma, [wide(builder.fsub(ir.Constant(f32_t, -0.0), dmin)),
                                           to_f32(column_sums(builder, prods)), r])
                d_y = column_vector(builder, [a.elem(4, yb) for yb in ybk])
                builder.store(builder.call(fma, [r, d_y, builder.load(acc)]), acc)
            total = builder.load(acc)
            outs = [total] if ncol == 1 else [builder.extract_element(total, ir.Constant(i32_t, j))
                                              for j in range(ncol)]
            return context.make_tuple(builder, ret, outs)

        return sig, codegen

    return tiled


def _vec_dots(context, builder, a, type_, row, nblk, cols, yi=(3, 4, 5)):
    """The weight row at byte `row` . each activation row in cols (i64 values) as
    ggml_vec_dot_<type>_q8_K computes it: per block the scales decoded in registers, 8 float lanes
    acc = fma(d_y*d, lanes, acc) and the minimum term each format folds in its own way. The weight
    blocks are decoded once for all cols; yi: the argument numbers of yq (int8), yd (float32 per
    block) and ybs (int32 per 16), all flat. Returns one float32 per col."""
    size = TYPE_TRAITS[type_].type_size
    iq, idy, ibs = yi
    fma8, fma4, fma1 = fma_fn(builder, 8), fma_fn(builder, 4), fma_fn(builder, 1)
    zero = lambda n: ir.Constant(vec(f32_t, n), [0.0] * n) if n > 1 else ir.Constant(f32_t, 0.0)  # noqa: E731
    accs = []  # per col: 8 lanes, Q4_K's minimum terms in 4 lanes, Q5_K's in one scalar
    for _ in cols:
        slots = [cgutils.alloca_once(builder, zero(n).type) for n in (8, 4, 1)]
        for slot, n in zip(slots, (8, 4, 1)):
            builder.store(zero(n), slot)  # here, not in the entry block: callers may loop over rows
        accs.append(slots)
    with cgutils.for_range(builder, nblk) as loop:
        b = loop.index
        p = builder.add(row, builder.mul(b, i64c(size)))
        prefetch(builder, byte_ptr(context, builder, a.types[0], a.values[0], builder.add(p, i64c(PREFETCH_AHEAD)),
                                   i8_t))
        at = lambda o, ty: a.bytes_at(0, builder.add(p, i64c(o)), ty)  # noqa: E731
        scales, mins, d, dmin = block_scales(builder, type_, at)
        ybs = [builder.add(builder.mul(col, nblk), b) for col in cols]
        loaders = [lambda e, y0=builder.mul(yb, i64c(QK_K)): a.y32(iq, builder.add(y0, i64c(e))) for yb in ybs]
        all_lanes = block_lanes(builder, type_, at, loaders, scales, signed=type_ != T.Q6_K)
        for yb, lanes, (acc, acc_m, summs) in zip(ybs, all_lanes, accs):
            dy = a.elem(idy, yb)
            bsums = a.ivec(ibs, builder.mul(yb, i64c(16)), 16)
            if type_ == T.Q6_K:  # the unsigned codes' excess: 32 * S * bsum, paired per lane
                excess = product_pairs(builder, scales, bsums)
                lanes = builder.sub(lanes, builder.shl(excess, ir.Constant(vec(i32_t, 8), [5] * 8)))
            if HAS_MIN[type_]:
                d_min = builder.fmul(builder.fsub(ir.Constant(f32_t, -0.0), dy), dmin)
                m = weighted_bsums(builder, type_, mins, bsums)
                if type_ == T.Q2_K:
                    builder.store(builder.call(fma8, [splat(builder, d_min), builder.sitofp(m, vec(f32_t, 8)),
                                                      builder.load(acc)]), acc)
                elif type_ == T.Q4_K:
                    builder.store(builder.call(fma4, [splat(builder, d_min, 4), builder.sitofp(
                        pairs(builder, m), vec(f32_t, 4)), builder.load(acc_m)]), acc_m)
                else:  # Q5_K
                    builder.store(builder.call(fma1, [d_min, builder.sitofp(isum(builder, m), f32_t),
                                                      builder.load(summs)]), summs)
            d_xy = splat(builder, builder.fmul(dy, d))
            builder.store(builder.call(fma8, [d_xy, builder.sitofp(lanes, vec(f32_t, 8)), builder.load(acc)]), acc)
    totals = []
    for acc, acc_m, summs in accs:
        total = hsum8(builder, builder.load(acc))
        if type_ == T.Q4_K:
            v = builder.load(acc_m)
            e = [builder.extract_element(v, ir.Constant(i32_t, i)) for i in range(4)]
            total = builder.fadd(total, builder.fadd(builder.fadd(e[0], e[2]), builder.fadd(e[1], e[3])))
        elif type_ == T.Q5_K:
            total = builder.fadd(total, builder.load(summs))
        totals.append(total)
    return totals


def _make_vec_dot(type_: GGMLType):
    """Intrinsic dot(w, off, nblk, yq, yd, ybs, col) -> float32: the weight row at byte off . activation
    row col (yq int8, yd float32 per block, ybs int32 per 16, all flat), as ggml_vec_dot_<type>_q8_K."""

    @intrinsic
    def vec_dot(typingctx, w, off, nblk, yq, yd, ybs, col):
        sig = types.float32(w, types.int64, types.int64, yq, yd, ybs, types.int64)

        def codegen(context, builder, signature, args):
            a = Args(context, builder, signature, args)
            return _vec_dots(context, builder, a, type_, args[1], args[2], [args[6]])[0]

        return sig, codegen

    return vec_dot


def _make_vec_rows(type_: GGMLType, ncol: int):
    """Intrinsic rows(w, off, nb01, nrows, nblk, yq, yd, ybs, col, out, i13, i12, i11, i01) -> 0: weight
    rows off, off + nb01, ... (nrows of them) each dotted with activation rows col..col+ncol-1 as
    ggml_vec_dot_<type>_q8_K, the row's blocks decoded once for the ncol dots; the dot of weight row r
    and activation row col + j goes to out[i13, i12, i11 + j, i01 + r] (out float32, any strides).
    A decode step's whole task runs in one call: no per-row dispatch in the driver."""

    @intrinsic
    def rows(typingctx, w, off, nb01, nrows, nblk, yq, yd, ybs, col, out, i13, i12, i11, i01):
        sig = types.int64(w, types.int64, types.int64, types.int64, types.int64, yq, yd, ybs, types.int64, out,
                          types.int64, types.int64, types.int64, types.int64)

        def codegen(context, builder, signature, args):
            a = Args(context, builder, signature, args)
            off_, nb01_, nrows_, nblk_, col_ = args[1], args[2], args[3], args[4], args[8]
            ary = context.make_array(signature.args[9])(context, builder, args[9])
            strides = cgutils.unpack_tuple(builder, ary.strides, 4)
            base = builder.bitcast(ary.data, i8_t.as_pointer())
            first = builder.add(builder.add(builder.mul(args[10], strides[0]), builder.mul(args[11], strides[1])),
                                builder.mul(args[12], strides[2]))
            cols = [builder.add(col_, i64c(j)) for j in range(ncol)]
            with cgutils.for_range(builder, nrows_) as loop:
                r = loop.index
                totals = _vec_dots(context, builder, a, type_, builder.add(off_, builder.mul(r, nb01_)), nblk_, cols,
                                   yi=(5, 6, 7))
                at_row = builder.add(first, builder.mul(builder.add(args[13], r), strides[3]))
                for j, total in enumerate(totals):
                    o = builder.add(at_row, builder.mul(i64c(j), strides[2]))
                    builder.store(total, builder.bitcast(builder.gep(base, [o]), f32_t.as_pointer()))
            return i64c(0)

        return sig, codegen

    return rows


def _make_iq4_nl_dot(tinyblas: bool):
    """Intrinsic dot(w, off, nblk, yq, yd, col) -> float32 for an IQ4_NL row: tinyBLAS keeps one
    accumulator; ggml_vec_dot_iq4_nl_q8_0 alternates two over block pairs, adds them before
    hsum_float_8, then adds an odd last block as a scalar: sumf += d*sumi, which gcc contracts into an
    fma in the AVX2 build (in a native AVX-512 build it does not)."""

    @intrinsic
    def dot(typingctx, w, off, nblk, yq, yd, col):
        sig = types.float32(w, types.int64, types.int64, yq, yd, types.int64)

        def codegen(context, builder, signature, args):
            a = Args(context, builder, signature, args)
            off_, nb_, col_ = args[1], args[2], args[5]
            fma8 = fma_fn(builder, 8)

            def block(b):
                p = builder.add(off_, builder.mul(b, i64c(18)))
                yb = builder.add(builder.mul(col_, nb_), b)
                q = iq4_quants(builder, a.bytes_at(0, builder.add(p, i64c(2)), vec(i8_t, 16)))
                lanes = i8_dot_lanes(builder, q, a.y32(3, builder.mul(yb, i64c(32))))
                return lanes, builder.fmul(a.elem(4, yb), builder.fpext(a.bytes_at(0, p, ir.HalfType()), f32_t))

            def step(acc, b):
                lanes, d = block(b)
                builder.store(builder.call(fma8, [splat(builder, d), builder.sitofp(lanes, vec(f32_t, 8)),
                                                  builder.load(acc)]), acc)

            zero = ir.Constant(vec(f32_t, 8), [0.0] * 8)
            acc, acc2 = cgutils.alloca_once_value(builder, zero), cgutils.alloca_once_value(builder, zero)
            if tinyblas:
                with cgutils.for_range(builder, nb_) as loop:
                    step(acc, loop.index)
                return hsum8(builder, builder.load(acc))
            with cgutils.for_range(builder, builder.ashr(nb_, i64c(1))) as loop:
                b = builder.mul(loop.index, i64c(2))
                step(acc, b)
                step(acc2, builder.add(b, i64c(1)))
            total = hsum8(builder, builder.fadd(builder.load(acc), builder.load(acc2)))
            lanes, d = block(builder.sub(nb_, i64c(1)))  # always a valid block; used only if nb is odd
            tail = builder.call(fma_fn(builder, 1), [d, builder.sitofp(isum(builder, lanes), f32_t), total])
            odd = builder.icmp_signed("!=", builder.and_(nb_, i64c(1)), i64c(0))
            return builder.select(odd, tail, total)

        return sig, codegen

    return dot


_q2k_tiled, _q3k_tiled, _q4k_tiled, _q5k_tiled, _q6k_tiled, _iq4xs_tiled = (
    _make_tiled_dot(t, 1) for t in BIT_TYPES + (T.IQ4_XS,))
_q2k_tiles, _q3k_tiles, _q4k_tiles, _q5k_tiles, _q6k_tiles, _iq4xs_tiles = (
    _make_tiled_dot(t, TILE_COLS) for t in BIT_TYPES + (T.IQ4_XS,))
_q2k_vec, _q3k_vec, _q4k_vec, _q5k_vec, _q6k_vec, _iq4xs_vec = (_make_vec_dot(t) for t in BIT_TYPES + (T.IQ4_XS,))
# a decode step's few activation rows, in runs of VEC_COLS[0], then VEC_COLS[1], ... (fewer than 8: the
# VEC route's), each weight row's blocks decoded once per run
VEC_COLS = (4, 2, 1)
_q2k_rows4, _q3k_rows4, _q4k_rows4, _q5k_rows4, _q6k_rows4, _iq4xs_rows4 = (
    _make_vec_rows(t, 4) for t in BIT_TYPES + (T.IQ4_XS,))
_q2k_rows2, _q3k_rows2, _q4k_rows2, _q5k_rows2, _q6k_rows2, _iq4xs_rows2 = (
    _make_vec_rows(t, 2) for t in BIT_TYPES + (T.IQ4_XS,))
_q2k_rows1, _q3k_rows1, _q4k_rows1, _q5k_rows1, _q6k_rows1, _iq4xs_rows1 = (
    _make_vec_rows(t, 1) for t in BIT_TYPES + (T.IQ4_XS,))
_iq4nl_vec, _iq4nl_tiny = _make_iq4_nl_dot(False), _make_iq4_nl_dot(True)
iq4_nl_vec_dot = _iq4nl_vec  # ggml_vec_dot_iq4_nl_q8_0: also FLASH_ATTN_EXT's K.Q for an IQ4_NL K cache


@numba.njit(inline="always", **JIT)
def tiled_dot(kind, w, off, nblk, yq, yd, ybs, col):
    if kind == TYPE_Q2_K:
        return _q2k_tiled(w, off, nblk, yq, yd, ybs, col)
    if kind == TYPE_Q3_K:
        return _q3k_tiled(w, off, nblk, yq, yd, ybs, col)
    if kind == TYPE_Q4_K:
        return _q4k_tiled(w, off, nblk, yq, yd, ybs, col)
    if kind == TYPE_Q5_K:
        return _q5k_tiled(w, off, nblk, yq, yd, ybs, col)
    if kind == TYPE_Q6_K:
        return _q6k_tiled(w, off, nblk, yq, yd, ybs, col)
    return _iq4xs_tiled(w, off, nblk, yq, yd, ybs, col)


@numba.njit(inline="always", **JIT)
def tiled_dots(kind, w, off, nblk, yq, yd, ybs, col):
    if kind == TYPE_Q2_K:
        return _q2k_tiles(w, off, nblk, yq, yd, ybs, col)
    if kind == TYPE_Q3_K:
        return _q3k_tiles(w, off, nblk, yq, yd, ybs, col)
    if kind == TYPE_Q4_K:
        return _q4k_tiles(w, off, nblk, yq, yd, ybs, col)
    if kind == TYPE_Q5_K:
        return _q5k_tiles(w, off, nblk, yq, yd, ybs, col)
    if kind == TYPE_Q6_K:
        return _q6k_tiles(w, off, nblk, yq, yd, ybs, col)
    return _iq4xs_tiles(w, off, nblk, yq, yd, ybs, col)


@numba.njit(inline="always", **JIT)
def vec_dot(kind, w, off, nblk, yq, yd, ybs, col):
    if kind == TYPE_Q2_K:
        return _q2k_vec(w, off, nblk, yq, yd, ybs, col)
    if kind == TYPE_Q3_K:
        return _q3k_vec(w, off, nblk, yq, yd, ybs, col)
    if kind == TYPE_Q4_K:
        return _q4k_vec(w, off, nblk, yq, yd, ybs, col)
    if kind == TYPE_Q5_K:
        return _q5k_vec(w, off, nblk, yq, yd, ybs, col)
    if kind == TYPE_Q6_K:
        return _q6k_vec(w, off, nblk, yq, yd, ybs, col)
    return _iq4xs_vec(w, off, nblk, yq, yd, ybs, col)


@numba.njit(**JIT)
def vec_rows(kind, ncol, w, off, nb01, nrows, nblk, yq, yd, ybs, col, out, i13, i12, i11, i01):
    """The intrinsic rows() of _make_vec_rows for weights `kind` and ncol (one of VEC_COLS) activation
    rows; a function of its own (not inlined) so that the driver's loop is no bigger for it."""
    if ncol == 4:
        if kind == TYPE_Q2_K:
            return _q2k_rows4(w, off, nb01, nrows, nblk, yq, yd, ybs, col, out, i13, i12, i11, i01)
        if kind == TYPE_Q3_K:
            return _q3k_rows4(w, off, nb01, nrows, nblk, yq, yd, ybs, col, out, i13, i12, i11, i01)
        if kind == TYPE_Q4_K:
            return _q4k_rows4(w, off, nb01, nrows, nblk, yq, yd, ybs, col, out, i13, i12, i11, i01)
        if kind == TYPE_Q5_K:
            return _q5k_rows4(w, off, nb01, nrows, nblk, yq, yd, ybs, col, out, i13, i12, i11, i01)
        if kind == TYPE_Q6_K:
            return _q6k_rows4(w, off, nb01, nrows, nblk, yq, yd, ybs, col, out, i13, i12, i11, i01)
        return _iq4xs_rows4(w, off, nb01, nrows, nblk, yq, yd, ybs, col, out, i13, i12, i11, i01)
    if ncol == 2:
        if kind == TYPE_Q2_K:
            return _q2k_rows2(w, off, nb01, nrows, nblk, yq, yd, ybs, col, out, i13, i12, i11, i01)
        if kind == TYPE_Q3_K:
            return _q3k_rows2(w, off, nb01, nrows, nblk, yq, yd, ybs, col, out, i13, i12, i11, i01)
        if kind == TYPE_Q4_K:
            return _q4k_rows2(w, off, nb01, nrows, nblk, yq, yd, ybs, col, out, i13, i12, i11, i01)
        if kind == TYPE_Q5_K:
            return _q5k_rows2(w, off, nb01, nrows, nblk, yq, yd, ybs, col, out, i13, i12, i11, i01)
        if kind == TYPE_Q6_K:
            return _q6k_rows2(w, off, nb01, nrows, nblk, yq, yd, ybs, col, out, i13, i12, i11, i01)
        return _iq4xs_rows2(w, off, nb01, nrows, nblk, yq, yd, ybs, col, out, i13, i12, i11, i01)
    if kind == TYPE_Q2_K:
        return _q2k_rows1(w, off, nb01, nrows, nblk, yq, yd, ybs, col, out, i13, i12, i11, i01)
    if kind == TYPE_Q3_K:
        return _q3k_rows1(w, off, nb01, nrows, nblk, yq, yd, ybs, col, out, i13, i12, i11, i01)
    if kind == TYPE_Q4_K:
        return _q4k_rows1(w, off, nb01, nrows, nblk, yq, yd, ybs, col, out, i13, i12, i11, i01)
    if kind == TYPE_Q5_K:
        return _q5k_rows1(w, off, nb01, nrows, nblk, yq, yd, ybs, col, out, i13, i12, i11, i01)
    if kind == TYPE_Q6_K:
        return _q6k_rows1(w, off, nb01, nrows, nblk, yq, yd, ybs, col, out, i13, i12, i11, i01)
    return _iq4xs_rows1(w, off, nb01, nrows, nblk, yq, yd, ybs, col, out, i13, i12, i11, i01)


@numba.njit(inline="always", **JIT)
def _quantize_row(kind, x, r, yq, yd, ybs, block_major):
    """Flat activation row r of x (ne13, ne12, ne11, K) into its slice of the flat scratch, in the
    weights' vec_dot format: q8_0 for IQ4_NL, q8_K (with its 16-element sums) for the others; the
    VNNI tiles' scratch is block-major."""
    ne11, ne12, k = x.shape[2], x.shape[1], x.shape[3]
    row = x[r // (ne11 * ne12), (r // ne11) % ne12, r % ne11]
    if block_major:
        quantize_block_major(row, r, x.shape[0] * ne12 * ne11, yq, yd, ybs)
    elif kind == TYPE_IQ4_NL:
        nblk = k // quants.QK
        quants.quantize_q8_row(row, yq[r * k:(r + 1) * k], yd[r * nblk:(r + 1) * nblk], yd[r * nblk:(r + 1) * nblk],
                               False)
    else:
        nblk, ngroups = k // QK_K, k // GROUP
        quantize_q8_k_row(row, yq[r * k:(r + 1) * k], yd[r * nblk:(r + 1) * nblk], ybs[r * ngroups:(r + 1) * ngroups])


@numba.njit(parallel=True, **JIT)
def _mul_mat_kquant(kind, how, vnni, nb01, nb02, nb03, ne01, ne02, ne03, nblk, w, off, x, yq, yd, ybs, out):
    """Like _mul_mat_quant: the activations x (ne13, ne12, ne11, K) are quantized into the flat scratch
    first (a decode step's single row without waking the other threads), then a task's weight rows meet
    every activation row while they are hot, in tiles of TILE_COLS activation rows on the TILED route
    and in one vec_rows call per run of VEC_COLS on the VEC one; `how` is the route, `vnni` says the
    TILED route takes kernels.formats.kquant_vnni."""
    ne13, ne12, ne11 = out.shape[0], out.shape[1], out.shape[2]
    n_rows = ne13 * ne12 * ne11
    vnni = vnni and how == TILED
    if n_rows >= QUANTIZE_PARALLEL_ROWS:
        for r in numba.prange(n_rows):
            _quantize_row(kind, x, r, yq, yd, ybs, vnni)
    else:
        for r in range(n_rows):
            _quantize_row(kind, x, r, yq, yd, ybs, vnni)
    for task in numba.prange(ne13 * ne12 * ((ne01 + ROWS_PER_TASK - 1) // ROWS_PER_TASK)):
        i12, i13, base, col0, lo, hi = task_tile(task, ne01, ne02, ne03, ne11, ne12, ne13, off, nb02, nb03)
        if vnni:
            acc = np.zeros(ne11 * ROWS_PER_TASK, np.float32)
            vnni_tile(kind, w, base + lo * nb01, nb01, hi - lo, nblk, yq, yd, ybs, col0, ne11, 1, n_rows, acc)
            for i11 in range(ne11):
                for r in range(hi - lo):
                    out[i13, i12, i11, lo + r] = acc[i11 * ROWS_PER_TASK + r]
            continue
        if how == VEC and kind != TYPE_IQ4_NL:
            i11 = 0
            while i11 < ne11:
                n = VEC_COLS[0] if ne11 - i11 >= VEC_COLS[0] else (VEC_COLS[1] if ne11 - i11 >= VEC_COLS[1] else 1)
                vec_rows(kind, n, w, base + lo * nb01, nb01, hi - lo, nblk, yq, yd, ybs, col0 + i11, out, i13, i12, i11,
                         lo)
                i11 += n
            continue
        tiled = ne11 - ne11 % TILE_COLS if how == TILED else 0
        for i11 in range(0, tiled, TILE_COLS):
            for r in range(lo, hi):
                v = tiled_dots(kind, w, base + r * nb01, nblk, yq, yd, ybs, col0 + i11)
                for j in range(TILE_COLS):
                    out[i13, i12, i11 + j, r] = v[j]
        for i11 in range(tiled, ne11):
            col = col0 + i11
            for r in range(lo, hi):
                row = base + r * nb01
                if kind == TYPE_IQ4_NL:
                    if how == TINYBLAS:
                        v1 = _iq4nl_tiny(w, row, nblk, yq, yd, col)
                    else:
                        v1 = _iq4nl_vec(w, row, nblk, yq, yd, col)
                else:
                    v1 = tiled_dot(kind, w, row, nblk, yq, yd, ybs, col)[0]
                out[i13, i12, i11, r] = v1


def takes_vnni(type_: GGMLType, target: Target) -> bool:
    """Whether the TILED route runs kernels.formats.kquant_vnni: for a target that is an AVX-512 build (whose
    tiled kernel is the VNNI one) on a host that has AVX512_VNNI. The sums are the same either way."""
    return HAS_VNNI and target.lanes == 16 and type_ != T.IQ4_NL


def bind(src0, x, out, target: Target = AVX2):
    """MUL_MAT of K-quant/IQ4 weights src0 (a Tensor) with the f32 activations x (ne13, ne12, ne11, K,
    any strides) into out (the dst array, whose shape[2] is src1->ne[1], what picks ggml's route) as
    ggml-cpu built for `target` computes it, as a zero-argument call; the quantized activations'
    scratch is allocated once, here."""
    tt = TYPE_TRAITS[src0.type]
    k, n_rows = x.shape[3], x.shape[0] * x.shape[1] * x.shape[2]
    yq = np.empty(n_rows * k, np.int8)
    yd = np.empty(n_rows * (k // tt.block_size), np.float32)
    ybs = np.empty(n_rows * (k // GROUP), np.int32)
    return partial(_mul_mat_kquant, int(src0.type), route(src0.type, out.shape[2]), takes_vnni(src0.type, target),
                   src0.nb[1], src0.nb[2], src0.nb[3], src0.ne[1], src0.ne[2], src0.ne[3], k // tt.block_size, src0.mem,
                   src0.offset, x, yq, yd, ybs, out)


def mul_mat(src0, xs, out, target: Target = AVX2) -> None:
    """bind() run once, for activation rows xs (rows, K) given flat."""
    bind(src0, xs.reshape(out.shape[0], out.shape[1], out.shape[2], xs.shape[1]), out, target)()
