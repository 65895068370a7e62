"""GRAPH_COMPUTE: decode a graph, validate every node against memory and op semantics, plan, run.

Everything that could let a kernel touch memory it should not is checked here, once, before the
first kernel runs: tensor types, block alignment, every tensor's byte span inside a buffer this
connection owns, views inside their source, no tensor of more elements than all the connection's
buffers hold (zero strides could claim 2^64: scratch and loops grow with them), and each op's own
shape rules (the kernel's `check`).
The resulting plan is kept so GRAPH_RECOMPUTE re-runs it without decoding or validating again.

Each record becomes a kernel Tensor in memory.py's one checked step (BufferTable.tensor); this
module adds what only a graph knows: ids, sources, views inside their source, and ops. A tensor
without memory (it lives on another server) is refused only where a node would read or write it.
As in ggml-cpu, a node whose result is empty (a dimension of 0: e.g. the
last layer of a batch that selects no output rows) computes nothing and is not checked further.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kernels import InvalidNode, Node, Tensor, load_all
from kernels.registry import lookup
from kernels.target import AVX2, Target
from wire.ggml import FLAG_COMPUTE, VIEW_OPS, GGMLOp, logical_bytes, nbytes
from .memory import NO_MEMORY, BufferTable, RequestError, tensor_label
from wire.protocol import GraphComputeRequest, RpcTensor

load_all()


@dataclass
class Plan:
    steps: list  # (bound forward, Node) in execution order
    n_nodes: int

    def run(self) -> None:
        for run, _ in self.steps:
            run()


def _resolve(records: dict[int, RpcTensor], ids, buffers: BufferTable) -> dict[int, Tensor]:
    """Build a validated Tensor for every id reachable from `ids` (iteratively; graphs are deep)."""
    views: dict[int, Tensor] = {}
    visiting: set[int] = set()
    stack = [int(i) for i in ids]
    while stack:
        tid = stack[-1]
        if tid in views:
            stack.pop()
            continue
        rec = records.get(tid)
        if rec is None:
            raise RequestError(f"tensor id 0x{tid:x} is referenced but not in the graph")
        deps = [s for s in (*rec.src, rec.view_src) if s and s not in views]
        if deps:
            if tid in visiting:
                raise RequestError(f"tensor {tensor_label(rec)} depends on itself")
            visiting.add(tid)
            stack.extend(deps)
            continue
        stack.pop()
        visiting.discard(tid)
        views[tid] = _make_tensor(rec, records, views, buffers)
    return views


def _make_tensor(rec: RpcTensor, records, views, buffers: BufferTable) -> Tensor:
    tensor = buffers.tensor(rec)
    if rec.view_src and tensor.mem is not NO_MEMORY:
        src = views[rec.view_src]
        label, src_label = tensor_label(rec), tensor_label(records[rec.view_src])
        if src.mem is not tensor.mem:
            raise RequestError(f"view {label} is not in the buffer of its source {src_label}")
        end, src_end = (t.offset + nbytes(t.type, t.ne, t.nb) for t in (tensor, src))
        if not (src.offset <= tensor.offset and end <= src_end):
            raise RequestError(f"view {label} reaches outside its source {src_label}")
    return tensor


def build_plan(request: GraphComputeRequest, buffers: BufferTable, target: Target = AVX2) -> Plan:
    """The checked, bound nodes of a graph, each computed as the ggml-cpu build `target` computes it."""
    records: dict[int, RpcTensor] = {}
    for rec in RpcTensor.from_records(request.tensors):
        if rec.id == 0:
            raise RequestError("tensor with id 0")
        if records.setdefault(rec.id, rec) is not rec:
            raise RequestError(f"tensor id 0x{rec.id:x} appears twice")
    node_ids = [int(i) for i in request.nodes]
    if any(i == 0 for i in node_ids):
        raise RequestError("graph node with id 0")
    views = _resolve(records, node_ids, buffers)

    steps, limit = [], buffers.total
    for tid in node_ids:
        rec = records[tid]
        try:
            op = GGMLOp(rec.op)
        except ValueError:
            raise RequestError(f"node {tensor_label(rec)} has unknown op {rec.op}") from None
        dst = views[tid]
        if op in VIEW_OPS or not rec.flags & FLAG_COMPUTE or 0 in dst.ne:
            continue  # memory validated above; a view, an unselected branch or an empty result computes nothing
        src = [views[s] if s else None for s in rec.src]
        while src and src[-1] is None:
            src.pop()
        for t, tensor_id in ((dst, tid), *zip(src, rec.src)):
            if t is not None and t.mem is NO_MEMORY:
                raise RequestError(f"node {tensor_label(rec)} ({op.name}) uses "
                                 f"{tensor_label(records[tensor_id])}, which has no buffer here")
        for t, tensor_id in ((dst, tid), *zip(src, rec.src)):
            if t is not None and logical_bytes(t.type, t.ne) > limit:
                raise RequestError(f"node {tensor_label(rec)} ({op.name}): {tensor_label(records[tensor_id])} "
                                   f"holds more elements than all {limit} bytes of this connection's buffers")
        node = Node(op, dst, src, np.frombuffer(rec.op_params, dtype="<i4"), rec.name, target)
        try:
            kernel = lookup(node)
            kernel.check(node)
            steps.append((kernel.bind(node), node))
        except InvalidNode as exc:
            raise RequestError(f"node {tensor_label(rec)} ({op.name}): {exc}") from None
        except MemoryError:
            raise RequestError(f"node {tensor_label(rec)} ({op.name}): its scratch does not fit in memory") from None
    return Plan(steps, len(node_ids))


def run_plan(plan: Plan) -> None:
    try:
        plan.run()
    except InvalidNode as exc:  # index values are checked as the kernels meet them
        raise RequestError(str(exc)) from None


