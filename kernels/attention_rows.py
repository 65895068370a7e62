"""FLASH_ATTN_EXT, one query row at a time: the inner loop of ggml's
ggml_compute_forward_flash_attn_ext_f16_one_chunk, shared by attention.py's per-row paths (F16/F32 K,
quantized K) and its split-KV path.

For each unmasked kv position: the K.Q dot product as ggml_vec_dot_f16/_f32 of the node's build computes
it (`dot_kq`, 8 or 16 float lanes; a quantized K's integer dots live in attention.py), then the online
softmax with glibc expf and the V update (`accumulate`), in F16 for an F16 V. A row ends by folding in
the head's sink and normalizing (`apply_sink`, `finish_row`).
"""

from __future__ import annotations

import math

import numba
import numpy as np

from .jit import JIT
from .fmath import fma32, hsum16, round_f16
from wire.ggml import TYPE_F16, TYPE_F32
from .formats.quants import FLOAT_LANES
from .formats.float_dot512 import tail_sum, vec_f16_lanes16, vec_f32_lanes16
from .storage import contiguous_row, load_f32, prefetch_row
from .vec import NEG_INF

F32 = np.float32

_f16_lanes, _f32_lanes = FLOAT_LANES[TYPE_F16][1], FLOAT_LANES[TYPE_F32][1]

BLOCK_KV = 256  # kv positions whose scores one_chunk computes at a time (bounds its scratch)
# K and V rows asked for this many visible positions ahead: a server's sequences interleave their cells,
# so a row's visible positions lie apart and the hardware prefetcher does not follow them (a decode
# step's attention ran at half speed from memory)
PREFETCH_CELLS = 8
F16_NEG_INF_BITS = np.uint16(0xFC00)


@numba.njit(inline="always", **JIT)
def dot_kq(krow, kkind, q, acc, lanes):
    """ggml's vec_dot of one stored K row (F16 bits or F32, per kkind) with q (float32), as a build with
    `lanes` float lanes computes it; acc is scratch for 64 floats.

    ggml_vec_dot_f16/_f32 keep 4 vectors of FMA accumulators (4 * lanes in all: lane t sums elements t,
    t + 4*lanes, ...), add them up in a fixed tree (GGML_F32_VEC_REDUCE: (acc0 + acc2) + (acc1 + acc3)
    lane by lane, then across the lanes: AVX2's shuffle/hadd order or _mm512_reduce_add_ps), and finish
    the last DK % (4*lanes) elements in double (F16) or float (F32): float_dot512.tail_sum, as matmul.
    """
    dk = q.shape[0]
    step = 4 * lanes
    nb = dk - dk % step
    if lanes == 8:  # the vector code MUL_MAT uses (4 accumulators, reduced lane-wise)
        a0, a1, a2, a3, a4, a5, a6, a7 = _f16_lanes(krow, 0, q, 0, nb // step) if kkind == TYPE_F16 else \
            _f32_lanes(krow, 0, q, 0, nb // step)
        s = ((a0 + a4) + (a1 + a5)) + ((a2 + a6) + (a3 + a7))
    else:
        if kkind == TYPE_F16:
            vec_f16_lanes16(krow, 0, q, 0, nb // step, acc)
        else:
            vec_f32_lanes16(krow, 0, q, 0, nb // step, acc)
        s = hsum16(acc, 0)
    return tail_sum(kkind, krow, 0, 1, q, 0, nb, dk, s)


@numba.njit(inline="always", **JIT)
def visible(mrow, ic, mkind, has_mask, slope):
    """Whether position ic takes part (ggml skips a -inf mask entry before computing its dot)."""
    return not has_mask or slope * load_f32(mrow[ic], mkind) != NEG_INF


@numba.njit(inline="always", **JIT)
def visible_cells(mrow, b0, b1, mkind, has_mask, slope, idx):
    """The positions of [b0, b1) that take part, in order, into idx; returns how many."""
    n = 0
    if has_mask and mkind == TYPE_F16 and F32(0.0) < slope <= F32(1.0):
        # slope * m is -inf exactly when m is: compare the bits, without converting each entry
        for ic in range(b0, b1):
            if mrow[ic] != F16_NEG_INF_BITS:
                idx[n] = ic
                n += 1
        return n
    for ic in range(b0, b1):
        if visible(mrow, ic, mkind, has_mask, slope):
            idx[n] = ic
            n += 1
    return n


@numba.njit(inline="always", **JIT)
def _mad(vkq, vrow, vkind, vs, f16_v):
    """ggml_vec_mad_*: vkq += vrow * vs, one FMA per element in the vector steps (32 or 64 floats) and
    the (contracted) leftovers alike; an F16 V's accumulator is rounded to F16 after each update. The
    kind is tested once, outside the loops, so that each loop vectorizes."""
    dv = vkq.shape[0]
    if f16_v:  # an F16 V
        for d in range(dv):
            vkq[d] = round_f16(fma32(load_f32(vrow[d], TYPE_F16), vs, vkq[d]))
    elif vkind == TYPE_F32:
        for d in range(dv):
            vkq[d] = fma32(load_f32(vrow[d], TYPE_F32), vs, vkq[d])
    else:
        for d in range(dv):
            vkq[d] = fma32(load_f32(vrow[d], vkind), vs, vkq[d])


@numba.njit(inline="always", **JIT)
def accumulate(scores, idx, n, v2, vkind, mrow, mkind, has_mask, slope, scale, softcap, f16_v, vkq, M, S):
    """The online-softmax steps of one_chunk for the visible kv positions idx[:n] (visible_cells), whose
    raw K.Q dot products are scores[:n]; updates vkq in place and returns the new (M, S). V rows and the
    mask are read in their stored kinds (vkind, mkind: ggml type numbers)."""
    dv = vkq.shape[0]
    for j in range(n):
        ic = idx[j]
        mv = slope * load_f32(mrow[ic], mkind) if has_mask else F32(0.0)
        s = scores[j] * scale
        if softcap != F32(0.0):
            s = softcap * math.tanh(s)
        s = s + mv
        ms = F32(1.0)
        vs = F32(1.0)
        if s > M:
            Mold = M
            M = s
            ms = math.exp(Mold - M)
            for d in range(dv):
                vkq[d] = vkq[d] * ms
            if f16_v:
                for d in range(dv):
                    vkq[d] = round_f16(vkq[d])
        else:
            vs = math.exp(s - M)
        _mad(vkq, contiguous_row(v2, ic), vkind, vs, f16_v)
        S = fma32(S, ms, vs)
    return M, S


@numba.njit(**JIT)
def row_one_chunk(qrow, k2, kkind, v2, vkind, mrow, mkind, has_mask, slope, scale, softcap, ic0, ic1, f16_v, vkq,
                  lanes):
    """Online softmax of one query over kv positions [ic0, ic1): fills vkq (unnormalized), returns (M, S).
    The usual F16 cache gets code of its own, compiled with the kinds known."""
    if kkind == TYPE_F16 and vkind == TYPE_F16 and mkind == TYPE_F16 and f16_v:
        if lanes == 8:
            return _row_one_chunk(qrow, k2, TYPE_F16, v2, TYPE_F16, mrow, TYPE_F16, has_mask, slope, scale, softcap,
                                  ic0, ic1, True, vkq, 8)
        return _row_one_chunk(qrow, k2, TYPE_F16, v2, TYPE_F16, mrow, TYPE_F16, has_mask, slope, scale, softcap,
                              ic0, ic1, True, vkq, 16)
    return _row_one_chunk(qrow, k2, kkind, v2, vkind, mrow, mkind, has_mask, slope, scale, softcap, ic0, ic1, f16_v,
                          vkq, lanes)


@numba.njit(inline="always", **JIT)
def _row_one_chunk(qrow, k2, kkind, v2, vkind, mrow, mkind, has_mask, slope, scale, softcap, ic0, ic1, f16_v, vkq,
                   lanes):
    """row_one_chunk's body.

    k2 and v2 are one kv head's K and V rows (n_kv, D) as stored: F16 bits or F32 (kkind, vkind). An
    F16 K makes ggml round the query to F16; f16_v says it keeps the V accumulator in F16. Only
    unmasked positions are dotted, as in ggml; `lanes` is the build's float SIMD width.
    """
    dk = qrow.shape[0]
    q = np.empty(dk, F32)
    for i in range(dk):
        q[i] = round_f16(qrow[i]) if kkind == TYPE_F16 else qrow[i]
    acc = np.empty(64, F32)
    scores = np.empty(BLOCK_KV, F32)
    idx = np.empty(BLOCK_KV, np.int64)
    vkq[:] = 0
    S = F32(0.0)
    M = NEG_INF
    for b0 in range(ic0, ic1, BLOCK_KV):
        n = visible_cells(mrow, b0, min(b0 + BLOCK_KV, ic1), mkind, has_mask, slope, idx)
        for j in range(min(n, PREFETCH_CELLS)):
            prefetch_row(k2, idx[j])
            prefetch_row(v2, idx[j])
        for j in range(n):
            if j + PREFETCH_CELLS < n:
                prefetch_row(k2, idx[j + PREFETCH_CELLS])
                prefetch_row(v2, idx[j + PREFETCH_CELLS])
            scores[j] = dot_kq(contiguous_row(k2, idx[j]), kkind, q, acc, lanes)
        M, S = accumulate(scores, idx, n, v2, vkind, mrow, mkind, has_mask, slope, scale, softcap, f16_v, vkq, M, S)
    return M, S


@numba.njit(inline="always", **JIT)
def apply_sink(sink, M, S, vkq, fused):
    """Fold the head's sink logit into the softmax as one more position with a zero value row;
    returns the new (M, S).

    On a new maximum GCC leaves `S*ms + 1` unfused in the per-row code but fuses it in the tiled code.
    """
    if sink > M:
        ms = math.exp(M - sink)
        for d in range(vkq.shape[0]):
            vkq[d] *= ms
        return sink, (fma32(S, ms, F32(1.0)) if fused else S * ms + F32(1.0))
    return M, S + math.exp(sink - M)


@numba.njit(inline="always", **JIT)
def finish_row(M, S, vkq, sinks, has_sinks, out, iq3, iq1, iq2):
    """A per-row path's end: fold in head iq2's sink, normalize by S, store the row (out is permuted)."""
    if has_sinks:
        M, S = apply_sink(sinks[iq2], M, S, vkq, False)
    inv = F32(0.0) if S == F32(0.0) else F32(1.0) / S
    for d in range(vkq.shape[0]):
        out[iq3, iq1, iq2, d] = vkq[d] * inv


@numba.njit(inline="always", **JIT)
def row_index(r, n_q, n_head):
    return r // (n_head * n_q), (r // n_q) % n_head, r % n_q


@numba.njit(inline="always", **JIT)
def row_index_streams_inner(r, n_q, n_head, n_seq):
    """row_index's (iq3, iq2, iq1) of a loop that takes the sequences innermost: each thread's share of
    the rows then holds every sequence's, also when some sequences (the serving engine's idle streams)
    have nothing to attend. Each row is computed on its own, so the order changes no result."""
    return r % n_seq, r // (n_seq * n_q), (r // n_seq) % n_q
