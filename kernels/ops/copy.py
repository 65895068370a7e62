"""DUP, CPY, CONT and SET_ROWS: moving elements between tensors, converting type on the way.

ggml's copy semantics (ops.cpp `ggml_compute_forward_dup*`): the source is read in row-major order of
its own shape and the destination is filled in row-major order of *its* shape; only the element counts
must agree. Conversions go through f32, as ggml's `type_conversion_table` does. Into a quantized
type (a quantized KV cache), each source row is quantized whole by kernels/formats/kv_quants.py.

Storage kinds, their load/store and the converting copy between them are in kernels/storage.py.
"""

from __future__ import annotations

from functools import partial

import numba
import numpy as np
from numba import prange

from wire.ggml import TYPE_F32, TYPE_TRAITS, GGMLOp, GGMLType

from ..jit import JIT, row_loop
from ..formats.kv_quants import KV_QUANT_TYPES, quantize_rows, quantize_rows_reference
from ..node import InvalidNode, Node, Tensor
from ..registry import OpKernel, prepared, register
from ..storage import (RAW_BITS, copy_arrays, from_f32_reference, load_f32, parallel_worthwhile,
                      raw_storage, storage, store_f32, to_f32_reference, widen_f32)

# ---------------------------------------------------------------------------------------------
# DUP / CPY / CONT

# (source type, destination type) pairs ggml's dup converts between, quantization aside
_CONVERSIONS = {
    (GGMLType.F16, GGMLType.F32), (GGMLType.F16, GGMLType.BF16),
    (GGMLType.BF16, GGMLType.F32), (GGMLType.BF16, GGMLType.F16),
    (GGMLType.F32, GGMLType.F16), (GGMLType.F32, GGMLType.BF16), (GGMLType.F32, GGMLType.I32),
    (GGMLType.I32, GGMLType.F32),
}


def _nelements(t: Tensor) -> int:
    return t.ne[0] * t.ne[1] * t.ne[2] * t.ne[3]


# ggml_compute_forward_dup_to_q: float rows quantized by the destination type's from_float
_QUANTIZING_SOURCES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)


def _quantizing(src: Tensor, dst: Tensor) -> bool:
    return src.type != dst.type and dst.type in KV_QUANT_TYPES


def _write_contiguous(dst: Tensor, rows: np.ndarray) -> None:
    """Quantized rows, in row-major order, into a contiguous destination's bytes."""
    flat = rows.reshape(-1)
    dst.mem[dst.offset : dst.offset + flat.size] = flat


def copy_tensor(src: Tensor, dst: Tensor) -> None:
    """ggml_compute_forward_dup: fill dst from src in row-major order, converting the type if needed."""
    if _quantizing(src, dst):
        if _nelements(src):
            values = widen_f32(src).reshape(-1, src.ne[0])
            _write_contiguous(dst, quantize_rows(dst.type, values, parallel_worthwhile(values.size, cost=8)))
    elif src.type != dst.type:
        copy_arrays(storage(src), storage(dst), int(src.type), int(dst.type))
    elif not TYPE_TRAITS[src.type].is_quantized:
        copy_arrays(raw_storage(src), raw_storage(dst), RAW_BITS, RAW_BITS)
    else:  # whole blocks, which lie contiguously within rows: row-major bytes = row-major blocks
        copy_arrays(src.rows(), dst.rows(), RAW_BITS, RAW_BITS)


def _check_quantizing_copy(node: Node, src: Tensor, dst: Tensor) -> None:
    if src.type not in _QUANTIZING_SOURCES:
        raise InvalidNode(f"{node.op.name}: no conversion {src.type.name} -> {dst.type.name}")
    # ggml quantizes whole source rows straight into consecutive destination blocks
    if not dst.is_contiguous():
        raise InvalidNode(f"{node.op.name}: quantizing copy needs a contiguous destination")
    if src.nb[0] != TYPE_TRAITS[src.type].type_size or src.ne[0] % TYPE_TRAITS[dst.type].block_size:
        raise InvalidNode(f"{node.op.name}: quantizing copy needs contiguous source rows of whole blocks")


def _check_dup(node: Node) -> None:
    (src,) = node.srcs(1)
    dst = node.dst
    if _nelements(src) != _nelements(dst):
        raise InvalidNode(f"{node.op.name}: {_nelements(src)} source elements into {_nelements(dst)}")
    if _quantizing(src, dst):
        _check_quantizing_copy(node, src, dst)
    elif src.type != dst.type and (src.type, dst.type) not in _CONVERSIONS:
        raise InvalidNode(f"{node.op.name}: no conversion {src.type.name} -> {dst.type.name}")
    if src.type == dst.type and TYPE_TRAITS[src.type].is_quantized:
        # blocks are moved whole, so each side's rows must consist of whole blocks
        tt = TYPE_TRAITS[src.type]
        if any(t.nb[0] != tt.type_size or t.ne[0] % tt.block_size for t in (src, dst)):
            raise InvalidNode(f"{node.op.name}: quantized copy needs rows of whole, contiguous blocks")
        # ggml-cpu's dup_bytes sizes rows in elements instead of blocks when only the destination is
        # contiguous and the shapes differ, overrunning both tensors: refuse what it cannot do
        both = src.is_contiguous() and dst.is_contiguous()
        if dst.is_contiguous() and not both and src.ne != dst.ne:
            raise InvalidNode(f"{node.op.name}: quantized copy from a strided source into a reshaped tensor")
    if node.op == GGMLOp.CPY and len(node.src) > 1 and node.src[1] is not None:
        target = node.src[1]
        if target.type != dst.type or target.ne != dst.ne:
            raise InvalidNode("CPY: result must be a view of its destination (src[1])")
    if node.op in (GGMLOp.DUP, GGMLOp.CONT) and src.type != dst.type:
        raise InvalidNode(f"{node.op.name}: result type must equal source type")


def _prepare_dup(node: Node):
    """copy_tensor with its views made once, except for a quantizing copy (which widens on every run)."""
    src, dst = node.src[0], node.dst
    if _quantizing(src, dst):
        return partial(copy_tensor, src, dst)
    if src.type != dst.type:
        return partial(copy_arrays, storage(src), storage(dst), int(src.type), int(dst.type))
    if not TYPE_TRAITS[src.type].is_quantized:
        return partial(copy_arrays, raw_storage(src), raw_storage(dst), RAW_BITS, RAW_BITS)
    return partial(copy_arrays, src.rows(), dst.rows(), RAW_BITS, RAW_BITS)


_forward_dup = prepared(_prepare_dup)


def reference_copy_array(src: Tensor, dst: Tensor) -> None:
    """numpy twin of copy_tensor."""
    if _quantizing(src, dst):
        if _nelements(src):
            values = to_f32_reference(src).reshape(-1, src.ne[0])
            _write_contiguous(dst, quantize_rows_reference(dst.type, values))
        return
    if src.type == dst.type:
        s, d = (src.rows(), dst.rows()) if src.is_quantized else (raw_storage(src), raw_storage(dst))
        d[...] = s.reshape(d.shape)  # reshape reads src row-major; assignment writes dst row-major
        return
    values = to_f32_reference(src).reshape(dst.ne[3], dst.ne[2], dst.ne[1], dst.ne[0])
    storage(dst)[...] = from_f32_reference(values, dst.type)


def _reference_dup(node: Node) -> None:
    reference_copy_array(node.src[0], node.dst)


for _op in (GGMLOp.DUP, GGMLOp.CPY, GGMLOp.CONT):
    register(_op)(OpKernel(_check_dup, _forward_dup, _reference_dup, _prepare_dup))


# ---------------------------------------------------------------------------------------------
# SET_ROWS: dst[idx[i, i2 % n11, i3 % n12], i2, i3] = convert(values[i, i2, i3])
# sources: src0 = values (F32/F16), src1 = row indices (I64/I32), src2 = the destination tensor;
# the node's result is a view of that destination, so it is what we write.

_SET_ROWS_DST = (GGMLType.F32, GGMLType.F16, GGMLType.BF16, *KV_QUANT_TYPES)


def _check_set_rows(node: Node) -> None:
    values, index = node.srcs(2)
    dst = node.dst
    if values.type not in (GGMLType.F32, GGMLType.F16):
        raise InvalidNode(f"SET_ROWS: values must be F32 or F16, not {values.type.name}")
    if index.type not in (GGMLType.I64, GGMLType.I32):
        raise InvalidNode(f"SET_ROWS: indices must be I64 or I32, not {index.type.name}")
    if dst.type not in _SET_ROWS_DST:
        raise InvalidNode(f"SET_ROWS: destination type {dst.type.name} not supported")
    if len(node.src) > 2 and node.src[2] is not None:
        target = node.src[2]
        if target.type != dst.type or target.ne != dst.ne:
            raise InvalidNode("SET_ROWS: result must be a view of its destination (src[2])")
    ve, ie, de = values.ne, index.ne, dst.ne
    if de[0] != ve[0] or de[2] != ve[2] or de[3] != ve[3]:
        raise InvalidNode(f"SET_ROWS: destination {de} and values {ve} disagree outside dim 1")
    if de[0] % TYPE_TRAITS[dst.type].block_size:
        raise InvalidNode(f"SET_ROWS: {de[0]} elements are not whole {dst.type.name} blocks")
    if ie[0] != ve[1]:
        raise InvalidNode(f"SET_ROWS: {ie[0]} indices for {ve[1]} value rows")
    if ie[3] != 1 or ie[1] == 0 or ie[2] == 0 or ve[2] % ie[1] != 0 or ve[3] % ie[2] != 0:
        raise InvalidNode(f"SET_ROWS: indices {ie} cannot broadcast over values {ve}")
    for t, what in ((values, "values"), (dst, "destination")):
        if t.ne[0] != 1 and t.nb[0] != TYPE_TRAITS[t.type].type_size:
            raise InvalidNode(f"SET_ROWS: {what} rows must be contiguous")


@numba.njit(**JIT)
def _set_rows_plane(values, idx, dst, vkind, dkind, p):
    """All value rows of plane p = (i2, i3), in order, so a repeated index keeps the last row."""
    n3, n2, n1, n0 = values.shape
    i2 = p % n2
    i3 = p // n2
    for i1 in range(n1):
        row = idx[0, i3 % idx.shape[1], i2 % idx.shape[2], i1]
        for i0 in range(n0):
            v = values[i3, i2, i1, i0]
            if vkind == dkind and vkind != TYPE_F32:
                dst[i3, i2, row, i0] = v  # F16 into F16: a plain copy
            else:
                store_f32(dst, i3, i2, row, i0, load_f32(v, vkind), dkind)


@row_loop
def _set_rows(values, idx, dst, vkind, dkind):
    """Returns False, having written nothing, if an index is out of range."""
    for v in idx.flat:
        if v < 0 or v >= dst.shape[2]:
            return False
    n_planes = values.shape[0] * values.shape[1]
    for p in prange(n_planes):
        _set_rows_plane(values, idx, dst, vkind, dkind, np.int64(p))
    return True


def _prepare_set_rows(node: Node):
    values, dst = node.src[0], node.dst
    idx = node.src[1].array()
    parallel = parallel_worthwhile(_nelements(values))
    if dst.is_quantized:  # quantize every value row first (ggml's from_float), then scatter bytes
        quantize_parallel, dst_rows = parallel_worthwhile(_nelements(values), cost=8), dst.rows()

        def scatter():
            rows = quantize_rows(dst.type, widen_f32(values), quantize_parallel)
            return _set_rows(rows, idx, dst_rows, RAW_BITS, RAW_BITS, parallel)
    else:
        scatter = partial(_set_rows, storage(values), idx, storage(dst), int(values.type), int(dst.type), parallel)

    def run():  # the indices come with each run's inputs: checked as the kernel meets them
        if not scatter():
            raise InvalidNode(f"SET_ROWS: row index out of range [0, {dst.ne[1]})")

    return run


_forward_set_rows = prepared(_prepare_set_rows)


def _reference_set_rows(node: Node) -> None:
    values, dst = node.src[0], node.dst
    idx = node.src[1].array()
    if idx.size and (idx.min() < 0 or idx.max() >= dst.ne[1]):
        raise InvalidNode(f"SET_ROWS: row index out of range [0, {dst.ne[1]})")
    if dst.is_quantized:
        converted, out = quantize_rows_reference(dst.type, to_f32_reference(values)), dst.rows()
    else:  # F16 -> F32 -> F16 is exact
        converted, out = from_f32_reference(to_f32_reference(values), dst.type), storage(dst)
    for i3 in range(values.ne[3]):
        for i2 in range(values.ne[2]):
            for i1, row in enumerate(idx[0, i3 % idx.shape[1], i2 % idx.shape[2], :]):
                out[i3, i2, row] = converted[i3, i2, i1]


register(GGMLOp.SET_ROWS)(OpKernel(_check_set_rows, _forward_set_rows, _reference_set_rows, _prepare_set_rows))
