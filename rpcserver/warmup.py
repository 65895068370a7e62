"""Start-up warm-up: replay a recorded client session so numba has every kernel loaded before we listen.

Numba compiles (or loads from its on-disk cache) a kernel the first time it is called with a given
signature; left to the first client, that lands in its first GRAPH_COMPUTE. Here a private Session
(its own buffers and budget, nothing shared with clients) replays `warmup.rec`: the requests a client
sends for a tiny random llama — weights upload, KV cache clear, prompts of 8 and 2 tokens, single
tokens (one deep into a long context), GRAPH_RECOMPUTE, GET_TENSOR — with flash attention on and off,
through the same codec and handlers as any connection. tools/record_warmup.py made the recording with the orchestrator, which
the worker itself does not import.

The file: zlib-compressed; "PYRPCWU1", then per session a u32 frame count and per frame
`command:u8 stored:u32 dropped:u32 payload[stored]`, where `dropped` SET_TENSOR data bytes were left out
and are replayed as zeros.
"""

from __future__ import annotations

import struct
import time
import zlib
from pathlib import Path

import numpy as np

from kernels.hashing import fnv1a64

from wire import protocol as p
from .memory import MemoryBudget
from .session import Session, WorkerConfig

RECORDING = Path(__file__).with_name("warmup.rec")
MAGIC = b"PYRPCWU1"
BUDGET = 64 << 20


class WarmupError(RuntimeError):
    """The recording is missing or damaged, or replaying it failed."""


def encode(sessions: list[list[tuple[int, bytes, int]]]) -> bytes:
    out = [MAGIC]
    for frames in sessions:
        out.append(struct.pack("<I", len(frames)))
        for command, payload, dropped in frames:
            out.append(struct.pack("<BII", command, len(payload), dropped) + payload)
    return zlib.compress(b"".join(out), 9)


def decode(data: bytes) -> list[list[tuple[p.Command, bytes]]]:
    """The recorded sessions as (command, payload) lists, dropped SET_TENSOR data restored as zeros."""
    raw = zlib.decompress(data)
    if not raw.startswith(MAGIC):
        raise WarmupError("not a warm-up recording")
    sessions, pos = [], len(MAGIC)
    while pos < len(raw):
        (count,), pos = struct.unpack_from("<I", raw, pos), pos + 4
        frames = []
        for _ in range(count):
            command, stored, dropped = struct.unpack_from("<BII", raw, pos)
            pos += 9
            frames.append((p.Command(command), raw[pos:pos + stored] + bytes(dropped)))
            pos += stored
        sessions.append(frames)
    return sessions


GRAPHS = (p.Command.GRAPH_COMPUTE, p.Command.GRAPH_RECOMPUTE)  # the frames that compile kernels

# how many of the recording's sessions each tier replays (tools/record_warmup.py keeps the order):
# "all" every kernel signature a llama graph needs; "demo" the first session only, the demo model's
# (Q4_1 layers, Q8_0 head, flash attention on: a quarter of the compile), for workers the orchestrator
# starts itself; anything else a client sends is then compiled (or loaded) by numba on first use
TIERS = {"all": None, "demo": 1}


def replay(frames: list[tuple[p.Command, bytes]], after_graph=None) -> None:
    session = Session(WorkerConfig(MemoryBudget(BUDGET)))
    try:
        for command, payload in frames:
            session.handle(command, p.decode_request(command, memoryview(payload)))
            if after_graph is not None and command in GRAPHS:
                after_graph()
    finally:
        session.close()


def warm_up(progress=None, tier: str = "all") -> float:
    """Replay the recording's sessions of `tier` (TIERS); returns the seconds it took. Errors raise
    WarmupError: they are our bugs. `progress(done, total, seconds)` is called after each recorded graph
    (a first run compiles for minutes: the command line says how far it is)."""
    import numba  # noqa: PLC0415

    start = time.perf_counter()
    try:
        sessions = decode(RECORDING.read_bytes())[:TIERS[tier]]
    except (OSError, zlib.error, struct.error, ValueError) as exc:
        raise WarmupError(f"cannot read {RECORDING}: {exc}") from None
    threads = numba.get_num_threads()
    # one thread: the compiled code is the same, and tiny parallel kernels on a busy machine spend
    # most of their time waking threads (6.7 s instead of 1.0 s measured with load ~15 on 2 cores)
    numba.set_num_threads(1)
    try:
        with np.errstate(all="ignore"):
            total, done = sum(command in GRAPHS for frames in sessions for command, _ in frames), 0

            def after_graph():
                nonlocal done
                done += 1
                if progress is not None:
                    progress(done, total, time.perf_counter() - start)

            for frames in sessions:
                replay(frames, after_graph)
        for data in (np.zeros(1, np.uint8), np.frombuffer(bytes(1), np.uint8)):  # writable and read-only
            fnv1a64(data)  # the -c cache hashes what it receives and what it reads back from disk
    except (p.ProtocolError, ValueError) as exc:
        raise WarmupError(f"replaying {RECORDING.name} failed: {exc}") from None
    finally:
        numba.set_num_threads(threads)
    return time.perf_counter() - start
