"""A blocking RPC client on the shared codec: one connection to one worker (ours or llama.cpp's)."""

from __future__ import annotations

import collections
import contextlib
import select
import socket
import time
from typing import Callable

from wire import framing, protocol as p
from wire.gguf_files import GgufFile, LoadTensorRequest, decode_gguf_files
from wire.protocol import Command, ProtocolError

MAX_RESPONSE = 1 << 34
# Workers this process started itself (LocalWorkers): endpoint -> whether that worker has used CPU since
# last asked. A wait on them that outlasts --rpc-timeout goes on while they work: a first run of another
# model compiles its kernels in its first graphs, which can take minutes (a hung worker uses no CPU).
STILL_WORKING: dict[str, Callable[[], bool]] = {}


def still_working(endpoint: str) -> bool:
    """True if `endpoint` is one of our local workers and one of them has used CPU since this was last
    asked: a reply may wait on another worker (a push from the stage before, compiling)."""
    return endpoint in STILL_WORKING and any([working() for working in STILL_WORKING.values()])  # each asked


class WorkerError(Exception):
    """The worker is unreachable, speaks another protocol, dropped the connection or gave no answer in
    time. `endpoint`: the worker that failed, when one can be named (the engine re-plans without it)."""

    def __init__(self, message: str, endpoint: str | None = None):
        super().__init__(message)
        self.endpoint = endpoint


class RpcClient:
    held: list[bytes] | None = None  # frames of requests sent while corked, not written yet
    key: bytes | None = None  # --rpc-key-file: answers a keyed worker's challenge (protocol_spec.md §8.2)
    # --rpc-timeout: seconds a reply (or the connection) may take before the worker counts as hung
    timeout: float = 60.0
    # bytes written to and read from the worker so far (frames with their headers), for the engine's telemetry
    sent_bytes: int = 0
    received_bytes: int = 0
    graphs_sent: int = 0  # GRAPH_COMPUTEs sent on this connection (a Channel's too): the worker keeps the last
    # once a Channel shares the connection: who owns each reply owed, in order (None: this client's own user),
    # and replies read for an owner before it asked
    routes: collections.deque | None = None
    stashed: dict[object, collections.deque]

    def __init__(self, endpoint: str, timeout: float | None = None, key: bytes | None = None):
        host, _, port = endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise WorkerError(f"invalid endpoint '{endpoint}': expected host:port", endpoint)
        timeout = timeout if timeout is not None else RpcClient.timeout
        self.endpoint = endpoint
        self.owed = 0  # replies of requests sent with send() not read yet
        try:
            self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        except OSError as exc:
            raise WorkerError(f"cannot connect to worker {endpoint}: {exc.strerror or exc}", endpoint) from None
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.reader = framing.ResponseReader(MAX_RESPONSE)
        reply = self.call(Command.HELLO, p.HelloRequest())
        self.version = tuple(reply[:3])
        if self.version[0] != p.PROTOCOL_VERSION[0] or len(reply) != p.HelloResponse.wire_size():
            self.close()
            raise WorkerError(f"worker {endpoint} speaks RPC protocol {'.'.join(map(str, self.version))}, "
                              f"we speak {'.'.join(map(str, p.PROTOCOL_VERSION))}")
        key = key if key is not None else self.key
        if key is not None:
            self._authenticate(key)

    def _authenticate(self, key: bytes) -> None:
        """With a key, the worker must be ours (EXT_HELLO); if it asks for the key, prove we hold it."""
        ext = p.ExtHelloResponse.decode(self.call(Command.EXT_HELLO))
        if ext.magic != p.EXT_MAGIC or not ext.features & p.FEATURE_AUTH:
            return  # a worker without a key lets us in as it is
        nonce = p.AuthNonceResponse.decode(self.call(Command.AUTH_NONCE)).nonce
        try:
            self.call(Command.AUTH_PROOF, p.AuthProofRequest(p.auth_proof(key, nonce)))
        except WorkerError:
            self.close()
            raise WorkerError(f"worker {self.endpoint} refused our key (--rpc-key-file)", self.endpoint) from None

    def close(self) -> None:
        self.sock.close()

    def abort(self) -> None:
        """From another thread: a send or receive blocked on this connection fails at once (WorkerError)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # closed already

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def send(self, command: Command, message=None, owner=None) -> None:
        """A request; if it has a reply, receive() reads it later (replies come in request order). `owner`:
        the Channel sending it (None: this client's own user)."""
        frame = p.encode_request(command, message)
        if self.held is not None:
            self.held.append(frame)
        else:
            self._write(frame, command.name)
        if command == Command.GRAPH_COMPUTE:
            self.graphs_sent += 1
        if p.COMMANDS[command].response is not None:
            if self.routes is not None:
                self.routes.append((owner, command))
            if owner is None:
                self.owed += 1

    @contextlib.contextmanager
    def corked(self):
        """The requests sent inside go out together, in one write when it ends (or before a receive): a
        step's small frames cost one system call instead of one each."""
        self.held = []
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        frames, self.held = self.held, None
        if frames:
            self._write(b"".join(frames), f"a burst of {len(frames)} requests")

    def _write(self, data: bytes, what: str) -> None:
        view = memoryview(data).cast("B")
        try:
            while view:
                try:
                    view = view[self.sock.send(view):]
                except TimeoutError:
                    if not still_working(self.endpoint):
                        raise
            self.sent_bytes += len(data)
        except OSError as exc:
            raise WorkerError(f"worker {self.endpoint} dropped the connection during {what}: {exc}",
                              self.endpoint) from None

    def call(self, command: Command, message=None) -> bytes:
        """A request and its reply payload; no other reply may be owed (it would be read instead)."""
        if self.owed:
            raise RuntimeError(f"{command.name} called on {self.endpoint} with {self.owed} replies still owed")
        self.send(command, message)
        return self.receive(command)

    def receive(self, command: Command, owner=None) -> bytes:
        """The reply payload of `command`, the oldest request sent whose reply was not read yet (`owner`'s,
        where a Channel shares the connection: the replies before it are read and kept for their owners)."""
        if self.held:
            self._release()
        if owner is None:
            self.owed -= 1
        if self.routes is None:
            return self._read(command)
        if stash := self.stashed.get(owner):
            return stash.popleft()
        while True:
            head, head_command = self.routes.popleft()
            payload = self._read(head_command)
            if head is owner:
                return payload
            self.stashed.setdefault(head, collections.deque()).append(payload)

    def reply_ready(self) -> bool:
        """A reply of this client's own user is buffered (whole) or was read and kept for it."""
        if self.routes is None:
            return self.reader.complete()
        if self.stashed.get(None):
            return True
        return self.reader.complete() and bool(self.routes) and self.routes[0][0] is None

    def _read(self, command: Command) -> bytes:
        """The next reply on the connection, as `command`'s."""
        try:
            while (payload := self.reader.next_payload(command)) is None:
                try:
                    chunk = self.sock.recv(1 << 20)
                except TimeoutError:
                    if still_working(self.endpoint):
                        continue
                    raise
                if not chunk:
                    raise WorkerError(f"worker {self.endpoint} closed the connection during {command.name}", self.endpoint)
                self.received_bytes += len(chunk)
                self.reader.feed(chunk)
        except OSError as exc:
            raise WorkerError(f"worker {self.endpoint} failed during {command.name}: {exc}", self.endpoint) from None
        except ProtocolError as exc:
            raise WorkerError(f"worker {self.endpoint}: {exc}", self.endpoint) from None
        return payload

    def pump(self) -> None:
        """Buffers what has arrived on the (readable) socket for receive(); a closed connection raises."""
        try:
            chunk = self.sock.recv(1 << 20)
        except OSError as exc:
            raise WorkerError(f"worker {self.endpoint} failed: {exc}", self.endpoint) from None
        if not chunk:
            raise WorkerError(f"worker {self.endpoint} closed the connection", self.endpoint)
        self.received_bytes += len(chunk)
        self.reader.feed(chunk)

    # -- typed helpers -----------------------------------------------------------------------------

    def device_memory(self, device: int = 0) -> tuple[int, int]:
        r = p.GetDeviceMemoryResponse.decode(self.call(Command.GET_DEVICE_MEMORY, p.DeviceRequest(device)))
        return r.free_mem, r.total_mem

    def alignment(self, device: int = 0) -> int:
        return p.U64Response.decode(self.call(Command.GET_ALIGNMENT, p.DeviceRequest(device))).value

    def alloc_buffer(self, size: int, device: int = 0) -> tuple[int, int]:
        """(handle, base address) of a new buffer; raises WorkerError if it does not fit."""
        r = p.AllocBufferResponse.decode(self.call(Command.ALLOC_BUFFER, p.AllocBufferRequest(device, size)))
        if r.remote_ptr == 0:
            raise WorkerError(f"worker {self.endpoint} cannot allocate {size} bytes", self.endpoint)
        base = p.U64Response.decode(self.call(Command.BUFFER_GET_BASE, p.BufferRequest(r.remote_ptr))).value
        return r.remote_ptr, base

    def free_buffer(self, handle: int) -> None:
        self.send(Command.FREE_BUFFER, p.BufferRequest(handle))

    def buffer_clear(self, handle: int, value: int = 0) -> None:
        self.send(Command.BUFFER_CLEAR, p.BufferClearRequest(handle, value))

    def set_tensor(self, tensor: p.RpcTensor, data: bytes, offset: int = 0) -> None:
        self.send(Command.SET_TENSOR, p.SetTensorRequest(tensor, 0, offset, memoryview(data)))

    def set_tensor_hash(self, tensor: p.RpcTensor, digest: int, offset: int = 0) -> bool:
        """True if the worker had bytes with this FNV-1a hash in its cache and wrote them to the tensor."""
        reply = self.call(Command.SET_TENSOR_HASH, p.SetTensorHashRequest(tensor, offset, digest))
        return p.U8Response.decode(reply).result == 1

    def gguf_files(self) -> list[GgufFile]:
        """The GGUF files a worker with --gguf-dir offers (protocol_spec.md §8.3); file id = position."""
        try:
            return decode_gguf_files(self.call(Command.GGUF_FILES))
        except ValueError as exc:
            raise WorkerError(f"worker {self.endpoint}: {exc}", self.endpoint) from None

    def load_tensor(self, tensor: p.RpcTensor, file_id: int, file_offset: int, size: int, digest: int) -> None:
        """Asks the worker to read the tensor's bytes from its file; receive() gives 1 (done) or 0 (their
        FNV-1a hash is not `digest`: send them with SET_TENSOR)."""
        self.send(Command.LOAD_TENSOR, LoadTensorRequest(tensor, 0, file_id, file_offset, size, digest))

    def get_tensor(self, tensor: p.RpcTensor, size: int, offset: int = 0) -> bytes:
        return self.call(Command.GET_TENSOR, p.GetTensorRequest(tensor, offset, size))

    def graph_compute(self, nodes, tensors, device: int = 0) -> None:
        self.send(Command.GRAPH_COMPUTE, p.GraphComputeRequest(device, nodes, tensors))

    def graph_recompute(self, device: int = 0) -> None:
        self.send(Command.GRAPH_RECOMPUTE, p.DeviceRequest(device))


class Channel(RpcClient):
    """A second user of a client's connection, with requests and replies of its own: the draft beside the
    target on a llama.cpp worker, which serves one connection at a time (llama-server shares it between
    its model and its draft too). The worker answers in request order; a receive reads the replies before
    its own and keeps them for their owners. Used from the connection's owner's thread only, never inside
    its corked() nor while its graph's stored copy matters (Stage counts graphs_sent for that)."""

    def __init__(self, client: RpcClient):
        if client.owed or client.held is not None:
            raise RuntimeError(f"a channel opened on {client.endpoint} while requests are under way")
        self.base = client
        self.endpoint, self.version, self.sock, self.reader = client.endpoint, client.version, client.sock, client.reader
        self.owed = 0
        if client.routes is None:
            client.routes, client.stashed = collections.deque(), {}

    @property
    def graphs_sent(self) -> int:  # (the connection's, the base's and every channel's)
        return self.base.graphs_sent

    def send(self, command: Command, message=None, owner=None) -> None:
        self.base.send(command, message, owner=self)
        if p.COMMANDS[command].response is not None:
            self.owed += 1

    def receive(self, command: Command, owner=None) -> bytes:
        self.owed -= 1
        return self.base.receive(command, owner=self)

    def reply_ready(self) -> bool:
        return bool(self.base.stashed.get(self)) or (self.reader.complete() and bool(self.base.routes)
                                                      and self.base.routes[0][0] is self)

    @contextlib.contextmanager
    def corked(self):
        with self.base.corked():
            yield

    def close(self) -> None:
        pass  # the connection is its owner's to close

    def abort(self) -> None:
        self.base.abort()


class InProcessClient(RpcClient):
    """RpcClient's interface over a worker Session in this process (the worker's warm-up, profiling):
    requests still go through the codec, only the socket and the handshake are left out."""

    def __init__(self, session, endpoint: str = "in-process"):
        self.session, self.endpoint, self.version = session, endpoint, p.PROTOCOL_VERSION
        self.owed = 0
        self.replies: collections.deque[bytes] = collections.deque()  # of send(), for receive()

    def close(self) -> None:
        self.session.close()

    def call(self, command: Command, message=None) -> bytes:
        payload = memoryview(p.encode_request(command, message))[9:]  # drop the frame header
        return self.session.handle(command, p.decode_request(command, payload)) or b""

    def send(self, command: Command, message=None) -> None:
        reply = self.call(command, message)
        if p.COMMANDS[command].response is not None:
            self.replies.append(reply)

    def receive(self, command: Command) -> bytes:
        return self.replies.popleft()


def _pump_readable(clients: list[RpcClient], timeout: float | None, extra: tuple = ()) -> list:
    """Waits up to `timeout` for any of the clients' sockets or `extra` to become readable, buffers what
    each readable client has received (a closed connection raises) and returns the readable sockets."""
    readable, _, _ = select.select([c.sock for c in clients] + list(extra), [], [], timeout)
    for c in clients:
        if c.sock in readable:
            c.pump()
    return readable


def name_the_dead(clients: list[RpcClient], grace: float = 1.0) -> None:
    """Raises WorkerError naming a worker whose connection has closed, watching them for up to `grace`
    seconds: a failure reported by one worker is often the loss of another (its input never came)."""
    deadline = time.monotonic() + grace
    while (left := deadline - time.monotonic()) > 0:
        _pump_readable(clients, left)


def await_reply(client: RpcClient, watched: list[RpcClient], timeout: float | None = None) -> None:
    """Waits until `client` has a whole reply buffered (up to `timeout`, by default its socket's),
    meanwhile watching the other connections: a worker that goes away is named at once, not after the
    replies that depend on it time out."""
    timeout = timeout if timeout is not None else client.sock.gettimeout()
    while not client.reply_ready():
        if not _pump_readable(watched, timeout) and not still_working(client.endpoint):
            raise WorkerError(f"worker {client.endpoint}: no reply for {timeout:.0f} s", client.endpoint)


def replies_waiting(clients: list[RpcClient], wake: socket.socket | None = None) -> list[int]:
    """The indices of the clients that have a whole reply buffered, waiting until at least one has (each
    client's own timeout, as a blocking receive would) or, with `wake`, until that socket is readable
    (drained; then the list may be empty)."""
    if not clients:
        return []
    timeout = max(c.sock.gettimeout() or 0 for c in clients) or None
    extra = (wake,) if wake is not None else ()
    while not (ready := [i for i, c in enumerate(clients) if c.reply_ready()]):
        readable = _pump_readable(clients, timeout, extra)
        if not readable and not any(still_working(c.endpoint) for c in clients):
            # the one worker that owes a reply is the hung one; of several, any may be
            raise WorkerError(f"no reply from {', '.join(c.endpoint for c in clients)} for {timeout:.0f} s",
                              clients[0].endpoint if len(clients) == 1 else None)
        if wake in readable:
            while True:
                try:
                    wake.recv(4096)
                except BlockingIOError:
                    break
            return [i for i, c in enumerate(clients) if c.reply_ready()]
    return ready
