"""Float math shared by kernels: fused multiply-add, bit casts, ggml's vector exp, fp16/bf16 rounding.

Everything here matches what this x86-64 build of ggml-cpu (AVX2 + FMA + F16C, GCC) computes:
- `fma32`: a*b + c rounded once in float32 (llvm.fma, i.e. vfmadd);
- `f32_to_bits` / `f32_from_bits`: IEEE bit casts;
- `v_expf`: one lane of ggml's AVX2 `ggml_v_expf` (vec.h), with its numpy twin `np_v_expf`;
  `v_expf16` / `np_v_expf16` the AVX-512 one;
- `hsum16` / `np_hsum16`: the tree in which gcc's `_mm512_reduce_add_ps` adds 16 lanes;
- fp16: `f16_to_f32`, `f32_to_f16` (F16C round to nearest even), `round_f16` (to the nearest fp16
  value, kept as float32), with bit-level software fallbacks for hosts without F16C;
- bf16: `bf16_to_f32`, `f32_to_bf16` (ggml's own rounding formula).
"""

from __future__ import annotations

import llvmlite.binding as llvm_binding
import numba
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from .jit import JIT

F32 = np.float32

# ---------------------------------------------------------------------------------------------
# fused multiply-add and bit casts


@intrinsic
def fma32(typingctx, a, b, c):
    """Single-rounding a*b + c in float32 (llvm.fma.f32: vfmadd on this CPU)."""

    def codegen(context, builder, sig, args):
        f32 = ir.FloatType()
        vals = [context.cast(builder, v, t, types.float32) for v, t in zip(args, sig.args)]
        fn = builder.module.declare_intrinsic("llvm.fma", [f32], ir.FunctionType(f32, [f32, f32, f32]))
        return builder.call(fn, vals)

    return types.float32(a, b, c), codegen


@intrinsic
def f32_from_bits(typingctx, bits):
    """Reinterpret the low 32 bits of an integer as a float32."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        word = context.cast(builder, args[0], sig.args[0], types.uint32)
        return builder.bitcast(word, context.get_value_type(types.float32))

    return types.float32(bits), codegen


@intrinsic
def f32_to_bits(typingctx, value):
    """Reinterpret a float32 as a uint32."""
    if not isinstance(value, types.Float):
        return None

    def codegen(context, builder, sig, args):
        single = context.cast(builder, args[0], sig.args[0], types.float32)
        return builder.bitcast(single, context.get_value_type(types.uint32))

    return types.uint32(value), codegen


@intrinsic
def _scale_bits(typingctx, z, addend):
    """f32_from_bits((f32_to_bits(z) << 23) + addend) in wrapping 32-bit arithmetic (ggml_v_expf's 2**n)."""
    sig = types.float32(types.float32, types.uint32)

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        bits = builder.shl(builder.bitcast(args[0], i32), ir.Constant(i32, 23))
        return builder.bitcast(builder.add(bits, args[1]), ir.FloatType())

    return sig, codegen


# ---------------------------------------------------------------------------------------------
# ggml_v_expf

# polynomial and range-reduction constants of ggml_v_expf (an Arm optimized-routines exp)
_EXP_SHIFT = F32(float.fromhex("0x1.8p23"))
_EXP_LOG2E = F32(float.fromhex("0x1.715476p+0"))
_EXP_LN2_HI = F32(float.fromhex("0x1.62e4p-1"))
_EXP_LN2_LO = F32(float.fromhex("0x1.7f7d1cp-20"))
_EXP_P0 = F32(float.fromhex("0x1.0e4020p-7"))
_EXP_P1 = F32(float.fromhex("0x1.573e2ep-5"))
_EXP_P2 = F32(float.fromhex("0x1.555e66p-3"))
_EXP_P3 = F32(float.fromhex("0x1.fffdb6p-2"))
_EXP_P4 = F32(float.fromhex("0x1.ffffecp-1"))
_M32 = 0xFFFFFFFF


@numba.njit(inline="always", **JIT)
def v_expf(x):
    """One lane of ggml's AVX2 ggml_v_expf (vec.h), which differs from expf by up to ~1.5 ulp.

    Both of ggml's branches are evaluated and selected per lane, so loops over it vectorize; the
    lanes a branch does not serve get harmless operands (1.0) so that no subnormal slows them down.
    """
    z = fma32(x, _EXP_LOG2E, _EXP_SHIFT)
    n = z - _EXP_SHIFT
    b = fma32(-n, _EXP_LN2_HI, x)
    b = fma32(-n, _EXP_LN2_LO, b)
    u = b * b
    j = fma32(fma32(fma32(_EXP_P0, b, _EXP_P1), u, fma32(_EXP_P2, b, _EXP_P3)), u, _EXP_P4 * b)
    wide = abs(n) > F32(126.0)
    k = _scale_bits(z, np.uint32(0x3F800000)) if not wide else F32(1.0)
    near = fma32(k, j, k)
    # |n| > 126: the scale 2**n is split in two factors to reach the subnormal and overflow ranges
    low = n <= F32(0.0)
    s1 = (F32(2.0**-125) if low else F32(2.0**127)) if wide else F32(1.0)
    s2 = _scale_bits(z, np.uint32(0x7E000000) if low else np.uint32(0)) if wide else F32(1.0)
    mid = fma32(s2, j, s2) * s1
    far = F32(0.0) if low else F32(np.inf)  # = s1 * s1, which under- or overflows
    return near if not wide else (far if abs(n) > F32(192.0) else mid)


@numba.njit(inline="always", **JIT)
def v_expf16(x):
    """One lane of ggml's AVX-512 ggml_v_expf: the same range reduction and polynomial, but 1 + P4*b is
    inside the polynomial and 2**n is applied by VSCALEFPS (one rounding, into the subnormals too)."""
    z = fma32(x, _EXP_LOG2E, _EXP_SHIFT)
    n = z - _EXP_SHIFT
    b = fma32(-n, _EXP_LN2_LO, fma32(-n, _EXP_LN2_HI, x))
    u = b * b
    j = fma32(fma32(fma32(_EXP_P0, b, _EXP_P1), u, fma32(_EXP_P2, b, _EXP_P3)), u, fma32(_EXP_P4, b, F32(1.0)))
    # j * 2**n rounded once, without branches (so loops over it vectorize): beyond float32's normal
    # exponents 2**n is split as 2**e * 2**+-(126|127), and j * 2**e is exact, so only the last multiply rounds
    m = n if abs(n) <= F32(192.0) else F32(0.0)  # NaN too
    hi, lo = m > F32(126.0), m < F32(-126.0)
    e = np.int32(m) - (np.int32(127) if hi else (np.int32(-126) if lo else np.int32(0)))
    fix = F32(2.0**127) if hi else (F32(2.0**-126) if lo else F32(1.0))
    r = (j * f32_from_bits(np.uint32((e + 127) << 23))) * fix
    far = F32(0.0) if n <= F32(0.0) else F32(np.inf)
    return r if abs(n) <= F32(192.0) else (far if n == n else n)


@numba.njit(inline="always", **JIT)
def hsum16(a, i):
    """a[i] + ... + a[i + 15] as gcc's _mm512_reduce_add_ps adds them: 256-bit halves, 128-bit halves,
    lanes {2,3} onto {0,1}, then lane 0 + lane 1."""
    t0 = (a[i + 12] + a[i + 4]) + (a[i + 8] + a[i + 0])
    t1 = (a[i + 13] + a[i + 5]) + (a[i + 9] + a[i + 1])
    t2 = (a[i + 14] + a[i + 6]) + (a[i + 10] + a[i + 2])
    t3 = (a[i + 15] + a[i + 7]) + (a[i + 11] + a[i + 3])
    return (t0 + t2) + (t1 + t3)


# ---------------------------------------------------------------------------------------------
# fp16: ggml converts with F16C instructions (round to nearest even). LLVM's half type compiles to
# the same instructions (vcvtps2ph/vcvtph2ps) when the host has F16C; the bit-level versions are the
# exact fallback.

HAS_F16C = bool(llvm_binding.get_host_cpu_features().get("f16c", False))


@numba.njit(**JIT)
def f16_to_f32_soft(h):
    """An F16 bit pattern (any integer holding 16 bits) as float32; NaNs come out quiet, as with F16C."""
    h = np.uint32(h) & np.uint32(0xFFFF)
    sign = (h & np.uint32(0x8000)) << np.uint32(16)
    exp = (h >> np.uint32(10)) & np.uint32(0x1F)
    man = h & np.uint32(0x3FF)
    if exp == 0x1F:
        quiet = np.uint32(0x400000) if man != 0 else np.uint32(0)
        return f32_from_bits(sign | np.uint32(0x7F800000) | quiet | (man << np.uint32(13)))
    if exp == 0:
        # zero or subnormal: man * 2^-24 is exact in float32
        mag = np.float32(man) * np.float32(5.9604644775390625e-08)
        return -mag if sign else mag
    return f32_from_bits(sign | ((exp + np.uint32(112)) << np.uint32(23)) | (man << np.uint32(13)))


@numba.njit(**JIT)
def f32_to_f16_soft(value):
    """float32 -> F16 bits (uint16), round-to-nearest-even like the F16C `vcvtps2ph` ggml uses here."""
    u = f32_to_bits(np.float32(value))
    sign = (u >> np.uint32(16)) & np.uint32(0x8000)
    a = u & np.uint32(0x7FFFFFFF)
    if a > 0x7F800000:  # NaN: keep the top payload bits, force quiet
        return np.uint16(sign | np.uint32(0x7E00) | ((a >> np.uint32(13)) & np.uint32(0x3FF)))
    if a >= 0x477FF000:  # rounds to (or is) infinity
        return np.uint16(sign | np.uint32(0x7C00))
    if a >= 0x38800000:  # normal in f16: rebias the exponent, round the dropped 13 bits
        r = a - np.uint32(0x38000000)
        r = r + np.uint32(0xFFF) + ((r >> np.uint32(13)) & np.uint32(1))
        return np.uint16(sign | (r >> np.uint32(13)))
    # f16 subnormal (or zero): count units of 2^-24, rounding half to even
    e = np.int64(a >> np.uint32(23))
    shift = 126 - e
    if shift >= 25:
        return np.uint16(sign)  # under half a unit (f32 subnormals included): rounds to zero
    m = np.int64((a & np.uint32(0x7FFFFF)) | np.uint32(0x800000))
    q = m >> shift
    rem = m & ((np.int64(1) << shift) - 1)
    half = np.int64(1) << (shift - 1)
    if rem > half or (rem == half and (q & 1) == 1):
        q += 1
    return np.uint16(sign | np.uint32(q))


@numba.njit(inline="always", **JIT)
def _round_f16_sw(x):
    # adding and removing 1.5 * 2**(e+13) makes the float32 adder round at fp16's ulp for x's binade
    ex = f32_to_bits(x) & np.uint32(0x7F800000)
    # below fp16's smallest normal the grid is fixed at 2**-24; far above its range anything is inf
    ex = min(max(ex, np.uint32(113 << 23)), np.uint32(143 << 23))
    magic = f32_from_bits(np.uint32(ex + np.uint32((13 << 23) + 0x00400000)))
    r = (x + magic) - magic
    r = x * F32(0.0) if r == F32(0.0) else r  # keep the sign of zero
    big = F32(np.inf) if r > F32(0.0) else F32(-np.inf)
    return big if abs(r) > F32(65504.0) else r


@intrinsic
def _f32_to_f16_hw(typingctx, value):
    if not isinstance(value, types.Float):
        return None

    def codegen(context, builder, sig, args):
        single = context.cast(builder, args[0], sig.args[0], types.float32)
        return builder.bitcast(builder.fptrunc(single, ir.HalfType()), ir.IntType(16))

    return types.uint16(value), codegen


@intrinsic
def _f16_to_f32_hw(typingctx, bits):
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        word = context.cast(builder, args[0], sig.args[0], types.uint16)
        return builder.fpext(builder.bitcast(word, ir.HalfType()), ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def _round_f16_hw(typingctx, x):
    sig = types.float32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.fptrunc(args[0], ir.HalfType()), ir.FloatType())

    return sig, codegen


@numba.njit(inline="always", **JIT)
def f16_to_f32(h):
    """An F16 bit pattern (any integer holding 16 bits) as float32."""
    if HAS_F16C:
        return _f16_to_f32_hw(np.uint16(h))
    return f16_to_f32_soft(h)


@numba.njit(inline="always", **JIT)
def f32_to_f16(value):
    """float32 -> F16 bits (uint16), rounded to nearest even."""
    if HAS_F16C:
        return _f32_to_f16_hw(np.float32(value))
    return f32_to_f16_soft(value)


round_f16 = _round_f16_hw if HAS_F16C else _round_f16_sw  # float32 -> nearest fp16 value, as float32

# ---------------------------------------------------------------------------------------------
# bf16

@numba.njit(inline="always", **JIT)
def bf16_to_f32(h):
    return f32_from_bits((np.uint32(h) & np.uint32(0xFFFF)) << np.uint32(16))


@numba.njit(inline="always", **JIT)
def f32_to_bf16(value):
    """ggml_compute_fp32_to_bf16: round to nearest even; NaNs are truncated and forced quiet."""
    u = f32_to_bits(np.float32(value))
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16((u >> np.uint32(16)) | np.uint32(64))
    return np.uint16((u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16))


# ---------------------------------------------------------------------------------------------
# numpy twins, for references and tests

def np_f16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint16).view(np.float16).astype(np.float32)


def np_f32_to_f16_bits(values: np.ndarray) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).astype(np.float16).view(np.uint16)


def np_bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def np_f32_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    u = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, ((u >> 16) | 64).astype(np.uint16), rounded)


def np_fma(a, b, c):
    """Correctly rounded float32 a*b + c (numpy has no fma). The product is exact in float64; TwoSum
    gives the exact sum as s + err, and err's sign only matters when s is a float32 halfway point."""
    a, b, c = (np.asarray(v, np.float64) for v in (a, b, c))
    p = a * b
    s = p + c
    z = s - p
    err = (p - (s - z)) + (c - z)
    tie = (s.view(np.int64) & 0x1FFFFFFF) == 0x10000000
    s = np.where(tie & (err != 0), np.nextafter(s, np.copysign(np.inf, err)), s)
    return s.astype(F32)


def _np_exp_reduce(x: np.ndarray):
    """ggml_v_expf's range reduction, as both builds do it: z (shifted), n = round(x / ln 2), b, b * b."""
    z = np_fma(x, _EXP_LOG2E, _EXP_SHIFT)
    n = z - _EXP_SHIFT
    b = np_fma(-n, _EXP_LN2_LO, np_fma(-n, _EXP_LN2_HI, x))
    return z, n, b, b * b


def np_v_expf(x: np.ndarray) -> np.ndarray:
    """Vectorized twin of v_expf."""
    x = np.asarray(x, F32)
    with np.errstate(invalid="ignore", over="ignore"):
        z, n, b, u = _np_exp_reduce(x)
        e = (z.view(np.uint32).astype(np.int64) << 23) & _M32
        k = ((e + 0x3F800000) & _M32).astype(np.uint32).view(F32)
        j = np_fma(np_fma(np_fma(_EXP_P0, b, _EXP_P1), u, np_fma(_EXP_P2, b, _EXP_P3)), u, _EXP_P4 * b)
        g = np.where(n <= 0, 0x82000000, 0)
        s1 = ((g + 0x7F000000) & _M32).astype(np.uint32).view(F32)
        s2 = ((e - g) & _M32).astype(np.uint32).view(F32)
        far = np.where(np.abs(n) > 192, s1 * s1, np_fma(s2, j, s2) * s1)
        return np.where(np.abs(n) > 126, far, np_fma(k, j, k)).astype(F32)


def np_v_expf16(x: np.ndarray) -> np.ndarray:
    """Vectorized twin of v_expf16."""
    x = np.asarray(x, F32)
    with np.errstate(invalid="ignore", over="ignore"):
        _, n, b, u = _np_exp_reduce(x)
        j = np_fma(np_fma(np_fma(_EXP_P0, b, _EXP_P1), u, np_fma(_EXP_P2, b, _EXP_P3)), u, np_fma(_EXP_P4, b, F32(1)))
        scaled = np.ldexp(j, np.where(np.abs(n) > 192, 0, np.nan_to_num(n)).astype(np.int32))
        far = np.where(n <= 0, F32(0), F32(np.inf))
        return np.where(np.abs(n) > 192, far, np.where(np.isnan(n), n, scaled)).astype(F32)


def np_hsum16(a: np.ndarray) -> np.ndarray:
    """Twin of hsum16 over the last axis (16 lanes)."""
    t = a[..., 8:16] + a[..., 0:8]
    t = t[..., 4:8] + t[..., 0:4]
    return (t[..., 0] + t[..., 2]) + (t[..., 1] + t[..., 3])
