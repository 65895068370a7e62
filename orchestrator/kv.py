"""The KV cache's bookkeeping on the orchestrator side, and the batch one decode step carries.

As llama.cpp's unified cache: every cell holds one (sequence, position) or nothing, a token attends the
cells of its own sequence at positions up to its own, and the attended cells are the used ones padded
to 256, so short sequences stay cheap however many there are. One rule more than there: a sequence's
new cells always lie above its existing ones, so its cells are visited in position order whatever the
others do, and its results do not depend on them (attention skips masked cells, but summing its own
cells in another order would round differently). Where no free cell lies above, `take` refuses and the
caller computes the sequence again from its start. The K and V tensors live on the workers; only this
map is here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FREE = -1


@dataclass
class Batch:
    """One decode step: tokens (any mix of sequences), where their K/V go, what each attends, and the
    rows whose logits come back."""

    tokens: list[int]
    pos: np.ndarray  # int32, the token's position in its sequence
    cells: np.ndarray  # int64, the KV cell its K and V are written to
    visible: np.ndarray  # bool (n_tokens, n_cells): the cells each token attends (n_cells >= the used extent)
    out_ids: np.ndarray  # int32, the rows of the batch whose logits are wanted, in order

    @classmethod
    def sequence(cls, tokens: list[int], n_past: int, n_cells: int) -> "Batch":
        """The one sequence of the CLI: cell i holds position i; the last token's logits."""
        cells = np.arange(n_past, n_past + len(tokens), dtype=np.int64)
        visible = np.arange(n_cells)[None, :] <= cells[:, None]
        return cls(list(tokens), cells.astype(np.int32), cells, visible,
                   np.array([len(tokens) - 1], dtype=np.int32))


class KvFull(ValueError):
    """No free cells above the sequence's last one."""


class KvCells:
    """Which sequence and position each of the cache's cells holds."""

    def __init__(self, size: int):
        self.seq = np.full(size, FREE, dtype=np.int32)
        self.pos = np.zeros(size, dtype=np.int32)

    def extent(self) -> int:
        """One past the highest cell in use (0 when empty)."""
        used = np.flatnonzero(self.seq != FREE)
        return int(used[-1]) + 1 if used.size else 0

    def take(self, seq: int, positions: np.ndarray) -> np.ndarray:
        """The lowest free cells above the sequence's own for `positions` (ascending), now marked as its."""
        mine = np.flatnonzero(self.seq == seq)
        above = int(mine[-1]) + 1 if mine.size else 0
        free = above + np.flatnonzero(self.seq[above:] == FREE)[: len(positions)]
        if free.size < len(positions):
            raise KvFull(f"no {len(positions)} free KV cells above cell {above} for sequence {seq}")
        self.seq[free], self.pos[free] = seq, positions
        return free.astype(np.int64)

    def release(self, seq: int, from_pos: int = 0) -> None:
        """Frees the cells of `seq` at positions >= from_pos."""
        self.seq[(self.seq == seq) & (self.pos >= from_pos)] = FREE

    def batch(self, tokens: list[int], seqs: np.ndarray, pos: np.ndarray, cells: np.ndarray, out_ids: np.ndarray,
              n_cells: int) -> Batch:
        """The batch of tokens already given their cells (take), attending over the first n_cells."""
        seq, cpos = self.seq[:n_cells], self.pos[:n_cells]
        visible = (seq[None, :] == seqs[:, None]) & (cpos[None, :] <= pos[:, None])
        return Batch(list(tokens), pos.astype(np.int32), cells, visible, out_ids.astype(np.int32))
