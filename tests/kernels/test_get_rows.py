"""GET_ROWS: check(), index validation, numba forward vs numpy reference vs gguf-py dequantization,
and bit for bit against the real ggml-cpu when the pinned llama.cpp libraries are installed."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

import ggml_oracle
from kernels.ops import get_rows
from kernels.formats import kquants, quants
from kernels.node import InvalidNode, Node, Tensor
from wire.ggml import TYPE_TRAITS, GGMLOp, GGMLType

pytestmark = pytest.mark.kernels

T = GGMLType
# the K-quant and IQ4 formats (256-element blocks, no gguf-py quantizer) have tests/kernels/test_kquants.py
SOURCES = [t for t in get_rows.SOURCE_TYPES if t not in kquants.KQUANT_TYPES]


def source_bytes(rng, type_, ne0, nrows):
    x = rng.standard_normal((nrows, ne0)).astype(np.float32)
    if type_ == T.F32:
        return x
    if type_ == T.F16:
        return x.astype(np.float16)
    if type_ == T.BF16:
        return (x.view(np.uint32) >> 16).astype(np.uint16)
    if type_ == T.I32:
        return rng.integers(-2**31, 2**31 - 1, (nrows, ne0), dtype=np.int32)
    return gguf.quants.quantize(x, gguf.GGMLQuantizationType(int(type_)))


def source(rng, type_, ne, row_pad=0):
    ne = tuple(ne) + (1,) * (4 - len(ne))
    nrows = ne[1] * ne[2] * ne[3]
    rows = source_bytes(rng, type_, ne[0], nrows).view(np.uint8).reshape(nrows, -1)
    nb1 = rows.shape[1] + row_pad
    mem = np.zeros(nrows * nb1 + 64, np.uint8)
    mem[: nrows * nb1].reshape(nrows, nb1)[:, : rows.shape[1]] = rows
    return Tensor(type_, ne, (TYPE_TRAITS[type_].type_size, nb1, nb1 * ne[1], nb1 * ne[1] * ne[2]), mem, 0)


def indices(rng, ne01, ne, transposed=False):
    """I32 (ne10, ne11, ne12); transposed=True stores dims 0 and 1 swapped (a strided view)."""
    ne10, ne11, ne12 = ne
    if not transposed:
        return Tensor.new(T.I32, (ne10, ne11, ne12), rng.integers(0, ne01, (ne12, ne11, ne10), dtype=np.int32))
    store = Tensor.new(T.I32, (ne11, ne10, ne12), rng.integers(0, ne01, (ne12, ne10, ne11), dtype=np.int32))
    nb = store.nb
    return Tensor(T.I32, (ne10, ne11, ne12, 1), (nb[1], nb[0], nb[2], nb[3]), store.mem, 0)


def get_rows_node(src0, src1, dst_pad=0):
    ne = (src0.ne[0], src1.ne[0], src1.ne[1], src1.ne[2])
    dtype = T.I32 if src0.type == T.I32 else T.F32
    nb1 = 4 * ne[0] + dst_pad
    mem = np.zeros(nb1 * ne[1] * ne[2] * ne[3] + 64, np.uint8)
    dst = Tensor(dtype, ne, (4, nb1, nb1 * ne[1], nb1 * ne[1] * ne[2]), mem, 0)
    node = Node(GGMLOp.GET_ROWS, dst, (src0, src1))
    get_rows.check(node)
    return node


def run(fn, node):
    node.dst.mem[:] = 0xFF
    fn(node)
    return node.dst.array().copy()


# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("change, message", [
    (lambda s, i, d: (Tensor.new(T.IQ2_XXS, (256, 4)), i, d), "source type"),
    (lambda s, i, d: (s, Tensor.new(T.I64, i.ne), d), "I32"),
    (lambda s, i, d: (s, i, Tensor.new(T.F16, d.ne)), "dst must be F32"),
    (lambda s, i, d: (s, Tensor.new(T.I32, (3, 2)), Tensor.new(T.F32, (64, 3, 2))), "index shape"),
    (lambda s, i, d: (s, Tensor.new(T.I32, (3, 1, 1, 2)), Tensor.new(T.F32, (64, 3, 1, 1))), "index shape"),
    (lambda s, i, d: (s, i, Tensor.new(T.F32, (64, 4))), "dst shape"),
    (lambda s, i, d: (Tensor(T.F32, s.ne, (8,) + s.nb[1:], s.mem, 0), i, d), "contiguous"),
    (lambda s, i, d: (s, i, Tensor(T.F32, d.ne, (8, 512, 1536, 1536), np.zeros(2048, np.uint8), 0)), "contiguous"),
])
def test_check_rejects(change, message):
    rng = np.random.default_rng(0)
    s, i = source(rng, T.F32, (64, 10)), indices(rng, 10, (3, 1, 1))
    s, i, d = change(s, i, Tensor.new(T.F32, (64, 3)))
    with pytest.raises(InvalidNode, match=message):
        get_rows.check(Node(GGMLOp.GET_ROWS, d, (s, i)))


def test_check_rejects_partial_blocks_and_i32_needs_i32_dst():
    w = Tensor(T.Q8_0, (48, 2, 1, 1), (34, 34, 68, 68), np.zeros(256, np.uint8), 0)
    with pytest.raises(InvalidNode, match="multiple of 32"):
        get_rows.check(Node(GGMLOp.GET_ROWS, Tensor.new(T.F32, (48, 1)), (w, Tensor.new(T.I32, (1,)))))
    s = source(np.random.default_rng(1), T.I32, (8, 3))
    with pytest.raises(InvalidNode, match="dst must be I32"):
        get_rows.check(Node(GGMLOp.GET_ROWS, Tensor.new(T.F32, (8, 1)), (s, Tensor.new(T.I32, (1,)))))


@pytest.mark.parametrize("bad", [-1, 10, 2**31 - 1])
@pytest.mark.parametrize("fn", [get_rows.forward, get_rows.reference], ids=["forward", "reference"])
def test_out_of_range_index_is_refused(bad, fn):
    rng = np.random.default_rng(2)
    node = get_rows_node(source(rng, T.Q8_0, (64, 10)), indices(rng, 10, (4, 1, 1)))
    node.src[1].array()[0, 0, 0, 2] = bad
    with pytest.raises(InvalidNode, match="out of range"):
        fn(node)


CASES = [  # (ne00, ne01, ne02, ne03, (ne10, ne11, ne12), transposed indices, row_pad)
    (64, 10, 1, 1, (3, 1, 1), False, 0),
    (96, 7, 3, 2, (5, 3, 2), False, 8),
    (32, 5, 2, 1, (4, 2, 1), True, 0),
    (576, 50, 1, 1, (1, 1, 1), False, 0),
    (64, 6, 1, 1, (0, 1, 1), False, 0),
]


@pytest.mark.parametrize("type_", SOURCES, ids=lambda t: t.name)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}x{c[2]}x{c[3]}-{'x'.join(map(str, c[4]))}"
                         + ("t" if c[5] else ""))
def test_forward_matches_reference_and_gguf(type_, case):
    ne00, ne01, ne02, ne03, ine, transposed, pad = case
    rng = np.random.default_rng(hash((type_, case)) % 2**32)
    src0 = source(rng, type_, (ne00, ne01, ne02, ne03), pad)
    node = get_rows_node(src0, indices(rng, ne01, ine, transposed), dst_pad=4)
    ours, ref = run(get_rows.forward, node), run(get_rows.reference, node)
    np.testing.assert_array_equal(ours.view(np.uint32), ref.view(np.uint32))
    idx = node.src[1].array()[0]
    for i12 in range(ine[2]):  # independent oracle: gguf-py (or plain numpy) on each picked row
        for i11 in range(ine[1]):
            for i10 in range(ine[0]):
                raw = np.ascontiguousarray(src0.rows()[i12, i11, idx[i12, i11, i10]])
                if type_ == T.I32:
                    want = raw.view(np.int32)
                elif type_ == T.BF16:
                    want = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
                elif type_ in (T.F32, T.F16):
                    want = raw.view(np.float32 if type_ == T.F32 else np.float16).astype(np.float32)
                else:
                    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(int(type_)))
                np.testing.assert_array_equal(ours[i12, i11, i10], want)


@ggml_oracle.needs_ggml
@pytest.mark.parametrize("type_", SOURCES, ids=lambda t: t.name)
def test_bit_exact_with_ggml(type_):
    rng = np.random.default_rng(int(type_) + 7)
    for ne00, ne01, ne02, ne03, ne10 in ((64, 10, 1, 1, 3), (96, 7, 3, 2, 5)):
        with ggml_oracle.Graph() as g:
            a = g.new(type_, (ne00, ne01, ne02, ne03), source_bytes(rng, type_, ne00, ne01 * ne02 * ne03))
            b = g.new(T.I32, (ne10, ne02, ne03), rng.integers(0, ne01, ne10 * ne02 * ne03).astype(np.int32))
            out = g.op("ggml_get_rows", a, b)
            node = g.mirror(out)
            g.compute(out, n_threads=1)
            theirs = ggml_oracle.result_bytes(out)
        get_rows.check(node)
        get_rows.forward(node)
        np.testing.assert_array_equal(ggml_oracle.our_bytes(node.dst), theirs)
