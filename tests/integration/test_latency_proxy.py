"""tools/latency_proxy.py over real sockets, between a raw client and a tiny fake worker.

Timings are asserted only as the proxy guarantees them: a delay is a lower bound, and frames sent
together must arrive in well under the sum of their delays (pipelining).
"""

from __future__ import annotations

import random
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from wire.framing import FrameReader
from wire.protocol import COMMANDS, Command, ProtocolError
from tool_modules import load_tool

latency_proxy = load_tool("latency_proxy")
MODES, LatencyProxy = latency_proxy.MODES, latency_proxy.LatencyProxy

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 20.0
BAD_HELLO = b"\xee" * 24  # a HELLO the fake worker answers with a reply of the wrong size


# -- frames -----------------------------------------------------------------------------------------

def frame(command: Command, payload: bytes = b"") -> bytes:
    return struct.pack("<BQ", command, len(payload)) + payload


def fixed(command: Command, fill: int = 0) -> bytes:
    return frame(command, bytes([fill]) * COMMANDS[command].request_size)


def hello() -> bytes:
    return frame(Command.HELLO, bytes(24))


def graph(tag: int = 0) -> bytes:
    return frame(Command.GRAPH_COMPUTE, struct.pack("<II", 0, tag) + bytes(64))


def get_tensor(offset: int, size: int) -> bytes:
    return frame(Command.GET_TENSOR, bytes(296) + struct.pack("<QQ", offset, size))


def set_tensor(data: bytes) -> bytes:
    return frame(Command.SET_TENSOR, bytes(296) + b"\0" + struct.pack("<Q", 0) + data)


def reply_payload(command: Command, payload: bytes) -> bytes:
    """What the fake worker answers (deterministic, so a client can check it)."""
    if command == Command.GET_TENSOR:
        offset, size = struct.unpack_from("<QQ", payload, 296)
        return ((np.arange(size) + offset) % 251).astype(np.uint8).tobytes()
    if command == Command.HELLO and payload == BAD_HELLO:
        return b"\x07" * 100
    size = COMMANDS[command].response.wire_size()
    return bytes((command + i) % 256 for i in range(size))


# -- the fake worker --------------------------------------------------------------------------------

class FakeConnection:
    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.received = bytearray()
        self.sent = bytearray()
        self.frames: list[tuple[float, Command, bytes]] = []  # (arrival, command, payload)
        self.broken = False  # the stream stopped parsing: from then on it echoes
        self.closed = False
        self.cv = threading.Condition()
        threading.Thread(target=self._serve, daemon=True).start()

    def _send(self, data: bytes) -> None:
        self.sent += data
        self.sock.sendall(data)

    def _serve(self) -> None:
        reader = FrameReader(lambda command: 1 << 30)
        try:
            while chunk := self.sock.recv(1 << 18):
                now = time.monotonic()
                with self.cv:
                    self.received += chunk
                    self.cv.notify_all()
                if self.broken:
                    self._send(chunk)
                    continue
                try:
                    reader.feed(chunk)
                except ProtocolError:
                    self.broken = True
                    self._send(b"garbage!")
                    continue
                while (f := reader.next_frame()) is not None:
                    payload = bytes(f.payload)
                    with self.cv:
                        self.frames.append((now, f.command, payload))
                        self.cv.notify_all()
                    if COMMANDS[f.command].response is not None:
                        body = reply_payload(f.command, payload)
                        self._send(struct.pack("<Q", len(body)) + body)
        except OSError:
            pass
        finally:
            self.sock.close()
            with self.cv:
                self.closed = True
                self.cv.notify_all()

    def wait_frames(self, n: int) -> list:
        with self.cv:
            assert self.cv.wait_for(lambda: len(self.frames) >= n or self.closed, TIMEOUT)
            assert len(self.frames) >= n
            return list(self.frames)

    def wait_received(self, n: int) -> None:
        with self.cv:
            assert self.cv.wait_for(lambda: len(self.received) >= n, TIMEOUT)

    def wait_closed(self) -> None:
        with self.cv:
            assert self.cv.wait_for(lambda: self.closed, TIMEOUT)


class FakeWorker:
    def __init__(self):
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = "127.0.0.1:%d" % self.server.getsockname()[1]
        self.connections: list[FakeConnection] = []
        self.cv = threading.Condition()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.server.accept()
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self.cv:
                self.connections.append(FakeConnection(sock))
                self.cv.notify_all()

    def connection(self, index: int) -> FakeConnection:
        with self.cv:
            assert self.cv.wait_for(lambda: len(self.connections) > index, TIMEOUT)
            return self.connections[index]

    def close(self) -> None:
        self.server.close()


@pytest.fixture
def fake_worker():
    w = FakeWorker()
    yield w
    w.close()


# -- a raw client -----------------------------------------------------------------------------------

class Client:
    def __init__(self, address: str):
        host, _, port = address.rpartition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=TIMEOUT)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sent = bytearray()
        self.received = bytearray()

    def send(self, data: bytes) -> float:
        """Sends and returns the time it started sending."""
        t = time.monotonic()
        self.sent += data
        self.sock.sendall(data)
        return t

    def recv_exact(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            assert chunk, "connection closed early"
            out += chunk
        self.received += out
        return bytes(out)

    def reply(self) -> bytes:
        (size,) = struct.unpack("<Q", self.recv_exact(8))
        return self.recv_exact(size)

    def finish(self) -> bytes:
        """Half-close and read everything up to the proxy's end of stream."""
        self.sock.shutdown(socket.SHUT_WR)
        rest = bytearray()
        while chunk := self.sock.recv(1 << 16):
            rest += chunk
        self.received += rest
        self.sock.close()
        return bytes(rest)

    def round_trip(self, command: Command, data: bytes) -> tuple[float, bytes]:
        t0 = self.send(data)
        body = self.reply()
        return time.monotonic() - t0, body


def wait_closed(proxy: LatencyProxy, n: int):
    deadline = time.monotonic() + TIMEOUT
    while len(proxy.closed) < n:
        assert time.monotonic() < deadline, "proxy did not report the connection closed"
        time.sleep(0.01)
    return proxy.closed


# -- tests ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode,from_start", [("all", True), ("compute", False)])
def test_bytes_pass_through_unchanged(fake_worker, mode, from_start):
    rng = random.Random(1)
    big = rng.randbytes(3 << 20)
    stream = (hello() + set_tensor(big) + fixed(Command.INIT_TENSOR, 3) + graph(1) + get_tensor(5, 2 << 20)
              + fixed(Command.GET_ALLOC_SIZE, 1) + fixed(Command.GRAPH_RECOMPUTE) + set_tensor(b"x" * 1000)
              + frame(Command.DEVICE_COUNT) + fixed(Command.COPY_TENSOR, 9) + get_tensor(7, 100))
    expected_replies = [(Command.HELLO, bytes(24)), (Command.GET_TENSOR, get_tensor(5, 2 << 20)[9:]),
                        (Command.GET_ALLOC_SIZE, b"\1" * 3260), (Command.DEVICE_COUNT, b""),
                        (Command.COPY_TENSOR, b"\x09" * 592), (Command.GET_TENSOR, get_tensor(7, 100)[9:])]
    with LatencyProxy(fake_worker.address, 0.02, mode, jitter_s=0.01, delay_from_start=from_start, seed=5) as proxy:
        client = Client(proxy.address)

        def dribble():  # odd pieces, the first headers byte by byte
            pos = 0
            for size in [1] * 12 + [rng.randrange(1, 300_000) for _ in range(1000)]:
                if pos >= len(stream):
                    break
                client.send(stream[pos : pos + size])
                pos += size
            client.send(stream[pos:])

        sender = threading.Thread(target=dribble)
        sender.start()
        for command, payload in expected_replies:
            assert client.reply() == reply_payload(command, payload)
        sender.join()
        fake = fake_worker.connection(0)
        fake.wait_frames(11)
        client.finish()
        fake.wait_closed()
        (stats,) = wait_closed(proxy, 1)
    assert bytes(fake.received) == stream == bytes(client.sent)
    assert bytes(client.received) == bytes(fake.sent)
    assert [c for _, c, _ in fake.frames] == [Command.HELLO, Command.SET_TENSOR, Command.INIT_TENSOR,
                                              Command.GRAPH_COMPUTE, Command.GET_TENSOR, Command.GET_ALLOC_SIZE,
                                              Command.GRAPH_RECOMPUTE, Command.SET_TENSOR, Command.DEVICE_COUNT,
                                              Command.COPY_TENSOR, Command.GET_TENSOR]
    assert stats.fallback is None
    assert sum(stats.requests.values()) == 11 and sum(stats.replies.values()) == 6
    if mode == "all":
        assert stats.delayed == stats.requests and stats.replies_delayed == stats.replies
    else:
        assert dict(stats.delayed) == {"GRAPH_COMPUTE": 1, "GRAPH_RECOMPUTE": 1} and not stats.replies_delayed
    assert stats.bytes_up == len(stream) and stats.bytes_down == len(fake.sent)


PROBES = [graph(2), fixed(Command.GRAPH_RECOMPUTE), set_tensor(b"abc" * 100), get_tensor(1, 64),
          fixed(Command.SET_TENSOR_HASH), fixed(Command.COPY_TENSOR), fixed(Command.INIT_TENSOR),
          fixed(Command.BUFFER_GET_BASE), fixed(Command.GET_ALLOC_SIZE), frame(Command.DEVICE_COUNT),
          fixed(Command.MEMSET_TENSOR), fixed(Command.FREE_BUFFER)]


@pytest.mark.parametrize("mode", list(MODES))
def test_only_the_modes_commands_are_delayed(fake_worker, mode):
    latency = 0.08
    delayed_set = MODES[mode]
    with LatencyProxy(fake_worker.address, latency, mode) as proxy:
        client = Client(proxy.address)
        client.round_trip(Command.HELLO, hello())
        client.send(graph(1))  # arms the delays
        fake = fake_worker.connection(0)
        fake.wait_frames(2)
        for data in PROBES:
            command = Command(data[0])
            n = len(fake.frames)
            t0 = client.send(data)
            arrival = fake.wait_frames(n + 1)[n][0] - t0
            assert fake.frames[n][1] == command
            if command in delayed_set:
                assert arrival >= latency, command
            if COMMANDS[command].response is not None:
                body = client.reply()
                elapsed = time.monotonic() - t0
                assert body == reply_payload(command, data[9:])
                if command in delayed_set:
                    assert elapsed >= 2 * latency, command  # there and back
        client.finish()
        (stats,) = wait_closed(proxy, 1)
    sent = [Command(d[0]) for d in PROBES]
    expect = {c.name: sent.count(c) for c in sent if c in delayed_set}
    expect["GRAPH_COMPUTE"] += 1  # the first one, which armed them, is delayed too
    assert dict(stats.delayed) == expect
    assert dict(stats.replies_delayed) == {c.name: 1 for c in sent if c in delayed_set and COMMANDS[c].response}
    assert bytes(fake.received) == bytes(client.sent) and bytes(client.received) == bytes(fake.sent)


def test_delays_start_with_the_first_graph_compute(fake_worker):
    latency = 0.5
    proxy = LatencyProxy(fake_worker.address, latency, "transfer")
    host, port = proxy.start()
    try:
        client = Client(f"{host}:{port}")
        t0 = time.monotonic()
        client.round_trip(Command.HELLO, hello())
        client.send(set_tensor(bytes(1 << 16)))
        client.round_trip(Command.GET_TENSOR, get_tensor(0, 1000))
        assert time.monotonic() - t0 < latency  # the upload phase is not slowed
        fake = fake_worker.connection(0)
        t0 = client.send(graph(1))
        assert fake.wait_frames(4)[3][0] - t0 >= latency
        elapsed, _ = client.round_trip(Command.GET_TENSOR, get_tensor(0, 1000))
        assert elapsed >= 2 * latency
        client.finish()
        (stats,) = wait_closed(proxy, 1)
    finally:
        proxy.stop()
    assert dict(stats.delayed) == {"GRAPH_COMPUTE": 1, "GET_TENSOR": 1}
    assert dict(stats.replies_delayed) == {"GET_TENSOR": 1}
    assert stats.requests["SET_TENSOR"] == 1 and stats.requests["GET_TENSOR"] == 2


def test_delay_from_start(fake_worker):
    latency = 0.05
    with LatencyProxy(fake_worker.address, latency, "all", delay_from_start=True) as proxy:
        client = Client(proxy.address)
        elapsed, _ = client.round_trip(Command.HELLO, hello())
        assert elapsed >= 2 * latency
        client.finish()
        (stats,) = wait_closed(proxy, 1)
    assert dict(stats.delayed) == {"HELLO": 1} and dict(stats.replies_delayed) == {"HELLO": 1}


def test_frames_sent_together_arrive_together(fake_worker):
    latency, n = 0.05, 10
    with LatencyProxy(fake_worker.address, latency, "transfer", delay_from_start=True) as proxy:
        client = Client(proxy.address)
        client.send(hello())  # undelayed in transfer mode
        client.reply()
        fake = fake_worker.connection(0)
        t0 = client.send(b"".join(graph(i) for i in range(n)))
        arrivals = [t - t0 for t, _, _ in fake.wait_frames(1 + n)[1:]]
        assert min(arrivals) >= latency
        assert max(arrivals) < n / 2 * latency  # one latency for all, not ten
        # and back: ten GET_TENSORs in flight together, each reply delayed on its way back
        t0 = client.send(b"".join(get_tensor(i, 256) for i in range(n)))
        firsts = []
        for i in range(n):
            assert client.reply() == reply_payload(Command.GET_TENSOR, get_tensor(i, 256)[9:])
            firsts.append(time.monotonic() - t0)
        assert firsts[0] >= 2 * latency
        assert firsts[-1] < n / 2 * 2 * latency
        client.finish()
        (stats,) = wait_closed(proxy, 1)
    assert dict(stats.delayed) == {"GRAPH_COMPUTE": n, "GET_TENSOR": n}
    assert dict(stats.replies_delayed) == {"GET_TENSOR": n}


def test_serial_sleeps_before_each_delayed_command_and_leaves_replies_alone(fake_worker):
    latency, n = 0.05, 10
    with LatencyProxy(fake_worker.address, latency, "transfer", serial=True, delay_from_start=True) as proxy:
        client = Client(proxy.address)
        client.round_trip(Command.HELLO, hello())
        fake = fake_worker.connection(0)
        t0 = client.send(b"".join(graph(i) for i in range(n)))
        arrivals = [t - t0 for t, _, _ in fake.wait_frames(1 + n)[1:]]
        assert arrivals[0] >= latency
        assert arrivals[-1] >= n * latency  # no pipelining
        elapsed, _ = client.round_trip(Command.GET_TENSOR, get_tensor(0, 64))
        assert elapsed >= latency
        client.finish()
        (stats,) = wait_closed(proxy, 1)
    assert dict(stats.delayed) == {"GRAPH_COMPUTE": n, "GET_TENSOR": 1}
    assert not stats.replies_delayed


def test_jitter_never_reorders(fake_worker):
    frames = []
    for i in range(300):
        frames.append(frame(Command.INIT_TENSOR, struct.pack("<Q", i) + bytes(288)))
        if i % 6 == 0:
            frames.append(get_tensor(i, 16 + i))
    with LatencyProxy(fake_worker.address, 0.02, "all", jitter_s=0.02, delay_from_start=True, seed=3) as proxy:
        client = Client(proxy.address)
        client.round_trip(Command.HELLO, hello())
        replies = []
        reader = threading.Thread(target=lambda: replies.extend(client.reply() for _ in range(50)))
        reader.start()
        for i in range(0, len(frames), 7):  # bursts a millisecond apart: each draws its own latencies
            client.send(b"".join(frames[i : i + 7]))
            time.sleep(0.001)
        reader.join(TIMEOUT)
        fake = fake_worker.connection(0)
        fake.wait_frames(1 + len(frames))
        client.finish()
        (stats,) = wait_closed(proxy, 1)
    assert [payload for _, _, payload in fake.frames[1:]] == [f[9:] for f in frames]
    assert replies == [reply_payload(Command.GET_TENSOR, get_tensor(i, 16 + i)[9:]) for i in range(0, 300, 6)]
    assert bytes(fake.received) == bytes(client.sent) and bytes(client.received) == bytes(fake.sent)
    assert stats.delayed["INIT_TENSOR"] == 300 and stats.replies_delayed["GET_TENSOR"] == 50


def test_a_broken_stream_falls_back_to_pass_through(fake_worker):
    latency = 0.2
    logged = []
    with LatencyProxy(fake_worker.address, latency, "all", log=logged.append) as proxy:
        # 1: not the protocol at all
        garbage = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(range(256))
        a = Client(proxy.address)
        a.send(garbage)
        fake_a = fake_worker.connection(0)
        fake_a.wait_received(len(garbage))
        a.send(b"more garbage")
        fake_a.wait_received(len(garbage) + 12)
        a.finish()
        # 2: a valid start, then an unknown command and a graph that is never delayed
        b = Client(proxy.address)
        b.round_trip(Command.HELLO, hello())
        bad = struct.pack("<BQ", 99, 4) + b"zzzz" + graph(1)
        b.send(bad)
        fake_b = fake_worker.connection(1)
        fake_b.wait_received(len(hello()) + len(bad))
        b.finish()
        # 3: a worker whose reply does not fit the protocol
        c = Client(proxy.address)
        c.send(frame(Command.HELLO, BAD_HELLO))
        c.recv_exact(8 + 100)
        c.send(graph(1))
        fake_c = fake_worker.connection(2)
        fake_c.wait_frames(2)
        c.finish()
        # 4: the proxy still serves, with delays
        d = Client(proxy.address)
        d.round_trip(Command.HELLO, hello())
        d.send(graph(1))
        elapsed, _ = d.round_trip(Command.GET_TENSOR, get_tensor(0, 8))
        assert elapsed >= 2 * latency  # there (beside the graph) and back
        d.finish()
        stats = {s.number: s for s in wait_closed(proxy, 4)}
    for client, fake in ((a, fake_a), (b, fake_b), (c, fake_c), (d, fake_worker.connection(3))):
        assert bytes(fake.received) == bytes(client.sent) and bytes(client.received) == bytes(fake.sent)
    assert fake_a.broken and fake_b.broken
    assert "requests" in stats[1].fallback and not stats[1].delayed
    assert "requests" in stats[2].fallback and not stats[2].delayed and stats[2].replies["HELLO"] == 1
    assert "replies" in stats[3].fallback and not stats[3].delayed
    assert stats[4].fallback is None and dict(stats[4].delayed) == {"GRAPH_COMPUTE": 1, "GET_TENSOR": 1}
    assert len(logged) == 3 and all("passing its bytes through" in line for line in logged)


def test_connections_are_independent_and_proxies_chain(fake_worker):
    latency = 0.05
    with LatencyProxy(fake_worker.address, latency, "all", delay_from_start=True) as far, \
            LatencyProxy(far.address, latency, "compute") as near:
        clients = [Client(near.address) for _ in range(2)]
        for client in clients:
            elapsed, body = client.round_trip(Command.HELLO, hello())
            assert elapsed >= 2 * latency and body == reply_payload(Command.HELLO, bytes(24))
        clients[0].send(graph(0))
        elapsed, _ = clients[0].round_trip(Command.GET_TENSOR, get_tensor(3, 10))
        assert elapsed >= 3 * latency  # near: behind the graph's latency; far: there and back
        # the other connection has not seen a GRAPH_COMPUTE: the near proxy does not delay it
        elapsed, _ = clients[1].round_trip(Command.GET_TENSOR, get_tensor(4, 10))
        assert elapsed >= 2 * latency
        for client in clients:
            client.finish()
        near_stats = sorted(wait_closed(near, 2), key=lambda s: s.number)
        far_stats = wait_closed(far, 2)
    assert [dict(s.delayed) for s in near_stats] == [{"GRAPH_COMPUTE": 1}, {}]
    assert sorted(sum(s.delayed.values()) for s in far_stats) == [2, 3]
    for i, client in enumerate(clients):
        fake = fake_worker.connection(i)
        assert bytes(fake.received) == bytes(client.sent) and bytes(client.received) == bytes(fake.sent)


def test_command_line(fake_worker):
    proc = subprocess.Popen([sys.executable, str(REPO / "tools" / "latency_proxy.py"), "--worker", fake_worker.address,
                             "--latency-ms", "50", "--jitter-ms", "5", "--mode", "compute", "--seed", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")

    def line() -> str:
        ready, _, _ = select.select([proc.stdout], [], [], TIMEOUT)
        assert ready, "no output from the proxy"
        return proc.stdout.readline()

    try:
        match = re.fullmatch(r"listening on (\S+):(\d+)\n", line())
        assert match
        client = Client(f"{match[1]}:{match[2]}")
        client.round_trip(Command.HELLO, hello())
        fake = fake_worker.connection(0)
        t0 = client.send(graph(1) + graph(2))
        assert fake.wait_frames(3)[1][0] - t0 >= 0.045
        client.finish()
        summary = line()
        assert summary.startswith("connection 1 closed") and "delayed: GRAPH_COMPUTE 2;" in summary
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(TIMEOUT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert bytes(fake.received) == bytes(client.sent)
    assert "mode compute" in proc.stderr.read()


def test_rejects_bad_arguments():
    with pytest.raises(ValueError):
        LatencyProxy("127.0.0.1:1", 0.01, "sometimes")
    with pytest.raises(ValueError):
        LatencyProxy("127.0.0.1:1", -1, "all")
