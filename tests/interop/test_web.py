"""The page of `orchestrator serve` in a real browser: Debian's headless Chromium, driven by selenium
through Debian's chromedriver (tools/install_browser.sh installs both), against the default local setup
(`orchestrator serve` with no --rpc: two local Python workers, the packaged SmolLM2 model).

Oracles: the layer ranges the page lists must cover the model's blocks exactly once, as the gguf package
reads them from the file; the reply the page streams must be the text the same server answers (temperature
0) to a plain non-streamed request, which tests/interop/test_serve.py holds to llama-server's. With a worker
killed while the page streams a reply: the same text, the killed worker listed as lost, one re-plan, and
the layers over the two that are left.
"""
from __future__ import annotations

import json
import shutil
import signal
import sys
import urllib.request

import gguf
import pytest

from .conftest import IN_CI, RPC_TIMEOUT, reference
from .programs import LlamaServer, OrchestratorServer, orchestrator_env, start_workers, started, stop_workers

pytestmark = pytest.mark.interop

PROMPT = "What is the capital of France?"
N_TOKENS = 12
STORY, N_STORY = "Write a long story about a lighthouse keeper and his cat.", 96  # a reply long enough to kill into
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


class LocalServe(LlamaServer):
    """`orchestrator serve` as a user starts it first: no --rpc (local workers), no -m (the packaged model)."""

    name = "orchestrator serve (local workers)"

    def __init__(self, log_path):
        self.port = reference.free_port()
        cmd = [sys.executable, "-m", "orchestrator", "serve", "--host", reference.LOCALHOST, "--port", str(self.port),
               "-c", "1024", "-np", "2"]
        self._start(cmd, log_path, orchestrator_env())


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    s = started(LocalServe(tmp_path_factory.mktemp("web") / "serve.log"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def browser():
    webdriver = pytest.importorskip("selenium.webdriver")
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        message = "Debian's chromium and chromium-driver are not installed: run tools/install_browser.sh as root"
        if IN_CI:
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,900"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    driver.set_script_timeout(RPC_TIMEOUT)
    yield driver
    driver.quit()


def greedy(url: str, prompt: str = PROMPT, n_tokens: int = N_TOKENS) -> str:
    body = json.dumps({"messages": [{"role": "user", "content": prompt}], "temperature": 0,
                       "max_tokens": n_tokens}).encode()
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=RPC_TIMEOUT) as response:
        return json.loads(response.read())["choices"][0]["message"]["content"]


def test_page_lists_workers_and_streams_a_reply(server, browser, model_path):
    from selenium.webdriver.common.by import By  # noqa: PLC0415
    from selenium.webdriver.support.ui import WebDriverWait  # noqa: PLC0415

    browser.get(server.url + "/")
    wait = WebDriverWait(browser, RPC_TIMEOUT)
    rows = wait.until(lambda d: read_rows(d) or False)
    assert len(rows) == 2
    assert all(r[1] == "ours" and r[-1] == "up" for r in rows)
    assert_layers_cover_the_model(rows, model_path)

    send(browser, PROMPT, N_TOKENS)
    reply = wait.until(lambda d: d.find_element(By.CSS_SELECTOR, ".msg.assistant[data-done]"))
    assert reply.text.strip() == greedy(server.url).strip()
    assert_telemetry_is_plausible(server.url, browser, model_path)


def pipeline_state(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/pipeline/state", timeout=RPC_TIMEOUT) as response:
        return json.loads(response.read())


def assert_telemetry_is_plausible(url: str, browser, model_path) -> None:
    """After a reply: every worker probed (a round trip, free memory within its total), the link pushed
    (one job decoding alone); after a prompt alone (the server's waves), relayed: at least a token's
    activation per token, n_embd float32 as the gguf package reads it, plus framing; the page draws the
    steps and the round trips."""
    from selenium.webdriver.support.ui import WebDriverWait  # noqa: PLC0415

    wait = WebDriverWait(browser, RPC_TIMEOUT)
    # the engine probes when it is idle again, just after the reply
    state = wait.until(lambda _: (s := pipeline_state(url)) and all(w["rtt"] for w in s["workers"]) and s)
    for w in state["workers"]:
        assert w["rtt"] > 0 and 0 < w["free_now"] <= w["total"], w
        assert w["busy"] > 0 and w["sent_per_token"] > 0 and w["received_per_token"] > 0, w
    (link,) = state["links"]
    # the reply's last steps were one job's alone: pushed from worker to worker (Solo), nothing relayed
    assert link["push"] is True and link["relayed"] is False and link["bytes_per_token"] is None, link
    assert link["rtt_src"] > 0 and link["rtt_dst"] > 0, link
    greedy(url, n_tokens=1)  # a prompt only: its steps go in waves, every boundary relayed
    n_embd = int(gguf.GGUFReader(model_path).fields["llama.embedding_length"].parts[-1][0])
    (link,) = pipeline_state(url)["links"]
    assert link["relayed"] is True and 4 * n_embd <= link["bytes_per_token"] < 4 * n_embd + 256, (link, n_embd)
    assert state["timeline"] and all(len(step["stages"]) == 2 for step in state["timeline"]), state["timeline"]
    drawn = "return [document.querySelectorAll('#timeline .step').length, " \
            "[...document.querySelectorAll('#workers tr.worker td.rtt')].map(c => c.textContent)]"
    steps, rtts = wait.until(lambda d: (r := d.execute_script(drawn)) and r[0] and all(r[1]) and r)
    assert all(t.endswith(" ms") for t in rtts), rtts


def read_rows(driver) -> list[list[str]]:
    """The workers table's cells (the view redraws it at each event: read them in one script)."""
    return driver.execute_script(
        "return [...document.querySelectorAll('#workers tr.worker')].map(r => [...r.cells].map(c => c.textContent))")


def assert_layers_cover_the_model(rows, model_path) -> None:
    n_layer = gguf.GGUFReader(model_path).fields["llama.block_count"].parts[-1][0]
    covered, heads = [], 0
    for r in rows:  # the layers column: "0–15", "16–29 + output", or "none"
        text = r[2]
        if text == "none":
            continue
        heads += text.endswith(" + output")
        first, last = text.removesuffix(" + output").split("–")
        covered += range(int(first), int(last) + 1)
    assert sorted(covered) == list(range(n_layer)) and heads == 1, rows


def send(browser, prompt: str, n_tokens: int) -> None:
    from selenium.webdriver.common.by import By  # noqa: PLC0415

    for field, value in (("temperature", 0), ("max_tokens", n_tokens)):
        box = browser.find_element(By.ID, field)
        browser.execute_script("arguments[0].value = arguments[1]", box, str(value))
    browser.find_element(By.ID, "prompt").send_keys(prompt)
    browser.find_element(By.ID, "go").click()


def test_a_worker_killed_during_a_reply_shows_as_lost_and_the_reply_goes_on(model_path, browser, tmp_path):
    from selenium.webdriver.common.by import By  # noqa: PLC0415
    from selenium.webdriver.support.ui import WebDriverWait  # noqa: PLC0415

    workers = start_workers(("ours", "ours", "ours"), tmp_path)
    server = None
    try:
        server = started(OrchestratorServer(model_path, tmp_path / "serve.log", [w.address for w in workers]))
        undisturbed = greedy(server.url, STORY, N_STORY)
        browser.get(server.url + "/")
        wait = WebDriverWait(browser, RPC_TIMEOUT, poll_frequency=0.05)
        rows = wait.until(lambda d: read_rows(d) or False)
        victim = workers[0]
        assert any(r[0] == victim.address and r[2] != "none" for r in rows), rows  # it holds layers

        send(browser, STORY, N_STORY)
        wait.until(lambda d: d.execute_script("const m = [...document.querySelectorAll('.msg.assistant')].pop();"
                                              "return m && m.textContent.length > 0 && !m.dataset.done"))
        victim.proc.send_signal(signal.SIGKILL)
        reply = wait.until(lambda d: d.find_element(By.CSS_SELECTOR, ".msg.assistant[data-done]"))
        assert reply.text.strip() == undisturbed.strip()

        replans = "return [...document.querySelectorAll('#engine dt')].find(d => d.textContent === 're-plans')" \
                  "?.nextElementSibling.textContent"
        wait.until(lambda d: d.execute_script(replans) == "1")
        rows = wait.until(lambda d: (r := read_rows(d)) and {x[0]: x[-1] for x in r}.get(victim.address) == "lost" and r)
        states = {r[0]: r[-1] for r in rows}
        assert states == {victim.address: "lost", workers[1].address: "up", workers[2].address: "up"}, rows
        assert_layers_cover_the_model(rows, model_path)
    finally:
        if server is not None:
            server.stop()
        workers[0].stop()  # killed on purpose
        stop_workers(workers[1:])
