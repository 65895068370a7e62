"""The draft model's side of speculative decoding: its pipeline, which tokens its cells hold per slot, and
the drafting itself (stepwise for any number of slots at once, from the draft's ring, or from its chain on
a llama.cpp worker), including the background thread on which it reads a new prompt and drafts ahead while
the target verifies. The Speculator (engine/speculative.py) decides what to draft and verifies it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np

from orchestrator.engine.batching import Piece, Planner
from orchestrator.engine.slots import common_prefix
from orchestrator.pipeline.chain import Chain, ChainStep
from orchestrator.pipeline.client import Channel
from orchestrator.pipeline.kv import Batch
from orchestrator.pipeline.ring import Ring

DRAFT_TOP_K = 10  # the draft's sampler in common/speculative.cpp: top_k 10, then the target's temperature


def ranked_top(logits: np.ndarray, k: int = DRAFT_TOP_K) -> tuple[np.ndarray, np.ndarray]:
    """The draft's candidates: the ids of the k highest logits, highest first, and those logits (float32),
    as the sampled ring's graph ranks them (graph/llama.py's sample_tail; exact ties aside)."""
    x = np.asarray(logits, dtype=np.float32)
    top = np.argpartition(-x, k - 1)[:k] if len(x) > k else np.arange(len(x))
    ids = top[np.argsort(-x[top], kind="stable")].astype(np.int32)
    return ids, x[ids]


def candidates_distribution(n_vocab: int, ids: np.ndarray, logits: np.ndarray, temp: float) -> np.ndarray:
    """q over the whole vocabulary (float64): the softmax of the candidates' logits over the temperature
    (1 for a greedy job), nothing elsewhere."""
    z = np.asarray(logits, dtype=np.float64) / (temp if temp > 0 else 1.0)
    e = np.exp(z - z.max())
    q = np.zeros(n_vocab)
    q[ids] = e / e.sum()
    return q


def draft_distribution(logits: np.ndarray, temp: float) -> np.ndarray:
    """q: what the pinned llama.cpp's draft sampler draws from (spec_retune: top-k 10, then the target's
    temperature; temperature 1 for a greedy job), as float64 over the whole vocabulary."""
    return candidates_distribution(len(logits), *ranked_top(logits), temp)


def draw_noise(seed: int, key: int, temp: float, k: int = DRAFT_TOP_K) -> np.ndarray:
    """The temperature times Gumbel noise for the draft's draw of a job's token number `key`: a function of
    the job's seed and that number alone, so that a drafted token is the same whenever, however (stepwise,
    from the draft's ring, ahead of its block) and however often it is drafted: a job's drafts do not
    depend on timing. Independent draws: a number's noise is used again only after a rejection before it,
    when its earlier draw was never verified."""
    return (temp * np.random.default_rng((seed, key)).gumbel(size=k)).astype(np.float32)


def row_noise(r: "DraftRequest", i: int, k: int) -> np.ndarray:
    """The draw_noise of a request's i-th draft among k candidates (none for a greedy job's)."""
    return np.zeros(k, np.float32) if r.seed is None else draw_noise(r.seed, r.key + i, r.temp, k)


def draw(ids: np.ndarray, logits: np.ndarray, noise: np.ndarray) -> int:
    """The Gumbel-max draw from the ranked candidates: the one whose logit plus noise is the largest (the
    last of equal ones, as ggml's ARGMAX in sample_tail), which is distributed as
    candidates_distribution(..., temp) when noise is temp times independent Gumbel noise."""
    scores = np.asarray(logits, np.float32) + noise[:len(ids)]
    return int(ids[len(scores) - 1 - int(np.argmax(scores[::-1]))])


class Drafter:
    """The draft model's pipeline and, per slot, which tokens its cells hold (cell i: position i of the
    slot's run, as the engine's Planner lays them out).

    A draft with sliding-window layers runs with a full-size cache for them (swa_full: their cells are the
    global layers', the window a mask), so that a rejected draft's cells are dropped as any others are.

    Drafts come from the ring (pipeline/ring.py) when the draft's workers can run one: the draft's last
    stage picks each token (its most likely, or a job's draw with draw_noise) and feeds it back to its
    first, so k drafted tokens cost one round trip to the draft's workers instead of k. Each step holds
    each drafting slot's row as the Planner places it (its own cells, as a stepwise draft's), so the ring
    serves any slots at once. Where no ring runs (llama.cpp's rpc-server) and the draft lies on one worker,
    its chain (pipeline/chain.py) makes a block in one graph, for any slots too."""

    def __init__(self, pipe, n_slots: int):
        if pipe.n_swa and pipe.n_ctx_swa != pipe.n_ctx:
            raise ValueError("the draft's sliding-window layers share the global cells: build it with swa_full")
        self.pipe = pipe
        self.planner = Planner(n_slots, pipe.n_ctx, pipe.n_ubatch, flash_attn=pipe.flash_attn,
                               cache_types=pipe.cache_types, n_swa=pipe.n_swa)
        self.cached: list[list[int]] = [[] for _ in range(n_slots)]
        # the ring, or else a chain where the draft lies on one worker (not for sliding-window layers: the
        # ring places their cells as llama.cpp's iSWA cache does)
        ring, chain = Ring(pipe, []), Chain(pipe)
        self.ring = ring if not pipe.n_swa and ring.why_not() is None and ring.setup() else None
        self.chain = chain if not (self.ring or pipe.n_swa) and chain.why_not() is None and chain.setup() else None
        # a draft sharing the target's connection to a llama.cpp worker (a Channel) uses it from the engine's
        # thread only: no reading ahead, no drafting ahead (the worker, computing one graph at a time, would
        # make them wait for the target's step anyway)
        self.background = not any(isinstance(s.client, Channel) for s in pipe.stages)
        self.catch_up_s = 0.0  # what the last draft spent catching up (a read ahead's wait, tokens it had not seen)
        self.step_s: float | None = None  # what one more draft cost in the last draft() (None: not measured)
        self.ahead: dict[int, tuple[list[int], list[np.ndarray]]] = {}  # draft_ahead()'s by slot, once wait() returned
        self._thread: threading.Thread | None = None  # read_ahead()'s or draft_ahead()'s, until wait() joins it
        self._thread_error: BaseException | None = None
        self._stop = threading.Event()  # asks draft_ahead()'s drafting to end after its current step

    def _background(self, name: str, work) -> None:
        """Runs work() on the draft's one background thread; wait() joins it and raises what it met."""
        def run() -> None:
            try:
                work()
            except BaseException as exc:  # noqa: BLE001 - raised again by wait(), in the engine's thread
                self._thread_error = exc

        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()

    def read_ahead(self, slot: int, prompt: list[int]) -> None:
        """Starts feeding the slot a new prompt (what its cells lack of it) on a thread of its own, so that
        the draft reads it while the target does, not after the first token; the draft's next use waits for
        it (wait()). Nothing is started while an earlier read runs (the slot's first draft reads it then)."""
        if not self.background or (self._thread is not None and self._thread.is_alive()
                                   and self._thread.name == "draft-read-ahead"):
            return
        self.stop_ahead()  # a new request's first token matters more than another slot's drafts ahead
        self.wait()
        keep = common_prefix(self.cached[slot], prompt)
        if keep == len(prompt):
            return

        def read() -> None:
            self._feed(slot, prompt[keep:], keep)
            self.cached[slot] = list(prompt)

        self.cached[slot] = list(prompt[:keep])  # until the read is done
        self._background("draft-read-ahead", read)

    def draft_ahead(self, requests: list["DraftRequest"]) -> None:
        """Starts drafting for the requests on the background thread (while the target verifies the slots'
        blocks, each request's sequence assuming its block is kept whole); `ahead` has the tokens once
        wait() returns. stop_ahead() ends it after the draft step under way (its guesses are stale)."""
        self.wait()
        self._stop.clear()
        self.ahead = {}

        def draft() -> None:
            for r, drafted in zip(requests, self.draft_each(requests, self._stop)):
                self.ahead[r.slot] = drafted

        self._background("draft-ahead", draft)

    def stop_ahead(self) -> None:
        self._stop.set()

    def wait(self) -> None:
        """Waits for the background thread (read_ahead()'s, draft_ahead()'s); raises what it met (a
        WorkerError: the engine recovers). A no-op on that thread itself (draft_ahead() drafts there)."""
        if self._thread is threading.current_thread():
            return
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        error, self._thread_error = self._thread_error, None
        if error is not None:
            raise error

    def room(self, n_tokens: int) -> int:
        """Tokens that can be drafted after a sequence of n_tokens (the draft's cells of a slot)."""
        return max(0, self.planner.size - n_tokens)

    def _feed(self, slot: int, tokens: list[int], start: int) -> np.ndarray:
        """Feeds tokens at positions start.. in ubatch pieces; the last one's logits."""
        logits = None
        for u in range(0, len(tokens), self.pipe.n_ubatch):
            chunk = tokens[u:u + self.pipe.n_ubatch]
            s = start + u
            piece = Piece(slot, chunk, s, self.planner.path(len(chunk), s + len(chunk)), True)
            batch, _ = self.planner.batch([piece])
            logits = self.pipe.run(batch)[-1]
        return logits

    def draft_each(self, requests: list["DraftRequest"], stop: threading.Event | None = None
                   ) -> list[tuple[list[int], list[np.ndarray]]]:
        """draft() for each request: from the draft's ring where it serves them all (_ring_serves), else
        from its chain where it runs (not to stop at a probability either), else stepwise (draft_many)."""
        if not any(r.p_min > 0 for r in requests):  # (the ring's and the chain's picks have no probabilities)
            if self._ring_serves(requests):
                return self._draft_ring(requests)
            if self.chain is not None:
                return self._draft_chain(requests)
        return self.draft_many(requests, stop)

    def draft(self, slot: int, sequence: list[int], n_max: int, p_min: float, temp: float, seed: int | None,
              stop: threading.Event | None = None, key: int = 0) -> tuple[list[int], list[np.ndarray]]:
        """Up to n_max tokens after `sequence`: the draft's most likely token (seed None) or draws from
        draft_distribution, the i-th with draw_noise(seed, key + i, temp); drafting stops before a position
        whose most likely token has a probability below p_min (common_speculative's "only collect very
        high-confidence draft tokens"). Returns the tokens and the distribution each was drawn from (for
        speculative sampling; none for the most likely tokens from the ring)."""
        return self.draft_each([DraftRequest(slot, sequence, n_max, p_min, temp, seed, key)], stop)[0]

    def draft_many(self, requests: list["DraftRequest"], stop: threading.Event | None = None
                   ) -> list[tuple[list[int], list[np.ndarray]]]:
        """draft() for several slots at once, stepwise: each step one batch of every slot still drafting
        (its first: what the slot's cells lack of its sequence), so k drafts of any number of slots cost k
        round trips to the draft's workers, not k per slot. catch_up_s: the seconds spent waiting for a
        read ahead and feeding what would not fit in the first step (not drafting's price). `stop` set:
        no step after the one under way."""
        waited = time.perf_counter()
        self.wait()
        self.step_s = None
        feeds, read = {}, False  # per request: the tokens its slot is fed next, and from which position
        for i, r in enumerate(requests):
            keep = min(common_prefix(self.cached[r.slot], r.sequence), len(r.sequence) - 1)
            read |= len(r.sequence) - keep > 2  # more than the target's token and the last draft: a prompt
            if len(r.sequence) - 1 - keep > self.pipe.n_ubatch // len(requests) - 1:  # too long to share a step
                self._feed(r.slot, r.sequence[keep:-1], keep)
                keep = len(r.sequence) - 1
            feeds[i] = (list(r.sequence[keep:]), keep)
        began = time.perf_counter()
        self.catch_up_s = began - waited
        fed = [list(r.sequence) for r in requests]
        results: list[tuple[list[int], list[np.ndarray]]] = [([], []) for _ in requests]
        while feeds:
            pieces = [Piece(requests[i].slot, tokens, start, self.planner.path(len(tokens), start + len(tokens)), True)
                      for i, (tokens, start) in feeds.items()]
            batch, order = self.planner.batch(pieces)
            rows = dict(zip((p.slot for p in order), self.pipe.run(batch)))
            for i in list(feeds):
                r = requests[i]
                tokens, dists = results[i]
                row = rows[r.slot]
                ids, logits = ranked_top(row)
                q = candidates_distribution(len(row), ids, logits, r.temp if r.seed is not None else 1.0)
                del feeds[i]
                if q.max() < r.p_min:
                    continue
                if r.seed is None:
                    token = int(np.argmax(q))
                else:
                    token = draw(ids, logits, draw_noise(r.seed, r.key + len(tokens), r.temp, len(ids)))
                tokens.append(token)
                dists.append(q)
                if len(tokens) < r.n_max:
                    feeds[i] = ([token], len(fed[i]))
                    fed[i].append(token)
            if stop is not None and stop.is_set():
                for i in feeds:  # drafted but not fed
                    fed[i].pop()
                break
        for r, sequence in zip(requests, fed):
            self.cached[r.slot] = sequence
        most = max(len(tokens) for tokens, _ in results)
        if most and not read:  # a step per draft, the first also feeding the target's token (and the last draft,
            # never fed, after a block kept whole); one of a new job's prompt would not tell
            self.step_s = (time.perf_counter() - began) / most
        return results

    def catch_up(self, sequence: list[int], start: int, slot: int = 0) -> None:
        """Feeds the slot the tokens of sequence[:start] its cells lack (the prompt, what the target's ring
        made, or what a ring that broke left unfed); catch_up_s: the seconds it took, a read ahead's wait
        included (the price of switching to drafting, not counted in drafting's rate)."""
        began = time.perf_counter()
        self.wait()
        keep = min(common_prefix(self.cached[slot], sequence), start)
        if keep < start:
            self._feed(slot, sequence[keep:start], keep)
        self.catch_up_s = time.perf_counter() - began

    def _ring_serves(self, requests: list["DraftRequest"]) -> bool:
        """The draft's ring can draft for these slots at once: it runs, and each slot's rows keep one
        attention path over the run (a row changing path would change the rows' order in the batch, which
        the tokens going round keep)."""
        if self.ring is None:
            return False
        if len(requests) == 1:
            return True
        limit = self._ring_limit(requests)
        path = self.planner.path
        return all(path(1, len(r.sequence)) == path(1, len(r.sequence) - 1 + limit) for r in requests)

    def _ring_limit(self, requests: list["DraftRequest"]) -> int:
        """Steps of a ring run for the requests: one more than the most any wants, within every slot's cells."""
        return min(max(r.n_max for r in requests) + 1, *(self.planner.size - len(r.sequence) + 1 for r in requests))

    def _draft_ring(self, requests: list["DraftRequest"]) -> list[tuple[list[int], list[np.ndarray]]]:
        """The requests' drafts from the ring, one row a slot in each step (its own cells, as stepwise):
        one token more than the most wanted, so that the cells hold every token drafted (the next call then
        starts at the last token, after a rejection or none). Sampled rows are drawn on the worker with
        their draw_noise (greedy rows beside them with none: the most likely token)."""
        began = time.perf_counter()
        starts = [len(r.sequence) - 1 for r in requests]
        for r, start in zip(requests, starts):
            self.catch_up(r.sequence, start, r.slot)
        self.catch_up_s = time.perf_counter() - began
        self.step_s = None
        k = min(DRAFT_TOP_K, self.pipe.model.hparams.n_vocab)

        def pieces(i: int) -> list[Piece]:
            return [Piece(r.slot, [0], start + i, self.planner.path(1, start + i + 1), True)
                    for r, start in zip(requests, starts)]

        first = pieces(0)
        rows = [next(j for j, piece in enumerate(first) if piece is q) for q in self.planner.batch(first)[1]]

        def place(i: int) -> Batch:
            return self.planner.batch(pieces(i))[0]

        def noise(i: int) -> np.ndarray:
            return np.concatenate([row_noise(requests[j], i, k) for j in rows])

        sampled = any(r.seed is not None for r in requests)
        made: list[list] = [[] for _ in requests]
        times = []
        for got in self.ring.run([requests[j].sequence[-1] for j in rows], 0, self._ring_limit(requests), place,
                                 *((noise, k) if sampled else ())):
            for j, row in zip(rows, got):
                made[j].append(row)
            times.append(time.perf_counter())
        if len(times) > 1:  # what one more draft costs: the step, not the round trip to the draft's workers,
            # which is the block's once (stepwise, each draft costs a round trip and a step: draft_many())
            self.step_s = (times[-1] - times[0]) / (len(times) - 1)
        results = [self._made(r, rows_made, sampled) for r, rows_made in zip(requests, made)]
        if self.ring.broken is not None:  # a push failed: stepwise from now on
            self.ring = None
        return results

    def _draft_chain(self, requests: list["DraftRequest"]) -> list[tuple[list[int], list[np.ndarray]]]:
        """The requests' drafts from the chain, in one compute: its first step feeds each slot what its
        cells lack of its sequence (after a block kept whole: the last draft and the target's token), each
        step after it the tokens the step before picked for the slots still drafting, so that a slot's k
        drafts take k steps, as stepwise. A prompt too long for its share of a step is read before."""
        began = time.perf_counter()
        keeps = []
        for r in requests:
            keep = min(common_prefix(self.cached[r.slot], r.sequence), len(r.sequence) - 1)
            if len(r.sequence) - keep > self.pipe.n_ubatch // len(requests):
                self.catch_up(r.sequence, len(r.sequence) - 1, r.slot)
                keep = len(r.sequence) - 1
            keeps.append(keep)
        self.catch_up_s = time.perf_counter() - began
        k = min(DRAFT_TOP_K, self.pipe.model.hparams.n_vocab)
        sampled = any(r.seed is not None for r in requests)
        steps = []
        for i in range(max(r.n_max for r in requests)):
            pieces = {}
            for j, (r, keep) in enumerate(zip(requests, keeps)):
                if i < r.n_max:
                    tokens, start = (r.sequence[keep:], keep) if i == 0 else ([0], len(r.sequence) - 1 + i)
                    pieces[j] = Piece(r.slot, tokens, start, self.planner.path(len(tokens), start + len(tokens)), True)
            batch, order = self.planner.batch(list(pieces.values()))
            owners = [next(j for j, q in pieces.items() if q is piece) for piece in order]
            noise = np.stack([row_noise(requests[j], i, k) for j in owners]) if sampled else None
            steps.append(ChainStep(batch, owners, noise))
        picks = self.chain.run(steps, k)
        # what one more draft costs: a step (not for a block whose first step also read part of a prompt)
        read = any(len(r.sequence) - keep > 2 for r, keep in zip(requests, keeps))
        self.step_s = None if read else self.chain.step_s
        return [self._made(r, [step[j] for step in picks if j in step], sampled) for j, r in enumerate(requests)]

    def _made(self, r: "DraftRequest", rows: list, sampled: bool) -> tuple[list[int], list[np.ndarray]]:
        """A request's drafts from what the ring or the chain made for its row (tokens, or Draws where the
        run was sampled), each fed but the last (a broken ring's first not even sequence[-1]); a sampled
        job's with the distribution each was drawn from."""
        tokens = [row.token for row in rows] if sampled else list(rows)
        self.cached[r.slot] = list(r.sequence) + tokens[:-1] if tokens else list(r.sequence[:-1])
        n_vocab = self.pipe.model.hparams.n_vocab
        dists = [] if r.seed is None else [candidates_distribution(n_vocab, row.ids, row.logits, r.temp)
                                           for row in rows[:r.n_max]]
        return tokens[:r.n_max], dists

    def close(self) -> None:
        self.pipe.close()  # (a read still running meets the closed connections and ends)
        try:
            self.wait()
        except Exception:  # noqa: BLE001 - closing: what it met no longer matters
            pass


@dataclass
class DraftRequest:
    """What draft() is asked for one slot."""

    slot: int
    sequence: list[int]
    n_max: int
    p_min: float
    temp: float
    seed: int | None  # the job's seed for draw_noise; None: the draft's most likely tokens
    key: int = 0  # the job's number of the first token drafted (draw_noise's key; the i-th: key + i)
