"""A protocol-aware tracing proxy: sits between an RPC client and a worker and records what flows.

    python tools/trace_proxy.py --worker 127.0.0.1:50052 [--listen 127.0.0.1:50060] [-o trace]
    llama-completion -m model.gguf --rpc 127.0.0.1:50060 -ngl 99 -p Hello     # in another shell

Bytes pass through unchanged in both directions. The client's side is parsed with the shared codec
(wire.protocol): every command is counted, and every GRAPH_COMPUTE node is logged as
[op, name, ne, type, op_params[:6], sources (type, ne, nb)] in <trace>.graphs.jsonl, one line per
graph; <trace>.summary.json counts commands and the distinct (op, result type, source types).
That is how we learn which ops and types a real client sends for a given model.

With --record FILE it also saves the session for tools/replay.py: every request frame of every
connection and every reply, in the order they passed (see Recording for the format).
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import socket
import struct
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from wire import framing, protocol as p  # noqa: E402
from wire.ggml import GGMLGluOp, GGMLOp, GGMLType, GGMLUnaryOp  # noqa: E402
from wire.protocol import Command  # noqa: E402

MAX_FRAME = 1 << 34


def _name(enum, value: int) -> str:
    try:
        return enum(value).name
    except ValueError:
        return f"?{value}"


def op_label(rec) -> str:
    """'MUL_MAT', or 'UNARY:SILU' / 'GLU:SWIGLU' for ops whose sub-op is op_params[0]."""
    op = _name(GGMLOp, int(rec["op"]))
    if op == "UNARY":
        return f"UNARY:{_name(GGMLUnaryOp, int(rec['op_params'][0]))}"
    if op == "GLU":
        return f"GLU:{_name(GGMLGluOp, int(rec['op_params'][0]))}"
    return op


def describe_graph(request: p.GraphComputeRequest) -> list:
    records = {int(r["id"]): r for r in request.tensors}
    nodes = []
    for node_id in request.nodes:
        rec = records.get(int(node_id))
        if rec is None:
            continue
        sources = [[_name(GGMLType, int(records[s]["type"])), records[s]["ne"].tolist(), records[s]["nb"].tolist()]
                   for s in map(int, rec["src"]) if s and s in records]
        nodes.append([op_label(rec), rec["name"].split(b"\0", 1)[0].decode("utf-8", "replace"), rec["ne"].tolist(),
                      _name(GGMLType, int(rec["type"])), rec["op_params"][:6].tolist(), sources])
    return nodes


class Trace:
    """What the proxy saw, across all its connections (thread-safe)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.commands: collections.Counter = collections.Counter()
        self.command_bytes: collections.Counter = collections.Counter()
        self.ops: collections.Counter = collections.Counter()
        self.graphs: list[list] = []

    def record(self, frame: framing.Frame) -> None:
        graph = None
        if frame.command == Command.GRAPH_COMPUTE:
            graph = describe_graph(p.GraphComputeRequest.decode(frame.payload))
        with self.lock:
            self.commands[frame.command.name] += 1
            self.command_bytes[frame.command.name] += len(frame.payload)
            if graph is not None:
                self.graphs.append(graph)
                for op, _, _, type_, _, sources in graph:
                    self.ops[(op, type_, tuple(s[0] for s in sources))] += 1

    def summary(self) -> dict:
        with self.lock:
            return {
                "commands": dict(self.commands),
                "command_bytes": dict(self.command_bytes),
                "ops": [[op, type_, list(srcs), n] for (op, type_, srcs), n in sorted(self.ops.items())],
            }

    def save(self, stem: Path) -> None:
        stem.parent.mkdir(parents=True, exist_ok=True)
        Path(f"{stem}.summary.json").write_text(json.dumps(self.summary(), indent=1))
        with self.lock, open(f"{stem}.graphs.jsonl", "w") as out:
            for graph in self.graphs:
                out.write(json.dumps(graph) + "\n")


class Recording:
    """A session file for tools/replay.py: MAGIC, then entries of ENTRY header + payload.

    An entry is (connection number, kind, command, payload): a REQUEST is a frame's payload as the
    client sent it, a REPLY the worker's reply payload to the connection's oldest request still
    awaiting one, CLOSED the end of a connection. Each entry is written before its bytes are passed
    on, so a reply always follows its request and precedes the requests that could depend on it.
    """

    MAGIC = b"PYRPCREC\x01\x00\x00\x00"
    ENTRY = struct.Struct("<IBBQ")  # connection, kind, command, payload size
    REQUEST, REPLY, CLOSED = 0, 1, 2

    def __init__(self, path: Path):
        self.lock = threading.Lock()
        self.file = open(path, "wb")
        self.file.write(self.MAGIC)

    def write(self, conn: int, kind: int, command: int, payload=b"") -> None:
        with self.lock:
            if not self.file.closed:
                self.file.write(self.ENTRY.pack(conn, kind, command, len(payload)))
                self.file.write(payload)

    def close(self) -> None:
        with self.lock:
            self.file.close()


class TraceProxy:
    """Listens on `listen`; each client connection gets its own connection to `worker`."""

    def __init__(self, worker: str, listen: str = "127.0.0.1:0", record: Path | None = None):
        self.recording = Recording(Path(record)) if record is not None else None
        self._conn_ids = itertools.count()
        host, _, port = worker.rpartition(":")
        self.worker = (host, int(port))
        lhost, _, lport = listen.rpartition(":")
        self.server = socket.create_server((lhost, int(lport)))
        self.address = "%s:%d" % self.server.getsockname()[:2]
        self.trace = Trace()
        self.parse_errors: list[str] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.worker)
            except OSError:
                client.close()
                continue
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = next(self._conn_ids)
            awaiting: collections.deque = collections.deque()  # commands whose replies are still to come
            threading.Thread(target=self._pump, args=(client, upstream, conn, awaiting, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, conn, awaiting, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, conn: int, awaiting: collections.deque,
              requests: bool) -> None:
        """Relay src to dst; parse (and record) what passes before it is passed on."""
        rec = self.recording
        if requests:
            reader = framing.FrameReader(lambda command: MAX_FRAME)
        else:
            reader = framing.ResponseReader(MAX_FRAME) if rec is not None else None
        try:
            while chunk := src.recv(1 << 20):
                if reader is not None:
                    try:
                        reader.feed(chunk)
                        if requests:
                            while (frame := reader.next_frame()) is not None:
                                self.trace.record(frame)
                                if rec is not None:
                                    rec.write(conn, rec.REQUEST, frame.command, frame.payload)
                                    if p.COMMANDS[frame.command].response is not None:
                                        awaiting.append(frame.command)
                        else:
                            while awaiting and (reply := reader.next_payload(awaiting[0])) is not None:
                                rec.write(conn, rec.REPLY, awaiting.popleft(), reply)
                    except (p.ProtocolError, ValueError) as exc:
                        self.parse_errors.append(str(exc))
                        reader = None  # keep relaying, stop parsing this connection
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            if requests and rec is not None:
                rec.write(conn, rec.CLOSED, 0)
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def close(self) -> None:
        self._closed = True
        self.server.close()
        if self.recording is not None:
            self.recording.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", required=True, help="host:port of the worker to forward to")
    ap.add_argument("--listen", default="127.0.0.1:50060", help="host:port to accept clients on")
    ap.add_argument("-o", "--out", default="trace", help="output stem: <out>.summary.json, <out>.graphs.jsonl")
    ap.add_argument("--record", default=None, help="also save the session to this file for tools/replay.py")
    args = ap.parse_args(argv)
    proxy = TraceProxy(args.worker, args.listen, record=args.record)
    print(f"tracing {proxy.address} -> {args.worker}; Ctrl-C writes {args.out}.summary.json and .graphs.jsonl",
          file=sys.stderr)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    proxy.close()
    proxy.trace.save(Path(args.out))
    for error in proxy.parse_errors:
        print(f"parse error: {error}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
