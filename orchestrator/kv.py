"""The KV cache's bookkeeping on the orchestrator side, and the batch one decode step carries.

Every cell holds one (sequence, position) or nothing, and a token attends the cells of its own sequence
at positions up to its own. Each sequence owns a region of n_cells / n_seq cells and position p lives
in cell region + p, like llama.cpp's per-sequence KV streams (not its unified cache): a sequence's cells
are then visited in the same order whatever the others do, so its results do not depend on them
(attention skips the masked cells; summing its own in another order would round differently). The
cache itself (the K and V tensors) lives on the workers; only this map is here.
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


class KvCells:
    """Which sequence and position each of the cache's cells holds."""

    def __init__(self, size: int, n_seq: int = 1):
        self.seq = np.full(size, FREE, dtype=np.int32)
        self.pos = np.zeros(size, dtype=np.int32)
        self.region = size // n_seq  # the cells (and so the positions) of one sequence

    def extent(self) -> int:
        """One past the highest cell in use (0 when empty)."""
        used = np.flatnonzero(self.seq != FREE)
        return int(used[-1]) + 1 if used.size else 0

    def take(self, seq: int, positions: np.ndarray) -> np.ndarray:
        """The cells of `positions` of sequence `seq`, now marked as theirs."""
        positions = np.asarray(positions)
        if positions.size and not 0 <= positions.min() <= positions.max() < self.region:
            raise ValueError(f"position {positions.max()} is past a sequence's {self.region} cells")
        cells = seq * self.region + positions.astype(np.int64)
        self.seq[cells], self.pos[cells] = seq, positions
        return cells

    def release(self, seq: int, from_pos: int = 0) -> None:
        """Frees the cells of `seq` at positions >= from_pos."""
        self.seq[(self.seq == seq) & (self.pos >= from_pos)] = FREE

    def batch(self, tokens: list[int], seqs: np.ndarray, pos: np.ndarray, cells: np.ndarray, out_ids: np.ndarray,
              n_cells: int) -> Batch:
        """The batch of tokens already given their cells (take), attending over the first n_cells."""
        seq, cpos = self.seq[:n_cells], self.pos[:n_cells]
        visible = (seq[None, :] == seqs[:, None]) & (cpos[None, :] <= pos[:, None])
        return Batch(list(tokens), pos.astype(np.int32), cells, visible, out_ids.astype(np.int32))
