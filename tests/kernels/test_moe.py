"""The mixture-of-experts ops (MUL_MAT_ID, ARGSORT, TOP_K, SUM_ROWS, CLAMP, ADD_ID): numba forward bit for bit
against the real ggml-cpu, and against the numpy reference; check() refusing what would read or write
outside the tensors."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

import ggml_oracle
from kernels.formats import kquant_vnni
from kernels.formats.kquants import KQUANT_TYPES
from kernels.ops import add_id, moe, reduce, sort
from kernels.target import AVX512
from wire.ggml import TYPE_TRAITS, GGMLOp, GGMLType
from kernels.node import InvalidNode, Node, Tensor
from kernels.registry import lookup
from test_kquants import random_blocks

pytestmark = pytest.mark.kernels

T = GGMLType
needs_ggml = ggml_oracle.needs_ggml


def weight_bytes(rng, type_, ne0, nrows):
    w = (rng.standard_normal((nrows, ne0)) * 0.5).astype(np.float32)
    if type_ == T.F32:
        return w
    if type_ == T.F16:
        return w.astype(np.float16)
    if type_ == T.BF16:
        return (w.view(np.uint32) >> 16).astype(np.uint16)
    if TYPE_TRAITS[type_].block_size == 256 or type_ == T.IQ4_NL:
        return random_blocks(rng, type_, nrows * ne0 // TYPE_TRAITS[type_].block_size)
    return gguf.quants.quantize(w, gguf.GGMLQuantizationType(int(type_)))


def routed_ids(rng, n_as, n_ids, n_tok, hot):
    """n_ids distinct experts per token; expert 0 in every token's list when `hot` (so it gets >= 8
    rows: the tiled route beside vec_dot ones), and the last expert in none."""
    ids = np.empty((n_tok, n_ids), np.int32)
    for t in range(n_tok):
        pick = rng.permutation(n_as - 1)[:n_ids]
        if hot and 0 not in pick:
            pick[rng.integers(n_ids)] = 0
        ids[t] = pick
    return ids


def run_both(node):
    """Our forward and reference on the node: both results."""
    kernel = lookup(node)
    kernel.check(node)
    node.dst.mem[:] = 0xFF
    kernel.forward(node)
    ours = ggml_oracle.our_bytes(node.dst)
    node.dst.mem[:] = 0xFF
    kernel.reference(node)
    return ours, ggml_oracle.our_bytes(node.dst)


def against_ggml(build):
    with ggml_oracle.Graph() as g:
        out = build(g)
        node = g.mirror(out)
        g.compute(out, n_threads=2)
        theirs = ggml_oracle.result_bytes(out)
    ours, ref = run_both(node)
    return ours, ref, theirs


# ----------------------------------------------------------------------------------------------
# MUL_MAT_ID

MMID_TYPES = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
              T.IQ4_NL, T.IQ4_XS]
# (K, ne01, n_as, n_ids, n_tok, shared activation row (ne11 = 1, the up/gate form) or one per slot (down))
MMID_CASES = [
    (256, 24, 6, 2, 1, True),     # a decode step
    (256, 20, 5, 2, 12, True),    # a prompt: expert 0 takes the tiled route, the others vec_dot
    (512, 9, 4, 3, 10, False),    # down: one activation row per slot
]


def mmid_build(type_, case):
    k, ne01, n_as, n_ids, n_tok, shared = case
    rng = np.random.default_rng(hash((type_, case)) % 2**32)
    ne11 = 1 if shared else n_ids

    def build(g):
        a = g.new(type_, (k, ne01, n_as), weight_bytes(rng, type_, k, ne01 * n_as))
        b = g.new(T.F32, (k, ne11, n_tok), rng.standard_normal(k * ne11 * n_tok).astype(np.float32))
        # the ids as llama.cpp passes them: a view of the first n_ids columns of a wider I32 tensor
        wide = np.zeros((n_tok, n_as), np.int32)
        wide[:, :n_ids] = routed_ids(rng, n_as, n_ids, n_tok, hot=n_tok >= 8)
        full = g.new(T.I32, (n_as, n_tok), wide)
        c = full.contents
        ids = g.op("ggml_view_2d", full, n_ids, n_tok, c.nb[1], 0)
        return g.op("ggml_mul_mat_id", a, b, ids)

    return build


@needs_ggml
@pytest.mark.parametrize("type_", MMID_TYPES, ids=lambda t: t.name)
def test_mul_mat_id_bit_exact_with_ggml(type_):
    for case in MMID_CASES:
        ours, ref, theirs = against_ggml(mmid_build(type_, case))
        np.testing.assert_array_equal(ours.view(np.float32), theirs.view(np.float32), err_msg=str(case))
        np.testing.assert_array_equal(ref.view(np.float32), theirs.view(np.float32), err_msg=str(case))


@needs_ggml
@pytest.mark.skipif(not kquant_vnni.HAS_VNNI, reason="the VNNI tiles run only where the CPU has AVX512_VNNI")
@pytest.mark.parametrize("type_", [t for t in MMID_TYPES if t in KQUANT_TYPES and t != T.IQ4_NL],
                         ids=lambda t: t.name)
def test_mul_mat_id_vnni_tiles_bit_exact_with_ggml(type_):
    """An AVX-512 target's tiled experts (kernels.formats.kquant_vnni, block-major activations) against this
    oracle: ggml's tiled kernels differ between builds only in integer sums. The second case routes 21
    rows to two experts of 35 weight rows (two full tiles and a ragged one)."""
    for case in (MMID_CASES[1], (512, 35, 3, 2, 21, True)):
        with ggml_oracle.Graph() as g:
            out = mmid_build(type_, case)(g)
            node = g.mirror(out)
            g.compute(out, n_threads=2)
            theirs = ggml_oracle.result_bytes(out)
        node.target = AVX512
        ours, ref = run_both(node)
        np.testing.assert_array_equal(ours.view(np.float32), theirs.view(np.float32), err_msg=str(case))
        np.testing.assert_array_equal(ref.view(np.float32), theirs.view(np.float32), err_msg=str(case))


def mmid_node(k=64, ne01=4, n_as=3, n_ids=2, n_tok=3, ne11=1, type_=T.F32):
    w = Tensor.new(type_, (k, ne01, n_as))
    x = Tensor.new(T.F32, (k, ne11, n_tok))
    ids = Tensor.new(T.I32, (n_ids, n_tok), np.zeros((n_tok, n_ids), np.int32))
    return Node(GGMLOp.MUL_MAT_ID, Tensor.new(T.F32, (ne01, n_ids, n_tok)), (w, x, ids))


@pytest.mark.parametrize("change, message", [
    (lambda n: n.src[2].__setattr__("type", T.I64), "I32"),
    (lambda n: n.src[1].__setattr__("ne", (64, 1, 2, 1)), "expert lists"),
    (lambda n: n.src[1].__setattr__("ne", (64, 0, 3, 1)), "broadcast"),
    (lambda n: n.src[0].__setattr__("ne", (64, 4, 3, 2)), "3-D"),
    (lambda n: n.dst.__setattr__("ne", (4, 2, 4, 1)), "dst shape"),
    (lambda n: n.src[0].__setattr__("ne", (48, 4, 3, 1)), "row lengths"),
])
def test_mul_mat_id_check_rejects(change, message):
    node = mmid_node()
    moe.check(node)
    change(node)
    with pytest.raises(InvalidNode, match=message):
        moe.check(node)


@pytest.mark.parametrize("bad", [-1, 3])
def test_mul_mat_id_refuses_an_expert_id_out_of_range_before_writing(bad):
    node = mmid_node(type_=T.Q8_0)
    node.src[2].array()[0, 0, 1, 1] = bad
    node.dst.mem[:] = 7
    with pytest.raises(InvalidNode, match="expert id"):
        moe.forward(node)
    assert (node.dst.mem == 7).all()
    with pytest.raises(InvalidNode, match="expert id"):
        moe.reference(node)


# ----------------------------------------------------------------------------------------------
# ARGSORT / TOP_K: ties beyond 16 elements are where std::sort's order shows


def sort_source(rng, n, rows):
    x = rng.standard_normal((rows, n)).astype(np.float32)
    x[1::2] = np.round(x[1::2] * 2) / 2  # many ties
    return x


@needs_ggml
@pytest.mark.parametrize("n", [8, 16, 17, 100, 300])
def test_argsort_bit_exact_with_ggml(n):
    rng = np.random.default_rng(n)
    for order in (sort.SORT_ASC, sort.SORT_DESC):
        x = sort_source(rng, n, 6)
        ours, ref, theirs = against_ggml(lambda g: g.op("ggml_argsort", g.new(T.F32, (n, 3, 2), x), order))
        np.testing.assert_array_equal(ours.view(np.int32), theirs.view(np.int32))
        no_ties = (ref.view(np.int32) == theirs.view(np.int32)).reshape(6, n).all(axis=1)
        assert no_ties[0::2].all() and (n > 16 or no_ties.all())  # the stable twin agrees where it should


@needs_ggml
@pytest.mark.parametrize("n, k", [(8, 2), (33, 1), (128, 8), (300, 40)])
def test_top_k_bit_exact_with_ggml(n, k):
    x = sort_source(np.random.default_rng(n + k), n, 4)
    ours, ref, theirs = against_ggml(lambda g: g.op("ggml_top_k", g.new(T.F32, (n, 4), x), k))
    np.testing.assert_array_equal(ours.view(np.int32), theirs.view(np.int32))
    assert (ref.view(np.int32) == theirs.view(np.int32)).reshape(4, k)[0::2].all()


def test_argsort_survives_nans():
    x = np.random.default_rng(1).standard_normal((3, 200)).astype(np.float32)
    x[:, ::7] = np.nan
    node = Node(GGMLOp.ARGSORT, Tensor.new(T.I32, (200, 3)), (Tensor.new(T.F32, (200, 3), x),), params=[1])
    sort.check(node)
    sort.forward(node)
    assert (np.sort(node.dst.array()[0, 0], axis=1) == np.arange(200)).all()  # some permutation


def test_sort_check_rejects_unevenly_spaced_rows():
    src = Tensor.new(T.F32, (8, 3, 2))
    src.nb = (4, 32, 128, 256)  # a gap after each plane: row 3 is not at 3 * nb1
    node = Node(GGMLOp.ARGSORT, Tensor.new(T.I32, (8, 3, 2)), (src,), params=[1])
    with pytest.raises(InvalidNode, match="evenly spaced"):
        sort.check(node)
    node = Node(GGMLOp.TOP_K, Tensor.new(T.I32, (9, 3, 2)), (Tensor.new(T.F32, (8, 3, 2)),))
    with pytest.raises(InvalidNode, match="shape"):
        sort.check(node)


# ----------------------------------------------------------------------------------------------
# SUM_ROWS, CLAMP


@needs_ggml
def test_sum_rows_bit_exact_with_ggml():
    rng = np.random.default_rng(3)
    for n in (1, 2, 37, 1000):
        x = (rng.standard_normal(n * 6) * 10.0 ** rng.integers(-3, 4, n * 6)).astype(np.float32)
        ours, ref, theirs = against_ggml(lambda g: g.op("ggml_sum_rows", g.op(
            "ggml_permute", g.new(T.F32, (n, 3, 2), x), 0, 2, 1, 3)))
        np.testing.assert_array_equal(ours.view(np.float32), theirs.view(np.float32))
        np.testing.assert_array_equal(ref.view(np.float32), theirs.view(np.float32))


@needs_ggml
def test_clamp_bit_exact_with_ggml():
    x = np.random.default_rng(4).standard_normal(3 * 40).astype(np.float32) * 3
    x[:6] = [np.nan, np.inf, -np.inf, -0.0, 6.103515625e-5, 1e-9]
    for lo, hi in ((6.103515625e-5, float("inf")), (-1.5, 0.5), (float("-inf"), 2.0)):
        ours, ref, theirs = against_ggml(lambda g: g.op("ggml_clamp", g.new(T.F32, (40, 3), x), lo, hi))
        np.testing.assert_array_equal(ours, theirs)
        np.testing.assert_array_equal(ref, theirs)


def test_sum_rows_check_rejects_wrong_result_shape():
    node = Node(GGMLOp.SUM_ROWS, Tensor.new(T.F32, (2, 3)), (Tensor.new(T.F32, (8, 3)),))
    with pytest.raises(InvalidNode, match="result shape"):
        reduce.check(node)


# ----------------------------------------------------------------------------------------------
# ADD_ID


@needs_ggml
@pytest.mark.parametrize("ne0,n_used,n_tok,n_expert", [(64, 2, 1, 6), (300, 4, 7, 8), (17, 1, 3, 2)])
def test_add_id_bit_exact_with_ggml(ne0, n_used, n_tok, n_expert):
    rng = np.random.default_rng(ne0)
    a = rng.standard_normal(ne0 * n_used * n_tok).astype(np.float32)
    b = rng.standard_normal(ne0 * n_expert).astype(np.float32)
    ids = routed_ids(rng, n_expert + 1, n_used, n_tok, hot=False)
    ours, ref, theirs = against_ggml(lambda g: g.op(
        "ggml_add_id", g.new(T.F32, (ne0, n_used, n_tok), a), g.new(T.F32, (ne0, n_expert), b),
        g.new(T.I32, (n_used, n_tok), ids)))
    np.testing.assert_array_equal(ours, theirs)
    np.testing.assert_array_equal(ref, theirs)


def add_id_node(ids, n_expert=4, ne0=8):
    n_tok, n_used = ids.shape
    ids_t = Tensor.new(T.I32, (n_used, n_tok))
    ids_t.array()[0, 0] = ids
    return Node(GGMLOp.ADD_ID, Tensor.new(T.F32, (ne0, n_used, n_tok)),
                (Tensor.new(T.F32, (ne0, n_used, n_tok)), Tensor.new(T.F32, (ne0, n_expert)), ids_t))


@pytest.mark.parametrize("bad", [-1, 4, 1 << 30])
def test_add_id_refuses_an_id_outside_the_table(bad):
    """ggml's worker aborts on such an id; ours refuses the node and writes nothing."""
    node = add_id_node(np.array([[0, 1], [2, bad]], np.int32))
    add_id.check(node)
    node.dst.mem[:] = 0x7F
    for run in (lookup(node).bind(node), lambda: add_id.reference(node)):
        with pytest.raises(InvalidNode, match="out of range"):
            run()
        assert (node.dst.mem == 0x7F).all()


def test_add_id_check_rejects_mismatched_shapes():
    node = add_id_node(np.zeros((3, 2), np.int32))
    short_ids = Tensor.new(T.I32, (2, 2))  # fewer id rows than src0 has tokens: would read past them
    with pytest.raises(InvalidNode, match="ids"):
        add_id.check(Node(GGMLOp.ADD_ID, node.dst, (node.src[0], node.src[1], short_ids)))
    narrow = Tensor.new(T.F32, (4, 4))  # bias rows shorter than src0's
    with pytest.raises(InvalidNode, match="src1"):
        add_id.check(Node(GGMLOp.ADD_ID, node.dst, (node.src[0], narrow, node.src[2])))
