"""Weights from the worker's own disk (rpc-server --gguf-dir, protocol_spec.md §8.3) with the packaged
SmolLM2: our orchestrator reads them from the worker's copy and writes llama-completion's text, and
llama.cpp's client, which never asks for the feature, is served by that worker as by any other."""
from __future__ import annotations

import os
import shutil

import pytest

from .conftest import CLIENT_THREADS, RPC_TIMEOUT, text_diff
from .programs import PROMPTS, run_orchestrator, start_workers, stop_workers

pytestmark = pytest.mark.interop

N_PREDICT = 24


@pytest.fixture(scope="module")
def holder(bin_dir, model_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf-dir")
    try:  # the same file without a second copy (a symbolic link would not be offered)
        os.link(model_path, folder / model_path.name)
    except OSError:
        shutil.copy(model_path, folder / model_path.name)
    workers = start_workers(("ours",), tmp_path_factory.mktemp("gguf-dir-logs"),
                            extra={0: ("--gguf-dir", str(folder))})
    yield workers[0]
    stop_workers(workers)


def test_smollm2_from_the_workers_disk_and_llama_cpp_unchanged(holder, model_path, cpu_text, llama):
    args = ["-m", model_path, "-p", PROMPTS["fact"], "-n", N_PREDICT, "--temp", 0, "--ignore-eos"]
    expected = cpu_text(args)
    ours = run_orchestrator(["--rpc", holder.address, *args], [holder])
    assert "MiB of them read from the workers' disks" in ours.stderr, ours.stderr[-3000:]
    assert ours.stdout == expected, text_diff(expected, ours.stdout, "llama-completion", "from disk")
    theirs = llama("llama-completion", [*args, "--rpc", holder.address, "-ngl", 99, "-no-cnv", "-t", CLIENT_THREADS,
                                        "-fit", "off"], timeout=RPC_TIMEOUT, worker=holder)
    assert theirs.stdout == expected, text_diff(expected, theirs.stdout, "llama-completion", "llama.cpp via rpc")
    assert holder.alive()
