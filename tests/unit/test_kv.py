"""The KV cell map (orchestrator/kv.py): whatever mix of sequences grows and shrinks, each one's cells
stay in position order, and a batch attends exactly its own sequence's earlier positions."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from orchestrator.kv import FREE, KvCells, KvFull

pytestmark = pytest.mark.unit

ops = st.lists(st.tuples(st.sampled_from(["grow", "cut"]), st.integers(0, 3), st.integers(1, 6)), max_size=40)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_a_sequences_cells_stay_in_position_order(steps):
    kv, length = KvCells(32), {s: 0 for s in range(4)}
    for op, seq, n in steps:
        if op == "grow":
            at = np.arange(length[seq], length[seq] + n)
            free_above = np.flatnonzero(kv.seq == FREE)
            mine = np.flatnonzero(kv.seq == seq)
            if mine.size:
                free_above = free_above[free_above > mine[-1]]
            if free_above.size < n:
                with pytest.raises(KvFull):
                    kv.take(seq, at)
                continue
            cells = kv.take(seq, at)
            assert list(cells) == list(free_above[:n])  # the lowest free cells above its own
            length[seq] += n
        else:
            keep = max(0, length[seq] - n)
            kv.release(seq, keep)
            length[seq] = keep
        for s in range(4):
            mine = np.flatnonzero(kv.seq == s)
            assert list(kv.pos[mine]) == list(range(length[s]))  # cell order is position order


def test_a_batch_attends_its_own_sequence_up_to_each_tokens_position():
    kv = KvCells(16)
    a = kv.take(0, np.arange(3))
    b = kv.take(1, np.arange(2))
    new = np.concatenate([kv.take(0, np.array([3])), kv.take(1, np.array([2, 3]))])
    batch = kv.batch([5, 6, 7], np.array([0, 1, 1]), np.array([3, 2, 3]), new, np.array([0, 2]), 8)
    seq_of = {int(c): 0 for c in [*a, new[0]]} | {int(c): 1 for c in [*b, *new[1:]]}
    pos_of = {int(c): p for c, p in zip([*a, new[0], *b, *new[1:]], [0, 1, 2, 3, 0, 1, 2, 3])}
    for row, (seq, pos) in enumerate([(0, 3), (1, 2), (1, 3)]):
        expect = [c in seq_of and seq_of[c] == seq and pos_of[c] <= pos for c in range(8)]
        assert batch.visible[row].tolist() == expect
    assert batch.out_ids.tolist() == [0, 2] and batch.cells.tolist() == new.tolist()
