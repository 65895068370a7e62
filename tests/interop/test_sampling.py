"""Our sampler against libllama.so's own samplers, called through ctypes on the same logits.

The reference chain is built the way common_sampler_init builds llama-completion's (the no-op
samplers included), and both sides accept the same prompt and drawn tokens, so the RNG and the
penalty window advance together over a sequence of draws. Besides the drawn token we compare the
whole surviving candidate array (ids in order), which pins down sort order and ties.
"""
from __future__ import annotations

import ctypes
import zlib

import numpy as np
import pytest

from orchestrator.sampling import Sampler, SamplingParams


class TokenData(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int32), ("logit", ctypes.c_float), ("p", ctypes.c_float)]


class TokenDataArray(ctypes.Structure):
    _fields_ = [("data", ctypes.POINTER(TokenData)), ("size", ctypes.c_size_t),
                ("selected", ctypes.c_int64), ("sorted", ctypes.c_bool)]


class ChainParams(ctypes.Structure):
    _fields_ = [("no_perf", ctypes.c_bool)]


class LogitBiasEntry(ctypes.Structure):
    _fields_ = [("token", ctypes.c_int32), ("bias", ctypes.c_float)]


TOKEN_DTYPE = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
SAMPLER = ctypes.c_void_p
F, I32, U32, SIZE = ctypes.c_float, ctypes.c_int32, ctypes.c_uint32, ctypes.c_size_t
SIGNATURES = {
    "llama_sampler_chain_default_params": (ChainParams, []),
    "llama_sampler_chain_init": (SAMPLER, [ChainParams]),
    "llama_sampler_chain_add": (None, [SAMPLER, SAMPLER]),
    "llama_sampler_init_logit_bias": (SAMPLER, [I32, I32, ctypes.POINTER(LogitBiasEntry)]),
    "llama_sampler_init_penalties": (SAMPLER, [I32, I32, F, F, F]),
    "llama_sampler_init_dry": (SAMPLER, [ctypes.c_void_p, F, F, I32, I32, ctypes.POINTER(ctypes.c_char_p), SIZE]),
    "llama_sampler_init_top_n_sigma": (SAMPLER, [F]),
    "llama_sampler_init_top_k": (SAMPLER, [I32]),
    "llama_sampler_init_typical": (SAMPLER, [F, SIZE]),
    "llama_sampler_init_top_p": (SAMPLER, [F, SIZE]),
    "llama_sampler_init_min_p": (SAMPLER, [F, SIZE]),
    "llama_sampler_init_xtc": (SAMPLER, [F, F, SIZE, U32]),
    "llama_sampler_init_temp_ext": (SAMPLER, [F, F, F]),
    "llama_sampler_init_dist": (SAMPLER, [U32]),
    "llama_sampler_apply": (None, [SAMPLER, ctypes.POINTER(TokenDataArray)]),
    "llama_sampler_accept": (None, [SAMPLER, I32]),
    "llama_sampler_free": (None, [SAMPLER]),
}


@pytest.fixture(scope="module")
def libllama(bin_dir):
    lib = ctypes.CDLL(str(bin_dir / "libllama.so"))
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


class ReferenceChain:
    """common_sampler_init's chain for our options, with common_params_sampling's other defaults."""

    def __init__(self, lib, params: SamplingParams, n_vocab: int):
        self.lib = lib
        self.chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        breakers = (ctypes.c_char_p * 4)(b"\n", b":", b"\"", b"*")
        self.bias = (LogitBiasEntry * max(1, len(params.logit_bias)))(*params.logit_bias)
        for sampler in (
            lib.llama_sampler_init_logit_bias(n_vocab, len(params.logit_bias), self.bias),
            lib.llama_sampler_init_penalties(n_vocab, params.repeat_last_n, params.repeat_penalty,
                                             params.frequency_penalty, params.presence_penalty),
            lib.llama_sampler_init_dry(None, 0.0, 1.75, 2, 64, breakers, 4),  # disabled: never reads vocab
            lib.llama_sampler_init_top_n_sigma(-1.0),
            lib.llama_sampler_init_top_k(params.top_k),
            lib.llama_sampler_init_typical(1.0, 0),
            lib.llama_sampler_init_top_p(params.top_p, 0),
            lib.llama_sampler_init_min_p(params.min_p, 0),
            lib.llama_sampler_init_xtc(0.0, 0.1, 0, params.seed),
            lib.llama_sampler_init_temp_ext(params.temp, 0.0, 1.0),
            lib.llama_sampler_init_dist(params.seed),
        ):
            lib.llama_sampler_chain_add(self.chain, sampler)

    def candidates(self, logits: np.ndarray) -> tuple[np.ndarray, int]:
        """Surviving ids in array order and the index of the drawn one."""
        cur = np.zeros(len(logits), dtype=TOKEN_DTYPE)
        cur["id"] = np.arange(len(logits))
        cur["logit"] = logits
        arr = TokenDataArray(cur.ctypes.data_as(ctypes.POINTER(TokenData)), len(cur), -1, False)
        self.lib.llama_sampler_apply(self.chain, ctypes.byref(arr))
        ids = np.array([arr.data[i].id for i in range(arr.size)], dtype=np.int32)
        return ids, arr.selected

    def accept(self, token: int) -> None:
        self.lib.llama_sampler_accept(self.chain, token)

    def close(self) -> None:
        self.lib.llama_sampler_free(self.chain)


VOCAB = 49152  # SmolLM2's


def normal_logits(rng, n=VOCAB):
    return rng.normal(0.0, 3.0, n).astype(np.float32)


def tied_logits(rng, n=VOCAB):
    """Coarse steps: most logits share their value with many others."""
    return (np.round(rng.normal(0.0, 3.0, n) * 2) / 2).astype(np.float32)


def few_values(rng, n=VOCAB):
    """Only five distinct values, the top one shared by dozens of tokens."""
    return rng.choice(np.array([4.0, 3.5, 1.0, 0.0, -2.0], dtype=np.float32), n, p=[0.001, 0.004, 0.2, 0.5, 0.295])


def extreme_logits(rng, n=VOCAB):
    """Huge, infinite, signed-zero and tied values: huge ones fall in llama.cpp's lowest bucket."""
    x = normal_logits(rng, n)
    spots = rng.choice(n, 60, replace=False)
    x[spots[:10]] = np.float32(1e9)
    x[spots[10:15]] = np.float32(3e38)
    x[spots[15:25]] = -np.inf
    x[spots[25:35]] = -0.0
    x[spots[35:45]] = 0.0
    x[spots[45:60]] = np.float32(-1e30)
    return x


def peaked_logits(rng, n=VOCAB):
    """A confident model: one or two logits far above the rest."""
    x = normal_logits(rng, n)
    x[rng.integers(n)] += 25.0
    x[rng.integers(n)] += 23.0
    return x


def tiny_vocab(rng):
    return tied_logits(rng, 100)


GENERATORS = {
    "normal": normal_logits, "tied": tied_logits, "few-values": few_values,
    "extreme": extreme_logits, "peaked": peaked_logits, "tiny-vocab": tiny_vocab,
}

PARAMS = {
    "defaults": SamplingParams(seed=1234),
    "penalised": SamplingParams(seed=7, repeat_penalty=1.3, repeat_last_n=8),
    "no-top-k": SamplingParams(seed=99, top_k=0),  # top-p's adaptive bucket sort over the vocab
    "wide-top-k": SamplingParams(seed=5, top_k=300, top_p=0.99, min_p=0.0),  # bucket sort for top-k
    "min-p-only": SamplingParams(seed=11, top_k=0, top_p=1.0, min_p=0.1),  # unsorted min-p
    "unfiltered": SamplingParams(seed=3, top_k=0, top_p=1.0, min_p=0.0, temp=1.0),
    "greedy": SamplingParams(seed=0, temp=0.0),
    "hot-top-1": SamplingParams(seed=2, temp=1.7, top_k=1),
    "presence-frequency": SamplingParams(seed=13, repeat_last_n=16, frequency_penalty=0.4, presence_penalty=0.7),
    # a ban, a token given twice, ids past a small vocabulary, the favourite of "few-values" raised
    "biased": SamplingParams(seed=21, logit_bias=((3, float("-inf")), (40, 2.5), (40, 1.25), (77, -1.0),
                                                  (5000, 8.0), (49151, 0.5))),
    "biased-greedy": SamplingParams(seed=4, temp=0.0, logit_bias=((9, 6.0), (10, float("-inf")), (9, -0.75))),
    "seed-zero-everything": SamplingParams(seed=0, top_k=128, top_p=0.5, min_p=0.2, temp=0.6,
                                           repeat_penalty=0.8, repeat_last_n=64),
}

DRAWS = 12


@pytest.mark.parametrize("kind", GENERATORS)
@pytest.mark.parametrize("name", PARAMS)
def test_same_candidates_and_tokens_as_libllama(libllama, name, kind):
    params = PARAMS[name]
    rng = np.random.default_rng(zlib.crc32(f"{name}/{kind}".encode()))
    first = GENERATORS[kind](rng)
    n_vocab = len(first)
    ours = Sampler(params, n_vocab)
    ref = ReferenceChain(libllama, params, n_vocab)
    try:
        prompt = rng.integers(0, n_vocab, 20)
        for token in prompt:
            ours.accept(int(token))
            ref.accept(int(token))
        logits = first
        for step in range(DRAWS):
            ref_ids, ref_selected = ref.candidates(logits)
            got = ours.candidates(logits)
            where = f"{name}/{kind}, draw {step}"
            assert got.ids.tolist() == ref_ids.tolist(), f"{where}: candidate arrays differ"
            assert got.selected == ref_selected, f"{where}: drew index {got.selected}, libllama {ref_selected}"
            token = int(ref_ids[ref_selected])
            ours.accept(token)
            ref.accept(token)
            # Lift some prompt tokens into the running so the penalties change the outcome.
            logits = GENERATORS[kind](rng)
            logits[prompt[:5]] += np.float32(2.0)
    finally:
        ref.close()


@pytest.mark.parametrize("seed", [0, 1, 42, 2**31 + 5, 0xFFFFFFFE])
def test_long_sequence_same_tokens(libllama, seed):
    """Many draws from one chain: the RNG state must advance exactly alike."""
    params = SamplingParams(seed=seed, repeat_penalty=1.1)
    rng = np.random.default_rng(seed)
    ours, ref = Sampler(params, VOCAB), ReferenceChain(libllama, params, VOCAB)
    try:
        base = normal_logits(rng)
        got, want = [], []
        for _ in range(60):
            logits = base + rng.normal(0, 0.5, VOCAB).astype(np.float32)
            ids, selected = ref.candidates(logits)
            want.append(int(ids[selected]))
            got.append(ours.sample(logits))
            ours.accept(want[-1])
            ref.accept(want[-1])
        assert got == want
    finally:
        ref.close()


@pytest.mark.parametrize("kind", ["normal", "peaked", "few-values"])
def test_greedy_shortcut_applies_the_logit_bias(libllama, kind):
    """sample()'s greedy shortcut (argmax, no candidate array) sees the biased logits: a ban of the
    favourite and a lift of an outsider decide the token as libllama's chain does."""
    rng = np.random.default_rng(zlib.crc32(kind.encode()))
    got, want = [], []
    for _ in range(20):
        logits = GENERATORS[kind](rng)
        order = np.argsort(-logits, kind="stable")
        bias = ((int(order[0]), float("-inf")), (int(order[5]), float(logits[order[0]] - logits[order[5]]) / 2),
                (int(order[5]), 0.25))
        params = SamplingParams(seed=1, temp=0.0, logit_bias=bias)
        ref = ReferenceChain(libllama, params, len(logits))
        try:
            ids, selected = ref.candidates(logits)
            want.append(int(ids[selected]))
        finally:
            ref.close()
        got.append(Sampler(params, len(logits)).sample(logits))
    assert got == want
