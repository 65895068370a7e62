"""The TILED route of K-quant/IQ4_XS MUL_MAT as AVX-512 VNNI code: what ggml-cpu's native build on such a
CPU runs (tiled-kernel.cpp's VNNI micro-kernel), for a worker whose target is an AVX-512 build.

One call computes a tile of up to ROWS = 16 weight rows (a task of kernels.tasks, one int32 lane each)
against a run of activation rows. Per 256-block the 16 rows' quants are decoded once, as unsigned
bytes, into a stack scratch interleaved [4-byte group][row][4]; then for COLS activation rows at a time
one `vpdpbusd` per 4-byte group multiplies those 16 x 4 weight bytes by 4 activation bytes broadcast to
every lane. A format whose codes are signed stores them biased (+BIAS) and takes BIAS * bsum back out,
as ggml does. All of that is exact integer arithmetic, so the float order is the one of every other
K-quant route here and of ggml's kernels: per block and (row, activation row)
s1 = sum_g S_g <q, y>_g, s2 = sum_g M_g bsum_g, r = d*s1, r = fma(-dmin, s2, r), acc = fma(r, d_y, acc),
in 16 float lanes, one per weight row.

On a host without AVX512_VNNI the same IR computes `vpdpbusd` with plain vector integer operations
(kernels.llvm.dpbusd), so the module compiles everywhere; MUL_MAT and MUL_MAT_ID route here only with
HAS_VNNI and a 16-lane target (kquant_dot.takes_vnni).
"""

from __future__ import annotations

import numba
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from wire.ggml import TYPE_Q2_K, TYPE_Q3_K, TYPE_Q4_K, TYPE_Q5_K, TYPE_Q6_K, TYPE_TRAITS, GGMLType
from ..jit import JIT
from ..llvm import HAS_VNNI, byte_ptr, dpbusd, elem_ptr, i8_t, i32_t, llvm_fn, splat, vec
from ..tasks import ROWS_PER_TASK
from .kquant_lanes import Args, block_scales, chunk_quants, f32_t, fma_fn, i64c, per_32
from .kquants import BIT_TYPES, GROUP, HAS_MIN, QK_K, quantize_q8_k_row

T = GGMLType
ROWS = 16  # weight rows per tile: the 16 int32 lanes of a zmm register
assert ROWS_PER_TASK == ROWS, "a MUL_MAT task is one tile of weight rows"
BIAS = {T.Q3_K: 4, T.Q6_K: 32, T.IQ4_XS: 128}  # signed codes stored as code + BIAS (unsigned bytes)
GROUPS = QK_K // 4  # 4-byte groups per block: one vpdpbusd each
V16 = vec(i32_t, 16)
F16 = vec(f32_t, 16)
# activation rows whose sums stay in registers at once (2 x COLS of the 32 zmm registers); fewer where
# vpdpbusd is emulated, which only tests run
COLS = 8 if HAS_VNNI else 2


def _make_tile(type_: GGMLType):
    """Intrinsic tile(w, base, nb01, nrows, nblk, yq, yd, ybs, col0, ncols, cstride, bstride, acc) -> 0:
    weight rows at byte base, base + nb01, ... (nrows <= 16) dotted with activation rows
    col0..col0+ncols-1 of the flat Q8_K scratch, where block b of row j is Q8_K block j * cstride +
    b * bstride (row-major: nblk, 1; block-major: 1, rows, which reads a block's activation rows one
    after another); acc (float32, ncols * 16, zeroed) receives row r's result for activation row
    col0 + j at j * 16 + r."""
    size = TYPE_TRAITS[type_].type_size
    bias = BIAS.get(type_, 0)
    nsub = 8 if per_32(type_) else 16  # sub-blocks with their own scale: of 32 or of 16 elements
    per_sub = GROUPS // nsub  # 4-byte groups per sub-block

    @intrinsic
    def tile(typingctx, w, base, nb01, nrows, nblk, yq, yd, ybs, col0, ncols, cstride, bstride, acc):
        sig = types.int64(w, types.int64, types.int64, types.int64, types.int64, yq, yd, ybs, types.int64,
                          types.int64, types.int64, types.int64, acc)

        def codegen(context, builder, signature, args):
            a = Args(context, builder, signature, args)
            base_, nb01_, nrows_, nblk_, _, _, _, col0_, ncols_, cstride_, bstride_ = (args[i] for i in range(1, 12))
            # the decoded block: codes [group][row] as i32, scales and minimums [sub-block][row], d, dmin
            codes = cgutils.alloca_once(builder, ir.ArrayType(i32_t, GROUPS * ROWS))
            staged = cgutils.alloca_once(builder, ir.ArrayType(i32_t, ROWS * GROUPS))  # [row][group], decoded
            scales = cgutils.alloca_once(builder, ir.ArrayType(i32_t, nsub * ROWS))
            mins = cgutils.alloca_once(builder, ir.ArrayType(i32_t, nsub * ROWS))
            ds = cgutils.alloca_once(builder, ir.ArrayType(f32_t, 2 * ROWS))
            for buf in (codes, staged, scales, mins, ds):
                buf.align = 64
            at_i32 = lambda buf, i: builder.gep(buf, [ir.Constant(i32_t, 0), i])  # noqa: E731

            def load_v(buf, i, t=V16):  # the vector at element i of a scratch
                return builder.load(builder.bitcast(at_i32(buf, ir.Constant(i32_t, i)), t.as_pointer()), align=64)

            last = builder.sub(nrows_, i64c(1))
            prefetch = llvm_fn(builder, "llvm.prefetch.p0", ir.VoidType(), [i8_t.as_pointer()] + [i32_t] * 3)
            with cgutils.for_range(builder, nblk_) as blocks:
                b = blocks.index
                with cgutils.for_range(builder, i64c(ROWS)) as rows:  # decode: rows past nrows repeat the last
                    r = rows.index
                    rr = builder.select(builder.icmp_signed("<", r, nrows_), r, last)
                    p = builder.add(builder.add(base_, builder.mul(rr, nb01_)), builder.mul(b, i64c(size)))
                    at = lambda o, ty: a.bytes_at(0, builder.add(p, i64c(o)), ty)  # noqa: E731
                    for line in range(0, size, 64):  # the row's next block, while this one is multiplied
                        ahead = byte_ptr(context, builder, a.types[0], a.values[0],
                                         builder.add(p, i64c(size + line)), i8_t)
                        builder.call(prefetch, [ahead, ir.Constant(i32_t, 0), ir.Constant(i32_t, 3),
                                                ir.Constant(i32_t, 1)])
                    sc, mn, d, dmin = block_scales(builder, type_, at)
                    r32 = builder.trunc(r, i32_t)
                    for s in range(nsub):
                        g = ir.Constant(i32_t, 2 * s if nsub == 8 else s)
                        idx = builder.add(ir.Constant(i32_t, s * ROWS), r32)
                        builder.store(builder.extract_element(sc, g), at_i32(scales, idx))
                        if HAS_MIN[type_]:
                            builder.store(builder.extract_element(mn, g), at_i32(mins, idx))
                    fds = builder.bitcast(ds, f32_t.as_pointer())
                    builder.store(d, builder.gep(fds, [r32]))
                    builder.store(dmin, builder.gep(fds, [builder.add(r32, ir.Constant(i32_t, ROWS))]))
                    for c in range(QK_K // 32):
                        q = chunk_quants(builder, at, type_, c, signed=False)
                        if type_ == T.Q3_K:  # chunk_quants subtracts Q3_K's 4; keep the unsigned code
                            q = builder.add(q, ir.Constant(vec(i8_t, 32), [4] * 32))
                        elif type_ == T.IQ4_XS:  # table values -127..113 + 128
                            q = builder.xor(q, ir.Constant(vec(i8_t, 32), [0x80] * 32))
                        idx = builder.add(builder.mul(r32, ir.Constant(i32_t, GROUPS)), ir.Constant(i32_t, 8 * c))
                        builder.store(q, builder.bitcast(at_i32(staged, idx), q.type.as_pointer()), align=32)
                _transpose_groups(builder, staged, codes, load_v, at_i32)
                d_v, dmin_v = load_v(ds, 0, F16), load_v(ds, ROWS, F16)
                neg_dmin = builder.fsub(ir.Constant(F16, [-0.0] * 16), dmin_v)
                fma = fma_fn(builder, 16)

                def run(col, n):
                    """Activation rows col..col+n-1 of block b into their acc rows."""
                    yb = [builder.add(builder.mul(b, bstride_), builder.mul(builder.add(col, i64c(j)), cstride_))
                          for j in range(n)]
                    yoff = [builder.mul(x, i64c(QK_K)) for x in yb]
                    zero = ir.Constant(V16, [0] * 16)
                    s1, s2 = [zero] * n, [zero] * n
                    for s in range(nsub):
                        raw = [zero] * n
                        for g in range(s * per_sub, (s + 1) * per_sub):
                            wv = load_v(codes, g * ROWS)
                            for j in range(n):
                                y = a.bytes_at(5, builder.add(yoff[j], i64c(4 * g)), i32_t)
                                raw[j] = dpbusd(builder, raw[j], wv, splat(builder, y, 16))
                        sc = load_v(scales, s * ROWS)
                        mn = load_v(mins, s * ROWS) if HAS_MIN[type_] else None
                        for j in range(n):
                            gi = builder.add(builder.mul(yb[j], i64c(16)), i64c(s * (16 // nsub)))
                            bsum = a.elem(7, gi)
                            if nsub == 8:
                                bsum = builder.add(bsum, a.elem(7, builder.add(gi, i64c(1))))
                            if bias:
                                raw[j] = builder.sub(raw[j], splat(builder, builder.mul(bsum, ir.Constant(
                                    i32_t, bias)), 16))
                            s1[j] = builder.add(s1[j], builder.mul(raw[j], sc))
                            if mn is not None:
                                s2[j] = builder.add(s2[j], builder.mul(mn, splat(builder, bsum, 16)))
                    for j in range(n):
                        r = builder.fmul(d_v, builder.sitofp(s1[j], F16))
                        if HAS_MIN[type_]:
                            r = builder.call(fma, [neg_dmin, builder.sitofp(s2[j], F16), r])
                        out = elem_ptr(context, builder, a.types[12], a.values[12],
                                       builder.mul(builder.sub(builder.add(col, i64c(j)), col0_), i64c(ROWS)))
                        out = builder.bitcast(out, F16.as_pointer())
                        d_y = splat(builder, a.elem(6, yb[j]), 16)
                        builder.store(builder.call(fma, [r, d_y, builder.load(out, align=4)]), out, align=4)

                full = builder.sdiv(ncols_, i64c(COLS))
                with cgutils.for_range(builder, full) as tiles:
                    run(builder.add(col0_, builder.mul(tiles.index, i64c(COLS))), COLS)
                with cgutils.for_range(builder, builder.sub(ncols_, builder.mul(full, i64c(COLS)))) as rest:
                    run(builder.add(builder.add(col0_, builder.mul(full, i64c(COLS))), rest.index), 1)
            return i64c(0)

        return sig, codegen

    return tile


def _transpose_groups(builder, staged, codes, load_v, at_i32):
    """codes[g][r] = staged[r][g]: each 16 x 16 square of 4-byte groups transposed in registers, by
    swapping the off-diagonal d x d blocks of every 2d x 2d block for d = 1, 2, 4, 8 (two-source
    shuffles), instead of one scalar store per group and row."""
    for g0 in range(0, GROUPS, ROWS):
        v = [load_v(staged, r * GROUPS + g0) for r in range(ROWS)]
        for d in (1, 2, 4, 8):
            for i in range(ROWS):
                if i & d:
                    continue
                j = i + d
                lo = [lane if not lane & d else ROWS + lane - d for lane in range(ROWS)]
                hi = [lane + d if not lane & d else ROWS + lane for lane in range(ROWS)]
                v[i], v[j] = (builder.shuffle_vector(v[i], v[j], ir.Constant(vec(i32_t, ROWS), m)) for m in (lo, hi))
        for g in range(ROWS):
            ptr = builder.bitcast(at_i32(codes, ir.Constant(i32_t, (g0 + g) * ROWS)), V16.as_pointer())
            builder.store(v[g], ptr, align=64)


_q2k, _q3k, _q4k, _q5k, _q6k, _iq4xs = (_make_tile(t) for t in BIT_TYPES + (T.IQ4_XS,))


@numba.njit(inline="always", **JIT)
def vnni_tile(kind, w, base, nb01, nrows, nblk, yq, yd, ybs, col0, ncols, cstride, bstride, acc):
    if kind == TYPE_Q2_K:
        return _q2k(w, base, nb01, nrows, nblk, yq, yd, ybs, col0, ncols, cstride, bstride, acc)
    if kind == TYPE_Q3_K:
        return _q3k(w, base, nb01, nrows, nblk, yq, yd, ybs, col0, ncols, cstride, bstride, acc)
    if kind == TYPE_Q4_K:
        return _q4k(w, base, nb01, nrows, nblk, yq, yd, ybs, col0, ncols, cstride, bstride, acc)
    if kind == TYPE_Q5_K:
        return _q5k(w, base, nb01, nrows, nblk, yq, yd, ybs, col0, ncols, cstride, bstride, acc)
    if kind == TYPE_Q6_K:
        return _q6k(w, base, nb01, nrows, nblk, yq, yd, ybs, col0, ncols, cstride, bstride, acc)
    return _iq4xs(w, base, nb01, nrows, nblk, yq, yd, ybs, col0, ncols, cstride, bstride, acc)


@numba.njit(inline="always", **JIT)
def quantize_block_major(row, j, nall, yq, yd, ybs):
    """Activation row j (float32, K) into Q8_K in the block-major scratch of nall rows that tile() reads:
    Q8_K quantizes each 256-block on its own, so this is quantize_q8_k_row block by block."""
    for b in range(row.size // QK_K):
        i = b * nall + j
        quantize_q8_k_row(row[b * QK_K:(b + 1) * QK_K], yq[i * QK_K:(i + 1) * QK_K], yd[i:i + 1],
                          ybs[i * (QK_K // GROUP):(i + 1) * (QK_K // GROUP)])
