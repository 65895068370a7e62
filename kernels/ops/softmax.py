"""SOFT_MAX: dst = softmax(src0 * scale + slope * mask) over each row, with optional attention sinks.

Matches ggml-cpu bit for bit (ops.cpp ggml_compute_forward_soft_max_f32 and vec.cpp
ggml_vec_soft_max_f32) on the build the node's target names: the mask is added with a fused
multiply-add, exponentials of each whole block of `lanes` values (8 for AVX2+FMA, 16 for AVX-512) use
that build's vector exp approximation (`v_expf` / `v_expf16`) and the rest glibc `expf`, and the row
sum is accumulated in double from float32 sums of each block, in the order the SIMD code adds them
(the AVX2 shuffle sequence / gcc's `_mm512_reduce_add_ps`). Nothing else in SOFT_MAX depends on the
lane width: scale, max and the final scaling are elementwise or sequential in both builds.

The float helpers (`fma32`, `v_expf`, fp16 conversions) live in kernels/fmath.py.
"""

from __future__ import annotations

import math
from functools import partial

import numba
import numpy as np
from numba import prange

from ..jit import JIT, row_loop
from wire.ggml import GGMLOp, GGMLType

from ..fmath import fma32, np_fma
from ..node import InvalidNode, Node
from ..registry import OpKernel, prepared, register
from ..storage import as_f32, parallel_worthwhile
from ..vec import NEG_INF, alibi_slope, np_expf, np_soft_max, vec_soft_max

F32 = np.float32



# ---------------------------------------------------------------- SOFT_MAX


@numba.njit(**JIT)
def _soft_max_row(r, src, dst, mask, has_mask, sinks, has_sinks, scale, max_bias, lanes):
    ne3, ne2, ne1, ne0 = src.shape
    i3 = r // (ne2 * ne1)
    i2 = (r // ne1) % ne2
    i1 = r % ne1
    slope = alibi_slope(max_bias, ne2, i2)
    sp = src[i3, i2, i1]
    wp = np.empty(ne0, F32)
    for i in range(ne0):
        wp[i] = sp[i] * scale
    if has_mask:
        mp = mask[i3 % mask.shape[0], i2 % mask.shape[1], i1]
        for i in range(ne0):
            wp[i] = fma32(slope, mp[i], wp[i])
    mx = NEG_INF
    for i in range(ne0):
        mx = mx if mx > wp[i] else wp[i]
    if has_sinks:
        mx = mx if mx > sinks[i2] else sinks[i2]
    total = vec_soft_max(ne0, wp, wp, mx, lanes)
    if has_sinks:
        total += np.float64(math.exp(sinks[i2] - mx))
    inv = F32(1.0 / total)
    dp = dst[i3, i2, i1]
    for i in range(ne0):
        dp[i] = wp[i] * inv


@row_loop
def _soft_max_rows(src, dst, mask, has_mask, sinks, has_sinks, scale, max_bias, lanes):
    n_rows = src.shape[0] * src.shape[1] * src.shape[2]
    for r in prange(n_rows):
        _soft_max_row(np.int64(r), src, dst, mask, has_mask, sinks, has_sinks, scale, max_bias, lanes)


def _soft_max_parts(node: Node):
    src, mask = node.src[0], node.src[1] if len(node.src) > 1 else None
    sinks = node.src[2] if len(node.src) > 2 else None
    return src, mask, sinks, node.param("scale"), node.param("max_bias")


def check_soft_max(node: Node) -> None:
    (src,) = node.srcs(1)
    _, mask, sinks, _, max_bias = _soft_max_parts(node)
    dst = node.dst
    if src.type != GGMLType.F32 or dst.type != GGMLType.F32:
        raise InvalidNode("SOFT_MAX: src0 and dst must be F32")
    if dst.ne != src.ne:
        raise InvalidNode(f"SOFT_MAX: dst shape {dst.ne} differs from src0 {src.ne}")
    if src.nb[0] != 4 or dst.nb[0] != 4:
        raise InvalidNode("SOFT_MAX: rows must be contiguous")
    if mask is not None:
        if mask.type not in (GGMLType.F32, GGMLType.F16) or mask.nb[0] != (4 if mask.type == GGMLType.F32 else 2):
            raise InvalidNode("SOFT_MAX: mask must be F32 or F16 with contiguous rows")
        if mask.ne[0] != src.ne[0] or mask.ne[1] < src.ne[1]:
            raise InvalidNode(f"SOFT_MAX: mask {mask.ne} does not cover rows of {src.ne}")
        if mask.ne[2] <= 0 or mask.ne[3] <= 0 or src.ne[2] % mask.ne[2] or src.ne[3] % mask.ne[3]:
            raise InvalidNode(f"SOFT_MAX: mask {mask.ne} does not broadcast to {src.ne}")
    elif max_bias > 0.0:
        raise InvalidNode("SOFT_MAX: max_bias (ALiBi) needs a mask")
    if sinks is not None:
        if sinks.type != GGMLType.F32 or sinks.ne[0] != src.ne[2] or sinks.ne[1:] != (1, 1, 1):
            raise InvalidNode("SOFT_MAX: sinks must be an F32 vector with one value per head (src0.ne2)")


def prepare_soft_max(node: Node):
    src, mask, sinks, scale, max_bias = _soft_max_parts(node)
    sk = sinks.array()[0, 0, 0] if sinks is not None else np.zeros(1, F32)
    x = src.array()
    rows = partial(_soft_max_rows, x, node.dst.array())
    tail = (mask is not None, sk, sinks is not None, F32(scale), F32(max_bias), node.target.lanes,
            parallel_worthwhile(x.size, cost=8))
    if mask is None:
        return partial(rows, np.zeros((1, 1, 1, 1), F32), *tail)
    if mask.type == GGMLType.F32:
        return partial(rows, mask.array(), *tail)
    return lambda: rows(as_f32(mask), *tail)  # an F16 mask is widened on every run


forward_soft_max = prepared(prepare_soft_max)


# numpy twin: the same float32 steps, vectorized over all rows


def reference_soft_max(node: Node) -> None:
    src, mask, sinks, scale, max_bias = _soft_max_parts(node)
    x = src.array() * F32(scale)
    ne3, ne2, ne1, _ = x.shape
    if mask is not None:
        m = as_f32(mask)
        m = np.tile(m, (ne3 // m.shape[0], ne2 // m.shape[1], 1, 1))[:, :, :ne1]
        slopes = np.array([alibi_slope(F32(max_bias), ne2, h) for h in range(ne2)], F32)
        x = np_fma(slopes[None, :, None, None], m, x)
    mx = x.max(-1)
    if sinks is not None:
        sk = sinks.array()[0, 0, 0][None, :, None]
        mx = np.maximum(mx, sk)
    y, total = np_soft_max(x, mx, node.target.lanes)
    if sinks is not None:
        total = total + np_expf(sk - mx)
    node.dst.array()[...] = y * (1.0 / total).astype(F32)[..., None]


register(GGMLOp.SOFT_MAX)(OpKernel(check_soft_max, forward_soft_max, reference_soft_max, prepare_soft_max))
