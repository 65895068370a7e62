"""SpecRing.window: the speculative ring keeps WINDOW_MIN steps in flight, and WINDOW only while its draft
has been right nearly always (a wrong draft costs the steps sent after it, on every worker)."""

from __future__ import annotations

from types import SimpleNamespace

from orchestrator.pipeline.spec_ring import WINDOW, WINDOW_MIN, SpecRing


def ring(window: int = WINDOW) -> SpecRing:
    target = SimpleNamespace(model=SimpleNamespace(hparams=SimpleNamespace(n_vocab=16)))
    return SpecRing(target, None, [], window)


def test_the_window_widens_after_a_streak_of_right_drafts_and_narrows_at_a_wrong_one():
    r = ring()
    assert r.window == WINDOW_MIN
    streak = 0
    while r.window == WINDOW_MIN:
        r.checked(True)
        streak += 1
    assert r.window == WINDOW and 8 <= streak <= 20  # a streak, not a lucky few
    r.checked(False)
    assert r.window == WINDOW_MIN
    assert (r.n_drafted, r.n_accepted) == (streak + 1, streak)


def test_a_draft_right_seven_times_in_ten_keeps_the_narrow_window():
    r = ring()
    widths = []
    for i in range(200):
        r.checked(i % 10 < 7)
        widths.append(r.window)
    assert set(widths) == {WINDOW_MIN}


def test_the_window_never_passes_what_was_asked():
    r = ring(window=1)
    for _ in range(50):
        r.checked(True)
    assert r.window == 1
