"""The sans-IO codec: every decoder whole, byte at a time and with trailing bytes; fuzzed."""

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fuzzing import at_least
from wire import framing, protocol as p
from wire.framing import FrameReader
from wire.protocol import Command, ProtocolError

LIMIT = 1 << 20


def reader(first=Command.HELLO):
    return FrameReader(lambda command: LIMIT, first_command=first)


def sample_tensor(**kw):
    base = dict(id=0xDEAD, type=1, buffer=7, ne=(64, 9, 2, 1), nb=(2, 128, 1152, 2304), op=41,
                op_params=struct.pack("<4i", 1, -2, 3, 4).ljust(64, b"\0"), flags=3,
                src=tuple(range(1, 11)), view_src=5, view_offs=256, data=0x10001000,
                name="Kcur-0 (view)", use_count=2)
    base.update(kw)
    return p.RpcTensor(**base)


SAMPLES = {
    Command.HELLO: p.HelloRequest(bytes(range(24))),
    Command.DEVICE_COUNT: p.Empty(),
    Command.ALLOC_BUFFER: p.AllocBufferRequest(0, 123456789),
    Command.GET_ALIGNMENT: p.DeviceRequest(0),
    Command.GET_MAX_SIZE: p.DeviceRequest(0),
    Command.BUFFER_GET_BASE: p.BufferRequest(42),
    Command.FREE_BUFFER: p.BufferRequest(42),
    Command.BUFFER_CLEAR: p.BufferClearRequest(42, 0xAB),
    Command.SET_TENSOR: p.SetTensorRequest(sample_tensor(), 1, 16, memoryview(b"payload!")),
    Command.SET_TENSOR_HASH: p.SetTensorHashRequest(sample_tensor(), 8, 0x1234567890ABCDEF),
    Command.GET_TENSOR: p.GetTensorRequest(sample_tensor(), 8, 99),
    Command.COPY_TENSOR: p.CopyTensorRequest(sample_tensor(), sample_tensor(id=1)),
    Command.GRAPH_COMPUTE: p.GraphComputeRequest(
        0, np.array([1, 2], dtype="<u8"),
        np.concatenate([sample_tensor(id=1).to_record(), sample_tensor(id=2).to_record()])),
    Command.GET_DEVICE_MEMORY: p.DeviceRequest(0),
    Command.INIT_TENSOR: p.TensorRequest(sample_tensor()),
    Command.GET_ALLOC_SIZE: p.GetAllocSizeRequest(0, sample_tensor(), (sample_tensor(id=3),)),
    Command.GRAPH_RECOMPUTE: p.DeviceRequest(0),
    Command.MEMSET_TENSOR: p.MemsetTensorRequest(sample_tensor(), 4, 12, 0x7F),
    Command.EXT_HELLO: p.Empty(),
    Command.PEER_TOKEN: p.Empty(),
    Command.SET_PEER: p.SetPeerRequest(3, bytes(range(16)), 50052, b"10.0.0.2".ljust(256, b"\0")),
    Command.PUSH_TENSOR: p.PushTensorRequest(1, 7, sample_tensor(), sample_tensor(id=1)),
    Command.PEER_WRITE: p.PeerWriteRequest(bytes(range(16)), 9, sample_tensor(), 8, memoryview(b"data")),
    Command.WAIT_PUSH: p.WaitPushRequest(9, 250),
    Command.AUTH_NONCE: p.Empty(),
    Command.AUTH_PROOF: p.AuthProofRequest(bytes(range(32))),
    Command.GGUF_FILES: p.Empty(),
    Command.LOAD_TENSOR: p.LoadTensorRequest(sample_tensor(), 16, 2, 1 << 40, 4096, 0xFEDCBA9876543210),
}


def test_peer_push_layouts_match_the_spec():
    """protocol_spec.md §8.1, field by field."""
    token = bytes(range(16))
    raw = SAMPLES[Command.SET_PEER].encode()
    assert len(raw) == 4 + 16 + 2 + 256
    assert struct.unpack_from("<I16sH", raw) == (3, token, 50052) and raw[22:30] == b"10.0.0.2"
    assert SAMPLES[Command.SET_PEER].host_name == "10.0.0.2"
    raw = SAMPLES[Command.PUSH_TENSOR].encode()
    assert len(raw) == 4 + 8 + 296 * 2 and struct.unpack_from("<IQ", raw) == (1, 7)
    assert raw[12:308] == sample_tensor().encode() and raw[308:] == sample_tensor(id=1).encode()
    raw = SAMPLES[Command.PEER_WRITE].encode()
    assert p.PeerWriteRequest.HEADER == 328 and len(raw) == 328 + 4
    assert raw[:16] == token and struct.unpack_from("<Q", raw, 16)[0] == 9
    assert raw[24:320] == sample_tensor().encode() and struct.unpack_from("<Q", raw, 320)[0] == 8
    assert raw[328:] == b"data"
    assert SAMPLES[Command.WAIT_PUSH].encode() == struct.pack("<QI", 9, 250)
    assert p.PeerTokenResponse(token).encode() == token
    assert p.COMMANDS[Command.PEER_WRITE].variable and p.COMMANDS[Command.PUSH_TENSOR].response is p.U8Response


def test_every_command_has_a_sample_and_the_table_matches_the_pinned_protocol():
    assert set(SAMPLES) == set(Command)
    assert p.TENSOR_SIZE == 296
    assert p.COMMANDS[Command.GET_ALLOC_SIZE].request_size == 4 + 296 * 11
    assert p.COMMANDS[Command.HELLO].request_size == 24 and p.HelloResponse.wire_size() == 28


def test_tensor_record_layout_matches_the_c_struct():
    rec = sample_tensor().encode()
    assert len(rec) == 296
    # packed offsets of rpc_tensor: id@0 type@8 buffer@12 ne@20 nb@36 op@52 op_params@56 flags@120
    # src@124 view_src@204 view_offs@212 data@220 name@228 use_count@292
    assert struct.unpack_from("<Q", rec, 0)[0] == 0xDEAD
    assert struct.unpack_from("<I", rec, 8)[0] == 1
    assert struct.unpack_from("<Q", rec, 12)[0] == 7
    assert struct.unpack_from("<4I", rec, 20) == (64, 9, 2, 1)
    assert struct.unpack_from("<4I", rec, 36) == (2, 128, 1152, 2304)
    assert struct.unpack_from("<I", rec, 52)[0] == 41
    assert struct.unpack_from("<2i", rec, 56) == (1, -2)
    assert struct.unpack_from("<i", rec, 120)[0] == 3
    assert struct.unpack_from("<10Q", rec, 124) == tuple(range(1, 11))
    assert struct.unpack_from("<3Q", rec, 204) == (5, 256, 0x10001000)
    assert rec[228:241] == b"Kcur-0 (view)"
    assert struct.unpack_from("<i", rec, 292)[0] == 2


@settings(max_examples=200, deadline=None)
@given(raw=st.binary(min_size=296, max_size=296))
def test_any_tensor_record_decodes_as_the_c_struct_reads_it(raw):
    t = p.RpcTensor.decode(raw)
    assert (t.id, t.type, t.buffer) == struct.unpack_from("<QIQ", raw, 0)
    assert t.ne == struct.unpack_from("<4I", raw, 20) and t.nb == struct.unpack_from("<4I", raw, 36)
    assert t.op == struct.unpack_from("<I", raw, 52)[0] and t.op_params == raw[56:120]
    assert t.flags == struct.unpack_from("<i", raw, 120)[0] and t.src == struct.unpack_from("<10Q", raw, 124)
    assert (t.view_src, t.view_offs, t.data) == struct.unpack_from("<3Q", raw, 204)
    assert t.name == raw[228:292].split(b"\0", 1)[0].decode("utf-8", "replace")
    assert t.use_count == struct.unpack_from("<i", raw, 292)[0]
    assert all(type(v) is int for v in (t.id, t.type, t.buffer, t.op, t.flags, t.data, *t.ne, *t.nb, *t.src))


def _frames(data: bytes, step: int | None):
    r = reader()
    if step is None:
        r.feed(data)
    else:
        for i in range(0, len(data), step):
            r.feed(data[i:i + step])
    out = []
    while (f := r.next_frame()) is not None:
        out.append(f)
    return r, out


@pytest.mark.parametrize("command", list(Command))
@pytest.mark.parametrize("step", [None, 1, 7])
def test_each_request_round_trips_whole_and_in_pieces(command, step):
    msg = SAMPLES[command]
    data = p.encode_request(Command.HELLO, SAMPLES[Command.HELLO]) + p.encode_request(command, msg)
    r, frames = _frames(data, step)
    assert [f.command for f in frames] == [Command.HELLO, command]
    assert r.idle
    decoded = p.decode_request(command, frames[1].payload)
    assert decoded.encode() == msg.encode()


@pytest.mark.parametrize("command", [c for c in Command if p.COMMANDS[c].request_size])
def test_fixed_size_request_with_trailing_bytes_is_refused(command):
    payload = SAMPLES[command].encode() + b"\0"
    data = p.encode_request(Command.HELLO, SAMPLES[Command.HELLO]) + struct.pack("<BQ", command, len(payload)) + payload
    with pytest.raises(ProtocolError, match=command.name):
        _frames(data, None)


def test_trailing_bytes_after_a_frame_wait_for_the_next_frame():
    data = p.encode_request(Command.HELLO, SAMPLES[Command.HELLO]) + b"\x0f\x00"
    r, frames = _frames(data, None)
    assert len(frames) == 1 and not r.idle


def test_graph_payload_with_trailing_bytes_is_refused():
    payload = SAMPLES[Command.GRAPH_COMPUTE].encode() + b"\0\0\0\0"
    with pytest.raises(ProtocolError, match="GRAPH_COMPUTE"):
        p.decode_request(Command.GRAPH_COMPUTE, memoryview(payload))


def test_first_command_must_be_hello():
    with pytest.raises(ProtocolError, match="first command must be HELLO"):
        _frames(p.encode_request(Command.DEVICE_COUNT, p.Empty()), None)


def test_unknown_command_is_refused():
    data = p.encode_request(Command.HELLO, SAMPLES[Command.HELLO]) + struct.pack("<BQ", 18, 0)
    with pytest.raises(ProtocolError, match="unknown command 18"):
        _frames(data, None)


def test_a_size_header_cannot_make_the_reader_allocate_beyond_its_limit():
    data = p.encode_request(Command.HELLO, SAMPLES[Command.HELLO]) + struct.pack("<BQ", Command.SET_TENSOR, 1 << 62)
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        _frames(data, None)


def test_reader_stays_failed():
    r = reader()
    with pytest.raises(ProtocolError):
        r.feed(struct.pack("<BQ", 99, 0))
    with pytest.raises(ProtocolError):
        r.feed(b"\0")


def test_set_tensor_payload_lands_in_one_buffer_received_in_place():
    r = reader(first=None)
    msg = p.encode_request(Command.SET_TENSOR, SAMPLES[Command.SET_TENSOR])
    r.feed(msg[:9])
    target = r.get_buffer()
    assert len(target) == len(msg) - 9  # the whole payload is offered as one region
    target[:] = msg[9:]
    r.buffer_updated(len(target))
    frame = r.next_frame()
    assert bytes(p.decode_request(Command.SET_TENSOR, frame.payload).data) == b"payload!"


class Arena:
    """A place() over one array: the data of a SET_TENSOR lands at its `offset` field, checked."""

    def __init__(self, size=64, refuse=False):
        self.mem = np.full(size, 0xEE, dtype=np.uint8)
        self.refuse = refuse  # answer None: receive the data into the frame instead
        self.calls = []

    def __call__(self, head, size):
        req = p.SetTensorRequest.decode_head(head, memoryview(b""))
        self.calls.append((req.offset, size))
        if self.refuse:
            return None
        if not (req.offset <= len(self.mem) and size <= len(self.mem) - req.offset):
            raise ProtocolError("outside the arena", Command.SET_TENSOR)
        return memoryview(self.mem[req.offset : req.offset + size])


def _placed_frames(data: bytes, step: int | None, arena: Arena):
    r = FrameReader(lambda command: LIMIT, first_command=None, place=arena)
    for i in range(0, len(data), step or len(data)):
        r.feed(data[i : i + (step or len(data))])
    out = []
    while (f := r.next_frame()) is not None:
        out.append(f)
    return r, out


SET_AT_16 = p.SetTensorRequest(sample_tensor(), 1, 16, memoryview(b"payload!"))


@pytest.mark.parametrize("step", [None, 1, 7])
def test_set_tensor_data_is_placed_where_place_says_whole_in_pieces_and_before_trailing_bytes(step):
    arena = Arena()
    trailing = p.encode_request(Command.DEVICE_COUNT)[:5]
    r, frames = _placed_frames(p.encode_request(Command.SET_TENSOR, SET_AT_16) + trailing, step, arena)
    assert len(frames) == 1 and not r.idle  # the trailing bytes wait as the start of the next frame
    assert arena.calls == [(16, 8)]
    assert bytes(arena.mem[16:24]) == b"payload!"
    assert (arena.mem[:16] == 0xEE).all() and (arena.mem[24:] == 0xEE).all()
    req = framing.decode_frame(frames[0])
    assert req.in_place and bytes(req.data) == b"payload!"
    assert req.tensor == SET_AT_16.tensor and req.offset == 16 and req.cache_flag == 1
    r.feed(p.encode_request(Command.DEVICE_COUNT)[5:])
    assert r.next_frame().command == Command.DEVICE_COUNT and r.idle


@pytest.mark.parametrize("step", [None, 1, 7])
def test_set_tensor_that_place_declines_arrives_whole_in_the_frame(step):
    arena = Arena(refuse=True)
    _, frames = _placed_frames(p.encode_request(Command.SET_TENSOR, SET_AT_16), step, arena)
    req = framing.decode_frame(frames[0])
    assert arena.calls == [(16, 8)] and not req.in_place
    assert req.encode() == SET_AT_16.encode()
    assert (arena.mem == 0xEE).all()


def test_set_tensor_without_data_and_short_set_tensor_with_place():
    empty = p.SetTensorRequest(sample_tensor(), 0, 3, memoryview(b""))
    _, frames = _placed_frames(p.encode_request(Command.SET_TENSOR, empty), 1, Arena())
    assert framing.decode_frame(frames[0]).encode() == empty.encode()
    short = struct.pack("<BQ", Command.SET_TENSOR, 10) + bytes(10)  # shorter than the fixed header
    _, frames = _placed_frames(short, None, Arena())
    with pytest.raises(ProtocolError, match="SET_TENSOR"):
        framing.decode_frame(frames[0])


def test_place_refusing_the_destination_fails_the_reader_for_good():
    arena = Arena(size=20)
    data = p.encode_request(Command.SET_TENSOR, SET_AT_16)  # 16 + 8 > 20
    r = FrameReader(lambda command: LIMIT, first_command=None, place=arena)
    with pytest.raises(ProtocolError, match="outside the arena"):
        r.feed(data)
    with pytest.raises(ProtocolError):
        r.feed(b"\0")
    assert (arena.mem == 0xEE).all()


@settings(max_examples=at_least(300), deadline=None)
@given(stream=st.binary(max_size=1200), offset=st.integers(0, 80), extra=st.binary(max_size=40))
def test_fuzz_set_tensor_streams_with_place_frame_or_raise_and_stay_in_the_arena(stream, offset, extra):
    arena = Arena(size=64)
    head = p.encode_request(Command.SET_TENSOR, p.SetTensorRequest(sample_tensor(), 0, offset, memoryview(extra)))
    try:
        _, frames = _placed_frames(head + stream, 3, arena)
        for f in frames:
            framing.decode_frame(f)
    except ProtocolError:
        pass
    # the reader wrote nowhere but into the regions place() handed out
    untouched = np.ones(64, dtype=bool)
    for o, n in arena.calls:
        untouched[o : o + n] = False
    assert (arena.mem[untouched] == 0xEE).all()
    if offset + len(extra) <= 64:
        assert arena.calls[0] == (offset, len(extra))
        assert len(arena.calls) > 1 or bytes(arena.mem[offset : offset + len(extra)]) == extra


@pytest.mark.parametrize("command", list(Command))
@settings(max_examples=at_least(60), deadline=None)
@given(payload=st.binary(max_size=700))
def test_fuzz_any_payload_decodes_or_raises_protocol_error(command, payload):
    try:
        p.decode_request(command, memoryview(payload))
    except ProtocolError:
        pass


@settings(max_examples=at_least(300), deadline=None)
@given(stream=st.binary(max_size=2000))
def test_fuzz_any_stream_frames_or_raises_protocol_error(stream):
    r = reader()
    try:
        r.feed(stream)
        while (f := r.next_frame()) is not None:
            p.decode_request(f.command, f.payload)
    except ProtocolError:
        pass


def test_response_reader_checks_sizes():
    rr = framing.ResponseReader(LIMIT)
    rr.feed(p.encode_response(p.U64Response(32).encode())[:5])
    assert rr.next_payload(Command.GET_ALIGNMENT) is None
    rr.feed(p.encode_response(p.U64Response(32).encode())[5:])
    assert p.U64Response.decode(rr.next_payload(Command.GET_ALIGNMENT)).value == 32
    rr.feed(p.encode_response(b"\0" * 3))
    with pytest.raises(ProtocolError, match="expected 8"):
        rr.next_payload(Command.GET_ALIGNMENT)
