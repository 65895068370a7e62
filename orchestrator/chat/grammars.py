"""The GBNF a tool call is held to, per chat family, written as llama.cpp 11434 writes it.

llama.cpp builds a PEG parser per request (common/chat-auto-parser-generator.cpp) and turns it into
GBNF (common_peg_arena::build_grammar). For tool_choice "auto" the grammar is lazy and its root is
the parser's trigger rules (the calls, from the trigger on); for "required" it is the whole parser:
the generation prompt (cut at the reasoning tag; the sampler is fed the generation prompt's tokens
first), optional reasoning, content that does not contain the call marker (`until`), then the calls,
which must come before the end of generation. The rules below are those of llama-server's
`--verbose` grammar for each family, rule for rule, so a greedy constrained answer is the same;
only the numbers in the names of the `until-N` / `ac-N` automaton rules differ.

Each family function takes a ToolGrammar and the request's tools, parallel flag and whether calls are
required, adds its rules, and returns a Calls: the expression the root ends with, the rule names a
lazy root is made of, and the markers the content before the calls must not contain.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from orchestrator.sampling.json_schema import GrammarBuilder, format_literal

JSON_STRING_BODY = '( [^"\\\\] | "\\\\" ( ["\\\\/ bfnrt] | "u" [0-9a-fA-F]{4} ) )*'  # the PEG `string` parser
JSON_NUMBER = '"-"? ("0" | [1-9] [0-9]*) ("." [0-9]+)? (("e" | "E") [+-]? [0-9]+)?'


@dataclass
class Calls:
    expression: str  # what the required root ends with
    lazy_roots: tuple[str, ...]  # the trigger rules: a lazy grammar's root is their choice
    content_until: tuple[str, ...]  # the markers content before the calls may not contain
    content_optional: bool = True  # `until-N?` (False: `until-N space`, Qwen3-Coder's handler)


def _escape_class_char(c: str) -> str:
    """gbnf_escape_char_class."""
    if c in "-][\\":
        return "\\" + c
    if c in "\n\t\r":
        return {"\n": "\\n", "\t": "\\t", "\r": "\\r"}[c]
    o = ord(c)
    if 0x20 <= o <= 0x7E:
        return c
    return f"\\x{o:02X}" if o <= 0xFF else f"\\u{o:04X}" if o <= 0xFFFF else f"\\U{o:08X}"


def _class(chars, negate: bool) -> str:
    return ("[^" if negate else "[") + "".join(_escape_class_char(c) for c in chars) + "]"


class _Automaton:
    """common_aho_corasick: the DFA that finds any of `strings` in a text, one character at a time."""

    def __init__(self, strings: list[str]):
        self.goto: list[dict[str, int]] = [{}]
        self.terminal = [False]
        for s in strings:
            q = 0
            for c in s:
                if c not in self.goto[q]:
                    self.goto.append({})
                    self.terminal.append(False)
                    self.goto[q][c] = len(self.goto) - 1
                q = self.goto[q][c]
            self.terminal[q] = True
        self.alphabet = sorted({c for s in strings for c in s})
        fail = [0] * len(self.goto)
        order = list(self.goto[0].values())
        for q in order:  # breadth first
            for c, d in self.goto[q].items():
                f = fail[q]
                while f and c not in self.goto[f]:
                    f = fail[f]
                fail[d] = self.goto[f].get(c, 0) if self.goto[f].get(c, 0) != d else 0
                self.terminal[d] = self.terminal[d] or self.terminal[fail[d]]
                order.append(d)
        self.fail = fail

    def next(self, q: int, c: str) -> int:
        while q and c not in self.goto[q]:
            q = self.fail[q]
        return self.goto[q].get(c, 0)


class ToolGrammar:
    """A GrammarBuilder with the PEG parser's `until` (text without any delimiter) and `ac` (text up to
    and including the first delimiter) automata, numbered in the order they are made."""

    def __init__(self):
        self.builder = GrammarBuilder()
        self._n = 0
        self._made: dict[tuple, str] = {}

    def rule(self, name: str, body: str) -> str:
        return self.builder.add_rule(name, body)

    def schema(self, name: str, schema: dict) -> str:
        return self.builder.add_schema(name, schema)

    def _automaton(self, prefix: str, strings: list[str], including: bool) -> str:
        self._n += 1
        prefix = f"{prefix}-{self._n}"
        ac = _Automaton(strings)
        name = lambda q: prefix if q == 0 else f"{prefix}-{q:02d}"  # noqa: E731
        for q in range(len(ac.goto)):
            if ac.terminal[q]:
                continue
            buckets: dict[int, list[str]] = {}
            completing, specific = [], []
            for c in ac.alphabet:
                d = ac.next(q, c)
                if ac.terminal[d]:
                    completing.append(c)
                    specific.append(c)
                elif d:
                    buckets.setdefault(d, []).append(c)
                    specific.append(c)
            moves = [f"{_class(chars, False)} {name(d)}" for d, chars in sorted(buckets.items())]
            if including:
                alts = ([_class(completing, False)] if completing else []) + moves + [f"{_class(specific, True)} {name(0)}"]
                self.rule(name(q), " | ".join(alts))
            else:
                self.rule(name(q), "| " + "".join(f"{m} | " for m in moves) + f"{_class(specific, True)} {name(0)}")
        return name(0)

    def until(self, strings) -> str:
        return self._automaton("until", list(strings), False)

    def through(self, strings) -> str:
        key = tuple(strings)
        if key not in self._made:  # one automaton per delimiter, shared by every argument that needs it
            self._made[key] = self._automaton("ac", list(strings), True)
        return self._made[key]


def _parameters(tool: dict) -> dict:
    params = tool["function"].get("parameters")
    return params if params else {"type": "object", "properties": {}}


def _may_be_string(schema) -> bool:
    if not isinstance(schema, dict) or "type" not in schema:
        return True
    kind = schema["type"]
    return kind == "string" or (isinstance(kind, list) and "string" in kind)


def _name_literal(name: str) -> str:
    return f'("\\"" {format_literal(name)} "\\"")'


def _json_alternatives(g: ToolGrammar, tools: list[dict], args_key: str, id_key: str, wrapper: bool) -> str:
    """build_json_tools_flat_keys: {("type": "function",)? "name": "NAME", "ARGS": ARGS(, ("id": ID)?)?}."""
    head = '("\\"type\\"" space ":" space "\\"function\\"" space "," space)? ' if wrapper else ""
    tail = (f' space "," space ({format_literal(json.dumps(id_key))} space ":" space '
            f'("\\"" {JSON_STRING_BODY} "\\"" | json-number))?' if id_key else "")
    if id_key:
        g.rule("json-number", JSON_NUMBER)
    names = []
    for tool in tools:
        name = tool["function"]["name"]
        args = g.schema(f"tool-{name}-schema", _parameters(tool))
        names.append(g.rule(f"tool-{name}", f'"{{" space {head}"\\"name\\"" space ":" space {_name_literal(name)} space "," '
                                            f'space {format_literal(json.dumps(args_key))} space ":" space {args}{tail} space "}}"'))
    return " | ".join(names)


def tag_json(g: ToolGrammar, tools: list[dict], parallel: bool, required: bool) -> Calls:
    """Hermes 2 Pro, Qwen 2.5, Qwen 3: <tool_call>\\n{"name": "NAME", "arguments": ARGS}</tool_call>."""
    alts = _json_alternatives(g, tools, "arguments", "", False)
    inner = f"({alts})" + (f' (space "," space ({alts}))*' if parallel else "")
    g.rule("tool-call", f'"<tool_call>\\n" space {inner} space "</tool_call>"')
    g.rule("tool-calls", "(tool-call space)+" if required else "(tool-call? space)+")
    return Calls("tool-calls", ("tool-call", "tool-calls"), ("<tool_call>\n",))


def _json_section(g: ToolGrammar, tools, parallel: bool, start: str, args_key: str, id_key: str, array: bool,
                  wrapper: bool) -> Calls:
    alts = _json_alternatives(g, tools, args_key, id_key, wrapper)
    calls = f"({alts})" + (f' (space "," space ({alts}))*' if parallel else "")
    if array:
        calls = f'"[" space {calls} space "]"'
    g.rule("tool-call", f"{format_literal(start)} space {calls} space \"\"")
    return Calls("tool-call", ("tool-call",), (start or "{",))


def llama3_json(g: ToolGrammar, tools, parallel: bool, required: bool) -> Calls:
    """Llama 3.x: {("type": "function",)? "name": "NAME", "parameters": ARGS}, content until the first {."""
    return _json_section(g, tools, parallel, "", "parameters", "", False, True)


def mistral_nemo(g: ToolGrammar, tools, parallel: bool, required: bool) -> Calls:
    """[TOOL_CALLS][{"name": "NAME", "arguments": ARGS, ("id": ID)?}, …]."""
    return _json_section(g, tools, parallel, "[TOOL_CALLS]", "arguments", "id", True, False)


def ministral(g: ToolGrammar, tools, parallel: bool, required: bool) -> Calls:
    """Ministral 3, Devstral: ([TOOL_CALLS]NAME[ARGS]ARGS) once or repeated (parallel), optional unless required."""
    names = [g.rule(f"tool-{t['function']['name']}", f'({format_literal(t["function"]["name"])} "[ARGS]") '
                    + g.schema(f"tool-{t['function']['name']}-schema", _parameters(t))) for t in tools]
    repeat = ("+" if parallel else "") if required else ("*" if parallel else "?")
    g.rule("tool-call", f'("[TOOL_CALLS]" ({" | ".join(names)})){repeat}')
    return Calls("tool-call", ("tool-call",), ("[TOOL_CALLS]",), content_optional=False)


def mistral_small(g: ToolGrammar, tools, parallel: bool, required: bool) -> Calls:
    """Mistral Small 3.2, as llama.cpp's template analysis has it: [TOOL_CALLS]NAME[ARGS]([CALL_ID]ID)?[ARGS]ARGS,
    then, with parallel calls, any number of further ones (the model's own NAME[CALL_ID]ID[ARGS]ARGS does not fit)."""
    names = []
    for t in tools:
        name = t["function"]["name"]
        call_id = g.until(["[ARGS]"])
        names.append(g.rule(f"tool-{name}", f'("" {format_literal(name)} "[ARGS]") ("[CALL_ID]" {call_id})? "[ARGS]" '
                            f'space {g.schema(f"tool-{name}-schema", _parameters(t))} space'))
    alts = " | ".join(names)
    more = f' (space "[TOOL_CALLS]" ({alts}) "")*' if parallel else ""
    g.rule("tool-call", f'"[TOOL_CALLS]" ({alts}) ""{more}')
    return Calls("tool-call", ("tool-call",), ("[TOOL_CALLS]",))


def _tagged_args(g: ToolGrammar, tool: dict, arg, joiner: str, first: str) -> str:
    """build_tool_parser_tag_tagged's arguments: the required ones in order, then any optional ones."""
    name = tool["function"]["name"]
    schema = _parameters(tool)
    required = set(schema.get("required") or [])
    req, opt = [], []
    for key, sub in (schema.get("properties") or {}).items():
        (req if key in required else opt).append(g.rule(f"tool-{name}-arg-{key}", arg(name, key, sub)))
    seq = joiner.join(req)
    if opt:
        choice = " | ".join(opt)
        seq += ("" if not req else " ") + (f"({first}({choice}))*" if first else f"({choice})*")
    return seq


def glm(g: ToolGrammar, tools, parallel: bool, required: bool) -> Calls:
    """GLM 4.5+: <tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n…</tool_call>."""
    def arg(name, key, sub):
        head = f'("<arg_key>" {format_literal(key)} "</arg_key>\\n") "<arg_value>" '
        if _may_be_string(sub):
            return head + g.through(["</arg_value>\n"])
        return head + g.schema(f"tool-{name}-arg-{key}-schema", sub) + ' "</arg_value>\\n"'
    names = [g.rule(f"tool-{t['function']['name']}", f'("" {format_literal(t["function"]["name"])} "\\n") space '
                    + _tagged_args(g, t, arg, " space ", "space ")) for t in tools]
    wrapped = f'"<tool_call>" space ({" | ".join(names)}) space "</tool_call>"'
    g.rule("tool-call", f"{wrapped} (space {wrapped})* space" if parallel else f"{wrapped} space")
    return Calls("tool-call", ("tool-call",), ("<tool_call>",))


def qwen3_coder(g: ToolGrammar, tools, parallel: bool, required: bool) -> Calls:
    """Qwen3-Coder: <tool_call>\\n<function=NAME>\\n<parameter=K>\\nV\\n</parameter>\\n</function>\\n</tool_call>
    (chat.cpp's own handler: the first call's <tool_call> may be left out)."""
    def arg(name, key, sub):
        head = f'("<parameter=" {format_literal(key)} ">\\n") '
        if _may_be_string(sub):
            return head + g.rule("xml-arg-string", g.through(["\n</parameter>\n"]))
        return head + g.schema(f"tool-{name}-arg-{key}-schema", sub) + ' "\\n</parameter>\\n"'
    names = [g.rule(f"tool-{t['function']['name']}", f'("<function=" {format_literal(t["function"]["name"])} ">\\n") '
                    f'({_tagged_args(g, t, arg, " ", "")}) "</function>\\n"') for t in tools]
    alts = " | ".join(names)
    g.rule("tool-call-first", f'"<tool_call>\\n"? ({alts}) "</tool_call>" space')
    if parallel:
        g.rule("tool-call", f'"<tool_call>\\n" ({alts}) "</tool_call>" space')
    body = "(tool-call-first tool-call*)" if parallel else "tool-call-first"
    g.rule("tool-call-root", body if required else f"{body}?")
    markers = ["<tool_call>"] + [f"<function={t['function']['name']}>" for t in tools]
    return Calls("tool-call-root", ("tool-call-root",), tuple(markers), content_optional=False)


def _optspace(tag: str) -> str:
    """common_chat_peg_builder::optspace: the tag with its surrounding whitespace optional, char by char."""
    core = tag.strip()
    at = tag.find(core)
    parts = [f"{format_literal(c)}?" for c in tag[:at]] + [format_literal(core)]
    return " ".join(parts + [f"{format_literal(c)}?" for c in tag[at + len(core):]])


def build(family_grammar, tools: list[dict], parallel: bool, required: bool, prefix: str,
          think: tuple[str, str] | None, think_first: bool = False) -> tuple[str, tuple[str, ...]]:
    """The grammar text and the markers that trigger it when lazy (the call markers: Qwen3-Coder's
    per-tool <function=NAME> too, as llama-server's triggers). Lazy (the trigger rules) unless `required`; then the root is the whole parser:
    `prefix` (the generation prompt up to the reasoning tag), space, `think` (reasoning tags when
    reasoning is extracted; `think_first`: before the space, as Ministral 3's handler has it), content without
    the call markers, the calls."""
    g = ToolGrammar()
    calls = family_grammar(g, tools, parallel, required)
    if not required:
        g.rule("root", " | ".join(calls.lazy_roots))
        return g.builder.format(), calls.content_until
    parts = [format_literal(prefix)] if prefix else []
    parts.append("space")
    if think:
        parts.insert(len(parts) - think_first, f"({_optspace(think[0])} {g.until([think[1].strip()])} "
                                                f"{_optspace(think[1])})?")
    content = g.until(calls.content_until)
    parts.append(f"{content}?" if calls.content_optional else f"{content} space")
    parts.append(calls.expression)
    g.rule("root", " ".join(parts))
    return g.builder.format(), calls.content_until
