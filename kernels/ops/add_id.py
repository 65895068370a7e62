"""GGML_OP_ADD_ID, the per-expert bias of a mixture of experts (gpt-oss): dst row (i1, i2, i3) = src0's
row (i1, i2, i3) + src1's row ids[i1, i2], all F32.

ggml_add_id makes src0 [ne0, n_used, n_tokens], src1 [ne0, n_expert] and ids [n_used, n_tokens];
ggml-cpu (ggml_compute_forward_add_id_f32) adds with ggml_vec_add_f32, one rounding per element, so
any order gives the same bits. An id outside [0, n_expert) aborts ggml's worker; ours refuses the graph
before writing anything.
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
    a, b, ids = node.srcs(3)
    dst = node.dst
    if a.type != GGMLType.F32 or b.type != GGMLType.F32 or dst.type != GGMLType.F32 or ids.type != GGMLType.I32:
        raise InvalidNode("ADD_ID: src0, src1 and dst must be F32, the ids I32")
    if dst.ne != a.ne:
        raise InvalidNode(f"ADD_ID: dst shape {dst.ne} is not src0's {a.ne}")
    if b.ne[0] != a.ne[0] or b.ne[2:] != (1, 1):
        raise InvalidNode(f"ADD_ID: src1 {b.ne} is not a 2-D table of rows of {a.ne[0]}")
    if ids.ne[:2] != a.ne[1:3] or ids.ne[2:] != (1, 1):
        raise InvalidNode(f"ADD_ID: ids {ids.ne} do not match src0's rows {a.ne[1:3]}")
    if a.nb[0] != 4 or b.nb[0] != 4 or dst.nb[0] != 4:
        raise InvalidNode("ADD_ID: rows must be contiguous")


@numba.njit(inline="always", **JIT)
def _add_row(a, b, ids, dst, r):
    i1, i2, i3 = row_coords(r, a.shape[2], a.shape[1])
    src, bias, out = a[i3, i2, i1], b[0, 0, ids[0, 0, i2, i1]], dst[i3, i2, i1]
    for i in range(out.size):
        out[i] = src[i] + bias[i]


@row_loop
def _add_id(a, b, ids, dst):
    for r in numba.prange(a.shape[0] * a.shape[1] * a.shape[2]):
        _add_row(a, b, ids, dst, r)


def _checked(ids: np.ndarray, n_rows: int) -> np.ndarray:
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= n_rows):
        raise InvalidNode(f"ADD_ID: id out of range [0, {n_rows})")
    return ids


def prepare(node: Node):
    if 0 in node.dst.ne:
        return nothing
    a, b, ids, out = node.src[0].array(), node.src[1].array(), node.src[2].array(), node.dst.array()
    parallel = parallel_worthwhile(out.size)

    def run():  # the ids are this run's (an input, or a node computed just before): checked every run
        _add_id(a, b, _checked(ids, b.shape[2]), out, parallel)

    return run


forward = prepared(prepare)


def reference(node: Node) -> None:
    if 0 in node.dst.ne:
        return
    ids = _checked(node.src[2].array(), node.src[1].ne[1])[0, 0]  # (n_tokens, n_used)
    bias = node.src[1].array()[0, 0][ids]  # (n_tokens, n_used, ne0)
    node.dst.array()[...] = node.src[0].array() + bias[None]


register(GGMLOp.ADD_ID)(OpKernel(check, forward, reference, prepare))
