"""llama-server with its layers on the worker answers chat requests exactly like a CPU-only llama-server."""
from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request

import pytest

from .conftest import CLIENT_THREADS, OFFLOAD_RE, RPC_TIMEOUT, reference, text_diff

pytestmark = pytest.mark.interop


CHATS = {
    "capital": [{"role": "user", "content": "What is the capital of France?"}],
    "followup": [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Name a colour of the sky."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "And at sunset?"},
    ],
}


class LlamaServer:
    """A llama-server process on a free port, logging to a file."""

    def __init__(self, bin_dir, model_path, log_path, extra_args: list[str], n_ctx: int = 1024, n_parallel: int = 1):
        self.port = reference.free_port()
        self.log_path = log_path
        self.cmd = [str(bin_dir / "llama-server"), "-m", str(model_path), "--host", reference.LOCALHOST,
                    "--port", str(self.port), "-t", str(CLIENT_THREADS), "-c", str(n_ctx), "-np", str(n_parallel),
                    "--no-webui", "-fit", "off", "-lv", "4", *map(str, extra_args)]
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, env=reference.llama_env())

    @property
    def url(self) -> str:
        return f"http://{reference.LOCALHOST}:{self.port}"

    def describe(self) -> str:
        state = "running" if self.proc.poll() is None else f"exited with status {self.proc.returncode}"
        tail = self.log_path.read_bytes()[-3000:].decode("utf-8", "replace")
        return f"llama-server ({state})\n  command: {' '.join(self.cmd)}\n  log tail:\n{tail}"

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"llama-server exited during startup.\n{self.describe()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass  # not listening yet, or 503 while the model loads
            if time.monotonic() > deadline:
                raise AssertionError(f"llama-server not healthy within {timeout:.0f}s.\n{self.describe()}")
            time.sleep(0.25)

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


def started(server: LlamaServer) -> LlamaServer:
    try:
        server.wait_healthy(RPC_TIMEOUT)  # includes uploading ~90 MiB of weights
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture(scope="module")
def cpu_server(bin_dir, model_path, tmp_path_factory):
    server = started(LlamaServer(bin_dir, model_path, tmp_path_factory.mktemp("server") / "cpu.log", ["-ngl", 0]))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def rpc_server(bin_dir, model_path, worker, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "rpc.log"
    server = started(LlamaServer(bin_dir, model_path, log, ["--rpc", worker.address, "-ngl", 99]))
    yield server
    server.stop()


def assistant_text(reply: dict) -> str:
    message = reply["choices"][0]["message"]
    assert message["role"] == "assistant", reply
    return message.get("content") or ""


def test_server_offloads_every_layer(rpc_server):
    match = OFFLOAD_RE.search(rpc_server.log_path.read_text(errors="replace"))
    assert match and match.group(1) == match.group(2), rpc_server.describe()


@pytest.mark.parametrize("chat_id", list(CHATS))
def test_chat_matches_cpu(rpc_server, cpu_server, worker, chat_id):
    expected = assistant_text(cpu_server.chat(CHATS[chat_id]))
    # The repeat is answered from the slot's prompt cache: a different path through the worker.
    for attempt in ("first", "repeated"):
        got = assistant_text(rpc_server.chat(CHATS[chat_id]))
        assert got.strip(), f"empty assistant message ({attempt} request)\n{worker.describe()}"
        assert got == expected, f"{attempt} request: " + text_diff(expected, got)
