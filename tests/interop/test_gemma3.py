"""Gemma 3 270M (Q4_K_M) through the worker must give llama.cpp's own CPU results: full-vocabulary logits
(llama-perplexity --kl-divergence) and greedy text (llama-completion), the latter also past the 512-token
sliding window that five of every six Gemma 3 layers attend over.

Gemma 3 adds to what SmolLM2 exercises: embeddings scaled by sqrt(n_embd) (SCALE), Q/K RMS norms, NEOX
rope with head size 256, one KV head for four query heads, GEGLU feed-forward, post-attention and
post-FFN norms, and K-quant (Q4_K, Q6_K) beside Q5_0/Q8_0 weights.
"""
from __future__ import annotations

import pytest

from .conftest import CPU_TIMEOUT, RPC_TIMEOUT, assert_fully_offloaded, text_diff
from .perplexity import CPU_ONLY, assert_kl_matches_cpu, perplexity_args
from .programs import PROMPT_EVAL_RE, completion_args, long_prompt

pytestmark = pytest.mark.interop

SLIDING_WINDOW = 512  # gemma3.attention.sliding_window in this GGUF


@pytest.mark.parametrize("flash_attn", ["on", "off"])
def test_kl_divergence_against_cpu(llama, gemma3_path, worker, text_file, tmp_path, flash_attn):
    base = tmp_path / "cpu.kld"  # ~200 MB of logits (262k vocabulary): one file at a time
    llama("llama-perplexity", perplexity_args(gemma3_path, text_file, flash_attn, "f16") + CPU_ONLY
          + ["--kl-divergence-base", base], timeout=CPU_TIMEOUT)
    assert_kl_matches_cpu(llama, worker, gemma3_path, text_file, base, flash_attn, "f16", f"gemma3 fa {flash_attn}")


PROMPTS = {"short": lambda: "The capital of France is", "past-window": long_prompt}


@pytest.mark.parametrize("prompt_id", list(PROMPTS))
def test_completion_matches_cpu(llama, gemma3_path, worker, prompt_id):
    prompt = PROMPTS[prompt_id]()
    # -c 1024: room for the long prompt; the SWA layers' cache is then smaller than the context
    common = completion_args(gemma3_path, prompt, "on") + ["-c", 1024]
    expected = llama("llama-completion", common + CPU_ONLY, timeout=CPU_TIMEOUT)
    assert expected.stdout.strip(), "the CPU baseline produced no text"
    if prompt_id == "past-window":
        n_prompt = int(PROMPT_EVAL_RE.search(expected.stderr).group(1))
        assert n_prompt > SLIDING_WINDOW + 64, f"prompt of {n_prompt} tokens does not pass the sliding window"

    done = llama("llama-completion", common + ["--rpc", worker.address, "-ngl", 99], timeout=RPC_TIMEOUT,
                 worker=worker)
    assert_fully_offloaded(done.stderr)
    assert done.stdout == expected.stdout, text_diff(expected.stdout, done.stdout)
