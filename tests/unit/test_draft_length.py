"""pacing.DraftLength: the adaptive draft length. Its choice is checked against a simulation of
blocks (each position's draft kept with probability a given the ones before it, a block of k drafts
costing t + k d seconds): for every setting tried, the length it picks makes tokens at the best
simulated rate of any length allowed, within the margin given to longer blocks and the simulation's
noise. Fixed seeds: deterministic."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator.engine.pacing import ACCEPT_DECAY, LENGTH_MARGIN, DraftLength


def simulated_rate(a: float, k: int, pass_s: float, draft_s: float, n_blocks: int, seed: int) -> float:
    """Tokens per second over n_blocks blocks of k drafts, each position kept with probability a while
    the ones before it were: a block makes its kept prefix and the target's own token."""
    kept = np.random.default_rng(seed).random((n_blocks, k)) < a
    prefix = np.cumprod(kept, axis=1).sum(axis=1) if k else np.zeros(n_blocks)
    return float((prefix + 1).sum() / (n_blocks * (pass_s + k * draft_s)))


def with_rate(a: float, n_min: int = 0, n_max: int = 8) -> DraftLength:
    length = DraftLength(n_min, n_max)
    length.kept, length.checked = a, 1.0  # a running rate of exactly a
    return length


def test_the_ceiling_until_a_block_is_verified():
    length = DraftLength(0, 5)
    assert length.rate is None
    assert length.choose(0.01, 0.05) == 5
    length.record(5, 2)
    assert length.choose(None, 0.05) == 5  # nothing measured yet of drafting's price


def test_the_rate_counts_only_the_positions_checked():
    """After a rejection the later drafts were not checked: 1 kept of 3 drafted is 1 of 2 positions."""
    length = DraftLength(0, 3)
    length.record(3, 1)
    assert length.rate == pytest.approx(1 / 2)
    length.record(3, 3)  # all kept: 3 positions checked, 3 kept
    assert length.rate == pytest.approx((ACCEPT_DECAY * 1 + 3) / (ACCEPT_DECAY * 2 + 3))
    length.record(2, 0)
    assert length.rate == pytest.approx((ACCEPT_DECAY ** 2 * 1 + ACCEPT_DECAY * 3) /
                                        (ACCEPT_DECAY ** 2 * 2 + ACCEPT_DECAY * 3 + 1))


@pytest.mark.parametrize("a", [0.0, 0.3, 0.55, 0.75, 0.9, 1.0])
@pytest.mark.parametrize(("pass_s", "draft_s"), [(0.040, 0.020), (0.040, 0.005), (0.010, 0.020), (0.100, 0.001)])
def test_the_length_chosen_makes_tokens_fastest_in_simulation(a, pass_s, draft_s):
    length = with_rate(a, n_max=8)
    chosen = length.choose(draft_s, pass_s)
    rates = {k: simulated_rate(a, k, pass_s, draft_s, 40_000, seed=k) for k in range(1, 9)}
    # within the margin given to longer blocks (and 2% of simulation noise) of the best simulated rate
    assert rates[chosen] * (1 + LENGTH_MARGIN) >= 0.98 * max(rates.values()), (chosen, rates)
    # and no longer block would have been as good by more than the noise
    assert all(rates[k] * (1 + LENGTH_MARGIN) < 1.02 * max(rates.values()) for k in range(chosen + 1, 9)), (chosen, rates)


def test_near_a_tie_the_longer_block():
    """3 stages 10 ms apart as measured (a 0.57, t 0.14 s, d 0.02 s): 2 and 3 rate within 1%, so 3."""
    length = with_rate(0.57, n_max=3)
    assert length.choose(0.02, 0.14) == 3


def test_a_draft_never_kept_drafts_the_floor_and_one_always_kept_the_ceiling():
    never, always = DraftLength(0, 8), DraftLength(0, 8)
    for _ in range(3):
        never.record(8, 0)
        always.record(8, 8)
    assert never.choose(0.02, 0.14) == 1  # a guess a step where a guess costs a seventh of the rest
    assert never.choose(0.0001, 0.14) == 8  # nearly free guesses: the longest (within LENGTH_MARGIN)
    assert always.choose(0.02, 0.04) == 8  # every guess kept, a guess cheaper than a pass: the longest
    assert always.choose(0.2, 0.04) == 1  # five times a pass: even a guess always kept pays only once
    floor = DraftLength(3, 8)
    floor.record(8, 0)
    assert floor.choose(0.01, 0.04) == 3  # --draft-min is the floor
