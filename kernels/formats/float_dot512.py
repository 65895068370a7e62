"""Float weight dot products (F32/F16/BF16 . activations) as ggml-cpu built for AVX-512 computes them.

matmul.py's 8-lane code reproduces the AVX2 build; this is the 16-lane twin, used when a node's target
has 16 lanes (kernels.target):
  * ggml_vec_dot_f32 / _f16: steps of 64 in four 16-lane FMA accumulators, combined lane-wise as
    (a0 + a2) + (a1 + a3), then summed in gcc's _mm512_reduce_add_ps tree (fmath.hsum16); the F16 tail
    is summed in double, the F32 tail as the AVX2 build compiles it (8- then 4-wide multiply-then-add,
    then scalar FMA);
  * ggml_vec_dot_bf16: two 16-lane accumulators, each reduced by the tree and added in double, then the
    tail in double. With AVX512_BF16 (Target.bf16_pairs) each accumulator lane takes a pair of elements
    per step with VDPBF16PS (odd element first, then even, each an FMA; denormal inputs and results
    flushed to zero), 64 elements a step; without it, one element per lane, 32 a step;
  * llamafile's tinyBLAS (batches): one 16-lane FMA accumulator (32 elements a step, in pairs, for BF16
    with AVX512_BF16), the last partial step padded with zeros, then the reduction tree.
`dot16` is the numba kernel, `np_dot16` its numpy twin over (rows x columns). The vec_dot tails, the
same in both builds, are `tail_sum` / `np_tail_sum`, which matmul's 8-lane code uses too.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ..fmath import f32_from_bits, f32_to_bits, fma32, hsum16, np_fma, np_hsum16
from ..jit import JIT
from wire.ggml import TYPE_BF16, TYPE_F16, TYPE_F32, GGMLType
from ..llvm import FLOAT_ELEM, byte_ptr, elem_ptr, f32_t, i32_t, i64_t, llvm_fn, shuffle, to_f32, vec
from .quants import LOAD_WEIGHT
from ..storage import load_f32

F32 = np.float32
SCRATCH = 32  # float32 lanes a dot needs in its scratch array


def _flush(builder, v, n):
    """Denormals to signed zero (the DAZ/FTZ of VDPBF16PS)."""
    vi = vec(i32_t, n)
    bits = builder.bitcast(v, vi)
    tiny = builder.icmp_unsigned("==", builder.and_(bits, ir.Constant(vi, [0x7F800000] * n)), ir.Constant(vi, [0] * n))
    return builder.bitcast(builder.select(tiny, builder.and_(bits, ir.Constant(vi, [0x80000000] * n)), bits), v.type)


def _make_lanes16(typ: GGMLType, ways: int, pairs: bool):
    """Intrinsic lanes(w, woff, y, yoff, steps, acc): `ways` 16-lane accumulators over `steps` steps of
    ways*16 elements (ways*32 with pairs), from weight bytes w at woff and float32 activations y at yoff.
    ways=4 stores (a0 + a2) + (a1 + a3) into acc[0:16]; otherwise accumulator a goes to acc[16a:16a+16]."""
    esize, elty = FLOAT_ELEM[typ]
    per = 32 if pairs else 16  # elements one accumulator takes per step

    @intrinsic
    def lanes(typingctx, w, woff, y, yoff, steps, acc):
        sig = types.none(w, types.int64, y, types.int64, types.int64, acc)

        def codegen(context, builder, signature, args):
            w_, woff_, y_, yoff_, steps_, acc_ = args
            wt, _, yt, _, _, at = signature.args
            v16 = vec(f32_t, 16)
            fma = llvm_fn(builder, "llvm.fma.v16f32", v16, [v16] * 3)
            accs = [cgutils.alloca_once_value(builder, ir.Constant(v16, [0.0] * 16)) for _ in range(ways)]
            with cgutils.for_range(builder, steps_) as loop:
                for a in range(ways):
                    k = builder.add(builder.mul(loop.index, ir.Constant(i64_t, per * ways)), ir.Constant(i64_t, per * a))
                    wp = byte_ptr(context, builder, wt, w_, builder.add(woff_, builder.mul(k, ir.Constant(i64_t, esize))),
                                   vec(elty, per))
                    yp = builder.bitcast(elem_ptr(context, builder, yt, y_, builder.add(yoff_, k)), vec(f32_t, per).as_pointer())
                    wv = to_f32(builder, builder.load(wp, align=1), typ, per)
                    yv = builder.load(yp, align=4)
                    c = builder.load(accs[a])
                    if pairs:
                        odd, even = list(range(1, 32, 2)), list(range(0, 32, 2))
                        wo, yo = (_flush(builder, shuffle(builder, v, v, odd), 16) for v in (wv, yv))
                        we, ye = (_flush(builder, shuffle(builder, v, v, even), 16) for v in (wv, yv))
                        t = _flush(builder, builder.call(fma, [wo, yo, _flush(builder, c, 16)]), 16)
                        c = _flush(builder, builder.call(fma, [we, ye, t]), 16)
                    else:
                        c = builder.call(fma, [wv, yv, c])
                    builder.store(c, accs[a])
            v = [builder.load(a) for a in accs]
            if ways == 4:
                v = [builder.fadd(builder.fadd(v[0], v[2]), builder.fadd(v[1], v[3]))]
            for a, lanes16 in enumerate(v):
                p = builder.bitcast(elem_ptr(context, builder, at, acc_, ir.Constant(i64_t, 16 * a)), v16.as_pointer())
                builder.store(lanes16, p, align=4)
            return context.get_dummy_value()

        return sig, codegen

    return lanes

T = GGMLType
_vec_f32, _vec_f16 = _make_lanes16(T.F32, 4, False), _make_lanes16(T.F16, 4, False)
vec_f32_lanes16, vec_f16_lanes16 = _vec_f32, _vec_f16  # ggml_vec_dot_f32/_f16's 4x16 lanes (attention's K.Q too)
_vec_bf16, _vec_bf16_pairs = _make_lanes16(T.BF16, 2, False), _make_lanes16(T.BF16, 2, True)
_tiny_f32, _tiny_f16 = _make_lanes16(T.F32, 1, False), _make_lanes16(T.F16, 1, False)
_tiny_bf16, _tiny_bf16_pairs = _make_lanes16(T.BF16, 1, False), _make_lanes16(T.BF16, 1, True)
_load_f32, _load_f16, _load_bf16 = (LOAD_WEIGHT[t] for t in (T.F32, T.F16, T.BF16))


@numba.njit(inline="always", **JIT)
def load_weight(kind, w, off):
    """The F32, F16 or BF16 (kind: its ggml type number) element at byte `off` of raw memory w, as float32."""
    if kind == TYPE_F32:
        return _load_f32(w, off)
    if kind == TYPE_F16:
        return _load_f16(w, off)
    return _load_bf16(w, off)


def load_elem(kind, w, off):
    """Element `off` of w as float32, w either raw memory (uint8; off a byte offset; kind F32, F16 or
    BF16) or a storage array (float32, or F16/BF16 bits; off an index): what tail_sum reads."""
    raise NotImplementedError("numba only")


@overload(load_elem)
def _load_elem(kind, w, off):
    if w.dtype == types.uint8:
        return lambda kind, w, off: load_weight(kind, w, off)
    return lambda kind, w, off: load_f32(w[off], kind)


@numba.njit(inline="always", **JIT)
def _ftz(x):
    return f32_from_bits(f32_to_bits(x) & np.uint32(0x80000000)) if (f32_to_bits(x) & np.uint32(0x7F800000)) == 0 else x


@numba.njit(**JIT)
def _tiny_tail(kind, pairs, w, off, esize, y, yoff, n, b, acc):
    """tinyBLAS's last partial step from element b: lanes past n multiply zero padding."""
    if pairs:
        for j in range(16):
            e0, e1 = b + 2 * j, b + 2 * j + 1
            x0 = _ftz(load_weight(kind, w, off + e0 * esize)) if e0 < n else F32(0.0)
            y0 = _ftz(y[yoff + e0]) if e0 < n else F32(0.0)
            x1 = _ftz(load_weight(kind, w, off + e1 * esize)) if e1 < n else F32(0.0)
            y1 = _ftz(y[yoff + e1]) if e1 < n else F32(0.0)
            acc[j] = _ftz(fma32(x0, y0, _ftz(fma32(x1, y1, _ftz(acc[j])))))
        return
    for j in range(16):
        e = b + j
        if e < n:
            acc[j] = fma32(load_weight(kind, w, off + e * esize), y[yoff + e], acc[j])
        else:
            acc[j] = acc[j] + F32(0.0)


@numba.njit(inline="always", **JIT)
def tail_sum(kind, w, off, esize, y, yoff, i, n, res):
    """ggml_vec_dot_{f16,f32}'s elements i..n-1 after the SIMD part `res`: F16 products are exact and
    summed in double; F32 as gcc compiles that loop for AVX2: 8- then 4-wide multiply-then-add, then
    scalar fma. Element j of w is at off + j*esize (see load_elem): matmul's weights in raw memory, or
    (esize 1) a K row of flash attention."""
    if kind != TYPE_F32:
        total = np.float64(res)
        for j in range(i, n):
            total += np.float64(load_elem(kind, w, off + j * esize) * y[yoff + j])
        return F32(total)
    while n - i >= 4:
        step = 8 if n - i >= 8 else 4
        for j in range(i, i + step):
            res = res + load_elem(kind, w, off + j * esize) * y[yoff + j]
        i += step
    for j in range(i, n):
        res = fma32(load_elem(kind, w, off + j * esize), y[yoff + j], res)
    return res


def np_tail_sum(type_: GGMLType, w: np.ndarray, x: np.ndarray, i: int, res: np.ndarray) -> np.ndarray:
    """Twin of tail_sum over (rows x columns)."""
    n = w.shape[1]
    if type_ != GGMLType.F32:
        tail = (w[:, None, i:] * x[None, :, i:]).astype(np.float64)
        total = res.astype(np.float64)
        for j in range(n - i):
            total = total + tail[..., j]
        return total.astype(F32)
    while n - i >= 4:
        step = 8 if n - i >= 8 else 4
        for j in range(i, i + step):
            res = res + w[:, None, j] * x[None, :, j]
        i += step
    for j in range(i, n):
        res = np_fma(w[:, None, j], x[None, :, j], res)
    return res


@numba.njit(inline="always", **JIT)
def dot16(kind, tiny, pairs, w, off, esize, y, yoff, n, acc):
    """One weight row (bytes at `off` of w) . one activation row (y[yoff:yoff+n], already rounded to the
    weights' vec_dot_type) as the AVX-512 build; acc: float32 scratch of SCRATCH lanes."""
    pairs = pairs and kind == TYPE_BF16
    if tiny:
        kn = 32 if pairs else 16
        steps = n // kn
        if kind == TYPE_F32:
            _tiny_f32(w, off, y, yoff, steps, acc)
        elif kind == TYPE_F16:
            _tiny_f16(w, off, y, yoff, steps, acc)
        elif pairs:
            _tiny_bf16_pairs(w, off, y, yoff, steps, acc)
        else:
            _tiny_bf16(w, off, y, yoff, steps, acc)
        if n % kn:
            _tiny_tail(kind, pairs, w, off, esize, y, yoff, n, steps * kn, acc)
        return hsum16(acc, 0)
    if kind == TYPE_BF16:
        step = 64 if pairs else 32
        steps = n // step
        if pairs:
            _vec_bf16_pairs(w, off, y, yoff, steps, acc)
        else:
            _vec_bf16(w, off, y, yoff, steps, acc)
        total = np.float64(0.0) + np.float64(hsum16(acc, 0))
        total += np.float64(hsum16(acc, 16))
        for i in range(steps * step, n):  # bf16 products are exact in float32
            total += np.float64(load_weight(kind, w, off + i * esize) * y[yoff + i])
        return F32(total)
    steps = n // 64
    if kind == TYPE_F32:
        _vec_f32(w, off, y, yoff, steps, acc)
    else:
        _vec_f16(w, off, y, yoff, steps, acc)
    return tail_sum(kind, w, off, esize, y, yoff, steps * 64, n, hsum16(acc, 0))


# ----------------------------------------------------------------------------------------------
# numpy twin: the same arithmetic over (weight rows x activation rows)


def _np_flush(v):
    v = np.asarray(v, F32)
    bits = v.view(np.uint32)
    return np.where((bits & 0x7F800000) == 0, (bits & 0x80000000).view(F32), v).astype(F32)


def np_dot16(type_: GGMLType, w: np.ndarray, x: np.ndarray, tiny: bool, pairs: bool) -> np.ndarray:
    """w: (R, K) weights as float32, x: (C, K) activations rounded to the vec_dot type -> (R, C)."""
    n = w.shape[1]
    pairs = pairs and type_ == GGMLType.BF16
    prod = lambda i, j: (w[:, None, i:j], x[None, :, i:j])  # noqa: E731

    def padded(i, width):
        a, b = prod(i, i + width)
        pad = [(0, 0)] * 2 + [(0, width - a.shape[-1])]
        return np.pad(a, pad), np.pad(b, pad)

    def dpbf16(acc, a, b):  # 32 elements into 16 lanes: odd element first, then even
        a, b = _np_flush(a), _np_flush(b)
        t = _np_flush(np_fma(a[..., 1::2], b[..., 1::2], _np_flush(acc)))
        return _np_flush(np_fma(a[..., 0::2], b[..., 0::2], t))

    acc = np.zeros((len(w), len(x), 16), F32)
    if tiny:
        kn = 32 if pairs else 16
        for i in range(0, n, kn):
            a, b = padded(i, kn)
            acc = dpbf16(acc, a, b) if pairs else np_fma(a, b, acc)
        return np_hsum16(acc)
    if type_ == GGMLType.BF16:
        step = 64 if pairs else 32
        full = n - n % step
        acc2 = acc.copy()
        for i in range(0, full, step):
            if pairs:
                acc = dpbf16(acc, *prod(i, i + 32))
                acc2 = dpbf16(acc2, *prod(i + 32, i + 64))
            else:
                acc = np_fma(*prod(i, i + 16), acc)
                acc2 = np_fma(*prod(i + 16, i + 32), acc2)
        total = np_hsum16(acc).astype(np.float64) + np_hsum16(acc2).astype(np.float64)
        tail = (w[:, None, full:] * x[None, :, full:]).astype(np.float64)
        for i in range(n - full):
            total = total + tail[..., i]
        return total.astype(F32)
    full = n & ~63
    accs = [acc.copy() for _ in range(4)]
    for i in range(0, full, 64):
        for a in range(4):
            accs[a] = np_fma(*prod(i + 16 * a, i + 16 * a + 16), accs[a])
    return np_tail_sum(type_, w, x, full, np_hsum16((accs[0] + accs[2]) + (accs[1] + accs[3])))
