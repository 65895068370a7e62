"""The long fuzz run: the fuzz tests with many examples and fresh random seeds, for a bounded time.

    python tools/fuzz.py                              # 10 minutes of rounds, 5000 examples per test
    python tools/fuzz.py --minutes 60 --examples 50000
    python tools/fuzz.py --seed 1234567 --rounds 1    # repeat a round that failed

CI runs the same tests derandomized with each test's own count (tests/conftest.py's "ci" profile), so it
passes or fails on the code alone; this is the search that finds new inputs. Each round is one pytest
run under the "fuzz" profile with a seed of its own, printed first; rounds go on until the time is up
(the round running then is stopped and counts as unfinished, not failed). A failure prints hypothesis'
falsifying example and its @reproduce_failure blob, and stops the run: pin the input as an @example in
the test before fixing the code, so CI keeps checking it.
"""
from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FUZZ_TESTS = ("tests/unit/test_session_fuzz.py", "tests/unit/test_protocol.py")


def run_round(seed: int, examples: int | None, tests: list[str], seconds: float) -> int | None:
    """One pytest run of the tests under the fuzz profile; its exit status, None if cut off by the time."""
    env = dict(os.environ, HYPOTHESIS_PROFILE="fuzz")
    if examples is not None:
        env["PYRPC_FUZZ_EXAMPLES"] = str(examples)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", f"--hypothesis-seed={seed}",
           *tests]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=max(seconds, 1.0))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # its own session: pytest and nothing else of ours
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="time for the whole run (default 10)")
    ap.add_argument("--examples", type=int, help="examples per test and round (default: tests/conftest.py's, 5000)")
    ap.add_argument("--rounds", type=int, default=0, help="stop after this many rounds (default: until the time is up)")
    ap.add_argument("--seed", type=int, help="the first round's seed (default: random)")
    ap.add_argument("tests", nargs="*", default=list(FUZZ_TESTS),
                    help=f"test files or ids (default: {' '.join(FUZZ_TESTS)})")
    args = ap.parse_args(argv)

    deadline = time.monotonic() + args.minutes * 60
    seed = args.seed if args.seed is not None else random.SystemRandom().getrandbits(32)
    done = 0
    while time.monotonic() < deadline and (not args.rounds or done < args.rounds):
        print(f"=== round {done + 1}: seed {seed}", flush=True)
        status = run_round(seed, args.examples, args.tests, deadline - time.monotonic())
        if status is None:
            print(f"=== round {done + 1} (seed {seed}) unfinished when the time ran out", flush=True)
            break
        if status != 0:
            again = f" --examples {args.examples}" if args.examples else ""
            print(f"=== FAILED in round {done + 1}: repeat it with\n"
                  f"    python tools/fuzz.py --seed {seed} --rounds 1{again}", flush=True)
            return 1
        done += 1
        seed = random.SystemRandom().getrandbits(32)
    print(f"=== {done} rounds passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
