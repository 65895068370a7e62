"""LLVM building blocks for the kernels' numba intrinsics: IR types, vector helpers, pointers into numba
arrays, the int8 dot-product lanes of ggml's AVX2 code, and loading F32/F16/BF16 weights as float32
vectors. Plain numba loops do not vectorize the small fixed-width lane patterns ggml's SIMD code uses;
these emit them directly (quants.py, kquant_dot.py and float_dot512.py build their dot products here).
"""

from __future__ import annotations

import numba
from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba.core import cgutils

from wire.ggml import GGMLType

f32_t, i8_t, i16_t, i32_t, i64_t = ir.FloatType(), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
half_t = ir.HalfType()


def vec(t, n):
    return ir.VectorType(t, n)


def _host_has_avx2() -> bool:
    if numba.config.CPU_NAME not in (None, "host"):
        return False
    try:
        return bool(llvm_binding.get_host_cpu_features().get("avx2", False))
    except Exception:  # pragma: no cover - exotic hosts
        return False


HAS_AVX2 = _host_has_avx2()


def _host_has_vnni() -> bool:
    if numba.config.CPU_NAME not in (None, "host"):
        return False
    try:
        f = llvm_binding.get_host_cpu_features()
    except Exception:  # pragma: no cover - exotic hosts
        return False
    return all(f.get(x, False) for x in ("avx512f", "avx512bw", "avx512vl", "avx512vnni"))


HAS_VNNI = _host_has_vnni()  # AVX512_VNNI (with BW and VL): vpdpbusd on 256- and 512-bit vectors


def dpbusd(builder, acc, w, y):
    """acc + per int32 lane the sum of 4 products of w's unsigned bytes by y's signed bytes (acc <n x i32>,
    w and y the same n*4 bytes as <n x i32>, n = 8 or 16): one vpdpbusd with HAS_VNNI, else the same
    sums in plain vector integer operations (correct, slow)."""
    n = acc.type.count
    if HAS_VNNI:
        fn = llvm_fn(builder, f"llvm.x86.avx512.vpdpbusd.{32 * n}", acc.type, [acc.type] * 3)
        return builder.call(fn, [acc, w, y])
    wide = vec(i32_t, 4 * n)
    p = builder.mul(builder.zext(builder.bitcast(w, vec(i8_t, 4 * n)), wide),
                    builder.sext(builder.bitcast(y, vec(i8_t, 4 * n)), wide))
    for _ in range(2):  # neighbouring products summed twice: lane l = products 4l..4l+3
        m = p.type.count
        p = builder.add(shuffle(builder, p, p, list(range(0, m, 2))), shuffle(builder, p, p, list(range(1, m, 2))))
    return builder.add(acc, p)


PREFETCH_AHEAD = 1024  # bytes; streaming a big weight matrix (the Q8_0 output layer) gains ~30%


def llvm_fn(builder, name, ret, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def elem_ptr(context, builder, aryty, ary, index):
    """Pointer to element `index` of a C-contiguous 1-d array."""
    return builder.gep(context.make_array(aryty)(context, builder, ary).data, [index])


def byte_ptr(context, builder, aryty, ary, offset, elty):
    data = builder.bitcast(context.make_array(aryty)(context, builder, ary).data, i8_t.as_pointer())
    return builder.bitcast(builder.gep(data, [offset]), elty.as_pointer())


def shuffle(builder, a, b, idx):
    return builder.shuffle_vector(a, b, ir.Constant(vec(i32_t, len(idx)), idx))


def splat(builder, x, n=8):
    v = builder.insert_element(ir.Constant(vec(x.type, n), None), x, ir.Constant(i32_t, 0))
    return shuffle(builder, v, v, [0] * n)


def i8_dot_lanes(builder, w, y, unsigned_w=False):
    """<32 x i8> weights, <32 x i8> activations -> <8 x i32>; lane l = sum of products 4l..4l+3.
    ggml's AVX2 sequence: maddubs multiplies unsigned by signed bytes into int16 pair sums, madd with
    ones adds those pairs into the lanes. Signed weights first go through the sign trick (|w|, and y
    takes w's sign); unsigned_w says they lie in 0..127 already (Q4_1's and Q5_1's nibbles), as ggml's
    mul_sum_us8_pairs_float takes them."""
    if HAS_AVX2:
        v32, v16 = vec(i8_t, 32), vec(i16_t, 16)
        if not unsigned_w:
            psign = llvm_fn(builder, "llvm.x86.avx2.psign.b", v32, [v32, v32])
            w, y = builder.call(psign, [w, w]), builder.call(psign, [y, w])
        maddubs = llvm_fn(builder, "llvm.x86.avx2.pmadd.ub.sw", v16, [v32, v32])
        madd = llvm_fn(builder, "llvm.x86.avx2.pmadd.wd", vec(i32_t, 8), [v16, v16])
        return builder.call(madd, [builder.call(maddubs, [w, y]), ir.Constant(v16, [1] * 16)])
    p = builder.mul(builder.sext(w, vec(i32_t, 32)), builder.sext(y, vec(i32_t, 32)))
    even, odd = list(range(0, 32, 2)), list(range(1, 32, 2))
    p2 = builder.add(shuffle(builder, p, p, even), shuffle(builder, p, p, odd))
    return builder.add(shuffle(builder, p2, p2, even[:8]), shuffle(builder, p2, p2, odd[:8]))


def prefetch(builder, ptr):
    """A read hint; never faults, so running past the end of the buffer is harmless."""
    pf = llvm_fn(builder, "llvm.prefetch.p0i8", ir.VoidType(), [i8_t.as_pointer(), i32_t, i32_t, i32_t])
    builder.call(pf, [ptr, ir.Constant(i32_t, 0), ir.Constant(i32_t, 3), ir.Constant(i32_t, 1)])


def hsum8(builder, v):
    """ggml hsum_float_8: t = hi + lo, then (t0 + t2) + (t1 + t3)."""
    t = builder.fadd(shuffle(builder, v, v, [4, 5, 6, 7]), shuffle(builder, v, v, [0, 1, 2, 3]))
    e = [builder.extract_element(t, ir.Constant(i32_t, i)) for i in range(4)]
    return builder.fadd(builder.fadd(e[0], e[2]), builder.fadd(e[1], e[3]))


FLOAT_ELEM = {GGMLType.F32: (4, f32_t), GGMLType.F16: (2, half_t), GGMLType.BF16: (2, i16_t)}


def to_f32(builder, v, typ, n):
    if typ == GGMLType.F16:
        return builder.fpext(v, vec(f32_t, n)) if n > 1 else builder.fpext(v, f32_t)
    if typ == GGMLType.BF16:
        wide = vec(i32_t, n) if n > 1 else i32_t
        shifted = builder.shl(builder.zext(v, wide), ir.Constant(wide, [16] * n if n > 1 else 16))
        return builder.bitcast(shifted, vec(f32_t, n) if n > 1 else f32_t)
    return v
