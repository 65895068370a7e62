"""Our worker over real TCP: memory lifecycle, isolation between clients, and compute correctness."""

import socket
import struct
import time

import numpy as np
import pytest

from orchestrator.pipeline.client import RpcClient, WorkerError
from wire import protocol as p
from wire.ggml import GGMLOp, GGMLType
from wire.protocol import Command

from .conftest import GraphBuilder

MiB = 1 << 20


def test_handshake_and_device_queries(connect):
    c = connect()
    assert c.version == p.PROTOCOL_VERSION
    assert p.DeviceCountResponse.decode(c.call(Command.DEVICE_COUNT)).device_count == 1
    assert c.alignment() == 32
    free, total = c.device_memory()
    assert total == 256 * MiB and 0 < free <= total


def test_buffers_are_accounted_and_freed_when_the_client_disconnects(connect):
    observer = connect()
    free0, _ = observer.device_memory()
    c = connect()
    c.alloc_buffer(10 * MiB)
    handle, _ = c.alloc_buffer(6 * MiB)
    assert observer.device_memory()[0] == free0 - 16 * MiB
    c.free_buffer(handle)
    assert c.device_memory()[0] == free0 - 10 * MiB
    c.close()
    deadline = time.monotonic() + 30
    while observer.device_memory()[0] != free0:
        assert time.monotonic() < deadline, "buffers of a closed connection were not freed"
        time.sleep(0.05)


def test_alloc_beyond_the_budget_answers_a_null_buffer_and_keeps_the_connection(connect):
    c = connect()
    r = p.AllocBufferResponse.decode(c.call(Command.ALLOC_BUFFER, p.AllocBufferRequest(0, 10**12)))
    assert (r.remote_ptr, r.remote_size) == (0, 0)
    assert c.device_memory()[1] == 256 * MiB  # still usable


def test_set_get_copy_memset_clear_round_trip(connect):
    c = connect()
    g = GraphBuilder(c)
    data = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    a = g.tensor(GGMLType.F32, (1000,), data=data)
    b = g.tensor(GGMLType.F32, (1000,))
    assert np.array_equal(g.read(a, np.float32), data)
    assert p.U8Response.decode(c.call(Command.COPY_TENSOR, p.CopyTensorRequest(a, b))).result == 1
    assert np.array_equal(g.read(b, np.float32), data)
    c.send(Command.MEMSET_TENSOR, p.MemsetTensorRequest(b, 8, 16, 0))
    expect = data.copy()
    expect[2:6] = 0
    assert np.array_equal(g.read(b, np.float32), expect)
    assert c.get_tensor(a, 8, offset=4) == data[1:3].tobytes()
    c.send(Command.BUFFER_CLEAR, p.BufferClearRequest(g.handle, 0))
    assert not g.read(a, np.uint8).any()


def test_buffer_clear_to_any_value_then_to_zero_then_written_again(connect):
    # clearing to 0 drops the buffer's pages rather than writing them: reads must still see zeros,
    # and the memory must stay usable at the same addresses
    c = connect()
    g = GraphBuilder(c, size=3 * MiB + 123)
    a = g.tensor(GGMLType.F32, (3 * MiB // 4,))
    c.buffer_clear(g.handle, 0xAB)
    assert (g.read(a, np.uint8) == 0xAB).all()
    c.buffer_clear(g.handle, 0)
    assert not g.read(a, np.uint8).any()
    data = np.arange(3 * MiB // 4, dtype=np.float32)
    c.set_tensor(a, data.tobytes())
    assert np.array_equal(g.read(a, np.float32), data)


def test_graph_compute_and_recompute_follow_new_inputs(connect):
    c = connect()
    g = GraphBuilder(c)
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((2, 3, 7)).astype(np.float32)
    a = g.tensor(GGMLType.F32, (7, 3), data=x)
    b = g.tensor(GGMLType.F32, (7, 3), data=y)
    s = g.tensor(GGMLType.F32, (7, 3), op=GGMLOp.ADD, src=(a, b))
    m = g.tensor(GGMLType.F32, (7, 3), op=GGMLOp.MUL, src=(s, a))
    g.compute(s, m)
    assert np.array_equal(g.read(m, np.float32).reshape(3, 7), (x + y) * x)
    x2 = rng.standard_normal((3, 7)).astype(np.float32)
    c.set_tensor(a, x2.tobytes())
    c.graph_recompute()
    assert np.array_equal(g.read(m, np.float32).reshape(3, 7), (x2 + y) * x2)


def test_set_tensor_sent_right_behind_a_graph_does_not_reach_the_running_graph(connect):
    # SET_TENSOR data may be received straight into its buffer, but only once every earlier
    # request is done with: the graph must compute on the input as it was when it was sent
    c = connect()
    g = GraphBuilder(c, size=8 * MiB)
    n = 1 << 18
    old = np.arange(n, dtype=np.float32) % 97
    new = np.full(n, -1.0, dtype=np.float32)
    a = g.tensor(GGMLType.F32, (n,), data=old)
    node = a
    for _ in range(6):  # a chain long enough that the SET_TENSOR arrives while it runs
        node = g.tensor(GGMLType.F32, (n,), op=GGMLOp.ADD, src=(node, a))
    records = np.concatenate([t.to_record() for t in g.tensors.values()])
    nodes = np.array([t.id for t in g.tensors.values() if t.op], dtype="<u8")
    c.sock.sendall(p.encode_request(Command.GRAPH_COMPUTE, p.GraphComputeRequest(0, nodes, records))
                   + p.encode_request(Command.SET_TENSOR, p.SetTensorRequest(a, 0, 0, memoryview(new.tobytes()))))
    assert np.array_equal(g.read(node, np.float32), 7 * old)
    assert np.array_equal(g.read(a, np.float32), new)
    c.graph_recompute()
    assert np.array_equal(g.read(node, np.float32), 7 * new)


def test_set_tensors_back_to_back_land_in_order_at_their_offsets(connect):
    c = connect()
    g = GraphBuilder(c, size=4 * MiB)
    a = g.tensor(GGMLType.F32, (1 << 18,))
    rng = np.random.default_rng(3)
    chunks = [rng.standard_normal(1 << 16).astype(np.float32) for _ in range(4)]
    stream = b"".join(p.encode_request(Command.SET_TENSOR, p.SetTensorRequest(a, 0, i * (1 << 18), memoryview(x.tobytes())))
                      for i, x in enumerate(chunks))
    overwrite = np.zeros(8, dtype=np.float32)  # the last write to the same bytes wins
    stream += p.encode_request(Command.SET_TENSOR, p.SetTensorRequest(a, 0, 4, memoryview(overwrite.tobytes())))
    c.sock.sendall(stream)
    expect = np.concatenate(chunks)
    expect[1:9] = 0
    assert np.array_equal(g.read(a, np.float32), expect)


def test_two_clients_at_once_get_their_own_results(connect):
    c1, c2 = connect(), connect()
    g1, g2 = GraphBuilder(c1), GraphBuilder(c2)
    v1 = np.arange(64, dtype=np.float32)
    v2 = -np.arange(64, dtype=np.float32)
    a1 = g1.tensor(GGMLType.F32, (64,), data=v1)
    a2 = g2.tensor(GGMLType.F32, (64,), data=v2)
    s1 = g1.tensor(GGMLType.F32, (64,), op=GGMLOp.ADD, src=(a1, a1))
    s2 = g2.tensor(GGMLType.F32, (64,), op=GGMLOp.ADD, src=(a2, a2))
    g1.compute(s1)
    g2.compute(s2)
    assert np.array_equal(g2.read(s2, np.float32), 2 * v2)
    assert np.array_equal(g1.read(s1, np.float32), 2 * v1)


def test_a_client_stalled_mid_message_does_not_delay_another(worker, connect):
    staller = connect()
    g = GraphBuilder(staller)
    t = g.tensor(GGMLType.F32, (256,))
    header = p.encode_request(Command.SET_TENSOR, p.SetTensorRequest(t, 0, 0, memoryview(bytes(1024))))
    staller.sock.sendall(header[:400])  # header and part of the data, then silence
    other = connect()
    other.sock.settimeout(10)  # a stall would surface as a timeout here
    for _ in range(20):
        other.device_memory()
    staller.sock.sendall(header[400:])
    assert g.read(t, np.uint8).size == 1024


def test_extension_probe_answers_with_our_magic(connect):
    c = connect()
    r = p.ExtHelloResponse.decode(c.call(Command.EXT_HELLO))
    assert r.magic == p.EXT_MAGIC


def test_nodes_without_the_compute_flag_are_skipped_as_by_ggml(connect, tmp_path):
    """llama.cpp sends the branches ggml_build_forward_select did not pick unflagged; ggml-cpu skips them.
    The same graph on llama.cpp's own worker is the oracle."""
    from tools import reference

    def run(client):
        g = GraphBuilder(client)
        x = np.arange(16, dtype=np.float32)
        a = g.tensor(GGMLType.F32, (16,), data=x)
        skipped = g.tensor(GGMLType.F32, (16,), op=GGMLOp.ADD, src=(a, a), data=np.full(16, 7, np.float32))
        skipped.flags = 0  # as llama.cpp sends an unselected branch
        ran = g.tensor(GGMLType.F32, (16,), op=GGMLOp.MUL, src=(a, a))
        g.compute(skipped, ran)
        return g.read(skipped, np.float32), g.read(ran, np.float32)

    ours = run(connect())
    with reference.start_worker("reference", tmp_path) as ref_worker:
        with RpcClient(ref_worker.address) as ref_client:
            theirs = run(ref_client)
    assert np.array_equal(theirs[0], np.full(16, 7, np.float32)), "the oracle computed an unflagged node"
    for o, t in zip(ours, theirs):
        assert np.array_equal(o, t)
