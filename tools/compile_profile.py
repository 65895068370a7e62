"""Where a worker's cold start goes: CPU seconds numba spends compiling (or loading) each kernel during
the warm-up, from numba's compile events.

    NUMBA_CACHE_DIR=$(mktemp -d) python tools/compile_profile.py [--tier demo|all] [--top 15]

Run it with an empty cache (NUMBA_CACHE_DIR a fresh directory) to see the compile; with a filled one
it shows the loads. Times are process CPU (robust on a shared machine), self time: a nested compile of a
callee is counted for the callee only. Prints the total, per module and the most expensive functions.
"""
from __future__ import annotations

import argparse
import collections
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    from numba.core import event  # noqa: PLC0415

    from rpcserver import warmup  # noqa: PLC0415

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tier", choices=list(warmup.TIERS), default="demo")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--signatures", metavar="TEXT", help="also print the argument types of every compile of a "
                                                               "function whose name contains TEXT")
    args = parser.parse_args()

    per_function: dict[str, float] = collections.defaultdict(float)
    signatures: dict[str, int] = collections.Counter()
    stack: list[list] = []  # [name, start, nested seconds]

    class Listener(event.Listener):
        def on_start(self, ev):
            stack.append([ev.data["dispatcher"].py_func.__module__ + "." + ev.data["dispatcher"].py_func.__qualname__,
                          time.process_time(), 0.0])

        def on_end(self, ev):
            name, start, nested = stack.pop()
            took = time.process_time() - start
            per_function[name] += took - nested
            if args.signatures and args.signatures in name:
                print(f"{name} {took - nested:.1f} s: {ev.data['args']}")
            signatures[name] += 1
            if stack:
                stack[-1][2] += took

    def rusage() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    cpu0, wall0 = rusage(), time.perf_counter()
    with event.install_listener("numba:compile", Listener()):
        warmup.warm_up(lambda done, total, s: print(f"warm-up: {done}/{total} graphs, {s:.0f} s", file=sys.stderr),
                       args.tier)
    cpu, wall = rusage() - cpu0, time.perf_counter() - wall0
    compile_cpu = sum(per_function.values())
    print(f"tier {args.tier}: {cpu:.1f} s CPU, {wall:.1f} s wall, {compile_cpu:.1f} s CPU in {sum(signatures.values())} "
          f"compile events ({len(per_function)} functions); peak RSS "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    modules: dict[str, float] = collections.defaultdict(float)
    for name, seconds in per_function.items():
        modules[name.rsplit(".", 1)[0]] += seconds
    print("\n| module | CPU s | share |\n|---|---|---|")
    for name, seconds in sorted(modules.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"| `{name}` | {seconds:.1f} | {100 * seconds / compile_cpu:.0f}% |")
    print("\n| function | signatures | CPU s |\n|---|---|---|")
    for name, seconds in sorted(per_function.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"| `{name}` | {signatures[name]} | {seconds:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
