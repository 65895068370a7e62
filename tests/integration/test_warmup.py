"""The start-up warm-up: after it, a real model's graphs make numba compile or load nothing more."""

import os
import sys

import numba.core.registry
import pytest

from kernels.jit import RowLoop
from rpcserver import warmup
from rpcserver.memory import MemoryBudget
from rpcserver.session import Session, WorkerConfig
from tools import reference


def numba_signatures() -> dict[str, int]:
    """Compiled signatures of every numba function in the kernels package (the oracle: numba's own)."""
    found = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("kernels") or module is None:
            continue
        for attr, value in vars(module).items():
            if isinstance(value, numba.core.registry.CPUDispatcher):
                found[f"{name}.{attr}"] = len(value.signatures)
            elif isinstance(value, RowLoop):  # two dispatchers: prange on numba's threads, and serial
                found[f"{name}.{attr}"] = len(value.parallel.signatures)
                found[f"{name}.{attr}_serial"] = len(value.serial.signatures)
    return found


def _reference_model(locate):
    from orchestrator.graph.model import ModelFile

    try:
        return ModelFile(locate())
    except reference.ReferenceMissing as exc:  # the test policy for a missing reference: fail in CI, skip locally
        if os.environ.get("CI", "").strip().lower() == "true":
            pytest.fail(str(exc), pytrace=False)
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def smollm2():
    return _reference_model(reference.model_path)


@pytest.fixture(scope="module")
def gemma3():
    return _reference_model(reference.gemma3_model_path)


def run_after_warm_up(model, flash_attn: bool, n_ctx: int = 1024, tier: str = "all"):
    """The warm-up, then llama-completion's shapes through a session (its 2-token warm-up decode, a prompt,
    single tokens, a token deep into the context, where ggml splits a long cache over threads, and one at
    the cache's last cell): the last logits, and the numba functions that compiled new signatures
    meanwhile."""
    from orchestrator.pipeline.client import InProcessClient
    from orchestrator.pipeline.runner import Pipeline

    warmup.warm_up(tier=tier)
    before = numba_signatures()
    assert sum(before.values()) > 10  # the warm-up did load kernels
    client = InProcessClient(Session(WorkerConfig(MemoryBudget())))
    try:
        pipe = Pipeline(model, n_ctx=n_ctx, n_batch=64, n_ubatch=64, flash_attn=flash_attn)
        pipe.connect([client])
        pipe.place()
        pipe.allocate()
        pipe.upload()
        pipe.evaluate_prompt([1, 2])
        pipe.evaluate_prompt(list(range(10, 47)))
        for token in (5, 6):
            logits = pipe.evaluate_token(token)
        pipe.run(pipe.sequence_batch([7], n_ctx - 100))
        pipe.run(pipe.sequence_batch([8], n_ctx - 1))
    finally:
        client.close()
    after = numba_signatures()
    return logits, {k: (before.get(k, 0), n) for k, n in after.items() if n != before.get(k, 0)}


@pytest.mark.parametrize("n_ctx", [256, 1024])
@pytest.mark.parametrize("flash_attn", [True, False])
def test_a_real_model_after_the_warm_up_needs_no_new_kernel_signatures(smollm2, flash_attn, n_ctx):
    logits, grown = run_after_warm_up(smollm2, flash_attn, n_ctx)
    assert logits.shape == (smollm2.hparams.n_vocab,)
    assert not grown, f"compiled after the warm-up: {grown}"


def test_the_demo_model_after_the_demo_tier_needs_no_new_kernel_signatures(smollm2):
    """The tier the orchestrator's local workers replay covers the demo's model with the CLI's defaults
    (flash attention on, F16 cache), the split long cache included."""
    _, grown = run_after_warm_up(smollm2, flash_attn=True, n_ctx=1024, tier="demo")
    assert not grown, f"compiled after the demo tier: {grown}"


@pytest.mark.parametrize("flash_attn", [True, False])
def test_gemma3_after_the_warm_up_needs_no_new_kernel_signatures(gemma3, flash_attn):
    """Sliding-window layers attend to a cache of their own, whole or in part."""
    _, grown = run_after_warm_up(gemma3, flash_attn)
    assert not grown, f"compiled after the warm-up: {grown}"


def test_a_mixture_of_experts_after_the_warm_up_needs_no_new_kernel_signatures(smollm2, tmp_path):
    """A random qwen3moe in Q4_K_M (tools/make_model.py): MUL_MAT_ID, ARGSORT and the routing weights' ops
    were compiled at start-up, so a first MoE client does not wait for numba."""
    from orchestrator.graph.model import ModelFile
    from tools.make_model import write_model

    model = ModelFile(write_model(tmp_path / "moe.gguf", "qwen3moe", n_layer=2, n_embd=256, n_ff=256, n_expert=8,
                                  n_expert_used=2, weight_type="Q4_K", vocab_from=smollm2.path))
    _, grown = run_after_warm_up(model, flash_attn=True)
    assert not grown, f"compiled after the warm-up: {grown}"
