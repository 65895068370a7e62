"""Replay a recorded RPC session against any worker and compare what comes back, byte for byte.

    python tools/trace_proxy.py --worker 127.0.0.1:50052 --listen 127.0.0.1:50060 --record s.rpcrec
    llama-server -m model.gguf --rpc 127.0.0.1:50060 -ngl 99 ...     # use it, then stop both
    python tools/replay.py s.rpcrec --worker 127.0.0.1:50053 --worker 127.0.0.1:50054 -n 3

Every recorded request is sent again, in the recorded order, each on its own connection as recorded.
Buffer handles and data addresses are the recorded worker's and mean nothing to another one, so the
replay keeps, per connection, the new handle of each recorded ALLOC_BUFFER and the new base of each
BUFFER_GET_BASE, and rewrites every tensor record it sends (buffer, data) and every buffer handle. A
recording is therefore replayable as long as the client asked for the base of every buffer whose
tensors it addressed (ggml-rpc's client always does), and was made against a worker without a
weights cache (a SET_TENSOR_HASH hit left no SET_TENSOR data to replay).

The result of a replay is the list of GET_TENSOR replies (what the client read back: logits,
embeddings, activations); replays are compared on those. With several --worker and/or -n, the
command reports, for each replay, whether it read back what the recorded session read (the
recorded worker's replies) and what the first replay read, and if not, where it first differs; it
exits 1 if any replay differs from the first.
"""

from __future__ import annotations

import argparse
import socket
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from wire import framing, protocol as p  # noqa: E402
from wire.ggml import GGMLType  # noqa: E402
from wire.protocol import TENSOR_DTYPE, TENSOR_SIZE, Command  # noqa: E402
from tools.trace_proxy import Recording  # noqa: E402

MAX_REPLY = 1 << 34


class ReplayError(RuntimeError):
    """The recording cannot be replayed on this worker, or the worker misbehaved."""


@dataclass
class Entry:
    conn: int
    kind: int  # Recording.REQUEST / REPLY / CLOSED
    command: Command
    payload: bytes


def read_recording(path: Path, payloads: bool = True) -> Iterator[Entry]:
    """The entries in order (with empty payloads if not `payloads`: a quick scan)."""
    with open(path, "rb") as f:
        if f.read(len(Recording.MAGIC)) != Recording.MAGIC:
            raise ReplayError(f"{path} is not a recording of tools/trace_proxy.py --record")
        while head := f.read(Recording.ENTRY.size):
            if len(head) < Recording.ENTRY.size:
                raise ReplayError(f"{path} ends inside an entry header")
            conn, kind, command, size = Recording.ENTRY.unpack(head)
            if payloads:
                payload = f.read(size)
                if len(payload) != size:
                    raise ReplayError(f"{path} ends inside an entry")
            else:
                payload = b""
                f.seek(size, 1)
            yield Entry(conn, kind, Command(command), payload)


def tensor_slots(command: Command, payload: bytes) -> tuple[int, int]:
    """(byte offset, count) of the tensor records in a request payload."""
    if command in (Command.SET_TENSOR, Command.SET_TENSOR_HASH, Command.GET_TENSOR, Command.INIT_TENSOR,
                   Command.MEMSET_TENSOR):
        return 0, 1
    if command == Command.COPY_TENSOR:
        return 0, 2
    if command == Command.GET_ALLOC_SIZE:
        return 4, (p.GetAllocSizeRequest.wire_size() - 4) // TENSOR_SIZE
    if command == Command.GRAPH_COMPUTE:
        (n_nodes,) = struct.unpack_from("<I", payload, 4)
        pos = 8 + 8 * n_nodes
        return pos + 4, struct.unpack_from("<I", payload, pos)[0]
    return 0, 0


HANDLE_COMMANDS = (Command.BUFFER_GET_BASE, Command.FREE_BUFFER, Command.BUFFER_CLEAR)  # u64 handle first


@dataclass
class Output:
    """One GET_TENSOR reply of a replay."""

    index: int  # among the replay's GET_TENSORs
    name: str
    type: int
    ne: tuple
    data: bytes


@dataclass
class _Connection:
    sock: socket.socket
    reader: framing.ResponseReader = field(default_factory=lambda: framing.ResponseReader(MAX_REPLY))
    handles: dict = field(default_factory=dict)  # recorded buffer handle -> this worker's
    bases: dict = field(default_factory=dict)  # recorded buffer handle -> (recorded base, this worker's base)
    replies: list = field(default_factory=list)  # live replies not yet paired with their recorded entry


class Replayer:
    """Replays one recording on one worker; `run()` returns its GET_TENSOR outputs."""

    def __init__(self, worker: str, timeout: float | None = 600.0):
        host, _, port = worker.rpartition(":")
        self.address, self.timeout = (host, int(port)), timeout
        self.conns: dict[int, _Connection] = {}
        self.outputs: list[Output] = []

    def run(self, recording: Path) -> list[Output]:
        # A connection is closed right after its last exchange, not at its recorded end: the client
        # may have opened the next one a moment before the proxy saw the last one close, and
        # llama.cpp's worker serves one connection at a time.
        last = {e.conn: i for i, e in enumerate(read_recording(recording, payloads=False)) if e.kind != Recording.CLOSED}
        try:
            for i, entry in enumerate(read_recording(recording)):
                if entry.kind == Recording.REQUEST:
                    self._request(entry)
                elif entry.kind == Recording.REPLY:
                    self._reply(entry)
                if last.get(entry.conn) == i and entry.conn in self.conns:
                    self.conns.pop(entry.conn).sock.close()
        finally:
            for conn in self.conns.values():
                conn.sock.close()
            self.conns.clear()
        return self.outputs

    def _connection(self, number: int) -> _Connection:
        if number not in self.conns:
            sock = socket.create_connection(self.address, timeout=self.timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.conns[number] = _Connection(sock)
        return self.conns[number]

    def _request(self, entry: Entry) -> None:
        conn = self._connection(entry.conn)
        payload = self._remap(conn, entry.command, entry.payload)
        conn.sock.sendall(struct.pack("<BQ", entry.command, len(payload)))
        conn.sock.sendall(payload)
        if p.COMMANDS[entry.command].response is not None:
            while (reply := conn.reader.next_payload(entry.command)) is None:
                chunk = conn.sock.recv(1 << 20)
                if not chunk:
                    raise ReplayError(f"the worker closed connection {entry.conn} during {entry.command.name}")
                conn.reader.feed(chunk)
            conn.replies.append((entry.command, entry.payload, reply))

    def _reply(self, entry: Entry) -> None:
        """Pair the recorded reply with the live one: learn handles and bases, keep GET_TENSOR data."""
        conn = self.conns[entry.conn]
        command, request, reply = conn.replies.pop(0)  # request: as recorded
        if command != entry.command:
            raise ReplayError(f"the recording pairs a {entry.command.name} reply with a {command.name} request")
        if command == Command.ALLOC_BUFFER:
            old = p.AllocBufferResponse.decode(entry.payload).remote_ptr
            new = p.AllocBufferResponse.decode(reply).remote_ptr
            if old and not new:
                raise ReplayError(f"the worker cannot allocate {p.AllocBufferRequest.decode(request).size} bytes")
            if old:
                conn.handles[old] = new
        elif command == Command.BUFFER_GET_BASE:
            old = p.BufferRequest.decode(request).remote_ptr
            conn.bases[old] = (p.U64Response.decode(entry.payload).value, p.U64Response.decode(reply).value)
        elif command == Command.GET_TENSOR:
            t = p.GetTensorRequest.decode(request).tensor
            self.outputs.append(Output(len(self.outputs), t.name, t.type, t.ne, reply))

    def _remap(self, conn: _Connection, command: Command, payload: bytes) -> bytes:
        if command in HANDLE_COMMANDS:
            (handle,) = struct.unpack_from("<Q", payload)
            return struct.pack("<Q", conn.handles.get(handle, handle)) + payload[8:]
        offset, count = tensor_slots(command, payload)
        if not count:
            return payload
        out = bytearray(payload)
        recs = np.frombuffer(out, dtype=TENSOR_DTYPE, count=count, offset=offset)
        for old in np.unique(recs["buffer"]):
            old = int(old)
            if old not in conn.handles:
                continue  # none, or not this connection's: means the same to any worker
            mine = recs["buffer"] == old
            recs["buffer"][mine] = conn.handles[old]
            addressed = mine & (recs["data"] != 0)
            if addressed.any():
                if old not in conn.bases:
                    raise ReplayError(f"{command.name} addresses buffer 0x{old:x}, whose base was never asked for")
                old_base, new_base = conn.bases[old]
                recs["data"][addressed] = recs["data"][addressed] - np.uint64(old_base) + np.uint64(new_base)
        return bytes(out)


def recorded_outputs(recording: Path) -> list[Output]:
    """The GET_TENSOR replies the recorded worker gave, as a replay's outputs."""
    asked: dict[int, list] = {}
    outputs: list[Output] = []
    for e in read_recording(recording):
        if e.kind == Recording.REQUEST and p.COMMANDS[e.command].response is not None:
            asked.setdefault(e.conn, []).append(e)
        elif e.kind == Recording.REPLY:
            request = asked[e.conn].pop(0)
            if request.command == Command.GET_TENSOR:
                t = p.GetTensorRequest.decode(request.payload).tensor
                outputs.append(Output(len(outputs), t.name, t.type, t.ne, e.payload))
    return outputs


def first_difference(a: list[Output], b: list[Output]) -> str | None:
    """None if both replays read back the same bytes; else where and how they first differ."""
    for x, y in zip(a, b):
        if x.data != y.data:
            what = f"GET_TENSOR #{x.index} ('{x.name}', {GGMLType(x.type).name} {x.ne})"
            if x.type == GGMLType.F32 and len(x.data) == len(y.data):
                u, v = np.frombuffer(x.data, np.float32), np.frombuffer(y.data, np.float32)
                diff = np.flatnonzero(u != v)
                return (f"{what}: {diff.size} of {u.size} floats differ, first at {diff[0]}, "
                        f"max |diff| {np.abs(u[diff] - v[diff]).max():.3g}")
            return f"{what}: the bytes differ"
    if len(a) != len(b):
        return f"{len(a)} GET_TENSOR replies against {len(b)}"
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recording", type=Path)
    ap.add_argument("--worker", action="append", required=True, help="host:port; repeat to compare workers")
    ap.add_argument("-n", "--repeat", type=int, default=1, help="replays per worker")
    args = ap.parse_args(argv)
    recorded = recorded_outputs(args.recording)
    print(f"the recording: {len(recorded)} GET_TENSOR replies")
    first = None
    status = 0
    for worker in args.worker:
        for i in range(args.repeat):
            outputs = Replayer(worker).run(args.recording)
            label = f"{worker} replay {i + 1}"
            for name, baseline in (("the recording", recorded), *([first] if first else [])):
                diff = first_difference(baseline, outputs)
                print(f"{label}: " + (f"same as {name}" if diff is None else f"differs from {name}: {diff}"))
            if first is None:
                first = (label, outputs)
            else:
                status |= diff is not None  # against the first replay
    return status


if __name__ == "__main__":
    sys.exit(main())
