"""tools/trace_proxy.py: transparent to llama.cpp, and it sees what an independent trace saw."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.trace_proxy import TraceProxy

from .conftest import CLIENT_THREADS, RPC_TIMEOUT

pytestmark = pytest.mark.interop

# traced independently (llama-cli, SmolLM2 Q4_1, default flags) and shipped with the reference notes
SHARED_SUMMARY = Path(__file__).resolve().parent / "data" / "llama-cli-ops-summary.json"


@pytest.fixture(scope="module")
def reference_worker(bin_dir, tmp_path_factory):
    from .conftest import reference

    w = reference.start_worker("reference", tmp_path_factory.mktemp("traced"), threads=CLIENT_THREADS)
    yield w
    w.stop()


def completion(llama, model_path, address, *extra):
    args = ["-m", model_path, "-p", "The capital of France is", "-n", 16, "--temp", 0, "-no-cnv", "-t", CLIENT_THREADS,
            "-ngl", 99, "-fit", "off", "--rpc", address, *extra]
    return llama("llama-completion", args, timeout=RPC_TIMEOUT).stdout


def test_proxy_is_transparent_and_records_the_graphs(llama, model_path, reference_worker, tmp_path):
    direct = completion(llama, model_path, reference_worker.address, "-fa", "on")
    with TraceProxy(reference_worker.address) as proxy:
        traced = completion(llama, model_path, proxy.address, "-fa", "on")
    assert traced == direct
    assert not proxy.parse_errors
    summary = proxy.trace.summary()
    assert summary["commands"]["GRAPH_COMPUTE"] >= 1 and summary["commands"]["GRAPH_RECOMPUTE"] >= 1
    assert summary["commands"]["HELLO"] >= 1
    ops = {(op, type_, tuple(srcs)) for op, type_, srcs, _ in summary["ops"]}
    shared = {(op, type_, tuple(srcs)) for (op, type_, srcs), _ in json.loads(SHARED_SUMMARY.read_text())["ops"]}
    assert ops == shared
    proxy.trace.save(tmp_path / "trace")
    graphs = (tmp_path / "trace.graphs.jsonl").read_text().splitlines()
    assert len(graphs) == summary["commands"]["GRAPH_COMPUTE"]
    first = json.loads(graphs[0])
    assert any(node[0] == "ROPE" and node[4][1] == 64 for node in first)  # n_dims of SmolLM2's rope


def test_flash_attention_off_sends_soft_max(llama, model_path, reference_worker):
    with TraceProxy(reference_worker.address) as proxy:
        completion(llama, model_path, proxy.address, "-fa", "off")
    ops = {op for op, *_ in proxy.trace.summary()["ops"]}
    assert "SOFT_MAX" in ops and "FLASH_ATTN_EXT" not in ops
