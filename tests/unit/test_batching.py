"""The serving engine's batch plans (orchestrator/engine/batching.py), checked against ggml's rule for the path
of a FLASH_ATTN_EXT node (wire.ggml.flash_attn_path): every node a batch makes takes the path each of
its rows would take if its sequence were alone, each row sees exactly its own sequence's positions up to
its own, and prompts are cut only where their chunk's path survives."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from wire.ggml import GGMLType, flash_attn_path
from orchestrator.engine.batching import Piece, Planner
from orchestrator.pipeline.kv import padded_cells

pytestmark = pytest.mark.unit

F16 = (GGMLType.F16, GGMLType.F16)


def planner(n_slots=4, n_ctx=4096, n_ubatch=512, cache_types=F16, n_swa=0):
    return Planner(n_slots, n_ctx, n_ubatch, flash_attn=True, cache_types=cache_types, n_swa=n_swa)


def alone_path(pl: Planner, n_q: int, end: int) -> str:
    """The path ggml gives n_q rows of a sequence alone in its cache, the last at position end - 1."""
    return flash_attn_path(*pl.cache_types, n_q, 1, padded_cells(end, pl.size))


def test_a_prompt_is_read_in_n_ubatch_chunks_from_its_start():
    pl = planner(n_ubatch=512)
    paths = pl.prompt_paths(1100)
    assert paths[:1024] == ["tiled"] * 1024  # two full chunks
    assert paths[1024:] == ["tiled"] * 76  # 76 >= 64 queries
    assert pl.prompt_paths(40) == ["one_chunk"] * 40
    assert pl.prompt_paths(513)[-1] == "split"  # one query over 768 cells
    assert planner(cache_types=(GGMLType.Q8_0, GGMLType.Q8_0)).prompt_paths(600) == ["one_chunk"] * 600


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 1500), st.lists(st.integers(1, 600), min_size=1, max_size=30), st.sampled_from([32, 64, 100, 512]))
def test_a_prompt_read_in_pieces_keeps_each_chunks_path(n_prompt, budgets, n_ubatch):
    """Pieces as the engine takes them (whatever room each batch has left) each take their chunk's path,
    and a piece gets all the rest of its chunk whenever the room allows."""
    pl = planner(n_ubatch=n_ubatch, n_ctx=8192)
    paths = pl.prompt_paths(n_prompt)
    start = 0
    for budget in budgets + [n_ubatch] * (n_prompt // n_ubatch + 1):
        if start == n_prompt:
            break
        n = pl.piece(start, n_prompt, paths, budget)
        chunk_end = min((start // n_ubatch + 1) * n_ubatch, n_prompt)
        assert 0 <= n <= min(budget, chunk_end - start)
        if budget >= chunk_end - start:
            assert n == chunk_end - start
        if n:
            assert alone_path(pl, n, start + n) == paths[start]
            assert paths[start:start + n] == [paths[start]] * n
        start += n
    assert start == n_prompt


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 2), min_size=1, max_size=700), st.integers(0, 80), st.integers(1, 700),
       st.sampled_from([64, 512]))
def test_a_kept_prefix_was_computed_on_the_paths_the_new_prompt_wants(cached, shared, extra, n_ubatch):
    pl = planner(n_ubatch=n_ubatch, n_ctx=8192)
    shared = min(shared, len(cached))
    prompt = cached[:shared] + [9] * extra
    cached_paths = pl.prompt_paths(len(cached))
    paths = pl.prompt_paths(len(prompt))
    keep = pl.keep(cached, cached_paths, prompt, paths)
    assert 0 <= keep <= min(shared, len(prompt) - 1)
    assert cached_paths[:keep] == paths[:keep]
    chunk_end = min((keep // n_ubatch + 1) * n_ubatch, len(prompt))
    assert alone_path(pl, chunk_end - keep, chunk_end) == paths[keep]  # the rest of its chunk can be read


pieces_st = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 700), st.integers(1, 200), st.booleans()),
                     min_size=1, max_size=4, unique_by=lambda t: t[0])


@settings(max_examples=300, deadline=None)
@given(pieces_st, st.sampled_from([0, 100]), st.booleans(), st.sampled_from([F16, (GGMLType.Q8_0, GGMLType.Q8_0)]))
def test_each_node_takes_the_path_of_its_rows_and_each_row_sees_its_own_past(spec, n_swa, single_rows, cache_types):
    pl = planner(n_ctx=4096, n_swa=n_swa, cache_types=cache_types)
    pieces = []
    for slot, start, n, output in spec:
        n = 1 if single_rows else n
        start = min(start, pl.size - n)
        pieces.append(Piece(slot, list(range(n)), start, alone_path(pl, n, start + n), output))
    batch, order = pl.batch(pieces)
    assert sorted(p.slot for p in order) == sorted(p.slot for p in pieces)
    assert sum(g.n_rows for g in batch.groups) == len(batch.tokens) == sum(p.n for p in pieces)
    row, rows_of = 0, {}
    for p in order:
        rows_of[p.slot] = range(row, row + p.n)
        assert list(batch.pos[row:row + p.n]) == list(range(p.start, p.start + p.n))
        assert list(batch.cells[row:row + p.n]) == [pl.base(p.slot) + q for q in range(p.start, p.start + p.n)]
        row += p.n
    assert list(batch.out_ids) == [rows_of[p.slot][-1] for p in order if p.output]

    def check_row(visible, swa_visible, first_cell, pos, slot):
        seen = np.flatnonzero(visible) + first_cell
        assert list(seen) == [pl.base(slot) + q for q in range(pos + 1)]
        if n_swa:
            seen = np.flatnonzero(swa_visible) + first_cell
            assert list(seen) == [pl.base(slot) + q for q in range(max(0, pos - n_swa + 1), pos + 1)]

    row = 0
    for g in batch.groups:
        members = [p for p in order if rows_of[p.slot].start >= row and rows_of[p.slot].stop <= row + g.n_rows]
        assert sum(p.n for p in members) == g.n_rows  # a group is whole pieces
        n_q = 1 if g.n_streams > 1 else g.n_rows
        node_path = flash_attn_path(*pl.cache_types, n_q, g.n_streams, g.n_kv)
        for p in members:
            assert node_path == p.path, (p, g.shape)
            if g.n_streams > 1:  # its stream is its slot's cells; the query comes from its row and goes back there
                assert p.n == 1 and g.stride == pl.size
                assert g.gather[p.slot] == rows_of[p.slot].start - row
                assert g.scatter[rows_of[p.slot].start - row] == p.slot
                s = p.slot
                check_row(g.visible[s], g.swa_visible[s] if n_swa else None, g.cell0 + s * g.stride, p.start, s)
                continue
            r0 = rows_of[p.slot].start - row
            for i in range(p.n):
                check_row(g.visible[r0 + i], g.swa_visible[r0 + i] if n_swa else None, g.cell0, p.start + i, p.slot)
        if g.n_streams > 1:  # a stream without a row of this batch sees nothing
            idle = set(range(g.n_streams)) - {p.slot for p in members}
            assert not g.visible[sorted(idle)].any()
        row += g.n_rows


def test_steps_of_different_slots_share_their_graph():
    """Two batches in flight hold different slots: their nodes must not depend on which (a new graph
    each step would be sent and planned again, step after step)."""
    pl = planner(n_ctx=4096)
    extents = {s: 40 + s for s in range(4)}
    a, _ = pl.batch([Piece(0, [1], 40, "one_chunk", True), Piece(1, [1], 41, "one_chunk", True)], extents)
    b, _ = pl.batch([Piece(2, [1], 42, "one_chunk", True), Piece(3, [1], 43, "one_chunk", True)], extents)
    assert [g.shape for g in a.groups] == [g.shape for g in b.groups]


def test_a_sequences_tiled_and_split_nodes_see_its_cells_where_they_lie_alone():
    """The sums of the tiled and split paths depend on where the cells lie in the node's view: a node of its
    own over its slot's cells puts position p at view cell p, as alone."""
    pl = planner(n_ctx=8192)
    tiled = Piece(2, [1] * 100, 300, "tiled", True)
    split = Piece(3, [1], 700, alone_path(pl, 1, 701), True)
    assert split.path == "split"
    batch, _ = pl.batch([Piece(0, [5], 10, "one_chunk", True), tiled, split])
    by_cell0 = {g.cell0: g for g in batch.groups}
    assert by_cell0[pl.base(2)].n_kv == padded_cells(400, pl.size)
    assert by_cell0[pl.base(3)].n_kv == padded_cells(701, pl.size)


class _SequencePipe:
    """What OneSequence reads of a Pipeline."""

    def __init__(self, n_ctx: int, n_batch: int, n_ubatch: int):
        self.n_ctx, self.n_batch, self.n_ubatch, self.cells = n_ctx, n_batch, min(n_batch, n_ubatch), None


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 3000), st.integers(1, 2048), st.integers(1, 512))
def test_the_clis_prompt_is_cut_as_llama_completion_feeds_llama_decode(n_prompt, n_batch, n_ubatch):
    """The CLI's one sequence reads its prompt in the ubatches llama-completion's loop makes: n_batch
    chunks from the start, each cut into n_ubatch pieces (llama_decode's split)."""
    from orchestrator.engine.batching import OneSequence  # noqa: PLC0415

    pipe = _SequencePipe(4096, n_batch, n_ubatch)
    layout = OneSequence(pipe)
    expected = [min(b + u + pipe.n_ubatch, b + n_batch, n_prompt) - (b + u)
                for b in range(0, n_prompt, n_batch) for u in range(0, min(n_batch, n_prompt - b), pipe.n_ubatch)]
    got, start = [], 0
    while start < n_prompt:
        n = layout.piece(start, n_prompt, layout.prompt_paths(n_prompt), pipe.n_ubatch)
        got.append(n)
        start += n
    assert got == expected
    assert layout.size == pipe.n_ctx - 1  # llama-completion never fills the last cell
