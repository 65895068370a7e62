"""Which idle slot a prompt goes to (engine/slots.py pick_slot) against llama-server's get_available_slot
(tools/server/server-context.cpp of the pinned llama.cpp) written out as it is there, in float32: the
largest prefix similarity above -sps among slots with cached tokens, else the least recently used; a
request's id_slot, that slot (the task deferred while it is busy). The one difference, on purpose: of slots
used equally long ago ours takes the first, llama-server the last."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from orchestrator.engine.slots import Slot, common_prefix, pick_slot

pytestmark = pytest.mark.unit


def llama_servers_choice(idle: list[Slot], prompt: list[int], similarity: float, wanted: int = -1,
                         busy: tuple[Slot, ...] = ()) -> Slot | None:
    if wanted != -1:  # get_slot_by_id; the similarity pass then looks at that slot alone and keeps it
        ret = next(s for s in [*idle, *busy] if s.index == wanted)
        return None if ret in busy else ret  # a busy one: the task is deferred
    ret, f_sim_best = None, np.float32(0)
    if np.float32(similarity) != 0:
        for slot in idle:
            tokens = slot.tokens[:slot.n_cached]
            if not tokens:
                continue
            f_sim_cur = np.float32(common_prefix(tokens, prompt)) / np.float32(len(prompt))
            if f_sim_cur > f_sim_best and f_sim_cur > np.float32(similarity):
                f_sim_best, ret = f_sim_cur, slot
    if ret is None:
        t_last = None
        for slot in idle:
            if ret is None or slot.t_last_used < t_last:  # llama-server: <=, the last of equals
                t_last, ret = slot.t_last_used, slot
    return ret


def slot(index: int, cached: list[int], t_last_used: float) -> Slot:
    return Slot(index, tokens=list(cached) + [99], n_cached=len(cached), t_last_used=t_last_used)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 2), max_size=12), st.sampled_from([-1.0, 1.0, 2.0, 3.0])),
                min_size=1, max_size=4),
       st.lists(st.integers(0, 2), min_size=1, max_size=12), st.sampled_from([0.0, 0.1, 0.5, 0.9]))
def test_a_prompt_goes_to_the_slot_llama_server_gives_it(slots, prompt, similarity):
    idle = [slot(i, cached, t) for i, (cached, t) in enumerate(slots)]
    assert pick_slot(idle, prompt, similarity) is llama_servers_choice(idle, prompt, similarity)


def test_a_short_unlike_prompt_leaves_a_conversations_slot_alone():
    conversation = list(range(100, 300))
    idle = [slot(0, [1, 2, 3] + conversation, 5.0), slot(1, [], -1.0)]
    assert pick_slot(idle, [1, 2, 3] + list(range(400, 450)), 0.1).index == 1  # 3 of 53 in common: the empty slot
    assert pick_slot(idle, [1, 2, 3] + conversation + [7, 8], 0.1).index == 0
    assert pick_slot(idle, [1, 2, 3] + conversation + [7, 8], 0.0).index == 1  # -sps 0: least recently used


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 2), max_size=8), st.booleans()), min_size=1, max_size=4),
       st.lists(st.integers(0, 2), min_size=1, max_size=8), st.integers(0, 3))
def test_a_requested_slot_is_taken_or_waited_for(slots, prompt, wanted):
    everyone = [slot(i, cached, 1.0) for i, (cached, _) in enumerate(slots)]
    idle = [s for s, (_, is_busy) in zip(everyone, slots) if not is_busy]
    busy = tuple(s for s in everyone if s not in idle)
    wanted %= len(everyone)
    assert pick_slot(idle, prompt, 0.1, wanted) is llama_servers_choice(idle, prompt, 0.1, wanted, busy)
