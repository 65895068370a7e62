"""What the engine (orchestrator/engine/loop.py) keeps per request: the Job a front end submits, the Slot that
serves it, how it ended (Finish), and the counters of /metrics.

A slot owns everything a step is made from: its sequence's tokens (those in the KV cache first, then the
ones to feed), how many of them are cached (the next position), its sampler chain and the attention path
each cached token was computed on. So a step can be run again from the slot alone: cells rebuilt from its
tokens after a worker is replaced, or k drafted tokens verified and the rejected ones dropped by cutting
`tokens` and `n_cached` back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from orchestrator.cxx import expf, logf, std_partial_sort
from orchestrator.sampling import Sampler, SamplingParams


@dataclass
class Finish:
    """How a job ended, with llama-server's timings."""

    reason: str  # "stop" (end of generation), "length" (n_predict or the slot's context), "cancelled"
    prompt_n: int  # prompt tokens computed (the cached ones not counted)
    cache_n: int  # prompt tokens whose cells were kept from the slot's previous job
    prompt_ms: float
    predicted_n: int
    predicted_ms: float
    slot: int = -1  # the slot that served the job
    eog_token: int | None = None  # the end-of-generation token sampled ("stop"; it is not among the tokens)
    context_full: bool = False  # "length" because the slot's context filled (and the job does not shift)
    sampling_ms: float = 0.0  # spent in the sampler chain

    def timings(self) -> dict:
        def per(ms: float, n: int) -> tuple[float, float]:
            return (ms / n if n else 0.0), (1e3 * n / ms if ms > 0 else 0.0)

        p_tok, p_sec = per(self.prompt_ms, self.prompt_n)
        g_tok, g_sec = per(self.predicted_ms, self.predicted_n)
        return {"cache_n": self.cache_n, "prompt_n": self.prompt_n, "prompt_ms": self.prompt_ms,
                "prompt_per_token_ms": p_tok, "prompt_per_second": p_sec, "predicted_n": self.predicted_n,
                "predicted_ms": self.predicted_ms, "predicted_per_token_ms": g_tok, "predicted_per_second": g_sec}


@dataclass
class Job:
    """One request: its prompt tokens and sampling. `emit(kind, value)` is called on the engine's thread:
    ("token", (id, logprobs)) for each generated token, then ("done", Finish) or ("error", message); a job
    that shifts its context also gets ("shift", (n_past, n_keep, n_discard)) at each shift.
    logprobs is None unless n_probs > 0: then (the token's log-probability, [(id, log-probability)] of
    the n_probs most likely), from the softmax of the raw logits as llama-server reports them."""

    prompt: list[int]
    params: SamplingParams
    n_predict: int  # -1: until end of generation or the slot's context is full
    emit: Callable[[str, object], None]
    ignore_eos: bool = False
    n_probs: int = 0
    cancelled: bool = False
    # None: the job ends when its slot is full; else llama-completion's --context-shift: keep the first
    # n_keep positions, drop half of the rest and go on (only where the engine's cells can shift)
    n_keep: int | None = None
    cache_n: int = 0  # set when a slot takes the job: prompt tokens it keeps cached (read before the first token)
    cache_prompt: bool = True  # False: the slot's cached prefix is not reused, the whole prompt is computed
    id_slot: int = -1  # llama-server's id_slot: n >= 0 runs on slot n % slots (waiting while it is busy); else any
    request: object = None  # what the front end made the job from (the server's Completion: GET /slots shows it)
    id_task: int = -1  # set by Engine.submit: jobs in the order they came


@dataclass
class Slot:
    index: int
    tokens: list[int] = field(default_factory=list)  # its sequence by position: cached, then to feed
    n_cached: int = 0  # how many of them are in the KV cache (the next position; the rest are fed next)
    n_prompt: int = 0  # the first n_prompt tokens are read as a prompt (in chunks), the rest one per step
    paths: list[str] = field(default_factory=list)  # the attention path each cached token was computed on
    want: list[str] = field(default_factory=list)  # the path each prompt token is to be computed on
    job: Job | None = None
    sampler: Sampler | None = None
    n_generated: int = 0
    cache_n: int = 0
    t_start: float = 0.0
    t_first: float | None = None  # when its first token was sampled
    sampling_seconds: float = 0.0
    awaiting: bool = False  # a batch in flight holds its last fed token, whose logits it waits for
    t_last_used: float = -1.0  # when its last job ended (time.perf_counter()); -1: never used
    last_job: Job | None = None  # the job it served last (GET /slots shows it once the slot is idle)

    @property
    def generating(self) -> bool:
        return self.t_first is not None


@dataclass
class Metrics:
    """Counters for /metrics (llama-server's names) and the CLI's timings."""

    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    tokens_predicted: int = 0
    tokens_predicted_seconds: float = 0.0
    n_decode: int = 0
    eval_runs: int = 0  # decodes that fed generated tokens (llama-completion's "eval time ... runs")
    n_drafted: int = 0  # tokens a draft model proposed (speculative decoding)
    n_drafted_accepted: int = 0  # of those, the ones the target verified


def pick_slot(idle: list[Slot], prompt: list[int], similarity: float, wanted: int = -1) -> Slot | None:
    """The idle slot a prompt goes to, as llama-server picks it (get_available_slot): slot `wanted` if it is
    >= 0 (a request's id_slot; None while that slot is busy), else the one whose cached
    tokens share the largest fraction of the prompt as their prefix, if that fraction is above `similarity`
    (its -sps; 0: never by prefix), else the least recently used, an empty one first. A prompt unlike every
    cache thus leaves the others' caches alone: an agent's short request for a session title between two turns
    took the slot holding the conversation's 2,200 tokens (its few tokens of chat template in common beat
    an empty slot's none), and the next turn read them all again. Of equals the lowest index (llama-server's
    LRU takes the last of equals).

    Where the slot chosen keeps less than half of its cached tokens, the engine's prompt cache (as
    llama-server's --cache-ram) first copies them away (engine/prompt_cache.py): a short prompt sharing a
    chat template's few tokens can reach -sps (seen with Gemma 3's: 7 of a 40-token title request's)."""
    if wanted >= 0:
        return next((s for s in idle if s.index == wanted), None)
    if similarity > 0 and prompt:
        shared = {s.index: common_prefix(s.tokens[:s.n_cached], prompt) for s in idle}
        best = max(idle, key=lambda s: (shared[s.index], -s.index))
        if shared[best.index] > similarity * len(prompt):
            return best
    return min(idle, key=lambda s: (s.t_last_used, s.index))


def log_probs(logits: np.ndarray, token: int, n: int) -> tuple[float, list[tuple[int, float]]]:
    """The token's log-probability and the n most likely tokens with theirs, in float32 as llama-server
    computes them (get_token_probabilities): std::partial_sort of the first n by logit, expf of each logit
    less the highest summed one after the other in the order that leaves (a different order moves the
    result by up to ~1e-4), each divided by the sum, logf (of 0: -FLT_MAX, the lowest float, as there:
    JSON has no -inf)."""
    x = np.asarray(logits, dtype=np.float32)
    order = list(range(x.size))
    std_partial_sort(order, x, 0, n, x.size, rest_keys=x[n:])
    high = x[order[0]]
    total = np.add.accumulate(expf(x[order] - high), dtype=np.float32)[-1]
    ids = np.array([token, *order[:n]], dtype=np.int64)
    p = expf(x[ids] - high) / total
    lp = [float(logf(v)) if v > 0 else float(np.finfo(np.float32).min) for v in p]
    return lp[0], [(int(t), v) for t, v in zip(ids[1:], lp[1:])]


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two sequences share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
