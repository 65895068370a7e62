"""engine/prompt_cache.py's rules, against llama-server's server_prompt_cache (alloc, load) written out as they
are there: what is saved, what is dropped to make room, and which entry a prompt gets back. The cells
themselves are stood in for by their tokens (the workers' side is tests/interop/test_agents.py's)."""

from __future__ import annotations

import pytest

from orchestrator.engine import prompt_cache
from orchestrator.engine.prompt_cache import PromptCache
from orchestrator.engine.slots import Slot

pytestmark = pytest.mark.unit

BYTES_PER_TOKEN = 10


@pytest.fixture(autouse=True)
def cells_as_tokens(monkeypatch):
    """A pipeline of one stage whose 'cells' are the slot's tokens, 10 bytes each."""
    store: dict[int, list[int]] = {}
    monkeypatch.setattr(prompt_cache, "bytes_per_token", lambda pipe: BYTES_PER_TOKEN)
    monkeypatch.setattr(prompt_cache, "read_cells", lambda pipe, first, n: [[bytes(BYTES_PER_TOKEN * n)]])
    monkeypatch.setattr(prompt_cache, "write_cells", lambda pipe, first, cells: store.update({first: cells}))
    return store


def slot(tokens: list[int]) -> Slot:
    return Slot(0, tokens=list(tokens), n_cached=len(tokens), paths=["p"] * len(tokens))


def test_a_slot_that_would_lose_most_of_its_cells_is_saved_and_comes_back():
    cache = PromptCache(None)
    conversation = list(range(100))
    s = slot(conversation)
    aside = [0, 1, 500, 501]  # keeps 2 of 100
    assert cache.wanted(s, aside, keep=2)
    assert not cache.swap(None, 0, s, aside, keep=2)  # saved; nothing better for the aside
    assert [e.tokens for e in cache.entries] == [conversation] and cache.nbytes == 100 * BYTES_PER_TOKEN
    s.tokens, s.n_cached, s.paths = aside, 4, ["p"] * 4  # the aside ran there
    following = conversation + [7, 8]
    assert cache.swap(None, 0, s, following, keep=2)  # the conversation back (the aside keeps 2 of 4: not saved)
    assert s.tokens == conversation and s.n_cached == 100 and s.paths == ["p"] * 100
    assert cache.entries == []  # a loaded entry leaves the cache


def test_a_slot_that_keeps_half_or_more_is_not_saved():
    cache = PromptCache(None)
    assert not cache.wanted(slot(list(range(10))), list(range(5)) + [99], keep=5)


def test_saved_tokens_contained_whole_in_an_entry_are_not_saved_again_and_contained_entries_go():
    cache = PromptCache(None)
    cache.swap(None, 0, slot(list(range(10))), [99], keep=0)
    cache.swap(None, 0, slot(list(range(5))), [99], keep=0)  # all in the first entry: not saved
    assert [len(e.tokens) for e in cache.entries] == [10]
    cache.swap(None, 0, slot(list(range(20))), [99], keep=0)  # contains the first whole: it goes
    assert [len(e.tokens) for e in cache.entries] == [20]


def test_the_oldest_entries_make_room_and_a_state_over_the_limit_is_not_saved():
    cache = PromptCache(25 * BYTES_PER_TOKEN)
    for first in (100, 200, 300):
        cache.swap(None, 0, slot(list(range(first, first + 10))), [99], keep=0)
    assert [e.tokens[0] for e in cache.entries] == [200, 300]
    cache.swap(None, 0, slot(list(range(30))), [99], keep=0)  # 30 tokens > 25: skipped, the rest untouched
    assert [e.tokens[0] for e in cache.entries] == [200, 300]


@pytest.mark.parametrize("own, entry, prompt, loaded", [
    ([], list(range(40)), list(range(12)) + [99], True),  # an empty slot: an entry keeping 12/40 >= 1/4 of itself
    ([5], list(range(40)), list(range(8)) + [99], False),  # 8/40 < 1/4: a long entry is not spent on it
    ([0, 1, 2, 50, 51], list(range(40)), list(range(30)) + [99], True),  # more of the prompt and of itself kept
    ([0, 1, 2], list(range(40)), list(range(30)) + [99], False),  # the slot keeps all its own: as good a share
])
def test_an_entry_is_loaded_only_where_it_beats_the_slots_own_cells(own, entry, prompt, loaded):
    cache = PromptCache(None)
    cache.swap(None, 0, slot(entry), [77], keep=0)
    s = slot(own)
    assert cache.swap(None, 0, s, prompt, keep=len(own)) == loaded  # (keeping all its own: not saved)
    assert (s.tokens == entry) == loaded and len(cache.entries) == (0 if loaded else 1)
