"""The recorded warm-up session covers what a real client sends, so the worker's start-up compiles it.

The oracle is a census of the ops and types llama-cli sent through the trace proxy
(tests/interop/data/llama-cli-ops-summary.json, SmolLM2 with default settings): every (op, result type,
source types) there must occur in the recording's graphs, else the first real client would compile
kernels in its first GRAPH_COMPUTE.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from wire.ggml import GGMLGluOp, GGMLOp, GGMLType, GGMLUnaryOp
from wire import protocol as p
from rpcserver import warmup

pytestmark = pytest.mark.unit

CENSUS = Path(__file__).resolve().parents[1] / "interop" / "data" / "llama-cli-ops-summary.json"


def label(op: int, params: np.ndarray) -> str:
    name = GGMLOp(op).name
    if op == GGMLOp.UNARY:
        return f"UNARY:{GGMLUnaryOp(int(params[0])).name}"
    if op == GGMLOp.GLU:
        return f"GLU:{GGMLGluOp(int(params[0])).name}"
    return name


def recorded_ops(tier: str = "all") -> set[tuple]:
    ops = set()
    for frames in warmup.decode(warmup.RECORDING.read_bytes())[:warmup.TIERS[tier]]:
        for command, payload in frames:
            if command != p.Command.GRAPH_COMPUTE:
                continue
            graph = p.GraphComputeRequest.decode(memoryview(payload))
            records = {int(r["id"]): r for r in graph.tensors}
            for rec in records.values():
                if rec["op"] == GGMLOp.NONE:
                    continue
                srcs = tuple(GGMLType(int(records[int(s)]["type"])).name for s in rec["src"] if s)
                ops.add((label(int(rec["op"]), rec["op_params"]), GGMLType(int(rec["type"])).name, srcs))
    return ops


def test_the_recording_covers_a_real_clients_ops():
    census = {(op, dst, tuple(srcs)) for (op, dst, srcs), _count in json.loads(CENSUS.read_text())["ops"]}
    missing = census - recorded_ops()
    assert not missing, f"ops llama-cli sends that the warm-up recording never runs: {sorted(missing)}"


def test_the_demo_tier_covers_the_demo_models_ops():
    """The census is of SmolLM2 Q4_1, the demo's model: the demo tier (what the orchestrator's local
    workers replay) runs all of it but the two input nodes only llama.cpp's own graphs start with."""
    census = {(op, dst, tuple(srcs)) for (op, dst, srcs), _count in json.loads(CENSUS.read_text())["ops"]}
    llama_cpp_inputs = {("DUP", "F32", ("F32",)), ("SET_ROWS", "F32", ("F32", "I64", "F32"))}
    missing = census - llama_cpp_inputs - recorded_ops("demo")
    assert not missing, f"ops of the demo's model that the demo tier never runs: {sorted(missing)}"


def test_the_worker_offers_every_tier():
    from rpcserver.cli import main

    option = next(o for o in main.params if o.name == "warmup_tier")
    assert list(option.type.choices) == list(warmup.TIERS)


def test_the_recording_replays_through_a_session():
    sessions = warmup.decode(warmup.RECORDING.read_bytes())
    # the demo's model; flash attention on, off; one KV head; a qwen3moe; llama.cpp graphs' input nodes
    assert len(sessions) == 6
    commands = {command for frames in sessions for command, _ in frames}
    assert {p.Command.SET_TENSOR, p.Command.GRAPH_COMPUTE, p.Command.GRAPH_RECOMPUTE, p.Command.GET_TENSOR} <= commands


def test_a_damaged_recording_is_an_error(tmp_path, monkeypatch):
    bad = tmp_path / "warmup.rec"
    bad.write_bytes(b"not zlib")
    monkeypatch.setattr(warmup, "RECORDING", bad)
    with pytest.raises(warmup.WarmupError, match="cannot read"):
        warmup.warm_up()


def test_the_recording_covers_the_draft_rings_draws():
    """The draft's ring for sampled jobs ends its graph in sample_tail (graph/llama.py): its ops are in the
    recording, so a worker's first sampled draft compiles nothing (measured: 3.9 s with an empty numba
    cache, 0.05 s warm)."""
    from orchestrator.engine.drafter import DRAFT_TOP_K
    from orchestrator.graph.ggml import Graph, new_tensor
    from orchestrator.graph.llama import sample_tail

    g = Graph()
    sample_tail(g, new_tensor(GGMLType.F32, (256, 1), "logits"), {}, DRAFT_TOP_K)
    tail = {(t.op.name, t.type.name, tuple(s.type.name for s in t.src)) for t in g.tensors()
            if t.op not in (GGMLOp.NONE, GGMLOp.RESHAPE, GGMLOp.VIEW)}
    assert {"TOP_K", "ARGSORT", "GET_ROWS", "ADD", "ARGMAX"} <= {op for op, _, _ in tail}
    assert not tail - recorded_ops(), sorted(tail - recorded_ops())
