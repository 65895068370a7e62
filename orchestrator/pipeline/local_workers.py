"""Python workers started on this machine, for running the orchestrator without --rpc."""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from orchestrator.pipeline.client import STILL_WORKING, WorkerError

HOST = "127.0.0.1"
STALL_SECONDS = 120.0  # a starting worker that uses no CPU for this long is given up on
NOTICE_AFTER = 5.0  # seconds before saying that the kernels are being compiled


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask where Linux gives it, else the CPU count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_threads(count: int, *, concurrent: bool) -> int:
    """Threads for each of `count` local workers sharing this machine's cores.

    concurrent: the workers compute at the same time (the server keeps a batch in flight in every
    stage), so each gets its share of the cores: with every worker taking them all, their threads
    fought (4 requests at once 0.35-0.55x one after another on 2 cores, 2.4-2.7x with one thread
    each). Otherwise (one sequence passing the stages in turn, the CLI) one stage computes at a time
    and may use every core; the workers' idle threads then sleep (LocalWorkers: OMP_WAIT_POLICY)."""
    cores = usable_cores()
    return max(1, cores // max(1, count)) if concurrent else cores


def cpu_seconds(pid: int) -> float | None:
    """CPU time a process has used so far (Linux /proc), or None where that cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    except (OSError, IndexError, ValueError):
        return None


def _progress(pid: int) -> Callable[[], bool]:
    """Whether the process has used CPU since this was last asked (first: since now)."""
    last = cpu_seconds(pid)

    def working() -> bool:
        nonlocal last
        now = cpu_seconds(pid)
        moved, last = now is not None and now != last, now
        return moved

    return working


PR_SET_PDEATHSIG = 1  # Linux prctl(2): a signal for this process when the thread that forked it ends
# looked up here, in the parent: a forked child of a process with threads should not dlopen
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None


def _die_with_parent(parent: int) -> None:
    """A local worker's preexec_fn on Linux: SIGTERM when the command that started it dies, even by
    SIGKILL (LocalWorkers.stop never runs then), so that no worker outlives it holding its port and
    memory. (The fork is made on the main thread, which lives as long as the command.)"""
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # it died before the prctl
        os.kill(os.getpid(), signal.SIGTERM)


def worker_env(threads: int, count: int) -> dict[str, str]:
    """The local workers' environment: this checkout importable, and for several workers of several threads
    sharing these cores OMP_WAIT_POLICY=PASSIVE (unless set): numba's OpenMP threads spin after each parallel
    loop before they sleep (GNU OpenMP's default), taking CPU the stage computing now needs, and PASSIVE puts
    them to sleep at once. A worker with the host to itself keeps the default, which decodes twice as fast
    at -t 2 (docs/serving.md)."""
    repo_root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo_root, os.environ.get("PYTHONPATH")]))}
    if threads > 1 and count > 1:
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


class LocalWorkers:
    """Starts n `python -m rpcserver` processes on free ports; stops them on exit.

    The first worker starts alone: before it listens, its warm-up compiles the kernels into numba's
    on-disk cache (a minute or more the first time, longer on a busy machine), and the others then
    load them from that cache instead of compiling the same code at once (numba's cache is not safe for
    processes adding different signatures of one function at once: each rewrites the index and may
    pick the same data file name). Workers that compute one at a time (the CLI: a stage's graph runs
    after the one before it) warm up the demo model's tier only (rpcserver.warmup.TIERS), about a
    quarter of every kernel: another model's other kernels compile on first use, in the CLI's untimed
    warm-up run, one worker at a time. Concurrent ones (the server) warm up every kernel. There is no
    fixed deadline: a worker is waited for as long as it is alive and using CPU, and given up on when
    it exits or makes no progress for `stall` seconds; once they listen, the orchestrator's waits on
    them follow the same rule (client.STILL_WORKING), not --rpc-timeout alone. `log` receives the
    progress lines (the CLI prints them). `threads` None: default_threads(count, concurrent=concurrent).
    `extra`: more rpc-server flags for each worker (a --key-file).
    """

    def __init__(self, count: int, threads: int | None = None, *, concurrent: bool = False, log: Callable[[str], None] = lambda line: None,
                 stall: float = STALL_SECONDS, command: Callable[[int], list[str]] | None = None,
                 extra: tuple[str, ...] = ()):
        self.procs: list[subprocess.Popen] = []
        self.endpoints: list[str] = []
        self.log = log
        self.stall = stall
        threads = threads or default_threads(count, concurrent=concurrent)
        self.threads = threads
        tier = "all" if concurrent else "demo"
        self.log_dir = Path(tempfile.mkdtemp(prefix="orchestrator-workers-"))
        self.env = worker_env(threads, count)
        self.command = command or (lambda port: [sys.executable, "-m", "rpcserver", "-H", HOST, "-p", str(port),
                                                 "-t", str(threads), "--warmup-tier", tier, *extra])
        try:
            self._wait(*self._start(), first=True)
            rest = [self._start() for _ in range(count - 1)]
            for proc, endpoint in rest:
                self._wait(proc, endpoint, first=False)
            for proc, endpoint in zip(self.procs, self.endpoints):
                STILL_WORKING[endpoint] = _progress(proc.pid)
        except BaseException:
            self.stop()
            raise

    def _start(self) -> tuple[subprocess.Popen, str]:
        port = _free_port()
        log = open(self.log_dir / f"worker-{port}.log", "wb")
        armed = functools.partial(_die_with_parent, os.getpid()) if _prctl is not None else None
        proc = subprocess.Popen(self.command(port), stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                stdin=subprocess.DEVNULL, preexec_fn=armed)
        log.close()
        self.procs.append(proc)
        self.endpoints.append(f"{HOST}:{port}")
        return proc, f"{HOST}:{port}"

    def _wait(self, proc: subprocess.Popen, endpoint: str, *, first: bool) -> None:
        host, port = endpoint.rsplit(":", 1)
        started = last_progress = time.monotonic()
        last_cpu = cpu_seconds(proc.pid)
        noticed = not first
        log_path, shown = self.log_dir / f"worker-{port}.log", 0
        while True:
            if proc.poll() is not None:
                raise WorkerError(f"local worker {endpoint} exited with status {proc.returncode}; "
                                  f"see {self.log_dir}")
            try:
                socket.create_connection((host, int(port)), timeout=1).close()
                if noticed and first:
                    self._relay_progress(log_path, shown)  # its last lines, written just before it listened
                return
            except OSError:
                pass
            now = time.monotonic()
            if not noticed and now - started > NOTICE_AFTER:
                self.log("compiling the worker kernels (first run only; a few minutes on a busy machine)...")
                noticed = True
            if noticed and first:
                shown = self._relay_progress(log_path, shown)
            cpu = cpu_seconds(proc.pid)
            if cpu is None or cpu != last_cpu:  # unknown counts as progress: the process is alive
                last_cpu, last_progress = cpu, now
            elif now - last_progress > self.stall:
                raise WorkerError(f"local worker {endpoint} has made no progress for {self.stall:.0f}s "
                                  f"and is not listening; see {self.log_dir}")
            time.sleep(0.1)

    def _relay_progress(self, log_path: Path, shown: int) -> int:
        """Passes on the worker's new "warm-up: ..." lines; returns how many lines have been read."""
        try:
            lines = log_path.read_text(errors="replace").split("\n")[:-1]  # complete lines only
        except OSError:
            return shown
        for line in lines[shown:]:
            if line.startswith("warm-up:"):
                self.log(f"  {line}")
        return len(lines)

    def stop(self) -> None:
        for endpoint in self.endpoints:
            STILL_WORKING.pop(endpoint, None)
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
