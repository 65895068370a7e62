"""Our orchestrator against llama.cpp: the same text as llama-completion on its own CPU backend.

The orchestrator runs on two workers: two of llama.cpp's ggml-rpc-server, two of ours, and one of
each. The models: SmolLM2 (llama architecture) and random-weight qwen2/qwen3 files written by
tools/make_model.py. Placement is checked against llama.cpp's own layer assignment log.
"""
from __future__ import annotations

import re

import pytest

from .conftest import CLIENT_THREADS, CPU_TIMEOUT, RPC_TIMEOUT, text_diff
from .programs import PROMPTS, run_orchestrator, start_workers, stop_workers

pytestmark = pytest.mark.interop

N_PREDICT = 64
WORKER_SETS = {"reference+reference": ("reference", "reference"), "ours+ours": ("ours", "ours"),
               "ours+reference": ("ours", "reference")}


@pytest.fixture(scope="module", params=list(WORKER_SETS))
def worker_pair(request, bin_dir, tmp_path_factory):
    workers = start_workers(WORKER_SETS[request.param], tmp_path_factory.mktemp(request.param))
    yield workers
    stop_workers(workers)


def generation_args(model, prompt_id: str) -> list:
    args = ["-m", model, "-p", PROMPTS[prompt_id], "-n", N_PREDICT, "--temp", 0, "--ignore-eos"]
    return args + (["-b", 64] if prompt_id == "long" else [])


@pytest.mark.parametrize("prompt_id", list(PROMPTS))
def test_same_text_as_llama_completion(model_path, worker_pair, cpu_text, prompt_id):
    args = generation_args(model_path, prompt_id)
    expected = cpu_text(args)
    assert expected.strip(), "llama-completion produced no text"
    done = run_orchestrator(["--rpc", ",".join(w.address for w in worker_pair), *args], worker_pair)
    assert done.stdout == expected, text_diff(expected, done.stdout, "llama-completion", "orchestrator")


def test_seeded_sampling_like_llama_completion(model_path, worker_pair, cpu_text):
    """Same logits bit for bit and the same sampler chain and RNG: the same random text for a seed."""
    args = ["-m", model_path, "-p", PROMPTS["fact"], "-n", N_PREDICT, "--temp", 0.9, "--seed", 1234,
            "--repeat-penalty", 1.1, "--top-k", 50]
    expected = cpu_text(args)
    done = run_orchestrator(["--rpc", ",".join(w.address for w in worker_pair), *args], worker_pair)
    assert done.stdout == expected, text_diff(expected, done.stdout, "llama-completion", "orchestrator")


def test_logit_bias_like_llama_completion(model_path, worker_pair, cpu_text):
    """-l/--logit-bias as llama-completion reads it: 7042 (" Paris") banned, 3575 (" capital") lifted,
    one token given twice; with presence and frequency penalties."""
    plain = cpu_text(["-m", model_path, "-p", PROMPTS["fact"], "-n", 16, "--temp", 0])
    args = ["-m", model_path, "-p", PROMPTS["fact"], "-n", 16, "--temp", 0, "-l", "7042-inf", "-l", "3575+2.5",
            "--logit-bias", "3575-0.75", "-ngl", 99, "--presence-penalty", 0.6, "--frequency-penalty", 0.4]
    expected = cpu_text(args)
    assert expected != plain, "the biases changed nothing: the test cannot see them"
    done = run_orchestrator(["--rpc", ",".join(w.address for w in worker_pair), *args], worker_pair)
    assert done.stdout == expected, text_diff(expected, done.stdout, "llama-completion", "orchestrator")


# -- other architectures -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mixed_pair(bin_dir, tmp_path_factory):
    workers = start_workers(("ours", "reference"), tmp_path_factory.mktemp("mixed"))
    yield workers
    stop_workers(workers)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_synthetic_architecture(model_path, mixed_pair, cpu_text, tmp_path, arch):
    from tools.make_model import write_model  # noqa: PLC0415

    model = write_model(tmp_path / f"{arch}.gguf", arch, vocab_from=model_path, seed=3)
    args = ["-m", model, "-p", PROMPTS["list"], "-n", N_PREDICT, "--temp", 0, "--ignore-eos"]
    expected = cpu_text(args)
    done = run_orchestrator(["--rpc", ",".join(w.address for w in mixed_pair), *args], mixed_pair)
    assert f"({arch}," in done.stderr
    assert done.stdout == expected, text_diff(expected, done.stdout, "llama-completion", "orchestrator")


def test_quantized_kv_cache(model_path, mixed_pair, cpu_text):
    """-ctk/-ctv q8_0: SET_ROWS quantizes each new K and V row into the cache, flash attention reads them, and
    Q, K, V and the attention output go through llama.cpp's Hadamard rotation (head size 64)."""
    args = ["-m", model_path, "-p", PROMPTS["list"], "-n", N_PREDICT, "--temp", 0, "--ignore-eos", "-ctk", "q8_0",
            "-ctv", "q8_0"]
    expected = cpu_text(args)
    done = run_orchestrator(["--rpc", ",".join(w.address for w in mixed_pair), *args], mixed_pair)
    assert done.stdout == expected, text_diff(expected, done.stdout, "llama-completion", "orchestrator")


# -- placement -------------------------------------------------------------------------------------------

LLAMA_ASSIGN_RE = re.compile(r"layer\s+(\d+) assigned to device RPC(\d+)")
OUR_PLAN_RE = re.compile(r"^\s*(\S+): layers\s+(\d+)-\s*(\d+)( \+ output)?", re.M)


def llama_assignment(stderr: str) -> dict[int, int]:
    return {int(layer): int(dev) for layer, dev in LLAMA_ASSIGN_RE.findall(stderr)}


def our_assignment(stderr: str, endpoints: list[str]) -> dict[int, int]:
    owner = {}
    for endpoint, first, last, output in OUR_PLAN_RE.findall(stderr):
        for il in range(int(first), int(last) + 1):
            owner[il] = endpoints.index(endpoint)
        if output:
            owner[int(last) + 1] = endpoints.index(endpoint)
    return owner


@pytest.fixture(scope="module")
def unequal_pair(bin_dir, tmp_path_factory):
    workers = start_workers(("ours", "ours"), tmp_path_factory.mktemp("unequal"), mem_mib=(300, 900))
    yield workers
    stop_workers(workers)


@pytest.mark.parametrize("split", [None, "1,3", "2,1"])
def test_layers_split_like_llama_cpp(llama, model_path, unequal_pair, split):
    """Layers in proportion to free memory (300 vs 900 MiB) or to --tensor-split, exactly as llama.cpp assigns them."""
    endpoints = [w.address for w in unequal_pair]
    extra = ["-ts", split] if split else []
    common = ["-m", model_path, "-p", "Hi", "-n", 1, "--rpc", ",".join(endpoints), *extra]
    theirs = llama("llama-completion", [*common, "-no-cnv", "-t", CLIENT_THREADS, "-fit", "off", "-ngl", 99, "-v"],
                   timeout=RPC_TIMEOUT, worker=unequal_pair[0])
    expected = llama_assignment(theirs.stderr)
    assert len(expected) == 31, theirs.stderr[-2000:]
    ours = our_assignment(run_orchestrator(common, unequal_pair).stderr, endpoints)
    assert ours == expected
    if split is None:
        assert sum(1 for d in expected.values() if d == 1) > sum(1 for d in expected.values() if d == 0)


# -- an ordinary K-quant file ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def q4_k_m_model(llama, model_path, tmp_path_factory):
    """A llama whose width is a multiple of 256, quantized by llama-quantize to Q4_K_M as downloaded files
    are: its tied token_embd becomes Q6_K, its layers Q4_K with Q6_K ffn_down/attn_v."""
    from tools.make_model import write_model  # noqa: PLC0415

    folder = tmp_path_factory.mktemp("q4_k_m")
    source = write_model(folder / "f16.gguf", "llama", vocab_from=model_path, seed=5, weight_type="F16",
                         n_embd=512, n_ff=1024, n_head=8, n_head_kv=4)
    quantized = folder / "q4_k_m.gguf"
    llama("llama-quantize", [source, quantized, "Q4_K_M"], timeout=CPU_TIMEOUT)
    return quantized


def test_q4_k_m_file_with_a_k_quant_embedding(q4_k_m_model, mixed_pair, cpu_text):
    import gguf  # noqa: PLC0415

    types = {t.name: t.tensor_type for t in gguf.GGUFReader(q4_k_m_model).tensors}
    assert types["token_embd.weight"] == gguf.GGMLQuantizationType.Q6_K
    assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.Q4_K
    args = ["-m", q4_k_m_model, "-p", PROMPTS["list"], "-n", 32, "--temp", 0, "--ignore-eos"]
    # --no-repack: the CPU backend computes on the file's layout, as every RPC worker does
    expected = cpu_text([*args, "--no-repack"])
    done = run_orchestrator(["--rpc", ",".join(w.address for w in mixed_pair), *args], mixed_pair)
    assert done.stdout == expected, text_diff(expected, done.stdout, "llama-completion", "orchestrator")
