"""FLASH_ATTN_EXT's tiled path (for kernels/ops/attention.py): prompt batches, n_q >= FA_TILE_Q with K and V of
one type. F32 Q; K widened and transposed per head so a 64-wide KV tile's scores vectorize; per tile each
score is one FMA chain over d in order from 0 and each output element one FMA chain over the tile's rows
in order (ggml's simd_gemm), the tile's softmax uses the build's vector exp and lane sums
(kernels.vec.vec_soft_max), and the F32 accumulators are rescaled when a row's maximum grows.

A task takes ROWS query rows of one head (kernels.fa_lanes): the K and V tiles are loaded once for all of
them. Each row keeps its own chains, maximum and sum, so the result is the one-row computation's; a
group's last rows, and tiles where some row sees nothing (its scores all masked), take the one-row
kernels for the rows concerned.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import prange

from wire.ggml import FA_TILE_KV as TILE_KV
from .attention_rows import apply_sink
from .fa_lanes import ROWS, kq_tile, kq_tile_rows, v_tile16, v_tile64, v_tile_rows16, v_tile_rows64
from .fmath import fma32
from .jit import JIT, row_loop
from .vec import NEG_INF, alibi_slope, vec_soft_max

F32 = np.float32


@numba.njit(**JIT)
def _scores(kq, kt2, ic, n, qrows, nr):
    """kq[j, :n] = K tile . q row j for j < nr."""
    if n == TILE_KV and nr == ROWS:
        kq_tile_rows(kt2, ic, qrows, kq)
    elif n == TILE_KV:
        for j in range(nr):
            kq_tile(kt2, ic, qrows[j], kq[j])
    else:
        for j in range(nr):
            s = kq[j]
            s[:] = 0
            for d in range(qrows.shape[1]):
                qd = qrows[j, d]
                krow = kt2[d, ic : ic + n]
                for t in range(n):
                    s[t] = fma32(krow[t], qd, s[t])


@numba.njit(**JIT)
def _values(vkq, v2, ic, n, kq, live, nr, n_live):
    """vkq[j] += the tile's V rows weighted by kq[j, :n], for the rows j that see the tile."""
    dv = vkq.shape[1]
    if n_live == ROWS and dv % 64 == 0:
        v_tile_rows64(v2, ic, n, kq, vkq)
        return
    if n_live == ROWS and dv % 16 == 0:
        v_tile_rows16(v2, ic, n, kq, vkq)
        return
    for j in range(nr):
        if not live[j]:
            continue
        p, acc = kq[j], vkq[j]
        if dv % 64 == 0:
            v_tile64(v2, ic, n, p, acc)
        elif dv % 16 == 0:
            v_tile16(v2, ic, n, p, acc)
        else:
            for t in range(n):
                pt = p[t]
                vrow = v2[ic + t]
                for d in range(dv):
                    acc[d] = fma32(vrow[d], pt, acc[d])


@numba.njit(**JIT)
def _tiled_rows(g, q, kt, v, mask, has_mask, sinks, has_sinks, scale, max_bias, softcap, out, lanes):
    """Query rows i0 .. i0 + ROWS - 1 (fewer at the end) of head iq2 of sequence iq3, for task g."""
    n_seq, n_head, n_q, dk = q.shape
    n_kv, dv = kt.shape[3], v.shape[3]
    n_groups = (n_q + ROWS - 1) // ROWS
    iq3, iq2, i0 = g // (n_head * n_groups), (g // n_groups) % n_head, (g % n_groups) * ROWS
    nr = min(ROWS, n_q - i0)
    slope = alibi_slope(max_bias, n_head, iq2)
    kt2 = kt[iq3 // (n_seq // kt.shape[0]), iq2 // (n_head // kt.shape[1])]
    v2 = v[iq3 // (n_seq // v.shape[0]), iq2 // (n_head // v.shape[1])]
    masks = mask[iq3 % mask.shape[0], iq2 % mask.shape[1]]
    qrows = q[iq3, iq2, i0 : i0 + nr]
    kq = np.empty((ROWS, TILE_KV), F32)
    vkq = np.zeros((ROWS, dv), F32)
    S = np.zeros(ROWS, F32)
    M = np.full(ROWS, NEG_INF, F32)
    live = np.zeros(ROWS, np.bool_)
    for ic in range(0, n_kv, TILE_KV):
        n = min(TILE_KV, n_kv - ic)
        _scores(kq, kt2, ic, n, qrows, nr)
        n_live = 0
        for j in range(nr):
            s = kq[j]
            for t in range(n):
                s[t] = s[t] * scale
            if softcap != F32(0.0):
                for t in range(n):
                    s[t] = math.tanh(s[t]) * softcap
            if has_mask:
                mseg = masks[i0 + j, ic : ic + n]
                for t in range(n):
                    s[t] += slope * mseg[t]
            s[n:] = NEG_INF
            tile_max = NEG_INF
            for t in range(TILE_KV):
                tile_max = tile_max if tile_max > s[t] else s[t]
            live[j] = tile_max != NEG_INF
            if not live[j]:
                continue
            n_live += 1
            m_new = max(M[j], tile_max)
            if m_new > M[j]:
                ms = math.exp(M[j] - m_new)
                for d in range(dv):
                    vkq[j, d] *= ms
                S[j] *= ms
            M[j] = m_new
            S[j] = F32(np.float64(S[j]) + vec_soft_max(TILE_KV, s, s, m_new, lanes))
        if n_live:
            _values(vkq, v2, ic, n, kq, live, nr, n_live)
    for j in range(nr):
        m, total = M[j], S[j]
        if has_sinks:
            m, total = apply_sink(sinks[iq2], m, total, vkq[j], True)
        inv = F32(0.0) if total == F32(0.0) else F32(1.0) / total
        for d in range(dv):
            out[iq3, i0 + j, iq2, d] = vkq[j, d] * inv


@row_loop
def fa_tiled(q, kt, v, mask, has_mask, sinks, has_sinks, scale, max_bias, softcap, out, lanes):
    """kt is K transposed per head, (n_seq, n_head_kv, DK, n_kv), so a tile's scores vectorize."""
    n_tasks = q.shape[0] * q.shape[1] * ((q.shape[2] + ROWS - 1) // ROWS)
    for g in prange(n_tasks):
        _tiled_rows(np.int64(g), q, kt, v, mask, has_mask, sinks, has_sinks, scale, max_bias, softcap, out, lanes)
