"""The asyncio glue: bytes in through the codec, handlers from the table, replies out.

Each connection gets its own Session. Requests of one connection are handled strictly in order; heavy
ones (tensor data, graphs) run on one compute thread so the event loop keeps serving every other
client. Kernels are serialized on that thread: they parallelize inside themselves.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from concurrent.futures import ThreadPoolExecutor

from wire import protocol as p
from wire.framing import Frame, FrameReader, decode_frame
from .peers import LOOP_COMMANDS, PeerSide
from wire.protocol import Command, ProtocolError
from .session import HEAVY, Session, WorkerConfig

log = logging.getLogger("rpcserver")

MAX_QUEUED_FRAMES = 16  # stop reading from a client that is this far ahead of us
INLINE_PEER_WRITE = 1 << 20  # a pushed decode step's activation is kilobytes; a prompt's goes to the thread


class ComputeThread:
    """The one thread that runs heavy handlers, shared by every connection, and how many it has queued
    or running: when none, no handler touches any session's memory but the event loop's own."""

    def __init__(self, executor: ThreadPoolExecutor):
        self.executor = executor
        self.in_flight = 0

    async def run(self, fn, *args):
        self.in_flight += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)
        finally:
            self.in_flight -= 1


class WorkerProtocol(asyncio.BufferedProtocol):
    def __init__(self, config: WorkerConfig, compute: ComputeThread, connections: set):
        self.config = config
        self.compute = compute
        self.connections = connections
        self.session = Session(config)
        self.reader = FrameReader(self.session.max_payload, place=self._place)
        self.frames: collections.deque = collections.deque()
        self.unplaced = 0  # frames queued or being handled, other than placed SET_TENSORs
        self.wakeup = asyncio.Event()
        self.paused = False
        self.closed = False
        self.task: asyncio.Task | None = None
        self.peer = "?"
        self.greeted = False
        self.replies: collections.deque = collections.deque()  # behind a reply still to come (a push's)
        self.flusher: asyncio.Task | None = None
        self.writable = asyncio.Event()  # cleared while the client does not read what we wrote
        self.writable.set()

    # -- asyncio callbacks ---------------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if peer else "?"
        self.connections.add(self)
        log.info("client %s connected", self.peer)
        self.peer_side = PeerSide(self.session, self.config.peer_push)
        self.task = asyncio.get_running_loop().create_task(self._serve())

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.reader.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        try:
            self.reader.buffer_updated(nbytes)
        except ProtocolError as exc:
            self._fail(exc)
            return
        while (frame := self.reader.next_frame()) is not None:
            self.frames.append(frame)
            self.unplaced += frame.placed is None
        if self.frames:
            self.wakeup.set()
        if len(self.frames) >= MAX_QUEUED_FRAMES and not self.paused:
            self.paused = True
            self.transport.pause_reading()

    def _place(self, head: memoryview, size: int) -> memoryview | None:
        """SET_TENSOR data goes straight into its buffer when every earlier request is done with:
        a queued or running command (a graph reading that region, a FREE_BUFFER) must see memory as
        it was before this SET_TENSOR, as with the reference's one-request-at-a-time loop."""
        if self.unplaced or not self.greeted:
            return None
        return self.session.place_set_tensor(head, size)

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.wakeup.set()
        self.writable.set()
        self.peer_side.close()  # ends its waits, and its pushes' replies (nobody will read them)
        self.connections.discard(self)

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    # -- request processing --------------------------------------------------------------------------

    async def _serve(self) -> None:
        try:
            while not self.closed or self.frames:
                if not self.frames:
                    self.wakeup.clear()
                    await self.wakeup.wait()
                    continue
                if self.closed:
                    break  # the client is gone: drop what it left queued
                if not self.writable.is_set() or len(self.replies) >= MAX_QUEUED_FRAMES:
                    await self._caught_up()  # a client that does not read its replies gets no more
                    continue
                frame = self.frames.popleft()
                if self.paused and len(self.frames) < MAX_QUEUED_FRAMES // 2:
                    self.paused = False
                    self.transport.resume_reading()
                reply = await self._dispatch(frame)
                self.unplaced -= frame.placed is None
                if reply is not None:
                    self._reply(reply)
        except ProtocolError as exc:
            self._fail(exc)
        except Exception:  # a bug of ours: keep the worker alive, drop only this client
            log.exception("client %s: internal error; closing the connection", self.peer)
            self.transport.abort()
        finally:
            if self.flusher is not None:
                self.flusher.cancel()
            self.peer_side.close()
            await self.compute.run(self.session.close)
            log.info("client %s disconnected", self.peer)

    async def _caught_up(self) -> None:
        """Waits until the client has read enough of its replies and few are held back."""
        await self.writable.wait()
        if len(self.replies) >= MAX_QUEUED_FRAMES and self.flusher is not None:
            await asyncio.shield(self.flusher)

    def _reply(self, reply: bytes | asyncio.Future) -> None:
        """Replies go out in request order: one still to come holds back the replies after it."""
        if self.replies or isinstance(reply, asyncio.Future):
            self.replies.append(reply)
            if self.flusher is None:
                self.flusher = asyncio.get_running_loop().create_task(self._flush())
        elif not self.closed:
            self._write(reply)

    async def _flush(self) -> None:
        while self.replies:
            head = self.replies[0]
            reply = await head if isinstance(head, asyncio.Future) else head
            self.replies.popleft()
            if not self.closed:
                self._write(reply)
        self.flusher = None

    def _write(self, reply: bytes) -> None:
        self.transport.write(p.response_header(len(reply)))
        self.transport.write(reply)

    async def _dispatch(self, frame: Frame):
        command = frame.command
        request = decode_frame(frame)
        if not self.greeted:  # the reader let only HELLO through first
            self.greeted = True
            return p.HelloResponse().encode()  # we offer no transport caps (upstream's RDMA)
        if command in LOOP_COMMANDS:
            return await self.peer_side.handle(command, request)
        if command in HEAVY and not (frame.placed is not None and not self.session.caching):
            if command == Command.PEER_WRITE and not self.compute.in_flight and len(request.data) <= INLINE_PEER_WRITE:
                # a pushed activation into a worker waiting for it: written here, no thread hop on the
                # pipeline's critical path (with nothing on the compute thread, nothing else can be
                # reading or freeing the target's memory)
                return self.session.handle(command, request)
            return await self.compute.run(self.session.handle, command, request)
        return self.session.handle(command, request)

    def _fail(self, exc: ProtocolError) -> None:
        if not self.closed:
            log.error("client %s: %s; closing the connection", self.peer, exc)
            self.closed = True
            self.transport.abort()
        self.wakeup.set()


def _set_numba_threads(n: int) -> None:
    import numba  # noqa: PLC0415 - only the compute thread needs it

    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))


async def serve(host: str, port: int, config: WorkerConfig, ready=None) -> None:
    """Serve until cancelled; `ready(server)` is called once the socket listens."""
    # numba's thread count is per calling thread: set it on the compute thread itself
    init = (_set_numba_threads, (config.threads,)) if config.threads else (None, ())
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute", initializer=init[0], initargs=init[1])
    compute = ComputeThread(executor)  # one for all connections: its count is the whole worker's
    connections: set = set()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: WorkerProtocol(config, compute, connections), host, port, reuse_address=True
    )
    if ready is not None:
        ready(server)
    try:
        async with server:
            await server.serve_forever()
    finally:
        server.close()
        for conn in list(connections):
            conn.transport.close()
        executor.shutdown(wait=True, cancel_futures=True)
