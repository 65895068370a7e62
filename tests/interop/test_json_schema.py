"""json_schema_to_grammar against llama.cpp's C++ converter, schema by schema.

The pinned sdist does not ship examples/json_schema_to_grammar.py, so the oracle is the C++ converter
that llama-server itself runs: POST /completion with a "json_schema" answers, in its
generation_settings, the grammar it built ("grammar"), and a 400 with its message for a schema it
cannot convert. The server runs on its own CPU backend (no workers needed); one token is generated.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from orchestrator.sampling.json_schema import GrammarBuilder, json_schema_to_grammar
from orchestrator.sampling.schema_tree import SchemaError

from .programs import LlamaServer, started

pytestmark = pytest.mark.interop

SCHEMAS = [
    {},
    {"type": "object"},
    {"type": "string"}, {"type": "number"}, {"type": "integer"}, {"type": "boolean"}, {"type": "null"},
    {"type": ["string", "null"]},
    {"enum": ["red", "green", 3, None, {"a": 1}]},
    {"const": "fixed \"quoted\" \n line"},
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
     "required": ["name"]},
    {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "number"}, "c": {"type": "boolean"}},
     "required": ["b"], "additionalProperties": False},
    {"type": "object", "properties": {"and": {}, "also": {}}, "additionalProperties": {"type": "integer"}},
    {"type": "object", "additionalProperties": {"type": "string"}},
    {"type": "object", "properties": {"x": {"type": "number"}}, "additionalProperties": True},
    {"type": "array"},
    {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
    {"type": "array", "items": {"type": "string"}, "minItems": 2},
    {"type": "array", "items": {"type": "boolean"}, "maxItems": 1},
    {"type": "array", "prefixItems": [{"type": "string"}, {"type": "number"}]},
    {"type": "string", "minLength": 2, "maxLength": 5},
    {"type": "string", "maxLength": 0},
    {"type": "string", "format": "date"}, {"type": "string", "format": "time"},
    {"type": "string", "format": "date-time"}, {"type": "string", "format": "uuid"},
    {"type": "string", "pattern": "^[A-Z][a-z]{2,4}-\\d?$"},
    {"type": "string", "pattern": "^(abc|de)+x{3}\\.y*[0-9a-f]{1,2}$"},
    {"type": "string", "pattern": "^\"q\"(?:a|b)c.$"},
    {"type": "string", "pattern": "not anchored"},
    {"type": "integer", "minimum": 5, "maximum": 2345},
    {"type": "integer", "minimum": -120, "maximum": 75},
    {"type": "integer", "minimum": -7, "maximum": -3},
    {"type": "integer", "minimum": 42}, {"type": "integer", "minimum": 7}, {"type": "integer", "minimum": -15},
    {"type": "integer", "maximum": 300}, {"type": "integer", "maximum": -8},
    {"type": "integer", "exclusiveMinimum": 0.5, "exclusiveMaximum": 10},
    {"type": "number", "minimum": 1.5},
    {"anyOf": [{"type": "string"}, {"type": "integer"}]},
    {"oneOf": [{"type": "object", "properties": {"k": {"const": 1}}}, {"type": "array"}]},
    {"allOf": [{"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
               {"anyOf": [{"type": "object", "properties": {"b": {"type": "number"}}}]}]},
    {"allOf": [{"enum": ["a", "b", "c"]}, {"enum": ["b", "c", "d"]}]},
    {"$defs": {"item": {"type": "object", "properties": {"id": {"type": "integer"}, "tags": {
        "type": "array", "items": {"$ref": "#/$defs/tag"}}}, "required": ["id"]},
        "tag": {"type": "string", "maxLength": 8}},
     "type": "object", "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/item"}}}},
    {"definitions": {"node": {"type": "object", "properties": {"value": {"type": "integer"},
                                                             "next": {"anyOf": [{"$ref": "#/definitions/node"}, {"type": "null"}]}}}},
     "$ref": "#/definitions/node"},
    {"type": "object", "properties": {"root": {"type": "string"}, "number": {"type": "number"}, "ünï cödé": {"type": "null"}}},
]
BAD_SCHEMAS = [{"type": "frobnicate"}, {"$ref": "#/nowhere"}, {"type": "array", "minItems": -1},
               {"type": "string", "pattern": "^(ab$"}, {"$ref": "http://example.com/schema"}]


@pytest.fixture(scope="module")
def server(bin_dir, model_path, tmp_path_factory):
    s = started(LlamaServer(bin_dir, model_path, tmp_path_factory.mktemp("schema") / "llama-server.log", [], n_ctx=256))
    yield s
    s.stop()


def _converted(server, schema) -> tuple[int, dict]:
    body = json.dumps({"prompt": "x", "n_predict": 1, "json_schema": schema}).encode()
    request = urllib.request.Request(f"{server.url}/completion", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_same_grammar_text_as_llama_server(server, index):
    schema = SCHEMAS[index]
    status, answer = _converted(server, schema)
    assert status == 200, answer
    expected = answer["generation_settings"]["grammar"]
    assert json_schema_to_grammar(schema or {"type": "object"}) == expected  # {} means any object there


@pytest.mark.parametrize("index", range(len(BAD_SCHEMAS)))
def test_schema_errors_as_llama_server(server, index):
    schema = BAD_SCHEMAS[index]
    status, answer = _converted(server, schema)
    assert status == 400, answer
    with pytest.raises(SchemaError) as caught:
        json_schema_to_grammar(schema)
    assert answer["error"]["message"] == f'Field \'json_schema\': "json_schema": {caught.value}'


def test_builder_adds_rules_and_schemas_as_the_converter(server):
    """GrammarBuilder used as common_grammar_builder: a schema added under "root" is the converter's text."""
    schema = SCHEMAS[10]
    builder = GrammarBuilder()
    assert builder.add_schema("root", schema) == "root"
    assert builder.format() == json_schema_to_grammar(schema)
    builder = GrammarBuilder()
    name = builder.add_rule("call", '"<tool_call>" space ' + builder.add_schema("args", schema) + ' "</tool_call>"')
    builder.add_rule("root", name)
    text = builder.format()
    assert "call ::= \"<tool_call>\" space args \"</tool_call>\"\n" in text and "args-name-kv ::=" in text
