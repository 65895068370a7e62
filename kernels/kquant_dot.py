"""K-quant and IQ4 dot products for MUL_MAT as numba/LLVM vector code, and the MUL_MAT driver over
ggml-cpu's three routes (kernels.kquants.route): tiled super-block sums, ggml_vec_dot_<w>_q8_K lanes,
and llamafile's tinyBLAS for IQ4_NL. The formats, their decoders, the Q8_K activation quantizer and the
numpy twin of all this (`dot_ref`) are in kernels/kquants.py.
"""

from __future__ import annotations

import numba
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .ggml import TYPE_IQ4_NL, TYPE_Q2_K, TYPE_Q3_K, TYPE_Q4_K, TYPE_Q5_K, TYPE_Q6_K, TYPE_TRAITS, GGMLType
from .jit import JIT
from .kquants import (BIT_TYPES, HAS_MIN, KVALUES_IQ4NL, QK_K, TILED, TINYBLAS, VEC, _chunk_layout,
                      quantize_activations, route)
from .llvm import (HAS_AVX2, PREFETCH_AHEAD, byte_ptr, elem_ptr, half_t, hsum8, i8_dot_lanes, i8_t, i16_t, i32_t,
                   llvm_fn, prefetch, shuffle, splat, vec)
from .tasks import ROWS_PER_TASK, task_tile

T = GGMLType

_V32 = vec(i8_t, 32)


def _load_y(context, builder, yt, y, yoff):
    return builder.load(builder.bitcast(elem_ptr(context, builder, yt, y, yoff), _V32.as_pointer()), align=1)


def _shift_bytes(builder, v, amount, left=False):
    """Shift every byte of a <32 x i8> by a constant. x86 has no byte shifts, so shift 16-bit lanes;
    bits crossing into the neighbouring byte are masked off afterwards (see _chunk_layout)."""
    if amount == 0:
        return v
    lanes = builder.bitcast(v, vec(i16_t, 16))
    count = ir.Constant(vec(i16_t, 16), [amount] * 16)
    return builder.bitcast(builder.shl(lanes, count) if left else builder.lshr(lanes, count), _V32)


def _bytes(value):
    return ir.Constant(_V32, [value] * 32)


def _iq4_quants(builder, raw):
    """16 IQ4 bytes -> 32 kvalues_iq4nl entries (low nibbles, then high nibbles)."""
    v16 = vec(i8_t, 16)
    lo = builder.and_(raw, ir.Constant(v16, [15] * 16))
    hi = builder.lshr(raw, ir.Constant(v16, [4] * 16))
    idx = builder.shuffle_vector(lo, hi, ir.Constant(vec(i32_t, 32), list(range(32))))
    table = [int(v) for v in KVALUES_IQ4NL]
    if HAS_AVX2:  # one byte shuffle per 128-bit half, the table repeated in both halves
        pshufb = llvm_fn(builder, "llvm.x86.avx2.pshuf.b", _V32, [_V32, _V32])
        return builder.call(pshufb, [ir.Constant(_V32, table * 2), idx])
    q = _bytes(0)
    for i, v in enumerate(table):
        q = builder.select(builder.icmp_unsigned("==", idx, _bytes(i)), _bytes(v), q)
    return q


def _scaled_lanes(builder, q, y, scales, unsigned=False):
    """<32 x i8> q . y -> <8 x i32> whose lanes 0-3 carry scales[0] * (the first 16 products) and
    4-7 scales[1] * (the last 16). On AVX2 the scales ride in the 16-bit multiply-add that ggml uses
    to widen pairs (all scales fit in 16 bits), saving a 32-bit vector multiply; quants known to be
    non-negative go into the unsigned side of the byte multiply-add as they are, without the sign trick."""
    if not HAS_AVX2:
        spread = builder.shuffle_vector(scales, scales, ir.Constant(vec(i32_t, 8), [0, 0, 0, 0, 1, 1, 1, 1]))
        return builder.mul(i8_dot_lanes(builder, q, y), spread)
    v16 = vec(i16_t, 16)
    psign = llvm_fn(builder, "llvm.x86.avx2.psign.b", _V32, [_V32, _V32])
    maddubs = llvm_fn(builder, "llvm.x86.avx2.pmadd.ub.sw", v16, [_V32, _V32])
    madd = llvm_fn(builder, "llvm.x86.avx2.pmadd.wd", vec(i32_t, 8), [v16, v16])
    if unsigned:
        pairs = builder.call(maddubs, [q, y])
    else:
        pairs = builder.call(maddubs, [builder.call(psign, [q, q]), builder.call(psign, [y, q])])
    narrow = builder.trunc(scales, vec(i16_t, 2))
    spread = builder.shuffle_vector(narrow, narrow, ir.Constant(vec(i32_t, 16), [0] * 8 + [1] * 8))
    return builder.call(madd, [pairs, spread])


i64_t, f32_t = ir.IntType(64), ir.FloatType()


def _unsigned(type_, signed=True):
    """Whether _chunk_quants(..., signed) gives only non-negative quants for this type."""
    return type_ in (T.Q2_K, T.Q4_K, T.Q5_K) or (type_ == T.Q6_K and not signed)


def _chunk_quants(builder, at, type_, c, signed=True):
    """<32 x i8> quants of chunk c (elements 32c..32c+31) of the 256-block whose bytes at(off, type)
    loads. signed=False leaves Q6_K's codes unsigned (0..63), as ggml's VEC route dots them."""
    if type_ == T.IQ4_XS:
        return _iq4_quants(builder, at(8 + 16 * c, vec(i8_t, 16)))
    a, sa, ma, b, sb, mb, hs, bias = _chunk_layout(type_, c)
    q = builder.and_(_shift_bytes(builder, at(a, _V32), sa), _bytes(ma))
    if mb:
        high = builder.and_(_shift_bytes(builder, at(b, _V32), sb), _bytes(mb))
        q = builder.or_(q, _shift_bytes(builder, high, hs, left=True))
    if bias and (signed or type_ != T.Q6_K):
        q = builder.sub(q, _bytes(bias))
    return q


def _lane_consts(t, values):
    return ir.Constant(vec(t, len(values)), values)


def _block_scales(builder, type_, at):
    """(S, M, d, dmin) of the 256-block whose bytes at(off, type) loads, decoded in registers as
    kquants._decode_scales decodes them into arrays: S and M the 16 group scales and minimums as
    <16 x i32> (M None where the format has none), d and dmin float32. Q4_K/Q5_K unpack their 12
    scale bytes with ggml's three 32-bit masks."""
    v16i32 = vec(i32_t, 16)
    half = lambda off: builder.fpext(at(off, half_t), f32_t)  # noqa: E731
    no_min = ir.Constant(f32_t, 0.0)
    if type_ in (T.Q4_K, T.Q5_K):
        u0, u1, u2 = (at(4 + 4 * i, i32_t) for i in range(3))
        k = lambda x: ir.Constant(i32_t, x)  # noqa: E731
        top2 = lambda u: builder.shl(builder.and_(builder.lshr(u, k(6)), k(0x03030303)), k(4))  # noqa: E731
        scales = (builder.and_(u0, k(0x3F3F3F3F)), builder.or_(builder.and_(u2, k(0x0F0F0F0F)), top2(u0)))
        mins = (builder.and_(u1, k(0x3F3F3F3F)),
                builder.or_(builder.and_(builder.lshr(u2, k(4)), k(0x0F0F0F0F)), top2(u1)))

        def per_group(lo, hi):  # 8 bytes, one per 32 elements -> 16 lanes, one per 16
            v = builder.insert_element(ir.Constant(vec(i32_t, 2), None), lo, k(0))
            v = builder.bitcast(builder.insert_element(v, hi, k(1)), vec(i8_t, 8))
            return builder.zext(shuffle(builder, v, v, [g // 2 for g in range(16)]), v16i32)

        return per_group(*scales), per_group(*mins), half(0), half(2)
    if type_ == T.Q6_K:
        return builder.sext(at(192, vec(i8_t, 16)), v16i32), None, half(208), no_min
    if type_ == T.Q2_K:
        raw = at(0, vec(i8_t, 16))
        return (builder.zext(builder.and_(raw, _lane_consts(i8_t, [15] * 16)), v16i32),
                builder.zext(builder.lshr(raw, _lane_consts(i8_t, [4] * 16)), v16i32), half(80), half(82))
    if type_ == T.Q3_K:
        low, top = at(96, vec(i8_t, 8)), at(104, vec(i8_t, 4))
        low = builder.lshr(shuffle(builder, low, low, list(range(8)) * 2), _lane_consts(i8_t, [0] * 8 + [4] * 8))
        top = builder.lshr(shuffle(builder, top, top, [0, 1, 2, 3] * 4), _lane_consts(i8_t, [s for s in (0, 2, 4, 6)
                                                                                               for _ in range(4)]))
        six = builder.or_(builder.and_(low, _lane_consts(i8_t, [15] * 16)),
                          builder.shl(builder.and_(top, _lane_consts(i8_t, [3] * 16)), _lane_consts(i8_t, [4] * 16)))
        return builder.sub(builder.zext(six, v16i32), _lane_consts(i32_t, [32] * 16)), None, half(108), no_min
    if type_ != T.IQ4_XS:
        raise ValueError(f"no in-register scales for {type_.name}")
    nib = at(4, vec(i8_t, 4))  # IQ4_XS: 4 low bits per 32 from nibbles, 2 high bits from one 16-bit word
    nib = builder.lshr(shuffle(builder, nib, nib, [i // 2 for i in range(8)]), _lane_consts(i8_t, [0, 4] * 4))
    nib = builder.zext(builder.and_(nib, _lane_consts(i8_t, [15] * 8)), vec(i32_t, 8))
    high = splat(builder, builder.zext(at(2, i16_t), i32_t))
    high = builder.and_(builder.lshr(high, _lane_consts(i32_t, list(range(0, 16, 2)))), _lane_consts(i32_t, [3] * 8))
    ls = builder.sub(builder.or_(nib, builder.shl(high, _lane_consts(i32_t, [4] * 8))), _lane_consts(i32_t, [32] * 8))
    return shuffle(builder, ls, ls, [g // 2 for g in range(16)]), None, half(0), no_min


def _block_lanes(builder, type_, at, load_y, load_scales, signed=True):
    """The 8 int32 lanes of ggml's AVX2 block dot: lane l = sum over the 8 chunks c of
    S[2c + l//4] * (products 4l..4l+3 of chunk c). load_y(e) loads activations e..e+31 of the block,
    load_scales(g) the <2 x i32> scales of groups g, g+1."""
    acc = ir.Constant(vec(i32_t, 8), [0] * 8)
    for c in range(QK_K // 32):
        q = _chunk_quants(builder, at, type_, c, signed)
        acc = builder.add(acc, _scaled_lanes(builder, q, load_y(32 * c), load_scales(2 * c), _unsigned(type_, signed)))
    return acc


def _isum(builder, v):
    """Integer sum of a vector's lanes (exact, so any order)."""
    n = v.type.count
    while n > 1:
        n //= 2
        v = builder.add(shuffle(builder, v, v, list(range(n))), shuffle(builder, v, v, list(range(n, 2 * n))))
    return builder.extract_element(v, ir.Constant(i32_t, 0))


def _pairs(builder, v):
    """Neighbouring lanes summed: <2n x i32> -> <n x i32> (the pairing of _mm256_madd_epi16)."""
    n = v.type.count
    return builder.add(shuffle(builder, v, v, list(range(0, n, 2))), shuffle(builder, v, v, list(range(1, n, 2))))


class _Args:
    """Typed access to an intrinsic's array arguments (all C-contiguous and 1-d)."""

    def __init__(self, context, builder, signature, args):
        self.context, self.builder, self.types, self.values = context, builder, signature.args, args

    def elem(self, i, index):
        return self.builder.load(elem_ptr(self.context, self.builder, self.types[i], self.values[i], index))

    def ivec(self, i, index, n):
        ptr = elem_ptr(self.context, self.builder, self.types[i], self.values[i], index)
        return self.builder.load(self.builder.bitcast(ptr, vec(i32_t, n).as_pointer()), align=4)

    def bytes_at(self, i, offset, ty):
        return self.builder.load(byte_ptr(self.context, self.builder, self.types[i], self.values[i], offset, ty),
                                 align=1)

    def y32(self, i, index):
        return _load_y(self.context, self.builder, self.types[i], self.values[i], index)


def _i64(v):
    return ir.Constant(i64_t, v)


def _fma_fn(builder, n):
    if n == 1:
        return llvm_fn(builder, "llvm.fma.f32", f32_t, [f32_t] * 3)
    return llvm_fn(builder, f"llvm.fma.v{n}f32", vec(f32_t, n), [vec(f32_t, n)] * 3)


def _column_vector(builder, values):
    """Scalars -> one vector (a single value stays a scalar)."""
    if len(values) == 1:
        return values[0]
    v = ir.Constant(vec(values[0].type, len(values)), None)
    for j, x in enumerate(values):
        v = builder.insert_element(v, x, ir.Constant(i32_t, j))
    return v


def _column_sums(builder, vectors):
    """n <8 x i32> vectors -> <n x i32> of their lane sums (an i32 if n == 1): pairs of vectors are
    folded into one (neighbouring lanes added) until one is left, then its lanes are folded in turn.
    Integer sums are exact, so this order is as good as any."""
    vs = list(vectors)
    while len(vs) > 1:
        vs = [builder.add(shuffle(builder, x, y, list(range(0, 16, 2))), shuffle(builder, x, y, list(range(1, 16, 2))))
              for x, y in zip(vs[::2], vs[1::2])]
    v = vs[0]
    while v.type.count > len(vectors):
        v = _pairs(builder, v)
    return builder.extract_element(v, ir.Constant(i32_t, 0)) if len(vectors) == 1 else v


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
            a = _Args(context, builder, signature, args)
            off_, nb_, col_ = args[1], args[2], args[6]
            fma = _fma_fn(builder, ncol)
            acc = cgutils.alloca_once_value(builder, _column_vector(builder, [ir.Constant(f32_t, 0.0)] * ncol))
            with cgutils.for_range(builder, nb_) as loop:
                b = loop.index
                p = builder.add(off_, builder.mul(b, _i64(size)))
                prefetch(builder, byte_ptr(context, builder, a.types[0], a.values[0],
                                           builder.add(p, _i64(PREFETCH_AHEAD)), i8_t))
                at = lambda o, ty: a.bytes_at(0, builder.add(p, _i64(o)), ty)  # noqa: E731
                scales, mins, d, dmin = _block_scales(builder, type_, at)
                ybk = [builder.add(builder.mul(builder.add(col_, _i64(j)), nb_), b) for j in range(ncol)]
                lanes = [ir.Constant(vec(i32_t, 8), [0] * 8)] * ncol
                for c in range(QK_K // 32):
                    q = _chunk_quants(builder, at, type_, c)
                    sc = shuffle(builder, scales, scales, [2 * c, 2 * c + 1])
                    for j in range(ncol):
                        y = a.y32(3, builder.add(builder.mul(ybk[j], _i64(QK_K)), _i64(32 * c)))
                        lanes[j] = builder.add(lanes[j], _scaled_lanes(builder, q, y, sc, _unsigned(type_)))
                to_f32 = lambda v: builder.sitofp(v, f32_t if ncol == 1 else vec(f32_t, ncol))  # noqa: E731
                wide = lambda x: x if ncol == 1 else splat(builder, x, ncol)  # noqa: E731
                r = builder.fmul(wide(d), to_f32(_column_sums(builder, lanes)))
                if HAS_MIN[type_]:
                    prods = [builder.mul(mins, a.ivec(5, builder.mul(yb, _i64(16)), 16)) for yb in ybk]
                    halves = [builder.add(shuffle(builder, v, v, list(range(8))),
                                          shuffle(builder, v, v, list(range(8, 16)))) for v in prods]
                    r = builder.call(fma, [wide(builder.fsub(ir.Constant(f32_t, -0.0), dmin)),
                                           to_f32(_column_sums(builder, halves)), r])
                d_y = _column_vector(builder, [a.elem(4, yb) for yb in ybk])
                builder.store(builder.call(fma, [r, d_y, builder.load(acc)]), acc)
            total = builder.load(acc)
            outs = [total] if ncol == 1 else [builder.extract_element(total, ir.Constant(i32_t, j))
                                              for j in range(ncol)]
            return context.make_tuple(builder, ret, outs)

        return sig, codegen

    return tiled


def _make_vec_dot(type_: GGMLType):
    """Intrinsic dot(w, off, nblk, yq, yd, ybs, col) -> float32: the weight row at byte off . activation
    row col (yq int8, yd float32 per block, ybs int32 per 16, all flat), as ggml_vec_dot_<type>_q8_K:
    per block the scales decoded in registers, 8 float lanes acc = fma(d_y*d, lanes, acc) and the
    minimum term each format folds in its own way."""
    size = TYPE_TRAITS[type_].type_size

    @intrinsic
    def vec_dot(typingctx, w, off, nblk, yq, yd, ybs, col):
        sig = types.float32(w, types.int64, types.int64, yq, yd, ybs, types.int64)

        def codegen(context, builder, signature, args):
            a = _Args(context, builder, signature, args)
            off_, nb_, col_ = args[1], args[2], args[6]
            fma8, fma4, fma1 = _fma_fn(builder, 8), _fma_fn(builder, 4), _fma_fn(builder, 1)
            zero = lambda n: ir.Constant(vec(f32_t, n), [0.0] * n)  # noqa: E731
            acc = cgutils.alloca_once_value(builder, zero(8))
            acc_m = cgutils.alloca_once_value(builder, zero(4))  # Q4_K: minimum terms in 4 lanes
            summs = cgutils.alloca_once_value(builder, ir.Constant(f32_t, 0.0))  # Q5_K: one scalar
            with cgutils.for_range(builder, nb_) as loop:
                b = loop.index
                p = builder.add(off_, builder.mul(b, _i64(size)))
                ahead = builder.add(p, _i64(PREFETCH_AHEAD))
                prefetch(builder, byte_ptr(context, builder, a.types[0], a.values[0], ahead, i8_t))
                at = lambda o, ty: a.bytes_at(0, builder.add(p, _i64(o)), ty)  # noqa: E731
                scales, mins, d, dmin = _block_scales(builder, type_, at)
                yb = builder.add(builder.mul(col_, nb_), b)
                yg0, y0 = builder.mul(yb, _i64(16)), builder.mul(yb, _i64(QK_K))
                lanes = _block_lanes(builder, type_, at, lambda e: a.y32(3, builder.add(y0, _i64(e))),
                                     lambda g: shuffle(builder, scales, scales, [g, g + 1]), signed=type_ != T.Q6_K)
                dy = a.elem(4, yb)
                bsums = a.ivec(5, yg0, 16)
                if type_ == T.Q6_K:  # the unsigned codes' excess: 32 * S * bsum, paired per lane
                    excess = _pairs(builder, builder.mul(scales, bsums))
                    lanes = builder.sub(lanes, builder.shl(excess, ir.Constant(vec(i32_t, 8), [5] * 8)))
                if HAS_MIN[type_]:
                    d_min = builder.fmul(builder.fsub(ir.Constant(f32_t, -0.0), dy), dmin)
                    mins = builder.mul(mins, bsums)
                    if type_ == T.Q2_K:
                        builder.store(builder.call(fma8, [splat(builder, d_min), builder.sitofp(
                            _pairs(builder, mins), vec(f32_t, 8)), builder.load(acc)]), acc)
                    elif type_ == T.Q4_K:
                        builder.store(builder.call(fma4, [splat(builder, d_min, 4), builder.sitofp(
                            _pairs(builder, _pairs(builder, mins)), vec(f32_t, 4)), builder.load(acc_m)]), acc_m)
                    else:  # Q5_K
                        builder.store(builder.call(fma1, [d_min, builder.sitofp(_isum(builder, mins), f32_t),
                                                          builder.load(summs)]), summs)
                d_xy = splat(builder, builder.fmul(dy, d))
                builder.store(builder.call(fma8, [d_xy, builder.sitofp(lanes, vec(f32_t, 8)), builder.load(acc)]), acc)
            total = hsum8(builder, builder.load(acc))
            if type_ == T.Q4_K:
                v = builder.load(acc_m)
                e = [builder.extract_element(v, ir.Constant(i32_t, i)) for i in range(4)]
                total = builder.fadd(total, builder.fadd(builder.fadd(e[0], e[2]), builder.fadd(e[1], e[3])))
            elif type_ == T.Q5_K:
                total = builder.fadd(total, builder.load(summs))
            return total

        return sig, codegen

    return vec_dot


def _make_iq4_nl_dot(tinyblas: bool):
    """Intrinsic dot(w, off, nblk, yq, yd, col) -> float32 for an IQ4_NL row: tinyBLAS keeps one
    accumulator; ggml_vec_dot_iq4_nl_q8_0 alternates two over block pairs, adds them before
    hsum_float_8, then adds an odd last block as a scalar: sumf += d*sumi, which gcc contracts into an
    fma in the AVX2 build (in a native AVX-512 build it does not)."""

    @intrinsic
    def dot(typingctx, w, off, nblk, yq, yd, col):
        sig = types.float32(w, types.int64, types.int64, yq, yd, types.int64)

        def codegen(context, builder, signature, args):
            a = _Args(context, builder, signature, args)
            off_, nb_, col_ = args[1], args[2], args[5]
            fma8 = _fma_fn(builder, 8)

            def block(b):
                p = builder.add(off_, builder.mul(b, _i64(18)))
                yb = builder.add(builder.mul(col_, nb_), b)
                q = _iq4_quants(builder, a.bytes_at(0, builder.add(p, _i64(2)), vec(i8_t, 16)))
                lanes = i8_dot_lanes(builder, q, a.y32(3, builder.mul(yb, _i64(32))))
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
            with cgutils.for_range(builder, builder.ashr(nb_, _i64(1))) as loop:
                b = builder.mul(loop.index, _i64(2))
                step(acc, b)
                step(acc2, builder.add(b, _i64(1)))
            total = hsum8(builder, builder.fadd(builder.load(acc), builder.load(acc2)))
            lanes, d = block(builder.sub(nb_, _i64(1)))  # always a valid block; used only if nb is odd
            tail = builder.call(_fma_fn(builder, 1), [d, builder.sitofp(_isum(builder, lanes), f32_t), total])
            odd = builder.icmp_signed("!=", builder.and_(nb_, _i64(1)), _i64(0))
            return builder.select(odd, tail, total)

        return sig, codegen

    return dot


_q2k_tiled, _q3k_tiled, _q4k_tiled, _q5k_tiled, _q6k_tiled, _iq4xs_tiled = (
    _make_tiled_dot(t, 1) for t in BIT_TYPES + (T.IQ4_XS,))
_q2k_tiles, _q3k_tiles, _q4k_tiles, _q5k_tiles, _q6k_tiles, _iq4xs_tiles = (
    _make_tiled_dot(t, TILE_COLS) for t in BIT_TYPES + (T.IQ4_XS,))
_q2k_vec, _q3k_vec, _q4k_vec, _q5k_vec, _q6k_vec, _iq4xs_vec = (_make_vec_dot(t) for t in BIT_TYPES + (T.IQ4_XS,))
_iq4nl_vec, _iq4nl_tiny = _make_iq4_nl_dot(False), _make_iq4_nl_dot(True)
iq4_nl_vec_dot = _iq4nl_vec  # ggml_vec_dot_iq4_nl_q8_0: also FLASH_ATTN_EXT's K.Q for an IQ4_NL K cache


@numba.njit(inline="always", **JIT)
def _tiled_dot(kind, w, off, nblk, yq, yd, ybs, col):
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
def _tiled_dots(kind, w, off, nblk, yq, yd, ybs, col):
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
def _vec_dot(kind, w, off, nblk, yq, yd, ybs, col):
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


@numba.njit(parallel=True, **JIT)
def _mul_mat_kquant(kind, how, nb01, nb02, nb03, ne01, ne02, ne03, nblk, w, off, yq, yd, ybs, out):
    """Like _mul_mat_quant: a task's weight rows meet every activation row while they are hot, in
    tiles of TILE_COLS activation rows on the TILED route; `how` is the route."""
    ne13, ne12, ne11 = out.shape[0], out.shape[1], out.shape[2]
    for task in numba.prange(ne13 * ne12 * ((ne01 + ROWS_PER_TASK - 1) // ROWS_PER_TASK)):
        i12, i13, base, col0, lo, hi = task_tile(task, ne01, ne02, ne03, ne11, ne12, ne13, off, nb02, nb03)
        tiled = ne11 - ne11 % TILE_COLS if how == TILED else 0
        for i11 in range(0, tiled, TILE_COLS):
            for r in range(lo, hi):
                v = _tiled_dots(kind, w, base + r * nb01, nblk, yq, yd, ybs, col0 + i11)
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
                elif how == VEC:
                    v1 = _vec_dot(kind, w, row, nblk, yq, yd, ybs, col)
                else:
                    v1 = _tiled_dot(kind, w, row, nblk, yq, yd, ybs, col)[0]
                out[i13, i12, i11, r] = v1


def mul_mat(src0, xs, out) -> None:
    """MUL_MAT with K-quant/IQ4 weights src0 (a Tensor) and f32 activation rows xs (rows, K) into out
    (the dst array, whose shape[2] is src1->ne[1], what picks ggml's route)."""
    tt = TYPE_TRAITS[src0.type]
    yq, yd, ybs = quantize_activations(src0.type, xs)
    _mul_mat_kquant(int(src0.type), route(src0.type, out.shape[2]), src0.nb[1], src0.nb[2], src0.nb[3], src0.ne[1],
                    src0.ne[2], src0.ne[3], xs.shape[1] // tt.block_size, src0.mem, src0.offset, yq.reshape(-1),
                    yd.reshape(-1), ybs.reshape(-1), out)
