"""GPT-2 style byte-level BPE (tokenizer.ggml.model "gpt2"), as llm_tokenizer_bpe_session does it.

A fragment is cut into words by the vocabulary's pre-tokenizer; each word is spelled in GPT-2's byte
alphabet and merged pair by pair, lowest merge rank first. Pieces map back to bytes through the same
alphabet (decode_byte_level).
"""

from __future__ import annotations

import heapq

from orchestrator.tokenizer.errors import TokenizerError
from orchestrator.tokenizer.pretokenizers import PreTokenizer
from orchestrator.tokenizer.unicode import BYTE_ENCODE, BYTE_OF_CHAR, codepoint_flags, encode, lenient_decode

_WORD_CACHE_LIMIT = 1 << 16


class BpeTokenizer:
    """The merges of one vocabulary, and a cache of the words it has tokenized."""

    def __init__(self, pre_tokenizer: PreTokenizer, merges: list[bytes] | None, id_of_text: dict[bytes, int]):
        if merges is None:
            raise TokenizerError("BPE vocabulary without tokenizer.ggml.merges")
        self.pre_tokenizer = pre_tokenizer
        self.ignore_merges = pre_tokenizer.ignore_merges
        self.id_of_text = id_of_text
        self.bpe_ranks: dict[tuple[str, str], int] = {}
        for rank, merge in enumerate(merges):
            cut = merge.find(b" ", 1)
            pair = (merge[:cut], merge[cut + 1:]) if cut >= 0 else (b"", b"")
            self.bpe_ranks.setdefault(tuple(p.decode("utf-8", "surrogateescape") for p in pair), rank)
        self.id_of_str = {t.decode("utf-8", "surrogateescape"): i for t, i in id_of_text.items()}
        self._word_cache: dict[str, tuple[int, ...]] = {}

    def tokenize(self, data: bytes, out: list[int]) -> None:
        """Appends the tokens of one text fragment (no special tokens in it) to out."""
        text = lenient_decode(data)
        flags = codepoint_flags(text)
        spans = [(0, len(text))]
        for split in self.pre_tokenizer.splitters:
            spans = split(text, flags, spans)
        cache = self._word_cache
        for start, end in spans:
            word = encode(text[start:end]).decode("latin-1").translate(BYTE_ENCODE)
            ids = cache.get(word)
            if ids is None:
                if len(cache) >= _WORD_CACHE_LIMIT:
                    cache.clear()
                ids = cache[word] = self._merge_word(word)
            out.extend(ids)

    def _merge_word(self, word: str) -> tuple[int, ...]:
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
                ids.extend(self.id_of_text[b] for b in (bytes([c]) for c in encode(part)) if b in self.id_of_text)
        return tuple(ids)


def decode_byte_level(text: bytes) -> bytes:
    """llama_decode_text: map each character of a piece back to its byte; unknown ones are spelled out."""
    out = bytearray()
    for char in lenient_decode(text):
        byte = BYTE_OF_CHAR.get(char)
        if byte is not None:
            out.append(byte)
        else:
            out += b"[UNK_BYTE_0x" + encode(char).hex().encode() + text + b"]"
    return bytes(out)

