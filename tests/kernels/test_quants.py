"""Block formats: dequantizers vs gguf-py, the activation quantizers (numpy vs numba, vs the real
ggml-cpu), and the per-row integer dot products vs the numpy reference and vs ggml's vec_dot."""

from __future__ import annotations

import ctypes as C

import gguf
import numba
import numpy as np
import pytest

import ggml_oracle
from kernels.formats import quants
from kernels.formats.dequantize import dequantize_rows
from kernels import llvm
from kernels.ops import matmul
from wire.ggml import TYPE_TRAITS, GGMLType

pytestmark = pytest.mark.kernels

T = GGMLType
QUANT = list(quants.QUANT_TYPES)
needs_ggml = ggml_oracle.needs_ggml


def gguf_type(t):
    return gguf.GGMLQuantizationType(int(t))


def random_rows(rng, rows, k):
    """Activations with per-row scales, an all-zero block and a lone tiny value."""
    x = (rng.standard_normal((rows, k)) * rng.uniform(0.01, 20, (rows, 1))).astype(np.float32)
    x[0, :32] = 0
    if k >= 64:
        x[min(1, rows - 1), 32:64] = 0
        x[min(1, rows - 1), 40] = 1e-6
    return x


# ----------------------------------------------------------------------------------------------
# dequantizers


@pytest.mark.parametrize("type_", QUANT, ids=lambda t: t.name)
def test_dequantize_matches_gguf(type_):
    rng = np.random.default_rng(int(type_))
    raw = gguf.quants.quantize(rng.standard_normal((40, 256)).astype(np.float32), gguf_type(type_))
    blocks = raw.reshape(-1, TYPE_TRAITS[type_].type_size)
    # also arbitrary quant bits under sane scales: every bit pattern of qs/qh must decode like gguf's
    noise = rng.integers(0, 256, blocks.shape, dtype=np.uint8)
    noise[:, :4] = blocks[:, :4]
    for b in (blocks, noise):
        want = gguf.quants.dequantize(b.reshape(-1), gguf_type(type_)).reshape(len(b), -1)
        np.testing.assert_array_equal(quants.DEQUANTIZE[type_](b), want)


@pytest.mark.parametrize("type_", [T.F32, T.F16, T.BF16], ids=lambda t: t.name)
def test_dequantize_plain(type_):
    rng = np.random.default_rng(5)
    x = rng.standard_normal(300).astype(np.float32)
    if type_ == T.F16:
        raw, want = x.astype(np.float16), x.astype(np.float16).astype(np.float32)
    elif type_ == T.BF16:
        raw = (x.view(np.uint32) >> 16).astype(np.uint16)
        want = (raw.astype(np.uint32) << 16).view(np.float32)
        np.testing.assert_allclose(want, x, rtol=2**-7)
    else:
        raw, want = x, x
    rows = raw.view(np.uint8).reshape(3, -1)
    np.testing.assert_array_equal(dequantize_rows(type_, rows), want.reshape(3, -1))


# ----------------------------------------------------------------------------------------------
# activation quantizers


@pytest.mark.parametrize("with_sum", [False, True])
@pytest.mark.parametrize("rows, k", [(1, 32), (7, 576), (37, 1536)])
def test_quantize_numba_matches_reference(with_sum, rows, k):
    x = random_rows(np.random.default_rng(rows), rows, k)
    q, d, s = quants.quantize_q8_ref(x, with_sum)
    qs, dd = np.empty_like(q), np.empty_like(d)
    ss = np.empty_like(d) if with_sum else dd
    quants.quantize_q8_rows(x, qs, dd, ss, with_sum)
    np.testing.assert_array_equal(qs, q)
    np.testing.assert_array_equal(dd, d)
    if with_sum:
        np.testing.assert_array_equal(ss, s)


def test_quantize_reference_against_float_math():
    x = random_rows(np.random.default_rng(9), 20, 256)
    q, d, s = quants.quantize_q8_ref(x, True)
    xb, qb = x.reshape(20, -1, 32).astype(np.float64), q.reshape(20, -1, 32).astype(np.float64)
    amax = np.abs(xb).max(axis=2)
    np.testing.assert_array_equal(d, (amax / 127).astype(np.float16).astype(np.float32))
    # s uses the scale before its fp16 rounding (which flushes the 1e-6 block's d to zero)
    np.testing.assert_allclose(s, amax / 127 * qb.sum(axis=2), rtol=2**-10, atol=2**-24)
    assert np.abs(qb).max() <= 127
    step = amax / 127
    assert np.all(np.abs(qb * step[..., None] - xb) <= step[..., None] * (0.5 + 1e-4))
    # ties go to even (vroundps), unlike roundf in the generic C reference
    tie = np.zeros((1, 32), np.float32)
    tie[0, 0], tie[0, 1], tie[0, 2] = 127, 0.5, 1.5
    assert list(quants.quantize_q8_ref(tie, False)[0][0, :3]) == [127, 0, 2]


def test_quantize_agrees_with_gguf_except_rare_last_bit_cases():
    """gguf-py mirrors the generic C quantizer (1/d and roundf): same scales, quants within 1."""
    x = random_rows(np.random.default_rng(11), 64, 512)
    q, d, _ = quants.quantize_q8_ref(x, False)
    theirs = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0).reshape(-1, 34)
    np.testing.assert_array_equal(theirs[:, :2].copy().view(np.float16).astype(np.float32)[:, 0], d.reshape(-1))
    diff = np.abs(theirs[:, 2:].view(np.int8).astype(int) - q.reshape(-1, 32))
    assert diff.max() <= 1 and (diff > 0).mean() < 0.01


def test_pack_q8_layout():
    q, d, s = quants.quantize_q8_ref(random_rows(np.random.default_rng(2), 3, 64), True)
    packed = quants.pack_q8(q, d, s)
    assert packed.shape == (6, 36)
    np.testing.assert_array_equal(packed[:, 4:].view(np.int8), q.reshape(-1, 32))
    np.testing.assert_array_equal(packed[:, 2:4].copy().view(np.float16)[:, 0].astype(np.float32), s.reshape(-1))
    deq = gguf.quants.dequantize(quants.pack_q8(q, d).reshape(-1), gguf.GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(deq.reshape(q.shape), q * np.repeat(d, 32, axis=1))


# ----------------------------------------------------------------------------------------------
# per-row dot products


def _row_dot_caller(type_, ncols, dot=None):
    dot = dot or quants.ROW_DOT[type_][{1: 0, 2: 1, 4: 2}[ncols]]

    @numba.njit
    def call(w, off, nb, yq, yd, ys, col):
        return dot(w, off, nb, yq, yd, ys, col)

    return call


@pytest.mark.parametrize("type_", QUANT, ids=lambda t: t.name)
def test_row_dot_matches_reference(type_):
    rng = np.random.default_rng(int(type_) + 40)
    k, rows, cols = 320, 3, 6
    raw = gguf.quants.quantize(rng.standard_normal((rows, k)).astype(np.float32), gguf_type(type_))
    raw = raw.reshape(rows, -1)
    x = random_rows(rng, cols, k)
    q, d, s = quants.quantize_q8_ref(x, quants.HAS_MIN[type_])
    s = d if s is None else s
    want = matmul._slice_quant(type_, raw, x)  # numpy reference, (rows, cols)
    one, two, four = _row_dot_caller(type_, 1), _row_dot_caller(type_, 2), _row_dot_caller(type_, 4)
    flat = raw.reshape(-1)
    for r in range(rows):
        args = (flat, r * raw.shape[1], k // 32, q.ravel(), d.ravel(), s.ravel())
        got = [one(*args, c)[0] for c in range(cols)]
        np.testing.assert_array_equal(np.array(got, np.float32), want[r])
        np.testing.assert_array_equal(np.array(two(*args, 3), np.float32), want[r, 3:5])
        np.testing.assert_array_equal(np.array(four(*args, 2), np.float32), want[r, 2:6])


@pytest.mark.parametrize("type_", QUANT, ids=lambda t: t.name)
def test_portable_lanes_match_avx2_lanes(type_, monkeypatch):
    """Hosts without AVX2 get plain LLVM vector code for the lane sums: same integers."""
    rng = np.random.default_rng(int(type_) + 60)
    k = 128
    raw = gguf.quants.quantize(rng.standard_normal((2, k)).astype(np.float32), gguf_type(type_)).reshape(-1)
    q, d, s = quants.quantize_q8_ref(random_rows(rng, 3, k), True)
    args = (raw, raw.size // 2, k // 32, q.ravel(), d.ravel(), s.ravel(), 0)
    monkeypatch.setattr(llvm, "HAS_AVX2", False)
    portable = _row_dot_caller(type_, 1, quants._make_row_dot(type_, 1))(*args)
    monkeypatch.undo()
    assert portable == _row_dot_caller(type_, 1)(*args)


# ----------------------------------------------------------------------------------------------
# against the real ggml-cpu: its from_float for q8_0/q8_1 and its vec_dot for each weight format


class _TraitsCPU(C.Structure):
    _fields_ = [("from_float", C.c_void_p), ("vec_dot", C.c_void_p), ("vec_dot_type", C.c_int), ("nrows", C.c_int64)]


def _traits(type_):
    cpu = ggml_oracle._libs()[1]
    cpu.ggml_get_type_traits_cpu.restype = C.POINTER(_TraitsCPU)
    return cpu.ggml_get_type_traits_cpu(int(type_)).contents


def ggml_from_float(type_, x):
    x = np.ascontiguousarray(x, np.float32)
    out = np.zeros(x.size // 32 * (34 if type_ == T.Q8_0 else 36), np.uint8)
    C.CFUNCTYPE(None, C.c_void_p, C.c_void_p, C.c_int64)(_traits(type_).from_float)(x.ctypes.data, out.ctypes.data, x.size)
    return out


@needs_ggml
@pytest.mark.parametrize("type_", [T.Q8_0, T.Q8_1], ids=lambda t: t.name)
def test_quantize_bit_exact_with_ggml(type_):
    x = random_rows(np.random.default_rng(3), 50, 576)
    q, d, s = quants.quantize_q8_ref(x, type_ == T.Q8_1)
    np.testing.assert_array_equal(quants.pack_q8(q, d, s).reshape(-1), ggml_from_float(type_, x))


@needs_ggml
@pytest.mark.parametrize("type_", QUANT, ids=lambda t: t.name)
def test_row_dot_bit_exact_with_ggml_vec_dot(type_):
    rng = np.random.default_rng(int(type_) + 80)
    k, rows, cols = 576, 4, 5
    raw = gguf.quants.quantize(rng.standard_normal((rows, k)).astype(np.float32), gguf_type(type_)).reshape(rows, -1)
    x = random_rows(rng, cols, k)
    act = T.Q8_1 if quants.HAS_MIN[type_] else T.Q8_0
    q, d, s = quants.quantize_q8_ref(x, quants.HAS_MIN[type_])
    s = d if s is None else s
    vec_dot = C.CFUNCTYPE(None, C.c_int, C.c_void_p, C.c_size_t, C.c_void_p, C.c_size_t, C.c_void_p, C.c_size_t,
                          C.c_int)(_traits(type_).vec_dot)
    one = _row_dot_caller(type_, 1)
    for r in range(rows):
        w = np.ascontiguousarray(raw[r])
        for c in range(cols):
            y = ggml_from_float(act, x[c])
            res = np.zeros(1, np.float32)
            vec_dot(k, res.ctypes.data, 0, w.ctypes.data, 0, y.ctypes.data, 0, 1)
            assert one(raw.reshape(-1), r * raw.shape[1], k // 32, q.ravel(), d.ravel(), s.ravel(), c)[0] == res[0]
