"""Which worker owns which blocks: layers 0..n_layer-1 and the output head (block n_layer).

As llama.cpp's load_tensors with every layer offloaded: split points are the running sums of each
worker's share (its free memory, or --tensor-split), normalized; block il goes to the first worker
whose split point exceeds il / (n_layer + 1). The arithmetic is float32, as there, so the same
inputs give the same assignment.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np


class PlacementError(Exception):
    """The model does not fit, or the requested split is unusable."""


def split_blocks(n_layer: int, shares: list[float]) -> list[range]:
    """Contiguous block ranges (over 0..n_layer inclusive), one per worker, possibly empty."""
    if not shares or any(s < 0 for s in shares) or not any(s > 0 for s in shares):
        raise PlacementError(f"cannot split layers by {shares}: need non-negative shares, one positive")
    splits = np.cumsum(np.asarray(shares, dtype=np.float32), dtype=np.float32)
    splits = (splits / splits[-1]).astype(np.float32).tolist()
    n_blocks = n_layer + 1
    owner = [min(bisect.bisect_right(splits, float(np.float32(il) / np.float32(n_blocks))), len(shares) - 1)
             for il in range(n_blocks)]
    ranges = []
    for w in range(len(shares)):
        mine = [il for il in range(n_blocks) if owner[il] == w]
        ranges.append(range(mine[0], mine[-1] + 1) if mine else range(0))
    return ranges


@dataclass
class StagePlan:
    endpoint: str
    blocks: range
    free: int
    weight_bytes: int
    kv_bytes: int
    compute_bytes: int

    @property
    def total(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.compute_bytes

    def describe(self, n_layer: int) -> str:
        layers = [b for b in self.blocks if b < n_layer]
        span = f"layers {layers[0]:2d}-{layers[-1]:2d}" if layers else "no layers   "
        head = " + output" if n_layer in self.blocks else ""
        mib = 1 << 20
        return (f"{self.endpoint:>21}: {span}{head:9} weights {self.weight_bytes / mib:7.1f} MiB, "
                f"KV {self.kv_bytes / mib:6.1f} MiB, compute {self.compute_bytes / mib:6.1f} MiB "
                f"(free {self.free / mib:.0f} MiB)")


def check_fit(plans: list[StagePlan]) -> None:
    """Refuses a plan in which some worker's share exceeds its free memory, naming the shortfall: in
    total (what the model needs against what the workers offer together) and per worker."""
    short = [s for s in plans if s.blocks and s.total > s.free]
    if not short:
        return
    mib = 1 << 20
    needed, offered = sum(s.total for s in plans), sum(s.free for s in plans)
    weights, kv, compute = (sum(getattr(s, f) for s in plans) for f in ("weight_bytes", "kv_bytes", "compute_bytes"))
    parts = (f"weights {weights / mib:.1f} + KV {kv / mib:.1f} + compute {compute / mib:.1f} MiB")
    if needed > offered:
        head = (f"the model does not fit: its {len(plans)} stage(s) need {needed / mib:.1f} MiB ({parts}) but "
                f"the workers offer {offered / mib:.1f} MiB free together, {(needed - offered) / mib:.1f} MiB "
                f"({needed - offered} bytes) short")
    else:
        head = (f"the model does not fit as split: the workers offer {offered / mib:.1f} MiB free together, "
                f"enough for its {needed / mib:.1f} MiB ({parts}), but not in these shares (--tensor-split "
                f"moves layers)")
    lines = [f"worker {s.endpoint} needs {s.total / mib:.1f} MiB but has {s.free / mib:.1f} MiB free" for s in short]
    raise PlacementError(head + "; " + "; ".join(lines))
