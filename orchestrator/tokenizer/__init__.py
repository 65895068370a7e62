"""Text to token ids and back, exactly as the pinned llama.cpp does it (src/llama-vocab.cpp, src/unicode.cpp).

Covers the GGUF vocabularies we serve: GPT-2 style byte-level BPE (tokenizer.ggml.model "gpt2") with the
pre-tokenizers listed in PRE_TOKENIZERS, and SentencePiece-style vocabularies (model "llama": scores,
<0xNN> byte fallback, "▁" for spaces). Anything else raises TokenizerError naming what is missing.

Everything works on UTF-8 bytes, like the C++ code, so text that is not valid UTF-8 is handled the way
llama.cpp handles it (each bad byte becomes U+FFFD for the pre-tokenizer). Modules:

* `vocab`: Vocab, the entry point (load, tokenize, render pieces, end-of-generation tokens);
* `gguf_fields`: reading the tokenizer.ggml.* keys; `special`: special ids and token attributes at load;
* `bpe`, `pretokenizers`: byte-level BPE and the pre-tokenizers cutting text into words;
* `spm`: SentencePiece; `unicode`: codepoint flags and UTF-8 as unicode.cpp has them;
* `errors`: TokenizerError.

The libstdc++ hash map whose iteration order picks EOT/FIM tokens is replayed in orchestrator.cxx.
"""

from orchestrator.tokenizer.errors import NULL_TOKEN, TokenizerError
from orchestrator.tokenizer.pretokenizers import PRE_TOKENIZERS, PreTokenizer
from orchestrator.tokenizer.unicode import codepoint_flag, codepoint_flags
from orchestrator.tokenizer.vocab import Vocab

__all__ = ["NULL_TOKEN", "PRE_TOKENIZERS", "PreTokenizer", "TokenizerError", "Vocab", "codepoint_flag",
           "codepoint_flags"]
