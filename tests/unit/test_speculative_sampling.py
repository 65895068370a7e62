"""Speculative sampling at temperature > 0 (orchestrator/engine/speculative.py): a token drafted from q and
passed through accept_or_resample is distributed as the target's p, whatever q is, and the draft is kept
with probability sum(min(p, q)) (Leviathan et al. 2023, theorem 3.5 and its corollary). Checked by
goodness of fit over many draws with fixed seeds, at a level (1e-6) no correct implementation fails by
chance, so the test is deterministic and still catches a wrong rule (e.g. resampling from p, or from q).
"""
from __future__ import annotations

import numpy as np
import pytest

from orchestrator.engine.drafter import DRAFT_TOP_K, draft_distribution, draw, draw_noise, ranked_top
from orchestrator.engine.speculative import accept_or_resample

# Upper 1e-6 quantiles of chi-square by degrees of freedom (scipy.stats.chi2.isf(1e-6, df)).
CHI2_CRITICAL = {1: 23.928, 2: 27.631, 3: 30.665, 4: 33.377, 5: 35.888, 6: 38.258, 7: 40.522, 8: 42.701,
                 9: 44.811}
Z_CRITICAL = 4.892  # two-sided 1e-6 for a normal approximation of the acceptance count
N_DRAWS = 20000

CASES = {
    "q close to p": ([0.30, 0.25, 0.20, 0.15, 0.10], [0.25, 0.30, 0.15, 0.20, 0.10]),
    "supports differ": ([0.50, 0.30, 0.20, 0.00, 0.00], [0.10, 0.10, 0.20, 0.40, 0.20]),
    "q on one token": ([0.40, 0.35, 0.25, 0.00], [0.00, 0.00, 0.00, 1.00]),
    "q equals p": ([0.60, 0.25, 0.10, 0.05], [0.60, 0.25, 0.10, 0.05]),
    "q flatter than p": ([0.85, 0.05, 0.04, 0.03, 0.02, 0.01], [1 / 6] * 6),
}


def chi_square(counts: np.ndarray, p: np.ndarray) -> tuple[float, int]:
    support = p > 0
    expected = counts.sum() * p[support]
    return float((((counts[support] - expected) ** 2) / expected).sum()), int(support.sum()) - 1


@pytest.mark.parametrize("name", CASES)
def test_drafted_then_verified_tokens_follow_the_target(name):
    p, q = (np.array(x) for x in CASES[name])
    rng = np.random.default_rng(20240530)
    counts = np.zeros(len(p), dtype=np.int64)
    n_kept = 0
    for _ in range(N_DRAWS):
        drafted = int(rng.choice(len(q), p=q))
        token, kept = accept_or_resample(p, q, drafted, rng)
        counts[token] += 1
        n_kept += kept
        assert token == drafted or not kept
    assert counts[p == 0].sum() == 0  # nothing the target rules out
    statistic, df = chi_square(counts, p)
    assert statistic < CHI2_CRITICAL[df], (name, counts.tolist(), statistic)
    accept = np.minimum(p, q).sum()
    if accept in (0.0, 1.0):
        assert n_kept == N_DRAWS * accept
    else:
        z = (n_kept - N_DRAWS * accept) / np.sqrt(N_DRAWS * accept * (1 - accept))
        assert abs(z) < Z_CRITICAL, (name, n_kept, accept)


def test_a_wrong_rule_is_caught():
    """The test's power: resampling from p instead of the residual (a tempting mistake) skews the output
    towards tokens the draft likes, and the statistic is far past the critical value."""
    p, q = (np.array(x) for x in CASES["supports differ"])
    rng = np.random.default_rng(20240530)
    counts = np.zeros(len(p), dtype=np.int64)
    for _ in range(N_DRAWS):
        drafted = int(rng.choice(len(q), p=q))
        token = drafted if rng.random() * q[drafted] < p[drafted] else int(rng.choice(len(p), p=p))
        counts[token] += 1
    statistic, df = chi_square(counts, p)
    assert statistic > 10 * CHI2_CRITICAL[df]


def test_the_draft_distribution_is_llama_cpps_top_10_then_temperature():
    """spec_retune's draft sampler: top-k 10, then the target's temperature; nothing outside the top 10."""
    logits = np.random.default_rng(3).normal(size=50).astype(np.float32)
    for temp in (0.5, 1.0, 1.7):
        q = draft_distribution(logits, temp)
        top = sorted(range(50), key=lambda i: -logits[i])[:DRAFT_TOP_K]
        weights = {i: np.exp(float(logits[i]) / temp) for i in top}
        total = sum(weights.values())
        expected = np.array([weights.get(i, 0.0) / total for i in range(50)])
        np.testing.assert_allclose(q, expected, rtol=1e-12, atol=1e-15)
    q = draft_distribution(np.array([0.0, 1.0, 2.0]), 0.0)  # a greedy job: temperature 1, as llama.cpp's sampler
    np.testing.assert_allclose(q, np.exp([0.0, 1.0, 2.0]) / np.exp([0.0, 1.0, 2.0]).sum())


@pytest.mark.parametrize("temp", [0.6, 1.0, 1.8])
def test_keyed_draws_follow_the_draft_distribution(temp):
    """The draft's draws (Gumbel-max over its ranked top 10 with draw_noise keyed by seed and token number)
    follow draft_distribution at the job's temperature: one chi-square over draws with consecutive keys
    (as a job's drafts are drawn) and over seeds, at 1e-6. The same key draws the same token again."""
    logits = np.random.default_rng(11).normal(scale=1.5, size=40).astype(np.float32)
    q = draft_distribution(logits, temp)
    ids, values = ranked_top(logits)
    assert list(values) == sorted(values, reverse=True) and set(ids) == set(np.flatnonzero(q))
    counts = np.zeros(len(logits), dtype=np.int64)
    for seed in range(4):
        for key in range(N_DRAWS // 4):
            counts[draw(ids, values, draw_noise(seed, key, temp))] += 1
    assert counts[q == 0].sum() == 0
    statistic, df = chi_square(counts[q > 0], q[q > 0])
    assert statistic < CHI2_CRITICAL[df], (temp, statistic, df)
    assert draw(ids, values, draw_noise(3, 77, temp)) == draw(ids, values, draw_noise(3, 77, temp))


def test_the_draft_flags_default_to_the_pinned_llama_cpps():
    """--spec-draft-n-max 3, --spec-draft-n-min 0, --spec-draft-p-min 0.00 (llama-server --help of the pinned
    build), in the command line and in DraftOptions alike (cli.py keeps its imports light, so it has its own)."""
    from orchestrator import cli
    from orchestrator.engine.speculative import DraftOptions

    options = {p.name: p.default for p in cli.main.params}
    assert (DraftOptions.n_max, DraftOptions.n_min, DraftOptions.p_min) == (3, 0, 0.0)
    assert (options["draft_max"], options["draft_min"], options["draft_p_min"]) == (3, 0, 0.0)
