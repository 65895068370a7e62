"""The pi coding agent (npm @mariozechner/pi-coding-agent, installed by tools/install_agents.sh) answers a
prompt through `orchestrator serve` as it does through `llama-server --jinja`, both over llama.cpp's
workers and the SmolLM2 test model.

pi is set up as a user would: a custom provider of its `openai-completions` API in its models.json
(PI_CODING_AGENT_DIR), run with `-p` and its default tools in an empty temporary directory. Each of its
requests carries the tools, `stream`, `stream_options.include_usage`, `store: false` and
`max_completion_tokens` (pi-ai's dist/providers/openai-completions.js, buildParams).

Its settings.json sets the compaction reserve to fit the model's window, as a user of an 8k-context model
would: pi's default reserve (16384 tokens) is larger than the whole window, so pi would summarise the
session after every answer, a second request asking for 13107 tokens that ran to the end of the context
(four minutes per server here, for nothing the answer needs).
"""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from .conftest import REPO_ROOT, RPC_TIMEOUT, _unavailable
from .programs import LlamaServer, OrchestratorServer, start_workers, started, stop_workers

pytestmark = pytest.mark.interop

N_CTX = 8192  # pi's system prompt and its tools' descriptions take a few thousand tokens
MAX_TOKENS = 48  # pi's maxTokens for the model: its max_completion_tokens
GREEDY = ["--temp", 0]  # pi sends no temperature: the servers' default makes its runs repeatable
COMPACTION_RESERVE = 1024  # tokens pi keeps free before it compacts (its settings.json)
PI_TIMEOUT = 3 * RPC_TIMEOUT  # a run may be several requests (a tool round or two), each a prompt of ~700+ tokens
PROMPT = "Reply with one short sentence: what is a sorting algorithm?"


@pytest.fixture(scope="module")
def pi() -> str:
    """pi's executable: tools/install_agents.sh installs the pinned version once (a no-op afterwards)."""
    done = subprocess.run(["bash", str(REPO_ROOT / "tools" / "install_agents.sh")], capture_output=True, text=True,
                          timeout=600, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        _unavailable(f"pi could not be installed (tools/install_agents.sh):\n{done.stderr[-3000:]}")
    return done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def workers(bin_dir, tmp_path_factory):
    found = start_workers(("reference", "reference"), tmp_path_factory.mktemp("agents-workers"))
    yield found
    stop_workers(found)


@pytest.fixture(scope="module")
def oracle(bin_dir, model_path, workers, tmp_path_factory):
    server = started(LlamaServer(bin_dir, model_path, tmp_path_factory.mktemp("agents") / "llama-server.log",
                                 ["--rpc", workers[0].address, "-ngl", 99, "--jinja", *GREEDY,
                                  # the pinned llama-server does not read pi's max_completion_tokens: without
                                  # -n a request ran on for thousands of tokens (10 t/s here)
                                  "-n", MAX_TOKENS], n_ctx=N_CTX))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def ours(model_path, workers, tmp_path_factory):
    server = started(OrchestratorServer(model_path, tmp_path_factory.mktemp("agents") / "ours.log",
                                        [workers[1].address], ["-ngl", 99, *GREEDY], n_ctx=N_CTX))
    yield server
    server.stop()


def run_pi(pi: str, server, tmp_path) -> subprocess.CompletedProcess:
    """`pi -p PROMPT --provider local` with pi's default tools, in an empty directory, its configuration
    (models.json: the server as an OpenAI-compatible provider; settings.json: the compaction reserve) in a
    directory of its own."""
    agent_dir, work = tmp_path / "pi-agent", tmp_path / "work"
    agent_dir.mkdir(exist_ok=True)
    work.mkdir(exist_ok=True)
    models = {"providers": {"local": {
        "baseUrl": server.url + "/v1", "api": "openai-completions", "apiKey": "none",
        "models": [{"id": "smollm2", "contextWindow": N_CTX, "maxTokens": MAX_TOKENS}]}}}
    (agent_dir / "models.json").write_text(json.dumps(models, indent=2))
    (agent_dir / "settings.json").write_text(json.dumps({"compaction": {"reserveTokens": COMPACTION_RESERVE}}))
    env = {**os.environ, "PI_CODING_AGENT_DIR": str(agent_dir), "PI_OFFLINE": "1", "PI_SKIP_VERSION_CHECK": "1",
           "HOME": str(tmp_path)}
    cmd = [pi, "-p", PROMPT, "--provider", "local", "--model", "smollm2", "--no-session"]
    try:
        return subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=PI_TIMEOUT,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"pi timed out after {PI_TIMEOUT:.0f}s\n{exc.stderr}\n{server.describe()}") from None


def check_answer(done: subprocess.CompletedProcess, server) -> None:
    assert done.returncode == 0 and done.stdout.strip(), (
        f"pi exited with {done.returncode}\nstdout: {done.stdout[-2000:]}\nstderr: {done.stderr[-3000:]}\n"
        f"{server.describe()}")


def test_pi_answers_through_orchestrator_serve_as_through_llama_server(pi, oracle, ours, tmp_path):
    """The same pi, setup, model and workers, each server fresh: pi answers through both, the same words.
    Both runs share one working directory, because pi's system prompt names it (and the date). Each server is
    asked once: llama-server's greedy text here can change once a prompt is cached (a reused prefix splits
    the batches differently)."""
    runs = {}
    for name, server in (("llama-server", oracle), ("orchestrator serve", ours)):
        runs[name] = run_pi(pi, server, tmp_path)
        check_answer(runs[name], server)
    assert runs["orchestrator serve"].stdout == runs["llama-server"].stdout
