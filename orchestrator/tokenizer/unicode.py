"""Unicode as llama.cpp's src/unicode.cpp sees it: codepoint flags, lenient UTF-8, GPT-2's byte map.

The flags follow unicode.cpp's generated table (Unicode 15.1 categories plus its own whitespace set);
decoding follows unicode_cpts_from_utf8, which turns a byte that starts no valid sequence into U+FFFD
instead of failing.
"""

from __future__ import annotations

import unicodedata
from bisect import bisect_right

from orchestrator.tokenizer.errors import TokenizerError

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

UTF8_LEN = (1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4)  # unicode_len_utf8, by the high nibble


def lenient_decode(data: bytes) -> str:
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


def encode(text: str) -> bytes:
    """UTF-8 of text, surrogates included."""
    return text.encode("utf-8", "surrogatepass")  # unicode_cpt_to_utf8 writes surrogates like any codepoint


# --- GPT-2's byte-level alphabet ---------------------------------------------------------------------------

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
BYTE_ENCODE = str.maketrans({b: c for b, c in enumerate(_BYTE_CHARS)})  # applied to latin-1 text
BYTE_OF_CHAR = {c: b for b, c in enumerate(_BYTE_CHARS)}

