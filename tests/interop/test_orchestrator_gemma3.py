"""Our orchestrator builds Gemma 3 graphs: the same greedy text as llama-completion on its CPU backend.

Gemma 3 270M Q4_K_M (token_embd Q8_0, tied output) over one, two and three workers, ours and llama.cpp's
ggml-rpc-server, flash attention on and off. The long prompt (~790 tokens) runs with -c 1024 -ub 64, so
the sliding-window layers' own cache holds pad(512 + 64, 256) = 768 cells and wraps round during the
prompt and generation: the text is llama.cpp's only if their cells are placed, visited and masked as
llama.cpp's iSWA cache does it. With two of our workers the generation goes round the ring (the first
worker scales the token rows it looks up itself), and the next step's shape is predicted ahead.
`orchestrator serve` decodes two prompts in one batch, its sliding-window layers sharing the engine's
cells (llama.cpp's --swa-full) and masked per sequence and window.
"""
from __future__ import annotations

import pytest

from .conftest import text_diff
from .programs import long_prompt, run_orchestrator, serve_greedy, start_workers, stop_workers

pytestmark = pytest.mark.interop

N_PREDICT = 32
SHORT = "The capital of France is"
# (workers, flash attention, prompt): each case one orchestrator run
CASES = {
    "ours-fa-on-long": (("ours",), "on", "long"),
    "ours+ours-fa-off-long": (("ours", "ours"), "off", "long"),
    "reference-fa-off-short": (("reference",), "off", "short"),
    "reference+ours+reference-fa-on-short": (("reference", "ours", "reference"), "on", "short"),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, bin_dir, tmp_path_factory):
    kinds, flash_attn, prompt_id = CASES[request.param]
    workers = start_workers(kinds, tmp_path_factory.mktemp(request.param))
    yield workers, flash_attn, prompt_id
    stop_workers(workers)


def test_same_text_as_llama_completion(gemma3_path, case, cpu_text):
    workers, flash_attn, prompt_id = case
    prompt = long_prompt() if prompt_id == "long" else SHORT
    args = ["-m", gemma3_path, "-p", prompt, "-n", N_PREDICT, "--temp", 0, "--ignore-eos", "-fa", flash_attn,
            "-c", 1024, "-b", 64, "-ub", 64]
    # --no-repack: the CPU backend computes on the file's layout, as every RPC worker does
    expected = cpu_text([*args, "-ngl", 0, "--no-repack"])
    assert expected.strip(), "llama-completion produced no text"
    done = run_orchestrator(["--rpc", ",".join(w.address for w in workers), *args], workers)
    assert "(gemma3," in done.stderr
    if len(workers) > 1 and all(w.kind == "ours" for w in workers):
        assert "ring: on" in done.stderr
    assert done.stdout == expected, text_diff(expected, done.stdout, "llama-completion", "orchestrator")


def test_serve_batches_two_sequences(gemma3_path, cpu_text, tmp_path):
    prompts = [SHORT, "Here are three simple tips for staying healthy:\n1."]
    texts = serve_greedy(gemma3_path, prompts, N_PREDICT, 1024, tmp_path)
    for prompt, text in zip(prompts, texts):
        expected = cpu_text(["-m", gemma3_path, "-p", prompt, "-n", N_PREDICT, "--temp", 0, "--ignore-eos", "-fa", "on",
                             "-c", 1024, "--no-display-prompt", "-ngl", 0, "--no-repack"]).removesuffix("\n\n")
        assert text == expected, text_diff(expected, text, "llama-completion", "orchestrator serve")
