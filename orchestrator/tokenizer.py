"""Text to token ids and back, exactly as the pinned llama.cpp does it (src/llama-vocab.cpp, src/unicode.cpp).

Covers the GGUF vocabularies we serve: GPT-2 style byte-level BPE (tokenizer.ggml.model "gpt2") with the
pre-tokenizers listed in PRE_TOKENIZERS, and SentencePiece-style vocabularies (model "llama": scores,
<0xNN> byte fallback, "▁" for spaces). Anything else raises TokenizerError naming what is missing.

Everything works on UTF-8 bytes, like the C++ code, so text that is not valid UTF-8 is handled the way
llama.cpp handles it (each bad byte becomes U+FFFD for the pre-tokenizer).
"""
from __future__ import annotations

import heapq
import struct
import unicodedata
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from typing import Callable, Iterable

from gguf import GGUFValueType

NULL_TOKEN = -1  # LLAMA_TOKEN_NULL


class TokenizerError(ValueError):
    """The vocabulary uses a tokenizer we do not implement, or is malformed the way llama.cpp rejects."""


# --- codepoint flags, as unicode.cpp's table gives them ---------------------------------------------------

UNDEFINED, NUMBER, LETTER, SEPARATOR, MARK, PUNCTUATION, SYMBOL, CONTROL = (1 << i for i in range(8))
WHITESPACE = 0x100

_CATEGORY_FLAGS = {"Cn": UNDEFINED, "Cc": CONTROL, "Cf": CONTROL, "Co": CONTROL, "Cs": CONTROL,
                   "L": LETTER, "M": MARK, "N": NUMBER, "P": PUNCTUATION, "S": SYMBOL, "Z": SEPARATOR}

# llama.cpp's table is generated from Unicode 15.1; Python 3.11 ships 14.0. These are the codepoints
# assigned in between (first, last, flag); everything else agrees with unicodedata.category.
_ASSIGNED_AFTER_UNICODE_14 = (
    (0x00CF3, 0x00CF3, MARK), (0x00ECE, 0x00ECE, MARK), (0x02FFC, 0x02FFF, SYMBOL),
    (0x031EF, 0x031EF, SYMBOL), (0x10EFD, 0x10EFF, MARK), (0x1123F, 0x11240, LETTER),
    (0x11241, 0x11241, MARK), (0x11B00, 0x11B09, PUNCTUATION), (0x11F00, 0x11F01, MARK),
    (0x11F02, 0x11F02, LETTER), (0x11F03, 0x11F03, MARK), (0x11F04, 0x11F10, LETTER),
    (0x11F12, 0x11F33, LETTER), (0x11F34, 0x11F3A, MARK), (0x11F3E, 0x11F42, MARK),
    (0x11F43, 0x11F4F, PUNCTUATION), (0x11F50, 0x11F59, NUMBER), (0x1342F, 0x1342F, LETTER),
    (0x13439, 0x1343F, CONTROL), (0x13440, 0x13440, MARK), (0x13441, 0x13446, LETTER),
    (0x13447, 0x13455, MARK), (0x1B132, 0x1B132, LETTER), (0x1B155, 0x1B155, LETTER),
    (0x1D2C0, 0x1D2D3, NUMBER), (0x1DF25, 0x1DF2A, LETTER), (0x1E030, 0x1E06D, LETTER),
    (0x1E08F, 0x1E08F, MARK), (0x1E4D0, 0x1E4EB, LETTER), (0x1E4EC, 0x1E4EF, MARK),
    (0x1E4F0, 0x1E4F9, NUMBER), (0x1F6DC, 0x1F6DC, SYMBOL), (0x1F774, 0x1F776, SYMBOL),
    (0x1F77B, 0x1F77F, SYMBOL), (0x1F7D9, 0x1F7D9, SYMBOL), (0x1FA75, 0x1FA77, SYMBOL),
    (0x1FA87, 0x1FA88, SYMBOL), (0x1FAAD, 0x1FAAF, SYMBOL), (0x1FABB, 0x1FABD, SYMBOL),
    (0x1FABF, 0x1FABF, SYMBOL), (0x1FACE, 0x1FACF, SYMBOL), (0x1FADA, 0x1FADB, SYMBOL),
    (0x1FAE8, 0x1FAE8, SYMBOL), (0x1FAF7, 0x1FAF8, SYMBOL), (0x2B739, 0x2B739, LETTER),
    (0x2EBF0, 0x2EE5D, LETTER), (0x31350, 0x323AF, LETTER),
)
_ASSIGNED_STARTS = [first for first, _, _ in _ASSIGNED_AFTER_UNICODE_14]
# unicode.cpp's own whitespace set (not the category): \t..\r, space, NEL, NBSP, U+1680, U+2000..U+200A, ...
_WHITESPACE_CODEPOINTS = frozenset([*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B),
                                    0x2028, 0x2029, 0x202F, 0x205F, 0x3000])
_flag_cache: dict[str, int] = {}


def codepoint_flag(cp: int) -> int:
    """unicode_cpt_flags_from_cpt(cp) & 0x1FF: the category bit plus the whitespace bit."""
    if cp >= 0x110000:
        return UNDEFINED
    at = bisect_right(_ASSIGNED_STARTS, cp) - 1
    if at >= 0 and cp <= _ASSIGNED_AFTER_UNICODE_14[at][1]:
        flags = _ASSIGNED_AFTER_UNICODE_14[at][2]
    else:
        category = unicodedata.category(chr(cp))
        flags = _CATEGORY_FLAGS.get(category) or _CATEGORY_FLAGS[category[0]]
    return flags | WHITESPACE if cp in _WHITESPACE_CODEPOINTS else flags


def codepoint_flags(text: str) -> list[int]:
    """codepoint_flag of every character (never 0 for a real codepoint), remembering what it computed."""
    cached = _flag_cache.get
    flags = [cached(char, 0) for char in text]
    for at, flag in enumerate(flags):
        if not flag:
            flags[at] = _flag_cache[text[at]] = codepoint_flag(ord(text[at]))
    return flags


# --- UTF-8 the way unicode.cpp reads it -------------------------------------------------------------------

_UTF8_LEN = (1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4)  # unicode_len_utf8, by the high nibble


def _lenient_decode(data: bytes) -> str:
    """unicode_cpts_from_utf8: no overlong/surrogate checks; a byte that starts no valid sequence -> U+FFFD."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        pass
    out, i, n = [], 0, len(data)
    while i < n:
        b = data[i]
        size = 1 if b < 0x80 else 0 if b < 0xC0 else 2 if b < 0xE0 else 3 if b < 0xF0 else 4 if b < 0xF8 else 0
        if size == 1:
            out.append(b)
        elif size and i + size <= n and all(0x80 <= c < 0xC0 for c in data[i + 1:i + size]):
            cp = b & (0x7F >> size)
            for c in data[i + 1:i + size]:
                cp = (cp << 6) | (c & 0x3F)
            if cp > 0x10FFFF:  # unicode_cpt_to_utf8 throws on these later; llama_tokenize would fail
                raise TokenizerError(f"invalid UTF-8: codepoint 0x{cp:X} is beyond U+10FFFF")
            out.append(cp)
        else:
            out.append(0xFFFD)
            size = 1
        i += size
    return "".join(map(chr, out))


def _encode(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")  # unicode_cpt_to_utf8 writes surrogates like any codepoint


# --- pre-tokenizers: split a fragment into words (character offsets) --------------------------------------
# Each splitter takes (text, flags, spans) and refines every span, like unicode_regex_split applies its
# regexes one after the other. The hand-written ones port unicode.cpp's custom matchers line by line.

Span = tuple[int, int]
Splitter = Callable[[str, list[int], list[Span]], list[Span]]
_NOT_PUNCT_RUN = WHITESPACE | LETTER | NUMBER


def _split_gpt2(text: str, flags: list[int], spans: list[Span]) -> list[Span]:
    """'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"""
    out: list[Span] = []
    for start, end in spans:
        def flag_at(i: int) -> int:
            return flags[i] if i < end else 0
        pos = start
        while pos < end:
            char, flag = text[pos], flags[pos]
            if char == "'" and pos + 1 < end:
                following = text[pos + 1]
                if following in "stmd":
                    out.append((pos, pos + 2)); pos += 2
                    continue
                if pos + 2 < end and following + text[pos + 2] in ("re", "ve", "ll"):
                    out.append((pos, pos + 3)); pos += 3
                    continue
            word = pos
            flag2 = flag_at(pos + 1) if char == " " else flag
            if flag2 & (LETTER | NUMBER):
                kind = flag2 & (LETTER | NUMBER)  # exactly one of them
                pos += char == " "
                while flag_at(pos) & kind:
                    pos += 1
            elif flag2 and not flag2 & _NOT_PUNCT_RUN:
                pos += char == " "
                while (f := flag_at(pos)) and not f & _NOT_PUNCT_RUN:
                    pos += 1
            else:
                spaces = 0
                while flag_at(pos + spaces) & WHITESPACE:
                    spaces += 1
                if spaces > 1 and pos + spaces < end:
                    pos += spaces - 1  # \s+(?!\S): leave the last space to the next word
                elif spaces:
                    pos += spaces
                else:
                    pos += 1
            out.append((word, pos))
    return out


def _llama3_style(max_digits: int) -> Splitter:
    """(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|
    \\s*[\\r\\n]+|\\s+(?!\\S)|\\s+  -- llama3 groups digits by 3, qwen2 keeps each digit alone."""

    def split(text: str, flags: list[int], spans: list[Span]) -> list[Span]:
        out: list[Span] = []
        for start, end in spans:
            def flag_at(i: int) -> int:
                return flags[i] if i < end else 0
            pos = start
            while pos < end:
                char, flag = text[pos], flags[pos]
                if char == "'" and pos + 1 < end:
                    following = text[pos + 1].lower() if text[pos + 1] < "\x80" else ""
                    if following and following in "stmd":
                        out.append((pos, pos + 2)); pos += 2
                        continue
                    if following and pos + 2 < end and text[pos + 2] < "\x80" and \
                            following + text[pos + 2].lower() in ("re", "ve", "ll"):
                        out.append((pos, pos + 3)); pos += 3
                        continue
                word = pos
                if char not in "\r\n" and not flag & NUMBER and (flag & LETTER or flag_at(pos + 1) & LETTER):
                    pos += 1
                    while flag_at(pos) & LETTER:
                        pos += 1
                    out.append((word, pos))
                    continue
                if flag & NUMBER:
                    while flag_at(pos) & NUMBER:
                        pos += 1
                        if pos - word >= max_digits:
                            out.append((word, pos)); word = pos
                    if pos > word:
                        out.append((word, pos))
                    continue
                flag2 = flag_at(pos + 1) if char == " " else flag
                if flag and not flag2 & _NOT_PUNCT_RUN:  # C++ tests the first char's flags, then flag2
                    pos += char == " "
                    while (f := flag_at(pos)) and not f & _NOT_PUNCT_RUN:
                        pos += 1
                    while pos < end and text[pos] in "\r\n":
                        pos += 1
                    out.append((word, pos))
                    continue
                spaces, after_last_newline = 0, 0
                while flag_at(pos + spaces) & WHITESPACE:
                    if text[pos + spaces] in "\r\n":
                        after_last_newline = pos + spaces + 1
                    spaces += 1
                if after_last_newline:
                    pos = after_last_newline
                elif spaces > 1 and pos + spaces < end:
                    pos += spaces - 1
                elif spaces:
                    pos += spaces
                else:
                    pos += 1
                out.append((word, pos))
        return out

    return split


def _isolating(find: Callable[[str, list[int], int, int], Iterable[Span]]) -> Splitter:
    """A std::regex pass: matches become words, and so does the text between them."""

    def split(text: str, flags: list[int], spans: list[Span]) -> list[Span]:
        out: list[Span] = []
        for start, end in spans:
            done = start
            for first, last in find(text, flags, start, end):
                if first > done:
                    out.append((done, first))
                out.append((first, last))
                done = last
            if done < end:
                out.append((done, end))
        return out

    return split


def _runs(wanted: Callable[[str, int], bool], longest: int | None):
    """Matches of [class]+ (longest=None), or of [class] repeated exactly `longest` times."""

    def find(text: str, flags: list[int], start: int, end: int) -> Iterable[Span]:
        pos = start
        while pos < end:
            if not wanted(text[pos], flags[pos]):
                pos += 1
                continue
            run = pos
            while pos < end and wanted(text[pos], flags[pos]):
                pos += 1
            if longest is None:
                yield run, pos
            else:
                yield from ((i, i + longest) for i in range(run, pos - longest + 1, longest))

    return find


def _each_number(text: str, flags: list[int], start: int, end: int) -> Iterable[Span]:
    return ((i, i + 1) for i in range(start, end) if flags[i] & NUMBER)


_split_each_number = _isolating(_each_number)                                      # \p{N}
_split_numbers = _isolating(_runs(lambda c, f: f & NUMBER, None))                  # \p{N}+
_split_ascii_digit_triples = _isolating(_runs(lambda c, f: "0" <= c <= "9", 3))    # [0-9][0-9][0-9]
# [\p{P}\$\+<=>\^~\|]+ : punctuation plus the ASCII symbols it names (not the backtick)
_split_punctuation = _isolating(_runs(lambda c, f: f & PUNCTUATION or c in "$+<=>^~|", None))


@dataclass(frozen=True)
class PreTokenizer:
    splitters: tuple[Splitter, ...]
    ignore_merges: bool = False  # a word that is already a token skips BPE
    add_bos: bool = False        # the default before tokenizer.ggml.add_bos_token


_DEFAULT = PreTokenizer((_split_punctuation, _split_gpt2, _split_numbers, _split_ascii_digit_triples))
_LLAMA3 = PreTokenizer((_llama3_style(3),), ignore_merges=True, add_bos=True)
_QWEN2 = PreTokenizer((_llama3_style(1),))

# tokenizer.ggml.pre -> pre-tokenizer; names grouped as llama-vocab.cpp groups them
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "": _DEFAULT,  # missing key: llama.cpp warns and uses "default"
    "default": _DEFAULT,
    "gpt-2": PreTokenizer((_split_gpt2,)),
    "smollm": PreTokenizer((_split_each_number, _split_gpt2)),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                     "lfm2", "jina-v5-nano"), _LLAMA3),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2),
}


def _bytes_to_unicode() -> list[str]:
    """GPT-2's reversible byte -> printable character map (unicode_byte_to_utf8_map)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


_BYTE_CHARS = _bytes_to_unicode()
_BYTE_ENCODE = str.maketrans({b: c for b, c in enumerate(_BYTE_CHARS)})  # applied to latin-1 text
_BYTE_OF_CHAR = {c: b for b, c in enumerate(_BYTE_CHARS)}


# --- token attributes (llama_token_attr) ------------------------------------------------------------------

ATTR_UNKNOWN, ATTR_UNUSED, ATTR_NORMAL, ATTR_CONTROL, ATTR_USER_DEFINED, ATTR_BYTE = (1 << i for i in range(6))
ATTR_LSTRIP, ATTR_RSTRIP = 1 << 7, 1 << 8
ATTR_SPECIAL = ATTR_UNKNOWN | ATTR_CONTROL
# tokenizer.ggml.token_type (llama_token_type) -> attribute; unknown numbers are UNDEFINED (0)
_ATTR_OF_TYPE = {1: ATTR_NORMAL, 2: ATTR_UNKNOWN, 3: ATTR_CONTROL, 4: ATTR_USER_DEFINED, 5: ATTR_UNUSED, 6: ATTR_BYTE}

# Tokens found by their text when the GGUF does not name them (llama_vocab::impl::load). When several
# match, llama.cpp takes whichever its hash map yields first (see unordered_map_order).
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
              "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>")
_SPECIAL_BY_TEXT = {
    "eot": _EOT_TEXTS,
    "eom": ("<|eom_id|>",),
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
_EOG_TEXTS = frozenset(("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
                        "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
                        "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
                        "<｜end▁of▁sentence｜>", "[e~["))
_ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")  # gpt-oss: USER_DEFINED

# GGUF keys of the special ids; the deprecated prefix/suffix/middle keys come last and win, as in C++
_SPECIAL_ID_KEYS = (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("eot", "eot_token_id"),
                    ("eom", "eom_token_id"), ("unk", "unknown_token_id"), ("sep", "seperator_token_id"),
                    ("pad", "padding_token_id"), ("mask", "mask_token_id"), ("fim_pre", "fim_pre_token_id"),
                    ("fim_suf", "fim_suf_token_id"), ("fim_mid", "fim_mid_token_id"),
                    ("fim_pad", "fim_pad_token_id"), ("fim_rep", "fim_rep_token_id"),
                    ("fim_sep", "fim_sep_token_id"), ("fim_pre", "prefix_token_id"),
                    ("fim_suf", "suffix_token_id"), ("fim_mid", "middle_token_id"))
# defaults per tokenizer model, before the GGUF overrides them
_DEFAULT_IDS = {"llama": {"bos": 1, "eos": 2, "unk": 0}, "gpt2": {"bos": 11, "eos": 11}}

_SPACE_ESCAPE = "▁".encode()
_WORD_CACHE_LIMIT = 1 << 16
_ASCII_SPACE = b" \t\n\v\f\r"  # C isspace


# --- std::unordered_map iteration order -------------------------------------------------------------------
# llama.cpp finds EOT/FIM tokens by walking its token_to_id hash map and taking the first text that matches,
# so when a vocabulary has several candidates (SmolLM2: <|im_end|> and <|endoftext|>) the winner is whatever
# libstdc++ (GCC 12, which built the pinned binaries) iterates first. We replay that map: its string hash,
# its prime bucket counts and where it links each new node.

_MASK64 = (1 << 64) - 1
_MURMUR_MUL = 0xC6A4A7935BD1E995
_STRING_HASH_SEED = 0xC70F6907
_FAST_BUCKETS = (2, 2, 2, 3, 5, 5, 7, 7, 11, 11, 11, 11, 13, 13)  # _Prime_rehash_policy::_M_next_bkt, n < 14
_BUCKET_PRIMES = (  # std::__detail::__prime_list from 17 on
    17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79, 83, 89, 97, 103, 109, 113, 127, 137, 139, 149,
    157, 167, 179, 193, 199, 211, 227, 241, 257, 277, 293, 313, 337, 359, 383, 409, 439, 467, 503, 541, 577, 619,
    661, 709, 761, 823, 887, 953, 1031, 1109, 1193, 1289, 1381, 1493, 1613, 1741, 1879, 2029, 2179, 2357, 2549,
    2753, 2971, 3209, 3469, 3739, 4027, 4349, 4703, 5087, 5503, 5953, 6427, 6949, 7517, 8123, 8783, 9497, 10273,
    11113, 12011, 12983, 14033, 15173, 16411, 17749, 19183, 20753, 22447, 24281, 26267, 28411, 30727, 33223, 35933,
    38873, 42043, 45481, 49201, 53201, 57557, 62233, 67307, 72817, 78779, 85229, 92203, 99733, 107897, 116731,
    126271, 136607, 147793, 159871, 172933, 187091, 202409, 218971, 236897, 256279, 277261, 299951, 324503, 351061,
    379787, 410857, 444487, 480881, 520241, 562841, 608903, 658753, 712697, 771049, 834181, 902483, 976369,
    1056323, 1142821, 1236397, 1337629, 1447153, 1565659, 1693859, 1832561, 1982627, 2144977, 2320627, 2510653,
    2716249, 2938679, 3179303, 3439651, 3721303, 4026031, 4355707, 4712381, 5098259, 5515729, 5967347, 6456007,
    6984629, 7556579, 8175383, 8844859, 9569143, 10352717, 11200489, 12117689, 13109983, 14183539, 15345007,
    16601593, 17961079, 19431899,
)


def _std_string_hash(data: bytes) -> int:
    """std::hash<std::string> of libstdc++ on 64-bit: std::_Hash_bytes (a MurmurHash2 variant)."""
    def shift_mix(v: int) -> int:
        return v ^ (v >> 47)
    aligned = len(data) & ~7
    h = _STRING_HASH_SEED ^ (len(data) * _MURMUR_MUL & _MASK64)
    for (word,) in struct.iter_unpack("<Q", data[:aligned]):
        h = ((h ^ (shift_mix(word * _MURMUR_MUL & _MASK64) * _MURMUR_MUL & _MASK64)) * _MURMUR_MUL) & _MASK64
    if len(data) & 7:
        h = ((h ^ int.from_bytes(data[aligned:], "little")) * _MURMUR_MUL) & _MASK64
    return shift_mix(shift_mix(h) * _MURMUR_MUL & _MASK64)


def unordered_map_order(keys: list[bytes]) -> list[int]:
    """Indices of `keys` in the order a std::unordered_map<std::string, int> filled by m[keys[i]] = i walks them."""
    hashes = [_std_string_hash(k) for k in keys]
    head = len(keys)  # index of the list's before-begin node
    nxt = [-1] * (len(keys) + 1)
    n_buckets, next_resize, before = 1, 0, [None]  # before[b]: the node preceding bucket b's first node
    for i, code in enumerate(hashes):
        if i + 1 > next_resize:  # _Prime_rehash_policy::_M_need_rehash with max_load_factor 1
            wanted = max(i + 1, 0 if next_resize else 11)
            if wanted >= n_buckets:
                want = max(wanted + 1, 2 * n_buckets)
                if want < len(_FAST_BUCKETS):
                    n_buckets = _FAST_BUCKETS[want]
                else:
                    at = bisect_left(_BUCKET_PRIMES, want)
                    if at == len(_BUCKET_PRIMES):
                        raise TokenizerError("vocabulary too large to replay llama.cpp's token map")
                    n_buckets = _BUCKET_PRIMES[at]
                next_resize = n_buckets
                before = [None] * n_buckets
                node, nxt[head], first_bucket = nxt[head], -1, 0
                while node != -1:  # _M_rehash_aux: relink every node in list order
                    following, bucket = nxt[node], hashes[node] % n_buckets
                    if before[bucket] is None:
                        nxt[node], nxt[head] = nxt[head], node
                        before[bucket] = head
                        if nxt[node] != -1:
                            before[first_bucket] = node
                        first_bucket = bucket
                    else:
                        nxt[node], nxt[before[bucket]] = nxt[before[bucket]], node
                    node = following
            else:
                next_resize = n_buckets
        bucket = code % n_buckets
        if before[bucket] is not None:  # _M_insert_bucket_begin
            nxt[i], nxt[before[bucket]] = nxt[before[bucket]], i
        else:
            nxt[i], nxt[head] = nxt[head], i
            if nxt[i] != -1:
                before[hashes[nxt[i]] % n_buckets] = i
            before[bucket] = head
    order, node = [], nxt[head]
    while node != -1:
        order.append(node)
        node = nxt[node]
    return order


# --- reading GGUF metadata ----------------------------------------------------------------------------------

_T = GGUFValueType
# how llama.cpp insists each key is stored; another type fails the load
_KINDS = {"str": ([_T.STRING],), "u32": ([_T.UINT32],), "bool": ([_T.BOOL],),
          "str[]": ([_T.ARRAY, _T.STRING],), "i32[]": ([_T.ARRAY, _T.INT32],),
          "number[]": ([_T.ARRAY, _T.FLOAT32], [_T.ARRAY, _T.INT32])}


def _field(reader, key: str, kind: str):
    """A metadata value, or None when the key is absent."""
    field = reader.fields.get(key)
    if field is None:
        return None
    if list(field.types) not in _KINDS[kind]:
        raise TokenizerError(f"GGUF key {key} is stored as {'/'.join(t.name for t in field.types)}; "
                             f"llama.cpp expects {kind}")
    if kind == "str":
        return bytes(field.parts[-1]).decode("utf-8", "replace")
    if kind == "str[]":
        return [bytes(field.parts[i]) for i in field.data]  # raw bytes: token texts need not be UTF-8
    return field.contents()


class Vocab:
    """One GGUF vocabulary: llama_tokenize, llama_token_to_piece and the EOG set, in pure Python."""

    def __init__(self, *, model: str, pre: str, tokens: list[bytes], scores: list[float] | None,
                 token_types: list[int] | None, merges: list[bytes] | None, metadata: dict):
        if model not in _DEFAULT_IDS:
            raise TokenizerError(f"unsupported tokenizer model '{model}' (tokenizer.ggml.model); "
                                 f"supported: {', '.join(sorted(_DEFAULT_IDS))}")
        self.model = model
        self.is_spm = model == "llama"
        if self.is_spm:
            self.pre_tokenizer = None
        elif pre in PRE_TOKENIZERS:
            self.pre_tokenizer = PRE_TOKENIZERS[pre]
        else:
            raise TokenizerError(f"unsupported pre-tokenizer '{pre}' (tokenizer.ggml.pre) for a BPE vocabulary; "
                                 f"supported: {', '.join(repr(name) for name in PRE_TOKENIZERS)}")
        self.n_tokens = len(tokens)
        self.texts = [text or f"[EMPTY_{i}]".encode() for i, text in enumerate(tokens)]
        self.id_of_text = {text: i for i, text in enumerate(self.texts)}
        if len(self.id_of_text) != self.n_tokens:
            raise TokenizerError("the vocabulary repeats a token text; llama.cpp refuses to load it")
        self.scores = list(scores) if scores is not None else [0.0] * self.n_tokens
        types = token_types if token_types is not None else [1] * self.n_tokens
        self.attrs = [_ATTR_OF_TYPE.get(t, 0) for t in types[:self.n_tokens]]
        for token in range(self.n_tokens):  # llama.cpp renders every piece at load: "<0x" must be there
            if self.attrs[token] & ATTR_BYTE and len(self.texts[token]) < 3:
                raise TokenizerError(f"byte token {token} ({self.texts[token]!r}) is too short for <0xNN>")
        self.bpe_ranks: dict[tuple[str, str], int] = {}
        if not self.is_spm:
            if merges is None:
                raise TokenizerError("BPE vocabulary without tokenizer.ggml.merges")
            for rank, merge in enumerate(merges):
                cut = merge.find(b" ", 1)
                pair = (merge[:cut], merge[cut + 1:]) if cut >= 0 else (b"", b"")
                self.bpe_ranks.setdefault(tuple(p.decode("utf-8", "surrogateescape") for p in pair), rank)
            self.id_of_str = {t.decode("utf-8", "surrogateescape"): i for t, i in self.id_of_text.items()}

        self.add_space_prefix = self.is_spm
        add_bos = self.is_spm or self.pre_tokenizer.add_bos
        add_eos = False
        if metadata.get("add_space_prefix") is not None:
            self.add_space_prefix = metadata["add_space_prefix"]
        self.ignore_merges = bool(self.pre_tokenizer and self.pre_tokenizer.ignore_merges)

        ids = {name: NULL_TOKEN for name, _ in _SPECIAL_ID_KEYS}
        ids.update(_DEFAULT_IDS[model])
        for name, key in _SPECIAL_ID_KEYS:
            if ids[name] >= self.n_tokens:
                ids[name] = NULL_TOKEN
            given = metadata.get(key)
            if given is not None and given < self.n_tokens:
                ids[name] = given
        self.add_bos = add_bos if metadata.get("add_bos_token") is None else metadata["add_bos_token"]
        self.add_eos = add_eos if metadata.get("add_eos_token") is None else metadata["add_eos_token"]
        self._find_special_by_text(ids)
        self.eog_ids = self._end_of_generation_ids(ids)
        self.special_ids = ids
        flagged = ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN
        # longest first; llama.cpp's std::sort is unstable, equal lengths are taken by id here
        self.special_tokens = sorted((i for i in range(self.n_tokens) if self.attrs[i] & flagged),
                                     key=lambda i: -len(self.texts[i]))
        self._apply_model_attr_rules(metadata.get("general.name") or "", metadata.get("general.architecture") or "",
                                     pre)
        self._pieces: dict[int, bytes] = {}
        self._word_cache: dict[str, tuple[int, ...]] = {}

    @classmethod
    def from_gguf(cls, reader) -> "Vocab":
        """Read tokenizer.ggml.* from a gguf.GGUFReader, as llama_vocab::impl::load does."""
        model = _field(reader, "tokenizer.ggml.model", "str")
        if model is None:
            raise TokenizerError("the GGUF has no tokenizer.ggml.model")
        tokens = _field(reader, "tokenizer.ggml.tokens", "str[]")
        if tokens is None:
            raise TokenizerError("the GGUF has no tokenizer.ggml.tokens")
        metadata = {key: _field(reader, f"tokenizer.ggml.{key}", "u32") for _, key in _SPECIAL_ID_KEYS}
        for key in ("add_bos_token", "add_eos_token", "add_space_prefix"):
            metadata[key] = _field(reader, f"tokenizer.ggml.{key}", "bool")
        for key in ("general.name", "general.architecture"):
            metadata[key] = _field(reader, key, "str")
        scores = _field(reader, "tokenizer.ggml.scores", "number[]")
        types = _field(reader, "tokenizer.ggml.token_type", "i32[]")
        for name, values in (("scores", scores), ("token_type", types)):
            if values is not None and len(values) < len(tokens):
                raise TokenizerError(f"tokenizer.ggml.{name} has {len(values)} entries for {len(tokens)} tokens")
        return cls(model=model, pre=_field(reader, "tokenizer.ggml.pre", "str") or "", tokens=tokens,
                   scores=scores, token_types=types,
                   merges=_field(reader, "tokenizer.ggml.merges", "str[]"),
                   metadata=metadata)

    # --- load-time rules -----------------------------------------------------------------------------------

    def _find_special_by_text(self, ids: dict[str, int]) -> None:
        candidates = {name: [self.id_of_text[t.encode()] for t in texts if t.encode() in self.id_of_text]
                      for name, texts in _SPECIAL_BY_TEXT.items() if ids[name] == NULL_TOKEN}
        if any(len(found) > 1 for found in candidates.values()):
            rank = {token: at for at, token in enumerate(unordered_map_order(self.texts))}
        else:
            rank = {}  # at most one candidate each: the map's order cannot matter
        for name, found in candidates.items():
            if found:
                ids[name] = min(found, key=rank.get) if rank else found[0]
                self.attrs[ids[name]] |= ATTR_CONTROL
        for i in range(self.n_tokens):
            if self.attrs[i] & ATTR_CONTROL and b"unused" in self.texts[i]:
                self.attrs[i] |= ATTR_UNUSED

    def _end_of_generation_ids(self, ids: dict[str, int]) -> set[int]:
        eog = {ids[name] for name in ("fim_pad", "fim_rep", "fim_sep") if ids[name] != NULL_TOKEN}
        for text in _EOG_TEXTS:
            token = self.id_of_text.get(text.encode())
            if token is not None:
                eog.add(token)
                self.attrs[token] |= ATTR_CONTROL
        for text in _ALWAYS_RENDERED:
            token = self.id_of_text.get(text.encode())
            if token is not None:
                self.attrs[token] = ATTR_USER_DEFINED
        eog |= {ids[name] for name in ("eos", "eot", "eom") if ids[name] != NULL_TOKEN}
        texts = {self.texts[i]: i for i in eog}
        # o200k_harmony / solar-open: "<|end|>" ends a message, not the generation
        if b"<|end|>" in texts and ((b"<|return|>" in texts and (b"<|call|>" in texts or b"<|calls|>" in texts))
                                    or ((b"<|call|>" in texts or b"<|calls|>" in texts) and b"<|flush|>" in texts)):
            eog.discard(texts[b"<|end|>"])
            self.attrs[texts[b"<|end|>"]] = ATTR_USER_DEFINED
        # gemma4 / plamo: "</s>" is an ordinary token there
        if b"</s>" in texts and (b"<|tool_response>" in texts or b"<|plamo:eos|>" in texts):
            eog.discard(texts[b"</s>"])
            self.attrs[texts[b"</s>"]] = ATTR_NORMAL
        return eog

    def _apply_model_attr_rules(self, name: str, arch: str, pre: str) -> None:
        """Per-model LSTRIP/RSTRIP that llama.cpp sets by model, tokenizer or architecture name."""
        name = name.encode().lower().decode()  # std::tolower: ASCII only
        if any(s in pre for s in ("jina-v2-de", "jina-v2-es", "jina-v2-code", "mmbert")) or \
                any(s in arch for s in ("nomic-bert-moe", "jina-bert-v3")):
            self._set_attr(b"<mask>", ATTR_LSTRIP, True, required=False)
        elif "phi-3" in name or "phi3" in name:
            for token in self.special_tokens:
                self.attrs[token] |= ATTR_RSTRIP
            self._set_attr(b"</s>", ATTR_RSTRIP, True)
            for text in (b"<unk>", b"<s>", b"<|endoftext|>"):
                self._set_attr(text, ATTR_RSTRIP, False)
        elif "modern-bert" in name:
            self._set_attr(b"[MASK]", ATTR_LSTRIP, True, required=False)

    def _set_attr(self, text: bytes, attr: int, value: bool, required: bool = True) -> None:
        token = self.id_of_text.get(text)
        if token is None:
            if required:
                raise TokenizerError(f"llama.cpp requires token {text!r} for this model and fails to load without it")
            return
        self.attrs[token] = self.attrs[token] | attr if value else self.attrs[token] & ~attr

    # --- public API ----------------------------------------------------------------------------------------

    @property
    def bos(self) -> int | None:
        return self._optional(self.special_ids["bos"])

    @property
    def eos(self) -> int | None:
        return self._optional(self.special_ids["eos"])

    @property
    def eot(self) -> int | None:
        return self._optional(self.special_ids["eot"])

    @staticmethod
    def _optional(token: int) -> int | None:
        return None if token == NULL_TOKEN else token

    def is_eog(self, token: int) -> bool:
        return token in self.eog_ids

    def tokenize(self, text: str | bytes, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """llama_tokenize(vocab, text, add_special, parse_special)."""
        data = text if isinstance(text, bytes) else _encode(text)
        fragments = self._split_special(data, parse_special) if data else []
        out: list[int] = []
        if add_special and self.add_bos:
            self._require(self.special_ids["bos"], "BOS")
            out.append(self.special_ids["bos"])
        prev_special = True  # SPM: the first text fragment gets the space prefix
        for fragment in fragments:
            if isinstance(fragment, int):
                out.append(fragment)
                prev_special = True
            elif self.is_spm:
                prefix = b" " if self.add_space_prefix and prev_special else b""
                self._tokenize_spm((prefix + fragment).replace(b" ", _SPACE_ESCAPE), out)
                prev_special = False
            else:
                self._tokenize_bpe(fragment, out)
        if add_special and self.add_eos:
            self._require(self.special_ids["eos"], "EOS")
            out.append(self.special_ids["eos"])
        return out

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        """llama_token_to_piece(vocab, token, buf, len, lstrip=0, special): the token's raw bytes."""
        if not 0 <= token < self.n_tokens:
            raise TokenizerError(f"token id {token} is outside the vocabulary (0..{self.n_tokens - 1})")
        attr = self.attrs[token]
        if not special and attr & ATTR_SPECIAL:
            return b""
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = self._render(token, attr)
        return piece

    # --- internals -----------------------------------------------------------------------------------------

    @staticmethod
    def _require(token: int, what: str) -> None:
        if token == NULL_TOKEN:
            raise TokenizerError(f"the vocabulary asks for a {what} token but has none")

    def _render(self, token: int, attr: int) -> bytes:
        text = self.texts[token]
        if attr & (ATTR_SPECIAL | ATTR_USER_DEFINED):
            return text
        if attr & ATTR_NORMAL:
            return text.replace(_SPACE_ESCAPE, b" ") if self.is_spm else self._decode_byte_level(text)
        if attr & ATTR_BYTE:
            return bytes([self._byte_value(text)])
        return b""  # UNUSED / UNDEFINED tokens render as nothing

    @staticmethod
    def _decode_byte_level(text: bytes) -> bytes:
        """llama_decode_text: map each character back to its byte; unknown ones are spelled out."""
        out = bytearray()
        for char in _lenient_decode(text):
            byte = _BYTE_OF_CHAR.get(char)
            if byte is not None:
                out.append(byte)
            else:
                out += b"[UNK_BYTE_0x" + _encode(char).hex().encode() + text + b"]"
        return bytes(out)

    @staticmethod
    def _byte_value(text: bytes) -> int:
        """token_to_byte: strtol(text.substr(3, 2), NULL, 16) of "<0xNN>", truncated to a char."""
        digits = text[3:5].decode("latin-1").lstrip(" \t\n\v\f\r")
        sign = -1 if digits[:1] == "-" else 1
        digits = digits[1:] if digits[:1] in "+-" else digits
        hex_digits = ""
        for char in digits:
            if char not in "0123456789abcdefABCDEF":
                break
            hex_digits += char
        return (sign * int(hex_digits or "0", 16)) & 0xFF

    def _split_special(self, data: bytes, parse_special: bool) -> list[bytes | int]:
        """tokenizer_st_partition: cut out special tokens written in the text, longest tokens first."""
        fragments: list[tuple[int, int] | int] = [(0, len(data))]
        for token in self.special_tokens:
            attr = self.attrs[token]
            if not parse_special and attr & ATTR_SPECIAL:
                continue  # user-defined tokens are still matched
            needle = self.texts[token]
            if needle not in data:
                continue
            cut: list[tuple[int, int] | int] = []
            for fragment in fragments:
                if isinstance(fragment, int):
                    cut.append(fragment)
                    continue
                start, end = fragment
                while True:
                    at = data.find(needle, start, end)
                    if at < 0:
                        break
                    left = at
                    if attr & ATTR_LSTRIP:
                        while left > start and data[left - 1] in _ASCII_SPACE:
                            left -= 1
                    if left > start:
                        cut.append((start, left))
                    cut.append(token)
                    start = at + len(needle)
                    if attr & ATTR_RSTRIP:
                        while start < end and data[start] in _ASCII_SPACE:
                            start += 1
                if start < end:
                    cut.append((start, end))
            fragments = cut
        return [f if isinstance(f, int) else data[f[0]:f[1]] for f in fragments]

    def _tokenize_bpe(self, data: bytes, out: list[int]) -> None:
        text = _lenient_decode(data)
        flags = codepoint_flags(text)
        spans = [(0, len(text))]
        for split in self.pre_tokenizer.splitters:
            spans = split(text, flags, spans)
        cache = self._word_cache
        for start, end in spans:
            word = _encode(text[start:end]).decode("latin-1").translate(_BYTE_ENCODE)
            ids = cache.get(word)
            if ids is None:
                if len(cache) >= _WORD_CACHE_LIMIT:
                    cache.clear()
                ids = cache[word] = self._bpe_word(word)
            out.extend(ids)

    def _bpe_word(self, word: str) -> tuple[int, ...]:
        """llm_tokenizer_bpe_session::tokenize for one word: lowest merge rank first, then leftmost."""
        if self.ignore_merges and word in self.id_of_str:
            return (self.id_of_str[word],)
        parts = list(word)  # one character per byte of the original text
        nxt = list(range(1, len(parts))) + [-1]
        prv = list(range(-1, len(parts) - 1))
        ranks, queue = self.bpe_ranks, []

        def push(left: int, right: int) -> None:
            if left != -1 and right != -1:
                rank = ranks.get((parts[left], parts[right]))
                if rank is not None:
                    heapq.heappush(queue, (rank, left, right, parts[left] + parts[right]))

        for i in range(1, len(parts)):
            push(i - 1, i)
        while queue:
            _, left, right, merged = heapq.heappop(queue)
            if not parts[left] or not parts[right] or parts[left] + parts[right] != merged:
                continue  # outdated: one side has merged since
            parts[left], parts[right] = merged, ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prv[nxt[right]] = left
            push(prv[left], left)
            push(left, nxt[left])
        ids: list[int] = []
        for part in filter(None, parts):
            token = self.id_of_str.get(part)
            if token is not None:
                ids.append(token)
            else:  # byte fallback; bytes without a token are dropped, as in llama.cpp
                ids.extend(self.id_of_text[b] for b in (bytes([c]) for c in _encode(part)) if b in self.id_of_text)
        return tuple(ids)

    def _tokenize_spm(self, text: bytes, out: list[int]) -> None:
        """llm_tokenizer_spm_session::tokenize: merge the best-scoring adjacent pair until none is a token."""
        starts, sizes, offset = [], [], 0
        while offset < len(text):
            size = min(_UTF8_LEN[text[offset] >> 4], len(text) - offset)
            starts.append(offset)
            sizes.append(size)
            offset += size
        count = len(starts)
        nxt = list(range(1, count)) + [-1] if count else []
        prv = list(range(-1, count - 1))
        queue: list[tuple[float, int, int, int]] = []
        rev_merge: dict[bytes, tuple[int, int]] = {}

        def push(left: int, right: int) -> None:
            if left == -1 or right == -1:
                return
            joined = text[starts[left]:starts[left] + sizes[left] + sizes[right]]
            token = self.id_of_text.get(joined)
            if token is None:
                return
            heapq.heappush(queue, (-self.scores[token], left, right, len(joined)))
            rev_merge[joined] = (left, right)

        for i in range(1, count):
            push(i - 1, i)
        while queue:
            _, left, right, size = heapq.heappop(queue)
            if not sizes[left] or not sizes[right] or sizes[left] + sizes[right] != size:
                continue
            sizes[left] += sizes[right]
            sizes[right] = 0
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prv[nxt[right]] = left
            push(prv[left], left)
            push(left, nxt[left])

        def resegment(symbol: int) -> None:
            piece = text[starts[symbol]:starts[symbol] + sizes[symbol]]
            token = self.id_of_text.get(piece)
            if token is not None:
                out.append(token)
            elif piece in rev_merge:
                for half in rev_merge[piece]:
                    resegment(half)
            else:
                out.extend(self._byte_token(b) for b in piece)

        symbol = 0 if count else -1
        while symbol != -1:
            resegment(symbol)
            symbol = nxt[symbol]

    def _byte_token(self, byte: int) -> int:
        token = self.id_of_text.get(b"<0x%02X>" % byte)
        if token is None:
            token = self.id_of_text.get(bytes([byte]) if byte else b"")
        if token is None:
            raise TokenizerError(f"SPM vocabulary has no token for byte 0x{byte:02X} (llama.cpp fails here too)")
        return token
