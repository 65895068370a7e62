"""ggml's shared vector routines (vec.cpp) that more than one op uses: the soft-max row kernel in either
build's lane order (SOFT_MAX and FLASH_ATTN_EXT's tiles) with its numpy twin, and ALiBi slopes.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from .fmath import hsum16, np_hsum16, np_v_expf, np_v_expf16, v_expf, v_expf16
from .jit import JIT

F32 = np.float32

NEG_INF = F32(-np.inf)


@numba.njit(**JIT)
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


@numba.njit(**JIT)
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
