"""Python workers started on this machine, for running the orchestrator without --rpc."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from orchestrator.client import WorkerError

HOST = "127.0.0.1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class LocalWorkers:
    """Starts n `python -m rpcserver` processes on free ports; stops them on exit."""

    def __init__(self, count: int, threads: int, timeout: float = 120.0):
        self.procs: list[subprocess.Popen] = []
        self.endpoints: list[str] = []
        self.log_dir = Path(tempfile.mkdtemp(prefix="orchestrator-workers-"))
        repo_root = str(Path(__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo_root, os.environ.get("PYTHONPATH")]))}
        try:
            for _ in range(count):
                port = _free_port()
                log = open(self.log_dir / f"worker-{port}.log", "wb")
                cmd = [sys.executable, "-m", "rpcserver", "-H", HOST, "-p", str(port), "-t", str(threads)]
                self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                                   stdin=subprocess.DEVNULL))
                self.endpoints.append(f"{HOST}:{port}")
            for proc, endpoint in zip(self.procs, self.endpoints):
                self._wait(proc, endpoint, timeout)
        except BaseException:
            self.stop()
            raise

    def _wait(self, proc: subprocess.Popen, endpoint: str, timeout: float) -> None:
        host, port = endpoint.rsplit(":", 1)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise WorkerError(f"local worker {endpoint} exited with status {proc.returncode}; "
                                  f"see {self.log_dir}")
            try:
                socket.create_connection((host, int(port)), timeout=1).close()
                return
            except OSError:
                time.sleep(0.1)
        raise WorkerError(f"local worker {endpoint} did not start listening within {timeout:.0f}s")

    def stop(self) -> None:
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
