"""Batches in flight through the stages at once: while one worker computes a batch, the next computes
the batch before it.

`Pipeline.run` takes one batch through every stage before the next starts, so of two workers one always
waits. The serving engine has several sequences to step, so it splits them into batches and keeps up to
one batch per stage in flight, as llama.cpp's pipeline parallelism does with its micro-batches. Each
tick every stage holding a batch computes it at the same time (the orchestrator sends each worker its
inputs and the activation it relays, then reads every output) and the batches move one stage on; the
last stage's batch leaves with its logits.

Every stage sees the batches in the order they started, so each finds in the KV cache what every earlier
batch wrote there: a sequence may be in several batches in flight (chunks of its prompt), but a token
that has to be sampled from a batch's logits can only be fed once that batch has left. The activations
always go through the orchestrator here (a peer push would need its step order on the workers).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from orchestrator.kv import Batch
from orchestrator.llama_graph import Shape


@dataclass
class Flight:
    batch: Batch
    tag: object  # the caller's, given back with the logits
    shape: Shape
    feed: dict[str, np.ndarray]
    activation: np.ndarray  # the input of the stage it is at
    started: float


class Waves:
    def __init__(self, pipe):
        self.pipe = pipe
        self.at: list[Flight | None] = [None] * len(pipe.stages)  # the batch at each stage

    @property
    def ready(self) -> bool:
        """The first stage is free for a new batch."""
        return self.at[0] is None

    @property
    def busy(self) -> bool:
        return any(f is not None for f in self.at)

    @property
    def width(self) -> int:
        """How many batches can be in flight."""
        return len(self.at)

    def start(self, batch: Batch, tag: object) -> None:
        pipe = self.pipe
        if not self.ready:
            raise RuntimeError("the first stage still holds a batch")
        if pipe.swa is not None and batch.swa_cells is None:
            raise ValueError("this model has sliding-window layers: the batch must place their cells too")
        self.at[0] = Flight(batch, tag, pipe.shape(batch), pipe._inputs(batch),
                            pipe.model.token_embeddings(batch.tokens), time.perf_counter())

    def tick(self) -> list[tuple[object, np.ndarray, float]]:
        """Every stage holding a batch computes it; returns (tag, logits of its output rows, seconds since
        it started) for the batch that left the last stage, if one did."""
        stages = self.pipe.stages
        for stage, flight in zip(stages, self.at):
            if flight is not None:
                stage.prepare(flight.shape)
                stage.launch({**flight.feed, "embd": flight.activation})
                stage.request_output()  # every output is asked for before any is read: one round trip
        moved: list[Flight | None] = [None] * len(stages)
        done = []
        for i, (stage, flight) in enumerate(zip(stages, self.at)):
            if flight is None:
                continue
            flight.activation = stage.receive_output()
            if i + 1 < len(stages):
                moved[i + 1] = flight
            else:
                logits = flight.activation.reshape(len(flight.batch.out_ids), self.pipe.model.hparams.n_vocab)
                done.append((flight.tag, logits, time.perf_counter() - flight.started))
        self.at = moved
        return done
