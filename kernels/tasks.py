"""How MUL_MAT splits its work into parallel tasks: slices of ROWS_PER_TASK weight rows per (i12, i13)."""

from __future__ import annotations

import numba

from .jit import JIT

ROWS_PER_TASK = 16  # weight rows kept hot in cache while all activation columns stream past
QUANTIZE_PARALLEL_ROWS = 4  # activation rows from which their quantization is split across threads


@numba.njit(inline="always", **JIT)
def task_tile(task, ne01, ne02, ne03, ne11, ne12, ne13, off, nb02, nb03):
    """One parallel task: a ROWS_PER_TASK slice [lo, hi) of the weight rows of slice (i12, i13), its
    byte offset `base` (src0 broadcast over dims 2/3) and the first activation column `col0`."""
    nchunk = (ne01 + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    chunk = task % nchunk
    i12 = (task // nchunk) % ne12
    i13 = task // (nchunk * ne12)
    base = off + (i12 // (ne12 // ne02)) * nb02 + (i13 // (ne13 // ne03)) * nb03
    lo = chunk * ROWS_PER_TASK
    return i12, i13, base, (i13 * ne12 + i12) * ne11, lo, min(ne01, lo + ROWS_PER_TASK)
