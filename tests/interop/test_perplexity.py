"""Full-vocabulary logits through the worker must match the CPU backend's (llama-perplexity --kl-divergence)."""
from __future__ import annotations

import ast
import re
import sysconfig
from pathlib import Path

import pytest

from .conftest import CLIENT_THREADS, CPU_TIMEOUT, RPC_TIMEOUT, assert_fully_offloaded

pytestmark = pytest.mark.interop

N_CTX = 128
N_CHUNKS = 6  # KL is scored on the second half of each chunk: 6 * 63 tokens
MIN_SAME_TOP_P = 99.0  # percent
MAX_MEAN_KLD = 1e-3
# the CPU baseline without weight repacking: an RPC worker computes on the plain layout, while the CPU
# backend would repack Q4_0/IQ4_NL/... into its interleaved GEMM layout and round differently
CPU_ONLY = ["-ngl", 0, "--no-repack"]

# Fallback corpus when the interpreter ships no LICENSE.txt: module docstrings of the stdlib,
# read as text (never imported), so the input is fixed for a given Python version and offline.
DOCSTRING_MODULES = ("argparse", "difflib", "subprocess", "pathlib", "textwrap", "heapq", "bisect",
                     "dataclasses", "functools", "shutil", "tempfile", "contextlib")

SAME_TOP_P_RE = re.compile(r"Same top p\s*:\s*([-\d.]+)\s*±")
MEAN_KLD_RE = re.compile(r"Mean\s+KLD\s*:\s*([-\d.eE+]+)\s*±")


def corpus_text() -> str:
    stdlib = Path(sysconfig.get_path("stdlib"))
    license_file = stdlib / "LICENSE.txt"
    if license_file.is_file() and license_file.stat().st_size > 8000:
        return license_file.read_text(encoding="utf-8", errors="replace")
    docs = []
    for name in DOCSTRING_MODULES:
        source = stdlib / f"{name}.py"
        if source.is_file():
            doc = ast.get_docstring(ast.parse(source.read_text(encoding="utf-8", errors="replace")))
            docs.append(doc or "")
    return "\n\n".join(docs)


def perplexity_args(model_path, text_file, flash_attn: str, cache_type: str) -> list[str]:
    return ["-m", model_path, "-f", text_file, "-c", N_CTX, "-b", N_CTX, "--chunks", N_CHUNKS,
            "-t", CLIENT_THREADS, "-fa", flash_attn, "-ctk", cache_type, "-ctv", cache_type, "-fit", "off", "-lv", 4]


@pytest.fixture(scope="session")
def text_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("perplexity") / "corpus.txt"
    path.write_text(corpus_text(), encoding="utf-8")
    return path


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


def parse_statistic(pattern: re.Pattern, output: str, what: str) -> float:
    match = pattern.search(output)
    assert match, f"no {what!r} line in llama-perplexity output:\n{output[-3000:]}"
    return float(match.group(1))


# a quantized V cache needs flash attention; q8_0 / q4_0 are what `-ctk/-ctv` users pick
@pytest.mark.parametrize("flash_attn,cache_type", [("on", "f16"), ("off", "f16"), ("on", "q8_0"), ("on", "q4_0")])
def test_kl_divergence_against_cpu(llama, model_path, worker, text_file, cpu_logits, flash_attn, cache_type):
    base = cpu_logits(flash_attn, cache_type)
    args = perplexity_args(model_path, text_file, flash_attn, cache_type) + [
        "--rpc", worker.address, "-ngl", 99, "--kl-divergence-base", base, "--kl-divergence"]
    done = llama("llama-perplexity", args, timeout=RPC_TIMEOUT, worker=worker)
    assert_fully_offloaded(done.stderr)

    output = done.stdout + done.stderr
    chunk_rows = re.findall(r"^\s*(\d+)\s+[\d.]+\s*±", done.stdout, flags=re.MULTILINE)
    assert len(chunk_rows) == N_CHUNKS, f"expected {N_CHUNKS} scored chunks, got {len(chunk_rows)}:\n{output[-3000:]}"
    same_top_p = parse_statistic(SAME_TOP_P_RE, output, "Same top p")
    mean_kld = parse_statistic(MEAN_KLD_RE, output, "Mean KLD")
    assert same_top_p >= MIN_SAME_TOP_P, f"Same top p {same_top_p}% < {MIN_SAME_TOP_P}%\n{done.stdout}"
    assert mean_kld <= MAX_MEAN_KLD, f"Mean KLD {mean_kld} > {MAX_MEAN_KLD}\n{done.stdout}"


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
    args = perplexity_args(model, text_file, "on", "f16") + [
        "--rpc", worker.address, "-ngl", 99, "--kl-divergence-base", base, "--kl-divergence"]
    done = llama("llama-perplexity", args, timeout=RPC_TIMEOUT, worker=worker)
    assert_fully_offloaded(done.stderr)
    output = done.stdout + done.stderr
    same_top_p = parse_statistic(SAME_TOP_P_RE, output, "Same top p")
    mean_kld = parse_statistic(MEAN_KLD_RE, output, "Mean KLD")
    print(f"{ftype}: same top p {same_top_p}%, mean KLD {mean_kld}")  # shown by pytest -rP
    assert same_top_p >= MIN_SAME_TOP_P, f"{ftype}: Same top p {same_top_p}% < {MIN_SAME_TOP_P}%\n{done.stdout}"
    assert mean_kld <= MAX_MEAN_KLD, f"{ftype}: Mean KLD {mean_kld} > {MAX_MEAN_KLD}\n{done.stdout}"
