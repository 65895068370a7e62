"""Activation functions as ggml-cpu computes them, shared by UNARY and GLU: SiLU in either build's lane
order (ggml_v_silu on full SIMD groups, libm on the tail), GELU's tanh/quick/erf forms and ggml's F16
lookup tables, and the numpy twins (`reference_unary_values`).
"""

from __future__ import annotations

import math

import numba
import numpy as np

from .fmath import f16_to_f32, f32_to_f16, fma32, np_v_expf, np_v_expf16, v_expf, v_expf16
from .jit import JIT
from wire.ggml import GGMLUnaryOp

F32 = np.float32
U = GGMLUnaryOp
SQR, SQRT = 1000, 1001  # codes for GGML_OP_SQR / SQRT, which reference_unary_values also computes

@numba.njit(inline="always", **JIT)
def silu_simd(x):
    """One lane of the AVX2 build's ggml_v_silu."""
    return x / (F32(1.0) + v_expf(F32(0.0) - x))


@numba.njit(inline="always", **JIT)
def silu_simd16(x):
    """One lane of the AVX-512 build's ggml_v_silu."""
    return x / (F32(1.0) + v_expf16(F32(0.0) - x))


@numba.njit(inline="always", **JIT)
def silu_vec(x, lanes):
    """One lane of ggml_v_silu in the build with `lanes` float lanes (8: AVX2, 16: AVX-512)."""
    return silu_simd16(x) if lanes == 16 else silu_simd(x)


@numba.njit(inline="always", **JIT)
def silu_scalar(x):
    return x / (F32(1.0) + math.exp(-x))
_GELU_COEF_A = F32(0.044715)
_GELU_QUICK_COEF = F32(-1.702)
_SQRT_2_OVER_PI = F32(0.79788456080286535587989211986876)
_SQRT_2_INV = F32(0.70710678118654752440084436210484)


@numba.njit(**JIT)
def gelu_tanh(x):
    # GCC contracts 1 + A*x*x into one fma when it builds the table
    return F32(0.5) * x * (F32(1.0) + math.tanh(_SQRT_2_OVER_PI * x * fma32(_GELU_COEF_A * x, x, F32(1.0))))


@numba.njit(inline="always", **JIT)
def gelu_quick(x):
    return x * (F32(1.0) / (F32(1.0) + math.exp(_GELU_QUICK_COEF * x)))


@numba.njit(inline="always", **JIT)
def gelu_erf(x):
    return F32(0.5) * x * (F32(1.0) + math.erf(x * _SQRT_2_INV))


@numba.njit(**JIT)
def _build_gelu_tables(gelu, quick):
    for h in range(65536):
        x = f16_to_f32(h)
        nan = np.uint16((h & 0x8000) | 0x7E00)  # ggml's table holds payload-free NaNs
        y = gelu_tanh(x)
        gelu[h] = nan if y != y else f32_to_f16(y)
        y = gelu_quick(x)
        quick[h] = nan if y != y else f32_to_f16(y)


_TABLES: list[np.ndarray] = []


def gelu_tables() -> tuple[np.ndarray, np.ndarray]:
    """ggml_table_gelu_f16 and ggml_table_gelu_quick_f16, as F16 bit patterns (built once)."""
    if not _TABLES:
        _TABLES.extend(np.empty(65536, dtype=np.uint16) for _ in range(2))
        _build_gelu_tables(*_TABLES)
    return _TABLES[0], _TABLES[1]


@numba.njit(inline="always", **JIT)
def gelu_table(x, table):
    """ggml_vec_gelu_f32 with GGML_GELU_FP16: clamp far tails, else look the F16-rounded input up."""
    if x <= F32(-10.0):
        return F32(0.0)
    if x >= F32(10.0):
        return x
    return f16_to_f32(table[f32_to_f16(x)])


def np_silu_rows(x: np.ndarray, lanes: int) -> np.ndarray:
    """ggml_vec_silu_f32 on every row (last axis): the build's ggml_v_silu on each full group of `lanes`
    (bit for bit), x / (1 + expf(-x)) on the rest (numpy's expf, within an ulp of libm's)."""
    x = np.asarray(x, F32)
    body = (x.shape[-1] // lanes) * lanes
    one = F32(1.0)
    out = np.empty(x.shape, F32)
    with np.errstate(all="ignore"):
        v = x[..., :body]
        out[..., :body] = v / (one + (np_v_expf16 if lanes == 16 else np_v_expf)(F32(0.0) - v))
        t = x[..., body:]
        out[..., body:] = t / (one + np.exp(-t))
    return out


def reference_unary_values(code: int, x: np.ndarray, lanes: int = 8) -> np.ndarray:
    """float32 numpy formulas (transcendentals to within an ulp of libm's; SILU's SIMD body exact)."""
    one, zero = F32(1.0), F32(0.0)
    if code == U.SILU:
        return np_silu_rows(x, lanes)
    with np.errstate(all="ignore"):
        if code == U.GELU:
            table = np.where(x <= -10, zero, np.where(x >= 10, x, _np_gelu_f16(x, _np_gelu_tanh)))
            return table.astype(F32)
        if code == U.GELU_QUICK:
            return _np_gelu_f16(x, _np_gelu_quick)
        formulas = {
            U.ABS: np.abs, U.NEG: np.negative, U.TANH: np.tanh, U.EXP: np.exp,
            U.SGN: lambda v: np.where(v > 0, one, np.where(v < 0, -one, zero)), U.STEP: lambda v: (v > 0).astype(F32),
            U.ELU: lambda v: np.where(v > 0, v, np.expm1(v)),
            U.RELU: lambda v: np.where(v > 0, v, zero),
            U.SIGMOID: lambda v: one / (one + np.exp(-v)),
            U.HARDSWISH: lambda v: v * np.fmin(one, np.fmax(zero, (v + F32(3)) / F32(6))),
            U.HARDSIGMOID: lambda v: np.fmin(one, np.fmax(zero, (v + F32(3)) / F32(6))),
            U.EXPM1: lambda v: np.exp(v) - one,
            U.SOFTPLUS: lambda v: np.where(v > 20, v, np.log(one + np.exp(v))),
            U.GELU_ERF: _np_gelu_erf,
            U.FLOOR: np.floor, U.CEIL: np.ceil, U.TRUNC: np.trunc,
            U.ROUND: lambda v: np.where(np.abs(v - np.trunc(v)) >= 0.5, np.trunc(v) + np.sign(v), np.trunc(v)),
            SQR: np.square, SQRT: np.sqrt,
        }
        return np.asarray(formulas[code](x), dtype=F32)


def _np_gelu_tanh(x):
    return F32(0.5) * x * (F32(1) + np.tanh(_SQRT_2_OVER_PI * x * (F32(1) + _GELU_COEF_A * x * x)))


def _np_gelu_quick(x):
    return x * (F32(1) / (F32(1) + np.exp(_GELU_QUICK_COEF * x)))


def _np_gelu_erf(x):
    from math import erf

    return (F32(0.5) * x * (F32(1) + np.vectorize(erf, otypes=[np.float64])(x * _SQRT_2_INV).astype(F32))).astype(F32)


def _np_gelu_f16(x, fn):
    """What the table path yields: fn at the F16-rounded input, rounded to F16."""
    return fn(x.astype(np.float16).astype(F32)).astype(np.float16).astype(F32)
