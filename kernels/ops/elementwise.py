"""Element-wise ops: ADD/SUB/MUL/DIV with broadcasting, SCALE, CLAMP, SQR/SQRT and UNARY (GLU is in glu.py).

Arithmetic follows ggml-cpu as built here (x86-64, GCC with contraction on), for the node's target:
- SILU (and SWIGLU) run ggml's vector `ggml_v_silu` on each full group of `target.lanes` elements of a
  row and libm `expf` on the remaining tail: the AVX2 build's 8-wide `ggml_v_expf` (`fmath.v_expf`)
  or the AVX-512 build's 16-wide one (`fmath.v_expf16`, VSCALEFPS). Everything else here is the same
  per element in both builds (their SIMD bodies and scalar leftovers compute identical operations).
- GELU and GELU_QUICK (and GEGLU, GEGLU_QUICK) read a 65536-entry F16 table indexed by the input
  rounded to F16 (GGML_GELU_FP16); GELU passes inputs beyond +-10 through without the table.
- SCALE with a bias is a fused multiply-add.
- CLAMP is ggml's MAX(MIN(x, max), min) with the C macros' comparisons, so NaN becomes max.
"""

from __future__ import annotations

import math
from functools import partial

import numba
import numpy as np
from numba import prange

from wire.ggml import TYPE_F32, TYPE_TRAITS, GGMLOp, GGMLType, GGMLUnaryOp

from .. import storage as st
from ..activations import SQR as _SQR, SQRT as _SQRT
from ..activations import gelu_erf, gelu_table, gelu_tables, reference_unary_values, silu_scalar, silu_vec
from ..fmath import f16_to_f32, f32_to_f16, fma32
from ..jit import JIT, row_loop
from ..node import InvalidNode, Node
from ..registry import OpKernel, nothing, prepared, register
from ..storage import rows_contiguous

F32 = np.float32


@numba.njit(inline="always", **JIT)
def _clamp01(t):
    """fminf(1, fmaxf(0, t)): NaN becomes 0."""
    return F32(0.0) if not t > F32(0.0) else (t if t < F32(1.0) else F32(1.0))


@numba.njit(inline="always", **JIT)
def _clamp(x, lo, hi):
    """MAX(MIN(x, hi), lo) with ggml's macros: MIN(a, b) = a < b ? a : b, MAX(a, b) = a > b ? a : b."""
    t = x if x < hi else hi
    return t if t > lo else lo


@numba.njit(inline="always", **JIT)
def _roundf(x):
    """C roundf: halfway cases away from zero."""
    t = np.trunc(x)
    if abs(x - t) >= F32(0.5):
        t += math.copysign(F32(1.0), x)
    return F32(t)


# ---------------------------------------------------------------------------------------------
# UNARY (and SQR/SQRT, which are ops of their own but the same kind of kernel)

U = GGMLUnaryOp
_SCALE = 1002  # private code for GGML_OP_SCALE (SQR/SQRT: activations.SQR/SQRT)
_CLAMP = 1003  # private code for GGML_OP_CLAMP: op_params (min, max) travel as (s, bias)

# sub-ops whose forward is a plain per-element f32 function (SILU/GELU* need row context or tables)
_UNARY_SUPPORTED = (
    U.ABS, U.SGN, U.NEG, U.STEP, U.TANH, U.ELU, U.RELU, U.SIGMOID, U.GELU, U.GELU_QUICK, U.SILU,
    U.HARDSWISH, U.HARDSIGMOID, U.EXP, U.EXPM1, U.SOFTPLUS, U.GELU_ERF, U.FLOOR, U.CEIL, U.ROUND, U.TRUNC,
)


@numba.njit(inline="always", **JIT)
def _unary_scalar(op, x, gelu_tab, quick_tab, s, bias):
    if op == _SCALE:  # with a bias ggml fuses the multiply-add
        return x * s if bias == F32(0.0) else fma32(x, s, bias)
    if op == _CLAMP:
        return _clamp(x, s, bias)
    if op == U.ABS:
        return abs(x)
    if op == U.SGN:
        return F32(1.0) if x > F32(0.0) else (F32(-1.0) if x < F32(0.0) else F32(0.0))
    if op == U.NEG:
        return -x
    if op == U.STEP:
        return F32(1.0) if x > F32(0.0) else F32(0.0)
    if op == U.TANH:
        return math.tanh(x)
    if op == U.ELU:
        return x if x > F32(0.0) else math.expm1(x)
    if op == U.RELU:
        return x if x > F32(0.0) else F32(0.0)
    if op == U.SIGMOID:
        return F32(1.0) / (F32(1.0) + math.exp(-x))
    if op == U.GELU:
        return gelu_table(x, gelu_tab)
    if op == U.GELU_QUICK:
        return f16_to_f32(quick_tab[f32_to_f16(x)])
    if op == U.SILU:
        return silu_scalar(x)
    if op == U.HARDSWISH:
        return x * _clamp01((x + F32(3.0)) / F32(6.0))
    if op == U.HARDSIGMOID:
        return _clamp01((x + F32(3.0)) / F32(6.0))
    if op == U.EXP:
        return math.exp(x)
    if op == U.EXPM1:
        return math.exp(x) - F32(1.0)
    if op == U.SOFTPLUS:
        return x if x > F32(20.0) else math.log(F32(1.0) + math.exp(x))
    if op == U.GELU_ERF:
        return gelu_erf(x)
    if op == U.FLOOR:
        return np.floor(x)
    if op == U.CEIL:
        return np.ceil(x)
    if op == U.ROUND:
        return _roundf(x)
    if op == U.TRUNC:
        return np.trunc(x)
    if op == _SQR:
        return x * x
    return math.sqrt(x)  # _SQRT


@numba.njit(**JIT)
def _unary_row(op, src, dst, gelu_tab, quick_tab, s, bias, lanes, r):
    n3, n2, n1, n0 = src.shape
    i1, i2, i3 = st.row_coords(r, n1, n2)
    if op == _SCALE:  # whole rows in one loop each, which LLVM vectorizes (the per-element chain does not)
        x, y = src[i3, i2, i1], dst[i3, i2, i1]
        if bias == F32(0.0):
            for i0 in range(n0):
                y[i0] = x[i0] * s
        else:
            for i0 in range(n0):
                y[i0] = fma32(x[i0], s, bias)
        return
    vec_end = (n0 // lanes) * lanes if op == U.SILU else 0  # SILU: SIMD body of `lanes`-wide groups, scalar tail
    for i0 in range(vec_end):
        dst[i3, i2, i1, i0] = silu_vec(src[i3, i2, i1, i0], lanes)
    for i0 in range(vec_end, n0):
        dst[i3, i2, i1, i0] = _unary_scalar(op, src[i3, i2, i1, i0], gelu_tab, quick_tab, s, bias)


@row_loop
def _unary_rows(op, src, dst, gelu_tab, quick_tab, s, bias, lanes):
    n_rows = src.shape[0] * src.shape[1] * src.shape[2]
    for r in prange(n_rows):
        _unary_row(op, src, dst, gelu_tab, quick_tab, s, bias, lanes, np.int64(r))


def _unary_code(node: Node) -> int:
    return {GGMLOp.SQR: _SQR, GGMLOp.SQRT: _SQRT, GGMLOp.SCALE: _SCALE, GGMLOp.CLAMP: _CLAMP}.get(node.op) or \
        node.param("op")


def _check_unary(node: Node) -> None:
    (src,) = node.srcs(1)
    dst = node.dst
    label = node.op.name if node.op != GGMLOp.UNARY else f"UNARY:{U(node.param('op')).name}"
    if src.type != GGMLType.F32 or dst.type != GGMLType.F32:
        raise InvalidNode(f"{label}: only F32 -> F32 is supported, got {src.type.name} -> {dst.type.name}")
    if src.ne != dst.ne:
        raise InvalidNode(f"{label}: result shape {dst.ne} differs from source {src.ne}")
    if not (rows_contiguous(src) and rows_contiguous(dst)):
        raise InvalidNode(f"{label}: rows must be contiguous")


def _prepare_unary(node: Node):
    """Also SCALE's: a per-element map with op_params (s, b)."""
    src = node.src[0].array()
    if src.size == 0:
        return nothing
    gelu, quick = gelu_tables()
    code = _unary_code(node)
    names = {_SCALE: ("scale", "bias"), _CLAMP: ("min", "max")}.get(code)
    s, bias = (F32(node.param(names[0])), F32(node.param(names[1]))) if names else (F32(1.0), F32(0.0))
    parallel = st.parallel_worthwhile(src.size, cost=1 if code == _SCALE else 8)
    return partial(_unary_rows, code, src, node.dst.array(), gelu, quick, s, bias, node.target.lanes, parallel)


_forward_unary = prepared(_prepare_unary)


def _reference_unary(node: Node) -> None:
    node.dst.array()[...] = reference_unary_values(_unary_code(node), node.src[0].array(), node.target.lanes)


_UNARY_KERNEL = OpKernel(_check_unary, _forward_unary, _reference_unary, _prepare_unary)
for _sub in _UNARY_SUPPORTED:
    register(GGMLOp.UNARY, _sub)(_UNARY_KERNEL)
register(GGMLOp.SQR)(_UNARY_KERNEL)
register(GGMLOp.SQRT)(_UNARY_KERNEL)


# ---------------------------------------------------------------------------------------------
# ADD / SUB / MUL / DIV: dst = src0 (op) src1, src1 repeated to src0's shape

_BINARY_CODES = {GGMLOp.ADD: 0, GGMLOp.SUB: 1, GGMLOp.MUL: 2, GGMLOp.DIV: 3}

# (src0, src1, dst) type triples ggml-cpu's binary_op accepts; all computed in f32
_F32, _F16, _BF16 = GGMLType.F32, GGMLType.F16, GGMLType.BF16
_BINARY_TYPES = {(_F32, _F32, _F32), (_F16, _F16, _F16), (_BF16, _BF16, _BF16), (_BF16, _F32, _BF16),
                 (_BF16, _F32, _F32), (_F16, _F32, _F16), (_F16, _F32, _F32)}


@numba.njit(inline="always", **JIT)
def _binary_row(op, a, b, dst, r):
    n3, n2, n1, n0 = a.shape
    m3, m2, m1, m0 = b.shape
    i1, i2, i3 = st.row_coords(r, n1, n2)
    x, y, z = a[i3, i2, i1], b[i3 % m3, i2 % m2, i1 % m1], dst[i3, i2, i1]
    if m0 == 1:  # one src1 value for the whole row (e.g. an expert's weight): no slice per element
        v = y[0]
        if op == 0:
            for k in range(n0):
                z[k] = x[k] + v
        elif op == 1:
            for k in range(n0):
                z[k] = x[k] - v
        elif op == 2:
            for k in range(n0):
                z[k] = x[k] * v
        else:
            for k in range(n0):
                z[k] = x[k] / v
        return
    for base in range(0, n0, m0):  # src1's row repeats along src0's
        xs, zs = x[base:base + m0], z[base:base + m0]  # slices with the same index as y's: LLVM vectorizes
        if op == 0:
            for k in range(m0):
                zs[k] = xs[k] + y[k]
        elif op == 1:
            for k in range(m0):
                zs[k] = xs[k] - y[k]
        elif op == 2:
            for k in range(m0):
                zs[k] = xs[k] * y[k]
        else:
            for k in range(m0):
                zs[k] = xs[k] / y[k]


@row_loop
def _binary_rows(op, a, b, dst):
    n_rows = a.shape[0] * a.shape[1] * a.shape[2]
    for r in prange(n_rows):
        _binary_row(op, a, b, dst, np.int64(r))


def _check_binary(node: Node) -> None:
    a, b = node.srcs(2)
    dst = node.dst
    name = node.op.name
    if (a.type, b.type, dst.type) not in _BINARY_TYPES:
        raise InvalidNode(f"{name}: unsupported types {a.type.name}, {b.type.name} -> {dst.type.name}")
    if dst.ne != a.ne:
        raise InvalidNode(f"{name}: result shape {dst.ne} differs from src0 {a.ne}")
    a_empty, b_empty = 0 in a.ne, 0 in b.ne
    repeats = a_empty == b_empty if (a_empty or b_empty) else all(x % y == 0 for x, y in zip(a.ne, b.ne))
    if not repeats:
        raise InvalidNode(f"{name}: src1 {b.ne} does not repeat into src0 {a.ne}")
    for t, what in ((a, "src0"), (dst, "result")):
        if t.nb[0] != TYPE_TRAITS[t.type].type_size:
            raise InvalidNode(f"{name}: {what} elements must be contiguous within rows")


def _prepare_binary(node: Node):
    a, b, dst = node.src[0], node.src[1], node.dst
    if 0 in a.ne:
        return nothing
    code = _BINARY_CODES[node.op]
    parallel = st.parallel_worthwhile(a.ne[0] * a.ne[1] * a.ne[2] * a.ne[3])
    if a.type == b.type == dst.type == GGMLType.F32:
        return partial(_binary_rows, code, a.array(), b.array(), dst.array(), parallel)

    def run_widened():  # half-float operands: widen to f32 (exact), compute in f32, round once into dst
        xa = st.widen_f32(a)
        xb = b.array() if b.type == GGMLType.F32 else st.widen_f32(b)
        out = dst.array() if dst.type == GGMLType.F32 else np.empty_like(xa)
        _binary_rows(code, xa, xb, out, parallel)
        if dst.type != GGMLType.F32:
            st.convert_into(out, st.storage(dst), TYPE_F32, int(dst.type))

    return run_widened


_forward_binary = prepared(_prepare_binary)


_NP_BINARY = {GGMLOp.ADD: np.add, GGMLOp.SUB: np.subtract, GGMLOp.MUL: np.multiply, GGMLOp.DIV: np.divide}


def _reference_binary(node: Node) -> None:
    a, b, dst = node.src[0], node.src[1], node.dst
    if 0 in a.ne:
        return
    xa, xb = st.to_f32_reference(a), st.to_f32_reference(b)
    reps = tuple(x // y for x, y in zip(xa.shape, xb.shape))
    with np.errstate(all="ignore"):
        z = _NP_BINARY[node.op](xa, np.tile(xb, reps), dtype=F32)
    st.storage(dst)[...] = st.from_f32_reference(z, dst.type)


_BINARY_KERNEL = OpKernel(_check_binary, _forward_binary, _reference_binary, _prepare_binary)
for _op in _BINARY_CODES:
    register(_op)(_BINARY_KERNEL)


# ---------------------------------------------------------------------------------------------
# SCALE: dst = src * s (+ b, fused); the forward is the unary map's


def _check_scale(node: Node) -> None:
    (src,) = node.srcs(1)
    dst = node.dst
    if src.type != GGMLType.F32 or dst.type != GGMLType.F32:
        raise InvalidNode(f"SCALE: only F32 is supported, got {src.type.name} -> {dst.type.name}")
    if src.ne != dst.ne:
        raise InvalidNode(f"SCALE: result shape {dst.ne} differs from source {src.ne}")
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise InvalidNode("SCALE: source and result must be contiguous")


def _reference_scale(node: Node) -> None:
    x = node.src[0].array().astype(np.float64)
    s, bias = node.param("scale"), node.param("bias")
    # a*s + b in double is the exact product plus one rounding: the same as f32 fma for these inputs
    # except in double-rounding corner cases, which the tests' tolerance covers
    y = x * s if bias == 0.0 else x * s + bias
    node.dst.array()[...] = y.astype(F32)


register(GGMLOp.SCALE)(OpKernel(_check_scale, _forward_unary, _reference_scale, _prepare_unary))


# ---------------------------------------------------------------------------------------------
# CLAMP: dst = MAX(MIN(src, max), min); the forward is the unary map's. ggml walks the rows of the flattened
# source at j * nb01, which is the 4-D walk when the rows are evenly spaced; others are refused.


def _check_clamp(node: Node) -> None:
    _check_unary(node)
    for t in (node.src[0], node.dst):
        if (t.ne[2] != 1 and t.nb[2] != t.ne[1] * t.nb[1]) or (t.ne[3] != 1 and t.nb[3] != t.ne[2] * t.nb[2]):
            raise InvalidNode("CLAMP: rows must be evenly spaced in dims 1..3")


def _reference_clamp(node: Node) -> None:
    x = node.src[0].array()
    lo, hi = F32(node.param("min")), F32(node.param("max"))
    t = np.where(x < hi, x, hi)
    node.dst.array()[...] = np.where(t > lo, t, lo)


register(GGMLOp.CLAMP)(OpKernel(_check_clamp, _forward_unary, _reference_clamp, _prepare_unary))
