"""Our orchestrator builds deepseek2 graphs with multi-head latent attention (GLM-4.7-Flash's architecture):
the same greedy text as llama-completion on its CPU backend.

A random-weight deepseek2 from tools/make_model.py in GLM-4.7-Flash's shape at small width (MlaShape:
q_lora 96, kv_lora 64, six key heads of 64 + 32 roped over a width of 256, which six does not divide, as
GLM-4.7-Flash's 20 do not divide 2048; value heads 64; a leading dense block, then 8 routed
experts of which 2 per token plus a shared one, sigmoid gating with exp_probs_b, norm and scale 1.8; YaRN
with the log multiplier; one MTP block after the three trunk blocks, which decoding skips), over one and two of our workers (and llama.cpp's ggml-rpc-server beside one) with flash attention on
and off, an F16 and a Q8_0 KV cache.
The ~190-token prompt runs in ubatches of 64. The plan's KV cache is llama.cpp's: one latent row of
kv_lora + rope values per token and layer, no V cache (llama.cpp's log of its own cache is the oracle).
The decode step's graph is llama.cpp's: the same compute nodes (op, shape, type, op_params, sources'
shapes and strides; the order aside) as llama-completion sends a worker, traced through
tools/trace_proxy.py. --context-shift ropes the latent rows' last n_rot values on the worker, as llama.cpp.
`orchestrator serve` decodes two prompts in one batch (one stream per sequence). A file with fused
ffn_gate_up_exps gives llama.cpp's decode graph and text.
"""
from __future__ import annotations

import re

import pytest

from orchestrator.graph.ggml import new_tensor
from orchestrator.graph.llama import Shape
from orchestrator.graph.model import ModelFile
from orchestrator.pipeline.stage import BUILDERS
from tools.trace_proxy import TraceProxy, describe_graph
from wire import protocol as p
from wire.ggml import GGMLType

from .conftest import CLIENT_THREADS, CPU_TIMEOUT, RPC_TIMEOUT, text_diff
from .programs import PROMPTS, run_orchestrator, serve_greedy, start_workers, stop_workers

pytestmark = pytest.mark.interop

N_PREDICT = 32
N_SERVE = 16
SHAPE = dict(n_layer=3, n_embd=256, n_head=6, head_dim=64, n_ff=128, n_expert=8, n_expert_used=2, rope_scaling="yarn",
             rope_scale=4.0, rope_orig_ctx=1024, rope_yarn_log_mul=0.1)
CASES = {  # (workers, flash attention, KV cache type)
    "ours-fa-on": (("ours",), "on", "f16"),
    "ours+ours-fa-off": (("ours", "ours"), "off", "f16"),
    "ours-fa-on-q8_0": (("ours",), "on", "q8_0"),
    "reference+ours-fa-on": (("reference", "ours"), "on", "f16"),  # our graph on llama.cpp's ggml-rpc-server too
}


@pytest.fixture(scope="module")
def deepseek2_model(model_path, tmp_path_factory):
    from tools.make_model import MlaShape, write_model  # noqa: PLC0415

    # one multi-token-prediction block after the trunk, as GLM-4.7-Flash's files have: not run by decoding
    return write_model(tmp_path_factory.mktemp("deepseek2") / "deepseek2.gguf", "deepseek2", seed=5,
                       vocab_from=model_path, mla=MlaShape(n_nextn=1), **SHAPE)


@pytest.fixture(scope="module")
def fused_model(model_path, tmp_path_factory):
    """The same shape with each layer's routed gate and up fused into one ffn_gate_up_exps (as llama.cpp's
    create_tensor_gate_up_exps reads it for deepseek2)."""
    from tools.make_model import MlaShape, write_model  # noqa: PLC0415

    return write_model(tmp_path_factory.mktemp("deepseek2-fused") / "fused.gguf", "deepseek2", seed=6,
                       vocab_from=model_path, mla=MlaShape(fused_gate_up_exps=True), **SHAPE)


def generation_args(model, prompt: str, flash_attn: str, cache_type: str = "f16") -> list:
    return ["-m", model, "-p", prompt, "-n", N_PREDICT, "--temp", 0, "--ignore-eos", "-fa", flash_attn,
            "-c", 512, "-b", 64, "-ub", 64, "-ctk", cache_type, "-ctv", cache_type]


@pytest.fixture(scope="module", params=list(CASES))
def case(request, bin_dir, tmp_path_factory):
    kinds, flash_attn, cache_type = CASES[request.param]
    workers = start_workers(kinds, tmp_path_factory.mktemp(request.param))
    yield workers, flash_attn, cache_type
    stop_workers(workers)


def test_same_text_as_llama_completion(llama, deepseek2_model, case, cpu_text):
    workers, flash_attn, cache_type = case
    args = generation_args(deepseek2_model, PROMPTS["long"], flash_attn, cache_type)
    # --no-repack: the CPU backend computes on the file's layout, as every RPC worker does
    expected = cpu_text([*args, "-ngl", 0, "--no-repack"])
    assert len(set(expected.split())) >= 8, f"the CPU baseline collapsed: {expected!r}"
    done = run_orchestrator(["--rpc", ",".join(w.address for w in workers), *args], workers)
    assert "(deepseek2," in done.stderr
    if len(workers) > 1 and all(w.kind == "ours" for w in workers):
        assert "ring: on" in done.stderr
    assert done.stdout == expected, text_diff(expected, done.stdout, "llama-completion", "orchestrator")

    # the KV cache: llama.cpp's is K only (V 0 MiB; its log says so with -v), and our plan gives the
    # workers together as much
    log = llama("llama-completion", ["-m", deepseek2_model, "-p", "Hi", "-n", 1, "-c", 512, "-ngl", 0, "-no-cnv",
                                     "-fa", flash_attn, "-ctk", cache_type, "-ctv", cache_type, "-t", CLIENT_THREADS,
                                     "-v"], timeout=CPU_TIMEOUT).stderr
    cache = re.search(r"llama_kv_cache: size = +([\d.]+) MiB .*K \(\w+\): +([\d.]+) MiB, V \(\w+\): +([\d.]+) MiB", log)
    assert cache, log[-2000:]
    theirs, k, v = map(float, cache.groups())
    assert v == 0.0 and k == theirs > 0
    ours = sum(float(x) for x in re.findall(r"KV +([\d.]+) MiB", done.stderr))
    assert abs(ours - theirs) < 0.05 * len(workers), (theirs, done.stderr)


VIEWS = {"VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE", "NONE"}


def _compute_nodes(described: list) -> list:
    """A graph's compute nodes without their names, in a fixed order (llama.cpp expands Q, V and K before
    storing K; the worker's results do not depend on the order of independent nodes)."""
    return sorted(repr(n[:1] + n[2:]) for n in described if n[0] not in VIEWS and not _mixed_embd(n))


def _mixed_embd(node: list) -> bool:
    """build_inp_embd's mixed-batch branch (ggml_dup of inp_mixed_embd, SET_ROWS of token rows into it):
    llama.cpp adds it to every graph but selects it only for batches mixing tokens and embeddings."""
    return node[0] in ("DUP", "SET_ROWS") and node[3] == "F32"


def _our_graph(model_path: str, n_kv: int, flash_attn: bool) -> list:
    model = ModelFile(model_path)
    hp = model.hparams
    names = [n for il in range(hp.n_layer) for n in model.layer_tensor_names(il).values()]
    weights = {n: new_tensor(model.weights[n].type, model.weights[n].ne, n)
               for n in [*names, *model.output_tensor_names().values()]}
    kv = {il: (new_tensor(GGMLType.F16, (hp.n_embd_k_gqa, 512), f"cache_k_l{il}"), None) for il in range(hp.n_layer)}
    sg = BUILDERS[hp.arch](hp, weights, kv, flash_attn).build(range(hp.n_layer + 1), Shape(1, n_kv, 1))
    nodes, tensors = sg.graph.serialize()
    return describe_graph(p.GraphComputeRequest(0, nodes, tensors))


@pytest.mark.parametrize("flash_attn", ["on", "off"])
def test_decode_graph_is_llama_cpps(llama, deepseek2_model, flash_attn, tmp_path):
    workers = start_workers(("reference",), tmp_path)
    try:
        with TraceProxy(workers[0].address) as proxy:
            llama("llama-completion", ["-m", deepseek2_model, "-p", PROMPTS["fact"], "-n", 2, "--temp", 0,
                                       "--ignore-eos", "-no-cnv", "-t", CLIENT_THREADS, "-c", 512, "-fa", flash_attn,
                                       "-fit", "off", "-ngl", 99, "--rpc", proxy.address], timeout=RPC_TIMEOUT)
    finally:
        stop_workers(workers)
    assert not proxy.parse_errors
    decode = [g for g in proxy.trace.graphs if any(n[1] == "attn_norm-0" and n[2][1] == 1 for n in g)]
    assert decode, "no decode step traced"
    theirs = _compute_nodes(decode[-1])
    ours = _compute_nodes(_our_graph(deepseek2_model, 256, flash_attn == "on"))
    assert ours == theirs, "\n".join(sorted(set(ours) ^ set(theirs)))


def test_fused_gate_up_exps(llama, fused_model, cpu_text, tmp_path):
    """ffn_gate_up_exps: one MUL_MAT_ID and two views, as build_moe_ffn's merged path: llama.cpp's decode
    graph node for node, and its greedy text."""
    assert "blk.1.ffn_gate_up_exps.weight" in ModelFile(fused_model).layer_tensor_names(1).values()
    workers = start_workers(("reference",), tmp_path / "trace")
    try:
        with TraceProxy(workers[0].address) as proxy:
            llama("llama-completion", ["-m", fused_model, "-p", PROMPTS["fact"], "-n", 2, "--temp", 0,
                                       "--ignore-eos", "-no-cnv", "-t", CLIENT_THREADS, "-c", 512, "-fa", "on",
                                       "-fit", "off", "-ngl", 99, "--rpc", proxy.address], timeout=RPC_TIMEOUT)
    finally:
        stop_workers(workers)
    decode = [g for g in proxy.trace.graphs if any(n[1] == "attn_norm-0" and n[2][1] == 1 for n in g)]
    assert decode, "no decode step traced"
    assert _compute_nodes(_our_graph(fused_model, 256, True)) == _compute_nodes(decode[-1])

    args = generation_args(fused_model, PROMPTS["fact"], "off")
    expected = cpu_text([*args, "-ngl", 0, "--no-repack"])
    workers = start_workers(("ours",), tmp_path / "run")
    try:
        done = run_orchestrator(["--rpc", workers[0].address, *args], workers)
    finally:
        stop_workers(workers)
    assert done.stdout == expected, text_diff(expected, done.stdout, "llama-completion", "orchestrator")


def test_context_shift(deepseek2_model, cpu_text, tmp_path):
    """--context-shift: the moved cells' latent rows roped on the worker in their last n_rot values only
    (llama.cpp's build_graph_shift offsets the view by kv_lora for MLA). The long prompt in 256 cells is
    full after ~65 tokens; 100 take one shift and go on past it."""
    args = [*generation_args(deepseek2_model, PROMPTS["long"], "on"), "-n", 100, "-c", 256, "--context-shift",
            "--keep", 16]
    expected = cpu_text([*args, "-ngl", 0, "--no-repack"])
    workers = start_workers(("ours",), tmp_path)
    try:
        done = run_orchestrator(["--rpc", workers[0].address, *args, "-v"], workers)
    finally:
        stop_workers(workers)
    assert "context full, shifting" in done.stderr
    assert done.stdout == expected, text_diff(expected, done.stdout, "llama-completion", "orchestrator")


def test_serve_batches_two_sequences(deepseek2_model, cpu_text, tmp_path):
    prompts = [PROMPTS["fact"], PROMPTS["list"]]
    texts = serve_greedy(deepseek2_model, prompts, N_SERVE, 512, tmp_path)
    for prompt, text in zip(prompts, texts):
        expected = cpu_text(["-m", deepseek2_model, "-p", prompt, "-n", N_SERVE, "--temp", 0, "--ignore-eos",
                             "-fa", "on", "-c", 512, "--no-display-prompt", "-ngl", 0,
                             "--no-repack"]).removesuffix("\n\n")
        assert text == expected, text_diff(expected, text, "llama-completion", "orchestrator serve")
