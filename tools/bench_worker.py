"""Benchmark our worker against llama.cpp's ggml-rpc-server, side by side in one run.

    python tools/bench_worker.py [-p 128] [-n 64] [-r 2] [-m MODEL]

Starts both workers, runs `llama-bench --rpc` against each (alternating, -r repetitions each), and
prints prompt-processing (pp) and generation (tg) tokens/s with the ratio ours/reference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools import reference  # noqa: E402


def llama_bench(worker, model: Path, n_prompt: int, n_gen: int, threads: int) -> dict[str, float]:
    cmd = [str(reference.binary("llama-bench")), "-m", str(model), "--rpc", worker.address, "-ngl", "99",
           "-p", str(n_prompt), "-n", str(n_gen), "-r", "1", "-t", str(threads), "-o", "json"]
    out = subprocess.run(cmd, env=reference.llama_env(), capture_output=True, text=True, timeout=3600,
                         stdin=subprocess.DEVNULL)
    if out.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({out.returncode}):\n{out.stderr[-3000:]}\n{worker.describe()}")
    results = {}
    for row in json.loads(out.stdout):
        kind = f"pp{row['n_prompt']}" if row["n_prompt"] else f"tg{row['n_gen']}"
        results[kind] = float(row["avg_ts"])
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-p", "--n-prompt", type=int, default=128)
    ap.add_argument("-n", "--n-gen", type=int, default=64)
    ap.add_argument("-r", "--repetitions", type=int, default=2)
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args(argv)
    model = Path(args.model) if args.model else reference.model_path()
    samples: dict[str, dict[str, list[float]]] = {"reference": {}, "ours": {}}
    with tempfile.TemporaryDirectory() as logs:
        workers = {kind: reference.start_worker(kind, Path(logs), threads=args.threads, timeout=600)
                   for kind in samples}
        try:
            for rep in range(args.repetitions):
                for kind, worker in workers.items():
                    for test, ts in llama_bench(worker, model, args.n_prompt, args.n_gen, args.threads).items():
                        samples[kind].setdefault(test, []).append(ts)
                        print(f"rep {rep + 1} {kind:9} {test:6} {ts:8.2f} t/s", file=sys.stderr, flush=True)
        finally:
            for worker in workers.values():
                worker.stop()
    print(f"model: {model.name}, threads: {args.threads}, repetitions: {args.repetitions}")
    print(f"| test | reference t/s | ours t/s | ours/reference |")
    print(f"|---|---|---|---|")
    for test in samples["reference"]:
        ref = statistics.median(samples["reference"][test])
        ours = statistics.median(samples["ours"][test])
        print(f"| {test} | {ref:.2f} | {ours:.2f} | {ours / ref:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
