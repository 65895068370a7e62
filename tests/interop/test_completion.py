"""Greedy text from llama-completion through the worker must equal llama.cpp's own CPU backend, byte for byte."""
from __future__ import annotations

import pytest

from .conftest import CPU_TIMEOUT, RPC_TIMEOUT, assert_fully_offloaded, text_diff
from .programs import PROMPTS, completion_args

pytestmark = pytest.mark.interop


@pytest.fixture(scope="session")
def cpu_completion(llama, model_path):
    """Baseline text from the CPU backend, computed at most once per (prompt, flash-attn) per session."""
    cache: dict[tuple[str, str], str] = {}

    def baseline(prompt_id: str, flash_attn: str) -> str:
        key = (prompt_id, flash_attn)
        if key not in cache:
            args = completion_args(model_path, PROMPTS[prompt_id], flash_attn) + ["-ngl", 0]
            cache[key] = llama("llama-completion", args, timeout=CPU_TIMEOUT).stdout
        return cache[key]

    return baseline


@pytest.mark.parametrize("flash_attn", ["on", "off"])
@pytest.mark.parametrize("prompt_id", list(PROMPTS))
def test_completion_matches_cpu(llama, model_path, worker, cpu_completion, prompt_id, flash_attn):
    expected = cpu_completion(prompt_id, flash_attn)
    assert expected.strip(), "the CPU baseline produced no text"

    args = completion_args(model_path, PROMPTS[prompt_id], flash_attn) + ["--rpc", worker.address, "-ngl", 99]
    done = llama("llama-completion", args, timeout=RPC_TIMEOUT, worker=worker)
    assert_fully_offloaded(done.stderr)
    assert done.stdout == expected, text_diff(expected, done.stdout)
