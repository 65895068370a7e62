"""How llama.cpp sorts candidates by logit, with libstdc++'s tie order.

llama_token_data_array_partial_sort sorts small requests with std::partial_sort and large ones by
scattering the logits into 128 buckets first, sorting bucket by bucket. Equal logits end up wherever
libstdc++'s algorithms put them. When the logits that matter are distinct, any correct sort gives that
order, so numpy sorts them; only ties run the (slower) copies of std::sort / std::partial_sort in
orchestrator.cxx. Every function returns positions into the logits it was given.
"""

from __future__ import annotations

import numpy as np

from orchestrator.cxx import F32, std_partial_sort, std_sort


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


def std_partial_sort_positions(logits: np.ndarray, positions: np.ndarray, count: int) -> np.ndarray:
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


def std_sort_positions(logits: np.ndarray, positions: np.ndarray) -> np.ndarray:
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
            parts.append(std_sort_positions(logits, chosen[start:start + histo[j]]))
            start += int(histo[j])
    parts.append(std_partial_sort_positions(logits, chosen[start:start + histo[ib]], npartial - start))
    return np.concatenate(parts)

