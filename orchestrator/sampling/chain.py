"""The sampler chain of one sequence: its options (SamplingParams) and the chain built from them (Sampler)."""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field

import numpy as np

from orchestrator.cxx import F32, uniform_canonical
from orchestrator.sampling.grammar import GrammarSampler, regex_escape
from orchestrator.sampling.samplers import Candidates, Dist, LogitBias, MinP, Penalties, Temperature, TopK, TopP

LLAMA_DEFAULT_SEED = 0xFFFFFFFF  # "pick a random seed", as in include/llama.h


@dataclass
class SamplingParams:
    """The sampling options of llama-completion, with common_params_sampling's defaults."""
    temp: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int = LLAMA_DEFAULT_SEED
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, bias) in order; -inf bans a token
    grammar: str | None = None  # GBNF text; None or "": unconstrained
    grammar_lazy: bool = False  # constrain only once a trigger has appeared
    # (kind, value), kind as common_grammar_trigger_type: "word" (text), "pattern" (a regex searched in the
    # generated text), "pattern_full" (a regex the whole text must match), "token" (a token id)
    grammar_triggers: list[tuple[str, str | int]] = field(default_factory=list)
    preserved_tokens: list[str] = field(default_factory=list)  # kept for the chat layer; no effect on sampling
    # common_grammar_type: "user" (a request's own grammar), "output_format" (from a JSON schema), "tool_calls"
    # (a chat template's); the last two are fed the generation prompt's tokens first, unless lazy
    grammar_type: str = "user"
    generation_prompt: str = ""  # what the chat template put after the last message (e.g. "<|im_start|>assistant\n")

    def validate(self) -> None:
        """The checks common_sampler_init makes before building the chain."""
        if not (math.isfinite(self.repeat_penalty) and self.repeat_penalty > 0
                and math.isfinite(1.0 / F32(self.repeat_penalty))):
            raise ValueError("repeat_penalty must be finite and greater than 0")
        if not (math.isfinite(self.frequency_penalty) and math.isfinite(self.presence_penalty)):
            raise ValueError("frequency_penalty and presence_penalty must be finite")
        if self.repeat_last_n < 0:
            raise ValueError("repeat_last_n must be >= 0")
        for kind, _ in self.grammar_triggers:
            if kind not in TRIGGER_KINDS:
                raise ValueError(f"unknown grammar trigger type {kind!r}; expected one of {', '.join(TRIGGER_KINDS)}")
        if self.grammar and self.grammar_lazy and not self.grammar_triggers:
            raise ValueError("Error: no triggers set for lazy grammar!")

    def grammar_sampler(self, vocab) -> GrammarSampler | None:
        """common_sampler_init's grammar sampler: the triggers turned into patterns and tokens, the root
        rule "root", the generation prompt accepted. GrammarError (a ValueError) for a grammar libllama
        refuses or a generation prompt it does not accept."""
        if not self.grammar:
            return None
        patterns, tokens = [], []
        for kind, value in self.grammar_triggers:
            if kind == "word":
                patterns.append(regex_escape(str(value)))
            elif kind == "pattern":
                patterns.append(str(value))
            elif kind == "pattern_full":
                value = str(value)
                patterns.append(("" if value.startswith("^") else "^") + value + ("" if value.endswith("$") else "$")
                                if value else "^$")
            else:
                tokens.append(int(value))
        if not self.grammar_lazy:
            patterns, tokens = [], []  # llama_sampler_init_grammar: triggers are not used
        grammar = GrammarSampler(self.grammar, vocab, lazy=self.grammar_lazy, trigger_patterns=patterns,
                                 trigger_tokens=tokens)
        if not self.grammar_lazy and self.grammar_type != "user":  # common_sampler_init's prefill: a tool call's
            for token in prefill_tokens(vocab, self.generation_prompt):  # grammar starts at the generation prompt
                grammar.accept(token)  # GrammarError where it (a prefilled message) does not fit the grammar
        return grammar

    @property
    def greedy(self) -> bool:
        """The chain always picks the highest logit: temperature <= 0 and no penalty that would change
        the logits first (top-k/p and min-p keep the highest one)."""
        penalized = self.repeat_last_n != 0 and (self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0
                                                 or self.presence_penalty != 0.0)
        return self.temp <= 0 and not penalized


def prefill_tokens(vocab, generation_prompt: str) -> list[int]:
    """common_sampler_init's prefill: the generation prompt's tokens (special tokens parsed), less a first
    token that is a space the prompt does not start with (some tokenizers add one)."""
    if not generation_prompt:
        return []
    tokens = vocab.tokenize(generation_prompt, add_special=False, parse_special=True)
    if tokens and vocab.token_to_piece(tokens[0], special=True)[:1].isspace() and not generation_prompt[0].isspace():
        tokens = tokens[1:]
    return tokens


TRIGGER_KINDS = ("word", "pattern", "pattern_full", "token")  # common_grammar_trigger_type, in its order


def random_seed() -> int:
    """What get_rng_seed does for LLAMA_DEFAULT_SEED: a fresh 32-bit seed from the OS."""
    return secrets.randbits(32)


class Sampler:
    """One sequence's sampler: call sample() for a token, then accept() it (and accept every
    prompt token first with is_generated=False, as llama-server does, so penalties see the prompt too
    and the grammar does not).

    With a grammar it is common_sampler_sample without grammar_first (llama-server's way): the chain
    draws a token first; only if the grammar rejects it are the logits masked by the grammar and the
    whole chain run again (a second draw from the same RNG)."""

    def __init__(self, params: SamplingParams, n_vocab: int, vocab=None):
        params.validate()
        self.params = params
        self.n_vocab = n_vocab
        self.grammar = params.grammar_sampler(vocab) if params.grammar else None
        self._bias = LogitBias(params.logit_bias) if params.logit_bias else None
        self._penalties = None
        if params.repeat_last_n != 0 and not (F32(params.repeat_penalty) == 1.0 and F32(params.frequency_penalty) == 0.0
                                              and F32(params.presence_penalty) == 0.0):
            self._penalties = Penalties(params.repeat_last_n, params.repeat_penalty,
                                        params.frequency_penalty, params.presence_penalty)
        optional = [
            (params.top_k > 0, lambda: TopK(params.top_k)),
            (F32(params.top_p) < 1.0, lambda: TopP(params.top_p)),
            (F32(params.min_p) > 0.0, lambda: MinP(params.min_p)),
            (F32(params.temp) != 1.0, lambda: Temperature(params.temp)),
        ]
        self._filters = [make() for enabled, make in optional if enabled]
        self._greedy = params.greedy and self._penalties is None
        self.reset()

    def reset(self) -> None:
        """common_sampler_reset: forget the history and reseed (a fresh random seed if it was random); the
        grammar keeps its state, as there."""
        if self._penalties is not None:
            self._penalties.window.clear()
            self._penalties.count.clear()
        seed = self.params.seed & 0xFFFFFFFF  # --seed goes through stoul into a uint32_t
        self.seed = random_seed() if seed == LLAMA_DEFAULT_SEED else seed
        self._dist = Dist(self.seed)

    def candidates(self, logits: np.ndarray, grammar: bool = False) -> Candidates:
        """Run every sampler up to and including the draw; the chosen one is at `.selected`. With
        `grammar`, the grammar masks the logits first."""
        logits = np.asarray(logits)
        if logits.shape != (self.n_vocab,):
            raise ValueError(f"expected {self.n_vocab} logits, got shape {logits.shape}")
        c = Candidates(logits)
        if grammar:
            self.grammar.apply(c)
        if self._bias is not None:
            self._bias.apply(c)
        if self._penalties is not None:
            self._penalties.apply(c)
        for sampler in self._filters:
            sampler.apply(c)
        self._dist.apply(c)
        return c

    def probabilities(self, logits: np.ndarray) -> np.ndarray:
        """The distribution the chain draws from (without a grammar): every sampler up to the draw, then
        the softmax of the candidates left, as float64 over the whole vocabulary (speculative sampling)."""
        logits = np.asarray(logits)
        if logits.shape != (self.n_vocab,):
            raise ValueError(f"expected {self.n_vocab} logits, got shape {logits.shape}")
        c = Candidates(logits)
        if self._bias is not None:
            self._bias.apply(c)
        if self._penalties is not None:
            self._penalties.apply(c)
        for sampler in self._filters:
            sampler.apply(c)
        x = c.logits.astype(np.float64)
        e = np.where(np.isfinite(x), np.exp(x - x[np.isfinite(x)].max()), 0.0)
        p = np.zeros(self.n_vocab)
        p[c.ids] = e / e.sum()
        return p

    def sample(self, logits: np.ndarray) -> int:
        token = self._sample_unconstrained(logits)
        if self.grammar is None or self.grammar.allows(token):
            return token
        masked = np.array(logits, dtype=F32)  # the grammar first, then the whole chain again
        if masked.shape == (self.n_vocab,):
            masked[~self.grammar.allowed_mask()] = -np.inf
        return self._sample_unconstrained(masked)

    def _sample_unconstrained(self, logits: np.ndarray) -> int:
        if self._greedy:  # the chain would keep the highest logit alone: when that one is unique, take it
            logits = np.asarray(logits)
            if self._bias is not None and logits.shape == (self.n_vocab,):
                c = Candidates(logits)
                self._bias.apply(c)
                logits = c.logits
            top = int(np.argmax(logits))
            if logits.shape == (self.n_vocab,) and np.count_nonzero(logits == logits[top]) == 1:
                uniform_canonical(self._dist.rng)  # the draw the chain's dist makes, so the streams stay equal
                return top
        c = self.candidates(logits)
        return int(c.ids[c.selected])

    def accept(self, token: int, is_generated: bool = True) -> None:
        """common_sampler_accept: the grammar moves on by generated tokens only. GrammarError if the
        grammar cannot take the token (it was not sampled under the grammar)."""
        if self.grammar is not None and is_generated:
            self.grammar.accept(int(token))
        if self._penalties is not None:
            self._penalties.accept(int(token))
