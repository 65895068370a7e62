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


# -ctk/-ctv: SET_ROWS quantizes each new K/V row into the cache (after llama.cpp's Hadamard rotation) and
# flash attention reads it back; every type llama.cpp's CPU backend takes for both K and V, and each side alone
KV_CACHES = [(t, t) for t in ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl")] + [("q4_0", "f16"), ("f16", "q5_0")]


@pytest.mark.parametrize("cache_k,cache_v", KV_CACHES)
def test_quantized_kv_cache_matches_cpu(llama, model_path, worker, cache_k, cache_v):
    args = completion_args(model_path, PROMPTS["list"], "on") + ["-ctk", cache_k, "-ctv", cache_v]
    expected = llama("llama-completion", [*args, "-ngl", 0], timeout=CPU_TIMEOUT).stdout
    assert expected.strip(), "the CPU baseline produced no text"
    done = llama("llama-completion", [*args, "--rpc", worker.address, "-ngl", 99], timeout=RPC_TIMEOUT, worker=worker)
    assert_fully_offloaded(done.stderr)
    assert done.stdout == expected, text_diff(expected, done.stdout)
