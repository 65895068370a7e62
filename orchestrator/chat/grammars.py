"""The GBNF a tool call is held to, per chat family, built with the JSON-schema grammar builder.

llama.cpp derives its grammar from the family's PEG parser; these rules accept the same calls:
the family's markers around one tool's name and its arguments as that tool's parameter schema
allows. Each function takes the request's tools (OpenAI shape) and whether several calls may
follow each other, and returns the grammar text, or None while the grammar builder
(orchestrator/sampling/json_schema.py) is not there: then generation is unconstrained and only
the parse applies.
"""

from __future__ import annotations

import json

SPACE_RULE = '| " " | "\\n"{1,2} [ \\t]{0,20}'  # json-schema-to-grammar's `space`


def _builder():
    try:
        from orchestrator.sampling.json_schema import GrammarBuilder  # noqa: PLC0415 - optional until it lands
    except ImportError:
        return None
    builder = GrammarBuilder()
    builder.add_rule("space", SPACE_RULE)
    return builder


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _parameters(tool: dict) -> dict:
    params = tool["function"].get("parameters")
    return params if params else {"type": "object", "properties": {}}


def _calls(builder, alternatives: list[str], start: str, end: str, parallel: bool) -> str:
    call = builder.add_rule("tool-call", f"{_literal(start)} space ( {' | '.join(alternatives)} ) space {_literal(end)}")
    builder.add_rule("root", f"{call} ( space {call} )*" if parallel else call)
    return builder.format()


def tag_json(tools: list[dict], parallel: bool) -> str | None:
    """<tool_call> {"name": "NAME", "arguments": ARGS} </tool_call>."""
    builder = _builder()
    if builder is None:
        return None
    alternatives = []
    for tool in tools:
        name = tool["function"]["name"]
        args = builder.add_schema(f"tool-{name}-args", _parameters(tool))
        alternatives.append(builder.add_rule(
            f"tool-{name}", f'"{{" space "\\"name\\"" space ":" space {_literal(json.dumps(name))} space "," space '
                            f'"\\"arguments\\"" space ":" space {args} space "}}"'))
    return _calls(builder, alternatives, "<tool_call>\n", "</tool_call>", parallel)


def _tagged(tools: list[dict], parallel: bool, head: str, arg) -> str | None:
    builder = _builder()
    if builder is None:
        return None
    alternatives = []
    for tool in tools:
        name = tool["function"]["name"]
        schema = _parameters(tool)
        props = schema.get("properties") or {}
        required = set(schema.get("required") or [])
        args = []
        for key, sub in props.items():
            value = ('[^<]*' if isinstance(sub, dict) and sub.get("type", "string") == "string"
                     else builder.add_schema(f"tool-{name}-arg-{key}", sub if isinstance(sub, dict) else {}))
            args.append((key in required, builder.add_rule(f"tool-{name}-arg-{key}", arg(key, value))))
        body = " ".join(r for req, r in args if req) + " " + (
            "( " + " | ".join(r for req, r in args if not req) + " )*" if any(not req for req, _ in args) else "")
        alternatives.append(builder.add_rule(f"tool-{name}", f"{head(name)} {body}"))
    return builder, alternatives


def qwen3_coder(tools: list[dict], parallel: bool) -> str | None:
    got = _tagged(tools, parallel, lambda n: _literal(f"\n<function={n}>\n"),
                  lambda k, v: f"{_literal(f'<parameter={k}>' + chr(10))} {v} {_literal(chr(10) + '</parameter>' + chr(10))}")
    if got is None:
        return None
    builder, alternatives = got
    alternatives = [f"{a} {_literal('</function>' + chr(10))}" for a in alternatives]
    return _calls(builder, alternatives, "<tool_call>", "</tool_call>", parallel)


def glm(tools: list[dict], parallel: bool) -> str | None:
    got = _tagged(tools, parallel, lambda n: _literal(n) + " space",
                  lambda k, v: f"{_literal(f'<arg_key>{k}</arg_key>')} space \"<arg_value>\" {v} \"</arg_value>\" space")
    if got is None:
        return None
    builder, alternatives = got
    return _calls(builder, alternatives, "<tool_call>", "</tool_call>", parallel)


def _json_calls(tools: list[dict], parallel: bool, start: str, args_key: str, id_key: str, array: bool,
                wrapper: bool) -> str | None:
    """START [ {("type": "function",)? "name": "NAME", "ARGS": ARGS (, ("id": ID)?)?} (, …)* ]."""
    builder = _builder()
    if builder is None:
        return None
    alternatives = []
    head = '( "\\"type\\"" space ":" space "\\"function\\"" space "," space )? ' if wrapper else ""
    tail = (f' space "," space ( {_literal(json.dumps(id_key))} space ":" space '
            '( "\\"" [^"]* "\\"" | "-"? [0-9]+ ) )?' if id_key else "")
    for tool in tools:
        name = tool["function"]["name"]
        args = builder.add_schema(f"tool-{name}-args", _parameters(tool))
        alternatives.append(builder.add_rule(
            f"tool-{name}", f'"{{" space {head}"\\"name\\"" space ":" space {_literal(json.dumps(name))} space "," space '
                            f'{_literal(json.dumps(args_key))} space ":" space {args}{tail} space "}}"'))
    call = builder.add_rule("tool-call", " | ".join(alternatives))
    calls = f'{call} ( space "," space {call} )*' if parallel else call
    if array:
        calls = f'"[" space {calls} space "]"'
    builder.add_rule("root", f"{_literal(start)} space {calls} space" if start else f"space {calls} space")
    return builder.format()


def llama3_json(tools: list[dict], parallel: bool) -> str | None:
    return _json_calls(tools, parallel, "", "parameters", "", False, True)


def mistral_nemo(tools: list[dict], parallel: bool) -> str | None:
    return _json_calls(tools, parallel, "[TOOL_CALLS]", "arguments", "id", True, False)
