"""FNV-1a 64-bit, the hash llama.cpp's client uses to name weights for SET_TENSOR_HASH."""

import numba
import numpy as np

from .jit import JIT

FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3


@numba.njit(**JIT)
def _fnv1a64(data, h):
    prime = np.uint64(FNV_PRIME)
    for i in range(data.size):
        h = (h ^ np.uint64(data[i])) * prime
    return h


def fnv1a64(data: np.ndarray) -> int:
    return int(_fnv1a64(np.ascontiguousarray(data, dtype=np.uint8).reshape(-1), np.uint64(FNV_OFFSET)))


def fnv1a64_reference(data: bytes) -> int:
    h = FNV_OFFSET
    for byte in data:
        h = ((h ^ byte) * FNV_PRIME) & 0xFFFFFFFFFFFFFFFF
    return h
