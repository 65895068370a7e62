"""MUL_MAT: check(), numba forward vs numpy reference (bit for bit), reference vs float64 math,
and both vs the real ggml-cpu (bit for bit) when the pinned llama.cpp libraries are installed."""

from __future__ import annotations

from fractions import Fraction

import gguf
import numpy as np
import pytest

import ggml_oracle
from kernels import fmath
from kernels.formats import quants
from kernels.formats.dequantize import dequantize_rows
from kernels.ops import matmul
from kernels.node import InvalidNode, Node, Tensor
from wire.ggml import TYPE_TRAITS, GGMLOp, GGMLType
from kernels.target import AVX2, AVX512, AVX512_NO_BF16

pytestmark = pytest.mark.kernels

T = GGMLType
QUANT = list(quants.QUANT_TYPES)
FLOAT = [T.F32, T.F16, T.BF16]
ALL = FLOAT + QUANT
# the ggml-cpu builds whose float orders we reproduce (quantized dots are the same in all of them)
TARGETS = pytest.mark.parametrize("target", [AVX2, AVX512, AVX512_NO_BF16], ids=lambda t: t.name)


def weight_bytes(rng, type_, ne0, nrows, scale=1.0):
    w = (rng.standard_normal((nrows, ne0)) * scale).astype(np.float32)
    if type_ == T.F32:
        return w
    if type_ == T.F16:
        return w.astype(np.float16)
    if type_ == T.BF16:
        return (w.view(np.uint32) >> 16).astype(np.uint16)
    return gguf.quants.quantize(w, gguf.GGMLQuantizationType(int(type_)))


def weights(rng, type_, ne, row_pad=0):
    """src0 of shape ne; row_pad extra bytes between rows makes dims 1..3 non-contiguous."""
    ne = tuple(ne) + (1,) * (4 - len(ne))
    nrows = ne[1] * ne[2] * ne[3]
    rows = weight_bytes(rng, type_, ne[0], nrows).view(np.uint8).reshape(nrows, -1)
    rb = rows.shape[1]
    mem = np.zeros(nrows * (rb + row_pad) + 64, np.uint8)
    mem[: nrows * (rb + row_pad)].reshape(nrows, rb + row_pad)[:, :rb] = rows
    nb1 = rb + row_pad
    return Tensor(type_, ne, (TYPE_TRAITS[type_].type_size, nb1, nb1 * ne[1], nb1 * ne[1] * ne[2]), mem, 0)


def activations(rng, ne, permute=False, scale=1.0):
    """f32 src1; permute=True stores dims 1 and 2 swapped (a permuted view, as attention's q)."""
    ne = tuple(ne) + (1,) * (4 - len(ne))
    if not permute:
        return Tensor.new(T.F32, ne, (rng.standard_normal(ne[::-1]) * scale).astype(np.float32))
    store = Tensor.new(T.F32, (ne[0], ne[2], ne[1], ne[3]), rng.standard_normal(
        (ne[3], ne[1], ne[2], ne[0])).astype(np.float32) * scale)
    nb = store.nb
    return Tensor(T.F32, ne, (nb[0], nb[2], nb[1], nb[3]), store.mem, 0)


def mul_mat(w, x, dst_pad=0, target=AVX2):
    ne = (w.ne[1], x.ne[1], x.ne[2], x.ne[3])
    nb1 = 4 * ne[0] + dst_pad
    mem = np.full(nb1 * ne[1] * ne[2] * ne[3] + 64, 0xFF, np.uint8)
    dst = Tensor(T.F32, ne, (4, nb1, nb1 * ne[1], nb1 * ne[1] * ne[2]), mem, 0)
    node = Node(GGMLOp.MUL_MAT, dst, (w, x), target=target)
    matmul.check(node)
    return node


def run(fn, node):
    node.dst.mem[:] = 0xFF
    fn(node)
    return node.dst.array().copy()


# ----------------------------------------------------------------------------------------------
# check()


def test_check_accepts_real_shapes():
    rng = np.random.default_rng(0)
    mul_mat(weights(rng, T.Q4_1, (576, 1536)), activations(rng, (576, 7)))
    mul_mat(weights(rng, T.F16, (64, 32, 3)), activations(rng, (64, 5, 9), permute=True))


@pytest.mark.parametrize("change, message", [
    (lambda w, x, d: (Tensor.new(T.IQ2_XXS, (256, 4)), x, d), "weight type"),
    (lambda w, x, d: (w, Tensor.new(T.F16, x.ne), d), "src1 and dst"),
    (lambda w, x, d: (w, activations(np.random.default_rng(0), (32, 3)), d), "row lengths"),
    (lambda w, x, d: (w, x, Tensor.new(T.F32, (3, 4, 1, 1))), "dst shape"),
    (lambda w, x, d: (weights(np.random.default_rng(0), T.F32, (64, 4, 2)), activations(
        np.random.default_rng(0), (64, 3, 3)), Tensor.new(T.F32, (4, 3, 3, 1))), "broadcast"),
    (lambda w, x, d: (Tensor(T.F32, w.ne, (8,) + w.nb[1:], w.mem, 0), x, d), "contiguous"),
    (lambda w, x, d: (w, Tensor(T.F32, x.ne, (8,) + x.nb[1:], x.mem, 0), d), "contiguous"),
    (lambda w, x, d: (Tensor(T.F32, w.ne, (4, 2, 8, 32), w.mem, 0), x, d), "transposed"),
    (lambda w, x, d: (w, x, Tensor(T.F32, d.ne, (4, 16, 8, 48), d.mem, 0)), "strides"),
])
def test_check_rejects(change, message):
    rng = np.random.default_rng(0)
    w, x = weights(rng, T.F32, (64, 4)), activations(rng, (64, 3))
    d = Tensor.new(T.F32, (4, 3, 1, 1))
    w, x, d = change(w, x, d)
    with pytest.raises(InvalidNode, match=message):
        matmul.check(Node(GGMLOp.MUL_MAT, d, (w, x)))


def test_check_rejects_partial_blocks_hint_and_missing_source():
    rng = np.random.default_rng(0)
    w = Tensor(T.Q8_0, (48, 2, 1, 1), (34, 34, 68, 68), np.zeros(256, np.uint8), 0)
    with pytest.raises(InvalidNode, match="multiple of 32"):
        matmul.check(Node(GGMLOp.MUL_MAT, Tensor.new(T.F32, (2, 1)), (w, activations(rng, (48, 1)))))
    node = mul_mat(weights(rng, T.F32, (32, 4)), activations(rng, (32, 2)))
    with pytest.raises(InvalidNode, match="Hadamard"):
        matmul.check(Node(GGMLOp.MUL_MAT, node.dst, node.src, params=[0, 1]))
    with pytest.raises(InvalidNode):
        matmul.check(Node(GGMLOp.MUL_MAT, node.dst, (node.src[0], None)))


# ----------------------------------------------------------------------------------------------
# forward vs reference, bit for bit

CASES = [  # (ne00, ne01, ne11, ne02, ne12, ne03, ne13, permute, row_pad)
    (64, 12, 1, 1, 1, 1, 1, False, 0),
    (96, 7, 5, 1, 1, 1, 1, False, 0),
    (64, 8, 9, 1, 1, 1, 1, False, 0),
    (160, 13, 2, 1, 1, 1, 1, False, 6),
    (64, 16, 5, 3, 6, 1, 1, True, 0),
    (32, 12, 1, 2, 4, 1, 2, True, 0),
    (64, 4, 3, 2, 2, 2, 4, False, 4),
]


@pytest.mark.parametrize("type_", QUANT, ids=lambda t: t.name)
@pytest.mark.parametrize("case", CASES + [(64, 5, 19, 1, 1, 1, 1, False, 0)],
                         ids=lambda c: "x".join(map(str, c[:7])) + ("p" if c[7] else ""))
@pytest.mark.parametrize("target", [AVX2, AVX512], ids=lambda t: t.name)
def test_forward_matches_reference(type_, case, target):
    """An AVX-512 target on an AVX512_VNNI host reads eight activation rows per weight row with
    vpdpbusd (quants.row_dot8), then four, two, one (case 5x19: 8 + 8 + 2 + 1)."""
    ne00, ne01, ne11, ne02, ne12, ne03, ne13, permute, pad = case
    rng = np.random.default_rng(hash((type_, case)) % 2**32)
    node = mul_mat(weights(rng, type_, (ne00, ne01, ne02, ne03), pad),
                   activations(rng, (ne00, ne11, ne12, ne13), permute), dst_pad=8, target=target)
    ours, ref = run(matmul.forward, node), run(matmul.reference, node)
    assert not np.isnan(ref).any()
    np.testing.assert_array_equal(ours, ref)


@TARGETS
@pytest.mark.parametrize("type_", FLOAT, ids=lambda t: t.name)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[:7])) + ("p" if c[7] else ""))
def test_float_orders_of_each_build(type_, case, target):
    ne00, ne01, ne11, ne02, ne12, ne03, ne13, permute, pad = case
    rng = np.random.default_rng(hash((type_, case)) % 2**32)
    node = mul_mat(weights(rng, type_, (ne00, ne01, ne02, ne03), pad),
                   activations(rng, (ne00, ne11, ne12, ne13), permute), dst_pad=8)
    node.target = target
    ours, ref = run(matmul.forward, node), run(matmul.reference, node)
    assert not np.isnan(ref).any()
    np.testing.assert_array_equal(ours, ref)


@TARGETS
@pytest.mark.parametrize("type_", FLOAT, ids=lambda t: t.name)
@pytest.mark.parametrize("ne00", [1, 7, 31, 33, 39, 45, 100, 130, 199])
@pytest.mark.parametrize("ne01, ne11", [(5, 1), (8, 3), (6, 2)])
def test_float_tails_and_paths(type_, ne00, ne01, ne11, target):
    """Row lengths that exercise every tail of ggml_vec_dot_* and of tinyBLAS (rows % 4 == 0)."""
    rng = np.random.default_rng(ne00 * 100 + ne01)
    node = mul_mat(weights(rng, type_, (ne00, ne01)), activations(rng, (ne00, ne11)))
    node.target = target
    np.testing.assert_array_equal(run(matmul.forward, node), run(matmul.reference, node))


@pytest.mark.parametrize("type_", [T.F16, T.F32, T.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("n_kv, n_tok", [(32, 1), (40, 7)])
def test_permuted_weights_like_a_kv_cache(type_, n_kv, n_tok):
    """-fa off attention: K^T Q with K a permuted cache view (head stride < row stride)."""
    rng = np.random.default_rng(n_kv + n_tok)
    head_dim, n_head_kv, n_head = 64, 2, 6
    store = weights(rng, type_, (head_dim, n_head_kv, n_kv))  # cache rows hold all kv heads
    nb = store.nb
    k = Tensor(type_, (head_dim, n_kv, n_head_kv, 1), (nb[0], nb[2], nb[1], nb[3]), store.mem, 0)
    q = activations(rng, (head_dim, n_tok, n_head), permute=True)
    node = mul_mat(k, q)
    np.testing.assert_array_equal(run(matmul.forward, node), run(matmul.reference, node))


def test_decode_and_batch_on_model_shapes():
    rng = np.random.default_rng(7)
    for type_, ne00, ne01, ne11 in [(T.Q4_1, 576, 1536, 1), (T.Q4_1, 1536, 576, 6), (T.Q8_0, 576, 600, 2)]:
        node = mul_mat(weights(rng, type_, (ne00, ne01)), activations(rng, (ne00, ne11)))
        np.testing.assert_array_equal(run(matmul.forward, node), run(matmul.reference, node))


def test_decode_steps_on_one_thread_where_threads_sleep(monkeypatch):
    """With OMP_WAIT_POLICY=PASSIVE (storage.WAKE_IS_SLOW) a decode step's MUL_MAT runs on the calling thread
    (numba's thread count given back after), a prompt's on all: both bit for bit the reference's."""
    import numba  # noqa: PLC0415
    monkeypatch.setattr(matmul, "WAKE_IS_SLOW", True)
    rng = np.random.default_rng(11)
    threads = numba.get_num_threads()
    for type_, ne11, alone in [(T.Q8_0, 1, True), (T.F16, 1, True), (T.Q4_1, 1, True), (T.Q8_0, 64, False)]:
        node = mul_mat(weights(rng, type_, (576, 576)), activations(rng, (576, ne11)))
        prepared = matmul.prepare(node)
        assert (getattr(prepared, "__name__", None) == "serial") == alone, (type_, ne11)  # on_one_thread
        node.dst.mem[:] = 0xFF
        prepared()
        assert numba.get_num_threads() == threads
        np.testing.assert_array_equal(node.dst.array(), run(matmul.reference, node))


def test_empty_batch_writes_nothing():
    rng = np.random.default_rng(1)
    node = mul_mat(weights(rng, T.Q8_0, (64, 4)), activations(rng, (64, 0)))
    node.dst.mem[:] = 0xA5  # the (4, 0) result has no bytes: its whole allocation must stay as it is
    matmul.forward(node)
    assert (node.dst.mem == 0xA5).all()


# ----------------------------------------------------------------------------------------------
# the reference against plain float64 math on dequantized weights


# bound on |error| per unit of sum(|w| |x|): activation rounding (fp16 / bf16 / q8 at half a step)
# plus float32 accumulation
REL = {T.F32: 1e-5, T.F16: 2.0**-11 + 1e-5, T.BF16: 2.0**-8 + 1e-5}


@pytest.mark.parametrize("type_", ALL, ids=lambda t: t.name)
def test_reference_close_to_float64(type_):
    rng = np.random.default_rng(int(type_))
    w, x = weights(rng, type_, (256, 9)), activations(rng, (256, 4), scale=3.0)
    node = mul_mat(w, x)
    got = run(matmul.reference, node)[0, 0]
    wf = dequantize_rows(type_, w.rows()[0, 0]).astype(np.float64)
    xf = x.array()[0, 0].astype(np.float64)
    exact = xf @ wf.T
    scale = np.abs(xf) @ np.abs(wf).T
    if type_ in QUANT:  # each activation moves by at most half a quantization step of its block
        step = np.abs(xf).reshape(len(xf), -1, 32).max(axis=2) / 127
        bound = np.einsum("cb,rbj->cr", step / 2, np.abs(wf).reshape(len(wf), -1, 32)) * 1.01 + 1e-5 * scale
    else:
        bound = REL[type_] * scale
    assert np.all(np.abs(got - exact) <= bound)
    assert np.abs(got - exact).max() > 0 or type_ == T.F32  # the rounding model is not vacuous


def test_np_fma_is_correctly_rounded():
    rng = np.random.default_rng(3)
    a = rng.standard_normal(3000).astype(np.float32)
    b = rng.standard_normal(3000).astype(np.float32)
    c = rng.standard_normal(3000).astype(np.float32)
    # halfway cases: c = -(a*b rounded to f32) + a tiny residue, and exact ties through large c
    c[:500] = -(a[:500] * b[:500]) + np.float32(1e-9)
    c[500:1000] = np.float32(2.0**24) * np.sign(c[500:1000])
    got = fmath.np_fma(a, b, c)
    for i in range(len(a)):
        exact = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
        lo = np.float32(float(exact))
        cands = [np.nextafter(lo, np.float32(-np.inf)), lo, np.nextafter(lo, np.float32(np.inf))]
        best = min(cands, key=lambda v: (abs(Fraction(float(v)) - exact), int(np.float32(v).view(np.int32)) & 1))
        assert got[i] == best, i


# ----------------------------------------------------------------------------------------------
# bit for bit against the real ggml-cpu (llamafile's tinyBLAS included), 2 threads


needs_ggml = ggml_oracle.needs_ggml

ORACLE_CASES = [  # (ne00, ne01, ne11, ne02, ne12, permute)
    (576, 36, 1, 1, 1, False), (576, 36, 7, 1, 1, False), (96, 7, 2, 1, 1, False),
    (64, 16, 5, 3, 6, True), (32, 12, 1, 2, 4, True), (128, 8, 9, 1, 1, False),
]


@needs_ggml
@pytest.mark.parametrize("type_", ALL, ids=lambda t: t.name)
@pytest.mark.parametrize("case", ORACLE_CASES, ids=lambda c: "x".join(map(str, c[:5])) + ("p" if c[5] else ""))
def test_bit_exact_with_ggml(type_, case):
    ne00, ne01, ne11, ne02, ne12, permute = case
    rng = np.random.default_rng(hash((type_, case)) % 2**32)
    with ggml_oracle.Graph() as g:
        a = g.new(type_, (ne00, ne01, ne02), weight_bytes(rng, type_, ne00, ne01 * ne02))
        if permute:
            b = g.op("ggml_permute", g.new(T.F32, (ne00, ne12, ne11), rng.standard_normal(
                ne00 * ne11 * ne12).astype(np.float32)), 0, 2, 1, 3)
        else:
            b = g.new(T.F32, (ne00, ne11, ne12), rng.standard_normal(ne00 * ne11 * ne12).astype(np.float32))
        out = g.op("ggml_mul_mat", a, b)
        node = g.mirror(out)
        g.compute(out, n_threads=2)
        theirs = ggml_oracle.result_bytes(out)
    matmul.check(node)
    matmul.forward(node)
    np.testing.assert_array_equal(ggml_oracle.our_bytes(node.dst).view(np.float32), theirs.view(np.float32))
    run(matmul.reference, node)
    np.testing.assert_array_equal(ggml_oracle.our_bytes(node.dst).view(np.float32), theirs.view(np.float32))


@needs_ggml
@pytest.mark.parametrize("type_", (T.F16, T.Q8_0),
                         ids=lambda t: t.name)
@pytest.mark.parametrize("n_tok", [1, 7])
def test_permuted_weights_bit_exact_with_ggml(type_, n_tok):
    rng = np.random.default_rng(n_tok)
    head_dim, n_kv, n_head_kv, n_head = 64, 40, 2, 6
    with ggml_oracle.Graph() as g:
        cache = g.new(type_, (head_dim, n_head_kv, n_kv), weight_bytes(rng, type_, head_dim, n_head_kv * n_kv))
        k = g.op("ggml_permute", cache, 0, 2, 1, 3)
        q0 = g.new(T.F32, (head_dim, n_head, n_tok), rng.standard_normal(head_dim * n_head * n_tok).astype(np.float32))
        out = g.op("ggml_mul_mat", k, g.op("ggml_permute", q0, 0, 2, 1, 3))
        node = g.mirror(out)
        g.compute(out, n_threads=2)
        theirs = ggml_oracle.result_bytes(out)
    matmul.check(node)
    matmul.forward(node)
    np.testing.assert_array_equal(ggml_oracle.our_bytes(node.dst).view(np.float32), theirs.view(np.float32))


@needs_ggml
@pytest.mark.parametrize("type_", FLOAT, ids=lambda t: t.name)
@pytest.mark.parametrize("ne00", [7, 39, 45, 100, 130, 199])
def test_float_tails_bit_exact_with_ggml(type_, ne00):
    rng = np.random.default_rng(ne00)
    for ne01, ne11 in [(5, 1), (8, 3)]:
        with ggml_oracle.Graph() as g:
            a = g.new(type_, (ne00, ne01), weight_bytes(rng, type_, ne00, ne01))
            b = g.new(T.F32, (ne00, ne11), rng.standard_normal(ne00 * ne11).astype(np.float32))
            out = g.op("ggml_mul_mat", a, b)
            node = g.mirror(out)
            g.compute(out, n_threads=2)
            theirs = ggml_oracle.result_bytes(out)
        matmul.forward(node)
        np.testing.assert_array_equal(ggml_oracle.our_bytes(node.dst).view(np.float32), theirs.view(np.float32))


# ----------------------------------------------------------------------------------------------
# the Hadamard hint (quantized KV caches): a fast Walsh-Hadamard transform instead of the product


def _hadamard(n: int) -> np.ndarray:
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(np.float32(n))).astype(np.float32)


@needs_ggml
@pytest.mark.parametrize("src_type", [T.F32, T.F16], ids=lambda t: t.name)
@pytest.mark.parametrize("n,ne11,ne12", [(64, 1, 1), (128, 5, 3), (256, 2, 1)])
def test_hadamard_hint_bit_exact_with_ggml(src_type, n, ne11, ne12):
    rng = np.random.default_rng(n * 31 + ne11)
    x = rng.standard_normal(n * ne11 * ne12).astype(np.float32)
    with ggml_oracle.Graph() as g:
        h = g.new(T.F32, (n, n), _hadamard(n))
        b = g.new(src_type, (n, ne11, ne12), x.astype(np.float16) if src_type == T.F16 else x)
        out = g.op("ggml_mul_mat", h, b)
        g._base.ggml_mul_mat_set_hint(out, matmul.HINT_SRC0_IS_HADAMARD)
        node = g.mirror(out)
        g.compute(out, n_threads=2)
        theirs = ggml_oracle.result_bytes(out).view(np.float32)
    before = ggml_oracle.our_bytes(node.src[1]).copy()
    matmul.check(node)
    matmul.forward(node)
    np.testing.assert_array_equal(ggml_oracle.our_bytes(node.dst).view(np.float32), theirs)
    np.testing.assert_array_equal(ggml_oracle.our_bytes(node.src[1]), before)  # the input is left alone
    run(matmul.reference, node)
    np.testing.assert_array_equal(ggml_oracle.our_bytes(node.dst).view(np.float32), theirs)
    # and it is the product it stands for, up to rounding
    expect = x.reshape(ne12, ne11, n).astype(np.float64) @ _hadamard(n).astype(np.float64).T
    got = ggml_oracle.our_bytes(node.dst).view(np.float32).reshape(ne12, ne11, n)
    np.testing.assert_allclose(got, expect, rtol=1e-4, atol=1e-4 if src_type == T.F32 else 1e-2)


def test_hadamard_hint_refuses_what_ggml_cannot_transform():
    def node(n_rows, weight_type=T.F32, ne00=None):
        ne00 = ne00 or n_rows
        w = Tensor.new(weight_type, (ne00, ne00, 1, 1))
        x = Tensor.new(T.F32, (n_rows, 2, 1, 1))
        params = np.zeros(16, np.int32)
        params[1] = matmul.HINT_SRC0_IS_HADAMARD
        return Node(GGMLOp.MUL_MAT, Tensor.new(T.F32, (ne00, 2, 1, 1)), [w, x], params)

    matmul.check(node(64))
    for bad in (node(48), node(64, T.F16), node(64, ne00=32)):
        with pytest.raises(InvalidNode):
            matmul.check(bad)
