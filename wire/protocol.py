"""The llama.cpp RPC wire protocol 7.0.0 as a sans-IO codec, shared by worker and orchestrator.

Nothing here touches a socket: message classes turn payloads into typed messages and back (the byte
streams are cut into frames by wire.framing). All integers are little-endian; all structs are
packed. See protocol_spec.md.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import re
import struct
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from wire.ggml import MAX_SRC
from .gguf_files import LoadTensorRequest
from .record import TENSOR_DTYPE, TENSOR_SIZE, RpcTensor  # noqa: F401 - the codec's names

PROTOCOL_VERSION = (7, 0, 0)
CONN_CAPS_SIZE = 24


class ProtocolError(Exception):
    """The peer broke the protocol; the connection is unusable from here on."""

    def __init__(self, reason: str, command: "Command | int | None" = None):
        self.command = command
        self.reason = reason
        label = _command_label(command) if command is not None else "connection"
        super().__init__(f"{label}: {reason}")


class Command(enum.IntEnum):
    ALLOC_BUFFER = 0
    GET_ALIGNMENT = 1
    GET_MAX_SIZE = 2
    BUFFER_GET_BASE = 3
    FREE_BUFFER = 4
    BUFFER_CLEAR = 5
    SET_TENSOR = 6
    SET_TENSOR_HASH = 7
    GET_TENSOR = 8
    COPY_TENSOR = 9
    GRAPH_COMPUTE = 10
    GET_DEVICE_MEMORY = 11
    INIT_TENSOR = 12
    GET_ALLOC_SIZE = 13
    HELLO = 14
    DEVICE_COUNT = 15
    GRAPH_RECOMPUTE = 16
    MEMSET_TENSOR = 17
    # Our extensions live at 128 and above, far from upstream's numbering (see protocol_spec.md).
    EXT_HELLO = 128
    PEER_TOKEN = 129  # peer push (feature bit 0), protocol_spec.md §8.1
    SET_PEER = 130
    PUSH_TENSOR = 131
    PEER_WRITE = 132
    WAIT_PUSH = 133
    AUTH_NONCE = 134  # pre-shared key (feature bit 1), protocol_spec.md §8.2
    AUTH_PROOF = 135
    GGUF_FILES = 136  # weights from the worker's disk (feature bit 2), protocol_spec.md §8.3
    LOAD_TENSOR = 137


UPSTREAM_COMMAND_COUNT = 18


def _command_label(command) -> str:
    try:
        return Command(command).name
    except ValueError:
        return f"command {command}"


# -- messages --------------------------------------------------------------------------------------


class Message:
    """A fixed-layout message: `FORMAT` is a struct format; tensors take 296-byte slots ("T")."""

    FORMAT: ClassVar[str] = ""

    @classmethod
    def wire_size(cls) -> int:
        return _layout(cls.FORMAT)[1]

    @classmethod
    def decode(cls, payload: memoryview | bytes):
        fields, size = _layout(cls.FORMAT)
        if len(payload) != size:
            raise ValueError(f"{cls.__name__} is {size} bytes, got {len(payload)}")
        values, pos = [], 0
        for kind, width in fields:
            if kind == "T":
                values.append(RpcTensor.decode(payload[pos : pos + TENSOR_SIZE]))
            else:
                values.append(struct.unpack_from("<" + kind, payload, pos)[0])
            pos += width
        return cls(*values)

    def encode(self) -> bytes:
        fields, _ = _layout(self.FORMAT)
        out = []
        for (kind, _), value in zip(fields, self.__dict__.values()):
            out.append(value.encode() if kind == "T" else struct.pack("<" + kind, value))
        return b"".join(out)


_LAYOUTS: dict[str, tuple[list[tuple[str, int]], int]] = {}


def _layout(fmt: str):
    if fmt not in _LAYOUTS:
        codes = re.findall(r"\d*[A-Za-z]", fmt)
        fields = [(k, TENSOR_SIZE if k == "T" else struct.calcsize("<" + k)) for k in codes]
        _LAYOUTS[fmt] = (fields, sum(w for _, w in fields))
    return _LAYOUTS[fmt]


@dataclass
class Empty(Message):
    FORMAT: ClassVar[str] = ""


@dataclass
class HelloRequest(Message):
    FORMAT: ClassVar[str] = "24s"
    conn_caps: bytes = bytes(CONN_CAPS_SIZE)


@dataclass
class HelloResponse(Message):
    FORMAT: ClassVar[str] = "BBBB24s"
    major: int = PROTOCOL_VERSION[0]
    minor: int = PROTOCOL_VERSION[1]
    patch: int = PROTOCOL_VERSION[2]
    padding: int = 0
    conn_caps: bytes = bytes(CONN_CAPS_SIZE)


@dataclass
class DeviceRequest(Message):
    """The request of every command that names only a device."""

    FORMAT: ClassVar[str] = "I"
    device: int = 0


@dataclass
class U64Response(Message):
    FORMAT: ClassVar[str] = "Q"
    value: int = 0


@dataclass
class U8Response(Message):
    FORMAT: ClassVar[str] = "B"
    result: int = 0


@dataclass
class DeviceCountResponse(Message):
    FORMAT: ClassVar[str] = "I"
    device_count: int = 1


@dataclass
class AllocBufferRequest(Message):
    FORMAT: ClassVar[str] = "IQ"
    device: int = 0
    size: int = 0


@dataclass
class AllocBufferResponse(Message):
    FORMAT: ClassVar[str] = "QQ"
    remote_ptr: int = 0
    remote_size: int = 0


@dataclass
class BufferRequest(Message):
    """BUFFER_GET_BASE and FREE_BUFFER: a buffer handle."""

    FORMAT: ClassVar[str] = "Q"
    remote_ptr: int = 0


@dataclass
class BufferClearRequest(Message):
    FORMAT: ClassVar[str] = "QB"
    remote_ptr: int = 0
    value: int = 0


@dataclass
class TensorRequest(Message):
    """INIT_TENSOR: a tensor."""

    FORMAT: ClassVar[str] = "T"
    tensor: RpcTensor = field(default_factory=RpcTensor)


@dataclass
class MemsetTensorRequest(Message):
    FORMAT: ClassVar[str] = "TQQB"
    tensor: RpcTensor = field(default_factory=RpcTensor)
    offset: int = 0
    size: int = 0
    value: int = 0


@dataclass
class SetTensorHashRequest(Message):
    FORMAT: ClassVar[str] = "TQQ"
    tensor: RpcTensor = field(default_factory=RpcTensor)
    offset: int = 0
    hash: int = 0


@dataclass
class GetTensorRequest(Message):
    FORMAT: ClassVar[str] = "TQQ"
    tensor: RpcTensor = field(default_factory=RpcTensor)
    offset: int = 0
    size: int = 0


@dataclass
class CopyTensorRequest(Message):
    FORMAT: ClassVar[str] = "TT"
    src: RpcTensor = field(default_factory=RpcTensor)
    dst: RpcTensor = field(default_factory=RpcTensor)


@dataclass
class GetDeviceMemoryResponse(Message):
    FORMAT: ClassVar[str] = "QQ"
    free_mem: int = 0
    total_mem: int = 0


@dataclass
class GetAllocSizeRequest:
    """| device u32 | tensor | srcs[MAX_SRC] |: the sources ride along because a backend's size may depend on them."""

    device: int = 0
    tensor: RpcTensor = field(default_factory=RpcTensor)
    srcs: tuple = ()

    @classmethod
    def wire_size(cls) -> int:
        return 4 + TENSOR_SIZE * (1 + MAX_SRC)

    @classmethod
    def decode(cls, payload):
        if len(payload) != cls.wire_size():
            raise ValueError(f"GetAllocSizeRequest is {cls.wire_size()} bytes, got {len(payload)}")
        (device,) = struct.unpack_from("<I", payload)
        records = np.frombuffer(payload, dtype=TENSOR_DTYPE, count=1 + MAX_SRC, offset=4)
        tensors = [RpcTensor.from_record(r) for r in records]
        return cls(device, tensors[0], tuple(tensors[1:]))

    def encode(self) -> bytes:
        srcs = list(self.srcs) + [RpcTensor()] * (MAX_SRC - len(self.srcs))
        return struct.pack("<I", self.device) + self.tensor.encode() + b"".join(s.encode() for s in srcs)


@dataclass
class SetTensorRequest:
    """| tensor (296) | cache_flag (1) | offset (8) | data (rest) |: variable size, no reply."""

    HEADER: ClassVar[int] = TENSOR_SIZE + 1 + 8
    tensor: RpcTensor
    cache_flag: int
    offset: int
    data: memoryview
    in_place: bool = False  # the data was received straight into its destination (FrameReader's place)

    @classmethod
    def decode(cls, payload: memoryview):
        if len(payload) < cls.HEADER:
            raise ValueError(f"SET_TENSOR needs at least {cls.HEADER} bytes, got {len(payload)}")
        return cls.decode_head(payload[: cls.HEADER], payload[cls.HEADER :])

    @classmethod
    def decode_head(cls, head: memoryview, data: memoryview, in_place: bool = False):
        """The request from its fixed header and its data, which may live elsewhere."""
        if len(head) != cls.HEADER:
            raise ValueError(f"SET_TENSOR header is {cls.HEADER} bytes, got {len(head)}")
        flag, offset = struct.unpack_from("<BQ", head, TENSOR_SIZE)
        return cls(RpcTensor.decode(head[:TENSOR_SIZE]), flag, offset, data, in_place)

    def encode(self) -> bytes:
        return self.tensor.encode() + struct.pack("<BQ", self.cache_flag, self.offset) + bytes(self.data)


@dataclass
class GraphComputeRequest:
    """| device u32 | n_nodes u32 | node ids u64[n_nodes] | n_tensors u32 | tensors[n_tensors] |."""

    device: int
    nodes: np.ndarray  # u64 node ids in execution order
    tensors: np.ndarray  # TENSOR_DTYPE records

    @classmethod
    def decode(cls, payload: memoryview):
        size = len(payload)
        if size < 8:
            raise ValueError(f"GRAPH_COMPUTE needs at least 8 bytes, got {size}")
        device, n_nodes = struct.unpack_from("<II", payload, 0)
        pos = 8 + 8 * n_nodes
        if size < pos + 4:
            raise ValueError(f"GRAPH_COMPUTE with {n_nodes} nodes is truncated")
        (n_tensors,) = struct.unpack_from("<I", payload, pos)
        end = pos + 4 + TENSOR_SIZE * n_tensors
        if size != end:
            raise ValueError(f"GRAPH_COMPUTE with {n_nodes} nodes, {n_tensors} tensors is {end} bytes, got {size}")
        nodes = np.frombuffer(payload, dtype="<u8", count=n_nodes, offset=8)
        tensors = np.frombuffer(payload, dtype=TENSOR_DTYPE, count=n_tensors, offset=pos + 4)
        return cls(device, nodes, tensors)

    def encode(self) -> bytes:
        nodes = np.asarray(self.nodes, dtype="<u8")
        tensors = np.asarray(self.tensors, dtype=TENSOR_DTYPE)
        return b"".join(
            (struct.pack("<II", self.device, len(nodes)), nodes.tobytes(), struct.pack("<I", len(tensors)), tensors.tobytes())
        )


@dataclass
class ExtHelloResponse(Message):
    """Our extension handshake: a bit set of extension features this worker offers."""

    FORMAT: ClassVar[str] = "QQ"
    magic: int = 0
    features: int = 0


EXT_MAGIC = int.from_bytes(b"PYRPCEXT", "little")
FEATURE_PEER_PUSH = 1 << 0
FEATURE_AUTH = 1 << 1  # this worker serves nothing but the handshake until AUTH_PROOF succeeds
FEATURE_GGUF_FILES = 1 << 2  # GGUF_FILES, LOAD_TENSOR: weights from the worker's --gguf-dir
TOKEN_SIZE = 16
NONCE_SIZE = 32
MIN_KEY_BYTES = 16  # of a --key-file's stripped contents


@dataclass
class AuthNonceResponse(Message):
    FORMAT: ClassVar[str] = "32s"
    nonce: bytes = bytes(NONCE_SIZE)


@dataclass
class AuthProofRequest(Message):
    FORMAT: ClassVar[str] = "32s"
    mac: bytes = bytes(32)  # auth_proof(key, nonce)


AUTH_CONTEXT = b"pyrpc-auth-v1\0"  # binds a proof to this use of the key


def auth_proof(key: bytes, nonce: bytes) -> bytes:
    """AUTH_PROOF's answer to AUTH_NONCE's challenge: HMAC-SHA256(key, AUTH_CONTEXT + nonce)."""
    return hmac.new(key, AUTH_CONTEXT + nonce, hashlib.sha256).digest()


@dataclass
class PeerTokenResponse(Message):
    FORMAT: ClassVar[str] = "16s"
    token: bytes = bytes(TOKEN_SIZE)


@dataclass
class SetPeerRequest(Message):
    FORMAT: ClassVar[str] = "I16sH256s"
    link: int = 0
    token: bytes = bytes(TOKEN_SIZE)
    port: int = 0
    host: bytes = b""  # NUL-padded ASCII

    @property
    def host_name(self) -> str:
        return self.host.split(b"\0", 1)[0].decode("ascii", "replace")


@dataclass
class PushTensorRequest(Message):
    FORMAT: ClassVar[str] = "IQTT"
    link: int = 0
    step: int = 0
    src: RpcTensor = field(default_factory=RpcTensor)
    dst: RpcTensor = field(default_factory=RpcTensor)


@dataclass
class PeerWriteRequest:
    """| token (16) | step (8) | tensor (296) | offset (8) | data (rest) |: SET_TENSOR with a capability."""

    HEADER: ClassVar[int] = TOKEN_SIZE + 8 + TENSOR_SIZE + 8
    token: bytes
    step: int
    tensor: RpcTensor
    offset: int
    data: memoryview

    @classmethod
    def decode(cls, payload: memoryview):
        if len(payload) < cls.HEADER:
            raise ValueError(f"PEER_WRITE needs at least {cls.HEADER} bytes, got {len(payload)}")
        step = struct.unpack_from("<Q", payload, TOKEN_SIZE)[0]
        tensor = RpcTensor.decode(payload[TOKEN_SIZE + 8 : TOKEN_SIZE + 8 + TENSOR_SIZE])
        offset = struct.unpack_from("<Q", payload, cls.HEADER - 8)[0]
        return cls(bytes(payload[:TOKEN_SIZE]), step, tensor, offset, payload[cls.HEADER :])

    def encode_head(self) -> bytes:
        return self.token + struct.pack("<Q", self.step) + self.tensor.encode() + struct.pack("<Q", self.offset)

    def encode(self) -> bytes:
        return self.encode_head() + bytes(self.data)


@dataclass
class WaitPushRequest(Message):
    FORMAT: ClassVar[str] = "QI"
    step: int = 0
    timeout_ms: int = 0


# -- the command table -----------------------------------------------------------------------------


@dataclass(frozen=True)
class CommandSpec:
    request: type  # a Message class, SetTensorRequest or GraphComputeRequest
    response: type | None  # None: the command has no reply; bytes: a raw variable-size reply
    variable: bool = False  # variable-size request payload

    @property
    def request_size(self) -> int | None:
        return None if self.variable else self.request.wire_size()


COMMANDS: dict[Command, CommandSpec] = {
    Command.ALLOC_BUFFER: CommandSpec(AllocBufferRequest, AllocBufferResponse),
    Command.GET_ALIGNMENT: CommandSpec(DeviceRequest, U64Response),
    Command.GET_MAX_SIZE: CommandSpec(DeviceRequest, U64Response),
    Command.BUFFER_GET_BASE: CommandSpec(BufferRequest, U64Response),
    Command.FREE_BUFFER: CommandSpec(BufferRequest, None),
    Command.BUFFER_CLEAR: CommandSpec(BufferClearRequest, None),
    Command.SET_TENSOR: CommandSpec(SetTensorRequest, None, variable=True),
    Command.SET_TENSOR_HASH: CommandSpec(SetTensorHashRequest, U8Response),
    Command.GET_TENSOR: CommandSpec(GetTensorRequest, bytes),
    Command.COPY_TENSOR: CommandSpec(CopyTensorRequest, U8Response),
    Command.GRAPH_COMPUTE: CommandSpec(GraphComputeRequest, None, variable=True),
    Command.GET_DEVICE_MEMORY: CommandSpec(DeviceRequest, GetDeviceMemoryResponse),
    Command.INIT_TENSOR: CommandSpec(TensorRequest, None),
    Command.GET_ALLOC_SIZE: CommandSpec(GetAllocSizeRequest, U64Response),
    Command.HELLO: CommandSpec(HelloRequest, HelloResponse),
    Command.DEVICE_COUNT: CommandSpec(Empty, DeviceCountResponse),
    Command.GRAPH_RECOMPUTE: CommandSpec(DeviceRequest, None),
    Command.MEMSET_TENSOR: CommandSpec(MemsetTensorRequest, None),
    Command.EXT_HELLO: CommandSpec(Empty, ExtHelloResponse),
    Command.PEER_TOKEN: CommandSpec(Empty, PeerTokenResponse),
    Command.SET_PEER: CommandSpec(SetPeerRequest, U8Response),
    Command.PUSH_TENSOR: CommandSpec(PushTensorRequest, U8Response),
    Command.PEER_WRITE: CommandSpec(PeerWriteRequest, U8Response, variable=True),
    Command.WAIT_PUSH: CommandSpec(WaitPushRequest, U8Response),
    Command.AUTH_NONCE: CommandSpec(Empty, AuthNonceResponse),
    Command.AUTH_PROOF: CommandSpec(AuthProofRequest, U8Response),
    Command.GGUF_FILES: CommandSpec(Empty, bytes),  # wire.gguf_files.decode_gguf_files
    Command.LOAD_TENSOR: CommandSpec(LoadTensorRequest, U8Response),
}


def decode_request(command: Command, payload: memoryview):
    """Typed request from a frame's payload; raises ProtocolError naming the command."""
    try:
        return COMMANDS[command].request.decode(payload)
    except (ValueError, struct.error) as exc:
        raise ProtocolError(str(exc), command) from None


def encode_request(command: Command, message=None) -> bytes:
    payload = b"" if message is None else message.encode()
    return struct.pack("<BQ", command, len(payload)) + payload


def encode_response(payload: bytes | memoryview) -> bytes:
    return struct.pack("<Q", len(payload)) + bytes(payload)


def response_header(size: int) -> bytes:
    return struct.pack("<Q", size)
