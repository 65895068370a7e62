"""A mixture-of-experts model (random-weight qwen3moe from tools/make_model.py: 8 experts, 2 per token)
through the worker must give llama.cpp's own CPU results: greedy llama-completion text with flash
attention on and off, and llama-perplexity's full-vocabulary logits (--kl-divergence).

What MoE adds to the dense archs: the router (an F32 MUL_MAT, SOFT_MAX), ARGSORT for the top-k experts,
GET_ROWS of their probabilities from a 3-D view, SUM_ROWS, CLAMP and DIV to renormalize them, and
MUL_MAT_ID of the 3-D expert weights (gate, up, down), whose rows ggml groups per expert and computes
on a route chosen by the number of rows each expert got: the 190-token prompt in batches of 64 gives
most experts 8 rows or more (ggml's tiled kernel for K-quants) and some fewer (vec_dot), and every
decoded token takes vec_dot.
"""
from __future__ import annotations

import gguf
import pytest


from .conftest import CPU_TIMEOUT, RPC_TIMEOUT, assert_fully_offloaded, text_diff
from .perplexity import CPU_ONLY, assert_kl_matches_cpu, perplexity_args
from .programs import PROMPTS, completion_args

pytestmark = pytest.mark.interop

MOE = dict(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_ff=256, n_expert=8, n_expert_used=2)
WEIGHT_TYPES = ("Q8_0", "Q4_K", "F16")


def test_the_file_has_routed_experts(moe_models):
    reader = gguf.GGUFReader(moe_models("Q4_K"))
    field = lambda key: reader.get_field(key).contents()  # noqa: E731
    assert field("general.architecture") == "qwen3moe"
    assert (field("qwen3moe.expert_count"), field("qwen3moe.expert_used_count")) == (8, 2)
    assert field("qwen3moe.expert_feed_forward_length") == MOE["n_ff"]
    tensors = {t.name: t for t in reader.tensors}
    q4k, f32 = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.F32
    for i in range(MOE["n_layer"]):
        router = tensors[f"blk.{i}.ffn_gate_inp.weight"]
        assert (tuple(int(n) for n in router.shape), router.tensor_type) == ((256, 8), f32)
        for name, shape in (("gate", (256, 256, 8)), ("up", (256, 256, 8)), ("down", (256, 256, 8))):
            t = tensors[f"blk.{i}.ffn_{name}_exps.weight"]
            assert (tuple(int(n) for n in t.shape), t.tensor_type) == (shape, q4k), t.name
        assert f"blk.{i}.ffn_up.weight" not in tensors


@pytest.mark.parametrize("weight_type, flash_attn", [("Q8_0", "on"), ("Q8_0", "off"), ("Q4_K", "on"), ("F16", "off")])
def test_completion_matches_cpu(llama, moe_models, worker, weight_type, flash_attn):
    common = completion_args(moe_models(weight_type), PROMPTS["long"], flash_attn)
    expected = llama("llama-completion", common + CPU_ONLY, timeout=CPU_TIMEOUT)
    assert len(set(expected.stdout.split())) >= 8, f"the CPU baseline collapsed: {expected.stdout!r}"
    done = llama("llama-completion", common + ["--rpc", worker.address, "-ngl", 99], timeout=RPC_TIMEOUT,
                 worker=worker)
    assert_fully_offloaded(done.stderr)
    assert done.stdout == expected.stdout, text_diff(expected.stdout, done.stdout)


@pytest.mark.parametrize("weight_type, flash_attn", [("Q4_K", "off"), ("Q8_0", "on")])
def test_kl_divergence_against_cpu(llama, moe_models, worker, text_file, tmp_path, weight_type, flash_attn):
    model, base = moe_models(weight_type), tmp_path / "cpu.kld"
    llama("llama-perplexity", perplexity_args(model, text_file, flash_attn, "f16") + CPU_ONLY
          + ["--kl-divergence-base", base], timeout=CPU_TIMEOUT)
    assert_kl_matches_cpu(llama, worker, model, text_file, base, flash_attn, "f16",
                          f"qwen3moe {weight_type} fa {flash_attn}")
