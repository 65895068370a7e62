"""Screenshot of the page of `orchestrator serve` (docs/web.png) in Debian's headless Chromium via selenium:

    orchestrator serve --port 18093 -c 1024 -np 2 &   # then, once it is ready:
    python tools/screenshot_web.py http://127.0.0.1:18093/ docs/web.png

It sends one greedy chat message (48 tokens), waits for the reply and the next pipeline event, and saves
the window (1440x720)."""
import sys, time
from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait
o = webdriver.ChromeOptions(); o.binary_location = "/usr/bin/chromium"
for f in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1440,720"):
    o.add_argument(f)
d = webdriver.Chrome(options=o, service=webdriver.ChromeService(executable_path="/usr/bin/chromedriver"))
try:
    d.get(sys.argv[1])
    w = WebDriverWait(d, 120)
    w.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#workers tr.worker"))
    d.execute_script("document.getElementById('temperature').value='0'; document.getElementById('max_tokens').value='48'")
    d.find_element(By.ID, "prompt").send_keys("Name three primary colors.")
    d.find_element(By.ID, "go").click()
    w.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-done]"))
    time.sleep(2)  # the pipeline view's next event, with the counters after the reply
    print(d.find_element(By.CSS_SELECTOR, ".msg.assistant").text)
    print(d.find_element(By.ID, "pipeline").text)
    d.save_screenshot(sys.argv[2])
finally:
    d.quit()
