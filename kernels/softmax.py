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

from .ggml import GGMLOp, GGMLType

from .copy import parallel_worthwhile
from .fmath import (
    f16_to_f32,
    fma32,
    hsum16,
    np_fma,
    np_hsum16,
    np_v_expf,
    np_v_expf16,
    v_expf,
    v_expf16,
)
from .node import InvalidNode, Node, Tensor
from .registry import OpKernel, prepared, register

F32 = np.float32
NEG_INF = F32(-np.inf)

_jit = dict(cache=True, nogil=True, fastmath=False)

@numba.njit(**_jit)
def _widen_row(r, buf, off, ne, st, out):
    i3, i2, i1 = r // (ne[2] * ne[1]), (r // ne[1]) % ne[2], r % ne[1]
    base = off + i3 * st[3] + i2 * st[2] + i1 * st[1]
    src = buf[base : base + ne[0]]  # a slice keeps the loop free of negative-index checks
    row = out[i3, i2, i1]
    for t in range(ne[0]):
        row[t] = f16_to_f32(src[t])


@numba.njit(**_jit)
def _widen_plane_transposed(r, buf, off, ne, st, out):
    # out[i3, i2, i0, i1]: widen 16 rows at a time into a small buffer, then write it out by columns
    block = 16
    i3, i2 = r // ne[2], r % ne[2]
    plane = out[i3, i2]
    tmp = np.empty((block, ne[0]), F32)
    for j0 in range(0, ne[1], block):
        m = min(block, ne[1] - j0)
        for u in range(m):
            b = off + i3 * st[3] + i2 * st[2] + (j0 + u) * st[1]
            src = buf[b : b + ne[0]]
            row = tmp[u]
            for t in range(ne[0]):
                row[t] = f16_to_f32(src[t])
        for t in range(ne[0]):
            col = plane[t, j0 : j0 + m]
            for u in range(m):
                col[u] = tmp[u, t]


@numba.njit(parallel=True, **_jit)
def _widen(buf, off, ne, st, out, transpose, parallel):
    n = ne[3] * ne[2] if transpose else ne[3] * ne[2] * ne[1]
    if parallel:
        for r in prange(n):
            if transpose:
                _widen_plane_transposed(r, buf, off, ne, st, out)
            else:
                _widen_row(r, buf, off, ne, st, out)
    else:
        for r in range(n):
            if transpose:
                _widen_plane_transposed(r, buf, off, ne, st, out)
            else:
                _widen_row(r, buf, off, ne, st, out)


def u16_view(t: Tensor) -> np.ndarray:
    """The raw bits of an F16 tensor as a strided (ne3, ne2, ne1, ne0) uint16 array."""
    ne, nb = t.ne, t.nb
    return np.ndarray((ne[3], ne[2], ne[1], ne[0]), np.uint16, t.mem, t.offset, (nb[3], nb[2], nb[1], nb[0]))


def widen_f16(t: Tensor, transpose: bool = False) -> np.ndarray:
    """An F16 tensor (rows contiguous) as a new C-contiguous float32 (ne3, ne2, ne1, ne0) array, or
    (ne3, ne2, ne0, ne1) if transpose."""
    ne = t.ne
    shape = (ne[3], ne[2], ne[0], ne[1]) if transpose else (ne[3], ne[2], ne[1], ne[0])
    out = np.empty(shape, F32)
    if t.offset % 2 or any(n % 2 for n in t.nb) or t.mem.size % 2:
        src = u16_view(t).view(np.float16)  # odd byte layout: let numpy do it
        out[...] = src.transpose(0, 1, 3, 2) if transpose else src
        return out
    buf = t.mem.view(np.uint16)
    _widen(buf, t.offset // 2, np.array(ne, np.int64), np.array(t.nb, np.int64) // 2, out, transpose,
           parallel_worthwhile(out.size, cost=2))
    return out


def as_f32(t: Tensor) -> np.ndarray:
    """An F32 or F16 tensor's values as float32 (a copy for F16; the conversion is exact)."""
    return t.array() if t.type == GGMLType.F32 else widen_f16(t)


@numba.njit(**_jit)
def alibi_slope(max_bias, n_head, h):
    """ALiBi slope of head h, as ggml computes it (powf in float32)."""
    if not max_bias > F32(0.0):
        return F32(1.0)
    n_head_log2 = 1 << int(math.floor(math.log2(n_head)))
    m0 = math.pow(F32(2.0), -max_bias / F32(n_head_log2))
    m1 = math.pow(F32(2.0), -(max_bias / F32(2.0)) / F32(n_head_log2))
    if h < n_head_log2:
        return math.pow(m0, F32(h + 1))
    return math.pow(m1, F32(2 * (h - n_head_log2) + 1))


@numba.njit(**_jit)
def vec_soft_max(n, y, x, mx, lanes):
    """ggml_vec_soft_max_f32 of a build with `lanes` float lanes (8: AVX2, 16: AVX-512): y = exp(x - mx);
    returns the sum, accumulated in double like ggml."""
    total = 0.0
    nv = n - n % lanes
    xs, ys = x[:nv], y[:nv]  # slices keep the loop free of negative-index checks, so it vectorizes
    if lanes == 16:
        for i in range(nv):
            ys[i] = v_expf16(xs[i] - mx)
        for i in range(0, nv, 16):
            total += np.float64(hsum16(y, i))  # _mm512_reduce_add_ps
    else:
        for i in range(nv):
            ys[i] = v_expf(xs[i] - mx)
        for i in range(0, nv, 8):
            # horizontal add of 8 lanes in the order of the AVX2 shuffle sequence
            v = y[i : i + 8]
            s = ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]))
            total += np.float64(s)
    for i in range(nv, n):
        v = math.exp(x[i] - mx)
        total += np.float64(v)
        y[i] = v
    return total


# ---------------------------------------------------------------- SOFT_MAX


@numba.njit(**_jit)
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


@numba.njit(parallel=True, **_jit)
def _soft_max_rows(src, dst, mask, has_mask, sinks, has_sinks, scale, max_bias, lanes, parallel):
    n_rows = src.shape[0] * src.shape[1] * src.shape[2]
    if parallel:
        for r in prange(n_rows):
            _soft_max_row(r, src, dst, mask, has_mask, sinks, has_sinks, scale, max_bias, lanes)
    else:
        for r in range(n_rows):
            _soft_max_row(r, src, dst, mask, has_mask, sinks, has_sinks, scale, max_bias, lanes)


def _soft_max_parts(node: Node):
    src, mask = node.src[0], node.src[1] if len(node.src) > 1 else None
    sinks = node.src[2] if len(node.src) > 2 else None
    return src, mask, sinks, node.param_f32(0), node.param_f32(1)


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
        if src.ne[2] % mask.ne[2] or src.ne[3] % mask.ne[3]:
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


def np_expf(x) -> np.ndarray:
    """expf, correctly rounded (glibc's expf agrees but for rare last-bit cases)."""
    return np.exp(np.asarray(x, np.float64)).astype(F32)


def np_soft_max(x: np.ndarray, mx: np.ndarray, lanes: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Twin of vec_soft_max over the last axis: (exp values, float64 sums)."""
    n = x.shape[-1]
    nv = n - n % lanes
    d = (x - mx[..., None]).astype(F32)
    y = np.empty_like(d)
    y[..., :nv] = (np_v_expf16 if lanes == 16 else np_v_expf)(d[..., :nv])
    y[..., nv:] = np_expf(d[..., nv:])
    blocks = y[..., :nv].reshape(*y.shape[:-1], nv // lanes, lanes)
    if lanes == 16:
        sums = np_hsum16(blocks)
    else:
        t = blocks[..., :4] + blocks[..., 4:]
        t = t[..., :2] + t[..., 2:]
        sums = t[..., 0] + t[..., 1]
    return y, sums.astype(np.float64).sum(-1) + y[..., nv:].astype(np.float64).sum(-1)


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
