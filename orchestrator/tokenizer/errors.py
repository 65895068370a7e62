"""The one exception the tokenizer raises, and llama.cpp's "no token" id."""

NULL_TOKEN = -1  # LLAMA_TOKEN_NULL


class TokenizerError(ValueError):
    """The vocabulary uses a tokenizer we do not implement, or is malformed the way llama.cpp rejects."""
