"""The CLI's engine (Engine.one_sequence) against llama-completion's loop written out plainly, on a toy
model whose logits are a function of the sequence: the same tokens, the same ending (end of generation,
-n, a full context that stops), the same decodes (the prompt in n_batch chunks of n_ubatch, then one
token at a time, the last cell never filled). No workers: the pipeline is a stand-in that records the
batches it is given."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from orchestrator.engine.loop import Engine, Job
from orchestrator.engine.recovery import FRUITLESS_REPLANS, RecoveryError
from orchestrator.pipeline.client import WorkerError
from orchestrator.pipeline.kv import Batch
from orchestrator.sampling import SamplingParams

pytestmark = pytest.mark.unit

N_VOCAB = 50
EOG = 3


class Hparams:
    n_vocab = N_VOCAB


class Model:
    hparams = Hparams()


def next_token(context: list[int]) -> int:
    """The toy model's most likely token after `context`."""
    return (sum(context) * 7 + len(context)) % N_VOCAB


def toy_logits(context: list[int]) -> np.ndarray:
    """Distinct logits, highest at next_token(context), then the ids after it round the vocabulary."""
    return -((np.arange(N_VOCAB) - next_token(context)) % N_VOCAB).astype(np.float32)


class ToyPipe:
    """What the engine reads of a Pipeline; run() answers each batch's last row with the toy logits of the
    positions up to it, as the cache holds them."""

    n_swa = 0
    n_ctx_swa = 0
    cells = None

    def __init__(self, n_ctx: int, n_batch: int, n_ubatch: int):
        self.n_ctx, self.n_batch, self.n_ubatch = n_ctx, n_batch, min(n_batch, n_ubatch)
        self.model = Model()
        self.cache: dict[int, int] = {}  # position -> token
        self.batches: list[tuple[int, int]] = []  # (first position, tokens)

    def sequence_batch(self, tokens: list[int], n_past: int) -> Batch:
        return Batch.sequence(tokens, n_past, n_past + len(tokens))

    def run(self, batch: Batch) -> np.ndarray:
        pos = [int(p) for p in batch.pos]
        assert pos[-1] < self.n_ctx - 1 or len(pos) > 1, "the last cell is filled by a generated token"
        self.batches.append((pos[0], len(pos)))
        for p, t in zip(pos, batch.tokens):
            self.cache[p] = t
        return toy_logits([self.cache[p] for p in range(pos[-1] + 1)])[None, :]


def llama_completion(prompt: list[int], n_predict: int, n_ctx: int, n_batch: int, n_ubatch: int, ignore_eos: bool):
    """llama-completion's loop on the toy model, greedy: (text tokens printed, decodes, how it ended)."""
    n_ubatch = min(n_batch, n_ubatch)
    decodes = [(b + u, min(n_ubatch, n_batch - u, len(prompt) - b - u))
               for b in range(0, len(prompt), n_batch) for u in range(0, min(n_batch, len(prompt) - b), n_ubatch)]
    seq, out, n_past = list(prompt), [], len(prompt)
    while n_predict < 0 or len(out) < n_predict:
        logits = toy_logits(seq)
        if ignore_eos:
            logits[EOG] = -np.inf
        token = int(np.argmax(logits))
        out.append(token)
        if token == EOG:
            return out, decodes, "stop"
        if n_predict >= 0 and len(out) >= n_predict:
            return out, decodes, "length"
        if n_past + 1 >= n_ctx:
            return out, decodes, "context"
        decodes.append((n_past, 1))
        seq.append(token)
        n_past += 1
    return out, decodes, "length"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, N_VOCAB - 1), min_size=1, max_size=40), st.integers(-1, 60), st.integers(44, 90),
       st.sampled_from([4, 7, 64]), st.sampled_from([2, 3, 64]), st.booleans())
def test_the_clis_engine_runs_llama_completions_loop(prompt, n_predict, n_ctx, n_batch, n_ubatch, ignore_eos):
    expected, decodes, how = llama_completion(prompt, n_predict, n_ctx, n_batch, n_ubatch, ignore_eos)
    pipe = ToyPipe(n_ctx, n_batch, n_ubatch)
    engine = Engine.one_sequence(pipe, [EOG])
    events = []
    finish = engine.generate(Job(prompt, SamplingParams(temp=0), n_predict, lambda k, v: events.append((k, v)),
                                 ignore_eos=ignore_eos))
    tokens = [v[0] for k, v in events if k == "token"] + ([finish.eog_token] if finish.eog_token is not None else [])
    if n_predict == 0:
        expected = []  # the prompt only (the engine samples the first token and drops it, as llama-server)
    assert tokens == expected
    assert pipe.batches == decodes
    assert events[-1] == ("done", finish)
    if n_predict != 0:
        assert (finish.reason, finish.context_full) == {"stop": ("stop", False), "length": ("length", False),
                                                        "context": ("length", True)}[how]
    assert engine.metrics.prompt_tokens == len(prompt) and engine.metrics.eval_runs == len(decodes) - sum(
        1 for p, _ in decodes if p < len(prompt))


class DyingPipe(ToyPipe):
    """A ToyPipe whose worker goes away at its `dies_at`-th decode (counting from 0)."""

    def __init__(self, *args, dies_at: int):
        super().__init__(*args)
        self.dies_at, self.closed = dies_at, False

    def run(self, batch: Batch) -> np.ndarray:
        if len(self.batches) == self.dies_at:
            raise WorkerError("worker 10.0.0.2:50052 closed the connection during GRAPH_COMPUTE", "10.0.0.2:50052")
        return super().run(batch)

    def close(self) -> None:
        self.closed = True


class Replanned:
    """Recovery's interface: replan() gives a pipeline with an empty cache (the survivors')."""

    states: dict = {}

    def __init__(self, make):
        self.make, self.pipes = make, []

    def replan(self, failure: str):
        assert "10.0.0.2:50052" in failure
        self.pipes.append(self.make())
        return self.pipes[-1]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, N_VOCAB - 1), min_size=1, max_size=30), st.integers(1, 30), st.integers(0, 40),
       st.sampled_from([4, 64]), st.sampled_from([3, 64]))
def test_a_worker_lost_mid_sequence_is_replaced_and_the_tokens_read_again(prompt, n_predict, dies_at, n_batch,
                                                                          n_ubatch):
    """After a re-plan the new pipeline reads the prompt in llama-completion's chunks and every generated
    token on a step of its own, as the first did: the same tokens come out, each once."""
    n_ctx = 90
    expected, decodes, _ = llama_completion(prompt, n_predict, n_ctx, n_batch, n_ubatch, True)
    first = DyingPipe(n_ctx, n_batch, n_ubatch, dies_at=dies_at)
    engine = Engine.one_sequence(first, [EOG])
    engine.recovery = Replanned(lambda: ToyPipe(n_ctx, n_batch, n_ubatch))
    events = []
    engine.generate(Job(prompt, SamplingParams(temp=0), n_predict, lambda k, v: events.append((k, v)), ignore_eos=True))
    assert [v[0] for k, v in events if k == "token"] == expected
    if dies_at >= len(decodes):  # it finished first
        assert engine.recovery.pipes == [] and first.batches == decodes
        return
    (second,) = engine.recovery.pipes
    assert first.closed and engine.pipe is second
    assert first.batches == decodes[:dies_at]
    assert second.batches == decodes  # the lost cells read again, then the rest


def test_a_step_that_fails_on_every_pipeline_ends_the_run_after_a_few_replans():
    """A failure that every new pipeline meets at the same step (not a lost worker: e.g. a graph that a
    worker refuses) is re-planned FRUITLESS_REPLANS times, then given up with an error saying so, instead
    of re-planning without end; a pipeline after which tokens are made resets the count."""
    n_ctx, prompt = 90, [1, 2, 3]
    _, decodes, _ = llama_completion(prompt, 20, n_ctx, 64, 64, True)
    dies_at = len(decodes) - 5  # every pipeline dies at the same decode, after reading the tokens again
    engine = Engine.one_sequence(DyingPipe(n_ctx, 64, 64, dies_at=dies_at), [EOG])
    engine.recovery = Replanned(lambda: DyingPipe(n_ctx, 64, 64, dies_at=dies_at))
    with pytest.raises(RecoveryError, match=f"after {FRUITLESS_REPLANS} re-plans in a row"):
        engine.generate(Job(prompt, SamplingParams(temp=0), 20, lambda k, v: None, ignore_eos=True))
    # the first re-plan follows tokens made by the first pipeline; then FRUITLESS_REPLANS more without any
    assert len(engine.recovery.pipes) == FRUITLESS_REPLANS
