"""Cheap checks of the sampler's parts; tests/interop/test_sampling.py compares it with libllama."""

import ctypes
import ctypes.util

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator import cxx
from orchestrator.sampling import LLAMA_DEFAULT_SEED, Sampler, SamplingParams, sorting


def test_mt19937_matches_the_cpp_standard():
    # [rand.predef]: the 10000th output of a default-constructed std::mt19937 (seed 5489) is 4123659995.
    gen = cxx.mt19937(5489)
    for _ in range(9999):
        gen.getrandbits(32)
    assert gen.getrandbits(32) == 4123659995


def test_uniform_canonical_is_in_unit_interval():
    gen = cxx.mt19937(1)
    draws = [cxx.uniform_canonical(gen) for _ in range(1000)]
    assert all(0.0 <= d < 1.0 for d in draws)


@pytest.fixture(scope="module")
def libm_expf():
    path = ctypes.util.find_library("m")
    if path is None:
        pytest.skip("no libm to compare with")
    fn = ctypes.CDLL(path).expf
    fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float]
    return fn


def test_expf_matches_libm(libm_expf):
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.uniform(-110, 0, 20000), rng.normal(0, 5, 20000), rng.uniform(80, 90, 2000),
                        [0.0, -0.0, np.inf, -np.inf, -103.9, -88.0, 88.7, 88.8]]).astype(np.float32)
    want = np.array([libm_expf(float(v)) for v in x], dtype=np.float32)
    np.testing.assert_array_equal(cxx.expf(x), want)


keys = st.lists(st.sampled_from([-np.inf, -1.5, -0.0, 0.0, 0.25, 1.0, 3.0, 1e9]), min_size=0, max_size=300)


@settings(max_examples=200, deadline=None)
@given(keys)
def test_std_sort_orders_descending_and_permutes(values):
    seq = list(range(len(values)))
    cxx.std_sort(seq, values, 0, len(seq))
    assert sorted(seq) == list(range(len(values)))
    assert all(values[a] >= values[b] for a, b in zip(seq, seq[1:]))


@settings(max_examples=200, deadline=None)
@given(keys, st.integers(0, 300))
def test_std_partial_sort_gives_the_top_in_order(values, middle):
    middle = min(middle, len(values))
    seq = list(range(len(values)))
    cxx.std_partial_sort(seq, values, 0, middle, len(seq))
    head = [values[i] for i in seq[:middle]]
    assert head == sorted(values, reverse=True)[:middle]
    assert sorted(seq) == list(range(len(values)))


def test_bucket_sort_of_distinct_logits_is_plain_descending():
    logits = np.random.default_rng(1).permutation(np.linspace(-12, 12, 5000)).astype(np.float32)
    order = sorting.bucket_partial_sort(logits, 700)
    np.testing.assert_array_equal(logits[order], np.sort(logits)[::-1][:700])


def test_huge_logits_fall_into_the_lowest_bucket_like_x86():
    buckets = sorting._bucket_of(np.array([1e9, np.inf, -1e9, 9.99, -10.0, 0.0], dtype=np.float32))
    assert buckets.tolist() == [0, 0, 0, 127, 0, 64]


def test_same_seed_same_tokens_and_default_seed_is_random():
    logits = np.random.default_rng(2).normal(0, 2, 1000).astype(np.float32)
    a, b = Sampler(SamplingParams(seed=9), 1000), Sampler(SamplingParams(seed=9), 1000)
    assert [a.sample(logits) for _ in range(20)] == [b.sample(logits) for _ in range(20)]
    seeds = {Sampler(SamplingParams(), 1000).seed for _ in range(4)}
    assert len(seeds) > 1 and all(0 <= s < 2**32 for s in seeds)
    assert Sampler(SamplingParams(seed=LLAMA_DEFAULT_SEED + 2**32 + 5), 10).seed == 4  # uint32 wrap


def test_zero_temperature_takes_the_first_highest_logit():
    logits = np.array([0.0, 5.0, 1.0, 5.0, -3.0], dtype=np.float32)
    sampler = Sampler(SamplingParams(temp=0.0, seed=3, top_k=0, top_p=1.0, min_p=0.0), 5)
    assert {sampler.sample(logits) for _ in range(10)} == {1}


@pytest.mark.parametrize("top_k", [40, 0])
def test_greedy_shortcut_picks_what_the_whole_chain_picks(top_k):
    """Greedy sampling takes a unique highest logit without running the chain (and falls back to it on a
    tie at the top); tokens and the random stream stay those of the chain run in full every time."""
    rng = np.random.default_rng(5)
    params = SamplingParams(temp=0.0, seed=11, top_k=top_k)
    fast, full = Sampler(params, 300), Sampler(params, 300)
    for i in range(40):
        logits = rng.normal(0, 2, 300).astype(np.float32)
        if i % 3 == 0:  # a tie at the top, found by the chain's own order
            logits[rng.integers(300, size=2)] = logits.max() + 1
        c = full.candidates(logits)
        assert fast.sample(logits) == int(c.ids[c.selected])
    assert cxx.uniform_canonical(fast._dist.rng) == cxx.uniform_canonical(full._dist.rng)


def test_repeat_penalty_window_forgets_old_tokens():
    params = SamplingParams(temp=0.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=100.0, repeat_last_n=2, seed=1)
    sampler = Sampler(params, 3)
    logits = np.array([3.0, 2.0, 1.0], dtype=np.float32)
    sampler.accept(0)
    assert sampler.sample(logits) == 1
    sampler.accept(1)
    sampler.accept(2)  # token 0 leaves the two-token window
    assert sampler.sample(logits) == 0


def test_rejects_bad_parameters_and_logits():
    with pytest.raises(ValueError):
        Sampler(SamplingParams(repeat_penalty=0.0), 10)
    with pytest.raises(ValueError):
        Sampler(SamplingParams(), 10).sample(np.zeros(11, dtype=np.float32))
