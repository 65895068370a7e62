"""The page of `orchestrator serve` in a real browser: Debian's headless Chromium, driven by selenium
through Debian's chromedriver (tools/install_browser.sh installs both), against the default local setup
(`orchestrator serve` with no --rpc: two local Python workers, the packaged SmolLM2 model).

Oracles: the layer ranges the page lists must cover the model's blocks exactly once, as the gguf package
reads them from the file; the reply the page streams must be the text the same server answers (temperature
0) to a plain non-streamed request, which tests/interop/test_serve.py holds to llama-server's.
"""
from __future__ import annotations

import json
import shutil
import sys
import urllib.request

import gguf
import pytest

from .conftest import IN_CI, RPC_TIMEOUT, reference
from .programs import LlamaServer, orchestrator_env, started

pytestmark = pytest.mark.interop

PROMPT = "What is the capital of France?"
N_TOKENS = 12
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


def greedy(url: str) -> str:
    body = json.dumps({"messages": [{"role": "user", "content": PROMPT}], "temperature": 0,
                       "max_tokens": N_TOKENS}).encode()
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=RPC_TIMEOUT) as response:
        return json.loads(response.read())["choices"][0]["message"]["content"]


def test_page_lists_workers_and_streams_a_reply(server, browser, model_path):
    from selenium.webdriver.common.by import By  # noqa: PLC0415
    from selenium.webdriver.support.ui import WebDriverWait  # noqa: PLC0415

    browser.get(server.url + "/")
    wait = WebDriverWait(browser, RPC_TIMEOUT)
    # the view redraws its table at each event: read the cells in one script, not element by element
    read_rows = "return [...document.querySelectorAll('#workers tr.worker')].map(r => [...r.cells].map(c => c.textContent))"
    rows = wait.until(lambda d: d.execute_script(read_rows) or False)
    assert len(rows) == 2
    assert all(r[1] == "ours" and r[-1] == "up" for r in rows)
    n_layer = gguf.GGUFReader(model_path).fields["llama.block_count"].parts[-1][0]
    covered, heads = [], 0
    for r in rows:  # the layers column: "0–15", "16–29 + output"
        text = r[2]
        heads += text.endswith(" + output")
        first, last = text.removesuffix(" + output").split("–")
        covered += range(int(first), int(last) + 1)
    assert sorted(covered) == list(range(n_layer)) and heads == 1

    for field, value in (("temperature", 0), ("max_tokens", N_TOKENS)):
        box = browser.find_element(By.ID, field)
        browser.execute_script("arguments[0].value = arguments[1]", box, str(value))
    browser.find_element(By.ID, "prompt").send_keys(PROMPT)
    browser.find_element(By.ID, "go").click()
    reply = wait.until(lambda d: d.find_element(By.CSS_SELECTOR, ".msg.assistant[data-done]"))
    assert reply.text.strip() == greedy(server.url).strip()
