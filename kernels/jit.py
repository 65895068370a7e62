"""The one set of numba options every kernel compiles with.

`JIT`: cached on disk, GIL released, no fast-math (kernels must be bit-identical to ggml), and numpy's
error model, so a float division by zero gives inf/nan as ggml's C does instead of raising.
"""

from __future__ import annotations

JIT = dict(cache=True, nogil=True, fastmath=False, error_model="numpy")
