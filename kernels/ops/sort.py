"""GGML_OP_ARGSORT and GGML_OP_TOP_K: per row of an F32 source, the I32 positions of its elements in
sorted order (ARGSORT: all, ascending or descending by op_params[0]; TOP_K: the k largest).

ggml-cpu sorts with libstdc++'s std::sort (introsort down to runs of 16, then insertion sort) and picks
TOP_K with std::partial_sort (heap select, then sort_heap), then swaps the first two results "to
emphasize that the order is not important". Neither is stable, so which of two equal values comes first
depends on those algorithms: the numba kernels replay them step for step (bits/stl_algo.h,
bits/stl_heap.h), with bounds checks the C++ leaves out (a NaN breaks the strict weak order its
unguarded loops rely on; here it only yields some order). The numpy twins are stable sorts, the same
result whenever a row has no ties (and, for ARGSORT, whenever it has at most 16 elements, which
insertion sort keeps stable).

Like ggml, both address row i of the flattened source at i * nb01 and of the result at i * nb1; the
check refuses tensors whose rows are not evenly spaced that way.
"""

from __future__ import annotations

import numba
import numpy as np

from wire.ggml import GGMLOp, GGMLType
from ..jit import JIT, row_loop
from ..node import InvalidNode, Node
from ..registry import OpKernel, nothing, prepared, register
from ..storage import parallel_worthwhile

SORT_ASC, SORT_DESC = 0, 1  # enum ggml_sort_order
_THRESHOLD = 16  # libstdc++'s _S_threshold


def _evenly_spaced_rows(t) -> bool:
    """Row i of the flattened tensor starts at i * nb[1] (what ggml's flat row loop assumes)."""
    return (t.ne[2] == 1 or t.nb[2] == t.ne[1] * t.nb[1]) and (t.ne[3] == 1 or t.nb[3] == t.ne[2] * t.nb[2])


def check(node: Node) -> None:
    (src,) = node.srcs(1)
    dst, name = node.dst, node.op.name
    if src.type != GGMLType.F32 or dst.type != GGMLType.I32:
        raise InvalidNode(f"{name}: only F32 -> I32 is supported, got {src.type.name} -> {dst.type.name}")
    want = src.ne if node.op == GGMLOp.ARGSORT else (dst.ne[0], *src.ne[1:])
    if dst.ne != want or (node.op == GGMLOp.TOP_K and dst.ne[0] > src.ne[0]):
        raise InvalidNode(f"{name}: result shape {dst.ne} does not fit source {src.ne}")
    if node.op == GGMLOp.ARGSORT and node.param("order") not in (SORT_ASC, SORT_DESC):
        raise InvalidNode(f"ARGSORT: invalid sort order {node.param('order')}")
    if src.nb[0] != 4 or dst.nb[0] != 4:
        raise InvalidNode(f"{name}: rows must be contiguous")
    if not (_evenly_spaced_rows(src) and _evenly_spaced_rows(dst)):
        raise InvalidNode(f"{name}: rows must be evenly spaced in dims 1..3")


# ----------------------------------------------------------------------------------------------
# libstdc++'s algorithms over positions `seq` (int32) compared by key[pos]: less(a, b) is the
# comparator, key[a] < key[b] ascending, key[a] > key[b] descending


@numba.njit(inline="always", **JIT)
def _less(key, a, b, desc):
    return key[a] > key[b] if desc else key[a] < key[b]


@numba.njit(**JIT)
def _adjust_heap(seq, key, desc, first, hole, length, value):
    top = hole
    child = hole
    while child < (length - 1) // 2:
        child = 2 * (child + 1)
        if _less(key, seq[first + child], seq[first + child - 1], desc):
            child -= 1
        seq[first + hole] = seq[first + child]
        hole = child
    if length % 2 == 0 and child == (length - 2) // 2:
        child = 2 * (child + 1)
        seq[first + hole] = seq[first + child - 1]
        hole = child - 1
    parent = (hole - 1) // 2  # __push_heap
    while hole > top and _less(key, seq[first + parent], value, desc):
        seq[first + hole] = seq[first + parent]
        hole = parent
        parent = (hole - 1) // 2
    seq[first + hole] = value


@numba.njit(**JIT)
def _partial_sort(seq, key, desc, first, middle, last):
    """std::partial_sort: make_heap, heap select, sort_heap."""
    length = middle - first
    if length >= 2:
        for parent in range((length - 2) // 2, -1, -1):
            _adjust_heap(seq, key, desc, first, parent, length, seq[first + parent])
    for i in range(middle, last):
        if _less(key, seq[i], seq[first], desc):  # __pop_heap(first, middle, i)
            value = seq[i]
            seq[i] = seq[first]
            _adjust_heap(seq, key, desc, first, 0, length, value)
    while middle - first > 1:
        middle -= 1
        value = seq[middle]
        seq[middle] = seq[first]
        _adjust_heap(seq, key, desc, first, 0, middle - first, value)


@numba.njit(inline="always", **JIT)
def _linear_insert(seq, key, desc, lo, last):
    """__unguarded_linear_insert, guarded at lo."""
    value = seq[last]
    nxt = last - 1
    while nxt >= lo and _less(key, value, seq[nxt], desc):
        seq[last] = seq[nxt]
        last = nxt
        nxt -= 1
    seq[last] = value


@numba.njit(**JIT)
def _insertion_sort(seq, key, desc, first, last):
    for i in range(first + 1, last):
        if _less(key, seq[i], seq[first], desc):
            value = seq[i]
            for j in range(i, first, -1):
                seq[j] = seq[j - 1]
            seq[first] = value
        else:
            _linear_insert(seq, key, desc, first, i)


@numba.njit(inline="always", **JIT)
def _swap(seq, i, j):
    seq[i], seq[j] = seq[j], seq[i]


@numba.njit(**JIT)
def _partition_pivot(seq, key, desc, first, last):
    """__unguarded_partition_pivot: median of three to first, then Hoare partition of [first+1, last)."""
    a, b, c = first + 1, first + (last - first) // 2, last - 1
    if _less(key, seq[a], seq[b], desc):
        if _less(key, seq[b], seq[c], desc):
            _swap(seq, first, b)
        elif _less(key, seq[a], seq[c], desc):
            _swap(seq, first, c)
        else:
            _swap(seq, first, a)
    elif _less(key, seq[a], seq[c], desc):
        _swap(seq, first, a)
    elif _less(key, seq[b], seq[c], desc):
        _swap(seq, first, c)
    else:
        _swap(seq, first, b)
    pivot = seq[first]
    lo, hi = first + 1, last
    while True:
        while lo < last - 1 and _less(key, seq[lo], pivot, desc):
            lo += 1
        hi -= 1
        while hi > first and _less(key, pivot, seq[hi], desc):
            hi -= 1
        if not lo < hi:
            return lo
        _swap(seq, lo, hi)
        lo += 1


@numba.njit(**JIT)
def std_sort(seq, key, desc):
    """std::sort of all of seq: the introsort loop (its recursion on the right part kept on a stack;
    the parts are disjoint, so the order they are done in does not matter), then insertion sort."""
    n = seq.size
    if n < 2:
        return
    depth = 2 * (63 - _clz(n))
    stack = np.empty((2 * 64 + 2, 3), np.int64)
    top = 0
    stack[0, 0], stack[0, 1], stack[0, 2] = 0, n, depth
    top = 1
    while top > 0:
        top -= 1
        first, last, limit = stack[top, 0], stack[top, 1], stack[top, 2]
        while last - first > _THRESHOLD:
            if limit == 0:
                _partial_sort(seq, key, desc, first, last, last)
                break
            limit -= 1
            cut = _partition_pivot(seq, key, desc, first, last)
            stack[top, 0], stack[top, 1], stack[top, 2] = cut, last, limit
            top += 1
            last = cut
    if n > _THRESHOLD:
        _insertion_sort(seq, key, desc, 0, _THRESHOLD)
        for i in range(_THRESHOLD, n):
            _linear_insert(seq, key, desc, 0, i)
    else:
        _insertion_sort(seq, key, desc, 0, n)


@numba.njit(inline="always", **JIT)
def _clz(n):
    """Leading zeros of a positive int64 (so 63 - _clz(n) is floor(log2 n), libstdc++'s __lg)."""
    z = 0
    bit = np.int64(1) << 62
    while bit > 0 and not n & bit:
        z += 1
        bit >>= 1
    return z + 1


@row_loop
def _argsort_rows(src, dst, desc):
    """src (rows, ne00) f32, dst (rows, ne00) i32."""
    for r in numba.prange(src.shape[0]):
        seq = dst[r]
        for j in range(seq.size):
            seq[j] = j
        std_sort(seq, src[r], desc)


@row_loop
def _top_k_rows(src, dst, scratch):
    """src (rows, ne00) f32, dst (rows, k) i32; scratch (rows, ne00) i32."""
    k = dst.shape[1]
    for r in numba.prange(src.shape[0]):
        seq = scratch[r]
        for j in range(seq.size):
            seq[j] = j
        _partial_sort(seq, src[r], True, 0, k, seq.size)
        for j in range(k):
            dst[r, j] = seq[j]
        if k > 1:
            dst[r, 0], dst[r, 1] = seq[1], seq[0]


def _rows(t, dtype) -> np.ndarray:
    """(rows, ne0) view: row i at i * nb[1], as ggml addresses them."""
    n_rows = t.ne[1] * t.ne[2] * t.ne[3]
    return np.ndarray((n_rows, t.ne[0]), dtype=dtype, buffer=t.mem, offset=t.offset, strides=(t.nb[1], 4))


def prepare(node: Node):
    src, dst = node.src[0], node.dst
    if 0 in dst.ne:
        return nothing
    x, out = _rows(src, np.float32), _rows(dst, np.int32)
    parallel = parallel_worthwhile(x.size, cost=8)
    if node.op == GGMLOp.ARGSORT:
        desc = node.param("order") == SORT_DESC
        return lambda: _argsort_rows(x, out, desc, parallel)
    scratch = np.empty(x.shape, np.int32)
    return lambda: _top_k_rows(x, out, scratch, parallel)


forward = prepared(prepare)


def reference(node: Node) -> None:
    src, dst = node.src[0], node.dst
    if 0 in dst.ne:
        return
    x, out = _rows(src, np.float32), _rows(dst, np.int32)
    if node.op == GGMLOp.ARGSORT:
        out[...] = np.argsort(-x if node.param("order") == SORT_DESC else x, axis=1, kind="stable")
        return
    top = np.argsort(-x, axis=1, kind="stable")[:, : out.shape[1]]
    if top.shape[1] > 1:
        top[:, [0, 1]] = top[:, [1, 0]]
    out[...] = top


register(GGMLOp.ARGSORT)(OpKernel(check, forward, reference, prepare))
register(GGMLOp.TOP_K)(OpKernel(check, forward, reference, prepare))
