"""A protocol-aware TCP proxy that adds network latency to chosen RPC commands, both ways.

    python tools/latency_proxy.py --worker 127.0.0.1:50052 --latency-ms 10 [--listen 127.0.0.1:50060]
        [--jitter-ms 2] [--mode compute|transfer|all] [--serial] [--delay-from-start] [--seed N]
    llama-completion -m model.gguf --rpc 127.0.0.1:50060 -ngl 99 -p Hello     # in another shell

It prints `listening on HOST:PORT` on stdout once it accepts connections (`--listen` defaults to a free
port on 127.0.0.1), then one summary line per closed connection (frames delayed per command).

Every byte passes through unchanged. Both streams are cut into frames with the shared codec
(wire.framing: FrameReader for the client's requests, ResponseReader for the worker's replies,
each reply matched to the oldest request still awaiting one), so delays apply per command:

    compute   GRAPH_COMPUTE, GRAPH_RECOMPUTE
    transfer  those and GET_TENSOR, SET_TENSOR, SET_TENSOR_HASH, COPY_TENSOR, PEER_WRITE
    all       every command

The model is a link with a one-way latency: a delayed frame reaches the far side `latency` after it
left (each byte of a large frame `latency` after the proxy received it); frames in flight PIPELINE
(ten frames sent together arrive together, one latency later); the reply to a delayed command travels
back with its own one-way latency. Each direction of each connection has its own scheduler (frames
queued with the time they are due, sent in order by a writer thread), so the directions and the
connections delay independently, and nothing is ever reordered: a frame is due at the latest of its
own time and the previous frame's, which is also what keeps an undelayed frame behind a delayed one.
`--jitter-ms J` draws each frame's latency uniformly from [X-J, X+J] (`--seed` makes it repeatable).

Delays start with the first GRAPH_COMPUTE (or, on a worker-to-worker link, PEER_WRITE) of a connection
(that one included), so the weight upload before it is not slowed; `--delay-from-start` delays from the first byte.

`--serial` reproduces the published llama.cpp latency proxy, for comparable figures: the request
reader sleeps the latency before forwarding each delayed command (no pipelining: ten frames cost ten
latencies) and replies are not delayed.

The proxy assumes nothing about its peers beyond the protocol, so proxies chain (client -> proxy ->
proxy -> worker). A stream the codec cannot parse (ProtocolError) is logged in one line and that
connection falls back to plain byte pass-through without delays; other connections are unaffected.

From Python (tools/bench_pipeline.py):

    with LatencyProxy("127.0.0.1:50052", latency_s=0.010, mode="transfer") as proxy:
        run_client(proxy.address)        # "host:port"; proxy.start() returned (host, port)
    proxy.closed                         # ConnectionStats of each closed connection
"""

from __future__ import annotations

import argparse
import collections
import itertools
import logging
import random
import signal
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from wire import framing  # noqa: E402
from wire.protocol import COMMANDS, Command, ProtocolError  # noqa: E402

MAX_FRAME = 1 << 34  # the largest payload the codec may be asked to hold; beyond: a broken stream
RECV_SIZE = 1 << 18
MAX_QUEUED = 64 << 20  # bytes waiting in one direction's scheduler before its reader stops reading
COALESCE = 1 << 16  # ready frames up to this total are joined into one send
HEADER = framing.FrameReader.HEADER  # command:u8 size:u64
CONNECT_TIMEOUT = 10.0

COMPUTE = frozenset({Command.GRAPH_COMPUTE, Command.GRAPH_RECOMPUTE})
TRANSFER = COMPUTE | {Command.GET_TENSOR, Command.SET_TENSOR, Command.SET_TENSOR_HASH, Command.COPY_TENSOR,
                      Command.PEER_WRITE}
MODES: dict[str, frozenset] = {"compute": COMPUTE, "transfer": TRANSFER, "all": frozenset(Command)}

_log = logging.getLogger("latency_proxy")


def parse_address(address) -> tuple[str, int]:
    """"host:port" (or a (host, port) pair) -> (host, port)."""
    if isinstance(address, str):
        host, _, port = address.rpartition(":")
        return host.strip("[]") or "127.0.0.1", int(port)
    host, port = address[:2]
    return str(host), int(port)


class Link:
    """One direction of one connection: bytes queued with the time they are due at the far end,
    written in order by a thread of its own. `put` never blocks for the delay (frames in flight
    pipeline); it blocks only while more than MAX_QUEUED bytes are in flight (a TCP window)."""

    def __init__(self, sock: socket.socket, name: str, on_error: Callable[[OSError], None],
                 on_done: Callable[[], None]):
        self.sock = sock
        self._queue: collections.deque = collections.deque()  # (due, bytes-like)
        self._queued = 0
        self._last_due = 0.0
        self._cv = threading.Condition()
        self._finished = False
        self._aborted = threading.Event()
        self._on_error = on_error
        self._on_done = on_done
        self.bytes = 0
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def put(self, data, due: float) -> None:
        """Queue `data` to leave at monotonic time `due`, or after what is queued before it."""
        self.put_all([(data, due)])

    def put_all(self, pieces: list) -> None:
        """put() each (data, due) in order, waking the writer once (what one recv brought goes together)."""
        with self._cv:
            while self._queued > MAX_QUEUED and not self._aborted.is_set():
                self._cv.wait(0.5)
            for data, due in pieces:
                if data:
                    due = self._last_due = max(due, self._last_due)
                    self._queue.append((due, data))
                    self._queued += len(data)
            self._cv.notify_all()

    def finish(self) -> None:
        """No more data: send what is queued, each piece when due, then shut the socket's write side."""
        with self._cv:
            self._finished = True
            self._cv.notify_all()

    def abort(self) -> None:
        with self._cv:
            self._aborted.set()
            self._queue.clear()
            self._queued = 0
            self._cv.notify_all()

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._queue and not self._finished and not self._aborted.is_set():
                        self._cv.wait()
                    if self._aborted.is_set():
                        return
                    if not self._queue:
                        break
                    due = self._queue[0][0]
                wait = due - time.monotonic()
                if wait > 0 and self._aborted.wait(wait):
                    return
                with self._cv:
                    now = time.monotonic()
                    batch = []
                    while self._queue and self._queue[0][0] <= now:
                        batch.append(self._queue.popleft()[1])
                    self._queued -= sum(len(b) for b in batch)
                    self._cv.notify_all()
                self._send(batch)
            try:
                self.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        except OSError as exc:
            if not self._aborted.is_set():
                self._on_error(exc)
        finally:
            self._on_done()

    def _send(self, batch: list) -> None:
        small: list = []
        size = 0
        for data in batch:
            if len(data) >= COALESCE:
                if small:
                    self.sock.sendall(b"".join(small))
                    small, size = [], 0
                self.sock.sendall(data)
            else:
                small.append(data)
                size += len(data)
                if size >= COALESCE:
                    self.sock.sendall(b"".join(small))
                    small, size = [], 0
            self.bytes += len(data)
        if small:
            self.sock.sendall(b"".join(small) if len(small) > 1 else small[0])


@dataclass
class ConnectionStats:
    """What one connection saw; `delayed`/`replies_delayed` count frames per command name."""

    number: int
    requests: collections.Counter = field(default_factory=collections.Counter)
    delayed: collections.Counter = field(default_factory=collections.Counter)
    replies: collections.Counter = field(default_factory=collections.Counter)
    replies_delayed: collections.Counter = field(default_factory=collections.Counter)
    bytes_up: int = 0
    bytes_down: int = 0
    fallback: str | None = None  # why the connection went to plain pass-through
    seconds: float = 0.0

    def summary(self) -> str:
        def counts(counter):
            return ", ".join(f"{name} {n}" for name, n in sorted(counter.items())) or "none"

        line = (f"connection {self.number} closed after {self.seconds:.1f} s: {sum(self.requests.values())} "
                f"requests ({self.bytes_up} B), {sum(self.replies.values())} replies ({self.bytes_down} B); "
                f"delayed: {counts(self.delayed)}; replies delayed: {counts(self.replies_delayed)}")
        if self.fallback:
            line += f"; pass-through after: {self.fallback}"
        return line


class _Connection:
    """One client connection and its own upstream connection: two readers, two Links."""

    def __init__(self, proxy: "LatencyProxy", number: int, client: socket.socket, upstream: socket.socket):
        self.proxy = proxy
        self.client, self.upstream = client, upstream
        self.stats = ConnectionStats(number)
        self.started = time.monotonic()
        seed = proxy.seed
        self._rng_up = random.Random(None if seed is None else f"{seed}/{number}/up")
        self._rng_down = random.Random(None if seed is None else f"{seed}/{number}/down")
        self.armed = proxy.delay_from_start  # delays start with the first GRAPH_COMPUTE
        self.passthrough = False
        self.awaiting: collections.deque = collections.deque()  # (command, delayed) awaiting a reply
        self._lock = threading.Lock()
        self._running = 4
        self._aborted = False
        self.up = Link(upstream, f"latency-proxy-{number}-up", self._link_error, self._thread_done)
        self.down = Link(client, f"latency-proxy-{number}-down", self._link_error, self._thread_done)
        for target, name in ((self._pump_requests, "requests"), (self._pump_replies, "replies")):
            threading.Thread(target=target, name=f"latency-proxy-{number}-{name}", daemon=True).start()

    # -- delays ------------------------------------------------------------------------------------

    def _latency(self, rng: random.Random) -> float:
        p = self.proxy
        if p.jitter_s <= 0:
            return p.latency_s
        return max(0.0, rng.uniform(p.latency_s - p.jitter_s, p.latency_s + p.jitter_s))

    def _request_latency(self, command: Command) -> float | None:
        """The latency of a request frame, None when it is not delayed."""
        if command in (Command.GRAPH_COMPUTE, Command.PEER_WRITE):  # a peer link carries no weight upload
            self.armed = True
        if not self.armed or command not in self.proxy.commands or self.proxy.latency_s <= 0:
            return None
        return self._latency(self._rng_up)

    def _fall_back(self, reason: str, where: str) -> None:
        with self._lock:
            if self.passthrough:
                return
            self.passthrough = True
            self.stats.fallback = f"{where}: {reason}"
        self.proxy._log(f"latency proxy: connection {self.stats.number}: cannot parse the {where} "
                        f"({reason}); passing its bytes through without delays")

    # -- client -> worker --------------------------------------------------------------------------

    def _pump_requests(self) -> None:
        # first_command=None: the worker enforces HELLO-first itself; we only need the frame boundaries
        reader = framing.FrameReader(lambda command: MAX_FRAME, first_command=None)
        header = bytearray()  # the current frame's header as far as received
        pending: list = []  # its header bytes, held until the command is known
        remaining = 0  # payload bytes of the current frame still to come
        latency: float | None = None  # the current frame's latency; None: not delayed
        up, stats, serial = self.up, self.stats, self.proxy.serial
        try:
            while chunk := self.client.recv(RECV_SIZE):
                now = time.monotonic()
                stats.bytes_up += len(chunk)
                if self.passthrough:  # (perhaps set by the replies' side, with a header held here)
                    for data in pending:
                        up.put(data, now)
                    pending = []
                    up.put(chunk, now)
                    continue
                view = memoryview(chunk)
                off = 0
                out: list = []  # (piece, due) of this chunk, queued together
                try:
                    while off < len(view):
                        target = reader.get_buffer()
                        n = min(len(target), len(view) - off)
                        piece = view[off : off + n]
                        target[:n] = piece
                        reader.buffer_updated(n)  # raises ProtocolError on a broken header
                        off += n
                        if len(header) < HEADER:
                            header += piece
                            pending.append(piece)
                            if len(header) < HEADER:
                                continue
                            command = Command(header[0])
                            remaining = struct.unpack_from("<Q", header, 1)[0]
                            stats.requests[command.name] += 1
                            latency = self._request_latency(command)
                            if latency is not None:
                                stats.delayed[command.name] += 1
                            if COMMANDS[command].response is not None:  # before any byte can reach the worker
                                self.awaiting.append((command, latency is not None))
                            if serial and latency is not None:
                                up.put_all(out)  # what came before leaves first
                                out = []
                                time.sleep(latency)  # the published proxy: the reader itself waits
                            out.extend((data, self._due(now, latency)) for data in pending)
                            pending = []
                        else:
                            remaining -= n
                            out.append((piece, self._due(now, latency)))
                        if remaining == 0:
                            if reader.next_frame() is None:  # the codec and we disagree: stop parsing
                                raise ProtocolError("frame boundary mismatch")
                            header = bytearray()
                            latency = None
                except (ProtocolError, ValueError, MemoryError) as exc:
                    self._fall_back(str(exc), "requests")
                    out.extend((data, now) for data in pending)
                    pending = []
                    out.append((view[off:], now))
                up.put_all(out)
        except OSError:
            self.abort()
        finally:
            self.up.finish()
            self._thread_done()

    def _due(self, now: float, latency: float | None) -> float:
        if latency is None or self.proxy.serial:
            return now
        return now + latency

    # -- worker -> client --------------------------------------------------------------------------

    def _pump_replies(self) -> None:
        reader = framing.ResponseReader(MAX_FRAME)
        seen = 0  # bytes of the current reply already passed on
        latency: float | None = None  # the current reply's latency
        down, stats = self.down, self.stats
        try:
            while chunk := self.upstream.recv(RECV_SIZE):
                now = time.monotonic()
                stats.bytes_down += len(chunk)
                if self.passthrough:
                    down.put(chunk, now)
                    continue
                view = memoryview(chunk)
                off = 0
                out: list = []  # (piece, due) of this chunk, queued together
                try:
                    reader.feed(chunk)
                    while off < len(view):
                        if not self.awaiting:
                            raise ProtocolError(f"{len(view) - off} bytes from the worker answer no request")
                        command, delayed = self.awaiting[0]
                        if seen == 0:
                            latency = self._latency(self._rng_down) if delayed and not self.proxy.serial else None
                        payload = reader.next_payload(command)
                        if payload is None:  # the rest of the chunk is part of this reply
                            seen += len(view) - off
                            out.append((view[off:], self._due(now, latency)))
                            off = len(view)
                            break
                        n = 8 + len(payload) - seen
                        out.append((view[off : off + n], self._due(now, latency)))
                        off += n
                        seen = 0
                        self.awaiting.popleft()
                        stats.replies[command.name] += 1
                        if latency is not None:
                            stats.replies_delayed[command.name] += 1
                except (ProtocolError, ValueError, MemoryError) as exc:
                    self._fall_back(str(exc), "replies")
                    out.append((view[off:], now))
                down.put_all(out)
        except OSError:
            self.abort()
        finally:
            self.down.finish()
            self._thread_done()

    # -- lifetime ----------------------------------------------------------------------------------

    def _link_error(self, exc: OSError) -> None:
        self.abort()

    def abort(self) -> None:
        """Drop the connection: both sockets shut down, nothing queued is sent."""
        with self._lock:
            if self._aborted:
                return
            self._aborted = True
        self.up.abort()
        self.down.abort()
        for s in (self.client, self.upstream):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _thread_done(self) -> None:
        with self._lock:
            self._running -= 1
            last = self._running == 0
        if last:
            for s in (self.client, self.upstream):
                s.close()
            self.stats.seconds = time.monotonic() - self.started
            self.proxy._closed_connection(self)



class LatencyProxy:
    """Listens on `listen`; each client connection gets its own connection to `worker` and its own
    pair of delaying links. `start()` returns the (host, port) it listens on; `stop()` ends it and
    drops the open connections. Usable as a context manager (entering starts it)."""

    def __init__(self, worker, latency_s: float, mode: str = "compute", jitter_s: float = 0.0,
                 serial: bool = False, delay_from_start: bool = False, listen="127.0.0.1:0",
                 seed: int | None = None, log: Callable[[str], None] | None = None,
                 on_close: Callable[[ConnectionStats], None] | None = None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if latency_s < 0 or jitter_s < 0:
            raise ValueError("latency and jitter must not be negative")
        self.worker = parse_address(worker)
        self.listen = parse_address(listen)
        self.latency_s = float(latency_s)
        self.jitter_s = float(jitter_s)
        self.mode = mode
        self.commands = MODES[mode]
        self.serial = serial
        self.delay_from_start = delay_from_start
        self.seed = seed
        self._log = log or _log.warning
        self._on_close = on_close
        self.closed: list[ConnectionStats] = []  # stats of each closed connection, in closing order
        self._active: set[_Connection] = set()
        self._lock = threading.Lock()
        self._numbers = itertools.count(1)
        self._server: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.address: str | None = None  # "host:port" once started

    def start(self) -> tuple[str, int]:
        if self._server is None:
            self._server = socket.create_server(self.listen)
            self._server.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            host, port = self._server.getsockname()[:2]
            self.address = f"{host}:{port}"
            self._thread = threading.Thread(target=self._accept, name="latency-proxy-accept", daemon=True)
            self._thread.start()
        return parse_address(self.address)

    def stop(self) -> None:
        self._stopping = True
        if self._server is not None:
            try:
                self._server.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._server.close()
        if self._thread is not None:
            self._thread.join(5)
        with self._lock:
            active = list(self._active)
        for conn in active:
            conn.abort()

    def __enter__(self) -> "LatencyProxy":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _accept(self) -> None:
        while not self._stopping:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.worker, timeout=CONNECT_TIMEOUT)
                upstream.settimeout(None)
            except OSError as exc:
                self._log(f"latency proxy: cannot connect to {self.worker[0]}:{self.worker[1]}: {exc}")
                client.close()
                continue
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self._stopping:
                    client.close()
                    upstream.close()
                    return
                self._active.add(_Connection(self, next(self._numbers), client, upstream))

    def _closed_connection(self, conn: _Connection) -> None:
        with self._lock:
            self._active.discard(conn)
            self.closed.append(conn.stats)
        if self._on_close is not None:
            try:
                self._on_close(conn.stats)
            except Exception as exc:  # a reporting callback must not take the proxy down
                self._log(f"latency proxy: on_close failed: {exc!r}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", required=True, help="host:port of the worker (or of the next proxy)")
    ap.add_argument("--listen", default="127.0.0.1:0", help="host:port to accept clients on (default: a free port)")
    ap.add_argument("--latency-ms", type=float, required=True, help="one-way latency of a delayed frame")
    ap.add_argument("--jitter-ms", type=float, default=0.0, help="latency drawn uniformly from [X-J, X+J]")
    ap.add_argument("--mode", choices=list(MODES), default="compute", help="which commands are delayed")
    ap.add_argument("--serial", action="store_true",
                    help="as the published proxy: sleep before each delayed command, no pipelining, replies undelayed")
    ap.add_argument("--delay-from-start", action="store_true",
                    help="delay from the first byte, not from the first GRAPH_COMPUTE")
    ap.add_argument("--seed", type=int, default=None, help="seed of the jitter")
    args = ap.parse_args(argv)

    def out(line: str) -> None:
        print(line, flush=True)

    def err(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    proxy = LatencyProxy(args.worker, args.latency_ms / 1000, args.mode, jitter_s=args.jitter_ms / 1000,
                         serial=args.serial, delay_from_start=args.delay_from_start, listen=args.listen,
                         seed=args.seed, log=err, on_close=lambda stats: out(stats.summary()))
    try:
        proxy.start()
    except OSError as exc:
        err(f"latency proxy: cannot listen on {args.listen}: {exc}")
        return 1
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    out(f"listening on {proxy.address}")
    err(f"latency proxy {proxy.address} -> {args.worker}: mode {args.mode}, {args.latency_ms:g} ms"
        f"{f' ± {args.jitter_ms:g} ms' if args.jitter_ms else ''} one-way, "
        f"{'serial' if args.serial else 'pipelined'}, delays from "
        f"{'the start' if args.delay_from_start else 'the first GRAPH_COMPUTE'}")
    try:
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    proxy.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
