"""Full-vocabulary logits through the worker must match the CPU backend's (llama-perplexity --kl-divergence)."""
from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import CLIENT_THREADS, CPU_TIMEOUT
from .perplexity import CPU_ONLY, assert_kl_matches_cpu, perplexity_args

pytestmark = pytest.mark.interop


@pytest.fixture(scope="session")
def cpu_logits(llama, model_path, text_file, tmp_path_factory):
    """CPU-backend logits saved with --kl-divergence-base, once per (flash-attn, KV cache type)."""
    cache: dict[tuple[str, str], Path] = {}

    def base(flash_attn: str, cache_type: str) -> Path:
        key = (flash_attn, cache_type)
        if key not in cache:
            path = tmp_path_factory.mktemp("perplexity") / f"cpu-fa-{flash_attn}-{cache_type}.kld"
            args = perplexity_args(model_path, text_file, *key) + CPU_ONLY + ["--kl-divergence-base", path]
            llama("llama-perplexity", args, timeout=CPU_TIMEOUT)
            assert path.is_file() and path.stat().st_size > 0, f"llama-perplexity wrote no logits to {path}"
            cache[key] = path
        return cache[key]

    return base


# a quantized V cache needs flash attention; q8_0 / q4_0 are what `-ctk/-ctv` users pick
@pytest.mark.parametrize("flash_attn,cache_type", [("on", "f16"), ("off", "f16"), ("on", "q8_0"), ("on", "q4_0")])
def test_kl_divergence_against_cpu(llama, model_path, worker, text_file, cpu_logits, flash_attn, cache_type):
    assert_kl_matches_cpu(llama, worker, model_path, text_file, cpu_logits(flash_attn, cache_type), flash_attn,
                          cache_type, f"SmolLM2 Q4_1, fa {flash_attn}, KV {cache_type}")


# SmolLM2 requantized by llama.cpp's own llama-quantize into every weight type issue 4 names
REQUANT_TYPES = ["Q8_0", "Q4_0", "Q5_0", "Q5_1", "Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_NL",
                 "IQ4_XS", "F16", "BF16"]


@pytest.fixture(scope="session")
def requantized(llama, model_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("requantized")
    cache: dict[str, Path] = {}

    def make(ftype: str) -> Path:
        if ftype not in cache:
            path = folder / f"smollm2-{ftype}.gguf"
            llama("llama-quantize", ["--allow-requantize", model_path, path, ftype, CLIENT_THREADS], timeout=CPU_TIMEOUT)
            cache[ftype] = path
        return cache[ftype]

    return make


@pytest.mark.parametrize("ftype", REQUANT_TYPES)
def test_kl_divergence_of_requantized_models(llama, requantized, worker, text_file, tmp_path, ftype):
    model = requantized(ftype)
    base = tmp_path / "cpu.kld"
    llama("llama-perplexity", perplexity_args(model, text_file, "on", "f16") + CPU_ONLY + ["--kl-divergence-base", base],
          timeout=CPU_TIMEOUT)
    assert_kl_matches_cpu(llama, worker, model, text_file, base, "on", "f16", ftype)
