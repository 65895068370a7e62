"""The sliding-window layers' cache (orchestrator/pipeline/kv.py SwaCells, llama.cpp's llama_kv_cache with n_swa):
cells are placed and reused as llama.cpp's find_slot / apply_ubatch place them, and every token sees
exactly the last n_swa positions of its sequence. (That the placement is llama.cpp's, bit for bit, the
interop test tests/interop/test_orchestrator_gemma3.py shows with a cache smaller than the text.)"""

import numpy as np
import pytest

from orchestrator.pipeline.kv import FREE, KvFull, SwaCells

pytestmark = pytest.mark.unit

N_SWA = 512


def feed(cells: SwaCells, lengths: list[int], start: int = 0):
    """Places ubatches of the given lengths of sequence 0; yields (positions, their cells, visible)."""
    pos = start
    for n in lengths:
        at = np.arange(pos, pos + n, dtype=np.int32)
        placed = cells.place(0, at)
        yield at, placed, cells.visible(np.zeros(n, np.int32), at, cells.n_kv(256))
        pos += n


def test_the_ring_wraps_onto_cells_the_window_has_passed():
    # llama-completion -c 1024 -b 64 -ub 64: a cache of pad(512 + 64, 256) = 768 cells
    cells = SwaCells(768, N_SWA)
    for at, placed, visible in feed(cells, [64] * 13 + [1] * 300):
        assert placed.tolist() == (at % 768).tolist()
        for row, p in enumerate(at):  # the window: positions p - 511 .. p, each once
            seen = cells.pos[: visible.shape[1]][visible[row]]
            assert sorted(seen.tolist()) == list(range(max(0, p - N_SWA + 1), p + 1))


def test_attended_cells_are_the_used_extent_padded_to_256():
    cells = SwaCells(1024, N_SWA)
    widths = [v.shape[1] for _, _, v in feed(cells, [100, 200, 300, 1, 500])]
    assert widths == [256, 512, 768, 768, 1024]


def test_a_ubatch_that_needs_cells_still_in_the_window_does_not_fit():
    cells = SwaCells(768, N_SWA)  # too small for ubatches of 512: llama.cpp sizes it n_swa + n_ubatch
    list(feed(cells, [512]))
    with pytest.raises(KvFull):
        cells.place(0, np.arange(512, 1024, dtype=np.int32))


def test_the_search_starts_over_when_there_is_room_before_the_head():
    cells = SwaCells(256, 4)
    list(feed(cells, [10]))
    cells.head = 200  # as after a longer sequence was cut
    (_, placed, _), = feed(cells, [1], start=10)
    assert placed.tolist() == [0]  # head 200 > used 10 + 2 * 1: from cell 0, whose position 0 is out of the window
    assert cells.pos[:10].tolist() == [10, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert cells.head == 1


def test_overwriting_purges_the_sequences_older_positions():
    # apply_ubatch keeps each sequence's positions contiguous: overwriting position 5 drops 0..4 too
    cells = SwaCells(256, 4)
    list(feed(cells, [10]))
    cells.head = 5
    (_, placed, _), = feed(cells, [1], start=10)
    assert placed.tolist() == [5]
    assert cells.pos[:10].tolist() == [-1] * 5 + [10, 6, 7, 8, 9]
    assert cells.head == 6


def test_a_step_computed_again_replaces_its_positions():
    cells = SwaCells(768, N_SWA)
    first = [c for _, c, _ in feed(cells, [64, 1, 1, 1])]
    again = cells.place(0, np.array([65], np.int32))  # the ring broke after position 64: 65 once more
    assert again.tolist() == first[2].tolist()
    assert (cells.seq != FREE).sum() == 66
