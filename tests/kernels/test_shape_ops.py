"""CONCAT / REPEAT / ARGMAX: jit vs numpy reference, numpy oracles, refusals, and ggml-cpu bit for bit."""

import numpy as np
import pytest

import ggml_oracle
from kernels import fmath as fm
from kernels.ops import shape_ops  # noqa: F401  (registers the kernels)
from kernels.node import InvalidNode, Node, Tensor
from kernels.registry import lookup
from wire.ggml import GGMLOp, GGMLType

pytestmark = pytest.mark.kernels

T = GGMLType
needs_ggml = ggml_oracle.needs_ggml


# --- helpers -------------------------------------------------------------------------------------

def random_data(type_, n, rng):
    values = (rng.standard_normal(n) * 3).astype(np.float32)
    return {
        T.F32: lambda: values,
        T.F16: lambda: values.astype(np.float16),
        T.BF16: lambda: fm.np_f32_to_bf16_bits(values),
        T.I32: lambda: rng.integers(-(2**31), 2**31 - 1, n, dtype=np.int32),
        T.I16: lambda: rng.integers(-(2**15), 2**15 - 1, n, dtype=np.int16),
        T.I8: lambda: rng.integers(-128, 127, n, dtype=np.int8),
        T.I64: lambda: rng.integers(-(2**62), 2**62, n, dtype=np.int64),
        T.F64: lambda: values.astype(np.float64),
    }[type_]()


def permuted(t: Tensor, axes) -> Tensor:
    """A ggml_permute-style view: result dim i is source dim axes[i] (same memory)."""
    return Tensor(t.type, tuple(t.ne[a] for a in axes), tuple(t.nb[a] for a in axes), t.mem, t.offset)


def source(type_, ne, axes=None, seed=0):
    """A random tensor of shape ne; with axes, a permuted view of differently shaped memory."""
    rng = np.random.default_rng(seed)
    base_ne = tuple(ne[i] for i in np.argsort(axes)) if axes else ne
    t = Tensor.new(type_, base_ne, random_data(type_, int(np.prod(ne)), rng))
    return permuted(t, axes) if axes else t


def strided_dst(type_, ne, gap=3):
    """A destination whose rows are spaced `gap` elements apart beyond their length (a view)."""
    size = Tensor.new(type_, (1,)).nb[0]
    nb1 = (ne[0] + gap) * size
    nb = (size, nb1, nb1 * ne[1], nb1 * ne[1] * ne[2])
    mem = np.full(nb[3] * ne[3] + 64, 0xA5, dtype=np.uint8)
    return Tensor(type_, ne, nb, mem, 16)


def run_both(build):
    """Build a node twice with identical inputs; forward on one, reference on the other."""
    a, b = build(), build()
    kernel = lookup(a)
    kernel.check(a)
    kernel.forward(a)
    kernel.reference(b)
    np.testing.assert_array_equal(a.dst.mem, b.dst.mem)
    return a


def refuses(node, match):
    with pytest.raises(InvalidNode, match=match):
        lookup(node).check(node)


# --- CONCAT --------------------------------------------------------------------------------------

CONCAT_SHAPES = {
    # name: (a ne, b ne, dim, a axes, b axes)
    "dim0": ((5, 3, 2, 2), (7, 3, 2, 2), 0, None, None),
    "dim1": ((6, 4, 3, 1), (6, 1, 3, 1), 1, None, None),
    "dim2": ((6, 4, 3, 2), (6, 4, 5, 2), 2, None, None),
    "dim3": ((6, 4, 3, 2), (6, 4, 3, 1), 3, None, None),
    "dim0-permuted-a": ((5, 3, 4, 1), (2, 3, 4, 1), 0, (1, 0, 2, 3), None),
    "dim1-permuted-both": ((6, 4, 3, 2), (6, 2, 3, 2), 1, (2, 0, 1, 3), (1, 2, 0, 3)),
    "dim2-transposed-b": ((7, 5, 1, 1), (7, 5, 2, 1), 2, None, (1, 0, 2, 3)),
    "empty-a": ((6, 0, 3, 1), (6, 4, 3, 1), 1, None, None),
}


def _concat_node(type_, shape, strided_out=False):
    a_ne, b_ne, dim, a_axes, b_axes = CONCAT_SHAPES[shape]
    a, b = source(type_, a_ne, a_axes, seed=1), source(type_, b_ne, b_axes, seed=2)
    ne = tuple(x + y if d == dim else x for d, (x, y) in enumerate(zip(a_ne, b_ne)))
    dst = strided_dst(type_, ne) if strided_out else Tensor.new(type_, ne)
    return Node(GGMLOp.CONCAT, dst, (a, b), [dim])


@pytest.mark.parametrize("shape", CONCAT_SHAPES)
@pytest.mark.parametrize("type_", [T.F32, T.F16, T.BF16, T.I32, T.I16, T.I8], ids=lambda t: t.name)
def test_concat_forward_matches_reference_and_numpy(type_, shape):
    node = run_both(lambda: _concat_node(type_, shape))
    a, b = node.src[0].array(), node.src[1].array()
    expect = np.concatenate((a, b), axis=3 - node.param("dim"))
    np.testing.assert_array_equal(node.dst.array().view(np.uint8), expect.view(np.uint8))


@pytest.mark.parametrize("type_", [T.F32, T.F16, T.I64, T.F64], ids=lambda t: t.name)
def test_concat_into_strided_dst_leaves_gaps_alone(type_):
    node = run_both(lambda: _concat_node(type_, "dim1", strided_out=True))
    a, b = node.src[0].array(), node.src[1].array()
    np.testing.assert_array_equal(node.dst.array(), np.concatenate((a, b), axis=2))
    written = np.zeros(node.dst.mem.size, bool)
    view = node.dst.rows()
    for idx in np.ndindex(view.shape[:3]):
        start = view[idx].__array_interface__["data"][0] - node.dst.mem.__array_interface__["data"][0]
        written[start : start + view.shape[3]] = True
    assert (node.dst.mem[~written] == 0xA5).all()


def test_concat_check_refusals():
    def node(a_ne=(4, 3, 2, 1), b_ne=(4, 5, 2, 1), dst_ne=(4, 8, 2, 1), dim=1, ta=T.F32, tb=T.F32, td=T.F32):
        return Node(GGMLOp.CONCAT, Tensor.new(td, dst_ne), (Tensor.new(ta, a_ne), Tensor.new(tb, b_ne)), [dim])

    lookup(node()).check(node())
    for dim in (-1, 4, 1 << 20):
        refuses(node(dim=dim), "dim")
    refuses(node(ta=T.Q8_0, tb=T.Q8_0, td=T.Q8_0, a_ne=(32, 3, 2, 1), b_ne=(32, 5, 2, 1), dst_ne=(32, 8, 2, 1)),
            "unsupported type")
    refuses(node(tb=T.F16), "agree")
    refuses(node(td=T.F16), "agree")
    refuses(node(b_ne=(5, 5, 2, 1)), "differ in dim 0")
    refuses(node(b_ne=(4, 5, 2, 2)), "differ in dim 3")
    refuses(node(dst_ne=(4, 9, 2, 1)), "dst shape")
    refuses(node(dst_ne=(4, 8, 2, 2)), "dst shape")
    refuses(node(dim=0, b_ne=(4, 3, 2, 1), dst_ne=(4, 6, 2, 1)), "dst shape")
    refuses(Node(GGMLOp.CONCAT, Tensor.new(T.F32, (4, 3)), (Tensor.new(T.F32, (4, 3)),), [0]), "sources")
    square = Tensor.new(T.I64, (4, 4, 2, 1))
    refuses(Node(GGMLOp.CONCAT, Tensor.new(T.I64, (4, 8, 2, 1)), (permuted(square, (1, 0, 2, 3)), square), [1]),
            "contiguous")


# --- REPEAT --------------------------------------------------------------------------------------

REPEAT_SHAPES = {
    # name: (src ne, dst ne, src axes): src axes permute dims 1..3 only (rows stay contiguous)
    "row-to-matrix": ((8, 1, 1, 1), (8, 5, 1, 1), None),
    "all-dims": ((3, 2, 1, 2), (6, 4, 3, 4), None),
    "identity": ((5, 3, 2, 1), (5, 3, 2, 1), None),
    "scalar": ((1, 1, 1, 1), (4, 3, 2, 2), None),
    "permuted-planes": ((4, 3, 2, 1), (8, 6, 4, 3), (0, 2, 1, 3)),
    "empty": ((0, 3, 1, 1), (0, 6, 1, 1), None),
}


def _repeat_node(type_, shape, strided_out=False):
    src_ne, dst_ne, axes = REPEAT_SHAPES[shape]
    src = source(type_, src_ne, axes, seed=3)
    dst = strided_dst(type_, dst_ne) if strided_out else Tensor.new(type_, dst_ne)
    return Node(GGMLOp.REPEAT, dst, (src,))


@pytest.mark.parametrize("strided_out", [False, True], ids=["dense", "strided-dst"])
@pytest.mark.parametrize("shape", REPEAT_SHAPES)
@pytest.mark.parametrize("type_", [T.F32, T.F16, T.BF16, T.I32, T.I16], ids=lambda t: t.name)
def test_repeat_forward_matches_reference_and_loops(type_, shape, strided_out):
    node = run_both(lambda: _repeat_node(type_, shape, strided_out))
    src, dst = node.src[0].array(), node.dst.array()
    for i in np.ndindex(dst.shape):  # the definition, element by element
        j = tuple(k % n for k, n in zip(i, src.shape))
        assert dst[i].tobytes() == src[j].tobytes()


def test_repeat_check_refusals():
    def node(src_ne=(4, 1, 2, 1), dst_ne=(8, 3, 2, 2), ts=T.F32, td=T.F32):
        return Node(GGMLOp.REPEAT, Tensor.new(td, dst_ne), (Tensor.new(ts, src_ne),))

    lookup(node()).check(node())
    refuses(node(ts=T.I8, td=T.I8), "unsupported type")
    refuses(node(ts=T.I64, td=T.I64), "unsupported type")
    refuses(node(td=T.F16), "dst type")
    refuses(node(dst_ne=(6, 3, 2, 2)), "repetition")
    refuses(node(dst_ne=(8, 3, 3, 2)), "repetition")
    refuses(node(src_ne=(0, 1, 1, 1), dst_ne=(8, 1, 1, 1)), "empty source")
    refuses(Node(GGMLOp.REPEAT, Tensor.new(T.F32, (4, 4)), ()), "sources")
    square = Tensor.new(T.F32, (4, 4))
    refuses(Node(GGMLOp.REPEAT, Tensor.new(T.F32, (8, 4)), (permuted(square, (1, 0, 2, 3)),)), "contiguous")
    dst = permuted(Tensor.new(T.F32, (4, 8)), (1, 0, 2, 3))
    refuses(Node(GGMLOp.REPEAT, dst, (Tensor.new(T.F32, (8, 1)),)), "contiguous")


# --- ARGMAX --------------------------------------------------------------------------------------

def _argmax_node(rows: np.ndarray, dst_stride: int = 4):
    rows = np.asarray(rows, dtype=np.float32)
    src = Tensor.new(T.F32, (rows.shape[1], rows.shape[0]), rows)
    mem = np.full(rows.shape[0] * dst_stride + 64, 0x5A, dtype=np.uint8)
    nb = (dst_stride,) + (dst_stride * rows.shape[0],) * 3
    dst = Tensor(T.I32, (rows.shape[0], 1, 1, 1), nb, mem, 0)
    return Node(GGMLOp.ARGMAX, dst, (src,))


def _ggml_argmax_loop(row) -> int:
    """ggml_vec_argmax_f32, transcribed line by line in plain Python floats."""
    best, idx = float("-inf"), 0
    for i, v in enumerate(row.tolist()):
        best = best if best > v else v
        if best == v:
            idx = i
    return idx


NAN, INF = np.nan, np.inf
SPECIAL_ROWS = [
    [1.0, 3.0, 3.0, 2.0],        # tie: the later index wins
    [0.0, -0.0, -1.0, -2.0],     # +0 and -0 tie
    [-0.0, 0.0, -1.0, -2.0],
    [-INF, -INF, -INF, -INF],    # all -inf: the last one
    [NAN, NAN, NAN, NAN],        # all NaN: 0
    [5.0, NAN, 1.0, 0.5],        # a NaN restarts the search
    [1.0, 9.0, NAN, NAN],        # trailing NaNs change nothing
    [NAN, 2.0, NAN, -1.0],
    [3.0, NAN, NAN, 3.0],
    [INF, 1.0, INF, NAN],
]


def test_argmax_special_values_follow_ggml_loop():
    rows = np.array(SPECIAL_ROWS, dtype=np.float32)
    node = run_both(lambda: _argmax_node(rows))
    np.testing.assert_array_equal(node.dst.array()[0, 0, 0], [_ggml_argmax_loop(r) for r in rows])


@pytest.mark.parametrize("n_rows,n_cols,stride", [(9, 37, 4), (1, 49152, 4), (6, 5, 12), (0, 7, 4), (3, 1, 4)])
def test_argmax_forward_matches_reference_and_loop(n_rows, n_cols, stride):
    rng = np.random.default_rng(n_cols)
    rows = rng.integers(-4, 4, (n_rows, n_cols)).astype(np.float32)  # small integers: many ties
    if rows.size:
        rows.flat[rng.integers(0, rows.size, max(1, rows.size // 50))] = np.nan
    node = run_both(lambda: _argmax_node(rows, stride))
    got = node.dst.array()[0, 0, 0]
    np.testing.assert_array_equal(got, [_ggml_argmax_loop(r) for r in rows])
    if stride != 4 and n_rows:  # the bytes between results are not ours to write
        gaps = node.dst.mem[: n_rows * stride].reshape(n_rows, stride)[:, 4:]
        assert (gaps == 0x5A).all()


def test_argmax_without_nan_or_ties_is_numpy_argmax():
    rows = np.random.default_rng(5).standard_normal((7, 300)).astype(np.float32)
    node = run_both(lambda: _argmax_node(rows))
    np.testing.assert_array_equal(node.dst.array()[0, 0, 0], rows.argmax(axis=1))


def test_argmax_of_empty_rows_is_zero():
    node = run_both(lambda: _argmax_node(np.zeros((3, 0), np.float32)))
    np.testing.assert_array_equal(node.dst.array()[0, 0, 0], [0, 0, 0])


def test_argmax_check_refusals():
    def node(src_ne=(10, 4, 1, 1), dst_ne=(4, 1, 1, 1), ts=T.F32, td=T.I32):
        return Node(GGMLOp.ARGMAX, Tensor.new(td, dst_ne), (Tensor.new(ts, src_ne),))

    lookup(node()).check(node())
    refuses(node(ts=T.F16), "F32")
    refuses(node(src_ne=(10, 4, 2, 1), dst_ne=(4, 1, 1, 1)), "matrix")
    refuses(node(src_ne=(10, 4, 1, 3), dst_ne=(4, 1, 1, 1)), "matrix")
    refuses(node(td=T.F32), "dst must be I32")
    refuses(node(dst_ne=(5, 1, 1, 1)), "dst must be I32")
    refuses(node(dst_ne=(4, 2, 1, 1)), "dst must be I32")
    refuses(Node(GGMLOp.ARGMAX, Tensor.new(T.I32, (4,)), ()), "sources")
    square = Tensor.new(T.F32, (4, 4))
    refuses(Node(GGMLOp.ARGMAX, Tensor.new(T.I32, (4,)), (permuted(square, (1, 0, 2, 3)),)), "contiguous")


# --- bit-exactness against ggml-cpu itself --------------------------------------------------------

def _ggml_source(g, type_, ne, seed):
    """A random ggml tensor of type_; half floats are converted from float32 by ggml itself."""
    n = int(np.prod(ne))
    if type_ in (T.I32, T.I16):
        return g.new(type_, ne, random_data(type_, n, np.random.default_rng(seed)))
    values = (np.random.default_rng(seed).standard_normal(n) * 100).astype(np.float32)
    values[:3] = [np.nan, np.inf, -0.0]
    if type_ == T.F32:
        return g.new(type_, ne, values)
    t = g.op("ggml_cast", g.new(T.F32, ne, values), int(type_))
    g.compute(t)
    return t


@needs_ggml
@pytest.mark.parametrize("dim", [0, 1, 2, 3])
@pytest.mark.parametrize("type_", [T.F32, T.F16, T.BF16, T.I32], ids=lambda t: t.name)
def test_concat_bit_exact_with_ggml(type_, dim):
    def build(g):
        ne = [6, 5, 4, 3]
        a_ne, b_ne = list(ne), list(ne)
        b_ne[dim] = 2
        a = _ggml_source(g, type_, a_ne, 1)
        # b is a permuted view: stored with dims 0 and 1 swapped, read back as b_ne
        b_store = [b_ne[1], b_ne[0], b_ne[2], b_ne[3]]
        b = g.op("ggml_permute", _ggml_source(g, type_, b_store, 2), 1, 0, 2, 3)
        return g.op("ggml_concat", a, b, dim)

    ggml_oracle.assert_matches_ggml(build)


@needs_ggml
@pytest.mark.parametrize("type_", [T.F32, T.F16, T.BF16, T.I32, T.I16], ids=lambda t: t.name)
@pytest.mark.parametrize("src_ne,dst_ne", [((7, 1, 3, 1), (14, 4, 3, 2)), ((5, 2, 1, 2), (5, 6, 3, 4))])
def test_repeat_bit_exact_with_ggml(type_, src_ne, dst_ne):
    def build(g):
        src = _ggml_source(g, type_, src_ne, 3)
        return g.op("ggml_repeat_4d", src, *dst_ne)

    ggml_oracle.assert_matches_ggml(build)


@needs_ggml
def test_repeat_of_plane_permuted_source_bit_exact_with_ggml():
    def build(g):
        src = g.op("ggml_permute", _ggml_source(g, T.F32, (6, 4, 3), 4), 0, 2, 1, 3)
        return g.op("ggml_repeat_4d", src, 12, 3, 8, 2)

    ggml_oracle.assert_matches_ggml(build)


@needs_ggml
@pytest.mark.parametrize("n_cols", [1, 37, 4096])
def test_argmax_bit_exact_with_ggml(n_cols):
    rng = np.random.default_rng(n_cols)
    rows = rng.integers(-3, 3, (len(SPECIAL_ROWS) + 6, n_cols)).astype(np.float32)
    rows.flat[rng.integers(0, rows.size, max(1, rows.size // 40))] = np.nan
    if n_cols >= 4:
        rows[: len(SPECIAL_ROWS), :4] = SPECIAL_ROWS
        rows[: len(SPECIAL_ROWS), 4:] = -np.inf

    def build(g):
        return g.op("ggml_argmax", g.new(T.F32, (n_cols, rows.shape[0]), rows))

    ggml_oracle.assert_matches_ggml(build)
