"""The `until` and `ac` automata of the tool-call grammars (orchestrator/chat/grammars.py), run by our
GBNF engine, against the definition they implement, checked by brute force on every short string:
`until` matches exactly the texts that contain none of the delimiters, `ac` exactly the texts whose
first delimiter ends at their last character. (Whether the grammars are llama-server's is the interop
test's question, tests/interop/test_chat_tools.py.)"""
from __future__ import annotations

import itertools

import pytest

from orchestrator.chat.grammars import ToolGrammar
from orchestrator.sampling.grammar import CompiledGrammar

DELIMITER_SETS = [["aba"], ["aba", "bb"], ["ab", "abcab", "c"], ["a\nb"]]


def _accepts(grammar: CompiledGrammar, text: str) -> bool:
    sid = grammar.initial
    for c in text:
        sid = grammar.step(sid, ord(c))
        if sid < 0:
            return False
    return grammar.can_end(sid)


def _grammar(kind: str, delimiters: list[str]) -> CompiledGrammar:
    g = ToolGrammar()
    g.rule("root", g.until(delimiters) if kind == "until" else g.through(delimiters))
    return CompiledGrammar(g.builder.format(), None)


def _texts(delimiters: list[str], n: int = 7):
    alphabet = sorted({c for d in delimiters for c in d} | {"x"})
    for size in range(n + 1):
        for chars in itertools.product(alphabet, repeat=size):
            yield "".join(chars)


@pytest.mark.parametrize("delimiters", DELIMITER_SETS)
def test_until_matches_the_texts_without_a_delimiter(delimiters):
    grammar = _grammar("until", delimiters)
    for text in _texts(delimiters):
        assert _accepts(grammar, text) == (not any(d in text for d in delimiters)), repr(text)


@pytest.mark.parametrize("delimiters", DELIMITER_SETS)
def test_ac_matches_the_texts_up_to_their_first_delimiter(delimiters):
    grammar = _grammar("ac", delimiters)
    for text in _texts(delimiters):
        first_end = min((text.find(d) + len(d) for d in delimiters if d in text), default=-1)
        assert _accepts(grammar, text) == (first_end == len(text)), repr(text)
