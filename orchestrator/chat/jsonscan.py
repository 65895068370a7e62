"""Where a JSON value ends in a text that may stop in its middle (a streamed tool call's arguments).

`json_end(text, i)` returns the index just past the complete JSON value starting at `text[i]`, or
None when the text ends before the value does (a partial value), or raises JsonSyntax when the text
cannot be JSON there. Only the extent is found; the value itself is kept as the model wrote it, as
llama.cpp keeps a tool call's argument text.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_NUMBER_PREFIX = re.compile(r"-?\d*(?:\.\d*)?(?:[eE][+-]?\d*)?")
_LITERALS = ("true", "false", "null")
WHITESPACE = " \t\n\r"


class JsonSyntax(ValueError):
    pass


def skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        if c < " ":
            raise JsonSyntax(f"control character in a string at {j}")
        j += 1
    return None


def json_end(text: str, i: int) -> int | None:
    i = skip_space(text, i)
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c in "{[":
        close = "}" if c == "{" else "]"
        j = skip_space(text, i + 1)
        if j >= len(text):
            return None
        if text[j] == close:
            return j + 1
        while True:
            if c == "{":
                if text[j] != '"':
                    raise JsonSyntax(f"expected a key at {j}")
                j = _string_end(text, j)
                if j is None:
                    return None
                j = skip_space(text, j)
                if j >= len(text):
                    return None
                if text[j] != ":":
                    raise JsonSyntax(f"expected ':' at {j}")
                j += 1
            j = json_end(text, j)
            if j is None:
                return None
            j = skip_space(text, j)
            if j >= len(text):
                return None
            if text[j] == close:
                return j + 1
            if text[j] != ",":
                raise JsonSyntax(f"expected ',' or '{close}' at {j}")
            j = skip_space(text, j + 1)
            if j >= len(text):
                return None
    for word in _LITERALS:
        if text.startswith(word, i):
            return i + len(word)
        if word.startswith(text[i:]):
            return None
    if _NUMBER_PREFIX.match(text, i).end() == len(text) and i < len(text):
        return None  # a number, or the start of one, at the very end: it may go on
    m = _NUMBER.match(text, i)
    if m and m.end() > i:
        return m.end()
    raise JsonSyntax(f"not JSON at {i}")


def brace_depth(text: str) -> int:
    """Unclosed '{' in a JSON prefix, outside strings (mapper's json_brace_depth)."""
    depth, in_string, escaped = 0, False, False
    for c in text:
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
    return max(depth, 0)
