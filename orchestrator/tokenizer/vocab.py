"""Vocab: one GGUF vocabulary with llama_tokenize, llama_token_to_piece and the end-of-generation set.

Loading follows llama_vocab::impl::load (special ids and attributes in orchestrator.tokenizer.special);
tokenizing cuts out the special tokens written in the text, then hands each plain fragment to the
vocabulary's BPE or SentencePiece tokenizer; rendering a token gives its raw bytes.
"""

from __future__ import annotations

from orchestrator.cxx import ISSPACE, strtol16
from orchestrator.tokenizer.bpe import BpeTokenizer, decode_byte_level
from orchestrator.tokenizer.errors import NULL_TOKEN, TokenizerError
from orchestrator.tokenizer.gguf_fields import read_vocab
from orchestrator.tokenizer.pretokenizers import PRE_TOKENIZERS
from orchestrator.tokenizer.special import (ATTR_BYTE, ATTR_CONTROL, ATTR_LSTRIP, ATTR_NORMAL, ATTR_OF_TYPE,
                                            ATTR_RSTRIP, ATTR_SPECIAL, ATTR_UNKNOWN, ATTR_USER_DEFINED,
                                            DEFAULT_IDS, apply_model_attr_rules, end_of_generation_ids,
                                            find_special_by_text, special_ids)
from orchestrator.tokenizer.spm import SPACE_ESCAPE, SpmTokenizer
from orchestrator.tokenizer.unicode import encode


class Vocab:
    """One GGUF vocabulary: llama_tokenize, llama_token_to_piece and the EOG set, in pure Python."""

    def __init__(self, *, model: str, pre: str, tokens: list[bytes], scores: list[float] | None,
                 token_types: list[int] | None, merges: list[bytes] | None, metadata: dict):
        if model not in DEFAULT_IDS:
            raise TokenizerError(f"unsupported tokenizer model '{model}' (tokenizer.ggml.model); "
                                 f"supported: {', '.join(sorted(DEFAULT_IDS))}")
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
        self.attrs = [ATTR_OF_TYPE.get(t, 0) for t in types[:self.n_tokens]]
        for token in range(self.n_tokens):  # llama.cpp renders every piece at load: "<0x" must be there
            if self.attrs[token] & ATTR_BYTE and len(self.texts[token]) < 3:
                raise TokenizerError(f"byte token {token} ({self.texts[token]!r}) is too short for <0xNN>")
        if self.is_spm:
            self._spm = SpmTokenizer(self.id_of_text, self.scores)
        else:
            self._bpe = BpeTokenizer(self.pre_tokenizer, merges, self.id_of_text)

        self.add_space_prefix = self.is_spm
        if metadata.get("add_space_prefix") is not None:
            self.add_space_prefix = metadata["add_space_prefix"]
        add_bos = self.is_spm or self.pre_tokenizer.add_bos
        self.add_bos = add_bos if metadata.get("add_bos_token") is None else metadata["add_bos_token"]
        self.add_eos = False if metadata.get("add_eos_token") is None else metadata["add_eos_token"]

        ids = special_ids(model, self.n_tokens, metadata, no_bos=bool(self.pre_tokenizer and self.pre_tokenizer.no_bos))
        find_special_by_text(ids, self.texts, self.id_of_text, self.attrs)
        self.eog_ids = end_of_generation_ids(ids, self.texts, self.id_of_text, self.attrs)
        self.special_ids = ids
        flagged = ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN
        # longest first; llama.cpp's std::sort is unstable, equal lengths are taken by id here
        self.special_tokens = sorted((i for i in range(self.n_tokens) if self.attrs[i] & flagged),
                                     key=lambda i: -len(self.texts[i]))
        apply_model_attr_rules(self.attrs, self.id_of_text, self.special_tokens, metadata.get("general.name") or "",
                               metadata.get("general.architecture") or "", pre)
        self._pieces: dict[int, bytes] = {}

    @classmethod
    def from_gguf(cls, reader) -> Vocab:
        """Read tokenizer.ggml.* from a gguf.GGUFReader, as llama_vocab::impl::load does."""
        return cls(**read_vocab(reader))

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
        data = text if isinstance(text, bytes) else encode(text)
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
                self._spm.tokenize((prefix + fragment).replace(b" ", SPACE_ESCAPE), out)
                prev_special = False
            else:
                self._bpe.tokenize(fragment, out)
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
            return text.replace(SPACE_ESCAPE, b" ") if self.is_spm else decode_byte_level(text)
        if attr & ATTR_BYTE:  # token_to_byte: strtol(text.substr(3, 2), NULL, 16) of "<0xNN>", as a char
            return bytes([strtol16(text[3:5]) & 0xFF])
        return b""  # UNUSED / UNDEFINED tokens render as nothing

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
                        while left > start and data[left - 1] in ISSPACE:
                            left -= 1
                    if left > start:
                        cut.append((start, left))
                    cut.append(token)
                    start = at + len(needle)
                    if attr & ATTR_RSTRIP:
                        while start < end and data[start] in ISSPACE:
                            start += 1
                if start < end:
                    cut.append((start, end))
            fragments = cut
        return [f if isinstance(f, int) else data[f[0]:f[1]] for f in fragments]
