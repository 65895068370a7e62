"""FNV-1a 64-bit compiled (wire.hashing states it and holds its constants): weights are gigabytes."""

import numba
import numpy as np

from wire.hashing import FNV_OFFSET, FNV_PRIME

from .jit import JIT


@numba.njit(**JIT)
def _fnv1a64(data, h):
    prime = np.uint64(FNV_PRIME)
    for i in range(data.size):
        h = (h ^ np.uint64(data[i])) * prime
    return h


def fnv1a64(data: np.ndarray) -> int:
    return int(_fnv1a64(np.ascontiguousarray(data, dtype=np.uint8).reshape(-1), np.uint64(FNV_OFFSET)))
