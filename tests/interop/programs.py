"""How the interop tests run llama.cpp's programs: llama-completion's arguments and prompts, a
llama-server process, and the Gemma 3 long prompt (shared by several test modules; not a test module).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from .conftest import CLIENT_THREADS, REPO_ROOT, RPC_TIMEOUT, ClientFailed, reference
from .perplexity import corpus_text

N_PREDICT = 64


PROMPTS = {
    "fact": "The capital of France is",
    "list": "Here are three simple tips for staying healthy:\n1.",
    # ~190 tokens: with -b/-ub 64 the prompt is processed in several batches, so the worker
    # sees KV-cache writes at non-zero offsets and attention over earlier batches.
    "long": (
        "The old lighthouse stood at the end of a narrow spit of land, where the river met the sea and "
        "the tides argued twice a day about which of them owned the shore. For ninety years a keeper had "
        "climbed its spiral stairs each evening to light the lamp, trim the wick, and write a line in the "
        "logbook about the weather, the ships that passed, and anything else that seemed worth remembering. "
        "The entries were short and plain: fog until noon, a schooner bound south, gulls unusually loud, "
        "the cat has caught another mouse. When the light was finally automated, the last keeper packed the "
        "logbooks into a wooden crate and carried them to the town library, where they sat unread on a low "
        "shelf for decades. Then one winter a schoolteacher opened the first volume, started reading aloud "
        "to her class, and discovered that the dull little notes, taken together, told the story of the "
        "whole coast. Her students decided to"
    ),
}


def completion_args(model_path, prompt: str, flash_attn: str) -> list[str]:
    """Everything except the device placement; -fit off so the client never trims the offload."""
    return [
        "-m", model_path, "-p", prompt, "-n", N_PREDICT, "--ignore-eos", "--temp", "0", "-s", "1",
        "-no-cnv", "--no-display-prompt", "-t", CLIENT_THREADS, "-c", 512, "-b", 64, "-ub", 64,
        "-fa", flash_attn, "-fit", "off", "-lv", 4,
    ]


PROMPT_EVAL_RE = re.compile(r"prompt eval time =.*?/\s*(\d+) tokens")


def long_prompt() -> str:
    # ~650 tokens of fixed text: later positions no longer see the first ones in the sliding-window layers
    return corpus_text()[:2800]


class LlamaServer:
    """A llama-server process on a free port, logging to a file."""

    name = "llama-server"

    def __init__(self, bin_dir, model_path, log_path, extra_args: list[str], n_ctx: int = 1024, n_parallel: int = 1):
        self.port = reference.free_port()
        cmd = [str(bin_dir / "llama-server"), "-m", str(model_path), "--host", reference.LOCALHOST,
               "--port", str(self.port), "-t", str(CLIENT_THREADS), "-c", str(n_ctx), "-np", str(n_parallel),
               "--no-webui", "-fit", "off", "-lv", "4", *map(str, extra_args)]
        self._start(cmd, log_path, reference.llama_env())

    def _start(self, cmd: list[str], log_path, env) -> None:
        self.cmd, self.log_path = cmd, log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)

    @property
    def url(self) -> str:
        return f"http://{reference.LOCALHOST}:{self.port}"

    def describe(self) -> str:
        state = "running" if self.proc.poll() is None else f"exited with status {self.proc.returncode}"
        tail = self.log_path.read_bytes()[-3000:].decode("utf-8", "replace")
        return f"{self.name} ({state})\n  command: {' '.join(self.cmd)}\n  log tail:\n{tail}"

    def wait_healthy(self, timeout: float) -> None:
        try:
            reference.wait_healthy(self.url, self.proc, timeout, self.describe)
        except RuntimeError as exc:
            raise AssertionError(f"{self.name}: {exc}") from None

    def chat(self, messages) -> dict:
        body = json.dumps({"messages": messages, "temperature": 0, "max_tokens": 16, "seed": 1}).encode()
        request = urllib.request.Request(f"{self.url}/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=RPC_TIMEOUT) as response:
                return json.loads(response.read())
        except (urllib.error.URLError, OSError) as exc:
            raise AssertionError(f"chat request failed: {exc}\n{self.describe()}") from None

    def stop(self) -> None:
        try:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(15)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(15)
        finally:
            self._log.close()


class OrchestratorServer(LlamaServer):
    """`orchestrator serve` on a free port, with LlamaServer's interface."""

    name = "orchestrator serve"

    def __init__(self, model_path, log_path, rpc: list[str], extra_args=(), n_ctx: int = 1024, n_parallel: int = 1):
        self.port = reference.free_port()
        cmd = [sys.executable, "-m", "orchestrator", "serve", "--rpc", ",".join(rpc), "-m", str(model_path),
               "--host", reference.LOCALHOST, "--port", str(self.port), "-c", str(n_ctx), "-np", str(n_parallel),
               *map(str, extra_args)]
        self._start(cmd, log_path, orchestrator_env())


def orchestrator_env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}


def started(server: LlamaServer) -> LlamaServer:
    try:
        server.wait_healthy(RPC_TIMEOUT)  # includes uploading ~90 MiB of weights
    except BaseException:
        server.stop()
        raise
    return server


def serve_greedy(model, prompts, n_predict: int, n_ctx: int, tmp_path) -> list[str]:
    """Greedy completions of `prompts` sent at once to `orchestrator serve` (-np one slot per prompt, -fa on)
    over one of our workers started for the call."""
    workers = start_workers(("ours",), tmp_path)
    try:
        server = started(OrchestratorServer(model, tmp_path / "serve.log", [workers[0].address], ["-fa", "on"],
                                            n_ctx=n_ctx, n_parallel=len(prompts)))
        try:
            with ThreadPoolExecutor(len(prompts)) as pool:
                return list(pool.map(lambda prompt: _complete(server.url, prompt, n_predict), prompts))
        finally:
            server.stop()
    finally:
        stop_workers(workers)


def _complete(url: str, prompt: str, n_predict: int) -> str:
    body = {"prompt": prompt, "max_tokens": n_predict, "temperature": 0, "ignore_eos": True}
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=RPC_TIMEOUT) as response:
        return json.loads(response.read())["choices"][0]["text"]


# -- our orchestrator over workers started for a module ---------------------------------------------------


def start_workers(kinds, log_dir, mem_mib=None, extra=None) -> list:
    """Workers of the given kinds ("ours"/"reference"); mem_mib: a tuple, one per worker; extra: flags
    of our worker number i."""
    mem_mib = mem_mib or (None,) * len(kinds)
    workers = []
    try:
        for i, (kind, mem) in enumerate(zip(kinds, mem_mib, strict=True)):
            workers.append(reference.start_worker(kind, log_dir, threads=CLIENT_THREADS, mem_mib=mem,
                                                  extra=(extra or {}).get(i, ())))
    except reference.WorkerFailed as exc:
        for w in workers:
            w.stop()
        pytest.fail(str(exc), pytrace=False)
    return workers


def stop_workers(workers) -> None:
    dead = [w for w in workers if not w.alive()]
    for w in workers:
        w.stop()
    if dead:
        pytest.fail("a worker died during the module.\n" + "\n".join(w.describe() for w in dead), pytrace=False)


def run_orchestrator(args, workers=(), timeout=RPC_TIMEOUT) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "orchestrator", *map(str, args)]
    try:
        done = subprocess.run(cmd, capture_output=True, timeout=timeout, env=orchestrator_env(), cwd=REPO_ROOT, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise ClientFailed(f"orchestrator timed out after {timeout:.0f}s\n{(exc.stderr or b'')[-3000:].decode()}"
                           + "".join(w.describe() for w in workers)) from None
    done.stdout = done.stdout.decode("utf-8", "replace")
    done.stderr = done.stderr.decode("utf-8", "replace")
    if done.returncode != 0:
        raise ClientFailed(f"orchestrator exited with {done.returncode}\ncommand: {' '.join(cmd)}\n"
                           f"stderr:\n{done.stderr[-3000:]}\n" + "".join(w.describe() for w in workers))
    return done
