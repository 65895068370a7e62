"""Our orchestrator builds qwen3moe graphs (mixture of experts): the same greedy text as llama-completion on
its CPU backend.

A random-weight qwen3moe from tools/make_model.py (4 layers, 8 experts of width 256, 2 routed per token),
in Q8_0 and Q4_K, over one, two and three workers (ours, llama.cpp's ggml-rpc-server, and both in one
pipeline), flash attention on and off. The ~190-token prompt runs in ubatches of 64, so MUL_MAT_ID sees
experts with many rows and with few, and every decoded token routes one row. Besides the text: the MoE
nodes the orchestrator builds are the ones llama-completion sends a worker (op, name, shape, type,
op_params, sources' shapes and strides, in order; traced through tools/trace_proxy.py) for a prompt and
a decode step; the memory placement counts the expert weights (a worker with room for all but them is
refused); `orchestrator serve` decodes two prompts in one batch, each routed as llama-completion routes
it alone.
"""
from __future__ import annotations

import re

import gguf
import pytest

from wire.ggml import GGMLType
from orchestrator.graph.ggml import new_tensor
from orchestrator.graph.llama import Shape
from orchestrator.graph.model import ModelFile
from orchestrator.pipeline.stage import BUILDERS
from wire import protocol as p
from tools.trace_proxy import TraceProxy, describe_graph

from .conftest import CLIENT_THREADS, RPC_TIMEOUT, ClientFailed, text_diff
from .programs import PROMPTS, run_orchestrator, serve_greedy, start_workers, stop_workers

pytestmark = pytest.mark.interop

N_PREDICT = 32
N_SERVE = 16  # tokens per sequence of the serve test
MOE = dict(n_layer=4, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_ff=256, n_expert=8, n_expert_used=2)
# (weight type, workers, flash attention): each case one orchestrator run on the long prompt
CASES = {
    "Q8_0-ours-fa-on": ("Q8_0", ("ours",), "on"),
    "Q4_K-ours+ours-fa-off": ("Q4_K", ("ours", "ours"), "off"),
    "Q4_K-reference-fa-on": ("Q4_K", ("reference",), "on"),
    "Q8_0-ours+reference+ours-fa-off": ("Q8_0", ("ours", "reference", "ours"), "off"),
}


def generation_args(model, prompt: str, flash_attn: str) -> list:
    return ["-m", model, "-p", prompt, "-n", N_PREDICT, "--temp", 0, "--ignore-eos", "-fa", flash_attn,
            "-c", 512, "-b", 64, "-ub", 64]


@pytest.fixture(scope="module", params=list(CASES))
def case(request, bin_dir, tmp_path_factory):
    weight_type, kinds, flash_attn = CASES[request.param]
    workers = start_workers(kinds, tmp_path_factory.mktemp(request.param))
    yield weight_type, workers, flash_attn
    stop_workers(workers)


def test_same_text_as_llama_completion(moe_models, case, cpu_text):
    weight_type, workers, flash_attn = case
    args = generation_args(moe_models(weight_type), PROMPTS["long"], flash_attn)
    # --no-repack: the CPU backend computes on the file's layout, as every RPC worker does
    expected = cpu_text([*args, "-ngl", 0, "--no-repack"])
    assert len(set(expected.split())) >= 8, f"the CPU baseline collapsed: {expected!r}"
    # three workers split 5 blocks 2,1,2 (llama.cpp's rule): each holds layers, the last also the output head
    split = ["-ts", "2,1,2"] if len(workers) == 3 else []
    done = run_orchestrator(["--rpc", ",".join(w.address for w in workers), *split, *args], workers)
    assert "(qwen3moe," in done.stderr
    layered = [line for line in done.stderr.splitlines() if re.search(r": layers +\d+- *\d+", line)]
    assert len(layered) == len(workers), done.stderr
    if len(workers) > 1 and all(w.kind == "ours" for w in workers):
        assert "ring: on" in done.stderr
    assert done.stdout == expected, text_diff(expected, done.stdout, "llama-completion", "orchestrator")


# -- the graph, node for node ---------------------------------------------------------------------------


def _our_graph(model_path: str, n_tokens: int, n_outputs: int, flash_attn: bool) -> list:
    """The MoE nodes of our graph of all blocks for a step of n_tokens, described as trace_proxy does."""
    model = ModelFile(model_path)
    hp = model.hparams
    names = [n for il in range(hp.n_layer) for n in model.layer_tensor_names(il).values()]
    weights = {n: new_tensor(model.weights[n].type, model.weights[n].ne, n)
               for n in [*names, *model.output_tensor_names().values()]}
    kv = {il: (new_tensor(GGMLType.F16, (hp.n_embd_k_gqa, 512), f"cache_k_l{il}"),
               new_tensor(GGMLType.F16, (hp.n_embd_v_gqa, 512), f"cache_v_l{il}")) for il in range(hp.n_layer)}
    builder = BUILDERS[hp.arch](hp, weights, kv, flash_attn)
    sg = builder.build(range(hp.n_layer + 1), Shape(n_tokens, 256, n_outputs))
    nodes, tensors = sg.graph.serialize()
    return [n for n in describe_graph(p.GraphComputeRequest(0, nodes, tensors)) if n[1].startswith("ffn_moe")]


def test_moe_nodes_are_llama_cpps(llama, moe_models, tmp_path_factory):
    """What llama-completion sends a worker for the prompt and for one decoded token, against ours."""
    model = moe_models("Q4_K")
    workers = start_workers(("reference",), tmp_path_factory.mktemp("traced"))
    try:
        with TraceProxy(workers[0].address) as proxy:
            llama("llama-completion", ["-m", model, "-p", PROMPTS["fact"], "-n", 2, "--temp", 0, "--ignore-eos",
                                       "-no-cnv", "-t", CLIENT_THREADS, "-c", 512, "-fa", "on", "-fit", "off",
                                       "-ngl", 99, "--rpc", proxy.address], timeout=RPC_TIMEOUT)
    finally:
        stop_workers(workers)
    assert not proxy.parse_errors
    views = {"VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE"}
    traced = {}  # n_tokens -> the graph's MoE compute nodes (views are no nodes of ours)
    for graph in proxy.trace.graphs:
        moe = [n for n in graph if n[1].startswith("ffn_moe") and n[0] not in views]
        if moe and moe[0][1] == "ffn_moe_logits-0":
            traced[moe[0][2][1]] = moe
    n_prompt = max(traced)
    assert n_prompt > 1 and 1 in traced, sorted(traced)
    for n_tokens in (n_prompt, 1):
        ours = _our_graph(model, n_tokens, 1, True)
        theirs = traced[n_tokens]
        assert [n[0] for n in ours] == [n[0] for n in theirs]
        assert ours == theirs
    ops = [n[0] for n in traced[1][:11]]
    assert ops == ["MUL_MAT", "SOFT_MAX", "ARGSORT", "GET_ROWS", "SUM_ROWS", "CLAMP", "DIV", "MUL_MAT_ID",
                   "MUL_MAT_ID", "GLU:SWIGLU", "MUL_MAT_ID"], ops


# -- placement -------------------------------------------------------------------------------------------


def test_placement_counts_the_expert_weights(moe_models, tmp_path):
    """A worker with room for everything but the experts is refused; the weights it would hold are the
    file's tensors of its blocks, the experts' 3-D tensors included."""
    model = moe_models("Q8_0")
    tensors = gguf.GGUFReader(model).tensors
    mib = 1 << 20
    total = sum(int(t.n_bytes) for t in tensors)
    experts = sum(int(t.n_bytes) for t in tensors if "_exps." in t.name)
    mem = (total - experts) // mib + 4  # the rest, its KV cache (1 MiB) and compute buffer (~1.5 MiB)
    workers = start_workers(("ours",), tmp_path, mem_mib=(mem,))
    try:
        with pytest.raises(ClientFailed) as failed:
            run_orchestrator(["--rpc", workers[0].address, "-m", model, "-p", "Hi", "-n", 1, "-c", 512, "-b", 64,
                              "-ub", 64], workers)
    finally:
        stop_workers(workers)
    message = str(failed.value)
    assert "does not fit" in message, message
    plan = re.search(r"weights +([\d.]+) MiB, KV +([\d.]+) MiB, compute +([\d.]+) MiB", message)
    assert plan, message
    weights, kv, compute = map(float, plan.groups())
    assert abs(weights - total / mib) < 0.06, message
    assert weights + kv + compute > mem >= weights - experts / mib + kv + compute, message  # refused for the experts


# -- serve -----------------------------------------------------------------------------------------------


def test_serve_batches_two_sequences(moe_models, cpu_text, tmp_path):
    model = moe_models("Q8_0")
    prompts = [PROMPTS["fact"], PROMPTS["list"]]
    texts = serve_greedy(model, prompts, N_SERVE, 512, tmp_path)
    for prompt, text in zip(prompts, texts):
        expected = cpu_text(["-m", model, "-p", prompt, "-n", N_SERVE, "--temp", 0, "--ignore-eos", "-fa", "on",
                             "-c", 512, "--no-display-prompt", "-ngl", 0, "--no-repack"]).removesuffix("\n\n")
        assert text == expected, text_diff(expected, text, "llama-completion", "orchestrator serve")
