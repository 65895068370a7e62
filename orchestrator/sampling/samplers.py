"""The candidate array and the samplers of llama-completion's chain, one class per llama_sampler_*.

Each sampler is named after its llama_sampler_*_apply counterpart in src/llama-sampler.cpp and keeps its
float32 arithmetic and its array order, because a different rounding or a different order of equal
logits can change the drawn token.
"""

from __future__ import annotations

from collections import Counter, deque

import numpy as np

from orchestrator.cxx import F32, expf, logf, mt19937, uniform_canonical
from orchestrator.sampling.sorting import bucket_partial_sort, std_partial_sort_positions


class Candidates:
    """llama_token_data_array: token ids, logits and probabilities in array order, plus `sorted`."""

    def __init__(self, logits: np.ndarray):
        self.logits = np.array(logits, dtype=F32)
        self.ids = np.arange(len(self.logits), dtype=np.int32)
        self.p = np.zeros(len(self.logits), dtype=F32)
        self.sorted = False
        self.selected = -1

    def __len__(self) -> int:
        return len(self.ids)

    def take(self, positions: np.ndarray) -> None:
        """Keep the candidates at `positions`, in that order."""
        self.ids, self.logits, self.p = self.ids[positions], self.logits[positions], self.p[positions]

    def partial_sort_inplace(self, npartial: int) -> None:
        """llama_token_data_array_partial_sort_inplace."""
        if npartial <= 128:
            self.take(std_partial_sort_positions(self.logits, np.arange(len(self)), npartial))
        else:
            self.take(bucket_partial_sort(self.logits, npartial))
        self.sorted = True


def _exp_from_max(c: Candidates) -> np.ndarray:
    """expf(logit - the highest logit) of every candidate, in array order."""
    with np.errstate(over="ignore", invalid="ignore"):
        return expf(c.logits - (c.logits[0] if c.sorted else c.logits.max()))


def softmax_impl(c: Candidates) -> None:
    """llama_sampler_softmax_impl(cur_p, do_sort=false): float32 probabilities, summed in order."""
    p = _exp_from_max(c)
    with np.errstate(over="ignore", invalid="ignore"):
        total = np.add.accumulate(p, dtype=F32)[-1]
        c.p = p / total


class LogitBias:
    """llama_sampler_logit_bias: each (token, bias) entry added to its token's logit in turn (a token given
    twice gets both), before every other sampler; a token outside the vocabulary is left alone."""

    def __init__(self, entries):
        self.tokens = np.array([t for t, _ in entries], dtype=np.int64)
        self.biases = np.array([b for _, b in entries], dtype=F32)

    def apply(self, c: Candidates) -> None:
        # First in the chain: the candidates are the vocabulary in id order, an id is its position.
        keep = (self.tokens >= 0) & (self.tokens < len(c))
        with np.errstate(invalid="ignore", over="ignore"):
            np.add.at(c.logits, self.tokens[keep], self.biases[keep])  # unbuffered: entry after entry


class Penalties:
    """llama_sampler_penalties: repeat/frequency/presence penalties over the last `last_n` tokens."""

    def __init__(self, last_n: int, repeat: float, freq: float, present: float):
        self.repeat, self.freq, self.present = F32(repeat), F32(freq), F32(present)
        self.window: deque[int] = deque(maxlen=last_n)
        self.count: Counter[int] = Counter()

    def accept(self, token: int) -> None:
        if len(self.window) == self.window.maxlen:
            old = self.window[0]
            self.count[old] -= 1
            if self.count[old] == 0:
                del self.count[old]
        self.count[token] += 1
        self.window.append(token)

    def apply(self, c: Candidates) -> None:
        if self.count:
            # The chain starts from the full vocabulary in id order, so an id is its position.
            tokens = np.fromiter(self.count.keys(), dtype=np.int64, count=len(self.count))
            counts = np.fromiter(self.count.values(), dtype=F32, count=len(self.count))
            keep = (tokens >= 0) & (tokens < len(c))
            tokens, counts = tokens[keep], counts[keep]
            logit = c.logits[tokens]
            logit = np.where(logit <= 0, logit * self.repeat, logit / self.repeat)
            c.logits[tokens] = logit - (counts * self.freq + F32(1.0) * self.present)
        c.sorted = False


class TopK:
    def __init__(self, k: int):
        self.k = k

    def apply(self, c: Candidates) -> None:
        k = min(self.k, len(c))
        if not c.sorted:
            c.partial_sort_inplace(k)
        c.take(np.arange(k))


_TOP_P_FIRST_GUESS = 256  # top-p sorts only this many first when the array is large and unsorted


class TopP:
    def __init__(self, p: float):
        self.p = F32(p)

    def apply(self, c: Candidates) -> None:
        softmax_impl(c)
        size = len(c)
        if c.sorted:
            order = None
            cum = np.add.accumulate(c.p, dtype=F32)
        elif size > 1024:
            order = bucket_partial_sort(c.logits, _TOP_P_FIRST_GUESS)
            cum = np.add.accumulate(c.p[order], dtype=F32)
            if not np.any(cum >= self.p):
                # llama.cpp then sorts everything and reads on from there, keeping the sum it has
                # (with tied logits the two sorts may disagree on the first part's order).
                full = bucket_partial_sort(c.logits, size)
                summed = np.concatenate([order, full[len(order):]])
                cum = np.add.accumulate(c.p[summed], dtype=F32)
                order = full
        else:
            c.partial_sort_inplace(size)
            order = None
            cum = np.add.accumulate(c.p, dtype=F32)
        reached = np.flatnonzero(cum >= self.p)
        last = int(reached[0]) + 1 if len(reached) else size
        if order is not None:
            c.take(order[:last])
            c.sorted = True
        else:
            c.take(np.arange(last))


class MinP:
    def __init__(self, p: float):
        self.p = F32(p)

    def apply(self, c: Candidates) -> None:
        if not c.sorted:
            # Unsorted first try: keep array order, drop logits below max + log(p).
            max_logit = max(c.logits.max(), F32(-np.finfo(F32).max))
            keep = np.flatnonzero(c.logits >= max_logit + logf(self.p))
            if len(keep):
                c.take(keep)
                return
            c.partial_sort_inplace(len(c))
        below = np.flatnonzero(c.logits[1:] < c.logits[0] + logf(self.p))
        c.take(np.arange(int(below[0]) + 1 if len(below) else len(c)))


class Temperature:
    """llama_sampler_temp_ext with no dynamic range, i.e. llama_sampler_temp_impl."""

    def __init__(self, temp: float):
        self.temp = F32(temp)

    def apply(self, c: Candidates) -> None:
        if self.temp <= 0:
            best = int(np.argmax(c.logits))  # the first of equal maxima survives
            kept = c.logits[best]
            c.logits[:] = -np.inf
            c.logits[best] = kept
        else:
            with np.errstate(over="ignore"):
                c.logits = c.logits / self.temp


class Dist:
    """llama_sampler_dist: softmax in array order and one draw per call, whatever the size."""

    def __init__(self, seed: int):
        self.rng = mt19937(seed)

    def apply(self, c: Candidates) -> None:
        if len(c) == 0:
            c.selected = -1
            return
        if len(c) == 1:
            uniform_canonical(self.rng)
            c.selected = 0
            return
        p = _exp_from_max(c)
        with np.errstate(invalid="ignore", over="ignore"):
            running = np.cumsum(p.astype(np.float64))  # double sum of float terms, in order
            target = running[-1] * uniform_canonical(self.rng)
            hits = np.flatnonzero(running >= target)
        c.selected = int(hits[0]) if len(hits) else len(c) - 1
