"""The start-up warm-up: after it, a real model's graphs make numba compile or load nothing more."""

import os
import sys

import numba.core.registry
import pytest

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
    return found


@pytest.fixture(scope="module")
def smollm2():
    from orchestrator.model import ModelFile

    try:
        return ModelFile(reference.model_path())
    except reference.ReferenceMissing as exc:  # the test policy for a missing reference: fail in CI, skip locally
        if os.environ.get("CI", "").strip().lower() == "true":
            pytest.fail(str(exc), pytrace=False)
        pytest.skip(str(exc))


@pytest.mark.parametrize("flash_attn", [True, False])
def test_a_real_model_after_the_warm_up_needs_no_new_kernel_signatures(smollm2, flash_attn):
    from orchestrator.client import InProcessClient
    from orchestrator.runner import Pipeline

    warmup.warm_up()
    before = numba_signatures()
    assert sum(before.values()) > 10  # the warm-up did load kernels

    client = InProcessClient(Session(WorkerConfig(MemoryBudget())))
    try:
        # llama-completion's shapes: its 2-token warm-up decode, a prompt, then single tokens
        pipe = Pipeline(smollm2, n_ctx=512, n_batch=64, n_ubatch=64, flash_attn=flash_attn)
        pipe.connect([client])
        pipe.place()
        pipe.allocate()
        pipe.upload()
        pipe.evaluate_prompt([1, 2])
        pipe.evaluate_prompt(list(range(10, 47)))
        for token in (5, 6):
            logits = pipe.evaluate_token(token)
    finally:
        client.close()
    assert logits.shape == (smollm2.hparams.n_vocab,)
    after = numba_signatures()
    grown = {k: (before.get(k, 0), n) for k, n in after.items() if n != before.get(k, 0)}
    assert not grown, f"compiled after the warm-up: {grown}"

