"""ggml-cpu's float weight dot products (F32/F16/BF16 . f32 activations) as the AVX2 build computes them.

`dot_float` is one weight row . one activation row in 8-lane arithmetic: llamafile's tinyBLAS (`tiny`:
one 8-lane FMA accumulator, the last partial step padded with zeros) or ggml_vec_dot_<f32|f16|bf16>
(four 8-lane accumulators over 32-element steps, their own reduction tree, the tail of kernels.formats.float_dot512).
`round_activations` is the conversion of src1 to the weights' vec_dot_type that comes first. MUL_MAT
(kernels.ops.matmul) takes either route; MUL_MAT_ID (kernels.ops.moe) only vec_dot. The 16-lane (AVX-512)
twin is kernels.formats.float_dot512.
"""

from __future__ import annotations

import numba
import numpy as np

from ..fmath import fma32
from .float_dot512 import load_weight, tail_sum
from wire.ggml import TYPE_BF16, TYPE_F16, TYPE_F32, GGMLType
from ..jit import JIT
from .quants import FLOAT_LANES, FLOAT_TYPES


def round_activations(type_: GGMLType, x: np.ndarray) -> np.ndarray:
    """f32 activations rounded to the float vec_dot_type (fp16 / bf16 round to nearest even)."""
    if type_ == GGMLType.F16:
        return x.astype(np.float16).astype(np.float32)
    if type_ == GGMLType.BF16:
        u = x.astype(np.float32).view(np.uint32)
        nan = (u & 0x7FFFFFFF) > 0x7F800000
        r = np.where(nan, (u >> 16) | 64, (u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint32)
        return (r << 16).view(np.float32)
    return np.ascontiguousarray(x, np.float32)


(_f32_tiny, _f32_vec), (_f16_tiny, _f16_vec), (_bf16_tiny, _bf16_vec) = (FLOAT_LANES[t] for t in FLOAT_TYPES)


@numba.njit(inline="always", **JIT)
def _lanes(kind, tiny, w, off, y, yoff, n):
    if tiny:
        steps = n // 8
        if kind == TYPE_F32:
            return _f32_tiny(w, off, y, yoff, steps)
        if kind == TYPE_F16:
            return _f16_tiny(w, off, y, yoff, steps)
        return _bf16_tiny(w, off, y, yoff, steps)
    steps = n // 32
    if kind == TYPE_F32:
        return _f32_vec(w, off, y, yoff, steps)
    if kind == TYPE_F16:
        return _f16_vec(w, off, y, yoff, steps)
    return _bf16_vec(w, off, y, yoff, steps)


@numba.njit(inline="always", **JIT)
def _padded(kind, w, off, esize, y, yoff, rem, lane, acc):
    """tinyBLAS's last partial step loads zero padding: lanes past the tail add fma(0, 0) = +0."""
    if lane < rem:
        return fma32(load_weight(kind, w, off + lane * esize), y[yoff + lane], acc)
    return acc + np.float32(0)


@numba.njit(inline="always", **JIT)
def dot_float(kind, tiny, w, off, esize, y, yoff, n):
    """One weight row . one activation row, as tinyBLAS or ggml_vec_dot_{f32,f16,bf16} on AVX2."""
    v = _lanes(kind, tiny, w, off, y, yoff, n)
    if tiny:
        a0, a1, a2, a3, a4, a5, a6, a7 = v
        if n & 7:
            b = n & ~7
            a0 = _padded(kind, w, off + b * esize, esize, y, yoff + b, n & 7, 0, a0)
            a1 = _padded(kind, w, off + b * esize, esize, y, yoff + b, n & 7, 1, a1)
            a2 = _padded(kind, w, off + b * esize, esize, y, yoff + b, n & 7, 2, a2)
            a3 = _padded(kind, w, off + b * esize, esize, y, yoff + b, n & 7, 3, a3)
            a4 = _padded(kind, w, off + b * esize, esize, y, yoff + b, n & 7, 4, a4)
            a5 = _padded(kind, w, off + b * esize, esize, y, yoff + b, n & 7, 5, a5)
            a6 = _padded(kind, w, off + b * esize, esize, y, yoff + b, n & 7, 6, a6)
            a7 = _padded(kind, w, off + b * esize, esize, y, yoff + b, n & 7, 7, a7)
        t0, t1, t2, t3 = a4 + a0, a5 + a1, a6 + a2, a7 + a3
        return (t0 + t2) + (t1 + t3)
    t0, t1, t2, t3 = v[0] + v[4], v[1] + v[5], v[2] + v[6], v[3] + v[7]
    full = n & ~31
    if kind == TYPE_BF16:  # bf16 reduces like hsum_float_8, f32/f16 with two haddps
        res = (t0 + t2) + (t1 + t3)
    else:
        res = (t0 + t1) + (t2 + t3)
    return tail_sum(kind, w, off, esize, y, yoff, full, n, res)
