"""ggml-style compute kernels: numba implementations, each with a numpy reference twin.

`load_all()` imports every op module, which registers its kernels in `kernels.registry.KERNELS`.
"""

import importlib

from .node import InvalidNode, Node, Tensor  # noqa: F401

OP_MODULES = ("matmul", "moe", "add_id", "sort", "reduce", "get_rows", "elementwise", "glu", "norm", "rope", "softmax", "attention",
              "copy", "shape_ops")


def load_all() -> None:
    for name in OP_MODULES:
        importlib.import_module(f"{__name__}.{name}")
