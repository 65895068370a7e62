"""GGML_OP_SUM_ROWS: dst[i3, i2, i1, 0] = the sum of src row (i1, i2, i3), F32.

ggml_vec_sum_f32 adds the row's elements one after the other into a double (ggml_float) and rounds the
total to float once; without -ffast-math gcc keeps that order, so the kernel does too and its numpy twin
takes the last element of a float64 cumulative sum (np.sum would add pairwise).
"""

from __future__ import annotations

import numba
import numpy as np

from wire.ggml import GGMLOp, GGMLType
from ..jit import JIT, row_loop
from ..node import InvalidNode, Node
from ..registry import OpKernel, nothing, prepared, register
from ..storage import parallel_worthwhile, row_coords


def check(node: Node) -> None:
    (src,) = node.srcs(1)
    dst = node.dst
    if src.type != GGMLType.F32 or dst.type != GGMLType.F32:
        raise InvalidNode(f"SUM_ROWS: only F32 -> F32 is supported, got {src.type.name} -> {dst.type.name}")
    if dst.ne != (1, *src.ne[1:]):
        raise InvalidNode(f"SUM_ROWS: result shape {dst.ne} is not {(1, *src.ne[1:])}")
    if src.nb[0] != 4 or dst.nb[0] != 4:
        raise InvalidNode("SUM_ROWS: rows must be contiguous")


@numba.njit(inline="always", **JIT)
def _sum_row(src, dst, r):
    n1, n2 = src.shape[2], src.shape[1]
    i1, i2, i3 = row_coords(r, n1, n2)
    row = src[i3, i2, i1]
    total = np.float64(0.0)
    for i in range(row.size):
        total += np.float64(row[i])
    dst[i3, i2, i1, 0] = np.float32(total)


@row_loop
def _sum_rows(src, dst):
    for r in numba.prange(src.shape[0] * src.shape[1] * src.shape[2]):
        _sum_row(src, dst, r)


def prepare(node: Node):
    src = node.src[0]
    if 0 in node.dst.ne:
        return nothing
    x, out = src.array(), node.dst.array()
    parallel = parallel_worthwhile(x.size)
    return lambda: _sum_rows(x, out, parallel)


forward = prepared(prepare)


def reference(node: Node) -> None:
    if 0 in node.dst.ne:
        return
    x = node.src[0].array()
    if x.shape[3] == 0:
        node.dst.array()[...] = 0
        return
    node.dst.array()[...] = np.cumsum(x, axis=3, dtype=np.float64)[..., -1:].astype(np.float32)


register(GGMLOp.SUM_ROWS)(OpKernel(check, forward, reference, prepare))
