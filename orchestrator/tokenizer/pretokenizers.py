"""Pre-tokenizers: how a BPE vocabulary cuts a text fragment into words before merging.

Each splitter takes (text, flags, spans) and refines every span (character offsets), like
unicode_regex_split applies its regexes one after the other. The hand-written ones port unicode.cpp's
custom matchers (unicode_regex_split_custom_gpt2, _llama3) branch by branch; the others are std::regex
passes. PRE_TOKENIZERS maps tokenizer.ggml.pre to the splitters llama-vocab.cpp chooses for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from orchestrator.tokenizer.unicode import LETTER, NUMBER, PUNCTUATION, WHITESPACE

Span = tuple[int, int]
Splitter = Callable[[str, list[int], list[Span]], list[Span]]
_NOT_PUNCT_RUN = WHITESPACE | LETTER | NUMBER


def _contraction(text: str, pos: int, end: int, ignore_case: bool) -> int:
    """Length of 's|'t|'re|'ve|'m|'ll|'d at pos (an apostrophe), 0 if none; ignore_case folds ASCII only."""
    letters = text[pos + 1:min(pos + 3, end)]
    if ignore_case:
        letters = "".join(c.lower() if c < "\x80" else c for c in letters)
    if letters[:1] and letters[0] in "stmd":
        return 2
    return 3 if letters in ("re", "ve", "ll") else 0


def _punctuation_run_end(flags: list[int], pos: int, end: int) -> int:
    """Where [^\\s\\p{L}\\p{N}]+ starting at pos ends."""
    while pos < end and flags[pos] and not flags[pos] & _NOT_PUNCT_RUN:
        pos += 1
    return pos


def _space_run_end(text: str, flags: list[int], pos: int, end: int, newlines: bool) -> int:
    """Where the word at pos ends by \\s+(?!\\S)|\\s+ (one character if no space starts there); with
    `newlines`, \\s*[\\r\\n]+ comes first: a space run containing a newline ends after its last one."""
    spaces, after_last_newline = 0, 0
    while pos + spaces < end and flags[pos + spaces] & WHITESPACE:
        if newlines and text[pos + spaces] in "\r\n":
            after_last_newline = pos + spaces + 1
        spaces += 1
    if after_last_newline:
        return after_last_newline
    if spaces > 1 and pos + spaces < end:
        return pos + spaces - 1  # \s+(?!\S): leave the last space to the next word
    return pos + (spaces or 1)


def _custom(word_end: Callable[[str, list[int], int, int], int], ignore_case: bool) -> Splitter:
    """A unicode.cpp custom matcher: at each position a contraction, else the word `word_end` finds there."""

    def split(text: str, flags: list[int], spans: list[Span]) -> list[Span]:
        out: list[Span] = []
        for start, end in spans:
            pos = start
            while pos < end:
                length = _contraction(text, pos, end, ignore_case) if text[pos] == "'" else 0
                stop = pos + length if length else word_end(text, flags, pos, end)
                out.append((pos, stop))
                pos = stop
        return out

    return split


def _gpt2_word_end(text: str, flags: list[int], pos: int, end: int) -> int:
    """ ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"""
    char, flag = text[pos], flags[pos]
    flag2 = (flags[pos + 1] if pos + 1 < end else 0) if char == " " else flag
    if flag2 & (LETTER | NUMBER):
        kind = flag2 & (LETTER | NUMBER)  # exactly one of them
        pos += char == " "
        while pos < end and flags[pos] & kind:
            pos += 1
        return pos
    if flag2 and not flag2 & _NOT_PUNCT_RUN:
        return _punctuation_run_end(flags, pos + (char == " "), end)
    return _space_run_end(text, flags, pos, end, newlines=False)


def _llama3_word_end(max_digits: int) -> Callable[[str, list[int], int, int], int]:
    """[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+
    -- llama3 groups digits by 3, qwen2 keeps each digit alone."""

    def word_end(text: str, flags: list[int], pos: int, end: int) -> int:
        char, flag = text[pos], flags[pos]
        following = flags[pos + 1] if pos + 1 < end else 0
        if char not in "\r\n" and not flag & NUMBER and (flag & LETTER or following & LETTER):
            pos += 1
            while pos < end and flags[pos] & LETTER:
                pos += 1
            return pos
        if flag & NUMBER:  # the next group of up to max_digits digits
            last = min(pos + max_digits, end)
            pos += 1
            while pos < last and flags[pos] & NUMBER:
                pos += 1
            return pos
        flag2 = following if char == " " else flag
        if flag and not flag2 & _NOT_PUNCT_RUN:  # C++ tests the first char's flags, then flag2
            pos = _punctuation_run_end(flags, pos + (char == " "), end)
            while pos < end and text[pos] in "\r\n":
                pos += 1
            return pos
        return _space_run_end(text, flags, pos, end, newlines=True)

    return word_end


_split_gpt2 = _custom(_gpt2_word_end, ignore_case=False)  # 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+|...
_split_llama3 = _custom(_llama3_word_end(3), ignore_case=True)  # (?i:'s|'t|'re|'ve|'m|'ll|'d)|...
_split_qwen2 = _custom(_llama3_word_end(1), ignore_case=True)


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
    """The splitters one tokenizer.ggml.pre runs, and the BPE defaults llama.cpp ties to it."""
    splitters: tuple[Splitter, ...]
    ignore_merges: bool = False  # a word that is already a token skips BPE
    add_bos: bool = False        # the default before tokenizer.ggml.add_bos_token
    no_bos: bool = False         # no default BOS id (special_bos_id = LLAMA_TOKEN_NULL) before the GGUF's key


_DEFAULT = PreTokenizer((_split_punctuation, _split_gpt2, _split_numbers, _split_ascii_digit_triples))
_LLAMA3 = PreTokenizer((_split_llama3,), ignore_merges=True, add_bos=True)
_QWEN2 = PreTokenizer((_split_qwen2,))
# LLAMA_VOCAB_PRE_TYPE_CHATGLM4: the llama3 regex (unicode.cpp runs the same custom matcher), no default BOS
_CHATGLM4 = PreTokenizer((_split_llama3,), no_bos=True)

# tokenizer.ggml.pre -> pre-tokenizer; names grouped as llama-vocab.cpp groups them
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "": _DEFAULT,  # missing key: llama.cpp warns and uses "default"
    "default": _DEFAULT,
    "gpt-2": PreTokenizer((_split_gpt2,)),
    "smollm": PreTokenizer((_split_each_number, _split_gpt2)),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                     "lfm2", "jina-v5-nano"), _LLAMA3),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2),
    "chatglm-bpe": _CHATGLM4,
    **dict.fromkeys(("glm4", "glm5"), PreTokenizer(_CHATGLM4.splitters, ignore_merges=True, no_bos=True)),
}
