"""Row normalisations: RMS_NORM, NORM and L2_NORM over ne0, F32, op_params[0] = eps.

The sums are replayed in ggml-cpu's order and precision (ops.cpp and vec.cpp), for the node's target:
- RMS_NORM and L2_NORM square in f32 and accumulate the squares in double, left to right (scalar
  loops, the same in every build); the final scaling is elementwise.
- NORM on contiguous rows sums x in double; its variance comes from `ggml_vec_cvar_f32`, which
  reduces each full group of `target.lanes` squared deviations in f32 before adding it to a double:
  8 in the AVX2 build's _mm256 -> _mm128 tree, 16 in the AVX-512 build's `_mm512_reduce_add_ps`
  (`fmath.hsum16`); the row's tail is added one square at a time.
  On strided rows NORM takes ggml's scalar path instead, with f32 accumulators.
The numpy reference replays the same orders (np.cumsum adds left to right), so it agrees bit for bit.
"""

from __future__ import annotations

import math
from functools import partial

import numba
import numpy as np
from numba import prange

from wire.ggml import GGMLOp, GGMLType

from ..fmath import fma32, hsum16, np_fma, np_hsum16
from ..jit import JIT, row_loop
from ..node import InvalidNode, Node
from ..registry import OpKernel, nothing, prepared, register
from ..storage import parallel_worthwhile, row_coords

F32 = np.float32


_RMS, _NORM, _L2 = 0, 1, 2
_CODES = {GGMLOp.RMS_NORM: _RMS, GGMLOp.NORM: _NORM, GGMLOp.L2_NORM: _L2}


@numba.njit(**JIT)
def _sum_squares(src, i3, i2, i1):
    """Squares rounded to f32, summed in double left to right."""
    total = 0.0
    for i0 in range(src.shape[3]):
        v = src[i3, i2, i1, i0]
        total += np.float64(v * v)
    return total


@numba.njit(**JIT)
def _centre8(src, dst, i3, i2, i1, base, mean):
    """Write 8 deviations from the mean; return their squares (one AVX2 step of ggml_vec_cvar_f32)."""
    d0 = src[i3, i2, i1, base] - mean
    d1 = src[i3, i2, i1, base + 1] - mean
    d2 = src[i3, i2, i1, base + 2] - mean
    d3 = src[i3, i2, i1, base + 3] - mean
    d4 = src[i3, i2, i1, base + 4] - mean
    d5 = src[i3, i2, i1, base + 5] - mean
    d6 = src[i3, i2, i1, base + 6] - mean
    d7 = src[i3, i2, i1, base + 7] - mean
    dst[i3, i2, i1, base] = d0
    dst[i3, i2, i1, base + 1] = d1
    dst[i3, i2, i1, base + 2] = d2
    dst[i3, i2, i1, base + 3] = d3
    dst[i3, i2, i1, base + 4] = d4
    dst[i3, i2, i1, base + 5] = d5
    dst[i3, i2, i1, base + 6] = d6
    dst[i3, i2, i1, base + 7] = d7
    return (d0 * d0, d1 * d1, d2 * d2, d3 * d3, d4 * d4, d5 * d5, d6 * d6, d7 * d7)


@numba.njit(**JIT)
def _centre(src, dst, i3, i2, i1, contiguous, lanes):
    """NORM's first pass: dst row = x - mean; returns the variance (f32), both as ggml computes them."""
    n0 = src.shape[3]
    if contiguous:
        total = 0.0
        for i0 in range(n0):
            total += np.float64(src[i3, i2, i1, i0])
        mean = F32(total) / F32(n0)
        var_sum = 0.0
        body = (n0 // lanes) * lanes
        if lanes == 16:
            sq = np.empty(16, F32)
            for base in range(0, body, 16):
                for k in range(16):
                    d = src[i3, i2, i1, base + k] - mean
                    dst[i3, i2, i1, base + k] = d
                    sq[k] = d * d
                var_sum += np.float64(hsum16(sq, 0))  # _mm512_reduce_add_ps(val * val)
        else:
            for base in range(0, body, 8):
                q = _centre8(src, dst, i3, i2, i1, base, mean)
                # _mm256 -> _mm128 fold, movehl, movehdup: ((q0+q4)+(q2+q6)) + ((q1+q5)+(q3+q7))
                w0 = (q[4] + q[0]) + (q[6] + q[2])
                w1 = (q[5] + q[1]) + (q[7] + q[3])
                var_sum += np.float64(w0 + w1)
        for i0 in range(body, n0):
            d = src[i3, i2, i1, i0] - mean
            dst[i3, i2, i1, i0] = d
            var_sum += np.float64(d * d)
        return F32(var_sum / n0)
    acc = F32(0.0)
    for i0 in range(n0):
        acc += src[i3, i2, i1, i0]
    mean = acc / F32(n0)
    variance = F32(0.0)
    for i0 in range(n0):
        d = src[i3, i2, i1, i0] - mean
        dst[i3, i2, i1, i0] = d
        variance = fma32(d, d, variance)  # gcc contracts `variance += v * v` (-ffp-contract=fast)
    return variance / F32(n0)


@numba.njit(**JIT)
def _norm_row(op, src, dst, eps, contiguous, lanes, r):
    n3, n2, n1, n0 = src.shape
    i1, i2, i3 = row_coords(r, n1, n2)
    if op == _RMS:
        mean = F32(_sum_squares(src, i3, i2, i1) / n0)
        scale = F32(1.0) / math.sqrt(mean + eps)
    elif op == _L2:
        norm = math.sqrt(F32(_sum_squares(src, i3, i2, i1)))
        scale = F32(1.0) / (norm if norm > eps else eps)  # fmaxf: a NaN norm yields eps
    else:
        variance = _centre(src, dst, i3, i2, i1, contiguous, lanes)
        scale = F32(1.0) / math.sqrt(variance + eps)
        for i0 in range(n0):  # scale the centred values just written
            dst[i3, i2, i1, i0] = dst[i3, i2, i1, i0] * scale
        return
    for i0 in range(n0):
        dst[i3, i2, i1, i0] = src[i3, i2, i1, i0] * scale


@row_loop
def _norm_rows(op, src, dst, eps, contiguous, lanes):
    n_rows = src.shape[0] * src.shape[1] * src.shape[2]
    for r in prange(n_rows):
        _norm_row(op, src, dst, eps, contiguous, lanes, np.int64(r))


def _check_norm(node: Node) -> None:
    (src,) = node.srcs(1)
    dst = node.dst
    name = node.op.name
    if src.type != GGMLType.F32 or dst.type != GGMLType.F32:
        raise InvalidNode(f"{name}: only F32 is supported, got {src.type.name} -> {dst.type.name}")
    if src.ne != dst.ne:
        raise InvalidNode(f"{name}: result shape {dst.ne} differs from source {src.ne}")
    eps = node.param("eps")
    if not eps >= 0.0:
        raise InvalidNode(f"{name}: eps must be >= 0, got {eps}")
    if node.op == GGMLOp.RMS_NORM and (src.nb[0] != 4 or dst.nb[0] != 4):
        raise InvalidNode("RMS_NORM: rows must be contiguous")


def _prepare(node: Node):
    src, dst = node.src[0].array(), node.dst.array()
    if src.size == 0:
        return nothing
    # NORM has a fast path for rows contiguous on both sides and a scalar one otherwise
    contiguous = node.src[0].nb[0] == 4 and node.dst.nb[0] == 4
    parallel = parallel_worthwhile(src.size, cost=2)
    eps = F32(node.param("eps"))
    return partial(_norm_rows, _CODES[node.op], src, dst, eps, contiguous, node.target.lanes, parallel)


_forward = prepared(_prepare)


def _sum_left_to_right(terms: np.ndarray) -> np.ndarray:
    """Double sums of the last axis, added left to right as ggml's loops do (keepdims)."""
    if terms.shape[-1] == 0:
        return np.zeros(terms.shape[:-1] + (1,))
    return np.cumsum(terms.astype(np.float64), axis=-1)[..., -1:]


def _np_hsum8(q: np.ndarray) -> np.ndarray:
    """The AVX2 build's 8-lane tree over the last axis: ((q0+q4)+(q2+q6)) + ((q1+q5)+(q3+q7))."""
    t = q[..., 4:8] + q[..., 0:4]
    return (t[..., 0] + t[..., 2]) + (t[..., 1] + t[..., 3])


def _np_cvar(x: np.ndarray, mean: np.ndarray, lanes: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml_vec_cvar_f32: (x - mean, the variance as f32), groups of `lanes` reduced in f32 first."""
    d = (x - mean).astype(F32)
    sq = d * d
    n0 = x.shape[-1]
    body = (n0 // lanes) * lanes
    groups = sq[..., :body].reshape(sq.shape[:-1] + (body // lanes, lanes))
    partial_sums = (np_hsum16 if lanes == 16 else _np_hsum8)(groups)
    terms = np.concatenate([partial_sums.astype(np.float64), sq[..., body:].astype(np.float64)], axis=-1)
    return d, (_sum_left_to_right(terms) / n0).astype(F32)


def _np_norm_strided(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """NORM's scalar path: f32 sum, f32 fma-accumulated variance, element by element."""
    n0 = x.shape[-1]
    acc = np.zeros(x.shape[:-1] + (1,), F32)
    for i0 in range(n0):
        acc = (acc + x[..., i0 : i0 + 1]).astype(F32)
    d = (x - acc / F32(n0)).astype(F32)
    variance = np.zeros_like(acc)
    for i0 in range(n0):
        variance = np_fma(d[..., i0 : i0 + 1], d[..., i0 : i0 + 1], variance)
    return d, (variance / F32(n0)).astype(F32)


def _reference(node: Node) -> None:
    """ggml's statistics in ggml's order and precision (the target's lanes for NORM's variance)."""
    x = node.src[0].array()
    eps = np.float32(node.param("eps"))
    if 0 in x.shape:
        return
    n0 = x.shape[-1]
    with np.errstate(all="ignore"):
        if node.op == GGMLOp.RMS_NORM:
            mean = (_sum_left_to_right(np.square(x)) / n0).astype(F32)
            y = x * (F32(1.0) / np.sqrt(mean + eps))
        elif node.op == GGMLOp.L2_NORM:
            norm = np.sqrt(_sum_left_to_right(np.square(x)).astype(F32))
            y = x * (F32(1.0) / np.fmax(norm, eps))
        else:
            if node.src[0].nb[0] == 4 and node.dst.nb[0] == 4:
                mean = _sum_left_to_right(x).astype(F32) / F32(n0)
                centred, variance = _np_cvar(x, mean, node.target.lanes)
            else:
                centred, variance = _np_norm_strided(x)
            y = centred * (F32(1.0) / np.sqrt(variance + eps))
    node.dst.array()[...] = y


_KERNEL = OpKernel(_check_norm, _forward, _reference, _prepare)
for _op in (GGMLOp.RMS_NORM, GGMLOp.NORM, GGMLOp.L2_NORM):
    register(_op)(_KERNEL)
