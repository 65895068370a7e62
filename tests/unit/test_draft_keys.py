"""A sampled job's drafts are keyed by its seed and the token's number (engine/drafter.py's draw_noise): the
block the Speculator drafts ahead, while the target verifies a block, must ask for the very keys the next
block would ask for, so that its drafts are the ones that block would draw and a job's text does not depend
on whether the block was drafted ahead (which depends on timing). Checked with a drafter whose draws are a
deterministic function of (sequence, seed, key), as the real one's are, through the Speculator's own
propose / draft_ahead: the block used from ahead equals the block drafted afresh for the same state.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

from orchestrator.engine.drafter import DraftRequest
from orchestrator.engine.speculative import DraftOptions, Speculator
from orchestrator.sampling.chain import SamplingParams

pytestmark = pytest.mark.unit


def keyed_draw(sequence: list[int], seed: int | None, key: int) -> int:
    """A stand-in for the draft's draw: a function of what it is asked, nothing else."""
    return zlib.crc32(repr((sequence, seed, key)).encode()) % 1000


class KeyedDrafter:
    """Drafter's interface as the Speculator uses it, drafting with keyed_draw."""

    def __init__(self):
        self.ahead: dict[int, tuple[list[int], list]] = {}
        self.catch_up_s, self.step_s = 0.0, None
        self.background = True  # drafts ahead on a thread of its own (here: at once)

    def draft_each(self, requests: list[DraftRequest], stop=None):
        results = []
        for r in requests:
            tokens: list[int] = []
            for i in range(r.n_max):
                tokens.append(keyed_draw(r.sequence + tokens, r.seed, r.key + i))
            results.append((tokens, [None] * len(tokens)))
        return results

    def draft_ahead(self, requests: list[DraftRequest]) -> None:
        self.ahead = {r.slot: drafted for r, drafted in zip(requests, self.draft_each(requests))}

    def room(self, n_tokens: int) -> int:
        return 1 << 20

    def wait(self) -> None:
        pass

    def stop_ahead(self) -> None:
        pass


@dataclass
class FakeSlot:
    job: object
    tokens: list[int]
    n_generated: int
    index: int = 0
    generating: bool = True
    sampler: object = field(default_factory=lambda: SimpleNamespace(seed=1234))


@pytest.mark.parametrize("temp", [0.0, 0.8])
def test_a_block_drafted_ahead_is_the_block_drafted_afresh(temp):
    job = SimpleNamespace(n_predict=-1, params=SamplingParams(temp=temp))
    slot = FakeSlot(job, tokens=[1, 2, 3, 4, 5], n_generated=7)
    engine = SimpleNamespace(n_ctx_slot=4096, slots=[slot], metrics=SimpleNamespace(n_drafted=0))
    options = DraftOptions(Path("draft.gguf"), n_max=3, always=True, adaptive=False)
    speculator = Speculator(KeyedDrafter(), options)

    drafts = speculator.propose(engine, [slot], 16)[0]
    assert len(drafts) == 3
    speculator.draft_ahead(engine, {0: drafts})  # while the target verifies the block
    guess = speculator.drafter.ahead[0][0][0]
    # the target kept the three drafts and its own next token is the draft's guess
    slot.tokens += drafts + [guess]
    slot.n_generated += len(drafts) + 1
    speculator.pending.clear()
    from_ahead = speculator.propose(engine, [slot], 16)[0]
    assert speculator.ahead_used == 1

    fresh = Speculator(KeyedDrafter(), options)  # the same state, nothing drafted ahead
    assert fresh.propose(engine, [slot], 16)[0] == from_ahead
