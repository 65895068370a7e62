"""llama-server's prompt cache (`--cache-ram`) for the server's slots: when a request is about to take a
slot whose cached tokens it mostly does not share, the slot's cells are first copied to the orchestrator's
memory, and a later prompt that starts like them gets them back instead of reading them again.

A coding agent's short aside (a session title, between two turns of its conversation) can take the slot
that holds the conversation: with one slot always, with more where a chat template's few tokens make the
aside look like the conversation (-sps). Without the cache the next turn reads the whole conversation
again (with Gemma 3 270M and 753 tokens: cache_n 0 where llama-server's was 748).

As llama-server's (server_prompt_cache, tools/server/server-task.cpp of the pinned llama.cpp):
- a slot is saved when the job given to it keeps less than half of its cached tokens, unless an entry
  holds all of them already; entries that its tokens contain whole are dropped, the oldest go first when
  the entries would pass the limit, and a state larger than the limit is not saved;
- an entry is loaded into the slot when it shares more of the prompt than the slot's own tokens do, both
  as a part of the prompt and of the entry, and at least a quarter of the entry (a long entry is not
  spent on a prompt that would keep little of it); it leaves the cache.
What is copied: every stage's K and V cells of the slot, byte for byte (get_tensor), and written back at
the slot's own cells (set_tensor), with the attention path each token was computed on (batching.Planner:
a restored cell is one computed where the slot's cells lie, so greedy text is as if it was never gone).
The draft model's cells (-md) are not copied: the draft reads a new prompt beside the target anyway.
Only with flash attention (the default): without it the V cache is stored transposed (graph/llama.py), a
slot's cells a stride apart in every row, and the server runs without the cache.
Reading cells needs the workers' replies in order, so the engine swaps only while no batch is in flight.
"""

from __future__ import annotations

from dataclasses import dataclass

from wire import protocol as p
from wire.ggml import row_size
from wire.protocol import Command
from orchestrator.engine.slots import Slot, common_prefix
from orchestrator.graph.ggml import wire_tensor

MIN_KEEP_SHARE = 0.25  # an entry is loaded only for a prompt that keeps at least this share of it (llama-server's)


@dataclass
class Entry:
    tokens: list[int]
    paths: list[str]
    cells: list[list[bytes]]  # per stage, per cache tensor: the bytes of the cells of tokens[0..n)

    @property
    def nbytes(self) -> int:
        return sum(len(b) for stage in self.cells for b in stage)


def bytes_per_token(pipe) -> int:
    return sum(row_size(t.type, t.ne[0]) for stage in pipe.stages for t in stage.caches())


def read_cells(pipe, first: int, n: int) -> list[list[bytes]]:
    """The cells' bytes of every cache tensor: every stage's GET_TENSORs sent at once, then their replies
    read, so the copy costs about one round trip, not one per tensor (two per layer)."""
    if not pipe.flash_attn:
        raise ValueError("a slot's cells are one run of bytes only with flash attention (V is stored transposed)")
    asked = []
    for stage in pipe.stages:
        rows = [(t, row_size(t.type, t.ne[0])) for t in stage.caches()]
        with stage.client.corked():
            for t, rs in rows:
                stage.client.send(Command.GET_TENSOR, p.GetTensorRequest(wire_tensor(t), first * rs, n * rs))
        asked.append(len(rows))
    return [[stage.client.receive(Command.GET_TENSOR) for _ in range(k)] for stage, k in zip(pipe.stages, asked)]


def write_cells(pipe, first: int, cells: list[list[bytes]]) -> None:
    for stage, blobs in zip(pipe.stages, cells, strict=True):
        for t, blob in zip(stage.caches(), blobs, strict=True):
            stage.client.set_tensor(wire_tensor(t), blob, first * row_size(t.type, t.ne[0]))


class PromptCache:
    """Saved slot states, oldest first, within `limit` bytes (None: no limit)."""

    def __init__(self, limit: int | None):
        self.limit = limit
        self.entries: list[Entry] = []
        self.saved = self.loaded = 0  # counts, for the log and tests

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def clear(self) -> None:
        """After a re-plan: the stages the entries were read from are gone."""
        self.entries.clear()

    def _save_due(self, slot: Slot, keep: int) -> bool:
        n = slot.n_cached
        return n > 0 and keep < n / 2 and not any(common_prefix(e.tokens, slot.tokens[:n]) == n for e in self.entries)

    def _best(self, slot: Slot, prompt: list[int]) -> Entry | None:
        own = slot.tokens[:slot.n_cached]
        shared = common_prefix(own, prompt)
        keep_best = shared / len(own) if own else -1.0
        sim_best = shared / len(prompt)
        best = None
        for entry in self.entries:
            lcp = common_prefix(entry.tokens, prompt)
            f_keep, f_sim = lcp / len(entry.tokens), lcp / len(prompt)
            if f_keep >= MIN_KEEP_SHARE and f_keep > keep_best and f_sim > sim_best:
                best, keep_best, sim_best = entry, f_keep, f_sim
        return best

    def wanted(self, slot: Slot, prompt: list[int], keep: int, load: bool = True) -> bool:
        """A job keeping `keep` of the slot's cached tokens would make the cache save the slot or (with
        `load`: the job reuses cached cells) load an entry into it."""
        return self._save_due(slot, keep) or (load and self._best(slot, prompt) is not None)

    def swap(self, pipe, first_cell: int, slot: Slot, prompt: list[int], keep: int, load: bool = True) -> bool:
        """Saves the slot's cells if due, then (with `load`) loads the best entry for the prompt into them
        (the slot's tokens and paths become the entry's); True if one was loaded. No batch may be in flight."""
        if self._save_due(slot, keep):
            self._save(pipe, first_cell, slot)
        entry = self._best(slot, prompt) if load else None
        if entry is None:
            return False
        write_cells(pipe, first_cell, entry.cells)
        slot.tokens, slot.n_cached, slot.paths = list(entry.tokens), len(entry.tokens), list(entry.paths)
        self.entries.remove(entry)
        self.loaded += 1
        return True

    def _save(self, pipe, first_cell: int, slot: Slot) -> None:
        n = slot.n_cached
        tokens = slot.tokens[:n]
        size = n * bytes_per_token(pipe)
        if self.limit is not None and size > self.limit:
            return
        self.entries = [e for e in self.entries if common_prefix(e.tokens, tokens) < len(e.tokens)]
        while self.entries and self.limit is not None and self.nbytes + size > self.limit:
            self.entries.pop(0)
        self.entries.append(Entry(tokens, list(slot.paths[:n]), read_cells(pipe, first_cell, n)))
        self.saved += 1
