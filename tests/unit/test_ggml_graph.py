"""The orchestrator's graph API: ggml's shape rules, and a serialization the shared codec decodes back."""

import numpy as np
import pytest

from orchestrator.graph.ggml import Graph, RemoteBuffer, new_tensor
from wire import protocol as p
from wire.ggml import FLAG_COMPUTE, GGMLOp, GGMLType


def small_graph():
    g = Graph()
    buf = RemoteBuffer(handle=0x55, base=0x10000, size=1 << 20)
    w = new_tensor(GGMLType.Q8_0, (64, 16), "w")
    x = new_tensor(GGMLType.F32, (64, 3), "x")
    cache = new_tensor(GGMLType.F16, (16, 32), "cache")
    idx = new_tensor(GGMLType.I64, (3,), "idx")
    for offset, t in enumerate((w, x, cache, idx)):
        t.place(buf, offset * 4096)
    y = g.mul_mat(w, x, "y")
    r = g.reshape(y, 4, 4, 3)
    v = g.view(r, (4, 2, 3), (r.nb[1], r.nb[2]), r.nb[1])
    perm = g.permute(v, 0, 2, 1, 3)
    rows = g.set_rows(cache, g.reshape(g.cont(y), 16, 3), idx)
    return g, buf, (w, x, cache, idx, y, r, v, perm, rows)


def test_shapes_follow_ggml():
    g, _, (w, x, cache, idx, y, r, v, perm, rows) = small_graph()
    assert y.ne == (16, 3, 1, 1) and y.type == GGMLType.F32
    assert r.ne == (4, 4, 3, 1) and r.nb == (4, 16, 64, 192)
    assert v.view_src is y and v.view_offs == 16 and v.nb[:3] == (4, 16, 64)
    assert perm.ne == (4, 3, 2, 1) and perm.nb == (4, 64, 16, 192) and perm.view_src is y
    assert rows.op == GGMLOp.SET_ROWS and rows.view_src is cache and rows.src[2] is cache
    assert [n.op for n in g.nodes] == [GGMLOp.MUL_MAT, GGMLOp.CONT, GGMLOp.SET_ROWS]
    with pytest.raises(ValueError):
        g.mul_mat(w, new_tensor(GGMLType.F32, (32, 3)))
    with pytest.raises(ValueError):
        g.reshape(perm, 24)  # not contiguous


def test_serialization_decodes_to_the_same_tensors():
    g, buf, tensors = small_graph()
    g.cont(tensors[-2])  # a node reading a permuted view: the view must travel with it
    plan_base = 0x80000
    for i, n in enumerate(g.nodes):
        if n.view_src is None:
            n.place(buf, plan_base + i * 1024)
    node_ids, records = g.serialize()
    request = p.GraphComputeRequest.decode(memoryview(p.GraphComputeRequest(0, node_ids, records).encode()))
    decoded = {int(r["id"]): p.RpcTensor.from_record(r) for r in request.tensors}
    by_name = {}
    for t in g.tensors():
        by_name.setdefault(t.name, []).append(t)
    assert len(decoded) == len(g.tensors())
    for rec in decoded.values():
        t = next(t for t in by_name[rec.name] if t.ne == rec.ne and t.nb == rec.nb and int(t.op) == rec.op)
        assert rec.type == t.type and rec.buffer == buf.handle and rec.data == t.address
        assert rec.flags & FLAG_COMPUTE == (FLAG_COMPUTE if t.op != GGMLOp.NONE else 0)
        assert [decoded[s].name for s in rec.src if s] == [s.name for s in t.src]
        if t.view_src is not None:
            assert decoded[rec.view_src].name == t.view_src.name and rec.view_offs == t.view_offs
            assert rec.data == decoded[rec.view_src].data + rec.view_offs
        assert rec.op_params.rstrip(b"\0") == t.op_params.rstrip(b"\0")
    assert [decoded[int(i)].op for i in request.nodes] == [int(n.op) for n in g.nodes]
    assert np.array_equal(node_ids, request.nodes)
