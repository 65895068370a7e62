"""The one set of numba options every kernel compiles with, and `row_loop` (row drivers compiled
parallel and serial from one function).

`JIT`: cached on disk, GIL released, no fast-math (kernels must be bit-identical to ggml), and numpy's
error model, so a float division by zero gives inf/nan as ggml's C does instead of raising.
"""

from __future__ import annotations

import types

import numba

JIT = dict(cache=True, nogil=True, fastmath=False, error_model="numpy")


class RowLoop:
    """A row driver compiled twice from one Python function: `parallel` (prange runs on numba's
    threads) and `serial` (prange is a plain range). Called like the function with one more, last,
    argument: whether to run in parallel, e.g. `_norm_rows(op, src, dst, ..., parallel)`.

    A prange index is uint64 in the parallel variant (and its body is typed once more with int64):
    a driver passes it on as `np.int64(r)`, so the row function it calls compiles once for both
    variants instead of twice (the same integer values: rows number far below 2**63)."""

    def __init__(self, py_func):
        self.py_func = py_func
        self.__doc__ = py_func.__doc__
        self.__name__ = py_func.__name__
        self.parallel = numba.njit(parallel=True, **JIT)(py_func)
        # A distinct function object and name: numba's cache file names derive from the qualname and its
        # index key does not hold the `parallel` option, so one name for both would let them overwrite
        # each other's cache entries.
        serial = types.FunctionType(py_func.__code__, py_func.__globals__, py_func.__name__ + "_serial",
                                    py_func.__defaults__, py_func.__closure__)
        serial.__qualname__ = py_func.__qualname__ + "_serial"
        serial.__module__ = py_func.__module__
        serial.__doc__ = py_func.__doc__
        self.serial = numba.njit(**JIT)(serial)

    def __call__(self, *args):
        *args, parallel = args
        run, other = (self.parallel, self.serial) if parallel else (self.serial, self.parallel)
        known = len(run.overloads)  # not run.signatures, which builds a list: this is every kernel call
        result = run(*args)
        if len(run.overloads) != known:
            # a new signature: give the other variant it too (compiled, or loaded from numba's cache),
            # so that whatever a warm-up calls leaves both ready; the row functions each one inlines
            # are typed differently under prange and range, so one variant does not cover the other
            other.compile(next(reversed(run.overloads)))
        return result


def row_loop(py_func) -> RowLoop:
    """Decorator for a row driver written once as a prange loop; see RowLoop. (A generic numba driver
    taking the row function as an argument is never a cache hit: dispatchers pickle with a per-process
    uuid, so the cache key differs in every process.)"""
    return RowLoop(py_func)
