"""Token sampling that picks exactly what llama-completion picks for the same logits and seed.

The chain mirrors common_sampler_init (common/sampling.cpp) with the defaults of
common_params_sampling (common/common.h):

    penalties -> [dry] -> [top-n-sigma] -> top-k -> [typical] -> top-p -> min-p -> [xtc] -> temp -> dist

The bracketed samplers are no-ops at their defaults and are not offered. Each sampler below is
named after its llama_sampler_*_apply counterpart in src/llama-sampler.cpp and keeps its float32
arithmetic, because a different rounding or a different order of equal logits can change the
drawn token:

* Candidates stay in llama.cpp's array order. Sorting follows libstdc++'s std::sort (introsort)
  and std::partial_sort (heap select), including llama.cpp's 128-bucket partial sort, so equal
  logits end up in the same order. When the logits that matter are distinct, any correct sort
  gives that order, so numpy sorts them; only ties run the (slower) libstdc++ emulation.
* expf is glibc's algorithm (the one libllama.so calls) and logf is libm's own.
* The draw is std::uniform_real_distribution<double>(0, 1) over std::mt19937.

temp <= 0 is not a separate greedy path in llama.cpp: the temperature sampler keeps only the first
highest logit, and dist still draws (and advances the RNG) before picking it.
Logits must not contain NaN (llama.cpp's comparisons are undefined for them too).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import random
import secrets
from collections import Counter, deque
from dataclasses import dataclass

import numpy as np

LLAMA_DEFAULT_SEED = 0xFFFFFFFF  # "pick a random seed", as in include/llama.h

F32 = np.float32


@dataclass
class SamplingParams:
    """The sampling options of llama-completion, with common_params_sampling's defaults."""
    temp: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int = LLAMA_DEFAULT_SEED

    def validate(self) -> None:
        """The checks common_sampler_init makes before building the chain."""
        if not (math.isfinite(self.repeat_penalty) and self.repeat_penalty > 0
                and math.isfinite(1.0 / F32(self.repeat_penalty))):
            raise ValueError("repeat_penalty must be finite and greater than 0")
        if not (math.isfinite(self.frequency_penalty) and math.isfinite(self.presence_penalty)):
            raise ValueError("frequency_penalty and presence_penalty must be finite")
        if self.repeat_last_n < 0:
            raise ValueError("repeat_last_n must be >= 0")


# --- float32 maths as libllama.so computes it ----------------------------------------------

# glibc's expf (sysdeps/ieee754/flt-32/e_expf.c, table from e_exp2f_data.c): evaluated in double
# and rounded once, so it usually but not always agrees with a correctly rounded exp.
_EXP2F_TABLE = np.array([
    0x3ff0000000000000, 0x3fefd9b0d3158574, 0x3fefb5586cf9890f, 0x3fef9301d0125b51,
    0x3fef72b83c7d517b, 0x3fef54873168b9aa, 0x3fef387a6e756238, 0x3fef1e9df51fdee1,
    0x3fef06fe0a31b715, 0x3feef1a7373aa9cb, 0x3feedea64c123422, 0x3feece086061892d,
    0x3feebfdad5362a27, 0x3feeb42b569d4f82, 0x3feeab07dd485429, 0x3feea47eb03a5585,
    0x3feea09e667f3bcd, 0x3fee9f75e8ec5f74, 0x3feea11473eb0187, 0x3feea589994cce13,
    0x3feeace5422aa0db, 0x3feeb737b0cdc5e5, 0x3feec49182a3f090, 0x3feed503b23e255d,
    0x3feee89f995ad3ad, 0x3feeff76f2fb5e47, 0x3fef199bdd85529c, 0x3fef3720dcef9069,
    0x3fef5818dcfba487, 0x3fef7c97337b9b5f, 0x3fefa4afa2a490da, 0x3fefd0765b6e4540,
], dtype=np.uint64)
_EXPF_N = 32
_EXPF_INVLN2N = float.fromhex("0x1.71547652b82fep+0") * _EXPF_N
_EXPF_SHIFT = float.fromhex("0x1.8p+52")
_EXPF_C0 = float.fromhex("0x1.c6af84b912394p-5") / _EXPF_N**3
_EXPF_C1 = float.fromhex("0x1.ebfce50fac4f3p-3") / _EXPF_N**2
_EXPF_C2 = float.fromhex("0x1.62e42ff0c52d6p-1") / _EXPF_N
_EXPF_OVERFLOW = float.fromhex("0x1.62e42ep6")
_EXPF_UNDERFLOW = -float.fromhex("0x1.9fe368p6")


def expf(x: np.ndarray) -> np.ndarray:
    """glibc expf over a float32 array."""
    x = np.asarray(x, dtype=F32)
    with np.errstate(all="ignore"):
        xd = x.astype(np.float64)
        z = _EXPF_INVLN2N * xd
        kd = z + _EXPF_SHIFT
        ki = kd.view(np.uint64)
        r = z - (kd - _EXPF_SHIFT)
        scale = (_EXP2F_TABLE[ki % np.uint64(_EXPF_N)] + (ki << np.uint64(47))).view(np.float64)
        y = (_EXPF_C0 * r + _EXPF_C1) * (r * r) + (_EXPF_C2 * r + 1.0)
        out = (y * scale).astype(F32)
    out[x > _EXPF_OVERFLOW] = np.inf
    out[x < _EXPF_UNDERFLOW] = 0.0  # also -inf
    out[np.isnan(x)] = np.nan
    return out


def _load_logf():
    path = ctypes.util.find_library("m")
    try:
        fn = ctypes.CDLL(path).logf
    except (OSError, AttributeError, TypeError):
        return lambda v: F32(math.log(v)) if v > 0 else F32(-math.inf if v == 0 else math.nan)
    fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float]
    return lambda v: F32(fn(float(v)))


logf = _load_logf()  # one call per token: libm's own beats re-deriving its rounding


# --- libstdc++ sorting, comparator a.logit > b.logit ------------------------------------------
# Work on `seq`, a list of candidate positions, with `key[pos]` the logit; moving a position
# stands for moving the whole llama_token_data. Index arithmetic follows bits/stl_heap.h and
# bits/stl_algo.h (GCC 12, which built libllama.so).

def _push_heap(seq, key, first, hole, top, value):
    parent = (hole - 1) // 2
    while hole > top and key[seq[first + parent]] > key[value]:
        seq[first + hole] = seq[first + parent]
        hole = parent
        parent = (hole - 1) // 2
    seq[first + hole] = value


def _adjust_heap(seq, key, first, hole, length, value):
    top = hole
    child = hole
    while child < (length - 1) // 2:
        child = 2 * (child + 1)
        if key[seq[first + child]] > key[seq[first + child - 1]]:
            child -= 1
        seq[first + hole] = seq[first + child]
        hole = child
    if length % 2 == 0 and child == (length - 2) // 2:
        child = 2 * (child + 1)
        seq[first + hole] = seq[first + child - 1]
        hole = child - 1
    _push_heap(seq, key, first, hole, top, value)


def _make_heap(seq, key, first, last):
    length = last - first
    if length < 2:
        return
    for parent in range((length - 2) // 2, -1, -1):
        _adjust_heap(seq, key, first, parent, length, seq[first + parent])


def _pop_heap(seq, key, first, last, result):
    value = seq[result]
    seq[result] = seq[first]
    _adjust_heap(seq, key, first, 0, last - first, value)


def std_partial_sort(seq, key, first, middle, last, rest_keys=None):
    """std::partial_sort: heap select, then sort_heap. `rest_keys`, if given, are the float32 keys
    of seq[middle:last] (saves gathering them)."""
    _make_heap(seq, key, first, middle)
    if middle < last:
        # The heap's top only rises, so a chunk's elements not above the top at its start never
        # enter: numpy skips them and Python visits only the few that might.
        rest = rest_keys if rest_keys is not None else np.array([key[pos] for pos in seq[middle:last]], dtype=F32)
        for chunk in range(0, len(rest), 1024):
            above = np.flatnonzero(rest[chunk:chunk + 1024] > key[seq[first]])
            for i in (middle + chunk + above).tolist():
                if key[seq[i]] > key[seq[first]]:
                    _pop_heap(seq, key, first, middle, i)
    while middle - first > 1:
        middle -= 1
        _pop_heap(seq, key, first, middle, middle)


def _unguarded_linear_insert(seq, key, last):
    value = seq[last]
    nxt = last - 1
    while key[value] > key[seq[nxt]]:
        seq[last] = seq[nxt]
        last = nxt
        nxt -= 1
    seq[last] = value


def _insertion_sort(seq, key, first, last):
    for i in range(first + 1, last):
        if key[seq[i]] > key[seq[first]]:
            value = seq[i]
            seq[first + 1:i + 1] = seq[first:i]
            seq[first] = value
        else:
            _unguarded_linear_insert(seq, key, i)


def _move_median_to_first(seq, key, result, a, b, c):
    ka, kb, kc = key[seq[a]], key[seq[b]], key[seq[c]]
    if ka > kb:
        pick = b if kb > kc else (c if ka > kc else a)
    else:
        pick = a if ka > kc else (c if kb > kc else b)
    seq[result], seq[pick] = seq[pick], seq[result]


def _unguarded_partition(seq, key, first, last, pivot):
    pivot_key = key[seq[pivot]]
    while True:
        while key[seq[first]] > pivot_key:
            first += 1
        last -= 1
        while pivot_key > key[seq[last]]:
            last -= 1
        if not first < last:
            return first
        seq[first], seq[last] = seq[last], seq[first]
        first += 1


_SORT_THRESHOLD = 16


def _introsort_loop(seq, key, first, last, depth_limit):
    while last - first > _SORT_THRESHOLD:
        if depth_limit == 0:
            std_partial_sort(seq, key, first, last, last)
            return
        depth_limit -= 1
        mid = first + (last - first) // 2
        _move_median_to_first(seq, key, first, first + 1, mid, last - 1)
        cut = _unguarded_partition(seq, key, first + 1, last, first)
        _introsort_loop(seq, key, cut, last, depth_limit)
        last = cut


def std_sort(seq, key, first, last):
    """std::sort: introsort down to runs of 16, then one insertion sort pass."""
    if last - first < 2:
        return
    _introsort_loop(seq, key, first, last, 2 * ((last - first).bit_length() - 1))
    if last - first > _SORT_THRESHOLD:
        _insertion_sort(seq, key, first, first + _SORT_THRESHOLD)
        for i in range(first + _SORT_THRESHOLD, last):
            _unguarded_linear_insert(seq, key, i)
    else:
        _insertion_sort(seq, key, first, last)


# --- llama.cpp's sorting helpers ---------------------------------------------------------------

def _distinct_top(logits: np.ndarray, order: np.ndarray, count: int) -> bool:
    """True when the first `count` of `order` (a descending order) and the next one are all distinct,
    so every correct sort puts the same elements in the same order."""
    head = logits[order[:count + 1]]
    return not np.any(head[1:] == head[:-1])


def _top_order(logits: np.ndarray, count: int) -> np.ndarray:
    """Positions of the `count` largest logits, largest first (ties in any order)."""
    n = len(logits)
    if count + 1 < n:
        part = np.argpartition(-logits, count)[:count + 1]  # the top count+1, to see boundary ties
    else:
        part = np.arange(n)
    return part[np.argsort(-logits[part], kind="stable")]


def _std_partial_sort_positions(logits: np.ndarray, positions: np.ndarray, count: int) -> np.ndarray:
    """The first `count` positions after std::partial_sort(begin, begin + count, end) over `positions`."""
    if count == 0:
        return positions[:0]
    sub = logits[positions]
    order = _top_order(sub, count)
    if not _distinct_top(sub, order, count):
        seq = list(range(len(sub)))
        std_partial_sort(seq, sub.tolist(), 0, count, len(seq), rest_keys=sub[count:])
        order = seq
    return positions[order[:count]]


def _std_sort_positions(logits: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """`positions` after std::sort."""
    sub = logits[positions]
    order = np.argsort(-sub, kind="stable")
    if not _distinct_top(sub, order, len(sub)):
        seq = list(range(len(sub)))
        std_sort(seq, sub.tolist(), 0, len(seq))
        order = seq
    return positions[order]


_BUCKETS = 128
_BUCKET_SCALE = F32(_BUCKETS / 20.0)  # nbuckets / (bucket_high - bucket_low)
_BUCKET_INTER = F32(10.0) * _BUCKET_SCALE


def _bucket_of(logits: np.ndarray) -> np.ndarray:
    """int(bucket_scale * val + bucket_inter) clamped to [0, 127]: float32 maths, and x86's
    cvttss2si that turns NaN and out-of-range values into INT_MIN (so huge logits land in bucket 0)."""
    with np.errstate(all="ignore"):
        v = logits * _BUCKET_SCALE + _BUCKET_INTER
        in_range = np.abs(v) < F32(2.0**31)
        ib = np.where(in_range, np.trunc(np.where(in_range, v, 0)), -(2**31)).astype(np.int64)
    return np.clip(ib, 0, _BUCKETS - 1)


def bucket_partial_sort(logits: np.ndarray, npartial: int) -> np.ndarray:
    """llama_token_data_array_partial_sort: the first `npartial` positions of its result."""
    bucket = _bucket_of(logits)
    histo = np.bincount(bucket, minlength=_BUCKETS)
    from_top = np.cumsum(histo[::-1])
    ib = _BUCKETS - 1 - int(np.argmax(from_top >= npartial))
    # Scatter keeps array order inside a bucket; buckets go from the highest down.
    chosen = np.flatnonzero(bucket >= ib)
    chosen = chosen[np.argsort(-bucket[chosen], kind="stable")]
    parts, start = [], 0
    for j in range(_BUCKETS - 1, ib, -1):
        if histo[j]:
            parts.append(_std_sort_positions(logits, chosen[start:start + histo[j]]))
            start += int(histo[j])
    parts.append(_std_partial_sort_positions(logits, chosen[start:start + histo[ib]], npartial - start))
    return np.concatenate(parts)


# --- the candidate array and the samplers ---------------------------------------------------------

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
            self.take(_std_partial_sort_positions(self.logits, np.arange(len(self)), npartial))
        else:
            self.take(bucket_partial_sort(self.logits, npartial))
        self.sorted = True


def _max_logit(c: Candidates) -> F32:
    return c.logits[0] if c.sorted else c.logits.max()


def softmax_impl(c: Candidates) -> None:
    """llama_sampler_softmax_impl(cur_p, do_sort=false): float32 probabilities, summed in order."""
    with np.errstate(over="ignore", invalid="ignore"):
        p = expf(c.logits - _max_logit(c))
        total = np.add.accumulate(p, dtype=F32)[-1]
        c.p = p / total


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


def mt19937(seed: int) -> random.Random:
    """std::mt19937(seed): Python's generator is the same MT19937; only the seeding differs."""
    state = [seed & 0xFFFFFFFF]
    for i in range(1, 624):
        prev = state[-1]
        state.append((1812433253 * (prev ^ (prev >> 30)) + i) & 0xFFFFFFFF)
    gen = random.Random()
    gen.setstate((3, (*state, 624), None))
    return gen


_TWO_32 = 4294967296.0
_ONE_BELOW = math.nextafter(1.0, 0.0)


def uniform_canonical(gen: random.Random) -> float:
    """std::uniform_real_distribution<double>(0, 1) in libstdc++: generate_canonical<double, 53>
    from two 32-bit draws, summed in double."""
    low = float(gen.getrandbits(32))
    value = (low + float(gen.getrandbits(32)) * _TWO_32) / (_TWO_32 * _TWO_32)
    return _ONE_BELOW if value >= 1.0 else value


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
        with np.errstate(invalid="ignore", over="ignore"):
            p = expf(c.logits - _max_logit(c))
            running = np.cumsum(p.astype(np.float64))  # double sum of float terms, in order
            target = running[-1] * uniform_canonical(self.rng)
            hits = np.flatnonzero(running >= target)
        c.selected = int(hits[0]) if len(hits) else len(c) - 1


def random_seed() -> int:
    """What get_rng_seed does for LLAMA_DEFAULT_SEED: a fresh 32-bit seed from the OS."""
    return secrets.randbits(32)


class Sampler:
    """One sequence's sampler: call sample() for a token, then accept() it (and accept every
    prompt token first, as llama-completion does, so penalties see the prompt too)."""

    def __init__(self, params: SamplingParams, n_vocab: int):
        params.validate()
        self.params = params
        self.n_vocab = n_vocab
        self._penalties = None
        if params.repeat_last_n != 0 and not (F32(params.repeat_penalty) == 1.0 and F32(params.frequency_penalty) == 0.0
                                              and F32(params.presence_penalty) == 0.0):
            self._penalties = Penalties(params.repeat_last_n, params.repeat_penalty,
                                        params.frequency_penalty, params.presence_penalty)
        optional = [
            (params.top_k > 0, lambda: TopK(params.top_k)),
            (F32(params.top_p) < 1.0, lambda: TopP(params.top_p)),
            (F32(params.min_p) > 0.0, lambda: MinP(params.min_p)),
            (F32(params.temp) != 1.0, lambda: Temperature(params.temp)),
        ]
        self._filters = [make() for enabled, make in optional if enabled]
        self.reset()

    def reset(self) -> None:
        """common_sampler_reset: forget the history and reseed (a fresh random seed if it was random)."""
        if self._penalties is not None:
            self._penalties.window.clear()
            self._penalties.count.clear()
        seed = self.params.seed & 0xFFFFFFFF  # --seed goes through stoul into a uint32_t
        self.seed = random_seed() if seed == LLAMA_DEFAULT_SEED else seed
        self._dist = Dist(self.seed)

    def candidates(self, logits: np.ndarray) -> Candidates:
        """Run every sampler up to and including the draw; the chosen one is at `.selected`."""
        logits = np.asarray(logits)
        if logits.shape != (self.n_vocab,):
            raise ValueError(f"expected {self.n_vocab} logits, got shape {logits.shape}")
        c = Candidates(logits)
        if self._penalties is not None:
            self._penalties.apply(c)
        for sampler in self._filters:
            sampler.apply(c)
        self._dist.apply(c)
        return c

    def sample(self, logits: np.ndarray) -> int:
        c = self.candidates(logits)
        return int(c.ids[c.selected])

    def accept(self, token: int) -> None:
        if self._penalties is not None:
            self._penalties.accept(int(token))
