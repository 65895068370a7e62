"""speculative.Pace: which of drafting and the target's ring makes the CLI's greedy tokens, from rates fed
in by hand (no clock): the ring's probe, drafting's, then the faster's stretch growing while it keeps
winning, the slower's probe between stretches, and a change of winner when the rates change."""

from __future__ import annotations

import pytest

from orchestrator.engine.speculative import LEAD_GROWTH, LEAD_MAX, PROBE_TOKENS, Pace


def run(pace: Pace, seconds_per_token: dict[str, float], n_tokens: int) -> list[tuple[str, int]]:
    """Feeds n_tokens one by one to whichever way the pace asks for; the runs of one way, in order."""
    seen: list[tuple[str, int]] = []
    for _ in range(n_tokens):
        mode = pace.mode
        pace.record(mode, 1, seconds_per_token[mode])
        seen[-1:] = [(mode, seen[-1][1] + 1)] if seen and seen[-1][0] == mode else seen[-1:] + [(mode, 1)]
    return seen


def test_the_ring_then_drafting_are_probed_and_the_faster_runs_ever_longer():
    pace = Pace()
    seen = run(pace, {"draft": 0.02, "ring": 0.04}, 2000)
    p, g = PROBE_TOKENS, LEAD_GROWTH
    stretches = [p * g, p * g * g, p * g * g * g]  # drafting wins again and again, up to LEAD_MAX probes
    stretches = [min(n, p * LEAD_MAX) for n in stretches]
    # drafting's first stretch follows its probe directly: the two make one run here
    expected = [("ring", p), ("draft", p + stretches[0])]
    for n in stretches[1:]:
        expected += [("ring", p), ("draft", n)]
    assert seen[:len(expected)] == expected
    assert all(n == p for mode, n in seen if mode == "ring")
    assert pace.rates == pytest.approx({"ring": 25.0, "draft": 50.0})
    assert pace.made == {"draft": 2000 - sum(n for mode, n in seen if mode == "ring"),
                         "ring": sum(n for mode, n in seen if mode == "ring")}


def test_a_change_of_rates_changes_the_winner():
    pace = Pace()
    run(pace, {"draft": 0.04, "ring": 0.02}, 200)
    assert pace.winner == "ring"
    # drafting gets faster: its next probe measures it, and it takes over
    run(pace, {"draft": 0.01, "ring": 0.02}, 2000)
    assert pace.winner == "draft" and pace.rates["draft"] > pace.rates["ring"]


def test_tokens_made_the_other_way_count_but_do_not_end_a_stretch():
    pace = Pace()
    pace.record("draft", 5, 0.1)  # e.g. a verification that was already under way
    assert (pace.mode, pace.left) == ("ring", PROBE_TOKENS) and pace.made == {"draft": 5, "ring": 0}
