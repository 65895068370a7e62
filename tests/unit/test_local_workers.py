"""Local workers start one at a time and are waited for while they make progress, not against a clock.

Stand-in workers (small Python scripts) play the part of `python -m rpcserver`: one that computes for a
while before it listens (the first run's kernel compilation on a busy machine), one that hangs without
using CPU, one that exits.
"""
from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest

from orchestrator.pipeline.client import WorkerError
from orchestrator.pipeline.local_workers import NOTICE_AFTER, LocalWorkers

pytestmark = pytest.mark.unit

# computes (burns CPU) for `busy` seconds, appends "<port> listening" to the journal, then serves
BUSY_THEN_LISTEN = textwrap.dedent("""
    import socket, sys, time
    port, busy, journal = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
    with open(journal, "a") as f:
        f.write(f"{port} started\\n")
    end = time.monotonic() + busy
    while time.monotonic() < end:
        sum(i * i for i in range(10000))
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen()
    with open(journal, "a") as f:
        f.write(f"{port} listening\\n")
    while True:
        s.accept()[0].close()
""")


def script(tmp_path, source: str):
    path = tmp_path / "fake_worker.py"
    path.write_text(source)
    return path


def test_a_slow_first_start_is_waited_for_and_the_others_start_after_it(tmp_path):
    fake = script(tmp_path, BUSY_THEN_LISTEN)
    journal = tmp_path / "journal"
    lines = []
    # the first worker computes for longer than the stall limit: only progress keeps it alive
    stall = 2.0
    busy = max(NOTICE_AFTER, stall) + 2.0
    command = lambda port: [sys.executable, str(fake), str(port), str(busy), str(journal)]  # noqa: E731
    with LocalWorkers(3, 1, log=lines.append, stall=stall, command=command) as workers:
        assert len(workers.endpoints) == 3
    events = journal.read_text().split("\n")
    first = workers.endpoints[0].rsplit(":", 1)[1]
    # nobody else started before the first worker listened (its compiled kernels are then cached)
    assert events[:2] == [f"{first} started", f"{first} listening"], events
    assert sum(e.endswith("listening") for e in events) == 3
    assert any("compiling" in line and "first run" in line for line in lines), lines


def test_a_worker_that_makes_no_progress_is_given_up(tmp_path):
    fake = script(tmp_path, "import time\ntime.sleep(600)\n")
    with pytest.raises(WorkerError, match="no progress for 1s"):
        LocalWorkers(1, 1, stall=1.0, command=lambda port: [sys.executable, str(fake)])


def test_a_worker_that_exits_is_reported(tmp_path):
    fake = script(tmp_path, "raise SystemExit(3)\n")
    with pytest.raises(WorkerError, match="exited with status 3"):
        LocalWorkers(2, 1, command=lambda port: [sys.executable, str(fake)])


def test_default_threads_share_the_cores_only_when_the_workers_compute_at_once(monkeypatch):
    from orchestrator.pipeline import local_workers

    for cores, count, together, in_turn in ((2, 2, 1, 2), (8, 2, 4, 8), (2, 3, 1, 2), (1, 1, 1, 1), (16, 3, 5, 16)):
        monkeypatch.setattr(local_workers, "usable_cores", lambda cores=cores: cores)
        assert local_workers.default_threads(count, concurrent=True) == together
        assert local_workers.default_threads(count, concurrent=False) == in_turn


def test_only_workers_that_share_the_cores_with_threads_to_spare_sleep_at_once(monkeypatch):
    from orchestrator.pipeline.local_workers import worker_env

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert worker_env(2, 2)["OMP_WAIT_POLICY"] == "PASSIVE"  # the CLI's workers: every core each, in turn
    assert "OMP_WAIT_POLICY" not in worker_env(1, 2)  # the server's: one thread each, nothing to spin
    assert "OMP_WAIT_POLICY" not in worker_env(4, 1)  # one worker, the cores its own
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert worker_env(2, 2)["OMP_WAIT_POLICY"] == "ACTIVE"  # the user's setting wins
    root = Path(worker_env(1, 1)["PYTHONPATH"].split(os.pathsep)[0])
    assert (root / "rpcserver" / "__main__.py").is_file()  # `python -m rpcserver` from a plain checkout


# prints two warm-up progress lines (the second without its newline for a while), then listens
PROGRESS_THEN_LISTEN = textwrap.dedent("""
    import socket, sys, time
    port = int(sys.argv[1])
    print("loading the kernels...", flush=True)
    for done in (1, 2):
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            sum(i * i for i in range(10000))
        print(f"warm-up: {done}/2 recorded sessions, {done} s", end="", flush=True)
        time.sleep(0.5)
        print(flush=True)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen()
    while True:
        s.accept()[0].close()
""")


def test_the_first_workers_warm_up_progress_is_passed_on_whole_lines_once(tmp_path, monkeypatch):
    from orchestrator.pipeline import local_workers

    monkeypatch.setattr(local_workers, "NOTICE_AFTER", 0.0)
    fake = script(tmp_path, PROGRESS_THEN_LISTEN)
    lines = []
    with LocalWorkers(1, 1, log=lines.append, command=lambda port: [sys.executable, str(fake), str(port)]):
        pass
    progress = [line.strip() for line in lines if "warm-up" in line]
    assert progress == ["warm-up: 1/2 recorded sessions, 1 s", "warm-up: 2/2 recorded sessions, 2 s"], lines
