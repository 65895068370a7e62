"""The GBNF parser and the UTF-8 decoder without a vocabulary (libllama's answers are checked in
tests/interop/test_grammar.py; here: invariants and what needs no oracle)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.sampling.gbnf import Element, GrammarError, check_left_recursion, parse_gbnf
from orchestrator.sampling.token_trie import decode_utf8

GBNF_ALPHABET = st.sampled_from(list('root ::= "ab\\\\[]^-|()*+?{}0123456789,.<>!#\n\t xyz\u00e9\u3042'))


@settings(max_examples=400, deadline=None)
@given(st.lists(GBNF_ALPHABET, max_size=40).map("".join))
def test_any_text_parses_or_raises_grammar_error(text):
    try:
        rules, symbols = parse_gbnf(text)
    except GrammarError as exc:
        assert str(exc)
        return
    for rule in rules:  # every rule ends, and every reference points at a defined rule
        assert rule and rule[-1][0] == Element.END
        assert all(value < len(rules) and rules[value] for kind, value in rule if kind == Element.RULE_REF)
    try:
        check_left_recursion(rules)
    except GrammarError:
        pass


def test_repetitions_expand_into_numbered_rules():
    rules, symbols = parse_gbnf('root ::= "a"{2,3} [b-d]* x?\nx ::= "x"')
    assert set(symbols) == {"root", "root_1", "root_2", "x", "root_4"}  # numbered as llama.cpp numbers them
    root = rules[symbols["root"]]
    assert root[:2] == [(Element.CHAR, ord("a")), (Element.CHAR, ord("a"))]
    assert (Element.CHAR_RNG_UPPER, ord("d")) in rules[symbols["root_2"]]


def test_token_names_need_a_vocabulary():
    try:
        parse_gbnf("root ::= <think>")
    except GrammarError as exc:
        assert str(exc) == "no vocab to parse token at <think>"
    else:
        raise AssertionError("a <name> token parsed without a vocabulary")
    rules, _ = parse_gbnf("root ::= <[42]> !<[7]>")
    assert rules[0][:2] == [(Element.TOKEN, 42), (Element.TOKEN_NOT, 7)]


@given(st.text(max_size=12), st.integers(0, 12))
def test_decode_matches_python_for_valid_utf8_split_anywhere(text, cut):
    data = text.replace("\0", "").encode()
    cut = min(cut, len(data))
    first, partial = decode_utf8(data[:cut], (0, 0))
    second, rest = decode_utf8(data[cut:], partial)
    assert rest[1] == 0
    assert first + second == [ord(c) for c in text.replace("\0", "")]


def test_decode_marks_invalid_sequences():
    assert decode_utf8(b"\x80abc", (0, 0)) == ([], (0, -1))  # a continuation byte first
    assert decode_utf8(b"a", (0b1110, 1)) == ([], (0, -1))  # a pending sequence not continued
    assert decode_utf8(b"ab\0cd", (0, 0)) == ([97, 98], (98, 0))  # a NUL ends the piece


def test_deep_nesting_is_a_grammar_error_not_a_crash():
    from orchestrator.sampling.json_schema import json_schema_to_grammar
    from orchestrator.sampling.schema_tree import SchemaError

    try:
        parse_gbnf("root ::= " + "(" * 5000 + '"a"' + ")" * 5000)
    except GrammarError as exc:
        assert "deep" in str(exc)
    else:
        raise AssertionError("5000 nested groups parsed")
    schema = {"type": "string"}
    for _ in range(3000):
        schema = {"type": "array", "items": schema}
    try:
        json_schema_to_grammar(schema)
    except SchemaError as exc:
        assert "deep" in str(exc)
    else:
        raise AssertionError("a 3000-deep schema converted")
