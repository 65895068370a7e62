"""The kernel table: which (op, sub-op) this worker computes, and how.

Every op module registers an OpKernel against the table; nothing else decides what is supported.
`check` refuses a node before anything executes; `forward` is the numba kernel; `reference` is its
numpy twin, the living specification the kernel is tested against. `prepare`, where a kernel has it,
does once what `forward` would redo on every call (views, scratch, parameters) and returns the
zero-argument call that runs the node: a plan replayed by GRAPH_RECOMPUTE then costs one numba call
per node.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

from wire.ggml import GGMLGluOp, GGMLOp, GGMLUnaryOp

from .node import InvalidNode, Node


@dataclass(frozen=True)
class OpKernel:
    check: Callable[[Node], None]
    forward: Callable[[Node], None]
    reference: Callable[[Node], None]
    prepare: Callable[[Node], Callable[[], None]] | None = None

    def bind(self, node: Node) -> Callable[[], None]:
        """The node's forward as a zero-argument call (the node must have passed check)."""
        return self.prepare(node) if self.prepare is not None else partial(self.forward, node)


def nothing() -> None:
    """The bound call of a node without work (an empty tensor)."""


def prepared(prepare: Callable[[Node], Callable[[], None]]) -> Callable[[Node], None]:
    """The forward of a kernel that has a prepare: bind and run at once."""
    return lambda node: prepare(node)()


# key: (op, sub-op) where sub-op is the unary/glu op for UNARY/GLU and 0 otherwise
KERNELS: dict[tuple[int, int], OpKernel] = {}


def register(op: GGMLOp, sub: int = 0):
    """Class-free registration: decorate a function returning (check, forward, reference)."""

    def add(kernel: OpKernel) -> OpKernel:
        key = (int(op), int(sub))
        if key in KERNELS:
            raise RuntimeError(f"kernel for {op.name}/{sub} registered twice")
        KERNELS[key] = kernel
        return kernel

    return add


def sub_op(node: Node) -> int:
    return node.param("op") if node.op in (GGMLOp.UNARY, GGMLOp.GLU) else 0


def op_label(op: int, sub: int) -> str:
    try:
        name = GGMLOp(op).name
    except ValueError:
        return f"op#{op}"
    if op == GGMLOp.UNARY:
        return f"UNARY:{GGMLUnaryOp(sub).name if sub in GGMLUnaryOp._value2member_map_ else sub}"
    if op == GGMLOp.GLU:
        return f"GLU:{GGMLGluOp(sub).name if sub in GGMLGluOp._value2member_map_ else sub}"
    return name


def lookup(node: Node) -> OpKernel:
    kernel = KERNELS.get((int(node.op), sub_op(node)))
    if kernel is None:
        raise InvalidNode(f"unsupported op {op_label(node.op, sub_op(node))}")
    return kernel
