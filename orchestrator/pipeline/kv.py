"""The KV cache's bookkeeping on the orchestrator side, and the batch one decode step carries.

The CLI's one sequence holds position i in cell i, and attends the used cells padded to 256, as
llama.cpp; the serving engine gives each slot a run of cells of its own (orchestrator/engine/batching.py). A
token attends the cells of its own sequence at positions up to its own. The K and V tensors live on
the workers; only this map is here.

Sliding-window layers (Gemma 3) have a cache of their own, as llama.cpp's iSWA cache: the CLI's one
sequence places its cells exactly as llama.cpp does (SwaCells: a ring of cells reused once the window has
passed them, so attention visits them in llama.cpp's order); the serving engine gives them a full-size
cache holding the same cells as the global layers (llama.cpp's --swa-full) and only masks by the window.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FREE = -1
KV_PAD = 256  # llama.cpp pads the context and the attended cell count to this


def padded_cells(extent: int, size: int) -> int:
    """The cells a step attends once `extent` cells are in use: padded to KV_PAD, at most the cache."""
    return min(size, max(KV_PAD, -(-extent // KV_PAD) * KV_PAD))


@dataclass
class Group:
    """Consecutive rows of a batch that one attention node serves: they attend cells [cell0, cell0 + n_kv);
    with n_streams > 1, the rows of several slots as llama.cpp's streams: stream s is cells
    [cell0 + s * stride, + n_kv), with one query row each (`gather`: the group's row each stream takes,
    `scatter`: the stream each of the group's rows comes back from; such a group comes first in its
    batch, so its rows are the batch's)."""

    n_rows: int
    cell0: int
    visible: np.ndarray  # bool (n_rows, n_kv), or (n_streams, n_kv)
    swa_visible: np.ndarray | None = None  # the sliding-window layers' mask over the same cells
    n_streams: int = 1
    stride: int = 0
    gather: np.ndarray | None = None  # int32 (n_streams,)
    scatter: np.ndarray | None = None  # int32 (n_rows,)

    @property
    def n_kv(self) -> int:
        return self.visible.shape[1]

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """What the graph's node depends on."""
        return self.n_rows, self.cell0, self.n_kv, self.n_streams, self.stride


@dataclass
class Batch:
    """One decode step: tokens (any mix of sequences), where their K/V go, what each attends, and the
    rows whose logits come back."""

    tokens: list[int]
    pos: np.ndarray  # int32, the token's position in its sequence
    cells: np.ndarray  # int64, the KV cell its K and V are written to
    visible: np.ndarray  # bool (n_tokens, n_cells): the cells each token attends (n_cells >= the used extent)
    out_ids: np.ndarray  # int32, the rows of the batch whose logits are wanted, in order
    swa_cells: np.ndarray | None = None  # the sliding-window layers' cells, when the model has such layers
    swa_visible: np.ndarray | None = None  # bool (n_tokens, n_swa_cells), as `visible` for those layers
    groups: list[Group] | None = None  # the serving engine's attention groups (then `visible` is unused)

    @classmethod
    def sequence(cls, tokens: list[int], n_past: int, n_cells: int) -> "Batch":
        """The one sequence of the CLI: cell i holds position i; the last token's logits."""
        cells = np.arange(n_past, n_past + len(tokens), dtype=np.int64)
        visible = np.arange(n_cells)[None, :] <= cells[:, None]
        return cls(list(tokens), cells.astype(np.int32), cells, visible,
                   np.array([len(tokens) - 1], dtype=np.int32))


class KvFull(ValueError):
    """No free cells for a step's tokens."""


class SwaCells:
    """llama.cpp's KV cache of the sliding-window layers (llama_kv_cache with n_swa, one stream), cell for
    cell: find_slot takes, from the head on and round the ring, the empty cells and those whose position
    the window of their sequence has passed; apply_ubatch writes them and purges the sequence's positions
    below the ones overwritten; the attended cells are the used extent padded to 256."""

    def __init__(self, size: int, n_swa: int):
        self.size, self.n_swa, self.head = size, n_swa, 0
        self.seq = np.full(size, FREE, dtype=np.int32)
        self.pos = np.full(size, -1, dtype=np.int32)

    def place(self, seq: int, positions: np.ndarray) -> np.ndarray:
        """The cells of `positions` (ascending, after the sequence's own), now holding them. Positions the
        sequence already has from there on are dropped first (a step computed again)."""
        self.release(seq, int(positions[0]))
        idxs = self._find_slot(len(positions))
        overwritten: dict[int, int] = {}
        for idx, p in zip(idxs, positions):
            if self.seq[idx] != FREE:
                s = int(self.seq[idx])
                overwritten[s] = max(overwritten.get(s, -1), int(self.pos[idx]))
            self.seq[idx], self.pos[idx] = seq, p
        for s, pos_max in overwritten.items():  # keep each sequence's positions contiguous
            mine = self.pos[self.seq == s]
            if mine.min() <= pos_max:
                self.release(s, int(mine.min()), pos_max + 1)
        self.head = idxs[-1] + 1
        return np.array(idxs, dtype=np.int64)

    def _find_slot(self, n: int) -> list[int]:
        used = int(np.count_nonzero(self.seq != FREE))
        head = 0 if self.head > used + 2 * n else self.head  # room before the head: fill from the start
        pos_max = {int(s): int(self.pos[self.seq == s].max()) for s in np.unique(self.seq[self.seq != FREE])}
        idxs, tested = [], 0
        while True:
            if head >= self.size:
                head = 0
            idx, head, tested = head, head + 1, tested + 1
            s = int(self.seq[idx])
            if s == FREE or pos_max[s] + 1 - self.pos[idx] >= self.n_swa:
                idxs.append(idx)
                if len(idxs) == n:
                    return idxs
            if tested >= self.size:
                raise KvFull(f"no {n} free cells in the sliding-window cache of {self.size}")

    def release(self, seq: int, p0: int = 0, p1: int = np.iinfo(np.int32).max) -> None:
        """llama_kv_cache::seq_rm: frees the sequence's cells at positions [p0, p1); the head moves back
        to the first one freed if that is lower."""
        freed = np.flatnonzero((self.seq == seq) & (self.pos >= p0) & (self.pos < p1))
        self.seq[freed], self.pos[freed] = FREE, -1
        if freed.size:
            self.head = min(self.head, int(freed[0]))

    def n_kv(self, pad: int) -> int:
        """The cells a step attends: the used extent padded to `pad`, at least `pad`, at most the cache."""
        used = np.flatnonzero(self.seq != FREE)
        extent = int(used[-1]) + 1 if used.size else 0
        return min(self.size, max(pad, -(-extent // pad) * pad))

    def visible(self, seqs: np.ndarray, pos: np.ndarray, n_kv: int) -> np.ndarray:
        """bool (n_tokens, n_kv): the cells of the token's own sequence at most n_swa - 1 positions back."""
        seq, cpos = self.seq[:n_kv], self.pos[:n_kv]
        return (seq[None, :] == seqs[:, None]) & (cpos[None, :] <= pos[:, None]) & \
            (pos[:, None] - cpos[None, :] < self.n_swa)
