"""A model bigger than any one worker: every worker is started with a memory budget (-m) below the size
of the GGUF file, so only a split can hold it.

Our orchestrator spreads the layers over two or three such workers so that each share (weights + KV +
compute, as its plan prints them) fits that worker's budget, and writes the same greedy text as
llama-completion --rpc over the same workers (which also splits by the free memory they report). With
budgets so small that all workers together cannot hold the model, both `orchestrator` and `orchestrator
serve` refuse before loading anything and say by how much it falls short.

llama.cpp's ggml-rpc-server has no memory flag (it reports the machine's free RAM), so every worker
here is ours.
"""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from .conftest import CLIENT_THREADS, REPO_ROOT, RPC_TIMEOUT, assert_fully_offloaded, reference, text_diff
from .programs import PROMPTS, orchestrator_env, run_orchestrator, start_workers, stop_workers

pytestmark = pytest.mark.interop

MIB = 1 << 20
N_PREDICT = 24
# A small context and micro-batch keep the KV cache and compute buffers small beside the weights,
# so the budgets below are mostly about the weights.
SMALL = ["-c", 256, "-b", 32, "-ub", 32]
# Per worker, as a fraction of the model file: each below 1, together above it (with room for KV and
# compute, and on the last worker for the output matrix: with llama.cpp's split by free memory it
# gets a third of the layers as well), or together well below it.
FITS_TOGETHER = {2: 0.72, 3: 0.60}
TOO_SMALL = 0.3
PLAN_RE = re.compile(r"^\s*(\S+): (?:layers\s+(\d+)-\s*(\d+)|no layers)\s*(\+ output)?\s+weights\s+([\d.]+) MiB, "
                     r"KV\s+([\d.]+) MiB, compute\s+([\d.]+) MiB \(free (\d+) MiB\)", re.M)


def budget_mib(model_path, fraction: float) -> int:
    return int(model_path.stat().st_size * fraction / MIB)


def generation_args(model_path) -> list:
    return ["-m", model_path, "-p", PROMPTS["fact"], "-n", N_PREDICT, "--temp", 0, "--ignore-eos", *SMALL]


@pytest.fixture(scope="module", params=sorted(FITS_TOGETHER))
def small_workers(request, bin_dir, model_path, tmp_path_factory):
    """Two or three of our workers, each with a budget below the model file's size."""
    n = request.param
    mem = budget_mib(model_path, FITS_TOGETHER[n])
    assert mem * MIB < model_path.stat().st_size < n * mem * MIB
    workers = start_workers(("ours",) * n, tmp_path_factory.mktemp(f"small-{n}"), mem_mib=(mem,) * n)
    yield workers, mem
    stop_workers(workers)


def test_the_plan_splits_a_model_no_worker_could_hold_and_writes_llama_completions_text(llama, model_path,
                                                                                          small_workers):
    workers, mem = small_workers
    endpoints = [w.address for w in workers]
    args = generation_args(model_path)
    ours = run_orchestrator(["--rpc", ",".join(endpoints), *args], workers)

    plans = PLAN_RE.findall(ours.stderr)
    assert [p[0] for p in plans] == endpoints, ours.stderr[-3000:]
    layers = 0
    for endpoint, first, last, _, weights, kv, compute, free in plans:
        assert int(free) == mem, endpoint
        assert first, f"{endpoint} got no layers"
        layers += int(last) - int(first) + 1
        assert float(weights) + float(kv) + float(compute) <= mem, f"{endpoint}'s share exceeds its -m {mem}"
    assert plans[-1][3], "the output head is not on the last worker"
    assert sum(float(p[4]) for p in plans) * MIB > mem * MIB  # no single budget holds the weights placed
    n_layer = int(plans[-1][2]) + 1
    assert layers == n_layer

    theirs = llama("llama-completion", [*args, "-no-cnv", "-t", CLIENT_THREADS, "--rpc", ",".join(endpoints),
                                        "-ngl", 99, "-fit", "off", "-lv", 4], timeout=RPC_TIMEOUT, worker=workers[0])
    assert_fully_offloaded(theirs.stderr)
    assert theirs.stdout.strip(), "llama-completion produced no text"
    assert ours.stdout == theirs.stdout, text_diff(theirs.stdout, ours.stdout, "llama-completion", "orchestrator")


SHORT_RE = re.compile(r"need ([\d.]+) MiB \(weights ([\d.]+) \+ KV [\d.]+ \+ compute [\d.]+ MiB\) but the workers "
                      r"offer ([\d.]+) MiB free together, ([\d.]+) MiB \((\d+) bytes\) short")


@pytest.fixture(scope="module")
def tiny_workers(bin_dir, model_path, tmp_path_factory):
    mem = budget_mib(model_path, TOO_SMALL)
    workers = start_workers(("ours", "ours"), tmp_path_factory.mktemp("tiny"), mem_mib=(mem, mem))
    yield workers, mem
    stop_workers(workers)


def assert_names_the_shortfall(done: subprocess.CompletedProcess, model_path, mem: int, n_workers: int) -> None:
    assert done.returncode != 0, f"the model fit in {n_workers} x {mem} MiB?\n{done.stderr[-3000:]}"
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    found = SHORT_RE.search(done.stderr)
    assert found, done.stderr[-3000:]
    needed, weights, offered, short_mib, short = found.groups()
    assert float(offered) == pytest.approx(n_workers * mem, abs=0.05)
    assert float(weights) * MIB > model_path.stat().st_size * 0.9  # nearly all the file is weights
    assert int(short) > 0 and float(short_mib) == pytest.approx(int(short) / MIB, abs=0.05)
    assert float(needed) - float(offered) == pytest.approx(float(short_mib), abs=0.1)


def test_too_small_together_the_orchestrator_refuses_naming_the_shortfall(model_path, tiny_workers):
    workers, mem = tiny_workers
    cmd = [sys.executable, "-m", "orchestrator", "--rpc", ",".join(w.address for w in workers),
           *map(str, generation_args(model_path)), "--no-warmup"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=RPC_TIMEOUT, env=orchestrator_env(),
                          cwd=REPO_ROOT, stdin=subprocess.DEVNULL)
    assert_names_the_shortfall(done, model_path, mem, len(workers))
    assert all(w.alive() for w in workers)


def test_too_small_together_serve_refuses_the_same_way(model_path, tiny_workers):
    workers, mem = tiny_workers
    cmd = [sys.executable, "-m", "orchestrator", "serve", "--rpc", ",".join(w.address for w in workers),
           "-m", str(model_path), "--host", "127.0.0.1", "--port", str(reference.free_port()), "-c", "256", "-ub", "32"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=RPC_TIMEOUT, env=orchestrator_env(),
                          cwd=REPO_ROOT, stdin=subprocess.DEVNULL)
    assert_names_the_shortfall(done, model_path, mem, len(workers))
    assert all(w.alive() for w in workers)
