"""The worker's limits as llama.cpp's own client meets them: a budget too small for the model makes
llama-completion fail cleanly while another client of the same worker goes on, and --allow admits or
refuses llama-completion by its address (it knows nothing of our extensions)."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from orchestrator.pipeline.client import RpcClient
from wire import protocol as p
from wire.protocol import Command

from .conftest import CLIENT_THREADS, REPO_ROOT, RPC_TIMEOUT, assert_fully_offloaded, reference

pytestmark = pytest.mark.interop
N_PREDICT = 4


def completion(bin_dir, model_path, worker) -> list[str]:
    return [str(bin_dir / "llama-completion"), "-m", str(model_path), "-p", "The capital of France is",
            "-n", str(N_PREDICT), "--ignore-eos", "--temp", "0", "-s", "1", "-no-cnv", "--no-display-prompt",
            "-t", str(CLIENT_THREADS), "-c", "256", "-fit", "off", "-lv", "4", "--rpc", worker.address, "-ngl", "99"]


def run(cmd) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, errors="replace",
                          timeout=RPC_TIMEOUT, env=reference.llama_env())


def start(tmp_path, *flags, mem_mib=None, warm=False):
    extra = flags if warm else ("--no-warmup", *flags)
    return reference.start_worker("ours", tmp_path, threads=CLIENT_THREADS, mem_mib=mem_mib, extra=extra)


def test_a_budget_too_small_for_the_model_fails_the_client_cleanly_and_spares_the_others(bin_dir, model_path,
                                                                                         tmp_path):
    with start(tmp_path, mem_mib=16) as worker:
        other = RpcClient(worker.address, timeout=120)
        r = p.AllocBufferResponse.decode(other.call(Command.ALLOC_BUFFER, p.AllocBufferRequest(0, 1 << 20)))
        base = p.U64Response.decode(other.call(Command.BUFFER_GET_BASE, p.BufferRequest(r.remote_ptr))).value
        ne = (1 << 18, 1, 1, 1)
        t = p.RpcTensor(id=1, type=0, buffer=r.remote_ptr, ne=ne, nb=(4, 1 << 20, 1 << 20, 1 << 20), op=0,
                        op_params=bytes(64), src=(), view_src=0, view_offs=0, data=base, name="x", flags=0)
        data = np.arange(1 << 18, dtype=np.float32)
        other.set_tensor(t, data.tobytes())

        done = run(completion(bin_dir, model_path, worker))
        assert done.returncode != 0, f"the model fit in 16 MiB?\n{done.stderr[-3000:]}"
        # It says why, as for a full device; but llama.cpp's log thread may lose its last lines when the
        # client exits (common_log_main() is never flushed), so the worker's own log is what we check.
        assert worker.alive(), worker.describe()
        assert "do not fit; replying with a null buffer" in worker.log_tail(), worker.describe()
        assert "Traceback" not in worker.log_tail()
        assert other.get_tensor(t, data.nbytes) == data.tobytes()  # the other client's memory is intact
        assert other.device_memory() == (15 << 20, 16 << 20)  # the failed client's buffers are all freed


def test_allow_refuses_llama_completion_from_elsewhere_and_admits_it_when_listed(bin_dir, model_path, tmp_path,
                                                                                cpu_text):
    with start(tmp_path / "refusing", "--allow", "127.0.0.2,10.0.0.0/8,::1") as worker:
        done = run(completion(bin_dir, model_path, worker))
        assert done.returncode != 0
        assert worker.alive(), worker.describe()
        assert "refused: address not in --allow" in worker.log_tail()
    with start(tmp_path / "admitting", "--allow", "10.0.0.0/8,127.0.0.1", warm=True) as worker:
        args = completion(bin_dir, model_path, worker)
        done = run(args)
        assert done.returncode == 0, worker.describe() + done.stderr[-3000:]
        assert_fully_offloaded(done.stderr)
        assert done.stdout == cpu_text(args[1:args.index("--rpc")] + ["-ngl", "0"])
        assert "refused" not in worker.log_tail()


def test_a_keyed_worker_serves_our_orchestrator_with_the_key_and_refuses_llama_completion(bin_dir, model_path,
                                                                                          tmp_path):
    key = tmp_path / "key"
    key.write_text(os.urandom(32).hex())
    with start(tmp_path, "--key-file", str(key), warm=True) as worker:
        done = run(completion(bin_dir, model_path, worker))  # llama.cpp cannot answer the challenge
        assert done.returncode != 0
        assert "not authenticated" in worker.log_tail()
        assert worker.alive(), worker.describe()

        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        orchestrator = [sys.executable, "-m", "orchestrator", "--rpc", worker.address, "-m", str(model_path),
                        "-p", "The capital of France is", "-n", str(N_PREDICT), "--temp", "0", "--no-warmup"]
        without = subprocess.run(orchestrator, capture_output=True, text=True, timeout=RPC_TIMEOUT, env=env,
                                 cwd=REPO_ROOT, stdin=subprocess.DEVNULL)
        assert without.returncode != 0 and "Traceback" not in without.stderr, without.stderr[-3000:]
        with_key = subprocess.run([*orchestrator, "--rpc-key-file", str(key)], capture_output=True, text=True,
                                  timeout=RPC_TIMEOUT, env=env, cwd=REPO_ROOT, stdin=subprocess.DEVNULL)
        assert with_key.returncode == 0, with_key.stderr[-3000:] + worker.describe()
        assert with_key.stdout.startswith("The capital of France is") and len(with_key.stdout) > 24
        assert worker.alive(), worker.describe()
