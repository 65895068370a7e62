"""ROPE's NORMAL mode (adjacent pairs) as 16-lane vector code: numba's loop over interleaved pairs does not
vectorize, ggml's does (two pairs per step on AVX2).

Per 8 pairs, with x = [x0 x1 x0' x1' ...] and the cache row cs = [c s c' s' ...] laid out the same way:
y = fma(even(x), cs, b), where even(x) = [x0 x0 x0' x0' ...] and b = [-(x1 s), x1 c, ...]. So the even
lane is fma(x0, c, -(x1 s)) and the odd lane fma(x0, s, x1 c): ggml's contracted expressions exactly
(kernels/ops/rope.py _rotate), the negation a sign flip of the rounded product.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .llvm import f32_t, i32_t, i64_t, llvm_fn, vec

PAIRS = 8  # pairs per vector step: 16 float lanes


@intrinsic
def rotate_pairs(typingctx, src, dst, cs, first, n_steps):
    """Pairs [first/2, first/2 + 8 n_steps) of a row: dst[first + 2p], dst[first + 2p + 1] from src's and the
    cache row cs (n_pairs, 2) of pair p; src, dst and cs contiguous float32 (dst may be src)."""
    sig = types.none(src, dst, cs, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        arrays = [context.make_array(signature.args[i])(context, builder, args[i]) for i in range(3)]
        s_data, d_data, c_data = (a.data for a in arrays)
        v16 = vec(f32_t, 16)
        fma = llvm_fn(builder, "llvm.fma.v16f32", v16, [v16] * 3)
        even = ir.Constant(vec(i32_t, 16), [i - i % 2 for i in range(16)])
        odd = ir.Constant(vec(i32_t, 16), [i - i % 2 + 1 for i in range(16)])
        swap = ir.Constant(vec(i32_t, 16), [i ^ 1 for i in range(16)])
        sign = ir.Constant(vec(i32_t, 16), [(-(1 << 31)) if i % 2 == 0 else 0 for i in range(16)])
        undef = ir.Constant(v16, ir.Undefined)
        with cgutils.for_range(builder, args[4]) as loop:
            k = builder.mul(loop.index, ir.Constant(i64_t, 16))
            at = builder.add(args[3], k)

            def ptr(data, index):
                return builder.bitcast(builder.gep(data, [index]), v16.as_pointer())

            x = builder.load(ptr(s_data, at), align=4)
            c = builder.load(ptr(c_data, k), align=4)
            xe = builder.shuffle_vector(x, undef, even)
            xo = builder.shuffle_vector(x, undef, odd)
            b = builder.fmul(xo, builder.shuffle_vector(c, undef, swap))
            b = builder.bitcast(builder.xor(builder.bitcast(b, vec(i32_t, 16)), sign), v16)
            builder.store(builder.call(fma, [xe, c, b]), ptr(d_data, at), align=4)
        return context.get_dummy_value()

    return sig, codegen
