"""GLU: dst = act(x) * g, with x and g the two halves of src0's rows (swapped: g first) or src0, src1.

The activations are elementwise.py's: SWIGLU is ggml_vec_swiglu_f32, `ggml_v_silu(x) * g` on each full
group of `target.lanes` (8 in the AVX2 build, 16 in the AVX-512 one) and `silu(x) * g` with libm expf
on the row's tail; REGLU, GEGLU (F16 table), GEGLU_QUICK (F16 table) and GEGLU_ERF are scalar loops,
the same in both builds.
"""

from __future__ import annotations

from functools import partial

import numba
import numpy as np
from numba import prange

from .. import storage as st
from ..activations import gelu_erf, gelu_tables, reference_unary_values, silu_scalar, silu_vec
from ..fmath import f16_to_f32, f32_to_f16
from ..jit import JIT, row_loop
from wire.ggml import GGMLGluOp, GGMLOp, GGMLType, GGMLUnaryOp
from ..node import InvalidNode, Node, Tensor
from ..registry import OpKernel, nothing, prepared, register
from ..storage import rows_contiguous

F32 = np.float32
U = GGMLUnaryOp

G = GGMLGluOp
_GLU_SUPPORTED = (G.REGLU, G.GEGLU, G.SWIGLU, G.GEGLU_ERF, G.GEGLU_QUICK)


@numba.njit(**JIT)
def _glu_row(op, x, g, dst, gelu_tab, quick_tab, lanes, r):
    n3, n2, n1, n0 = dst.shape
    i1, i2, i3 = st.row_coords(r, n1, n2)
    vec_end = (n0 // lanes) * lanes if op == G.SWIGLU else 0  # SWIGLU: ggml_v_silu(x) * g on whole groups
    for i0 in range(vec_end):
        dst[i3, i2, i1, i0] = silu_vec(x[i3, i2, i1, i0], lanes) * g[i3, i2, i1, i0]
    for i0 in range(vec_end, n0):
        v = x[i3, i2, i1, i0]
        w = g[i3, i2, i1, i0]
        if op == G.SWIGLU:
            out = silu_scalar(v) * w
        elif op == G.REGLU:
            out = v * w if v > F32(0.0) else F32(0.0)
        elif op == G.GEGLU:
            if v <= F32(-10.0):
                out = F32(0.0)
            elif v >= F32(10.0):
                out = v * w
            else:
                out = f16_to_f32(gelu_tab[f32_to_f16(v)]) * w
        elif op == G.GEGLU_QUICK:
            out = f16_to_f32(quick_tab[f32_to_f16(v)]) * w
        else:  # GEGLU_ERF
            out = gelu_erf(v) * w
        dst[i3, i2, i1, i0] = out


@row_loop
def _glu_rows(op, x, g, dst, gelu_tab, quick_tab, lanes):
    n_rows = dst.shape[0] * dst.shape[1] * dst.shape[2]
    for r in prange(n_rows):
        _glu_row(op, x, g, dst, gelu_tab, quick_tab, lanes, np.int64(r))


def _contiguous_1(t: Tensor) -> bool:
    """ggml_is_contiguous_1: contiguous rows, dims 2 and 3 packed after dim 1 (which may be padded)."""
    if not rows_contiguous(t):
        return False
    nxt = t.ne[1] * t.nb[1]
    for i in (2, 3):
        if t.ne[i] != 1 and t.nb[i] != nxt:
            return False
        nxt *= t.ne[i]
    return True


def _glu_operands(node: Node) -> tuple[np.ndarray, np.ndarray]:
    a = node.src[0].array()
    if len(node.src) > 1 and node.src[1] is not None:
        return a, node.src[1].array()
    nc = node.dst.ne[0]
    first, second = a[..., :nc], a[..., nc : 2 * nc]
    return (second, first) if node.param("swapped") else (first, second)


def _check_glu(node: Node) -> None:
    (a,) = node.srcs(1)
    b = node.src[1] if len(node.src) > 1 else None
    dst = node.dst
    label = f"GLU:{G(node.param('op')).name}"
    if a.type != GGMLType.F32 or dst.type != GGMLType.F32 or (b is not None and b.type != GGMLType.F32):
        raise InvalidNode(f"{label}: only F32 is supported")
    expect = a.ne if b is not None else (a.ne[0] // 2,) + a.ne[1:]
    if dst.ne != expect:
        raise InvalidNode(f"{label}: result shape {dst.ne}, expected {expect}")
    if b is not None and b.ne != a.ne:
        raise InvalidNode(f"{label}: operand shapes {a.ne} and {b.ne} differ")
    for t in (a, b, dst):
        if t is not None and not _contiguous_1(t):
            raise InvalidNode(f"{label}: operands must be contiguous beyond dim 1 (ggml_is_contiguous_1)")


def _prepare_glu(node: Node):
    x, g = _glu_operands(node)
    dst = node.dst.array()
    if dst.size == 0:
        return nothing
    gelu, quick = gelu_tables()
    parallel = st.parallel_worthwhile(dst.size, cost=8)
    return partial(_glu_rows, node.param("op"), x, g, dst, gelu, quick, node.target.lanes, parallel)


_forward_glu = prepared(_prepare_glu)


_GLU_ACTIVATION = {G.SWIGLU: U.SILU, G.REGLU: U.RELU, G.GEGLU: U.GELU, G.GEGLU_QUICK: U.GELU_QUICK,
                   G.GEGLU_ERF: U.GELU_ERF}


def _reference_glu(node: Node) -> None:
    x, g = _glu_operands(node)
    op = node.param("op")
    out = reference_unary_values(_GLU_ACTIVATION[op], x, node.target.lanes) * g
    # ggml writes a plain 0 where the activation's own result is 0 (never 0 * g)
    zero_where = x <= 0 if op == G.REGLU else (x <= -10 if op == G.GEGLU else np.zeros(x.shape, bool))
    node.dst.array()[...] = np.where(zero_where, F32(0), out)


_GLU_KERNEL = OpKernel(_check_glu, _forward_glu, _reference_glu, _prepare_glu)
for _sub in _GLU_SUPPORTED:
    register(GGMLOp.GLU, _sub)(_GLU_KERNEL)
