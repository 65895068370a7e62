"""What libllama.so's C and C++ runtimes compute, reproduced where llama.cpp's results depend on it.

llama.cpp's tokenizer and sampler call into glibc and libstdc++ (GCC 12, which built the pinned
binaries), and their exact answers matter: an expf rounded differently, equal logits sorted in another
order, another hash map walk or random stream would change the chosen token. Everything here follows
those libraries' sources:

* glibc: expf (vectorised over float32 arrays), logf (libm's own, through ctypes), strtol base 16,
  isspace in the C locale;
* libstdc++ algorithms: std::sort (introsort) and std::partial_sort (heap select) for the comparator
  a > b over keys;
* libstdc++ containers: the iteration order of a std::unordered_map<std::string, int> and its string hash;
* libstdc++ <random>: std::mt19937 and std::uniform_real_distribution<double>(0, 1).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import random
import struct
from bisect import bisect_left

import numpy as np

F32 = np.float32
ISSPACE = b" \t\n\v\f\r"  # isspace() in the C locale


# --- glibc ------------------------------------------------------------------------------------------------

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


def strtol16(text: bytes) -> int:
    """strtol(text, NULL, 16) for the ASCII text it is given: leading space, a sign, then hex digits
    up to the first other character (no digits: 0)."""
    digits = text.decode("latin-1").lstrip(ISSPACE.decode())
    sign = -1 if digits[:1] == "-" else 1
    digits = digits[1:] if digits[:1] in "+-" else digits
    hex_digits = ""
    for char in digits:
        if char not in "0123456789abcdefABCDEF":
            break
        hex_digits += char
    return sign * int(hex_digits or "0", 16)


# --- libstdc++ sorting, comparator key[a] > key[b] ------------------------------------------------------------
# Work on `seq`, a list of positions, with `key[pos]` the value compared (the sampler's logit; moving a
# position stands for moving the whole llama_token_data). Index arithmetic follows bits/stl_heap.h and
# bits/stl_algo.h.

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


# --- libstdc++: std::unordered_map iteration order ------------------------------------------------------------
# llama.cpp finds EOT/FIM tokens by walking its token_to_id hash map and taking the first text that matches,
# so when a vocabulary has several candidates (SmolLM2: <|im_end|> and <|endoftext|>) the winner is whatever
# libstdc++ iterates first. We replay that map: its string hash, its prime bucket counts and where it links
# each new node.

_MASK64 = (1 << 64) - 1
_MURMUR_MUL = 0xC6A4A7935BD1E995
_STRING_HASH_SEED = 0xC70F6907
_FAST_BUCKETS = (2, 2, 2, 3, 5, 5, 7, 7, 11, 11, 11, 11, 13, 13)  # _Prime_rehash_policy::_M_next_bkt, n < 14
_BUCKET_PRIMES = (  # std::__detail::__prime_list from 17 on
    17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79, 83, 89, 97, 103, 109, 113, 127, 137, 139, 149,
    157, 167, 179, 193, 199, 211, 227, 241, 257, 277, 293, 313, 337, 359, 383, 409, 439, 467, 503, 541, 577, 619,
    661, 709, 761, 823, 887, 953, 1031, 1109, 1193, 1289, 1381, 1493, 1613, 1741, 1879, 2029, 2179, 2357, 2549,
    2753, 2971, 3209, 3469, 3739, 4027, 4349, 4703, 5087, 5503, 5953, 6427, 6949, 7517, 8123, 8783, 9497, 10273,
    11113, 12011, 12983, 14033, 15173, 16411, 17749, 19183, 20753, 22447, 24281, 26267, 28411, 30727, 33223, 35933,
    38873, 42043, 45481, 49201, 53201, 57557, 62233, 67307, 72817, 78779, 85229, 92203, 99733, 107897, 116731,
    126271, 136607, 147793, 159871, 172933, 187091, 202409, 218971, 236897, 256279, 277261, 299951, 324503, 351061,
    379787, 410857, 444487, 480881, 520241, 562841, 608903, 658753, 712697, 771049, 834181, 902483, 976369,
    1056323, 1142821, 1236397, 1337629, 1447153, 1565659, 1693859, 1832561, 1982627, 2144977, 2320627, 2510653,
    2716249, 2938679, 3179303, 3439651, 3721303, 4026031, 4355707, 4712381, 5098259, 5515729, 5967347, 6456007,
    6984629, 7556579, 8175383, 8844859, 9569143, 10352717, 11200489, 12117689, 13109983, 14183539, 15345007,
    16601593, 17961079, 19431899,
)


def _std_string_hash(data: bytes) -> int:
    """std::hash<std::string> of libstdc++ on 64-bit: std::_Hash_bytes (a MurmurHash2 variant)."""
    def shift_mix(v: int) -> int:
        return v ^ (v >> 47)
    aligned = len(data) & ~7
    h = _STRING_HASH_SEED ^ (len(data) * _MURMUR_MUL & _MASK64)
    for (word,) in struct.iter_unpack("<Q", data[:aligned]):
        h = ((h ^ (shift_mix(word * _MURMUR_MUL & _MASK64) * _MURMUR_MUL & _MASK64)) * _MURMUR_MUL) & _MASK64
    if len(data) & 7:
        h = ((h ^ int.from_bytes(data[aligned:], "little")) * _MURMUR_MUL) & _MASK64
    return shift_mix(shift_mix(h) * _MURMUR_MUL & _MASK64)


def unordered_map_order(keys: list[bytes]) -> list[int]:
    """Indices of `keys` in the order a std::unordered_map<std::string, int> filled by m[keys[i]] = i walks them."""
    hashes = [_std_string_hash(k) for k in keys]
    head = len(keys)  # index of the list's before-begin node
    nxt = [-1] * (len(keys) + 1)
    n_buckets, next_resize, before = 1, 0, [None]  # before[b]: the node preceding bucket b's first node
    for i, code in enumerate(hashes):
        if i + 1 > next_resize:  # _Prime_rehash_policy::_M_need_rehash with max_load_factor 1
            wanted = max(i + 1, 0 if next_resize else 11)
            if wanted >= n_buckets:
                want = max(wanted + 1, 2 * n_buckets)
                if want < len(_FAST_BUCKETS):
                    n_buckets = _FAST_BUCKETS[want]
                else:
                    at = bisect_left(_BUCKET_PRIMES, want)
                    if at == len(_BUCKET_PRIMES):
                        raise ValueError(f"{len(keys)} keys: beyond the bucket counts replayed here")
                    n_buckets = _BUCKET_PRIMES[at]
                next_resize = n_buckets
                before = [None] * n_buckets
                node, nxt[head], first_bucket = nxt[head], -1, 0
                while node != -1:  # _M_rehash_aux: relink every node in list order
                    following, bucket = nxt[node], hashes[node] % n_buckets
                    if before[bucket] is None:
                        nxt[node], nxt[head] = nxt[head], node
                        before[bucket] = head
                        if nxt[node] != -1:
                            before[first_bucket] = node
                        first_bucket = bucket
                    else:
                        nxt[node], nxt[before[bucket]] = nxt[before[bucket]], node
                    node = following
            else:
                next_resize = n_buckets
        bucket = code % n_buckets
        if before[bucket] is not None:  # _M_insert_bucket_begin
            nxt[i], nxt[before[bucket]] = nxt[before[bucket]], i
        else:
            nxt[i], nxt[head] = nxt[head], i
            if nxt[i] != -1:
                before[hashes[nxt[i]] % n_buckets] = i
            before[bucket] = head
    order, node = [], nxt[head]
    while node != -1:
        order.append(node)
        node = nxt[node]
    return order


# --- libstdc++ <random> -------------------------------------------------------------------------------------

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

