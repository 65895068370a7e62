"""Handlers under hypothesis: any request either succeeds or raises ProtocolError, and no write
ever lands outside the tensor the request names.

Random search runs locally; CI runs the same tests derandomized (tests/conftest.py) and the edges found
or foreseen are pinned as @examples: sizes at 2^32, 2^63 and 2^64, addresses and offsets at 2^64 - 1.
tools/fuzz.py runs these tests with many more examples and a fresh seed."""

import numpy as np
from gguf import GGML_QUANT_SIZES
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fuzzing import at_least
from wire import framing, protocol as p
from rpcserver.memory import MemoryBudget
from wire.protocol import Command, ProtocolError
from rpcserver.session import Session, WorkerConfig

BUF = 4096
HANDLE, BASE = 1, 0x1000_0000  # the handle and address a fresh worker gives its first buffer (checked below)
U32, U64 = 2**32 - 1, 2**64 - 1

u32 = st.integers(0, U32)
u64 = st.integers(0, U64)
small = st.integers(0, 70)

# (block size, bytes per block) by ggml type number: gguf-py's table, with the two entries it lacks or
# has in an older layout taken from llama.cpp's ggml-common.h (block_q8_1: two halves and 32 quants;
# block_q2_0: one half and 64 2-bit quants)
BLOCKS = {int(t): v for t, v in GGML_QUANT_SIZES.items()} | {9: (32, 36), 42: (64, 18)}


def span(t: p.RpcTensor) -> int:
    """Bytes a tensor spans, from protocol_spec.md §3 and the block table above (not the worker's code)."""
    if any(n == 0 for n in t.ne):
        return 0
    block, type_size = BLOCKS[t.type]
    first = type_size if block == 1 else t.ne[0] * t.nb[0] // block
    return first + sum((t.ne[i] - 1) * t.nb[i] for i in range(1 if block > 1 else 0, 4))


def session_with_buffer():
    s = Session(WorkerConfig(MemoryBudget(1 << 20)))
    handle = p.AllocBufferResponse.decode(s.handle(Command.ALLOC_BUFFER, p.AllocBufferRequest(0, BUF))).remote_ptr
    base = p.U64Response.decode(s.handle(Command.BUFFER_GET_BASE, p.BufferRequest(handle))).value
    assert (handle, base) == (HANDLE, BASE)
    return s, s.buffers.get(handle), base


def tensors():
    return st.builds(
        p.RpcTensor, id=u64, type=st.one_of(st.sampled_from([0, 1, 3, 8, 24, 26, 27]), u32),
        buffer=st.one_of(st.sampled_from([HANDLE, 0, HANDLE + 1]), u64),
        ne=st.tuples(*[st.one_of(small, u32)] * 4),
        nb=st.tuples(*[st.one_of(st.integers(0, 300), u32)] * 4),
        data=st.one_of(st.integers(BASE - 64, BASE + BUF + 64), u64),
    )


TENSOR_COMMANDS = [Command.SET_TENSOR, Command.GET_TENSOR, Command.MEMSET_TENSOR, Command.COPY_TENSOR,
                   Command.INIT_TENSOR, Command.GET_ALLOC_SIZE, Command.PEER_WRITE]
F32, I8, I16, Q4_0 = 0, 24, 25, 2


def edge(ne, nb, type_=F32, commands=TENSOR_COMMANDS, data=BASE, offset=0, size=16, n_data=16):
    """@examples of one tensor under each command (the decorators of all of them, composed)."""
    t = p.RpcTensor(id=7, type=type_, buffer=HANDLE, ne=ne, nb=nb, data=data)
    src = p.RpcTensor(id=8, type=F32, buffer=HANDLE, ne=(4, 1, 1, 1), nb=(4, 16, 16, 16), data=BASE)

    def decorate(test):
        for command in commands:
            test = example(command=command, t=t, src=src, offset=offset, size=size, n_data=n_data)(test)
        return test
    return decorate


@settings(max_examples=at_least(400), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(command=st.sampled_from(TENSOR_COMMANDS), t=tensors(), src=tensors(),
       offset=st.one_of(st.integers(0, 128), u64), size=st.one_of(st.integers(0, 128), u64),
       n_data=st.integers(0, 200))
# sizes past 2^64: what CI found (GET_ALLOC_SIZE's reply could not be packed), with a block type too
@edge(ne=(1, 1, U32, 29), nb=(0, 301, U32, 536270968))
@edge(ne=(U32 - 31, U32, U32, U32), nb=(U32,) * 4, type_=Q4_0)
# 2^64 - 1 exactly (I8: one byte per element), and 2^64 with the same strides (I16)
@edge(ne=(1, 3, U32, 2), nb=(0, U32, U32, U32 - 1), type_=I8)
@edge(ne=(1, 3, U32, 2), nb=(0, U32, U32, U32 - 1), type_=I16)
# either side of 2^63 (where a signed 64-bit size turns negative)
@edge(ne=(1, 1, U32, 1), nb=(0, 0, 2**31 + 1, 0), type_=I8)
@edge(ne=(1, 1, U32, 1), nb=(0, 0, 2**31 + 1, 0))
# 2^32 elements' worth of bytes; strides of 2^32 - 1; an empty tensor with the largest strides
@edge(ne=(U32, 1, 1, 1), nb=(4, U32, U32, U32))
@edge(ne=(2, 2, 2, 2), nb=(U32,) * 4)
@edge(ne=(0, U32, U32, U32), nb=(U32,) * 4)
# addresses and ranges at the top of the 64-bit space
@edge(ne=(4, 1, 1, 1), nb=(4, 16, 16, 16), data=U64)
@edge(ne=(4, 1, 1, 1), nb=(4, 16, 16, 16), data=U64 - 15)
@edge(ne=(4, 1, 1, 1), nb=(4, 16, 16, 16), offset=U64, size=U64)
@edge(ne=(4, 1, 1, 1), nb=(4, 16, 16, 16), offset=U64 - 7, size=16)
@edge(ne=(4, 1, 1, 1), nb=(4, 16, 16, 16), offset=8, size=U64 - 7)
def test_tensor_handlers_never_touch_memory_outside_the_named_tensor(command, t, src, offset, size, n_data):
    s, buf, base = session_with_buffer()
    buf.mem[:] = 0xAA
    if command == Command.SET_TENSOR:
        req = p.SetTensorRequest(t, 0, offset, memoryview(bytes(n_data)))
    elif command == Command.GET_TENSOR:
        req = p.GetTensorRequest(t, offset, size)
    elif command == Command.MEMSET_TENSOR:
        req = p.MemsetTensorRequest(t, offset, size, 0)
    elif command == Command.COPY_TENSOR:
        req = p.CopyTensorRequest(src, t)
    elif command == Command.INIT_TENSOR:
        req = p.TensorRequest(t)
    elif command == Command.PEER_WRITE:  # with the session's own token: only the range can be wrong
        token = p.PeerTokenResponse.decode(s.handle(Command.PEER_TOKEN, p.Empty())).token
        req = p.PeerWriteRequest(token, 1, t, offset, memoryview(bytes(n_data)))
    else:
        req = p.GetAllocSizeRequest(0, t, ())
    try:
        reply = s.handle(command, p.decode_request(command, memoryview(req.encode())))
    except ProtocolError:
        assert (buf.mem == 0xAA).all(), "a refused request must not have written anything"
        if command == Command.GET_ALLOC_SIZE:  # refused only for a dead type or a size no u64 holds
            assert t.type not in BLOCKS or span(t) > U64
        return
    if command == Command.GET_ALLOC_SIZE:  # the exact ggml_nbytes, where llama.cpp's wraps modulo 2^64
        assert p.U64Response.decode(reply).value == span(t)
    written = np.flatnonzero(buf.mem != 0xAA)
    if written.size:  # every written byte lies inside the tensor's own span
        start = t.data - base
        assert start <= written[0] and written[-1] < start + span(t)


@settings(max_examples=at_least(200), deadline=None)
@given(payload=st.binary(max_size=3000), command=st.sampled_from(list(Command)))
def test_random_payloads_are_handled_or_refused(payload, command):
    s, _, _ = session_with_buffer()
    try:
        s.handle(command, p.decode_request(command, memoryview(payload)))
    except ProtocolError:
        pass


@settings(max_examples=at_least(400), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(t=tensors(), offset=st.one_of(st.integers(0, 128), u64), n_data=st.integers(0, 200))
@example(t=p.RpcTensor(type=F32, buffer=HANDLE, ne=(1, 1, U32, 29), nb=(0, 301, U32, 536270968), data=BASE),
         offset=0, n_data=16)
@example(t=p.RpcTensor(type=F32, buffer=HANDLE, ne=(4, 1, 1, 1), nb=(4, 16, 16, 16), data=BASE), offset=U64 - 7,
         n_data=16)
@example(t=p.RpcTensor(type=F32, buffer=HANDLE, ne=(4, 1, 1, 1), nb=(4, 16, 16, 16), data=U64 - 15), offset=0,
         n_data=16)
def test_set_tensor_received_in_place_never_touches_memory_outside_the_named_tensor(t, offset, n_data):
    # the worker's path: the FrameReader asks the session where the data goes before receiving it
    s, buf, base = session_with_buffer()
    buf.mem[:] = 0xAA
    payload = bytes(b for b in range(1, 256) if b != 0xAA)[:n_data]  # all marked
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


def test_buffer_addresses_stay_below_2_64():
    """BUFFER_GET_BASE packs an address the worker chose as it allocated: an ALLOC_BUFFER whose address
    range would pass 2^64 answers 0,0 as one that does not fit, and the worker goes on."""
    s = Session(WorkerConfig(MemoryBudget(1 << 20)))
    s.config.budget._next_address = 2**64 - 3 * 4096  # as after ~2^64 bytes allocated and freed
    first = p.AllocBufferResponse.decode(s.handle(Command.ALLOC_BUFFER, p.AllocBufferRequest(0, 4096)))
    base = p.U64Response.decode(s.handle(Command.BUFFER_GET_BASE, p.BufferRequest(first.remote_ptr))).value
    assert first.remote_size == 4096 and base + 4096 <= 2**64
    refused = p.AllocBufferResponse.decode(s.handle(Command.ALLOC_BUFFER, p.AllocBufferRequest(0, 4096)))
    assert (refused.remote_ptr, refused.remote_size) == (0, 0)
    assert p.DeviceCountResponse.decode(s.handle(Command.DEVICE_COUNT, p.Empty())).device_count == 1
