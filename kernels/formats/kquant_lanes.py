"""LLVM building blocks of the K-quant and IQ4 dot products (kernels/formats/kquant_dot.py): each format's 32
quants of a chunk as one <32 x i8> vector, its group scales and minimums decoded in registers, and the
integer lanes of ggml's AVX2 block dot. The byte layouts come from kernels/formats/kquants.py (_chunk_layout),
whose numpy decoders are the reference these must agree with.
"""

from __future__ import annotations

from llvmlite import ir

from wire.ggml import GGMLType
from .kquants import KVALUES_IQ4NL, QK_K, _chunk_layout
from ..llvm import (HAS_AVX2, HAS_VNNI, byte_ptr, elem_ptr, half_t, i8_dot_lanes, i8_t, i16_t, i32_t, llvm_fn, shuffle,
                   splat, vec)

T = GGMLType
V32 = vec(i8_t, 32)
i64_t, f32_t = ir.IntType(64), ir.FloatType()


def load_y(context, builder, yt, y, yoff):
    return builder.load(builder.bitcast(elem_ptr(context, builder, yt, y, yoff), V32.as_pointer()), align=1)


def shift_bytes(builder, v, amount, left=False):
    """Shift every byte of a <32 x i8> by a constant. x86 has no byte shifts, so shift 16-bit lanes;
    bits crossing into the neighbouring byte are masked off afterwards (see _chunk_layout)."""
    if amount == 0:
        return v
    lanes = builder.bitcast(v, vec(i16_t, 16))
    count = ir.Constant(vec(i16_t, 16), [amount] * 16)
    return builder.bitcast(builder.shl(lanes, count) if left else builder.lshr(lanes, count), V32)


def byte_splat(value):
    return ir.Constant(V32, [value] * 32)


def iq4_quants(builder, raw):
    """16 IQ4 bytes -> 32 kvalues_iq4nl entries (low nibbles, then high nibbles)."""
    v16 = vec(i8_t, 16)
    lo = builder.and_(raw, ir.Constant(v16, [15] * 16))
    hi = builder.lshr(raw, ir.Constant(v16, [4] * 16))
    idx = builder.shuffle_vector(lo, hi, ir.Constant(vec(i32_t, 32), list(range(32))))
    table = [int(v) for v in KVALUES_IQ4NL]
    if HAS_AVX2:  # one byte shuffle per 128-bit half, the table repeated in both halves
        pshufb = llvm_fn(builder, "llvm.x86.avx2.pshuf.b", V32, [V32, V32])
        return builder.call(pshufb, [ir.Constant(V32, table * 2), idx])
    q = byte_splat(0)
    for i, v in enumerate(table):
        q = builder.select(builder.icmp_unsigned("==", idx, byte_splat(i)), byte_splat(v), q)
    return q


SPREAD_CONTROLS = "pyrpc_kquant_spread_controls"  # the byte shuffles of spreader, as a module global


def spread_controls(builder):
    """spreader's 8 vpshufb controls (chunk c: bytes 2c, 2c+1 of each 128-bit half, 16 times), loaded
    from a writable global. Given constant controls LLVM rewrites the shuffles into per-chunk byte
    broadcasts from general registers (two instructions a chunk and the scalar work to feed them,
    13% of a Q4_K block's time); loaded ones it cannot see through, so the 8 shuffles stay single
    instructions whose controls, loop-invariant, sit in registers. linkonce_odr: every module that
    holds a kernel defines the same bytes, and the linker keeps one."""
    controls = ir.ArrayType(V32, QK_K // 32)
    table = builder.module.globals.get(SPREAD_CONTROLS)
    if table is None:
        table = ir.GlobalVariable(builder.module, controls, SPREAD_CONTROLS)
        table.linkage, table.global_constant, table.align = "linkonce_odr", False, 32
        table.initializer = ir.Constant(controls, [ir.Constant(V32, [2 * c, 2 * c + 1] * 16)
                                                   for c in range(QK_K // 32)])
    zero = ir.Constant(i32_t, 0)
    return [builder.load(builder.gep(table, [zero, ir.Constant(i32_t, c)]), align=32) for c in range(QK_K // 32)]


def spreader(builder, scales):
    """The block's <16 x i32> group scales -> spread(c): the <16 x i16> whose lanes 0-7 hold the scale
    of group 2c and 8-15 that of group 2c+1 (all scales fit in 16 bits). The scales are laid out once
    per block, even groups in the low half and odd in the high, so each chunk's spread is one in-lane
    byte shuffle, like ggml's get_scale_shuffle (vpshufb on AVX2: see spread_controls)."""
    narrow = builder.trunc(scales, vec(i16_t, 16))
    halves = shuffle(builder, narrow, narrow, list(range(0, 16, 2)) + list(range(1, 16, 2)))
    if not HAS_AVX2:
        return lambda c: shuffle(builder, halves, halves, [c] * 8 + [8 + c] * 8)
    pshufb = llvm_fn(builder, "llvm.x86.avx2.pshuf.b", V32, [V32, V32])
    controls, halves = spread_controls(builder), builder.bitcast(halves, V32)
    return lambda c: builder.bitcast(builder.call(pshufb, [halves, controls[c]]), vec(i16_t, 16))


def scaled_lanes(builder, q, y, spread, unsigned=False, acc=None):
    """<32 x i8> q . y -> <8 x i32> whose lanes 0-3 carry spread[0] * (the first 16 products) and
    4-7 spread[8] * (the last 16), added to acc if given. On AVX2 the scales ride in the 16-bit
    multiply-add that ggml uses to widen pairs, saving a 32-bit vector multiply (with AVX512_VNNI
    that multiply-add and the sum into acc are one vpdpwssd); quants known to be non-negative go into
    the unsigned side of the byte multiply-add as they are, without the sign trick."""
    add = (lambda v: v) if acc is None else (lambda v: builder.add(acc, v))  # noqa: E731
    if not HAS_AVX2:
        wide = builder.sext(shuffle(builder, spread, spread, [0] * 4 + [8] * 4), vec(i32_t, 8))
        return add(builder.mul(i8_dot_lanes(builder, q, y), wide))
    v16, v8 = vec(i16_t, 16), vec(i32_t, 8)
    psign = llvm_fn(builder, "llvm.x86.avx2.psign.b", V32, [V32, V32])
    maddubs = llvm_fn(builder, "llvm.x86.avx2.pmadd.ub.sw", v16, [V32, V32])
    if unsigned:
        pairs = builder.call(maddubs, [q, y])
    else:
        pairs = builder.call(maddubs, [builder.call(psign, [q, q]), builder.call(psign, [y, q])])
    if acc is not None and HAS_VNNI:
        dpwssd = llvm_fn(builder, "llvm.x86.avx512.vpdpwssd.256", v8, [v8] * 3)
        return builder.call(dpwssd, [acc, builder.bitcast(pairs, v8), builder.bitcast(spread, v8)])
    madd = llvm_fn(builder, "llvm.x86.avx2.pmadd.wd", v8, [v16, v16])
    return add(builder.call(madd, [pairs, spread]))


def unsigned_quants(type_, signed=True):
    """Whether chunk_quants(..., signed) gives only non-negative quants for this type."""
    return type_ in (T.Q2_K, T.Q4_K, T.Q5_K) or (type_ == T.Q6_K and not signed)


def chunk_quants(builder, at, type_, c, signed=True):
    """<32 x i8> quants of chunk c (elements 32c..32c+31) of the 256-block whose bytes at(off, type)
    loads. signed=False leaves Q6_K's codes unsigned (0..63), as ggml's VEC route dots them."""
    if type_ == T.IQ4_XS:
        return iq4_quants(builder, at(8 + 16 * c, vec(i8_t, 16)))
    a, sa, ma, b, sb, mb, hs, bias = _chunk_layout(type_, c)
    q = builder.and_(shift_bytes(builder, at(a, V32), sa), byte_splat(ma))
    if mb:
        high = builder.and_(shift_bytes(builder, at(b, V32), sb), byte_splat(mb))
        q = builder.or_(q, shift_bytes(builder, high, hs, left=True))
    if bias and (signed or type_ != T.Q6_K):
        q = builder.sub(q, byte_splat(bias))
    return q


def lane_consts(t, values):
    return ir.Constant(vec(t, len(values)), values)


def block_scales(builder, type_, at):
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
        return (builder.zext(builder.and_(raw, lane_consts(i8_t, [15] * 16)), v16i32),
                builder.zext(builder.lshr(raw, lane_consts(i8_t, [4] * 16)), v16i32), half(80), half(82))
    if type_ == T.Q3_K:
        low, top = at(96, vec(i8_t, 8)), at(104, vec(i8_t, 4))
        low = builder.lshr(shuffle(builder, low, low, list(range(8)) * 2), lane_consts(i8_t, [0] * 8 + [4] * 8))
        top = builder.lshr(shuffle(builder, top, top, [0, 1, 2, 3] * 4), lane_consts(i8_t, [s for s in (0, 2, 4, 6)
                                                                                               for _ in range(4)]))
        six = builder.or_(builder.and_(low, lane_consts(i8_t, [15] * 16)),
                          builder.shl(builder.and_(top, lane_consts(i8_t, [3] * 16)), lane_consts(i8_t, [4] * 16)))
        return builder.sub(builder.zext(six, v16i32), lane_consts(i32_t, [32] * 16)), None, half(108), no_min
    if type_ != T.IQ4_XS:
        raise ValueError(f"no in-register scales for {type_.name}")
    nib = at(4, vec(i8_t, 4))  # IQ4_XS: 4 low bits per 32 from nibbles, 2 high bits from one 16-bit word
    nib = builder.lshr(shuffle(builder, nib, nib, [i // 2 for i in range(8)]), lane_consts(i8_t, [0, 4] * 4))
    nib = builder.zext(builder.and_(nib, lane_consts(i8_t, [15] * 8)), vec(i32_t, 8))
    high = splat(builder, builder.zext(at(2, i16_t), i32_t))
    high = builder.and_(builder.lshr(high, lane_consts(i32_t, list(range(0, 16, 2)))), lane_consts(i32_t, [3] * 8))
    ls = builder.sub(builder.or_(nib, builder.shl(high, lane_consts(i32_t, [4] * 8))), lane_consts(i32_t, [32] * 8))
    return shuffle(builder, ls, ls, [g // 2 for g in range(16)]), None, half(0), no_min


def block_lanes(builder, type_, at, load_ys, scales, signed=True):
    """For each activation row, the 8 int32 lanes of ggml's AVX2 block dot: lane l = sum over the 8
    chunks c of S[2c + l//4] * (products 4l..4l+3 of chunk c). load_ys: per activation row a
    load_y(e) loading its activations e..e+31 of the block; scales are the block's <16 x i32> group
    scales S. The weight quants and their scales are decoded once for all the rows. Each sum runs
    in two chains (even and odd chunks) added at the end, half as long a chain of dependent
    multiply-adds as one accumulator (integer sums, exact in any order)."""
    zero = ir.Constant(vec(i32_t, 8), [0] * 8)
    chains = [[zero, zero] for _ in load_ys]
    spread = spreader(builder, scales)
    for c in range(QK_K // 32):
        q, sc = chunk_quants(builder, at, type_, c, signed), spread(c)
        for chain, load_y in zip(chains, load_ys):
            chain[c % 2] = scaled_lanes(builder, q, load_y(32 * c), sc, unsigned_quants(type_, signed), chain[c % 2])
    return [builder.add(even, odd) for even, odd in chains]


def per_32(type_):
    """Whether the format has one scale (and minimum) per 32 elements, each group pair sharing it."""
    return type_ in (T.Q4_K, T.Q5_K, T.IQ4_XS)


def product_pairs(builder, a, b):
    """<16 x i32> a, b whose values fit in 16 bits -> <8 x i32> lanes a[2l]*b[2l] + a[2l+1]*b[2l+1]:
    on AVX2 one vpmaddwd of the narrowed vectors (as ggml pairs scales with bsums), else in 32 bits."""
    if not HAS_AVX2:
        return pairs(builder, builder.mul(a, b))
    v16 = vec(i16_t, 16)
    madd = llvm_fn(builder, "llvm.x86.avx2.pmadd.wd", vec(i32_t, 8), [v16, v16])
    return builder.call(madd, [builder.trunc(a, v16), builder.trunc(b, v16)])


def weighted_bsums(builder, type_, mins, bsums):
    """M_g * bsum_g as <8 x i32>, lane l holding groups 2l and 2l+1 (M from block_scales: a format with
    one minimum per 32 has it in both of the pair's lanes). Minimums and bsums (16 activations) fit
    in 16 bits."""
    return product_pairs(builder, mins, bsums)


def isum(builder, v):
    """Integer sum of a vector's lanes (exact, so any order)."""
    n = v.type.count
    while n > 1:
        n //= 2
        v = builder.add(shuffle(builder, v, v, list(range(n))), shuffle(builder, v, v, list(range(n, 2 * n))))
    return builder.extract_element(v, ir.Constant(i32_t, 0))


def pairs(builder, v):
    """Neighbouring lanes summed: <2n x i32> -> <n x i32> (the pairing of _mm256_madd_epi16)."""
    n = v.type.count
    return builder.add(shuffle(builder, v, v, list(range(0, n, 2))), shuffle(builder, v, v, list(range(1, n, 2))))


class Args:
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
        return load_y(self.context, self.builder, self.types[i], self.values[i], index)


def i64c(v):
    return ir.Constant(i64_t, v)


def fma_fn(builder, n):
    if n == 1:
        return llvm_fn(builder, "llvm.fma.f32", f32_t, [f32_t] * 3)
    return llvm_fn(builder, f"llvm.fma.v{n}f32", vec(f32_t, n), [vec(f32_t, n)] * 3)


def column_vector(builder, values):
    """Scalars -> one vector (a single value stays a scalar)."""
    if len(values) == 1:
        return values[0]
    v = ir.Constant(vec(values[0].type, len(values)), None)
    for j, x in enumerate(values):
        v = builder.insert_element(v, x, ir.Constant(i32_t, j))
    return v


def column_sums(builder, vectors):
    """n <8 x i32> vectors -> <n x i32> of their lane sums (an i32 if n == 1): pairs of vectors are
    folded into one (neighbouring lanes added) until one is left, then its lanes are folded in turn.
    Integer sums are exact, so this order is as good as any."""
    vs = list(vectors)
    while len(vs) > 1:
        vs = [builder.add(shuffle(builder, x, y, list(range(0, 16, 2))), shuffle(builder, x, y, list(range(1, 16, 2))))
              for x, y in zip(vs[::2], vs[1::2])]
    v = vs[0]
    while v.type.count > len(vectors):
        v = pairs(builder, v)
    return builder.extract_element(v, ir.Constant(i32_t, 0)) if len(vectors) == 1 else v
