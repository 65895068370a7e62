"""K-quant and IQ4 weights (Q2_K..Q6_K, IQ4_NL, IQ4_XS): numpy unpackers and dequantizers against
gguf-py, numba twins against numpy, the Q8_K activation quantizer against ggml's, and MUL_MAT /
GET_ROWS bit for bit against the real ggml-cpu, MUL_MAT on each of the routes ggml-cpu takes (tiled
K-quant kernel, vec_dot, tinyBLAS) and at their boundaries."""

from __future__ import annotations

import ctypes as C

import gguf
import numba
import numpy as np
import pytest

import ggml_oracle
from kernels import llvm
from kernels.formats import kquant_dot, kquant_lanes, kquant_vnni, kquants, quants
from kernels.formats.dequantize import dequantize_rows
from kernels.ops import get_rows, matmul
from kernels.node import InvalidNode, Node, Tensor
from kernels.target import AVX2, AVX512
from wire.ggml import TYPE_TRAITS, GGMLOp, GGMLType

pytestmark = pytest.mark.kernels

T = GGMLType
TYPES = list(kquants.KQUANT_TYPES)
needs_ggml = ggml_oracle.needs_ggml


def random_blocks(rng, type_, n_blocks):
    """Arbitrary block bytes (every bit pattern of quants and scales) with finite fp16 d and dmin."""
    tt = TYPE_TRAITS[type_]
    b = rng.integers(0, 256, (n_blocks, tt.type_size), dtype=np.uint8)
    at = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.IQ4_NL: (0,),
          T.IQ4_XS: (0,)}[type_]
    for off in at:
        b[:, off : off + 2] = (rng.standard_normal((n_blocks, 1)) * 0.05).astype(np.float16).view(np.uint8)
    return b


def ggml_quantize(type_, values: np.ndarray) -> np.ndarray:
    """ggml's own quantizer (ggml_quantize_chunk of the pinned libggml-base)."""
    base = ggml_oracle._libs()[0]
    fn = base.ggml_quantize_chunk
    fn.restype = C.c_size_t
    fn.argtypes = [C.c_int, C.c_void_p, C.c_void_p, C.c_int64, C.c_int64, C.c_int64, C.c_void_p]
    rows = np.ascontiguousarray(values, np.float32).reshape(-1, values.shape[-1])
    tt = TYPE_TRAITS[type_]
    out = np.zeros((rows.shape[0], rows.shape[1] // tt.block_size * tt.type_size), np.uint8)
    assert fn(int(type_), rows.ctypes.data, out.ctypes.data, 0, rows.shape[0], rows.shape[1], None) == out.size
    return out


def gguf_dequantize(type_, blocks):
    return gguf.quants.dequantize(np.ascontiguousarray(blocks), gguf.GGMLQuantizationType(int(type_))).reshape(-1)


def decode_with_numba(type_, blocks):
    tt = TYPE_TRAITS[type_]
    nblk, qb = len(blocks), tt.block_size
    q = np.empty(nblk * qb, np.int8)
    s, m = np.empty(nblk * qb // 16, np.int32), np.empty(nblk * qb // 16, np.int32)
    d, dmin = np.empty(nblk, np.float32), np.empty(nblk, np.float32)
    kquants.decode_row(int(type_), blocks.reshape(-1).copy(), 0, nblk, tt.type_size, qb, q, s, m, d, dmin)
    out = np.empty(nblk * qb, np.float32)
    kquants.dequantize_decoded(kquants.HAS_MIN[type_], nblk, qb, q, s, m, d, dmin, out)
    return q, s, m, d, dmin, out


# ----------------------------------------------------------------------------------------------
# dequantization


@pytest.mark.parametrize("type_", TYPES, ids=lambda t: t.name)
def test_numpy_dequantize_matches_gguf_on_arbitrary_blocks(type_):
    blocks = random_blocks(np.random.default_rng(int(type_)), type_, 40)
    ours = kquants.DEQUANTIZE[type_](blocks).reshape(-1)
    np.testing.assert_array_equal(ours.view(np.uint32), gguf_dequantize(type_, blocks).view(np.uint32))


@needs_ggml
@pytest.mark.parametrize("type_", TYPES, ids=lambda t: t.name)
def test_numpy_dequantize_matches_gguf_on_ggml_quantized_blocks(type_):
    x = np.random.default_rng(int(type_) + 1).standard_normal((6, 512)).astype(np.float32)
    blocks = ggml_quantize(type_, x).reshape(-1, TYPE_TRAITS[type_].type_size)
    ours = kquants.DEQUANTIZE[type_](blocks).reshape(-1)
    np.testing.assert_array_equal(ours.view(np.uint32), gguf_dequantize(type_, blocks).view(np.uint32))
    assert np.abs(ours - x.reshape(-1)).max() < 1.0  # the quantizer round trip is not vacuous


@pytest.mark.parametrize("type_", TYPES, ids=lambda t: t.name)
def test_numba_decode_matches_numpy(type_):
    blocks = random_blocks(np.random.default_rng(int(type_) + 2), type_, 24)
    q, s, m, d, dmin, out = decode_with_numba(type_, blocks)
    rq, rs, rm, rd, rdmin = kquants.unpack_blocks(type_, blocks)
    np.testing.assert_array_equal(q, rq.reshape(-1))
    np.testing.assert_array_equal(s, rs.reshape(-1))
    if rm is not None:
        np.testing.assert_array_equal(m, rm.reshape(-1))
        np.testing.assert_array_equal(dmin, rdmin)
    np.testing.assert_array_equal(d, rd)
    np.testing.assert_array_equal(out.view(np.uint32), kquants.DEQUANTIZE[type_](blocks).reshape(-1).view(np.uint32))


def test_formats_dequantize_rows_serves_the_k_quants():
    blocks = random_blocks(np.random.default_rng(5), T.Q4_K, 4)
    rows = blocks.reshape(2, -1)
    np.testing.assert_array_equal(dequantize_rows(T.Q4_K, rows).reshape(-1),
                                  kquants.DEQUANTIZE[T.Q4_K](blocks).reshape(-1))


# ----------------------------------------------------------------------------------------------
# Q8_K activations


def _activation_rows(rng):
    x = rng.standard_normal((6, 512)).astype(np.float32) * np.float32(3)
    x[1, :256] = 0  # an all-zero block
    x[2, 7] = 40.0  # the extreme is positive: iscale is negative, values map to -127
    x[3, 300] = -40.0
    x[4, 10], x[4, 11] = -5.0, 5.0  # equal magnitudes: the first one sets the sign
    return x


def test_q8_k_numba_matches_reference():
    x = _activation_rows(np.random.default_rng(6))
    qs, d, bsums = kquants.quantize_activations(T.Q4_K, x)
    rq, rd, rb = kquants.quantize_q8_k_ref(x)
    np.testing.assert_array_equal(qs, rq)
    np.testing.assert_array_equal(d.view(np.uint32), rd.view(np.uint32))
    np.testing.assert_array_equal(bsums, rb)


@needs_ggml
def test_q8_k_reference_matches_ggml():
    x = _activation_rows(np.random.default_rng(7))
    base = ggml_oracle._libs()[0]
    fn = base.quantize_row_q8_K_ref
    fn.argtypes = [C.c_void_p, C.c_void_p, C.c_int64]
    raw = np.zeros((x.shape[0], 2, 292), np.uint8)  # block_q8_K: float d, int8 qs[256], int16 bsums[16]
    for r in range(x.shape[0]):
        row = np.ascontiguousarray(x[r])
        fn(row.ctypes.data, raw[r].ctypes.data, x.shape[1])
    qs, d, bsums = kquants.quantize_q8_k_ref(x)
    np.testing.assert_array_equal(d.view(np.uint32), raw[:, :, 0:4].copy().view("<u4")[..., 0])
    np.testing.assert_array_equal(qs.reshape(x.shape[0], 2, 256), raw[:, :, 4:260].view(np.int8))
    np.testing.assert_array_equal(bsums.reshape(x.shape[0], 2, 16), raw[:, :, 260:292].copy().view("<i2"))


# ----------------------------------------------------------------------------------------------
# MUL_MAT


def weight_tensor(rng, type_, ne, row_pad=0, quantizer=None):
    ne = tuple(ne) + (1,) * (4 - len(ne))
    nrows = ne[1] * ne[2] * ne[3]
    if quantizer is None:
        rows = random_blocks(rng, type_, nrows * ne[0] // TYPE_TRAITS[type_].block_size).reshape(nrows, -1)
    else:
        rows = quantizer(type_, rng.standard_normal((nrows, ne[0])).astype(np.float32))
    nb1 = rows.shape[1] + row_pad
    mem = np.zeros(nrows * nb1 + 64, np.uint8)
    mem[: nrows * nb1].reshape(nrows, nb1)[:, : rows.shape[1]] = rows
    return Tensor(type_, ne, (TYPE_TRAITS[type_].type_size, nb1, nb1 * ne[1], nb1 * ne[1] * ne[2]), mem, 0)


def activations(rng, ne, permute=False):
    ne = tuple(ne) + (1,) * (4 - len(ne))
    if not permute:
        return Tensor.new(T.F32, ne, rng.standard_normal(ne[::-1]).astype(np.float32))
    store = Tensor.new(T.F32, (ne[0], ne[2], ne[1], ne[3]),
                       rng.standard_normal((ne[3], ne[1], ne[2], ne[0])).astype(np.float32))
    nb = store.nb
    return Tensor(T.F32, ne, (nb[0], nb[2], nb[1], nb[3]), store.mem, 0)


def mul_mat_node(w, x, target=AVX2):
    dst = Tensor.new(T.F32, (w.ne[1], x.ne[1], x.ne[2], x.ne[3]))
    node = Node(GGMLOp.MUL_MAT, dst, (w, x), target=target)
    matmul.check(node)
    return node


def run(fn, node):
    node.dst.mem[:] = 0xFF
    fn(node)
    return node.dst.array().copy()


MUL_MAT_CASES = [  # (ne00, ne01, ne11, ne02, ne12, ne03, ne13, permuted activations, row_pad)
    (256, 13, 1, 1, 1, 1, 1, False, 0),
    (512, 7, 6, 1, 1, 1, 1, False, 4),
    (256, 5, 3, 2, 4, 1, 2, True, 0),
    (768, 17, 2, 1, 1, 2, 2, False, 0),
    (512, 9, 8, 1, 2, 1, 1, False, 4),  # the tiled route (src1 ne[1] >= 8)
    (256, 18, 19, 2, 2, 1, 1, True, 0),
]


@pytest.mark.parametrize("type_", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("case", MUL_MAT_CASES, ids=lambda c: "x".join(map(str, c[:7])) + ("p" if c[7] else ""))
@pytest.mark.parametrize("target", [AVX2, AVX512], ids=lambda t: t.name)
def test_mul_mat_forward_matches_reference(type_, case, target):
    """On an AVX512_VNNI host the AVX-512 target's tiled route is kernels.formats.kquant_vnni (ragged
    weight-row tiles and activation rows past its register tiles included: cases 18x19 and 9x8)."""
    ne00, ne01, ne11, ne02, ne12, ne03, ne13, permute, pad = case
    rng = np.random.default_rng(hash((type_, case)) % 2**32)
    node = mul_mat_node(weight_tensor(rng, type_, (ne00, ne01, ne02, ne03), pad),
                        activations(rng, (ne00, ne11, ne12, ne13), permute), target)
    ours, ref = run(matmul.forward, node), run(matmul.reference, node)
    np.testing.assert_array_equal(ours.view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("ne11", [1, 3])
def test_mul_mat_iq4_nl_odd_block_count_forward_matches_reference(ne11):
    rng = np.random.default_rng(ne11 + 20)
    node = mul_mat_node(weight_tensor(rng, T.IQ4_NL, (9 * 32, 11)), activations(rng, (9 * 32, ne11)))
    ours, ref = run(matmul.forward, node), run(matmul.reference, node)
    np.testing.assert_array_equal(ours.view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("type_", TYPES, ids=lambda t: t.name)
def test_mul_mat_reference_close_to_float64(type_):
    """Against float64 math on the dequantized weights: each activation moves by at most half a
    step of its Q8 block, plus float32 accumulation."""
    rng = np.random.default_rng(int(type_) + 3)
    w, x = weight_tensor(rng, type_, (512, 9)), activations(rng, (512, 4))
    got = run(matmul.reference, mul_mat_node(w, x))[0, 0]
    wf = dequantize_rows(type_, w.rows()[0, 0]).astype(np.float64)
    xf = x.array()[0, 0].astype(np.float64)
    qb = 32 if kquants.VEC_DOT_TYPE[type_] == T.Q8_0 else 256
    step = np.abs(xf).reshape(len(xf), -1, qb).max(axis=2) / 127
    bound = np.einsum("cb,rbj->cr", step / 2, np.abs(wf).reshape(len(wf), -1, qb)) * 1.01
    bound += 1e-5 * (np.abs(xf) @ np.abs(wf).T)
    err = np.abs(got - xf @ wf.T)
    assert np.all(err <= bound) and err.max() > 0


def test_mul_mat_check_rejects_partial_super_blocks():
    w = Tensor(T.Q4_K, (128, 2, 1, 1), (144, 144, 288, 288), np.zeros(512, np.uint8), 0)
    with pytest.raises(InvalidNode, match="multiple of 256"):
        matmul.check(Node(GGMLOp.MUL_MAT, Tensor.new(T.F32, (2, 1)), (w, Tensor.new(T.F32, (128, 1)))))


ORACLE_CASES = [  # (ne00, ne01, ne11, ne12, permuted activations): ggml-cpu's route is chosen by ne11
    (1536, 40, 1, 1, False),  # vec_dot (IQ4_NL too)
    (512, 36, 7, 1, False),  # vec_dot: the largest src1 the tiled kernel leaves to it; IQ4_NL: tinyBLAS
    (256, 17, 6, 1, False),  # vec_dot in runs of 4 and 2 activation rows; a last task of one weight row
    (512, 36, 8, 1, False),  # tiled kernel, narrow path (<= 16 activation rows)
    (768, 33, 40, 1, False),  # tiled kernel, standard path
    (256, 13, 3, 4, True),  # vec_dot over several broadcast slices, strided activations
    (256, 21, 9, 2, True),  # tiled kernel over slices, strided activations
]


def ggml_mul_mat(type_, ne00, ne01, ne11, ne12, permute, rng):
    """(our MUL_MAT node mirroring ggml's, ggml-cpu's result as float32) for random quantized weights."""
    with ggml_oracle.Graph() as g:
        a = g.new(type_, (ne00, ne01, 1), ggml_quantize(type_, rng.standard_normal((ne01, ne00))))
        values = rng.standard_normal(ne00 * ne11 * ne12).astype(np.float32)
        if permute:
            b = g.op("ggml_permute", g.new(T.F32, (ne00, ne12, ne11), values), 0, 2, 1, 3)
        else:
            b = g.new(T.F32, (ne00, ne11, ne12), values)
        out = g.op("ggml_mul_mat", a, b)
        node = g.mirror(out)
        g.compute(out, n_threads=2)
        return node, ggml_oracle.result_bytes(out).view(np.float32)


def assert_bit_exact(node, theirs):
    for fn in (matmul.forward, matmul.reference):
        fn(node)
        ours = ggml_oracle.our_bytes(node.dst).view(np.float32)
        np.testing.assert_array_equal(ours.view(np.uint32), theirs.view(np.uint32), err_msg=fn.__name__)


@needs_ggml
@pytest.mark.parametrize("type_", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("case", ORACLE_CASES, ids=lambda c: "x".join(map(str, c[:4])) + ("p" if c[4] else ""))
def test_mul_mat_bit_exact_with_ggml(type_, case):
    node, theirs = ggml_mul_mat(type_, *case, np.random.default_rng(hash((type_, case)) % 2**32))
    matmul.check(node)
    assert_bit_exact(node, theirs)


@needs_ggml
@pytest.mark.skipif(not kquant_vnni.HAS_VNNI, reason="the VNNI tiles run only where the CPU has AVX512_VNNI")
@pytest.mark.parametrize("type_", [t for t in TYPES if t != T.IQ4_NL], ids=lambda t: t.name)
@pytest.mark.parametrize("case", [c for c in ORACLE_CASES if c[2] >= kquants.TILED_MIN_ROWS],
                         ids=lambda c: "x".join(map(str, c[:4])) + ("p" if c[4] else ""))
def test_mul_mat_vnni_tiles_bit_exact_with_ggml(type_, case):
    """An AVX-512 target's tiled route (kernels.formats.kquant_vnni) against this oracle's tiled kernel:
    ggml's tiled kernels differ between builds only in integer sums, so they agree bit for bit."""
    node, theirs = ggml_mul_mat(type_, *case, np.random.default_rng(hash((type_, case)) % 2**32))
    node.target = AVX512
    matmul.check(node)
    assert_bit_exact(node, theirs)


@needs_ggml
@pytest.mark.parametrize("ne11", [1, 2, 5])
def test_mul_mat_iq4_nl_odd_block_count_bit_exact_with_ggml(ne11):
    """IQ4_NL's vec_dot pairs blocks and adds an odd last one separately; tinyBLAS does not."""
    if ne11 == 1 and ggml_oracle.ORACLE == "avx2" and ggml_oracle._libs()[1].ggml_cpu_has_avx512():
        pytest.skip("the odd block's fma is how gcc compiles the AVX2 build (tools/install_reference.sh); "
                    "this libggml is a native AVX-512 build, where it was seen as a mul and an add")
    node, theirs = ggml_mul_mat(T.IQ4_NL, 9 * 32, 11, ne11, 1, False, np.random.default_rng(ne11))
    matmul.check(node)
    assert_bit_exact(node, theirs)


@pytest.mark.parametrize("type_", [T.Q3_K, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_vec_rows_without_avx2_or_vnni_match_the_numpy_twin(type_, monkeypatch):
    """The VEC route's multi-row kernel as a host without AVX2, or with AVX2 but no AVX512_VNNI, compiles
    it (plain LLVM vector code, or madd + add for vpdpwssd): the same integers, so bit for bit dot_ref."""
    rng = np.random.default_rng(int(type_) + 70)
    k, n_rows, ncol = 512, 3, 2
    rows = random_blocks(rng, type_, n_rows * k // 256).reshape(n_rows, -1)
    x = rng.standard_normal((ncol, k)).astype(np.float32)
    qs, d, bsums = kquants.quantize_q8_k_ref(x)
    want = kquants.dot_ref(type_, rows, x, ne11=1)
    for avx2 in (False, True):
        rows_fn = kquant_dot._make_vec_rows(type_, ncol)

        @numba.njit
        def call(w, nb01, nrows, nblk, yq, yd, ybs, out):
            return rows_fn(w, 0, nb01, nrows, nblk, yq, yd, ybs, 0, out, 0, 0, 0, 0)

        out = np.zeros((1, 1, ncol, n_rows), np.float32)
        for module in (llvm, kquant_lanes):
            monkeypatch.setattr(module, "HAS_AVX2", avx2)
        monkeypatch.setattr(kquant_lanes, "HAS_VNNI", False)
        call(rows.reshape(-1), rows.shape[1], n_rows, k // 256, qs.ravel(), d.ravel(), bsums.ravel(), out)  # compiles
        monkeypatch.undo()
        np.testing.assert_array_equal(out[0, 0].T.view(np.uint32), want.view(np.uint32), err_msg=f"avx2={avx2}")


def test_routes_round_differently():
    """The three orders are genuinely different arithmetic: the same products, routed otherwise,
    change some low bits (so the route tests above are not vacuous)."""
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((3, 2048)) * np.exp(rng.standard_normal((3, 2048)))).astype(np.float32)
    for type_ in (T.Q4_K, T.IQ4_NL):
        rows = random_blocks(rng, type_, 64 * 2048 // TYPE_TRAITS[type_].block_size).reshape(64, -1)
        a = kquants.dot_ref(type_, rows, x, ne11=1)
        b = kquants.dot_ref(type_, rows, x, ne11=8)
        assert not np.array_equal(a.view(np.uint32), b.view(np.uint32))
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(a).max())


# ----------------------------------------------------------------------------------------------
# GET_ROWS


def get_rows_node(src0, idx):
    dst = Tensor.new(T.F32, (src0.ne[0], idx.ne[0], idx.ne[1], idx.ne[2]))
    node = Node(GGMLOp.GET_ROWS, dst, (src0, idx))
    get_rows.check(node)
    return node


@pytest.mark.parametrize("type_", TYPES, ids=lambda t: t.name)
def test_get_rows_forward_matches_reference(type_):
    rng = np.random.default_rng(int(type_) + 4)
    src0 = weight_tensor(rng, type_, (512, 9, 3, 2), row_pad=8)
    idx = Tensor.new(T.I32, (5, 3, 2), rng.integers(0, 9, (2, 3, 5), dtype=np.int32))
    node = get_rows_node(src0, idx)
    ours, ref = run(get_rows.forward, node), run(get_rows.reference, node)
    np.testing.assert_array_equal(ours.view(np.uint32), ref.view(np.uint32))


def test_get_rows_check_rejects_partial_super_blocks():
    s = Tensor(T.Q6_K, (128, 2, 1, 1), (210, 210, 420, 420), np.zeros(512, np.uint8), 0)
    with pytest.raises(InvalidNode, match="multiple of 256"):
        get_rows.check(Node(GGMLOp.GET_ROWS, Tensor.new(T.F32, (128, 1)), (s, Tensor.new(T.I32, (1,)))))


@needs_ggml
@pytest.mark.parametrize("type_", TYPES, ids=lambda t: t.name)
def test_get_rows_bit_exact_with_ggml(type_):
    rng = np.random.default_rng(int(type_) + 8)
    for ne00, ne01, ne02, ne03, ne10, quantized in ((256, 10, 1, 1, 3, True), (512, 7, 3, 2, 5, False)):
        n_rows = ne01 * ne02 * ne03
        if quantized:
            data = ggml_quantize(type_, rng.standard_normal((n_rows, ne00)))
        else:
            data = random_blocks(rng, type_, n_rows * ne00 // TYPE_TRAITS[type_].block_size)
        with ggml_oracle.Graph() as g:
            a = g.new(type_, (ne00, ne01, ne02, ne03), data)
            b = g.new(T.I32, (ne10, ne02, ne03), rng.integers(0, ne01, ne10 * ne02 * ne03).astype(np.int32))
            out = g.op("ggml_get_rows", a, b)
            node = g.mirror(out)
            g.compute(out, n_threads=2)
            theirs = ggml_oracle.result_bytes(out)
        get_rows.check(node)
        get_rows.forward(node)
        np.testing.assert_array_equal(ggml_oracle.our_bytes(node.dst), theirs)
