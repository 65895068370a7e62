"""Speculative decoding (-md): with greedy sampling the text is the one generated without a draft, whether
the draft agrees with the model (the same file: nearly every guess accepted) or often does not (a Q4_0
copy of a random-weight Q8_0 model: many guesses rejected and their cells dropped), over one worker and
over two. (tools/make_model.py copies SmolLM2's vocabulary into its random models.) A draft of another
vocabulary is refused before any worker is contacted, as llama.cpp does.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tools import reference

REPO_ROOT = Path(__file__).resolve().parents[2]
PROMPT = "The three most useful things to know about distributed computing are"


def orchestrator(*args, timeout=600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run([sys.executable, "-m", "orchestrator", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO_ROOT, stdin=subprocess.DEVNULL)


def drafted(stderr: str) -> tuple[int, int]:
    found = re.search(r"draft: (\d+) tokens drafted, (\d+) accepted", stderr)
    assert found, stderr[-2000:]
    return int(found[1]), int(found[2])


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("spec-workers")
    started = [reference.start_worker("ours", log_dir, threads=1) for _ in range(2)]
    yield [w.address for w in started]
    for w in started:
        w.stop()


@pytest.fixture(scope="module")
def random_pair(tmp_path_factory):
    """A random-weight llama as Q8_0 and the same weights as Q4_0 (same seed): a draft that is often wrong."""
    folder = tmp_path_factory.mktemp("spec-models")
    paths = {}
    for wtype in ("Q8_0", "Q4_0"):
        paths[wtype] = folder / f"llama-{wtype}.gguf"
        subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "make_model.py"), "--arch", "llama", "--n-layer", "2",
                        "--weight-type", wtype, "--seed", "7", "-o", str(paths[wtype])], check=True, cwd=REPO_ROOT,
                       capture_output=True)
    return paths


def generate(model, rpc, *extra) -> subprocess.CompletedProcess:
    done = orchestrator("--rpc", ",".join(rpc), "-m", model, "-p", PROMPT, "-n", 40, "--temp", 0, "--ignore-eos",
                        "-c", 512, *extra)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.parametrize("n_workers", [1, 2])
def test_a_draft_that_agrees_gives_the_same_text(model, workers, n_workers):
    rpc = workers[:n_workers]
    plain = generate(model, rpc)
    spec = generate(model, rpc, "-md", model, "--draft-max", 6)
    assert spec.stdout == plain.stdout
    n_drafted, n_accepted = drafted(spec.stderr)
    assert n_drafted >= 20 and n_accepted >= n_drafted // 2, spec.stderr[-1000:]


@pytest.mark.parametrize("n_workers", [1, 2])
def test_a_draft_that_is_often_wrong_gives_the_same_text(random_pair, workers, n_workers):
    rpc = workers[:n_workers]
    plain = generate(random_pair["Q8_0"], rpc)
    spec = generate(random_pair["Q8_0"], rpc, "-md", random_pair["Q4_0"], "--draft-max", 4, "--draft-p-min", 0)
    assert spec.stdout == plain.stdout
    n_drafted, n_accepted = drafted(spec.stderr)
    assert 0 < n_accepted < n_drafted, spec.stderr[-1000:]  # both paths taken: kept guesses and dropped ones


def test_a_draft_of_another_vocabulary_is_refused(model, workers):
    try:
        gemma = reference.gemma3_model_path()  # Gemma 3's vocabulary against SmolLM2's
    except reference.ReferenceMissing as exc:
        pytest.fail(str(exc), pytrace=False)
    done = orchestrator("--rpc", workers[0], "-m", model, "-p", PROMPT, "-n", 4, "-md", gemma)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "cannot draft for this model" in last, done.stderr[-2000:]


def serve_completion(model, rpc, tmp_path, *extra) -> tuple[str, str, dict]:
    """One greedy /v1/completions answer of `orchestrator serve` (with --metrics), its /metrics text and
    the web page's /pipeline/state."""
    import json  # noqa: PLC0415
    import time  # noqa: PLC0415
    import urllib.request  # noqa: PLC0415

    port = reference.free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    log = open(tmp_path / f"serve-{port}.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "serve", "--rpc", ",".join(rpc), "-m", str(model),
                             "--port", str(port), "--metrics", "-c", "1024", *map(str, extra)],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:  # until it answers /health (a start that fails ends the process)
            assert proc.poll() is None, (tmp_path / f"serve-{port}.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        body = json.dumps({"prompt": PROMPT, "max_tokens": 32, "temperature": 0}).encode()
        request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as r:
            text = json.load(r)["choices"][0]["text"]
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
            metrics = r.read().decode()
        with urllib.request.urlopen(f"{url}/pipeline/state", timeout=30) as r:
            state = json.load(r)
        return text, metrics, state
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()


def test_the_server_drafts_too_and_gives_the_same_text(model, workers, tmp_path):
    plain, _, state = serve_completion(model, workers, tmp_path)
    assert state["draft"] is None
    spec, metrics, state = serve_completion(model, workers, tmp_path, "-md", model, "--draft-max", 6)
    assert spec == plain
    counts = dict(re.findall(r"^llamacpp:(n_drafted\w*) (\d+)", metrics, re.M))
    assert int(counts["n_drafted_total"]) > 0 and int(counts["n_drafted_accepted_total"]) > 0, metrics
    assert state["draft"] == {"drafted": int(counts["n_drafted_total"]),
                              "accepted": int(counts["n_drafted_accepted_total"])}  # the web page's figures
