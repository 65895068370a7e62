"""The two products of FLASH_ATTN_EXT's tiled path (kernels/ops/attention.py, _tiled_row) with their
accumulators held in vector registers: plain numba loops over the tile load and store every partial
sum on each step. The float order is the loops' own: each score one FMA chain over d in order from 0,
each output element one FMA chain over the tile's rows in order (ggml's simd_gemm).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from wire.ggml import FA_TILE_KV as TILE  # scores per KV tile
from .llvm import f32_t, i64_t, llvm_fn, splat, vec


def _fma(builder, n):
    return llvm_fn(builder, f"llvm.fma.v{n}f32", vec(f32_t, n), [vec(f32_t, n)] * 3)


def _at(builder, data, index, n):
    """Pointer to n floats at element `index` of a float pointer."""
    return builder.bitcast(builder.gep(data, [index]), vec(f32_t, n).as_pointer())


@intrinsic
def kq_tile(typingctx, kt, ic, q, kq):
    """kq[t] = sum over d of kt[d, ic + t] * q[d] as one FMA chain from 0, for t < TILE (a full tile):
    kt (DK, n_kv) float32 with contiguous rows, q (DK,) float32, kq (TILE,) contiguous float32."""
    sig = types.none(kt, types.int64, q, kq)

    def codegen(context, builder, signature, args):
        kt_ = context.make_array(signature.args[0])(context, builder, args[0])
        q_ = context.make_array(signature.args[2])(context, builder, args[2])
        kq_ = context.make_array(signature.args[3])(context, builder, args[3])
        dk = builder.extract_value(kt_.shape, 0)
        row = builder.sdiv(builder.extract_value(kt_.strides, 0), ir.Constant(i64_t, 4))
        qstep = builder.sdiv(builder.extract_value(q_.strides, 0), ir.Constant(i64_t, 4))
        acc = cgutils.alloca_once_value(builder, ir.Constant(vec(f32_t, TILE), [0.0] * TILE))
        fma = _fma(builder, TILE)
        with cgutils.for_range(builder, dk) as loop:
            d = loop.index
            k = builder.load(_at(builder, kt_.data, builder.add(builder.mul(d, row), args[1]), TILE), align=4)
            qd = splat(builder, builder.load(builder.gep(q_.data, [builder.mul(d, qstep)])), TILE)
            builder.store(builder.call(fma, [k, qd, builder.load(acc)]), acc)
        builder.store(builder.load(acc), _at(builder, kq_.data, ir.Constant(i64_t, 0), TILE), align=4)
        return context.get_dummy_value()

    return sig, codegen


def _make_v_tile(width: int):
    @intrinsic
    def v_tile(typingctx, v, ic, n, p, out):
        """out[d] = fma(v[ic + t, d], p[t], out[d]) for t < n in order, for every d (DV a multiple of
        `width`): v (n_kv, DV) with contiguous rows, p (>= n,) and out (DV,) contiguous float32."""
        sig = types.none(v, types.int64, types.int64, p, out)

        def codegen(context, builder, signature, args):
            v_ = context.make_array(signature.args[0])(context, builder, args[0])
            p_ = context.make_array(signature.args[3])(context, builder, args[3])
            o_ = context.make_array(signature.args[4])(context, builder, args[4])
            dv = builder.extract_value(o_.shape, 0)
            row = builder.sdiv(builder.extract_value(v_.strides, 0), ir.Constant(i64_t, 4))
            fma = _fma(builder, width)
            with cgutils.for_range(builder, builder.sdiv(dv, ir.Constant(i64_t, width))) as chunks:
                d0 = builder.mul(chunks.index, ir.Constant(i64_t, width))
                out_ptr = _at(builder, o_.data, d0, width)
                acc = cgutils.alloca_once(builder, vec(f32_t, width))
                builder.store(builder.load(out_ptr, align=4), acc)
                with cgutils.for_range(builder, args[2]) as rows:
                    t = rows.index
                    at = builder.add(builder.mul(builder.add(args[1], t), row), d0)
                    vt = builder.load(_at(builder, v_.data, at, width), align=4)
                    pt = splat(builder, builder.load(builder.gep(p_.data, [t])), width)
                    builder.store(builder.call(fma, [vt, pt, builder.load(acc)]), acc)
                builder.store(builder.load(acc), out_ptr, align=4)
            return context.get_dummy_value()

        return sig, codegen

    return v_tile


v_tile64, v_tile16 = _make_v_tile(64), _make_v_tile(16)


ROWS = 4  # query rows of one head that share each K and V load (4 x 4 zmm accumulators at TILE = 64)


@intrinsic
def kq_tile_rows(typingctx, kt, ic, q, kq):
    """kq_tile for ROWS query rows at once: kq[j, t] = sum over d of kt[d, ic + t] * q[j, d], each one FMA
    chain from 0 over d in order, so the scores are kq_tile's; q (ROWS, DK) and kq (ROWS, TILE) contiguous
    float32. Each K row segment is loaded once for the ROWS queries."""
    sig = types.none(kt, types.int64, q, kq)

    def codegen(context, builder, signature, args):
        kt_ = context.make_array(signature.args[0])(context, builder, args[0])
        q_ = context.make_array(signature.args[2])(context, builder, args[2])
        kq_ = context.make_array(signature.args[3])(context, builder, args[3])
        dk = builder.extract_value(kt_.shape, 0)
        row = builder.sdiv(builder.extract_value(kt_.strides, 0), ir.Constant(i64_t, 4))
        zero = ir.Constant(vec(f32_t, TILE), [0.0] * TILE)
        accs = [cgutils.alloca_once_value(builder, zero) for _ in range(ROWS)]
        fma = _fma(builder, TILE)
        with cgutils.for_range(builder, dk) as loop:
            d = loop.index
            k = builder.load(_at(builder, kt_.data, builder.add(builder.mul(d, row), args[1]), TILE), align=4)
            for j, acc in enumerate(accs):
                at = builder.add(builder.mul(ir.Constant(i64_t, j), dk), d)
                qd = splat(builder, builder.load(builder.gep(q_.data, [at])), TILE)
                builder.store(builder.call(fma, [k, qd, builder.load(acc)]), acc)
        for j, acc in enumerate(accs):
            builder.store(builder.load(acc), _at(builder, kq_.data, ir.Constant(i64_t, j * TILE), TILE), align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def v_tile_rows(typingctx, v, ic, n, p, out):
    """v_tile64 for ROWS query rows at once: out[j, d] = fma(v[ic + t, d], p[j, t], out[j, d]) for t < n in
    order (DV a multiple of 64); p (ROWS, TILE) and out (ROWS, DV) contiguous float32. Each V row
    segment is loaded once for the ROWS queries."""
    sig = types.none(v, types.int64, types.int64, p, out)
    width = 64

    def codegen(context, builder, signature, args):
        v_ = context.make_array(signature.args[0])(context, builder, args[0])
        p_ = context.make_array(signature.args[3])(context, builder, args[3])
        o_ = context.make_array(signature.args[4])(context, builder, args[4])
        dv = builder.extract_value(o_.shape, 1)
        row = builder.sdiv(builder.extract_value(v_.strides, 0), ir.Constant(i64_t, 4))
        fma = _fma(builder, width)
        with cgutils.for_range(builder, builder.sdiv(dv, ir.Constant(i64_t, width))) as chunks:
            d0 = builder.mul(chunks.index, ir.Constant(i64_t, width))
            outs = [_at(builder, o_.data, builder.add(builder.mul(ir.Constant(i64_t, j), dv), d0), width)
                    for j in range(ROWS)]
            accs = [cgutils.alloca_once(builder, vec(f32_t, width)) for _ in range(ROWS)]
            for acc, ptr in zip(accs, outs):
                builder.store(builder.load(ptr, align=4), acc)
            with cgutils.for_range(builder, args[2]) as rows:
                t = rows.index
                at = builder.add(builder.mul(builder.add(args[1], t), row), d0)
                vt = builder.load(_at(builder, v_.data, at, width), align=4)
                for j, acc in enumerate(accs):
                    pj = builder.load(builder.gep(p_.data, [builder.add(ir.Constant(i64_t, j * TILE), t)]))
                    builder.store(builder.call(fma, [vt, splat(builder, pj, width), builder.load(acc)]), acc)
            for acc, ptr in zip(accs, outs):
                builder.store(builder.load(acc), ptr, align=4)
        return context.get_dummy_value()

    return sig, codegen
