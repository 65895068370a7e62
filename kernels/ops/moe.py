"""GGML_OP_MUL_MAT_ID, the mixture-of-experts product: dst[i0, e, t] = row i0 of expert ids[e, t] of src0
. src1 row (e % ne11, t).

Follows ggml_compute_forward_mul_mat_id of the x86 ggml-cpu build bit for bit:
  * src1 (f32) is converted to the weights' vec_dot_type first (q8_0/q8_1/q8_K, fp16/bf16 rounding);
  * the (slot e, token t) pairs are grouped per expert in token-major order, and each expert is then a
    product of its weights with its cne1 routed rows, on the route ggml picks *per expert*: its tiled
    kernel for K-quant and IQ4_XS weights when cne1 >= 8 (kernels.formats.kquants.TILED_MIN_ROWS), else the
    type's vec_dot (ggml_vec_dot_<w>_q8_<0|1|K>, the 32-lane ggml_vec_dot_<f32|f16|bf16>, or the
    16-lane one of an AVX-512 target). llamafile's tinyBLAS, which MUL_MAT takes for batches of float
    and IQ4_NL weights, never computes MUL_MAT_ID.
The dot products are the ones MUL_MAT uses (kernels.formats.quants, kernels.formats.kquant_dot, kernels.formats.float_dot).
The numpy twin is that definition spelled out: per expert, MUL_MAT's own reference on the gathered rows.
"""

from __future__ import annotations

import numba
import numpy as np

from ..formats import kquant_dot, kquant_vnni, kquants, quants
from ..formats.float_dot import dot_float, round_activations
from ..formats.float_dot512 import SCRATCH, dot16
from wire.ggml import TYPE_IQ4_NL, TYPE_TRAITS, GGMLOp, GGMLType
from ..jit import JIT
from ..formats.kquants import KQUANT_TYPES, TILED_MIN_ROWS
from ..node import InvalidNode, Node, Tensor
from ..formats.quants import FLOAT_TYPES, QK, QUANT_TYPES, row_dot1, row_dot2, row_dot4
from ..registry import KERNELS, OpKernel, nothing, prepared, register
from ..tasks import QUANTIZE_PARALLEL_ROWS, ROWS_PER_TASK

T = GGMLType
WEIGHT_TYPES = FLOAT_TYPES + QUANT_TYPES + KQUANT_TYPES
# the weights whose MUL_MAT batches tinyBLAS would take: their MUL_MAT_ID rows are each a vec_dot
VEC_DOT_ONLY = FLOAT_TYPES + (T.IQ4_NL,)


def check(node: Node) -> None:
    src0, src1, ids = node.srcs(3)
    dst = node.dst
    if src0.type not in WEIGHT_TYPES:
        raise InvalidNode(f"MUL_MAT_ID: unsupported weight type {src0.type.name}")
    if src1.type != T.F32 or ids.type != T.I32 or dst.type != T.F32:
        raise InvalidNode("MUL_MAT_ID: src1 and dst must be F32, the expert ids I32")
    if src0.ne[3] != 1 or src1.ne[3] != 1 or ids.ne[2] != 1 or ids.ne[3] != 1:
        raise InvalidNode("MUL_MAT_ID: experts and activations must be 3-D, the expert ids 2-D")
    if ids.ne[1] != src1.ne[2]:
        raise InvalidNode(f"MUL_MAT_ID: {ids.ne[1]} expert lists for {src1.ne[2]} activation columns")
    if src0.ne[0] != src1.ne[0]:
        raise InvalidNode(f"MUL_MAT_ID: row lengths differ ({src0.ne[0]} vs {src1.ne[0]})")
    if src1.ne[1] <= 0 or ids.ne[0] % src1.ne[1]:
        raise InvalidNode(f"MUL_MAT_ID: {src1.ne[1]} activation rows do not broadcast over {ids.ne[0]} slots")
    expect = (src0.ne[1], ids.ne[0], src1.ne[2], 1)
    if dst.ne != expect:
        raise InvalidNode(f"MUL_MAT_ID: dst shape {dst.ne} is not {expect}")
    tt = TYPE_TRAITS[src0.type]
    if src0.ne[0] % tt.block_size:
        raise InvalidNode(f"MUL_MAT_ID: row length {src0.ne[0]} is not a multiple of {tt.block_size}")
    if src0.nb[0] != tt.type_size or src1.nb[0] != 4:
        raise InvalidNode("MUL_MAT_ID: rows of src0 and src1 must be contiguous")
    if src0.nb[0] > src0.nb[1]:
        raise InvalidNode("MUL_MAT_ID: src0 must not be transposed")
    nb = dst.nb
    if 0 not in dst.ne and not (nb[0] == 4 and nb[0] <= nb[1] <= nb[2] <= nb[3]):
        raise InvalidNode("MUL_MAT_ID: dst must have contiguous rows and non-decreasing strides")


# ----------------------------------------------------------------------------------------------
# numba kernels: each groups the pairs, converts the routed activation rows into a scratch in group
# order (so an expert's rows are adjacent, as the 4- and 8-row dots want), then runs one task per
# (expert, slice of ROWS_PER_TASK weight rows)


@numba.njit(inline="always", **JIT)
def _group(ids, n_as, starts, pairs):
    """ggml's row groups: pairs[starts[a]:starts[a+1]] are expert a's pairs t * n_ids + e, token-major.
    False, with nothing written, if an id names no expert."""
    n_tok, n_ids = ids.shape
    for t in range(n_tok):
        for e in range(n_ids):
            if ids[t, e] < 0 or ids[t, e] >= n_as:
                return False
    starts[:] = 0
    for t in range(n_tok):
        for e in range(n_ids):
            starts[ids[t, e] + 1] += 1
    for a in range(n_as):
        starts[a + 1] += starts[a]
    fill = starts[:n_as].copy()
    for t in range(n_tok):
        for e in range(n_ids):
            a = ids[t, e]
            pairs[fill[a]] = t * n_ids + e
            fill[a] += 1
    return True


@numba.njit(inline="always", **JIT)
def _routed(starts, n_as, routed):
    """The experts with routed rows, in id order, into routed[:n]; returns n. The parallel tasks cover only
    these: a decode step routes a few of many experts, and numba hands each thread one contiguous run of
    the task range, so tasks of idle experts would leave a thread with nothing while another takes them all."""
    n = 0
    for a in range(n_as):
        if starts[a + 1] > starts[a]:
            routed[n] = a
            n += 1
    return n


@numba.njit(inline="always", **JIT)
def _slices(task, nchunk, ne01, routed):
    a = routed[task // nchunk]
    lo = (task % nchunk) * ROWS_PER_TASK
    return a, lo, min(ne01, lo + ROWS_PER_TASK)


@numba.njit(parallel=True, **JIT)
def _mul_mat_id_quant(kind, w, off, nb01, nb02, ne01, n_as, nblk, x, ids, starts, pairs, routed, yq, yd, ys, with_sum,
                      out):
    """Legacy quants (Q4_0 ... Q8_0): q8_0/q8_1 activations, ggml_vec_dot_<w>_q8_<0|1>."""
    if not _group(ids, n_as, starts, pairs):
        return False
    n_ids, ne11, k = ids.shape[1], x.shape[1], x.shape[2]
    n_pairs = pairs.size
    if n_pairs >= QUANTIZE_PARALLEL_ROWS:
        for s in numba.prange(n_pairs):
            t, e = pairs[s] // n_ids, pairs[s] % n_ids
            quants.quantize_q8_row(x[t, e % ne11], yq[s * k:(s + 1) * k], yd[s * nblk:(s + 1) * nblk],
                                   ys[s * nblk:(s + 1) * nblk], with_sum)
    else:
        for s in range(n_pairs):
            t, e = pairs[s] // n_ids, pairs[s] % n_ids
            quants.quantize_q8_row(x[t, e % ne11], yq[s * k:(s + 1) * k], yd[s * nblk:(s + 1) * nblk],
                                   ys[s * nblk:(s + 1) * nblk], with_sum)
    nchunk = (ne01 + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    n_tasks = _routed(starts, n_as, routed) * nchunk
    for task in numba.prange(n_tasks):
        a, lo, hi = _slices(task, nchunk, ne01, routed)
        base = off + a * nb02
        s, end = starts[a], starts[a + 1]
        while s + 4 <= end:
            for ir in range(lo, hi):
                v = row_dot4(kind, w, base + ir * nb01, nblk, yq, yd, ys, s)
                for c in range(4):
                    out[pairs[s + c] // n_ids, pairs[s + c] % n_ids, ir] = v[c]
            s += 4
        if s + 2 <= end:
            for ir in range(lo, hi):
                v2 = row_dot2(kind, w, base + ir * nb01, nblk, yq, yd, ys, s)
                for c in range(2):
                    out[pairs[s + c] // n_ids, pairs[s + c] % n_ids, ir] = v2[c]
            s += 2
        for c in range(s, end):
            for ir in range(lo, hi):
                out[pairs[c] // n_ids, pairs[c] % n_ids, ir] = row_dot1(kind, w, base + ir * nb01, nblk, yq, yd, ys, c)
    return True


@numba.njit(inline="always", **JIT)
def _quantize_k(kind, row, s, k, yq, yd, ybs):
    """Routed row s in the weights' vec_dot format: q8_0 for IQ4_NL, q8_K (with its 16-sums) otherwise."""
    if kind == TYPE_IQ4_NL:
        nblk = k // QK
        quants.quantize_q8_row(row, yq[s * k:(s + 1) * k], yd[s * nblk:(s + 1) * nblk],
                               yd[s * nblk:(s + 1) * nblk], False)
    else:
        nblk, ngroups = k // kquants.QK_K, k // kquants.GROUP
        kquants.quantize_q8_k_row(row, yq[s * k:(s + 1) * k], yd[s * nblk:(s + 1) * nblk],
                                  ybs[s * ngroups:(s + 1) * ngroups])


@numba.njit(inline="always", **JIT)
def _quantize_pair(kind, x, ids, starts, pairs, s, yq, yd, ybs, vnni, tq, td, tbs):
    """Routed row s into the block-major scratch if its expert takes the VNNI tiles, else row-major."""
    n_ids = ids.shape[1]
    t, e = pairs[s] // n_ids, pairs[s] % n_ids
    row = x[t, e % x.shape[1]]
    a = ids[t, e]
    if vnni and starts[a + 1] - starts[a] >= TILED_MIN_ROWS:
        kquant_vnni.quantize_block_major(row, s, pairs.size, tq, td, tbs)
    else:
        _quantize_k(kind, row, s, x.shape[2], yq, yd, ybs)


@numba.njit(parallel=True, **JIT)
def _mul_mat_id_kquant(kind, w, off, nb01, nb02, ne01, n_as, nblk, x, ids, starts, pairs, routed, yq, yd, ybs, vnni,
                       tq, td, tbs, out):
    """K-quants and IQ4: per expert the tiled kernel's sums from TILED_MIN_ROWS routed rows on (in
    tiles of TILE_COLS, or all at once in kernels.formats.kquant_vnni if `vnni`), ggml_vec_dot_<w>_q8_K
    below that, and always for IQ4_NL. The VNNI tiles' rows are quantized block-major into tq/td/tbs
    (block b of every routed row, then block b + 1: a tile reads one block's rows one after another),
    the vec_dot rows row-major into yq/yd/ybs."""
    if not _group(ids, n_as, starts, pairs):
        return False
    n_ids, ne11, k = ids.shape[1], x.shape[1], x.shape[2]
    n_pairs = pairs.size
    if n_pairs >= QUANTIZE_PARALLEL_ROWS:
        for s in numba.prange(n_pairs):
            _quantize_pair(kind, x, ids, starts, pairs, s, yq, yd, ybs, vnni, tq, td, tbs)
    else:
        for s in range(n_pairs):
            _quantize_pair(kind, x, ids, starts, pairs, s, yq, yd, ybs, vnni, tq, td, tbs)
    nchunk = (ne01 + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    cols = kquant_dot.TILE_COLS
    n_tasks = _routed(starts, n_as, routed) * nchunk
    for task in numba.prange(n_tasks):
        a, lo, hi = _slices(task, nchunk, ne01, routed)
        base = off + a * nb02
        s, end = starts[a], starts[a + 1]
        tiled = kind != TYPE_IQ4_NL and end - s >= TILED_MIN_ROWS
        if tiled and vnni:
            acc = np.zeros((end - s) * ROWS_PER_TASK, np.float32)
            kquant_vnni.vnni_tile(kind, w, base + lo * nb01, nb01, hi - lo, nblk, tq, td, tbs, s, end - s, 1, n_pairs,
                                  acc)
            for c in range(s, end):
                for ir in range(lo, hi):
                    out[pairs[c] // n_ids, pairs[c] % n_ids, ir] = acc[(c - s) * ROWS_PER_TASK + ir - lo]
            s = end
        elif tiled:
            while s + cols <= end:
                for ir in range(lo, hi):
                    v = kquant_dot.tiled_dots(kind, w, base + ir * nb01, nblk, yq, yd, ybs, s)
                    for c in range(cols):
                        out[pairs[s + c] // n_ids, pairs[s + c] % n_ids, ir] = v[c]
                s += cols
        for c in range(s, end):
            t, e = pairs[c] // n_ids, pairs[c] % n_ids
            for ir in range(lo, hi):
                row = base + ir * nb01
                if kind == TYPE_IQ4_NL:
                    out[t, e, ir] = kquant_dot.iq4_nl_vec_dot(w, row, nblk, yq, yd, c)
                elif tiled:
                    out[t, e, ir] = kquant_dot.tiled_dot(kind, w, row, nblk, yq, yd, ybs, c)[0]
                else:
                    out[t, e, ir] = kquant_dot.vec_dot(kind, w, row, nblk, yq, yd, ybs, c)
    return True


@numba.njit(parallel=True, **JIT)
def _mul_mat_id_float(kind, lanes, pairs16, w, off, nb01, nb02, ne01, n_as, esize, k, y, ne11, ids, starts, pairs,
                      routed, out):
    """F32/F16/BF16: y holds all of src1 (n_tok, ne11, k) flat, already rounded to the vec_dot type."""
    if not _group(ids, n_as, starts, pairs):
        return False
    n_ids = ids.shape[1]
    nchunk = (ne01 + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    n_tasks = _routed(starts, n_as, routed) * nchunk
    for task in numba.prange(n_tasks):
        a, lo, hi = _slices(task, nchunk, ne01, routed)
        base = off + a * nb02
        acc = np.empty(SCRATCH, np.float32)
        for c in range(starts[a], starts[a + 1]):
            t, e = pairs[c] // n_ids, pairs[c] % n_ids
            yoff = (t * ne11 + e % ne11) * k
            for ir in range(lo, hi):
                if lanes == 16:
                    out[t, e, ir] = dot16(kind, False, pairs16, w, base + ir * nb01, esize, y, yoff, k, acc)
                else:
                    out[t, e, ir] = dot_float(kind, False, w, base + ir * nb01, esize, y, yoff, k)
    return True


def _refuse_ids(node: Node) -> None:
    raise InvalidNode(f"MUL_MAT_ID: expert id out of range [0, {node.src[0].ne[2]})")


def prepare(node: Node):
    src0, src1, ids_t = node.src[:3]
    if 0 in node.dst.ne:
        return nothing
    x = src1.array()[0]  # (n_tok, ne11, K)
    ids = ids_t.array()[0, 0]  # (n_tok, n_ids)
    out = node.dst.array()[0]  # (n_tok, n_ids, ne01)
    n_as, ne01, k = src0.ne[2], src0.ne[1], src0.ne[0]
    starts = np.zeros(n_as + 1, np.int64)
    pairs = np.empty(ids.size, np.int64)
    routed = np.empty(n_as, np.int64)
    kind = int(src0.type)
    w = (kind, src0.mem, src0.offset, src0.nb[1], src0.nb[2], ne01, n_as)
    if src0.type in FLOAT_TYPES:
        target = node.target

        def run():  # the activations are rounded to the weights' float type on every run
            y = round_activations(src0.type, x).reshape(-1)
            return _mul_mat_id_float(kind, target.lanes, target.bf16_pairs, *w[1:], src0.nb[0], k, y, x.shape[1], ids,
                                     starts, pairs, routed, out)
    elif src0.type in QUANT_TYPES:
        nblk = k // QK
        with_sum = quants.HAS_MIN[src0.type]  # Q4_1/Q5_1 take q8_1 activations, with block sums
        yq, yd = np.empty(ids.size * k, np.int8), np.empty(ids.size * nblk, np.float32)
        ys = np.empty_like(yd) if with_sum else yd

        def run():
            return _mul_mat_id_quant(*w, nblk, x, ids, starts, pairs, routed, yq, yd, ys, with_sum, out)
    else:
        block = TYPE_TRAITS[src0.type].block_size
        nblk = k // block
        yq, yd = np.empty(ids.size * k, np.int8), np.empty(ids.size * nblk, np.float32)
        ybs = np.empty(ids.size * (k // kquants.GROUP), np.int32)
        vnni = kquant_dot.takes_vnni(src0.type, node.target)
        # the VNNI tiles' block-major scratch (unused, and not allocated, otherwise)
        tq, td, tbs = (np.empty_like(yq), np.empty_like(yd), np.empty_like(ybs)) if vnni else (yq, yd, ybs)

        def run():
            return _mul_mat_id_kquant(*w, nblk, x, ids, starts, pairs, routed, yq, yd, ybs, vnni, tq, td, tbs, out)

    def checked():
        if not run():
            _refuse_ids(node)

    return checked


forward = prepared(prepare)


# ----------------------------------------------------------------------------------------------
# numpy reference: per expert, MUL_MAT's reference on its routed rows


def reference(node: Node) -> None:
    from .. import load_all  # MUL_MAT's reference, from the kernel table

    load_all()
    mul_mat = KERNELS[(int(GGMLOp.MUL_MAT), 0)].reference
    src0, src1, ids_t = node.src[:3]
    if 0 in node.dst.ne:
        return
    ids = ids_t.array()[0, 0]
    n_as, ne01, k = src0.ne[2], src0.ne[1], src0.ne[0]
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= n_as):
        _refuse_ids(node)
    x, out = src1.array()[0], node.dst.array()[0]
    n_ids, ne11 = ids.shape[1], x.shape[1]
    flat = ids.reshape(-1)  # token-major, as ggml walks them
    for a in range(n_as):
        routed = np.flatnonzero(flat == a)
        if not routed.size:
            continue
        t, e = routed // n_ids, routed % n_ids
        nb = src0.nb
        weights = Tensor(src0.type, (k, ne01, 1, 1), (nb[0], nb[1], nb[2], nb[2]), src0.mem, src0.offset + a * nb[2])
        # one MUL_MAT column per batch where MUL_MAT would batch them into tinyBLAS; else one batch of
        # cne1 columns, which selects the tiled or vec_dot route as MUL_MAT_ID does
        shape = (k, 1, routed.size) if src0.type in VEC_DOT_ONLY else (k, routed.size, 1)
        rows = Tensor.new(T.F32, shape, np.ascontiguousarray(x[t, e % ne11], np.float32))
        res = Tensor.new(T.F32, (ne01, *shape[1:]))
        mul_mat(Node(GGMLOp.MUL_MAT, res, (weights, rows), target=node.target))
        out[t, e] = res.array().reshape(routed.size, ne01)


register(GGMLOp.MUL_MAT_ID)(OpKernel(check, forward, reference, prepare))
