"""Chaos run: `orchestrator serve` over local workers that are killed and restarted at random, while
clients stream greedy completions (some hanging up mid-stream) and hostile frames hit the workers.

    PYTHONPATH=. python tools/chaos.py --minutes 3 --requests 200 --workers 3

Bounded by both the request count and the time. The oracle is the undisturbed run: each prompt's greedy
text is asked for before any worker is touched. Reports requests completed, how many texts are identical
to the undisturbed ones, every error (each must be a clear one: a 503 or an error event with a message),
the workers' and the server's RSS over time (from /proc) and any crash (a process that died unasked).
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools import reference  # noqa: E402
from wire import protocol as p  # noqa: E402
from wire.protocol import Command  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["The capital of France is", "Once upon a time", "The three laws of motion are", "def fibonacci(n):"]
N_PREDICT = 32


def hostile_frames() -> list[tuple[str, bytes]]:
    """Frames a worker must refuse by closing the connection (the cases of tests/integration/test_bad_input.py
    that need no buffer of their own)."""
    hello = p.encode_request(Command.HELLO, p.HelloRequest())
    return [
        ("first command not HELLO", p.encode_request(Command.DEVICE_COUNT)),
        ("unknown command", hello + struct.pack("<BQ", 77, 0)),
        ("wrong payload size", hello + struct.pack("<BQ", int(Command.GET_ALIGNMENT), 3) + b"\0\0\0"),
        ("size header of 2^60 bytes", hello + struct.pack("<BQ", int(Command.SET_TENSOR), 1 << 60) + b"\0" * 64),
        ("random bytes", hello + random.randbytes(4096)),
        ("second HELLO", hello + hello),
        ("truncated frame", hello + struct.pack("<BQ", int(Command.SET_TENSOR), 1000) + b"\0" * 10),
    ]


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class Chaos:
    def __init__(self, args):
        self.args = args
        self.log_dir = Path(tempfile.mkdtemp(prefix="chaos-"))
        self.workers = [reference.start_worker("ours", self.log_dir, threads=1, timeout=600)
                        for _ in range(args.workers)]
        self.lock = threading.Lock()
        self.outcomes: collections.Counter = collections.Counter()
        self.errors: collections.Counter = collections.Counter()
        self.unclear: list[str] = []
        self.crashes: list[str] = []
        self.rss: list[dict] = []
        self.kills = self.restarts = self.hostile = 0
        self.done = threading.Event()
        self.started = time.monotonic()
        self.server_log = open(self.log_dir / "serve.log", "wb")
        self.port = reference.free_port()
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        self.server = subprocess.Popen(
            [sys.executable, "-m", "orchestrator", "serve", "--rpc", ",".join(w.address for w in self.workers),
             "-m", str(reference.model_path()), "--port", str(self.port), "-c", "1024", "-np", "2",
             "--rpc-timeout", str(args.rpc_timeout)],
            stdout=self.server_log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT, stdin=subprocess.DEVNULL)

    def request(self, prompt: str, stream: bool) -> http.client.HTTPResponse:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        conn.request("POST", "/completion", json.dumps({"prompt": prompt, "n_predict": N_PREDICT, "temperature": 0,
                                                        "stream": stream}), {"Content-Type": "application/json"})
        return conn.getresponse()

    def wait_healthy(self) -> None:
        while True:
            if self.server.poll() is not None:
                raise SystemExit(f"the server did not start; see {self.log_dir / 'serve.log'}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)

    def over(self) -> bool:
        return self.done.is_set() or time.monotonic() - self.started > 60 * self.args.minutes

    def client(self, oracle: dict[str, str], rng: random.Random) -> None:
        while not self.over():
            with self.lock:
                if sum(self.outcomes.values()) >= self.args.requests:
                    self.done.set()
                    return
            prompt = rng.choice(PROMPTS)
            hang_up = rng.random() < 0.2
            outcome, error = self.one(prompt, hang_up, oracle)
            with self.lock:
                self.outcomes[outcome] += 1
                if error is not None:
                    self.errors[error[:90]] += 1
            if outcome.startswith("error"):
                time.sleep(1)  # as a client that got a 503 with Retry-After would

    def one(self, prompt: str, hang_up: bool, oracle: dict[str, str]) -> tuple[str, str | None]:
        try:
            r = self.request(prompt, stream=True)
            if r.status != 200:
                message = json.loads(r.read()).get("error", {}).get("message", "")
                return ("error" if message else "unclear error"), f"{r.status} {message}"
            text, n = "", 0
            while line := r.readline():
                if not line.startswith(b"data: "):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    message = event["error"].get("message", "")
                    return ("error" if message else "unclear error"), f"stream: {message}"
                text += event.get("content", "")
                n += 1
                if hang_up and n == 3:
                    r.close()
                    return "hung up", None
                if event.get("stop"):
                    break
            else:
                return "unclear error", "the stream ended without a stop event"
            return ("identical" if text == oracle[prompt] else "different"), None
        except (OSError, ValueError, http.client.HTTPException) as exc:
            return "unclear error", f"{type(exc).__name__}: {exc}"

    def saboteur(self, rng: random.Random) -> None:
        """Kills a random worker now and then and starts it again on its port a few seconds later."""
        while not self.over():
            time.sleep(rng.uniform(*self.args.kill_every))
            if self.over():
                return
            i = rng.randrange(len(self.workers))
            w = self.workers[i]
            w.proc.send_signal(signal.SIGKILL)
            w.proc.wait()
            w.stop()
            self.kills += 1
            time.sleep(rng.uniform(2, 8))
            self.workers[i] = reference.start_worker("ours", self.log_dir, port=w.port, threads=1, timeout=600)
            self.restarts += 1

    def vandal(self, rng: random.Random) -> None:
        """Hostile frames at a random worker every second or so; each connection must just be closed."""
        frames = hostile_frames()
        while not self.over():
            time.sleep(rng.uniform(0.5, 2))
            w = rng.choice(self.workers)
            _, frame = rng.choice(frames)
            try:
                with socket.create_connection((w.host, w.port), timeout=10) as s:
                    s.sendall(frame)
                    s.shutdown(socket.SHUT_WR)
                    while s.recv(65536):
                        pass
                self.hostile += 1
            except OSError:
                pass  # a worker being restarted

    def watcher(self) -> None:
        while not self.over():
            sample = {"t": round(time.monotonic() - self.started, 1), "server": rss_mib(self.server.pid)}
            for i, w in enumerate(self.workers):
                sample[f"worker{i}"] = rss_mib(w.proc.pid)
            self.rss.append(sample)
            if self.server.poll() is not None:
                self.crashes.append(f"the server exited with status {self.server.returncode}")
                self.done.set()
            time.sleep(5)

    def run(self) -> dict:
        try:
            self.wait_healthy()
            oracle = {}
            for prompt in PROMPTS:  # undisturbed: before any worker is touched
                oracle[prompt] = json.loads(self.request(prompt, stream=False).read())["content"]
            self.started = time.monotonic()
            rng = random.Random(self.args.seed)
            threads = [threading.Thread(target=self.client, args=(oracle, random.Random(rng.random())))
                       for _ in range(self.args.clients)]
            threads += [threading.Thread(target=self.saboteur, args=(random.Random(rng.random()),)),
                        threading.Thread(target=self.vandal, args=(random.Random(rng.random()),)),
                        threading.Thread(target=self.watcher)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return self.report()
        finally:
            self.server.terminate()
            self.server.wait(60)
            for w in self.workers:
                w.stop()

    def report(self) -> dict:
        def span(key):
            values = [s[key] for s in self.rss if s.get(key) is not None]
            return [round(min(values), 1), round(max(values), 1)] if values else None

        keys = ["server"] + [f"worker{i}" for i in range(len(self.workers))]
        return {"seconds": round(time.monotonic() - self.started), "outcomes": dict(self.outcomes),
                "errors": dict(self.errors), "kills": self.kills, "restarts": self.restarts,
                "hostile_frames": self.hostile, "crashes": self.crashes,
                "rss_mib_min_max": {k: span(k) for k in keys}, "rss_samples": self.rss,
                "logs": str(self.log_dir)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--requests", type=int, default=200, help="stop after this many requests")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--clients", type=int, default=3, help="concurrent clients")
    parser.add_argument("--kill-every", type=float, nargs=2, default=(15.0, 30.0), metavar=("MIN", "MAX"),
                        help="seconds between two kills")
    parser.add_argument("--rpc-timeout", type=float, default=15.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = parser.parse_args()
    report = Chaos(args).run()
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    summary = {k: v for k, v in report.items() if k != "rss_samples"}
    print(json.dumps(summary, indent=1))
    unclear = report["outcomes"].get("unclear error", 0) + report["outcomes"].get("different", 0)
    return 1 if report["crashes"] or unclear else 0


if __name__ == "__main__":
    sys.exit(main())
