"""GRAPH_COMPUTE: decode a graph, validate every node against memory and op semantics, plan, run.

Everything that could let a kernel touch memory it should not is checked here, once, before the
first kernel runs: tensor types, block alignment, every tensor's byte span inside a buffer this
connection owns, views inside their source, and each op's own shape rules (the kernel's `check`).
The resulting plan is kept so GRAPH_RECOMPUTE re-runs it without decoding or validating again.

As in ggml-rpc's server, a tensor may come without memory: a client sends buffer 0 and data 0 for
a tensor that lives on another server, and a buffer handle this connection does not own counts as
none. Such a tensor is refused only where a node would read or write it; a data pointer without a
buffer is refused at once. As in ggml-cpu, a node whose result is empty (a dimension of 0: e.g. the
last layer of a batch that selects no output rows) computes nothing and is not checked further.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kernels import InvalidNode, Node, Tensor, load_all
from kernels.registry import lookup
from kernels.target import AVX2, Target
from kernels.ggml import FLAG_COMPUTE, VIEW_OPS, GGMLOp, GGMLType, type_traits
from .memory import BufferTable, AddressError
from .protocol import GraphComputeRequest, RpcTensor

load_all()


class GraphError(ValueError):
    """A graph this worker refuses: malformed, out of bounds, or using what it does not support."""


_NO_MEMORY = np.zeros(0, dtype=np.uint8)  # what a tensor without a buffer points at; never computed on


@dataclass
class Plan:
    steps: list  # (bound forward, Node) in execution order
    n_nodes: int

    def run(self) -> None:
        for run, _ in self.steps:
            run()


def _tensor_label(rec: RpcTensor) -> str:
    return f"'{rec.name}'" if rec.name else f"id 0x{rec.id:x}"


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
            raise GraphError(f"tensor id 0x{tid:x} is referenced but not in the graph")
        deps = [s for s in (*rec.src, rec.view_src) if s and s not in views]
        if deps:
            if tid in visiting:
                raise GraphError(f"tensor {_tensor_label(rec)} depends on itself")
            visiting.add(tid)
            stack.extend(deps)
            continue
        stack.pop()
        visiting.discard(tid)
        views[tid] = _make_tensor(rec, records, views, buffers)
    return views


def _make_tensor(rec: RpcTensor, records, views, buffers: BufferTable) -> Tensor:
    label = _tensor_label(rec)
    traits = type_traits(rec.type)
    if traits is None or traits.block_size == 0:
        raise GraphError(f"tensor {label} has invalid type {rec.type}")
    if traits.is_quantized and rec.nb[0] != traits.type_size:
        raise GraphError(f"quantized tensor {label} must have contiguous blocks (nb[0]={rec.nb[0]})")
    if not buffers.owns(rec.buffer):  # none, or another connection's / server's: "no buffer"
        if rec.data != 0:
            raise GraphError(f"tensor {label} has a data pointer but no buffer of this connection")
        return Tensor(GGMLType(rec.type), rec.ne, rec.nb, _NO_MEMORY, 0, rec.name)
    try:
        buf, offset, size = buffers.locate(rec)
    except AddressError as exc:
        raise GraphError(str(exc)) from None
    itemsize = traits.type_size if not traits.is_quantized else 1
    if offset % itemsize or any(n % itemsize for n in rec.nb):
        raise GraphError(f"tensor {label} is not aligned to its element size {itemsize}")
    if rec.view_src:
        src = records[rec.view_src]
        if src.buffer != rec.buffer or views[rec.view_src].mem is _NO_MEMORY:
            raise GraphError(f"view {label} is not in the buffer of its source")
        _, src_offset, src_size = buffers.locate(src)
        if not (src_offset <= offset and offset + size <= src_offset + src_size):
            raise GraphError(f"view {label} reaches outside its source {_tensor_label(src)}")
    return Tensor(GGMLType(rec.type), rec.ne, rec.nb, buf.mem, offset, rec.name)


def build_plan(request: GraphComputeRequest, buffers: BufferTable, target: Target = AVX2) -> Plan:
    """The checked, bound nodes of a graph, each computed as the ggml-cpu build `target` computes it."""
    records: dict[int, RpcTensor] = {}
    for raw in request.tensors:
        rec = RpcTensor.from_record(raw)
        if rec.id == 0:
            raise GraphError("tensor with id 0")
        if records.setdefault(rec.id, rec) is not rec:
            raise GraphError(f"tensor id 0x{rec.id:x} appears twice")
    node_ids = [int(i) for i in request.nodes]
    if any(i == 0 for i in node_ids):
        raise GraphError("graph node with id 0")
    views = _resolve(records, node_ids, buffers)

    steps = []
    for tid in node_ids:
        rec = records[tid]
        try:
            op = GGMLOp(rec.op)
        except ValueError:
            raise GraphError(f"node {_tensor_label(rec)} has unknown op {rec.op}") from None
        dst = views[tid]
        if op in VIEW_OPS or not rec.flags & FLAG_COMPUTE or 0 in dst.ne:
            continue  # memory validated above; a view, an unselected branch or an empty result computes nothing
        src = [views[s] if s else None for s in rec.src]
        while src and src[-1] is None:
            src.pop()
        for t, tensor_id in ((dst, tid), *zip(src, rec.src)):
            if t is not None and t.mem is _NO_MEMORY:
                raise GraphError(f"node {_tensor_label(rec)} ({op.name}) uses "
                                 f"{_tensor_label(records[tensor_id])}, which has no buffer here")
        node = Node(op, dst, src, np.frombuffer(rec.op_params, dtype="<i4"), rec.name, target)
        try:
            kernel = lookup(node)
            kernel.check(node)
            steps.append((kernel.bind(node), node))
        except InvalidNode as exc:
            raise GraphError(f"node {_tensor_label(rec)} ({op.name}): {exc}") from None
    return Plan(steps, len(node_ids))


def run_plan(plan: Plan) -> None:
    try:
        plan.run()
    except InvalidNode as exc:  # index values are checked as the kernels meet them
        raise GraphError(str(exc)) from None


