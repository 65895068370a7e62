"""ROPE: rotary position embedding of each row's first n_dims values, modes NORMAL and NEOX, with YaRN.

Follows ggml-cpu ops.cpp ggml_compute_forward_rope_flt and reproduces its rounding on an AVX2+FMA
build: the per-pair angle is float32 `theta *= theta_scale` from theta = position, cos/sin come from
glibc, and the rotation contracts `x0*cos - x1*sin` / `x0*sin + x1*cos` into one FMA on the x0 product
(GCC -ffp-contract=fast). In NORMAL mode the vectorized loop covers pairs two at a time, so when the
number of pairs is odd the last pair is computed without FMA.

op_params: [1] n_dims, [2] mode, [4] n_ctx_orig, [5..10] freq_base, freq_scale, ext_factor,
attn_factor, beta_fast, beta_slow (float32), [11..14] mrope sections, [15] n_offs (first rotated dim).
"""

from __future__ import annotations

import math
from functools import partial

import numba
import numpy as np
from numba import prange

from ..jit import JIT, row_loop
from wire import op_params
from wire.ggml import ROPE_MODE_NEOX, ROPE_MODE_NORMAL, TYPE_F16, GGMLOp, GGMLType

from ..node import InvalidNode, Node, Tensor
from ..registry import OpKernel, prepared, register
from ..fmath import fma32, np_fma
from ..rope_lanes import PAIRS, rotate_pairs
from ..storage import load_f32, parallel_worthwhile, store_f32, u16_view

F32 = np.float32


class RopeParams:
    """The op_params of a ROPE node, decoded."""

    def __init__(self, node: Node):
        p = op_params.decode(GGMLOp.ROPE, node.params.tobytes())
        self.n_dims, self.mode, self.n_ctx_orig, self.n_offs = p.n_dims, p.mode, p.n_ctx_orig, p.n_offs
        (self.freq_base, self.freq_scale, self.ext_factor, self.attn_factor, self.beta_fast,
         self.beta_slow) = (F32(x) for x in (p.freq_base, p.freq_scale, p.ext_factor, p.attn_factor, p.beta_fast,
                                              p.beta_slow))


@numba.njit(**JIT)
def yarn_corr_dims(n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow):
    """ggml_rope_yarn_corr_dims: the dims between which YaRN ramps from extrapolation to interpolation."""
    two_pi = F32(2.0) * F32(math.pi)
    d_fast = F32(n_dims) * math.log(F32(n_ctx_orig) / (beta_fast * two_pi)) / (F32(2.0) * math.log(freq_base))
    d_slow = F32(n_dims) * math.log(F32(n_ctx_orig) / (beta_slow * two_pi)) / (F32(2.0) * math.log(freq_base))
    start = np.floor(d_fast)
    end = np.ceil(d_slow)
    lo = F32(0.0) if F32(0.0) > start else start
    hi = F32(n_dims - 1) if F32(n_dims - 1) < end else end
    return F32(lo), F32(hi)


@numba.njit(**JIT)
def rope_cache(pos, n_pairs, n_dims, freq_base, freq_scale, ext_factor, attn_factor, corr_lo, corr_hi,
               freq_factors, has_ff):
    """(cos, sin) of every rotated pair at every position: shape (len(pos), n_pairs, 2)."""
    out = np.empty((pos.shape[0], n_pairs, 2), F32)
    corr_lo, corr_hi = F32(corr_lo), F32(corr_hi)
    theta_scale = math.pow(freq_base, F32(-2.0) / F32(n_dims))
    for t in range(pos.shape[0]):
        theta = F32(pos[t])
        for p in range(n_pairs):
            extrap = theta / freq_factors[p] if has_ff else theta
            interp = freq_scale * extrap
            angle = interp
            mscale = attn_factor
            if ext_factor != F32(0.0):
                span = corr_hi - corr_lo
                y = (F32(p) - corr_lo) / (F32(0.001) if F32(0.001) > span else span)
                y = F32(0.0) if F32(0.0) > y else y
                ramp = F32(1.0) - (F32(1.0) if F32(1.0) < y else y)
                mix = ramp * ext_factor
                angle = fma32(interp, F32(1.0) - mix, extrap * mix)
                mscale = mscale * fma32(F32(0.1), math.log(F32(1.0) / freq_scale), F32(1.0))
            out[t, p, 0] = math.cos(angle) * mscale
            out[t, p, 1] = math.sin(angle) * mscale
            theta = theta * theta_scale
    return out


@numba.njit(inline="always", **JIT)
def _rotate(x0, x1, c, s, fused):
    if fused:
        return fma32(x0, c, -(x1 * s)), fma32(x0, s, x1 * c)
    return x0 * c - x1 * s, x1 * c + x0 * s


@numba.njit(**JIT)
def _rope_row(r, src, dst, cache, n_dims, n_offs, neox, kind):
    """Row r of src (float32, or F16 bits: kind TYPE_F32 / TYPE_F16) into dst. F32 NORMAL rows leave an
    odd last pair unfused (ggml's vectorized loop goes two pairs at a time); F16 rows fuse every pair."""
    ne3, ne2, ne1, ne0 = src.shape
    n_pairs = n_dims // 2
    n_fused = n_pairs if neox or kind == TYPE_F16 else n_pairs - n_pairs % 2
    i3 = r // (ne2 * ne1)
    i2 = (r // ne1) % ne2
    i1 = r % ne1
    sp = src[i3, i2, i1]
    dp = dst[i3, i2, i1]
    if kind != TYPE_F16:  # float32 rows: one loop per mode and fusing, with no per-element dispatch
        cs = cache[i2]
        if neox:
            for p in range(n_pairs):
                a, b = n_offs + p, n_offs + n_pairs + p
                x0, x1 = sp[a], sp[b]
                dp[a], dp[b] = fma32(x0, cs[p, 0], -(x1 * cs[p, 1])), fma32(x0, cs[p, 1], x1 * cs[p, 0])
        else:
            steps = n_fused // PAIRS
            rotate_pairs(sp, dp, cs, n_offs, steps)  # 8 pairs per vector step, then the rest one by one
            for p in range(steps * PAIRS, n_fused):
                a = n_offs + 2 * p
                x0, x1 = sp[a], sp[a + 1]
                dp[a], dp[a + 1] = fma32(x0, cs[p, 0], -(x1 * cs[p, 1])), fma32(x0, cs[p, 1], x1 * cs[p, 0])
            for p in range(n_fused, n_pairs):
                a = n_offs + 2 * p
                dp[a], dp[a + 1] = _rotate(sp[a], sp[a + 1], cs[p, 0], cs[p, 1], False)
        for i in range(n_offs):
            dp[i] = sp[i]
        for i in range(n_offs + n_dims, ne0):
            dp[i] = sp[i]
        return
    for p in range(n_pairs):
        a = n_offs + p if neox else n_offs + 2 * p
        b = a + n_pairs if neox else a + 1
        y0, y1 = _rotate(load_f32(sp[a], kind), load_f32(sp[b], kind), cache[i2, p, 0], cache[i2, p, 1], p < n_fused)
        store_f32(dst, i3, i2, i1, a, y0, kind)
        store_f32(dst, i3, i2, i1, b, y1, kind)
    for i in range(n_offs):
        dp[i] = sp[i]
    for i in range(n_offs + n_dims, ne0):
        dp[i] = sp[i]


@row_loop
def _rope_rows(src, dst, cache, n_dims, n_offs, neox, kind):
    n_rows = src.shape[0] * src.shape[1] * src.shape[2]
    for r in prange(n_rows):
        _rope_row(np.int64(r), src, dst, cache, n_dims, n_offs, neox, kind)


def check_rope(node: Node) -> None:
    src, pos = node.srcs(2)
    ff = node.src[2] if len(node.src) > 2 else None
    p = RopeParams(node)
    dst = node.dst
    if p.mode & 1:
        raise InvalidNode("ROPE: mode & 1 is no longer supported by ggml")
    if p.mode not in (ROPE_MODE_NORMAL, ROPE_MODE_NEOX):
        raise InvalidNode(f"ROPE: mode {p.mode} (multi-section/vision rope) is not supported")
    if src.type not in (GGMLType.F32, GGMLType.F16) or dst.type != src.type:
        raise InvalidNode("ROPE: src0 and dst must both be F32 or both F16")
    if dst.ne != src.ne:
        raise InvalidNode(f"ROPE: dst shape {dst.ne} differs from src0 {src.ne}")
    size = 4 if src.type == GGMLType.F32 else 2
    if src.nb[0] != size or dst.nb[0] != size:
        raise InvalidNode("ROPE: rows must be contiguous")
    if pos.type != GGMLType.I32 or pos.ne != (src.ne[2], 1, 1, 1) or pos.nb[0] != 4:
        raise InvalidNode(f"ROPE: positions must be an I32 vector of length src0.ne2={src.ne[2]}, got {pos.ne}")
    ne0 = src.ne[0]
    if ne0 % 2 or p.n_dims <= 0 or p.n_dims % 2 or p.n_offs < 0 or p.n_offs % 2 or p.n_offs + p.n_dims > ne0:
        raise InvalidNode(f"ROPE: n_dims={p.n_dims}, n_offs={p.n_offs} do not fit rows of {ne0}")
    if ff is not None and (ff.type != GGMLType.F32 or ff.ne[0] < p.n_dims // 2 or ff.nb[0] != 4):
        raise InvalidNode("ROPE: freq_factors must be F32 with at least n_dims/2 contiguous values")


_last_cache: list = [None, None]  # (key, table): Q and K of every layer rotate by the same positions


def _raw(t: Tensor, n_bytes: int) -> bytes:
    return t.mem[t.offset : t.offset + n_bytes].tobytes()


def _cache(node: Node, p: RopeParams) -> np.ndarray:
    pos, ff = node.src[1], node.src[2] if len(node.src) > 2 else None
    n_pairs = p.n_dims // 2
    # positions and factors are vectors with contiguous elements (checked), so raw bytes identify them
    key = (_raw(pos, 4 * pos.ne[0]), _raw(ff, 4 * n_pairs) if ff is not None else None, node.params[1:11].tobytes())
    if _last_cache[0] != key:
        lo, hi = yarn_corr_dims(p.n_dims, p.n_ctx_orig, p.freq_base, p.beta_fast, p.beta_slow)
        factors = ff.array()[0, 0, 0] if ff is not None else np.ones(1, F32)
        table = rope_cache(pos.array()[0, 0, 0], n_pairs, p.n_dims, p.freq_base, p.freq_scale, p.ext_factor,
                           p.attn_factor, lo, hi, factors, ff is not None)
        _last_cache[:] = [key, table]
    return _last_cache[1]


def prepare_rope(node: Node):
    p = RopeParams(node)
    src, dst = node.src[0], node.dst
    neox = p.mode == ROPE_MODE_NEOX
    if src.type == GGMLType.F16:
        x, y = u16_view(src), u16_view(dst)
    else:
        x, y = src.array(), dst.array()
    rotate = partial(_rope_rows, x, y)
    tail = (p.n_dims, p.n_offs, neox, int(src.type), parallel_worthwhile(x.size, cost=4))
    return lambda: rotate(_cache(node, p), *tail)  # the positions are read on every run


forward_rope = prepared(prepare_rope)


def reference_rope(node: Node) -> None:
    """numpy twin: same float32 angle recurrence and FMA placement, cos/sin rounded from float64."""
    p = RopeParams(node)
    src, dst = node.src[0], node.dst
    ff = node.src[2].array()[0, 0, 0] if len(node.src) > 2 and node.src[2] is not None else None
    n_pairs = p.n_dims // 2
    lo, hi = yarn_corr_dims(p.n_dims, p.n_ctx_orig, p.freq_base, p.beta_fast, p.beta_slow)
    theta = node.src[1].array()[0, 0, 0].astype(F32)
    theta_scale = _powf(p.freq_base, F32(-2.0) / F32(p.n_dims))
    cos, sin = np.empty((2, theta.size, n_pairs), F32)
    for k in range(n_pairs):
        extrap = theta / ff[k] if ff is not None else theta
        interp = p.freq_scale * extrap
        angle, mscale = interp, p.attn_factor
        if p.ext_factor != 0:
            mix = (F32(1) - F32(np.clip((F32(k) - lo) / max(F32(0.001), hi - lo), 0, 1))) * p.ext_factor
            angle = np_fma(interp, F32(1) - mix, extrap * mix)
            mscale = mscale * np_fma(F32(0.1), F32(math.log(F32(1) / p.freq_scale)), F32(1))
        cos[:, k] = np.cos(angle.astype(np.float64)).astype(F32) * mscale
        sin[:, k] = np.sin(angle.astype(np.float64)).astype(F32) * mscale
        theta = theta * theta_scale
    x = src.array().astype(F32)
    rot = slice(p.n_offs, p.n_offs + p.n_dims)
    xr = x[..., rot]
    if p.mode == ROPE_MODE_NEOX:
        x0, x1 = xr[..., :n_pairs], xr[..., n_pairs:]
    else:
        x0, x1 = xr[..., 0::2], xr[..., 1::2]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    y0, y1 = np_fma(x0, c, -(x1 * s)), np_fma(x0, s, x1 * c)
    if p.mode == ROPE_MODE_NORMAL and n_pairs % 2 and src.type == GGMLType.F32:
        y0[..., -1] = x0[..., -1] * c[..., -1] - x1[..., -1] * s[..., -1]
        y1[..., -1] = x1[..., -1] * c[..., -1] + x0[..., -1] * s[..., -1]
    out = x.copy()
    if p.mode == ROPE_MODE_NEOX:
        out[..., p.n_offs:p.n_offs + n_pairs], out[..., p.n_offs + n_pairs:rot.stop] = y0, y1
    else:
        out[..., p.n_offs:rot.stop:2], out[..., p.n_offs + 1:rot.stop:2] = y0, y1
    dst.array()[...] = out.astype(dst.array().dtype)


def _powf(base, exponent):
    return F32(_powf_jit(F32(base), F32(exponent)))


@numba.njit(**JIT)
def _powf_jit(base, exponent):
    return math.pow(base, exponent)


register(GGMLOp.ROPE)(OpKernel(check_rope, forward_rope, reference_rope, prepare_rope))
