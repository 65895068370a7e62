"""What the orchestrator sees of its workers as it runs them: the last steps' times per stage, the bytes
each connection carried, and each worker's round trip and free memory from an idle probe.

The runners (waves.py, the engine's ring) record what they observe anyway, with no request of their own:
when a stage's requests were written, when its reply was read, the byte counters of its connection
(RpcClient.sent_bytes / received_bytes). Waves relays every boundary, so it sees each stage: how long a
batch waited for it (behind another batch, or for the orchestrator) and how long from its requests
written to its reply read, which is the transfers both ways plus the worker's compute; the two cannot be
told apart from here, which is what the probe's round trip is for. A stepwise step that pushes, and the
ring, show the orchestrator only the whole step and the bytes per connection.

The one request of its own is probe(): GET_DEVICE_MEMORY to every stage, timed. The engine's thread sends
it between steps while no batch is in flight (never another thread: a worker's socket has one user),
at most every PROBE_PERIOD_S; the reply's free memory is the worker's now, the time is a small request's
round trip (the link's latency plus the worker's answer to a trivial command).

Readers on other threads (the web page) take copies under the lock; a record is never changed once added.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import asdict, dataclass

RECENT = 32  # steps kept
PROBE_PERIOD_S = 2.0  # the idle probe's period


@dataclass(frozen=True)
class StageTime:
    """One stage's part of a step, as the orchestrator saw it."""

    endpoint: str
    wait: float | None  # seconds from the batch being ready for the stage to its requests written; None: not seen
    busy: float | None  # seconds from its requests written to its reply read (transfers + compute); None: not seen
    sent: int  # bytes written to the worker for this step
    received: int  # bytes read from it


@dataclass(frozen=True)
class StepTime:
    kind: str  # "waves" (every stage seen), "stepwise" or "ring" (the whole step only)
    end: float  # time.time() when its output was read
    seconds: float  # from its start to its output read
    n_tokens: int  # tokens it fed (prompt and generated)
    stages: tuple[StageTime, ...]


@dataclass(frozen=True)
class Probe:
    rtt: float  # seconds for GET_DEVICE_MEMORY's request and reply
    free: int
    total: int
    at: float  # time.time()


def clients(pipe) -> list:
    """The pipeline's connections, stage by stage (none for a stand-in without stages)."""
    return [s.client for s in getattr(pipe, "stages", ())]


class Mark:
    """Where a step began: the clock and each connection's byte counters."""

    def __init__(self, clients):
        self.clients = list(clients)
        self.counts = [(c.sent_bytes, c.received_bytes) for c in self.clients]
        self.started = time.perf_counter()

    def deltas(self) -> list[tuple[int, int]]:
        return [(c.sent_bytes - s, c.received_bytes - r) for c, (s, r) in zip(self.clients, self.counts)]


class Telemetry:
    def __init__(self, keep: int = RECENT):
        self._lock = threading.Lock()
        self._steps: deque[StepTime] = deque(maxlen=keep)
        self._probes: dict[str, Probe] = {}
        self._probed: float | None = None  # time.monotonic() of the last probe

    def add(self, step: StepTime) -> None:
        with self._lock:
            self._steps.append(step)

    def whole(self, kind: str, mark: Mark, n_tokens: int) -> None:
        """A step of which only its start, its end and the bytes per connection were seen."""
        seconds = time.perf_counter() - mark.started
        stages = tuple(StageTime(c.endpoint, None, None, s, r) for c, (s, r) in zip(mark.clients, mark.deltas()))
        self.add(StepTime(kind, time.time(), seconds, n_tokens, stages))

    def due(self, period: float = PROBE_PERIOD_S) -> bool:
        return self._probed is None or time.monotonic() - self._probed >= period

    def probe(self, clients) -> None:
        """GET_DEVICE_MEMORY to each client, timed (the caller owns their sockets and owes no replies)."""
        self._probed = time.monotonic()
        for client in clients:
            began = time.perf_counter()
            free, total = client.device_memory()
            rtt = time.perf_counter() - began
            with self._lock:
                self._probes[client.endpoint] = Probe(rtt, free, total, time.time())

    def steps(self) -> list[StepTime]:
        with self._lock:
            return list(self._steps)

    def probes(self) -> dict[str, Probe]:
        with self._lock:
            return dict(self._probes)

    def summary(self, now: float | None = None) -> dict:
        """JSON-ready: the recent steps (oldest first, with their age in seconds), the tokens per second
        over them, per endpoint the mean wait and busy seconds and the bytes per token each way (and what it
        sent back per token in the relayed steps), and the last probe of each endpoint."""
        now = time.time() if now is None else now
        steps, probes = self.steps(), self.probes()
        out = {"steps": [{**asdict(s), "age": now - s.end} for s in steps], "throughput": None, "stages": {},
               "probes": {e: {"rtt": p.rtt, "free": p.free, "total": p.total, "age": now - p.at}
                          for e, p in probes.items()}}
        for s in out["steps"]:
            del s["end"]
        if len(steps) > 1:  # tokens of all but the first over the time from its end to the last's
            span = steps[-1].end - steps[0].end
            out["throughput"] = sum(s.n_tokens for s in steps[1:]) / span if span > 0 else None
        per: dict[str, dict] = {}
        for step in steps:
            for st in step.stages:
                acc = per.setdefault(st.endpoint, {"wait": [], "busy": [], "sent": 0, "received": 0, "tokens": 0,
                                                   "relayed": 0, "relayed_tokens": 0})
                if st.wait is not None:
                    acc["wait"].append(st.wait)
                if st.busy is not None:
                    acc["busy"].append(st.busy)
                acc["sent"] += st.sent
                acc["received"] += st.received
                acc["tokens"] += step.n_tokens
                if step.kind == "waves":  # every boundary relayed: the activation comes back to the orchestrator
                    acc["relayed"] += st.received
                    acc["relayed_tokens"] += step.n_tokens
        for endpoint, acc in per.items():
            n = acc["tokens"] or 1
            out["stages"][endpoint] = {
                "wait": sum(acc["wait"]) / len(acc["wait"]) if acc["wait"] else None,
                "busy": sum(acc["busy"]) / len(acc["busy"]) if acc["busy"] else None,
                "sent_per_token": acc["sent"] / n, "received_per_token": acc["received"] / n,
                "relayed_per_token": acc["relayed"] / acc["relayed_tokens"] if acc["relayed_tokens"] else None}
        return out
