"""Token attributes and the special tokens, decided at load time as llama_vocab::impl::load decides them.

Which ids are BOS/EOS/EOT/FIM (the GGUF's keys, else found by their text), which tokens end a generation,
and the per-model attribute fixes (LSTRIP/RSTRIP, tokens re-marked as ordinary). The functions change a
vocabulary's `attrs` (one llama_token_attr per token) in place, as the C++ does while loading.
"""

from __future__ import annotations

from orchestrator.cxx import unordered_map_order
from orchestrator.tokenizer.errors import NULL_TOKEN, TokenizerError

# --- token attributes (llama_token_attr) ------------------------------------------------------------------

ATTR_UNKNOWN, ATTR_UNUSED, ATTR_NORMAL, ATTR_CONTROL, ATTR_USER_DEFINED, ATTR_BYTE = (1 << i for i in range(6))
ATTR_LSTRIP, ATTR_RSTRIP = 1 << 7, 1 << 8
ATTR_SPECIAL = ATTR_UNKNOWN | ATTR_CONTROL
# tokenizer.ggml.token_type (llama_token_type) -> attribute; unknown numbers are UNDEFINED (0)
ATTR_OF_TYPE = {1: ATTR_NORMAL, 2: ATTR_UNKNOWN, 3: ATTR_CONTROL, 4: ATTR_USER_DEFINED, 5: ATTR_UNUSED, 6: ATTR_BYTE}

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
SPECIAL_ID_KEYS = (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("eot", "eot_token_id"),
                   ("eom", "eom_token_id"), ("unk", "unknown_token_id"), ("sep", "seperator_token_id"),
                   ("pad", "padding_token_id"), ("mask", "mask_token_id"), ("fim_pre", "fim_pre_token_id"),
                   ("fim_suf", "fim_suf_token_id"), ("fim_mid", "fim_mid_token_id"),
                   ("fim_pad", "fim_pad_token_id"), ("fim_rep", "fim_rep_token_id"),
                   ("fim_sep", "fim_sep_token_id"), ("fim_pre", "prefix_token_id"),
                   ("fim_suf", "suffix_token_id"), ("fim_mid", "middle_token_id"))
# defaults per tokenizer model, before the GGUF overrides them
DEFAULT_IDS = {"llama": {"bos": 1, "eos": 2, "unk": 0}, "gpt2": {"bos": 11, "eos": 11}}


def special_ids(model: str, n_tokens: int, metadata: dict, no_bos: bool = False) -> dict[str, int]:
    """Each special id: the tokenizer model's default (no BOS when the pre-tokenizer says so), then the GGUF's
    key; ids outside the vocabulary are none."""
    ids = {name: NULL_TOKEN for name, _ in SPECIAL_ID_KEYS}
    ids.update(DEFAULT_IDS[model])
    if no_bos:
        ids["bos"] = NULL_TOKEN
    for name, key in SPECIAL_ID_KEYS:
        if ids[name] >= n_tokens:
            ids[name] = NULL_TOKEN
        given = metadata.get(key)
        if given is not None and given < n_tokens:
            ids[name] = given
    return ids


def find_special_by_text(ids: dict[str, int], texts: list[bytes], id_of_text: dict[bytes, int],
                         attrs: list[int]) -> None:
    """Fills the EOT/EOM/FIM ids the GGUF leaves out with tokens of a known text (marked CONTROL); when
    several match, the one llama.cpp's token_to_id map yields first wins."""
    candidates = {name: [id_of_text[t.encode()] for t in known if t.encode() in id_of_text]
                  for name, known in _SPECIAL_BY_TEXT.items() if ids[name] == NULL_TOKEN}
    if any(len(found) > 1 for found in candidates.values()):
        try:
            rank = {token: at for at, token in enumerate(unordered_map_order(texts))}
        except ValueError:
            raise TokenizerError("vocabulary too large to replay llama.cpp's token map") from None
    else:
        rank = {}  # at most one candidate each: the map's order cannot matter
    for name, found in candidates.items():
        if found:
            ids[name] = min(found, key=rank.get) if rank else found[0]
            attrs[ids[name]] |= ATTR_CONTROL
    for i, text in enumerate(texts):
        if attrs[i] & ATTR_CONTROL and b"unused" in text:
            attrs[i] |= ATTR_UNUSED


def end_of_generation_ids(ids: dict[str, int], texts: list[bytes], id_of_text: dict[bytes, int],
                          attrs: list[int]) -> set[int]:
    """The tokens that end a generation; known end texts become CONTROL, gpt-oss's markers USER_DEFINED."""
    eog = {ids[name] for name in ("fim_pad", "fim_rep", "fim_sep") if ids[name] != NULL_TOKEN}
    for text in _EOG_TEXTS:
        token = id_of_text.get(text.encode())
        if token is not None:
            eog.add(token)
            attrs[token] |= ATTR_CONTROL
    for text in _ALWAYS_RENDERED:
        token = id_of_text.get(text.encode())
        if token is not None:
            attrs[token] = ATTR_USER_DEFINED
    eog |= {ids[name] for name in ("eos", "eot", "eom") if ids[name] != NULL_TOKEN}
    ends = {texts[i]: i for i in eog}
    # o200k_harmony / solar-open: "<|end|>" ends a message, not the generation
    if b"<|end|>" in ends and ((b"<|return|>" in ends and (b"<|call|>" in ends or b"<|calls|>" in ends))
                               or ((b"<|call|>" in ends or b"<|calls|>" in ends) and b"<|flush|>" in ends)):
        eog.discard(ends[b"<|end|>"])
        attrs[ends[b"<|end|>"]] = ATTR_USER_DEFINED
    # gemma4 / plamo: "</s>" is an ordinary token there
    if b"</s>" in ends and (b"<|tool_response>" in ends or b"<|plamo:eos|>" in ends):
        eog.discard(ends[b"</s>"])
        attrs[ends[b"</s>"]] = ATTR_NORMAL
    return eog


def apply_model_attr_rules(attrs: list[int], id_of_text: dict[bytes, int], special_tokens: list[int],
                           name: str, arch: str, pre: str) -> None:
    """Per-model LSTRIP/RSTRIP that llama.cpp sets by model, tokenizer or architecture name."""

    def set_attr(text: bytes, attr: int, value: bool, required: bool = True) -> None:
        token = id_of_text.get(text)
        if token is None:
            if required:
                raise TokenizerError(f"llama.cpp requires token {text!r} for this model and fails to load without it")
            return
        attrs[token] = attrs[token] | attr if value else attrs[token] & ~attr

    name = name.encode().lower().decode()  # std::tolower: ASCII only
    if any(s in pre for s in ("jina-v2-de", "jina-v2-es", "jina-v2-code", "mmbert")) or \
            any(s in arch for s in ("nomic-bert-moe", "jina-bert-v3")):
        set_attr(b"<mask>", ATTR_LSTRIP, True, required=False)
    elif "phi-3" in name or "phi3" in name:
        for token in special_tokens:
            attrs[token] |= ATTR_RSTRIP
        set_attr(b"</s>", ATTR_RSTRIP, True)
        for text in (b"<unk>", b"<s>", b"<|endoftext|>"):
            set_attr(text, ATTR_RSTRIP, False)
    elif "modern-bert" in name:
        set_attr(b"[MASK]", ATTR_LSTRIP, True, required=False)
