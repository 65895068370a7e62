"""The draft on llama.cpp's rpc-server: its blocks from the chain (pipeline/chain.py), one graph a block.

llama.cpp's worker has no pushes, so the draft's ring cannot run there; the chain makes a block's steps in
one GRAPH_COMPUTE instead. Its drafts are checked against stepwise drafting on another of llama.cpp's
workers (each token the argmax, or the keyed draw, of logits read back), and the orchestrator's greedy text
with the draft there against llama-completion's without one, also where the draft shares the target's
connection to a llama.cpp worker.
"""
from __future__ import annotations

import re
import subprocess

import numpy as np
import pytest

from .conftest import CPU_TIMEOUT, reference, text_diff
from .programs import PROMPTS, run_orchestrator, start_workers, stop_workers

pytestmark = pytest.mark.interop

PROMPT = "The three most useful things to know about distributed computing are"


@pytest.fixture(scope="module")
def llama_workers(bin_dir, tmp_path_factory):
    """Two of llama.cpp's workers and one of ours."""
    workers = start_workers(("reference", "reference", "ours"), tmp_path_factory.mktemp("chain"))
    yield workers
    stop_workers(workers)


def draft_pipe(model, endpoint: str):
    """The draft's pipeline on one worker, as start_speculator brings it up."""
    from orchestrator.engine.startup import PipelineOptions, start_pipeline  # noqa: PLC0415
    from orchestrator.graph.model import ModelFile  # noqa: PLC0415

    options = PipelineOptions(n_ctx=256, n_batch=256, n_ubatch=256, flash_attn=True, swa_full=True)
    return start_pipeline(ModelFile(model), [endpoint], options)


def test_the_chain_drafts_what_stepwise_drafting_does(model_path, llama_workers):
    """Greedy and sampled drafts from the chain equal stepwise drafting's on another worker: a block on a
    fresh prompt, after a rejection (the first step one token), after a block kept whole (its first step
    the last draft and the target's token), and two slots at once, one leaving the chain before the other,
    one greedy beside one sampled. Each from one chain run."""
    from orchestrator.engine.drafter import Drafter, DraftRequest  # noqa: PLC0415
    from orchestrator.graph.model import ModelFile  # noqa: PLC0415
    from orchestrator.tokenizer import Vocab  # noqa: PLC0415

    prompt = Vocab.from_gguf(ModelFile(model_path).reader).tokenize(PROMPT)
    chained = Drafter(draft_pipe(model_path, llama_workers[0].address), 2)
    stepwise = Drafter(draft_pipe(model_path, llama_workers[1].address), 2)
    try:
        assert chained.ring is None and chained.chain is not None  # llama.cpp's worker: no ring
        stepwise.chain = None
        runs, run = [], chained.chain.run
        chained.chain.run = lambda *args: runs.append(args) or run(*args)

        def both(requests: list[DraftRequest]) -> list[tuple[list[int], list[np.ndarray]]]:
            before = len(runs)
            got = chained.draft_each(requests)
            assert len(runs) == before + 1  # one chain run for them all
            expected = stepwise.draft_many(requests)
            for (tokens, dists), (want, want_dists), r in zip(got, expected, requests):
                assert tokens == want and len(tokens) == r.n_max
                assert len(dists) == (0 if r.seed is None else r.n_max)
                for q, q_stepwise in zip(dists, want_dists):
                    np.testing.assert_allclose(q, q_stepwise, rtol=1e-6, atol=1e-12)
            return got

        (greedy, _), = both([DraftRequest(0, prompt, 5, 0.0, 1.0, None)])
        wrong = (greedy[2] + 1) % 1000  # the target kept two drafts, then made another token
        both([DraftRequest(0, prompt + greedy[:2] + [wrong], 4, 0.0, 1.0, None)])
        (sampled, _), = both([DraftRequest(1, prompt, 4, 0.0, 1.5, 5, 40)])
        kept = prompt + sampled + [sampled[-1]]  # every draft kept, then the target's token
        both([DraftRequest(1, kept, 3, 0.0, 1.5, 5, 45)])
        both([DraftRequest(0, prompt + greedy[:2] + [wrong, 17], 2, 0.0, 1.0, None),
              DraftRequest(1, kept + [5], 4, 0.0, 1.5, 6, 49)])
    finally:
        chained.close()
        stepwise.close()


def test_greedy_text_with_the_draft_on_llama_cpps_worker(model_path, llama_workers, cpu_text, tmp_path):
    """The target on our worker, its Q4_0 draft on llama.cpp's (--rpc-draft), drafting every step: drafts
    from the chain, and llama-completion's greedy text."""
    draft = tmp_path / "draft-Q4_0.gguf"
    subprocess.run([str(reference.binary("llama-quantize")), "--allow-requantize", str(model_path), str(draft), "Q4_0"],
                   check=True, capture_output=True, env=reference.llama_env(), timeout=CPU_TIMEOUT)
    args = ["-m", model_path, "-p", PROMPTS["list"], "-n", 48, "--temp", 0, "--ignore-eos"]
    expected = cpu_text(args)
    ours, theirs = llama_workers[2], llama_workers[0]
    done = run_orchestrator(["--rpc", ours.address, *args, "-md", draft, "--rpc-draft", theirs.address,
                             "--draft-always"], llama_workers)
    assert done.stdout == expected, text_diff(expected, done.stdout, "llama-completion", "orchestrator -md")
    assert "draft: drafts in one graph a block" in done.stderr
    found = re.search(r"draft: (\d+) tokens drafted, (\d+) accepted", done.stderr)
    assert found and int(found[1]) >= int(found[2]) > 20, done.stderr[-2000:]


@pytest.mark.parametrize("rpc_draft", ["", "the target's"])
def test_a_draft_shares_the_targets_connection_to_a_llama_cpp_worker(model_path, llama_workers, cpu_text, rpc_draft):
    """llama.cpp's rpc-server serves one connection at a time, which the target holds: a draft placed
    there (by default, the target's workers all being llama.cpp's, or by --rpc-draft) goes through the
    target's connection (a Channel), as llama-server's draft does. Drafting every step, over two of
    llama.cpp's workers: llama-completion's greedy text."""
    targets = [w.address for w in llama_workers[:2]]
    args = ["-m", model_path, "-p", PROMPTS["list"], "-n", 40, "--temp", 0, "--ignore-eos"]
    expected = cpu_text(args)
    extra = ["--rpc-draft", targets[1]] if rpc_draft else []
    done = run_orchestrator(["--rpc", ",".join(targets), *args, "-md", model_path, "--draft-always", *extra],
                            llama_workers)
    assert done.stdout == expected, text_diff(expected, done.stdout, "llama-completion", "orchestrator -md")
    assert "draft: drafts in one graph a block" in done.stderr
    found = re.search(r"draft: (\d+) tokens drafted, (\d+) accepted", done.stderr)
    assert found and int(found[2]) > 20, done.stderr[-2000:]
