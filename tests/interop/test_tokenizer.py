"""orchestrator.tokenizer against llama.cpp's own tokenizer.

Oracles: the pinned `llama-tokenize` on SmolLM2 (BPE, pre-tokenizer "smollm"), and libllama itself through
ctypes for everything else: vocabularies built from SmolLM2's tokens with the other pre-tokenizers, and a
SentencePiece vocabulary with scores and <0xNN> byte tokens. libllama runs in a child process (the oracle
functions below, sent to `python -c`) so that a crash there fails one test instead of killing pytest.
"""
from __future__ import annotations

import ctypes
import json
import random
from pathlib import Path

import gguf
from gguf_vocab import write_vocab_gguf
import pytest

from orchestrator.tokenizer import Vocab, codepoint_flag

from . import libllama_child

pytestmark = pytest.mark.interop

ORACLE_TIMEOUT = 120
MODES = [(True, True), (True, False), (False, True), (False, False)]  # (add_special, parse_special)

TEXTS = [
    "Hello world! It's a test. We're here, they've gone, I'm ok, you'll see, he'd go. DON'T SHOUT'S",
    "def foo(x):\n    return x ** 2  # comment\n\n\tif x:\n\t\tpass\n",
    "Café naïve résumé — über straße ÀÉÎÕÜ e\u0301 n\u0303",
    "Emoji: 😀🎉👍🏽 👨\u200d👩\u200d👧\u200d👦 ❤️",
    "中文测试，日本語のテキスト、한국어 텍스트",
    "    lots   of     spaces\n\n\n\nnewlines\r\n\r\ntabs\t\t\t end   ",
    "Numbers: 1234567890 3.14159 1,000,000 12345678901234567890 ١٢٣ ⅷ ²³",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><reponame>x<file_sep>  <s> </s><tool> <unused0>▁<PRE>",
    "  leading and trailing  ",
    "a'b 'S 'T 'RE x'll y'VE 'd'm",
    "\u00a0nbsp\u2003emspace\u3000ideographic\u0085nel\u2028line",
    "$100 + 5 = <tag> ^ ~ | `code` @user #hash %50 &amp; «quotes» ¿qué? 【括号】",
    " ",
    "\n",
    "",
]
# bytes that are not UTF-8: lone continuation, truncated sequences, surrogates, overlong forms
RAW_TEXTS = [b"abc\xff\xfe def \xe2\x82 xyz", b"\xed\xa0\x80 surrogate \xc0\x80 overlong \xf0\x9f", b"\x80\x80 1\xc3"]


# --- the libllama oracle (child process side) -----------------------------------------------------------------

def _oracle_main(lib, vocab, request) -> dict:
    vp, token = ctypes.c_void_p, ctypes.c_int32
    lib.llama_tokenize.argtypes = [vp, ctypes.c_char_p, ctypes.c_int32, ctypes.POINTER(token), ctypes.c_int32,
                                   ctypes.c_bool, ctypes.c_bool]
    lib.llama_token_to_piece.argtypes = [vp, token, ctypes.c_char_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_bool]
    lib.llama_vocab_is_eog.argtypes = [vp, token]
    lib.llama_vocab_is_eog.restype = ctypes.c_bool
    getters = ("n_tokens", "bos", "eos", "eot", "get_add_bos", "get_add_eos")
    for name in getters:
        getattr(lib, f"llama_vocab_{name}").argtypes = [vp]
    lib.llama_vocab_get_add_bos.restype = lib.llama_vocab_get_add_eos.restype = ctypes.c_bool
    result = {name: getattr(lib, f"llama_vocab_{name}")(vocab) for name in getters}
    n_tokens = result["n_tokens"]

    def tokenize(text: bytes, add_special: bool, parse_special: bool) -> list[int]:
        out = (token * (len(text) + 8))()
        n = lib.llama_tokenize(vocab, text, len(text), out, len(out), add_special, parse_special)
        assert n >= 0, f"llama_tokenize wants {-n} slots"
        return out[:n]

    def piece(token_id: int, special: bool) -> str:
        buf = ctypes.create_string_buffer(256)
        n = lib.llama_token_to_piece(vocab, token_id, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = lib.llama_token_to_piece(vocab, token_id, buf, len(buf), 0, special)
        return buf.raw[:n].hex()

    result["tokens"] = [[tokenize(bytes.fromhex(text), *mode) for mode in modes] for text, modes in request["texts"]]
    result["pieces"] = [[piece(i, False), piece(i, True)] for i in range(n_tokens)]
    result["eog"] = [i for i in range(n_tokens) if lib.llama_vocab_is_eog(vocab, i)]
    if request["flags"]:  # unicode.cpp's table, as runs of (first codepoint, category and whitespace bits)
        flag_of = getattr(lib, "_Z26unicode_cpt_flags_from_cptj")  # unicode_cpt_flags_from_cpt(uint32_t)
        flag_of.argtypes, flag_of.restype = [ctypes.c_uint32], ctypes.c_uint16
        runs = []
        for cp in range(0x110000):
            flags = flag_of(cp) & 0x1FF
            if not runs or runs[-1][1] != flags:
                runs.append((cp, flags))
        result["flag_runs"] = runs
    return result


def run_oracle(bin_dir: Path, model: Path, texts: list[tuple[bytes, list]], flags: bool = False) -> dict:
    """libllama's answers for one vocabulary: tokens of each (text, modes), every piece, specials, EOG set."""
    request = {"texts": [(text.hex(), modes) for text, modes in texts], "flags": flags}
    return libllama_child.run(_oracle_main, bin_dir, model, request, ORACLE_TIMEOUT)


# --- vocabularies --------------------------------------------------------------------------------------------

def _smollm_fields(model_path: Path, keep: int = 12000) -> dict:
    """SmolLM2's first `keep` tokens and the merges among them: realistic, and quick for GGUFReader to parse."""
    field = gguf.GGUFReader(model_path).fields
    tokens = [bytes(field["tokenizer.ggml.tokens"].parts[i]) for i in field["tokenizer.ggml.tokens"].data[:keep]]
    kept = set(tokens)
    merges = [bytes(field["tokenizer.ggml.merges"].parts[i]) for i in field["tokenizer.ggml.merges"].data]
    merges = [m for m in merges if all(p in kept for p in (*m.split(b" ", 1), m.replace(b" ", b"", 1)))]
    return {"tokens": tokens, "types": field["tokenizer.ggml.token_type"].contents()[:keep], "merges": merges}


def _extra_merges() -> list[tuple[str, str]]:
    """Merges SmolLM2 lacks (it never sees them: its pre-tokenizer isolates digits) that make the other
    pre-tokenizers' choices visible: multi-digit numbers, upper-case contractions, punctuation + newline."""
    pairs = [(a, b) for a in "0123456789" for b in "0123456789"]
    pairs += [("12", "3"), ("45", "6"), ("78", "9"), ("00", "0"), ("99", "9")]
    pairs += [("'", c) for c in "STMDRVL"] + [("'R", "E"), ("'V", "E"), ("'L", "L")]
    pairs += [("!", "Ċ"), (".", "Ċ"), (".Ċ", "Ċ"), ("?", "č"), ("?č", "Ċ"), (")", "Ċ")]
    return pairs


def _bpe_variant(pre, extra=(), retype=None, bos=1):
    """SmolLM2's BPE tokens and merges under another pre-tokenizer (pre=None: no key, llama.cpp's default;
    bos=None: no BOS id key)."""
    def build(folder: Path, smollm: dict) -> Path:
        types = list(smollm["types"])
        for token_id, token_type in (retype or {}).items():
            types[token_id] = token_type
        tokens, merges = list(smollm["tokens"]), list(smollm["merges"])
        known = set(tokens)
        for left, right in _extra_merges():
            merged = (left + right).encode()
            if merged not in known:
                known.add(merged)
                tokens.append(merged)
                types.append(1)
                merges.append(f"{left} {right}".encode())
        return write_vocab_gguf(folder / f"bpe-{pre}.gguf", model="gpt2", pre=pre, tokens=tokens, types=types,
                      merges=merges, extra=(*((("add_bos_token_id", bos),) if bos is not None else ()),
                                              ("add_eos_token_id", 2), *extra))
    return build


def _spm_variant(name: str, extra=()):
    """A SentencePiece vocabulary: SmolLM2's pieces with spaces as "▁", made-up scores (with ties), byte tokens."""
    def build(folder: Path, smollm: dict) -> Path:
        byte_of_char = {c: b for b, c in enumerate(_gpt2_byte_chars())}
        special = [(b"<unk>", 2), (b"<s>", 3), (b"</s>", 3)]
        special += [(b"<0x%02X>" % b, 6) for b in range(256)]
        special += [(b"<|im_start|>", 3), (b"<|im_end|>", 3), (b"<|endoftext|>", 3), (b"<tool>", 4),
                    (b"<unused0>", 3), ("▁<PRE>".encode(), 1), (b"<dropped>", 5)]
        tokens, types = [t for t, _ in special], [k for _, k in special]
        seen = set(tokens)
        for text, kind in zip(smollm["tokens"], smollm["types"]):
            raw = bytes(byte_of_char[c] for c in text.decode())
            if kind != 1 or b"\x00" in raw:
                continue
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                continue
            piece = raw.replace(b" ", "▁".encode())
            if piece not in seen:
                seen.add(piece)
                tokens.append(piece)
                types.append(1)
        scores = [-float(i // 3) for i in range(len(tokens))]  # ties on purpose
        return write_vocab_gguf(folder / f"{name}.gguf", model="llama", tokens=tokens, types=types, scores=scores,
                      extra=extra)
    return build


def _gpt2_byte_chars() -> list[str]:
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


VARIANTS = {
    "llama-bpe": _bpe_variant("llama-bpe"),
    "qwen2": _bpe_variant("qwen2", extra=(("add_add_bos_token", False), ("add_add_eos_token", True),
                                          ("add_eot_token_id", 2))),
    "default": _bpe_variant("default"),
    # GLM-4.7-Flash's "glm4": llama3's split, ignore_merges, no default BOS id (without a BOS key: none)
    "glm4": _bpe_variant("glm4", bos=None),
    "glm4-bos": _bpe_variant("glm4", extra=(("add_add_bos_token", True),)),
    "chatglm-bpe": _bpe_variant("chatglm-bpe", bos=None),
    "no-pre": _bpe_variant(None, extra=(("add_add_bos_token", True),)),
    "gpt-2": _bpe_variant("gpt-2", retype={5: 4, 10: 5, 11: 0, 1001: 6}),  # user-defined, unused, undefined, byte
    "spm": _spm_variant("spm"),
    "spm-phi3": _spm_variant("spm-phi3", extra=(("add_name", "Phi-3 mini"), ("add_add_space_prefix", False),
                                                ("add_add_eos_token", True))),
}


def _fuzz_texts(count: int, seed: int = 1234) -> list[str]:
    """Random mixes of the characters pre-tokenizers treat differently, including ones new in Unicode 15."""
    alphabet = (list("abcXYZ019 '\n\r\t.,!?-_$+<>|`~\"()[]{}") +
                ["'s", "'RE", "'ll", " ", "  ", "\n\n", "é", "e\u0301", "ß", "中", "文", "の", "한", "😀", "👍🏽",
                 "\u200d", "\u00a0", "\u2003", "\u3000", "\u0085", "١", "²", "Ⅷ", "½", "«", "—", "€", "\u00ad",
                 "\U0001e4d0", "\U00011f50", "\U0001fa75", "\u0cf3", "\U00031350", "<|im_start|>", "<|im_end|>",
                 "<|endoftext|>", "<tool>", "<s>", "</s>", "<0x41>", "▁", "1234567"])
    rng = random.Random(seed)
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(count)]


TEXTS_ALL_MODES = [(t.encode(), MODES) for t in TEXTS] + [(t, MODES) for t in RAW_TEXTS] + \
                  [(t.encode(), MODES) for t in _fuzz_texts(150)]


@pytest.fixture(scope="module")
def smollm_fields(model_path) -> dict:
    return _smollm_fields(model_path)


@pytest.fixture(scope="module")
def smollm(model_path) -> Vocab:
    return Vocab.from_gguf(gguf.GGUFReader(model_path))


@pytest.fixture(scope="module", params=["smollm2", *VARIANTS])
def case(request, bin_dir, model_path, smollm, smollm_fields, tmp_path_factory):
    """(our Vocab, libllama's answers, the texts asked about) for one vocabulary."""
    if request.param == "smollm2":
        path, ours = model_path, smollm
    else:
        path = VARIANTS[request.param](tmp_path_factory.mktemp("vocab"), smollm_fields)
        ours = Vocab.from_gguf(gguf.GGUFReader(path))
    return ours, run_oracle(bin_dir, path, TEXTS_ALL_MODES), TEXTS_ALL_MODES


# --- tests ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_smollm2_matches_llama_tokenize(llama, model_path, smollm, tmp_path, text):
    prompt = tmp_path / "prompt.txt"
    prompt.write_bytes(text.encode())
    ours = smollm
    for flags, parse_special in (([], True), (["--no-parse-special"], False)):
        done = llama("llama-tokenize", ["-m", model_path, "-f", prompt, "--ids", "--log-disable", "--no-escape",
                                        *flags], timeout=60)
        expected = json.loads(done.stdout.strip().splitlines()[-1])
        assert ours.tokenize(text, add_special=ours.add_bos, parse_special=parse_special) == expected


def test_codepoint_flags_match_unicode_cpp(bin_dir, model_path):
    """Letter/number/punctuation/... and whitespace for every codepoint, against libllama's own table."""
    runs = run_oracle(bin_dir, model_path, [], flags=True)["flag_runs"]
    ends = [first for first, _ in runs[1:]] + [0x110000]
    for (first, flags), end in zip(runs, ends):
        wrong = [cp for cp in range(first, end) if codepoint_flag(cp) != flags]
        assert not wrong, f"U+{wrong[0]:04X}: ours {codepoint_flag(wrong[0]):#x}, unicode.cpp {flags:#x}"


def _first_difference(got: list[int], want: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


def test_tokenize_matches_libllama(case):
    ours, oracle, texts = case
    for (text, modes), expected in zip(texts, oracle["tokens"]):
        for (add_special, parse_special), want in zip(modes, expected):
            got = ours.tokenize(text, add_special=add_special, parse_special=parse_special)
            assert got == want, (f"text={text!r} add_special={add_special} parse_special={parse_special}: "
                                 f"first difference at token {_first_difference(got, want)}")


def test_token_to_piece_matches_libllama(case):
    ours, oracle, _ = case
    assert ours.n_tokens == oracle["n_tokens"]
    for token, (plain, special) in enumerate(oracle["pieces"]):
        assert ours.token_to_piece(token).hex() == plain, token
        assert ours.token_to_piece(token, special=True).hex() == special, token


def test_special_tokens_match_libllama(case):
    ours, oracle, _ = case

    def as_id(token):
        return -1 if token is None else token

    assert (as_id(ours.bos), as_id(ours.eos), as_id(ours.eot)) == (oracle["bos"], oracle["eos"], oracle["eot"])
    assert (ours.add_bos, ours.add_eos) == (oracle["get_add_bos"], oracle["get_add_eos"])
    assert [i for i in range(ours.n_tokens) if ours.is_eog(i)] == oracle["eog"]
