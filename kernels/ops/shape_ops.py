"""CONCAT, REPEAT and ARGMAX: moving elements into a new shape, and finding each row's largest.

Shapes and op params follow ggml.c's constructors (`ggml_concat`, `ggml_repeat`, `ggml_argmax`);
element semantics follow ggml-cpu's ops.cpp. CONCAT and REPEAT copy bits unchanged (no float loads),
so numpy views over the tensors' own strides do the work; ARGMAX needs ggml's exact loop.
"""

from __future__ import annotations

import numba
import numpy as np
from numpy.lib.stride_tricks import as_strided

from wire.ggml import MAX_DIMS, TYPE_TRAITS, GGMLOp, GGMLType

from ..jit import JIT
from ..node import InvalidNode, Node, Tensor
from ..registry import OpKernel, prepared, register
from ..storage import raw_storage

T = GGMLType


def _is_empty(t: Tensor) -> bool:
    return any(n == 0 for n in t.ne)


def _contiguous_rows(t: Tensor) -> bool:
    """ggml_is_contiguous_rows for plain types: a row's elements lie side by side."""
    return t.ne[0] == 1 or t.nb[0] == TYPE_TRAITS[t.type].type_size


# ---------------------------------------------------------------------------------------------
# CONCAT: dst = a and b joined along dim op_params[0]; every other dim must agree.
# ggml-cpu copies element by element through each tensor's strides for 1, 2 and 4 byte types; the
# remaining plain types (I64, F64) go through its row-memcpy path, which needs contiguous rows.

CONCAT_STRIDED_TYPES = (T.F32, T.I32, T.F16, T.BF16, T.I16, T.I8)
CONCAT_ROW_COPY_TYPES = (T.I64, T.F64)


def _check_concat(node: Node) -> None:
    a, b = node.srcs(2)
    dst = node.dst
    dim = node.param("dim")
    if not 0 <= dim < MAX_DIMS:
        raise InvalidNode(f"CONCAT: dim {dim} outside [0, {MAX_DIMS})")
    if a.type not in CONCAT_STRIDED_TYPES + CONCAT_ROW_COPY_TYPES:
        raise InvalidNode(f"CONCAT: unsupported type {a.type.name}")
    if b.type != a.type or dst.type != a.type:
        raise InvalidNode(f"CONCAT: types {a.type.name}, {b.type.name} -> {dst.type.name} must all agree")
    for d in range(MAX_DIMS):
        if d != dim and a.ne[d] != b.ne[d]:
            raise InvalidNode(f"CONCAT: sources {a.ne} and {b.ne} differ in dim {d}")
    expect = tuple(a.ne[d] + b.ne[d] if d == dim else a.ne[d] for d in range(MAX_DIMS))
    if dst.ne != expect:
        raise InvalidNode(f"CONCAT: dst shape {dst.ne} is not {expect}")
    if a.type in CONCAT_ROW_COPY_TYPES and not all(_contiguous_rows(t) for t in (a, b, dst)):
        raise InvalidNode(f"CONCAT: {a.type.name} rows must be contiguous")


def _prepare_concat(node: Node):
    """The two copies into dst's halves, on views made once (a decode step's MLA concatenates its
    queries in every layer: the views cost more than the copies)."""
    a, b = node.src[:2]
    axis = 3 - node.param("dim")  # numpy views are (ne3, ne2, ne1, ne0)
    out = raw_storage(node.dst)
    split = a.ne[3 - axis]
    head = [slice(None)] * 4
    tail = [slice(None)] * 4
    head[axis], tail[axis] = slice(0, split), slice(split, None)
    copies = ((out[tuple(head)], raw_storage(a)), (out[tuple(tail)], raw_storage(b)))

    def run():
        for dst, src in copies:
            np.copyto(dst, src)

    return run


_forward_concat = prepared(_prepare_concat)


def _reference_concat(node: Node) -> None:
    a, b = node.src[:2]
    raw_storage(node.dst)[...] = np.concatenate((raw_storage(a), raw_storage(b)), axis=3 - node.param("dim"))


register(GGMLOp.CONCAT)(OpKernel(_check_concat, _forward_concat, _reference_concat, _prepare_concat))


# ---------------------------------------------------------------------------------------------
# REPEAT: dst tiles src, each dst dim a whole multiple of src's (ggml_can_repeat).
# ggml-cpu copies whole src rows into dst, asserting both have contiguous rows.

REPEAT_TYPES = (T.F32, T.I32, T.F16, T.BF16, T.I16)


def _check_repeat(node: Node) -> None:
    (src,) = node.srcs(1)
    dst = node.dst
    if src.type not in REPEAT_TYPES:
        raise InvalidNode(f"REPEAT: unsupported type {src.type.name}")
    if dst.type != src.type:
        raise InvalidNode(f"REPEAT: dst type {dst.type.name} is not the source's {src.type.name}")
    if _is_empty(src):
        if not _is_empty(dst):
            raise InvalidNode(f"REPEAT: cannot fill {dst.ne} from an empty source")
        return
    if any(d % s for d, s in zip(dst.ne, src.ne)):
        raise InvalidNode(f"REPEAT: dst shape {dst.ne} is not a repetition of {src.ne}")
    size = TYPE_TRAITS[src.type].type_size
    if src.nb[0] != size or dst.nb[0] != size:
        raise InvalidNode("REPEAT: source and dst rows must be contiguous")


def _forward_repeat(node: Node) -> None:
    src, dst = node.src[0], node.dst
    if _is_empty(dst):
        return
    # dst seen as (repeat, src extent) pairs per dim: one broadcast assignment fills every copy
    shape, strides = [], []
    for d in reversed(range(MAX_DIMS)):
        shape += [dst.ne[d] // src.ne[d], src.ne[d]]
        strides += [src.ne[d] * dst.nb[d], dst.nb[d]]
    tiles = as_strided(raw_storage(dst), shape=shape, strides=strides, writeable=True)
    tiles[...] = raw_storage(src)[None, :, None, :, None, :, None, :]


def _reference_repeat(node: Node) -> None:
    src, dst = node.src[0], node.dst
    if _is_empty(dst):
        return
    reps = tuple(dst.ne[d] // src.ne[d] for d in reversed(range(MAX_DIMS)))
    raw_storage(dst)[...] = np.tile(raw_storage(src), reps)


register(GGMLOp.REPEAT)(OpKernel(_check_repeat, _forward_repeat, _reference_repeat))


# ---------------------------------------------------------------------------------------------
# ARGMAX: I32 dst[i1] = index of the largest element of F32 row i1 of a matrix.
# ggml_vec_argmax_f32 keeps `max = MAX(max, x[i])` with MAX(a, b) = a > b ? a : b and takes i
# whenever max == x[i]. So a tie picks the LAST index (+0 and -0 tie), and a NaN makes max NaN, so
# the next element restarts the search while the NaN itself is never chosen.


def _check_argmax(node: Node) -> None:
    (src,) = node.srcs(1)
    dst = node.dst
    if src.type != T.F32:
        raise InvalidNode(f"ARGMAX: source must be F32, not {src.type.name}")
    if src.ne[2] != 1 or src.ne[3] != 1:
        raise InvalidNode(f"ARGMAX: source {src.ne} is not a matrix")
    if src.ne[0] > np.iinfo(np.int32).max:
        raise InvalidNode(f"ARGMAX: rows of {src.ne[0]} elements overflow an I32 index")
    if dst.type != T.I32 or dst.ne != (src.ne[1], 1, 1, 1):
        raise InvalidNode(f"ARGMAX: dst must be I32 of shape ({src.ne[1]}, 1, 1, 1), not {dst.type.name} {dst.ne}")
    # ggml reads each row as packed floats whatever nb[0] says; refuse rather than read past the view
    if not _contiguous_rows(src):
        raise InvalidNode("ARGMAX: source rows must be contiguous")


@numba.njit(**JIT)
def _argmax_rows(x, out):
    """ggml_vec_argmax_f32 over each row of x (n_rows, n) into out (n_rows,)."""
    for r in range(x.shape[0]):
        best = np.float32(-np.inf)
        idx = 0
        for i in range(x.shape[1]):
            v = x[r, i]
            best = best if best > v else v
            if best == v:
                idx = i
        out[r] = idx


def _forward_argmax(node: Node) -> None:
    if _is_empty(node.dst):
        return
    _argmax_rows(node.src[0].array()[0, 0], node.dst.array()[0, 0, 0])


def _argmax_reference_row(row: np.ndarray) -> int:
    """The same answer, argued instead of simulated: after a NaN the search starts afresh (max = NaN
    compares false, so the next element becomes max), trailing NaNs change nothing, and without NaN
    the running update lands last on the final occurrence of the row's maximum."""
    nan = np.isnan(row)
    while row.size and nan[-1]:  # trailing NaNs: the answer is that of the row before them
        row, nan = row[:-1], nan[:-1]
    if not row.size:
        return 0
    start = int(np.flatnonzero(nan)[-1]) + 1 if nan.any() else 0
    segment = row[start:]
    return start + int(np.flatnonzero(segment == segment.max())[-1])


def _reference_argmax(node: Node) -> None:
    if _is_empty(node.dst):
        return
    out = node.dst.array()[0, 0, 0]
    for r, row in enumerate(node.src[0].array()[0, 0]):
        out[r] = _argmax_reference_row(row)


register(GGMLOp.ARGMAX)(OpKernel(_check_argmax, _forward_argmax, _reference_argmax))
