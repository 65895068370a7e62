"""GLM-4.7-Flash's deepseek2 architecture (a random-weight file from tools/make_model.py at small width:
MLA attention with q/kv low-rank projections, a leading dense block, routed experts with exp_probs_b and a
shared expert, sigmoid gating with weight norm and scale, YaRN) through the worker must give llama.cpp's
own CPU text: greedy llama-completion with flash attention on and off, F16 and a quantized KV cache.
Its full-vocabulary logits through the worker, in Q8_0 and in llama-quantize's Q4_K_M mix, are llama.cpp's
worker's (llama-perplexity --kl-divergence at its default batch: the corpus chunks decoded side by side as
sequences of one batch)."""
from __future__ import annotations

import pytest

from .conftest import CLIENT_THREADS, CPU_TIMEOUT, RPC_TIMEOUT, assert_fully_offloaded, text_diff
from .perplexity import CPU_ONLY, assert_kl_matches_cpu, perplexity_args
from .programs import PROMPTS, completion_args

pytestmark = pytest.mark.interop

SHAPE = dict(n_layer=3, n_embd=256, n_head=4, n_ff=128, n_expert=8, n_expert_used=2, rope_scaling="yarn",
             rope_scale=4.0, rope_orig_ctx=1024, rope_yarn_log_mul=0.1)
MAX_MEAN_KLD = 1e-5  # against llama.cpp's worker (issue 32): the same kernels' float orders, not the CPU backend's


@pytest.fixture(scope="module")
def deepseek2_model(model_path, tmp_path_factory):
    from tools.make_model import write_model  # noqa: PLC0415

    return write_model(tmp_path_factory.mktemp("deepseek2") / "deepseek2.gguf", "deepseek2", seed=5,
                       vocab_from=model_path, **SHAPE)


@pytest.mark.parametrize("flash_attn, cache_type", [("on", "f16"), ("off", "f16"), ("on", "q8_0")])
def test_completion_matches_cpu(llama, deepseek2_model, worker, flash_attn, cache_type):
    common = completion_args(deepseek2_model, PROMPTS["fact"], flash_attn) + ["-ctk", cache_type,
                                                                              "-ctv", cache_type]
    expected = llama("llama-completion", common + CPU_ONLY, timeout=CPU_TIMEOUT)
    assert len(set(expected.stdout.split())) >= 6, f"the CPU baseline collapsed: {expected.stdout!r}"
    done = llama("llama-completion", common + ["--rpc", worker.address, "-ngl", 99], timeout=RPC_TIMEOUT,
                 worker=worker)
    assert_fully_offloaded(done.stderr)
    assert done.stdout == expected.stdout, text_diff(expected.stdout, done.stdout)


@pytest.fixture(scope="module")
def deepseek2_q4_k_m(llama, deepseek2_model, tmp_path_factory):
    """The same file through llama-quantize's Q4_K_M mix, as GLM-4.7-Flash Q4_K_M is made: Q4_K, Q5_K and Q6_K
    where the mix wants them, Q5_0 and Q8_0 for the rows too narrow for a 256-wide K-quant block."""
    path = tmp_path_factory.mktemp("deepseek2-q4_k_m") / "deepseek2-Q4_K_M.gguf"
    llama("llama-quantize", ["--allow-requantize", deepseek2_model, path, "Q4_K_M", CLIENT_THREADS],
          timeout=CPU_TIMEOUT)
    return path


@pytest.mark.parametrize("weight_type", ["Q8_0", "Q4_K_M"])
def test_kl_divergence_against_llama_cpp_worker(llama, deepseek2_model, deepseek2_q4_k_m, worker,
                                                reference_worker, text_file, tmp_path, weight_type):
    model = deepseek2_model if weight_type == "Q8_0" else deepseek2_q4_k_m
    base = tmp_path / "reference.kld"
    args = perplexity_args(model, text_file, "on", "f16", batch=[])  # llama-perplexity's default -b and -ub
    done = llama("llama-perplexity", args + ["--rpc", reference_worker.address, "-ngl", 99, "--kl-divergence-base",
                                             base], timeout=RPC_TIMEOUT, worker=reference_worker)
    assert_fully_offloaded(done.stderr)
    assert base.is_file() and base.stat().st_size > 0, f"llama-perplexity wrote no logits to {base}"
    assert_kl_matches_cpu(llama, worker, model, text_file, base, "on", "f16", f"deepseek2 {weight_type}", batch=[],
                          max_mean_kld=MAX_MEAN_KLD)
