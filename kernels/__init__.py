"""ggml-style compute kernels: numba implementations, each with a numpy reference twin.

`kernels.ops` holds one module per op family; each registers its kernels in `kernels.registry.KERNELS`
when imported, and `load_all()` imports every module there: the op list is the folder's contents.
`kernels.formats` holds the number formats (block quantizations, their dot products, float rows); the
modules here are the core both stand on (jit settings, float math, LLVM helpers, storage, the node and
the kernel table).
"""

import importlib
import pkgutil

from .node import InvalidNode, Node, Tensor  # noqa: F401


def op_modules() -> tuple[str, ...]:
    """Names of the op modules, as found in kernels/ops."""
    from . import ops

    return tuple(sorted(info.name for info in pkgutil.iter_modules(ops.__path__)))


def load_all() -> None:
    for name in op_modules():
        importlib.import_module(f"{__name__}.ops.{name}")
