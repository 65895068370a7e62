"""Places a graph's inputs and intermediate results in one compute buffer, reusing memory.

Like ggml-alloc: walk the nodes in order, give each new result the first free block that fits, and
return a tensor's block as soon as its last user has run. Inputs and requested outputs stay live for
the whole graph. Tensors that already have memory (weights, the KV cache) and views are skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.graph.ggml import Graph, RemoteBuffer, Tensor


def round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


class _FreeList:
    def __init__(self):
        self.blocks: list[tuple[int, int]] = []  # (offset, size), sorted, never adjacent
        self.end = 0  # high-water mark

    def take(self, size: int) -> int:
        for i, (off, sz) in enumerate(self.blocks):
            if sz >= size:
                self.blocks[i:i + 1] = [(off + size, sz - size)] if sz > size else []
                return off
        if self.blocks and self.blocks[-1][0] + self.blocks[-1][1] == self.end:
            off = self.blocks.pop()[0]  # grow the trailing free block
        else:
            off = self.end
        self.end = off + size
        return off

    def give(self, off: int, size: int) -> None:
        blocks = self.blocks
        i = next((k for k, (o, _) in enumerate(blocks) if o > off), len(blocks))
        blocks.insert(i, (off, size))
        if i + 1 < len(blocks) and off + size == blocks[i + 1][0]:
            blocks[i] = (off, size + blocks.pop(i + 1)[1])
        if i > 0 and blocks[i - 1][0] + blocks[i - 1][1] == off:
            prev = blocks.pop(i - 1)
            blocks[i - 1] = (prev[0], prev[1] + blocks[i - 1][1])


@dataclass
class MemoryPlan:
    size: int  # bytes the compute buffer needs
    offsets: dict[int, tuple[Tensor, int]]  # id(tensor) -> (tensor, offset)

    def bind(self, buffer: RemoteBuffer) -> None:
        if buffer.size < self.size:
            raise ValueError(f"compute buffer of {buffer.size} bytes is smaller than the plan's {self.size}")
        for tensor, offset in self.offsets.values():
            tensor.place(buffer, offset)


def plan_memory(graph: Graph, inputs: list[Tensor], outputs: list[Tensor], alignment: int) -> MemoryPlan:
    def needs_memory(t: Tensor) -> bool:
        return t.view_src is None and t.buffer is None

    last_use: dict[int, int] = {}
    for i, node in enumerate(graph.nodes):
        for s in node.src:
            last_use[id(s.root)] = i
        if node.view_src is not None:
            last_use[id(node.root)] = i
    pinned = {id(t.root) for t in (*inputs, *outputs)}

    free = _FreeList()
    offsets: dict[int, tuple[Tensor, int]] = {}

    def allocate(t: Tensor) -> None:
        if id(t) not in offsets and needs_memory(t):
            offsets[id(t)] = (t, free.take(round_up(max(t.nbytes, 1), alignment)))

    for t in inputs:
        allocate(t)
    dying: dict[int, list[Tensor]] = {}
    for t_id, i in last_use.items():
        if t_id not in pinned:
            dying.setdefault(i, []).append(t_id)
    for i, node in enumerate(graph.nodes):
        for s in node.src:
            if s.root is s and needs_memory(s) and id(s) not in offsets:
                raise ValueError(f"'{s.name}' is used by '{node.name}' but is neither an input nor computed")
        allocate(node)
        for t_id in dying.get(i, ()):
            if t_id in offsets and t_id != id(node):
                t, off = offsets[t_id]
                free.give(off, round_up(max(t.nbytes, 1), alignment))
    return MemoryPlan(free.end, offsets)
