"""Grammar-constrained requests: `orchestrator serve` gives llama-server's greedy and seeded text.

Each server drives one of llama.cpp's ggml-rpc-server workers (SmolLM2). The requests constrain the
text by a GBNF `grammar`, a `json_schema` and a chat `response_format`, so most of their tokens are
ones the model would not have picked first: each exercises the drawn-token check and the masked
resample. A bad grammar or schema is refused by both.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from .conftest import RPC_TIMEOUT, text_diff
from .programs import LlamaServer, OrchestratorServer, start_workers, started, stop_workers

pytestmark = pytest.mark.interop

CHAT = [{"role": "user", "content": "Describe a cat as JSON."}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                                      "maxItems": 2}},
          "required": ["name", "age"]}
LIST = r'''root ::= item{2,4}
item ::= "- " [A-Z] [a-z ]{2,20} "\n"'''
REQUESTS = [  # (path, body)
    ("/v1/completions", {"prompt": "Three fruits:\n", "grammar": LIST}),
    ("/v1/completions", {"prompt": "Here is a person:", "json_schema": PERSON}),
    ("/completion", {"prompt": "Is the sky blue? Answer:", "grammar": 'root ::= " " ("yes" | "no") "." [ a-z]*'}),
    ("/v1/chat/completions", {"messages": CHAT, "grammar": 'root ::= "{\\"cat\\": \\"" [a-z ]+ "\\"}"'}),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "cat", "schema": {"type": "object", "properties": {"name": {"type": "string"},
                                                                   "legs": {"type": "integer"}}}}}}),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_object"}}),
    # seeded draws: a refused draw is drawn again from the masked chain, a second number from the same RNG
    ("/v1/completions", {"prompt": "Three fruits:\n", "grammar": LIST, "temperature": 0.9, "seed": 7}),
    ("/v1/completions", {"prompt": "Here is a person:", "json_schema": PERSON, "temperature": 1.2, "seed": 11,
                         "top_k": 0, "top_p": 1.0, "min_p": 0.0}),
]
BAD = [("/v1/completions", {"prompt": "x", "grammar": "root ::= foo"}),
       ("/v1/completions", {"prompt": "x", "json_schema": {"type": "frobnicate"}}),
       ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "xml"}}),
       ("/v1/chat/completions", {"messages": CHAT, "grammar": 'root ::= "a"', "json_schema": {"type": "string"}})]


@pytest.fixture(scope="module")
def servers(bin_dir, model_path, tmp_path_factory):
    logs = tmp_path_factory.mktemp("serve-grammar")
    workers = start_workers(("reference", "reference"), logs)
    both = []
    try:
        both.append(started(LlamaServer(bin_dir, model_path, logs / "llama-server.log",
                                        ["--rpc", workers[0].address, "-ngl", 99], n_ctx=1024)))
        both.append(started(OrchestratorServer(model_path, logs / "ours.log", [workers[1].address], ["-ngl", 99],
                                               n_ctx=1024)))
        yield both
    finally:
        for s in both:
            s.stop()
        stop_workers(workers)


def post(server, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(server.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=RPC_TIMEOUT) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def text_of(path: str, reply: dict) -> str:
    if path == "/completion":
        return reply["content"]
    choice = reply["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


@pytest.mark.parametrize("index", range(len(REQUESTS)))
def test_constrained_text_as_llama_server(servers, index):
    path, body = REQUESTS[index]
    body = {"temperature": 0, "max_tokens": 48, "n_predict": 48, **body}
    results = []
    for server in servers:
        status, reply = post(server, path, body)
        assert status == 200, (reply, server.describe())
        results.append(text_of(path, reply))
    expected, got = results
    assert expected, "llama-server generated nothing: the request tests nothing"
    assert got == expected, text_diff(expected, got, "llama-server", "orchestrator serve")


def streamed(server, path: str, body: dict) -> str:
    """The content of a streamed chat reply, its deltas put together."""
    request = urllib.request.Request(server.url + path, data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
    text = []
    with urllib.request.urlopen(request, timeout=RPC_TIMEOUT) as response:
        for line in response:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:]).get("choices", []):
                    text.append(choice.get("delta", {}).get("content") or "")
    return "".join(text)


@pytest.mark.parametrize("index", [4, 5])
def test_streamed_json_reply_as_llama_server(servers, index):
    """A streamed response-format reply reassembles to llama-server's: the JSON without its fence."""
    path, body = REQUESTS[index]
    body = {"temperature": 0, "max_tokens": 48, **body}
    expected, got = (streamed(server, path, body) for server in servers)
    assert expected.startswith("{")
    assert got == expected, text_diff(expected, got, "llama-server", "orchestrator serve")


@pytest.mark.parametrize("index", range(len(BAD)))
def test_bad_grammars_refused_by_both(servers, index):
    path, body = BAD[index]
    (theirs, their_reply), (status, reply) = (post(server, path, body) for server in servers)
    assert theirs >= 400 and their_reply["error"]["message"], their_reply  # 500 for both grammar and schema there
    assert status == 400 and reply["error"]["message"], reply
