"""orchestrator.tokenizer without llama.cpp: refusals, and properties any correct tokenizer has.

Exact agreement with llama.cpp is checked in tests/interop/test_tokenizer.py; here tiny vocabularies are
written with gguf.GGUFWriter and we check what must hold whatever the merges: pieces spell the text back,
pre-tokenizers cut the text into contiguous words, bad vocabularies are refused by name.
"""
from __future__ import annotations

from pathlib import Path

import gguf
from gguf_vocab import write_vocab_gguf
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.cxx import unordered_map_order
from orchestrator.tokenizer import PRE_TOKENIZERS, TokenizerError, Vocab, codepoint_flags

CONTROL, USER_DEFINED, NORMAL, BYTE = 3, 4, 1, 6


def gpt2_byte_chars() -> list[str]:
    """GPT-2's byte -> character table, derived here independently of the module under test."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def write_vocab(path: Path, *, model: str = "gpt2", pre: str | None = "smollm", **fields) -> Vocab:
    return Vocab.from_gguf(gguf.GGUFReader(write_vocab_gguf(path, model=model, pre=pre, **fields)))


def bpe_vocab(path: Path, pre: str | None = "smollm", **kwargs) -> Vocab:
    space = gpt2_byte_chars()[ord(" ")]
    merges = [("t", "h"), ("th", "e"), (space, "the"), ("i", "n"), (space, "in"), ("1", "2"), ("'", "s")]
    tokens = ["<|endoftext|>", "<|im_end|>", *gpt2_byte_chars()] + [a + b for a, b in merges]
    types = [CONTROL, CONTROL] + [NORMAL] * (len(tokens) - 2)
    return write_vocab(path, pre=pre, tokens=tokens, types=types, merges=[f"{a} {b}" for a, b in merges], **kwargs)


def spm_vocab(path: Path, **kwargs) -> Vocab:
    pieces = ["▁", "▁t", "▁th", "▁the", "he", "in", "▁in", "中", "é"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * len(pieces)
    scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(pieces))]
    return write_vocab(path, model="llama", pre=None, tokens=tokens, types=types, scores=scores, **kwargs)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vocabs")


@pytest.fixture(scope="module", params=sorted(PRE_TOKENIZERS))
def bpe(request, folder) -> Vocab:
    return bpe_vocab(folder / f"bpe-{request.param or 'none'}.gguf", pre=request.param or None)


@pytest.fixture(scope="module")
def spm(folder) -> Vocab:
    return spm_vocab(folder / "spm.gguf")


TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=60) | st.sampled_from(
    ["It's 12345 the\r\n\n  in  ", "<|endoftext|>é中\u00a0\u2003x", "'S 'RE\t\t1.5e3", " "])


@settings(max_examples=60, deadline=None)
@given(text=TEXT)
def test_bpe_pieces_spell_the_text(bpe, text):
    tokens = bpe.tokenize(text, add_special=False, parse_special=False)
    assert b"".join(bpe.token_to_piece(t) for t in tokens) == text.encode()


@settings(max_examples=60, deadline=None)
@given(text=TEXT)
def test_spm_pieces_spell_the_text_after_the_space_prefix(spm, text):
    tokens = spm.tokenize(text, add_special=False, parse_special=False)
    expected = b" " + text.replace("▁", " ").encode() if text else b""  # "▁" is how SPM spells a space
    assert b"".join(spm.token_to_piece(t) for t in tokens) == expected


@settings(max_examples=40, deadline=None)
@given(data=st.binary(max_size=40))
def test_any_bytes_tokenize_or_raise_tokenizer_error(bpe, spm, data):
    for vocab in (bpe, spm):
        try:
            tokens = vocab.tokenize(data)
        except TokenizerError:
            continue
        assert all(0 <= t < vocab.n_tokens for t in tokens)


def test_special_tokens_are_cut_out_only_when_parsed(bpe):
    text = "in<|endoftext|>the"
    parsed = bpe.tokenize(text, add_special=False, parse_special=True)
    literal = bpe.tokenize(text, add_special=False, parse_special=False)
    special = bpe.id_of_text[b"<|endoftext|>"]
    assert special in parsed and special not in literal
    assert bpe.token_to_piece(special) == b"" and bpe.token_to_piece(special, special=True) == b"<|endoftext|>"


@pytest.mark.parametrize("name", sorted(PRE_TOKENIZERS))
@settings(max_examples=40, deadline=None)
@given(text=TEXT)
def test_pre_tokenizers_cut_the_text_into_contiguous_words(name, text):
    flags = codepoint_flags(text)
    spans = [(0, len(text))] if text else []
    for split in PRE_TOKENIZERS[name].splitters:
        spans = split(text, flags, spans)
    assert all(start < end for start, end in spans)
    assert [end for _, end in spans[:-1]] == [start for start, _ in spans[1:]]
    assert (spans[0][0], spans[-1][1]) == (0, len(text)) if text else spans == []


@given(keys=st.lists(st.binary(max_size=12), unique=True, max_size=80))
def test_unordered_map_order_is_a_permutation(keys):
    assert sorted(unordered_map_order(keys)) == list(range(len(keys)))


@pytest.mark.parametrize("model", ["bert", "t5", "rwkv", "gemma4"])
def test_unsupported_tokenizer_model_is_named(tmp_path, model):
    with pytest.raises(TokenizerError, match=model) as raised:
        write_vocab(tmp_path / "v.gguf", model=model, pre=None, tokens=["a", "b"], types=[NORMAL, NORMAL])
    assert isinstance(raised.value, ValueError)


@pytest.mark.parametrize("pre", ["gpt2", "deepseek-llm", "qwen35", "tekken"])
def test_unsupported_pre_tokenizer_is_named(tmp_path, pre):
    with pytest.raises(TokenizerError, match=pre):
        bpe_vocab(tmp_path / "v.gguf", pre=pre)


def test_special_id_of_the_wrong_type_is_refused(tmp_path):
    with pytest.raises(TokenizerError, match="bos_token_id"):
        bpe_vocab(tmp_path / "v.gguf", extra=[("add_int32", "tokenizer.ggml.bos_token_id", 1)])


def test_bpe_without_merges_is_refused(tmp_path):
    with pytest.raises(TokenizerError, match="merges"):
        write_vocab(tmp_path / "v.gguf", tokens=["a", "b"], types=[NORMAL, NORMAL])


def test_byte_token_too_short_for_its_hex_is_refused(tmp_path):
    with pytest.raises(TokenizerError, match="byte token"):
        write_vocab(tmp_path / "v.gguf", model="llama", pre=None, tokens=["<unk>", "ab"], types=[2, BYTE],
                    scores=[0.0, 0.0])
