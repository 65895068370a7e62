"""A JSON schema's string `pattern` (an anchored regex) as a GBNF rule, as _pattern_to_rule in
common/json-schema-to-grammar.cpp does: literals merged, classes and escapes copied where GBNF has the
same syntax, `{m,n}` expanded by build_repetition. A regex feature GBNF lacks raises UnsupportedPattern
(the caller then accepts any string, with a warning); a broken regex raises InvalidPattern.
"""

from __future__ import annotations

MAX_PATTERN_DEPTH = 100
INT_MAX = 0x7FFFFFFF  # std::numeric_limits<int>::max(): no upper bound
_NON_LITERAL = set("|.()[]{}*+?^$")
_ESCAPED_IN_REGEX_ONLY = set("^$.[]()|{}*+?")
_HEXDIGITS = set("0123456789abcdefABCDEF")


class UnsupportedPattern(ValueError):
    pass


class InvalidPattern(ValueError):
    pass


def build_repetition(item: str, low: int, high: int, separator: str = "") -> str:
    has_max = high != INT_MAX
    if high == 0:
        return ""
    if low == 0 and high == 1:
        return item + "?"
    if not separator:
        if low == 1 and not has_max:
            return item + "+"
        if low == 0 and not has_max:
            return item + "*"
        return f"{item}{{{low},{high if has_max else ''}}}"
    result = item + " " + build_repetition(f"({separator} {item})", low - 1 if low else 0, high - 1 if has_max else high)
    return f"({result})?" if low == 0 else result


def gbnf_escape_length(pattern: str, pos: int) -> int:
    """The length of a GBNF escape at pos (\\x.., \\u...., \\U........, \\t \\r \\n \\\\ \\" \\[ \\] \\-), else 0."""
    if pos + 1 >= len(pattern) or pattern[pos] != "\\":
        return 0
    c = pattern[pos + 1]
    n_hex = {"x": 2, "u": 4, "U": 8}.get(c)
    if n_hex is None:
        return 2 if c in 'trn\\"[]-' else 0
    if pos + 2 + n_hex > len(pattern) or not all(h in _HEXDIGITS for h in pattern[pos + 2:pos + 2 + n_hex]):
        return 0
    return 2 + n_hex


def _stoi(text: str) -> int:
    """std::stoi: leading spaces, a sign, digits; no digits throws."""
    s = text.lstrip(" \t\n\v\f\r")
    sign, i = 1, 0
    if s[:1] in "+-" and s[:1]:
        sign, i = (-1 if s[0] == "-" else 1), 1
    j = i
    while j < len(s) and s[j].isdigit() and s[j].isascii():
        j += 1
    if j == i:
        raise UnsupportedPattern("invalid number in curly brackets")
    value = sign * int(s[i:j])
    if not -(1 << 31) <= value < (1 << 31):
        raise UnsupportedPattern("invalid number in curly brackets")
    return value


class PatternConverter:
    def __init__(self, builder, dotall: bool):
        self.builder, self.dotall = builder, dotall

    def to_rule(self, pattern: str, name: str) -> str:
        if len(pattern) < 2 or pattern[0] != "^" or pattern[-1] != "$":
            raise UnsupportedPattern("not anchored with '^' and '$'")
        sub = pattern[1:-1]
        n = len(sub)
        sub_rule_ids: dict[str, str] = {}
        state = {"i": 0, "depth": 0}
        builder = self.builder

        def to_rule(item: tuple[str, bool]) -> str:
            text, literal = item
            return f'"{text}"' if literal else text

        def transform() -> tuple[str, bool]:
            seq: list[tuple[str, bool]] = []

            def dot() -> str:
                return builder.add_rule("dot", "[\\U00000000-\\U0010FFFF]" if self.dotall else "[^\\x0A\\x0D]")

            def join_seq() -> tuple[str, bool]:
                merged: list[tuple[str, bool]] = []
                literal = ""
                for text, is_literal in seq:
                    if is_literal:
                        literal += text
                    else:
                        if literal:
                            merged.append((literal, True))
                            literal = ""
                        merged.append((text, False))
                if literal:
                    merged.append((literal, True))
                return " ".join(to_rule(m) for m in merged), False

            while state["i"] < n:
                i = state["i"]
                c = sub[i]
                if c == ".":
                    seq.append((dot(), False))
                    state["i"] += 1
                elif c == "(":
                    state["i"] += 1
                    i = state["i"]
                    if i < n and sub[i] == "?":
                        if i + 1 < n and sub[i + 1] == ":":
                            state["i"] += 2
                        else:
                            raise UnsupportedPattern("unsupported group syntax")
                    state["depth"] += 1
                    if state["depth"] > MAX_PATTERN_DEPTH:
                        raise UnsupportedPattern("pattern nesting too deep")
                    seq.append(("(" + to_rule(transform()) + ")", False))
                elif c == ")":
                    state["i"] += 1
                    if state["depth"] == 0:
                        raise InvalidPattern("unbalanced parentheses")
                    state["depth"] -= 1
                    return join_seq()
                elif c in "^$":
                    raise UnsupportedPattern("anchor inside the pattern")
                elif c == "[":
                    text = "["
                    i += 1
                    while i < n and sub[i] != "]":
                        if sub[i] == "\\":
                            k = gbnf_escape_length(sub, i)
                            if k == 0:
                                raise UnsupportedPattern("unsupported escape in character class: " + sub[i:i + 2])
                            text += sub[i:i + k]
                            i += k
                        else:
                            text += sub[i]
                            i += 1
                    if i >= n:
                        raise InvalidPattern("unterminated character class")
                    state["i"] = i + 1
                    seq.append((text + "]", False))
                elif c == "|":
                    seq.append(("|", False))
                    state["i"] += 1
                elif c in "*+?":
                    if not seq:
                        raise InvalidPattern("nothing to repeat")
                    seq[-1] = (to_rule(seq[-1]) + c, False)
                    state["i"] += 1
                elif c == "{":
                    j = i + 1
                    while j < n and sub[j] != "}":
                        j += 1
                    if j >= n:
                        raise UnsupportedPattern("unterminated curly brackets")
                    nums = sub[i + 1:j].split(",")
                    state["i"] = j + 1
                    if len(nums) not in (1, 2):
                        raise UnsupportedPattern("wrong number of values in curly brackets")
                    if len(nums) == 1:
                        low = high = _stoi(nums[0])
                    else:
                        low = _stoi(nums[0]) if nums[0] else 0
                        high = _stoi(nums[1]) if nums[1] else INT_MAX
                    if not seq:
                        raise InvalidPattern("nothing to repeat")
                    text, is_literal = seq[-1]
                    if not is_literal:
                        rule_id = sub_rule_ids.get(text)
                        if rule_id is None:
                            rule_id = sub_rule_ids[text] = builder.add_rule(f"{name}-{len(sub_rule_ids) + 1}", text)
                        text = rule_id
                    seq[-1] = (build_repetition(f'"{text}"' if is_literal else text, low, high, ""), False)
                else:
                    literal = ""
                    while i < n:
                        if sub[i] == "\\":
                            if i == n - 1:
                                raise InvalidPattern("trailing backslash")
                            nxt = sub[i + 1]
                            if nxt in _ESCAPED_IN_REGEX_ONLY:
                                literal += nxt
                                i += 2
                            else:
                                k = gbnf_escape_length(sub, i)
                                if k == 0:
                                    raise UnsupportedPattern("unsupported escape: " + sub[i:i + 2])
                                literal += sub[i:i + k]
                                i += k
                        elif sub[i] == '"':
                            literal += '\\"'
                            i += 1
                        elif sub[i] not in _NON_LITERAL and (i == n - 1 or not literal or sub[i + 1] == "."
                                                              or sub[i + 1] not in _NON_LITERAL):
                            literal += sub[i]
                            i += 1
                        else:
                            break
                    state["i"] = i
                    if not literal:
                        raise UnsupportedPattern("unsupported character: " + c)
                    seq.append((literal, True))
            return join_seq()

        rule = to_rule(transform())
        if state["depth"] != 0:
            raise InvalidPattern("unbalanced parentheses")
        return builder.add_rule(name, '"\\"" (' + rule + ') "\\""')
