"""llama-perplexity --kl-divergence through a worker against the CPU backend's logits: the corpus, the
arguments, and the one check every KL test makes (not a test module itself)."""
from __future__ import annotations

import ast
import re
import subprocess
import sysconfig
from pathlib import Path

from .conftest import CLIENT_THREADS, RPC_TIMEOUT, assert_fully_offloaded

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


def perplexity_args(model_path, text_file, flash_attn: str, cache_type: str, n_ctx: int = N_CTX,
                    batch: list | None = None, chunks: int = N_CHUNKS) -> list[str]:
    """`batch` replaces the default "-b n_ctx" (one chunk per batch); [] leaves llama.cpp's defaults."""
    batch = ["-b", n_ctx] if batch is None else batch
    return ["-m", model_path, "-f", text_file, "-c", n_ctx, *batch, "--chunks", chunks,
            "-t", CLIENT_THREADS, "-fa", flash_attn, "-ctk", cache_type, "-ctv", cache_type, "-fit", "off", "-lv", 4]


def parse_statistic(pattern: re.Pattern, output: str, what: str) -> float:
    match = pattern.search(output)
    assert match, f"no {what!r} line in llama-perplexity output:\n{output[-3000:]}"
    return float(match.group(1))


def assert_kl_matches_cpu(llama, worker, model_path, text_file, base: Path, flash_attn: str, cache_type: str,
                          label: str, n_ctx: int = N_CTX, batch: list | None = None,
                          max_mean_kld: float = MAX_MEAN_KLD) -> subprocess.CompletedProcess:
    """Run llama-perplexity through `worker` against the logits in `base` (the CPU backend's, or another
    worker's); the same top token and the mean KL-divergence must meet the thresholds (printed too:
    pytest -rP shows them)."""
    args = perplexity_args(model_path, text_file, flash_attn, cache_type, n_ctx, batch) + [
        "--rpc", worker.address, "-ngl", 99, "--kl-divergence-base", base, "--kl-divergence"]
    done = llama("llama-perplexity", args, timeout=RPC_TIMEOUT, worker=worker)
    assert_fully_offloaded(done.stderr)
    output = done.stdout + done.stderr
    chunk_rows = re.findall(r"^\s*(\d+)\s+[\d.]+\s*±", done.stdout, flags=re.MULTILINE)
    assert len(chunk_rows) == N_CHUNKS, f"expected {N_CHUNKS} scored chunks, got {len(chunk_rows)}:\n{output[-3000:]}"
    same_top_p = parse_statistic(SAME_TOP_P_RE, output, "Same top p")
    mean_kld = parse_statistic(MEAN_KLD_RE, output, "Mean KLD")
    print(f"{label}: same top p {same_top_p}%, mean KLD {mean_kld}")
    assert same_top_p >= MIN_SAME_TOP_P, f"{label}: Same top p {same_top_p}% < {MIN_SAME_TOP_P}%\n{done.stdout}"
    assert mean_kld <= max_mean_kld, f"{label}: Mean KLD {mean_kld} > {max_mean_kld}\n{done.stdout}"
    return done
