"""GLM-4.7-Flash's deepseek2 architecture (a random-weight file from tools/make_model.py at small width:
MLA attention with q/kv low-rank projections, a leading dense block, routed experts with exp_probs_b and a
shared expert, sigmoid gating with weight norm and scale, YaRN) through the worker must give llama.cpp's
own CPU text: greedy llama-completion with flash attention on and off, F16 and a quantized KV cache."""
from __future__ import annotations

import pytest

from .conftest import CPU_TIMEOUT, RPC_TIMEOUT, assert_fully_offloaded, text_diff
from .perplexity import CPU_ONLY
from .programs import PROMPTS, completion_args

pytestmark = pytest.mark.interop

SHAPE = dict(n_layer=3, n_embd=256, n_head=4, n_ff=128, n_expert=8, n_expert_used=2, rope_scaling="yarn",
             rope_scale=4.0, rope_orig_ctx=1024, rope_yarn_log_mul=0.1)


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
