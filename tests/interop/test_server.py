"""llama-server with its layers on the worker answers chat requests exactly like a CPU-only llama-server."""
from __future__ import annotations

import pytest

from .conftest import OFFLOAD_RE, text_diff
from .programs import LlamaServer, started

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
