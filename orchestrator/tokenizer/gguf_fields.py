"""Reading a vocabulary's tokenizer.ggml.* keys from a GGUF, with the types llama.cpp insists on."""

from __future__ import annotations

from gguf import GGUFValueType

from orchestrator.tokenizer.errors import TokenizerError
from orchestrator.tokenizer.special import SPECIAL_ID_KEYS

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


def read_vocab(reader) -> dict:
    """The keyword arguments of Vocab, read from a gguf.GGUFReader as llama_vocab::impl::load reads them."""
    model = _field(reader, "tokenizer.ggml.model", "str")
    if model is None:
        raise TokenizerError("the GGUF has no tokenizer.ggml.model")
    tokens = _field(reader, "tokenizer.ggml.tokens", "str[]")
    if tokens is None:
        raise TokenizerError("the GGUF has no tokenizer.ggml.tokens")
    metadata = {key: _field(reader, f"tokenizer.ggml.{key}", "u32") for _, key in SPECIAL_ID_KEYS}
    for key in ("add_bos_token", "add_eos_token", "add_space_prefix"):
        metadata[key] = _field(reader, f"tokenizer.ggml.{key}", "bool")
    for key in ("general.name", "general.architecture"):
        metadata[key] = _field(reader, key, "str")
    scores = _field(reader, "tokenizer.ggml.scores", "number[]")
    types = _field(reader, "tokenizer.ggml.token_type", "i32[]")
    for name, values in (("scores", scores), ("token_type", types)):
        if values is not None and len(values) < len(tokens):
            raise TokenizerError(f"tokenizer.ggml.{name} has {len(values)} entries for {len(tokens)} tokens")
    return dict(model=model, pre=_field(reader, "tokenizer.ggml.pre", "str") or "", tokens=tokens,
                scores=scores, token_types=types, merges=_field(reader, "tokenizer.ggml.merges", "str[]"),
                metadata=metadata)
