"""Handlers under hypothesis: any request either succeeds or raises ProtocolError, and no write
ever lands outside the tensor the request names."""

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wire import framing, protocol as p
from rpcserver.memory import MemoryBudget
from wire.protocol import Command, ProtocolError
from rpcserver.session import Session, WorkerConfig

BUF = 4096

u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
small = st.integers(0, 70)


def span(t: p.RpcTensor) -> int:
    """Bytes a tensor spans, from protocol_spec.md §3 and gguf-py's block table (not the worker's code)."""
    if any(n == 0 for n in t.ne):
        return 0
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(t.type)]
    first = type_size if block == 1 else t.ne[0] * t.nb[0] // block
    return first + sum((t.ne[i] - 1) * t.nb[i] for i in range(1 if block > 1 else 0, 4))


def session_with_buffer():
    s = Session(WorkerConfig(MemoryBudget(1 << 20)))
    handle = p.AllocBufferResponse.decode(s.handle(Command.ALLOC_BUFFER, p.AllocBufferRequest(0, BUF))).remote_ptr
    base = p.U64Response.decode(s.handle(Command.BUFFER_GET_BASE, p.BufferRequest(handle))).value
    return s, s.buffers.get(handle), base


@st.composite
def tensors(draw, handle, base):
    return p.RpcTensor(
        id=draw(u64), type=draw(st.one_of(st.sampled_from([0, 1, 3, 8, 26, 27]), u32)),
        buffer=draw(st.sampled_from([handle, 0, handle + 1, draw(u64)])),
        ne=tuple(draw(st.one_of(small, u32)) for _ in range(4)),
        nb=tuple(draw(st.one_of(st.integers(0, 300), u32)) for _ in range(4)),
        data=draw(st.one_of(st.integers(base - 64, base + BUF + 64), u64)),
    )


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), command=st.sampled_from([Command.SET_TENSOR, Command.GET_TENSOR, Command.MEMSET_TENSOR,
                                                 Command.COPY_TENSOR, Command.INIT_TENSOR, Command.GET_ALLOC_SIZE,
                                                 Command.PEER_WRITE]))
def test_tensor_handlers_never_touch_memory_outside_the_named_tensor(data, command):
    s, buf, base = session_with_buffer()
    buf.mem[:] = 0xAA
    t = data.draw(tensors(buf.handle, base))
    offset = data.draw(st.one_of(st.integers(0, 128), u64))
    size = data.draw(st.one_of(st.integers(0, 128), u64))
    if command == Command.SET_TENSOR:
        req = p.SetTensorRequest(t, 0, offset, memoryview(bytes(data.draw(st.integers(0, 200)))))
    elif command == Command.GET_TENSOR:
        req = p.GetTensorRequest(t, offset, size)
    elif command == Command.MEMSET_TENSOR:
        req = p.MemsetTensorRequest(t, offset, size, 0)
    elif command == Command.COPY_TENSOR:
        req = p.CopyTensorRequest(data.draw(tensors(buf.handle, base)), t)
    elif command == Command.INIT_TENSOR:
        req = p.TensorRequest(t)
    elif command == Command.PEER_WRITE:  # with the session's own token: only the range can be wrong
        token = p.PeerTokenResponse.decode(s.handle(Command.PEER_TOKEN, p.Empty())).token
        req = p.PeerWriteRequest(token, 1, t, offset, memoryview(bytes(data.draw(st.integers(0, 200)))))
    else:
        req = p.GetAllocSizeRequest(0, t, ())
    try:
        s.handle(command, p.decode_request(command, memoryview(req.encode())))
    except ProtocolError:
        assert (buf.mem == 0xAA).all(), "a refused request must not have written anything"
        return
    written = np.flatnonzero(buf.mem != 0xAA)
    if written.size:  # every written byte lies inside the tensor's own span
        start = t.data - base
        assert start <= written[0] and written[-1] < start + span(t)


@settings(max_examples=200, deadline=None)
@given(payload=st.binary(max_size=3000), command=st.sampled_from(list(Command)))
def test_random_payloads_are_handled_or_refused(payload, command):
    s, _, _ = session_with_buffer()
    try:
        s.handle(command, p.decode_request(command, memoryview(payload)))
    except ProtocolError:
        pass


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_set_tensor_received_in_place_never_touches_memory_outside_the_named_tensor(data):
    # the worker's path: the FrameReader asks the session where the data goes before receiving it
    s, buf, base = session_with_buffer()
    buf.mem[:] = 0xAA
    t = data.draw(tensors(buf.handle, base))
    offset = data.draw(st.one_of(st.integers(0, 128), u64))
    payload = bytes(b for b in range(1, 256) if b != 0xAA)[: data.draw(st.integers(0, 200))]  # all marked
    reader = framing.FrameReader(lambda command: 1 << 20, first_command=None, place=s.place_set_tensor)
    try:
        reader.feed(p.encode_request(Command.SET_TENSOR, p.SetTensorRequest(t, 0, offset, memoryview(payload))))
        frame = reader.next_frame()
        s.handle(Command.SET_TENSOR, framing.decode_frame(frame))
    except ProtocolError:
        assert (buf.mem == 0xAA).all(), "a refused request must not have written anything"
        return
    assert frame.placed is not None
    written = np.flatnonzero(buf.mem != 0xAA)
    assert written.size == len(payload)
    if written.size:  # every written byte lies inside the tensor's own span, where the client said
        start = t.data - base
        assert written[0] == start + offset and written[-1] < start + span(t)
        assert bytes(buf.mem[written]) == payload
