"""ggml-style compute kernels: numba implementations, each with a numpy reference twin.

`kernels.ops` holds one module per op family; each registers its kernels in `kernels.registry.KERNELS`
when imported, and `load_all()` imports every module there: the op list is the folder's contents.
`kernels.formats` holds the number formats (block quantizations, their dot products, float rows); the
modules here are the core both stand on (jit settings, float math, LLVM helpers, storage, the node and
the kernel table).
"""

import hashlib
import importlib
import os
import pkgutil
from pathlib import Path

import numba


def source_digest() -> str:
    """A digest of every kernel and wire source file. numba keys a cached function on its own file alone,
    so a kernel that inlines a helper from another file (MUL_MAT_ID and the K-quant dots, say) would load
    stale machine code after that helper changed; the cache lives in a folder named by this digest."""
    root = Path(__file__).resolve().parent
    digest = hashlib.blake2b(digest_size=8)
    for path in sorted([*root.rglob("*.py"), *(root.parent / "wire").glob("*.py")]):
        digest.update(str(path.relative_to(root.parent)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


if not os.environ.get("NUMBA_CACHE_DIR"):  # before any kernel module compiles or loads a function
    _home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    numba.config.CACHE_DIR = str(_home / "pyrpc-llama" / "numba" / source_digest())

from .node import InvalidNode, Node, Tensor  # noqa: E402, F401


def op_modules() -> tuple[str, ...]:
    """Names of the op modules, as found in kernels/ops."""
    from . import ops

    return tuple(sorted(info.name for info in pkgutil.iter_modules(ops.__path__)))


def load_all() -> None:
    for name in op_modules():
        importlib.import_module(f"{__name__}.ops.{name}")
