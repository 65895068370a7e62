"""Writes vocabulary-only GGUF files for tokenizer tests (unit and interop tiers share it)."""

from pathlib import Path

import gguf


def write_vocab_gguf(path: Path, *, model: str, tokens, types, merges=None, scores=None, pre=None,
                     extra=()) -> Path:
    """A GGUF holding only tokenizer.ggml.* keys; `extra` is (GGUFWriter method name, *args) pairs."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if merges is not None:
        writer.add_token_merges(merges)
    if scores is not None:
        writer.add_token_scores(scores)
    for method, *args in extra:
        getattr(writer, method)(*args)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
