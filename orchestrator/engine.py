"""Many sequences over one pipeline at once: llama-server's slots with continuous batching.

The engine runs on a thread of its own (the pipeline's RPC is blocking) and serves Jobs from a bounded
queue. Each step it gives the idle slots the oldest waiting jobs, then, when the first stage is free
and fewer batches are in flight than there are stages, starts a batch: the next token of each
generating slot and chunks of the prompts still being read, up to n_ubatch tokens, so a long prompt is
read over several steps while the others keep generating. With several stages the slots are shared out
over as many batches, which go through the workers one behind the other (orchestrator/waves.py), so
all workers compute at once. Every slot samples its token from its own row of logits with its own
sampler chain and seed; the next batch goes out before the clients hear of the tokens, so the workers
compute while the server writes to its clients.

Each slot owns n_ctx / n_parallel cells of the KV cache, and batches are cut and grouped for attention
so that no sequence's numbers depend on the others' (orchestrator/batching.py). A slot keeps its cells
when its job ends, and the next job given to it keeps the part of them that the new prompt shares
(cache_prompt). A job that is cancelled (its client went away, a stop string was found)
leaves its slot at the next step.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from orchestrator.batching import Piece, Planner
from orchestrator.client import WorkerError
from orchestrator.cxx import expf, logf, std_partial_sort
from orchestrator.sampling import Sampler, SamplingParams
from orchestrator.sampling.gbnf import GrammarError
from orchestrator.waves import Waves

log = logging.getLogger(__name__)


@dataclass
class Finish:
    """How a job ended, with llama-server's timings."""

    reason: str  # "stop" (end of generation), "length" (n_predict or the slot's context), "cancelled"
    prompt_n: int  # prompt tokens computed (the cached ones not counted)
    cache_n: int  # prompt tokens whose cells were kept from the slot's previous job
    prompt_ms: float
    predicted_n: int
    predicted_ms: float
    slot: int = -1  # the slot that served the job

    def timings(self) -> dict:
        def per(ms: float, n: int) -> tuple[float, float]:
            return (ms / n if n else 0.0), (1e3 * n / ms if ms > 0 else 0.0)

        p_tok, p_sec = per(self.prompt_ms, self.prompt_n)
        g_tok, g_sec = per(self.predicted_ms, self.predicted_n)
        return {"cache_n": self.cache_n, "prompt_n": self.prompt_n, "prompt_ms": self.prompt_ms,
                "prompt_per_token_ms": p_tok, "prompt_per_second": p_sec, "predicted_n": self.predicted_n,
                "predicted_ms": self.predicted_ms, "predicted_per_token_ms": g_tok, "predicted_per_second": g_sec}


@dataclass
class Job:
    """One request: its prompt tokens and sampling. `emit(kind, value)` is called on the engine's thread:
    ("token", (id, logprobs)) for each generated token, then ("done", Finish) or ("error", message).
    logprobs is None unless n_probs > 0: then (the token's log-probability, [(id, log-probability)] of
    the n_probs most likely), from the softmax of the raw logits as llama-server reports them."""

    prompt: list[int]
    params: SamplingParams
    n_predict: int  # -1: until end of generation or the slot's context is full
    emit: Callable[[str, object], None]
    ignore_eos: bool = False
    n_probs: int = 0
    cancelled: bool = False
    cache_n: int = 0  # set when a slot takes the job: prompt tokens it keeps cached (read before the first token)


@dataclass
class Slot:
    index: int
    tokens: list[int] = field(default_factory=list)  # its sequence: prompt, then each sampled token
    n_cached: int = 0  # how many of them are in the KV cache (the rest are fed in the next steps)
    paths: list[str] = field(default_factory=list)  # the attention path each cached token was computed on
    want: list[str] = field(default_factory=list)  # the path each prompt token is to be computed on
    job: Job | None = None
    sampler: Sampler | None = None
    n_generated: int = 0
    cache_n: int = 0
    t_start: float = 0.0
    t_first: float | None = None  # when its first token was sampled
    awaiting: bool = False  # a batch in flight holds its last fed token, whose logits it waits for

    @property
    def generating(self) -> bool:
        return self.t_first is not None


@dataclass
class Metrics:
    """Counters for /metrics (llama-server's names)."""

    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    tokens_predicted: int = 0
    tokens_predicted_seconds: float = 0.0
    n_decode: int = 0


class Busy(Exception):
    """The queue of waiting jobs is full."""


class Engine:
    def __init__(self, pipe, eog_ids, *, n_parallel: int, max_queue: int, vocab=None):
        if pipe.n_swa and pipe.n_ctx_swa != pipe.n_ctx:
            raise ValueError("the engine's sliding-window layers share the global cells: build the Pipeline with swa_full")
        self.pipe, self.eog = pipe, sorted(eog_ids)
        self.vocab = vocab  # for grammar-constrained requests
        self.n_vocab = pipe.model.hparams.n_vocab
        self.planner = Planner(n_parallel, pipe.n_ctx, pipe.n_ubatch, flash_attn=pipe.flash_attn,
                               cache_types=pipe.cache_types, n_swa=pipe.n_swa)
        self.waves = Waves(pipe)
        self.slots = [Slot(i) for i in range(n_parallel)]
        self.n_ctx_slot = self.planner.size
        self.max_queue = max_queue
        self.waiting: deque[Job] = deque()
        self.metrics = Metrics()
        self.failed: str | None = None  # why the engine stopped serving (a worker went away)
        self._wake = threading.Condition()
        # a byte here ends the engine's wait for the workers' outputs: a new job can start on a free stage
        self._interrupt, self._interrupter = socket.socketpair()
        self._interrupt.setblocking(False)
        self._interrupter.setblocking(False)
        self._stopping = False
        self._outbox: list[tuple[Job, str, object]] = []  # what the jobs' clients hear once the step is done
        self._deferred = False  # a prompt piece waited for room: the next batch reads prompts first
        self._thread: threading.Thread | None = None

    # -- the side other threads call -------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
        self.pipe.close()
        self._interrupt.close()
        self._interrupter.close()

    def submit(self, job: Job) -> None:
        """Queues a job; Busy if the queue is full, WorkerError if the engine has failed."""
        if len(job.prompt) >= self.n_ctx_slot:
            raise ValueError(f"the prompt has {len(job.prompt)} tokens; a slot's context holds {self.n_ctx_slot}")
        with self._wake:
            if self.failed is not None:
                raise WorkerError(self.failed)
            idle = sum(s.job is None for s in self.slots)  # about to take a waiting job each
            if len(self.waiting) >= self.max_queue + idle:
                raise Busy(f"all {len(self.slots)} slots are busy and {self.max_queue} requests are waiting")
            self.waiting.append(job)
            self._wake.notify()
        try:
            self._interrupter.send(b"\0")
        except BlockingIOError:  # bytes are waiting already
            pass

    def cancel(self, job: Job) -> None:
        """The job's slot is freed at the next step (or it leaves the queue)."""
        with self._wake:
            job.cancelled = True
            if job in self.waiting:
                self.waiting.remove(job)
            self._wake.notify()

    @property
    def processing(self) -> int:
        return sum(s.job is not None for s in self.slots)

    @property
    def deferred(self) -> int:
        return len(self.waiting)

    # -- the engine's thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._wake:
                while not (self._stopping or self.waiting or self.waves.busy or any(s.job for s in self.slots)):
                    self._wake.wait()
                if self._stopping:
                    return
                self._admit()
            try:
                self._step()
            except Exception as exc:  # noqa: BLE001 - a worker gone, or a bug: every waiting client is told
                log.exception("the engine stopped")
                self._fail(str(exc) or type(exc).__name__)
                return

    def _admit(self) -> None:
        """Gives each idle slot a waiting job: the slot whose cached tokens share the longest prefix with
        the prompt; of that prefix it keeps what Planner.keep allows (one token is always computed again,
        for logits). Cells past it are overwritten as the prompt is read; no mask shows them before."""
        while self.waiting:
            idle = [s for s in self.slots if s.job is None and not s.awaiting]
            if not idle:
                return
            job = self.waiting.popleft()
            slot = max(idle, key=lambda s: (_common_prefix(s.tokens[:s.n_cached], job.prompt), -s.index))
            want = self.planner.prompt_paths(len(job.prompt))
            keep = self.planner.keep(slot.tokens[:slot.n_cached], slot.paths, job.prompt, want)
            slot.tokens, slot.n_cached, slot.cache_n, job.cache_n = list(job.prompt), keep, keep, keep
            slot.want, slot.paths = want, slot.paths[:keep]
            slot.job, slot.n_generated, slot.t_first = job, 0, None
            slot.sampler = Sampler(job.params, self.n_vocab, self.vocab)
            for t in job.prompt:
                slot.sampler.accept(t, is_generated=False)
            slot.t_start = time.perf_counter()

    def _step(self) -> None:
        """Starts a batch if the first stage is free and a slot has tokens to feed, then moves every batch
        in flight one stage on and samples from those that left the last."""
        for slot in self.slots:
            if slot.job is not None and slot.job.cancelled:
                self._finish(slot, "cancelled")
        if self.waves.ready:
            self._start_batch()
        if self.waves.busy:
            self._advance()
        self._tell()

    def _advance(self) -> None:
        """Moves the batches in flight on; samples from those that left the last stage and, before their
        clients hear of the tokens, sends the next batch (the workers compute while the server talks)."""
        for (outs, n_tokens, n_gen), logits, seconds in self.waves.tick(self._interrupt):
            self.metrics.n_decode += 1
            share = seconds / n_tokens
            self.metrics.prompt_tokens += n_tokens - n_gen
            self.metrics.prompt_seconds += share * (n_tokens - n_gen)
            self.metrics.tokens_predicted_seconds += share * n_gen
            for (slot, job), row in zip(outs, logits):
                slot.awaiting = False
                if slot.job is job:  # not cancelled meanwhile
                    self._sample(slot, row)
        if self._outbox and self.waves.ready:
            with self._wake:
                self._admit()
            self._start_batch()

    def _tell(self) -> None:
        """Hands the step's tokens and endings to the jobs' emit callbacks."""
        outbox, self._outbox = self._outbox, []
        for job, kind, value in outbox:
            job.emit(kind, value)

    def _start_batch(self) -> None:
        """One batch: the next token of generating slots, up to a share of the busy ones (so that each
        stage can hold a batch), then pieces of the prompts still being read, up to n_ubatch tokens in all
        (a new prompt does not wait for a batch of its own: its first token comes sooner). A prompt piece
        that found too little room left goes first in the next batch."""
        ready = [s for s in self.slots if s.job is not None and not s.awaiting and s.n_cached < len(s.tokens)]
        share = -(-sum(s.job is not None for s in self.slots) // self.waves.width)
        generating, reading = [s for s in ready if s.generating][:share], [s for s in ready if not s.generating]
        pieces: list[Piece] = []
        budget = self.pipe.n_ubatch
        deferred, self._deferred = self._deferred, False
        for slot in reading + generating if deferred else generating + reading:
            if budget <= 0:
                break
            start = slot.n_cached
            if slot.generating:  # the token sampled last
                n, path = 1, self.planner.path(1, start + 1)
            else:
                n = self.planner.piece(start, len(slot.tokens), slot.want, budget)
                if n == 0:  # its chunk's path needs more room than this batch has left
                    self._deferred = True
                    continue
                path = slot.want[start]
            slot.n_cached += n
            slot.paths[start:] = [path] * n
            budget -= n
            done = slot.n_cached == len(slot.tokens)
            pieces.append(Piece(slot.index, slot.tokens[start:slot.n_cached], start, path, done))
            slot.awaiting = done
        if not pieces:
            return
        batch, order = self.planner.batch(pieces, {s.index: s.n_cached for s in self.slots if s.job is not None})
        outs = [(self.slots[p.slot], self.slots[p.slot].job) for p in order if p.output]  # out_ids' order
        n_gen = sum(1 for s, _ in outs if s.generating)
        self.waves.start(batch, (outs, len(batch.tokens), n_gen))

    def _sample(self, slot: Slot, logits: np.ndarray) -> None:
        job = slot.job
        if job.ignore_eos:
            logits = np.array(logits, dtype=np.float32)
            logits[self.eog] = -np.inf
        try:
            token = slot.sampler.sample(logits)
            slot.sampler.accept(token)
        except GrammarError as exc:  # every token was masked (e.g. ignore_eos where only the end fits)
            slot.job, slot.sampler = None, None
            del slot.tokens[slot.n_cached:]
            self._outbox.append((job, "error", str(exc)))
            return
        if slot.t_first is None:
            slot.t_first = time.perf_counter()
        if job.n_predict == 0:  # the prompt only (it stays cached for the slot's next request)
            self._finish(slot, "length")
            return
        if token in self.eog and not job.ignore_eos:  # counted, as llama-server counts it (n_decoded), not sent
            slot.n_generated += 1
            self.metrics.tokens_predicted += 1
            self._finish(slot, "stop")
            return
        slot.tokens.append(token)
        slot.n_generated += 1
        self.metrics.tokens_predicted += 1
        self._outbox.append((job, "token", (token, log_probs(logits, token, job.n_probs) if job.n_probs else None)))
        if (job.n_predict >= 0 and slot.n_generated >= job.n_predict) or len(slot.tokens) > self.n_ctx_slot:
            self._finish(slot, "length")

    def _finish(self, slot: Slot, reason: str) -> None:
        job, now = slot.job, time.perf_counter()
        first = slot.t_first if slot.t_first is not None else now
        finish = Finish(reason, len(job.prompt) - slot.cache_n, slot.cache_n, 1e3 * (first - slot.t_start),
                        slot.n_generated, 1e3 * (now - first), slot.index)
        slot.job, slot.sampler = None, None  # before the client hears: its next /metrics sees the slot free
        del slot.tokens[slot.n_cached:]  # what was never fed (the last sampled token, an unread prompt tail)
        self._outbox.append((job, "done", finish))

    def _fail(self, message: str) -> None:
        self._tell()
        with self._wake:
            self.failed = message
            jobs = [s.job for s in self.slots if s.job is not None] + list(self.waiting)
            self.waiting.clear()
            for slot in self.slots:
                slot.job = None
        for job in jobs:
            job.emit("error", message)


def log_probs(logits: np.ndarray, token: int, n: int) -> tuple[float, list[tuple[int, float]]]:
    """The token's log-probability and the n most likely tokens with theirs, in float32 as llama-server
    computes them (get_token_probabilities): std::partial_sort of the first n by logit, expf of each logit
    less the highest summed one after the other in the order that leaves (a different order moves the
    result by up to ~1e-4), each divided by the sum, logf (of 0: -FLT_MAX, the lowest float, as there:
    JSON has no -inf)."""
    x = np.asarray(logits, dtype=np.float32)
    order = list(range(x.size))
    std_partial_sort(order, x, 0, n, x.size, rest_keys=x[n:])
    high = x[order[0]]
    total = np.add.accumulate(expf(x[order] - high), dtype=np.float32)[-1]
    ids = np.array([token, *order[:n]], dtype=np.int64)
    p = expf(x[ids] - high) / total
    lp = [float(logf(v)) if v > 0 else float(np.finfo(np.float32).min) for v in p]
    return lp[0], [(int(t), v) for t, v in zip(ids[1:], lp[1:])]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
