"""Drives the chat page (m40_ui) in Debian's headless chromium through selenium.

Run by test_ui.py with Debian's /usr/bin/python3 (python3-selenium is a Debian
package, outside the tests' virtual environment):
    ui_browser.py PAGE_URL MODEL OUT_DIR [reasoning]
With "reasoning" (a server whose template opens <think>): the answer's reasoning is in
a collapsed <details> and equals the API's reasoning_content. Without:
Sends a message, waits for the streamed answer in the page and compares it with the
API's own answer (temperature 0), checks the tokens/s line, the markdown renderer on
hostile input, a reload (the conversation comes back from localStorage), the stop
button (on a throttled connection, so that the answer is still streaming), deleting
a conversation; saves OUT_DIR/chat.png and prints its path. Exit status 0 when all hold."""
import json
import os
import re
import sys
import tempfile
import time
import urllib.request

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

URL, MODEL, OUT = sys.argv[1], sys.argv[2], sys.argv[3]
MODE = sys.argv[4] if len(sys.argv) > 4 else "chat"
PROMPT = "Once upon a time"


def api_message(max_tokens):
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": PROMPT}],
                       "temperature": 0, "max_tokens": max_tokens}).encode()
    req = urllib.request.Request(URL + "v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)["choices"][0]["message"]


def api_answer(max_tokens):
    return api_message(max_tokens)["content"]


def reasoning(d, wait, q, js):
    q("#settings-toggle").click()
    q("#temperature").send_keys("0")
    q("#max_tokens").send_keys("12")
    q("#input").send_keys(PROMPT)
    q("#send").click()
    wait.until(lambda _: js("return document.body.dataset.busy") == "0"
               and q(".msg.assistant .stats").text != "")
    expected = api_message(12)
    assert expected.get("reasoning_content"), expected
    det = q(".msg.assistant details.reasoning")
    assert det.is_displayed() and det.get_attribute("open") is None      # collapsed
    saved = js("return JSON.parse(localStorage.getItem('m40.chat.v1'))")
    assert saved["conversations"][0]["messages"][1]["reasoning"] == expected["reasoning_content"]
    q(".msg.assistant details.reasoning summary").click()
    assert det.get_attribute("open") is not None
    # textContent: exactly what came, whitespace included (a tiny model's text may be little else)
    shown = js("return arguments[0].textContent", q(".msg.assistant details.reasoning .text"))
    assert shown == expected["reasoning_content"], (shown, expected)
    assert q(".msg.assistant .content").text == ""
    shot = os.path.join(OUT, "chat-reasoning.png")
    d.save_screenshot(shot)
    print("screenshot:", shot, flush=True)
    print("ui_browser: reasoning checks passed")


def main():
    profile = tempfile.mkdtemp(prefix="m40-ui-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
              "--window-size=1200,900", f"--user-data-dir={profile}"):
        opts.add_argument(a)
    d = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)
    wait = WebDriverWait(d, 60)
    q = lambda css: d.find_element(By.CSS_SELECTOR, css)
    js = d.execute_script
    try:
        d.get(URL)
        wait.until(lambda _: js("return [...document.querySelectorAll('#model option')].map(o => o.value)") == [MODEL])
        if MODE == "reasoning":
            return reasoning(d, wait, q, js)
        assert js("return document.body.dataset.busy") == "0"
        assert not q("#stop").is_enabled()

        # settings: temperature 0 makes the page's answer the API's answer
        q("#settings-toggle").click()
        q("#temperature").send_keys("0")
        q("#max_tokens").send_keys("40")
        q("#input").send_keys(PROMPT)
        q("#send").click()
        wait.until(lambda _: js("return document.body.dataset.busy") == "0"
                   and q(".msg.assistant .content").text.strip() != "")
        stats = q(".msg.assistant .stats").text
        assert re.fullmatch(r"\d+ tokens, [\d.]+ tokens/s, first token after [\d.]+ s \((length|stop)\)", stats), stats
        saved = js("return JSON.parse(localStorage.getItem('m40.chat.v1'))")
        conv = saved["conversations"][0]
        assert [m["role"] for m in conv["messages"]] == ["user", "assistant"], conv
        expected = api_answer(40)
        assert conv["messages"][1]["content"] == expected, (conv["messages"][1]["content"], expected)
        n_tokens = int(stats.split()[0])
        assert 1 <= n_tokens <= 40, stats
        shot = os.path.join(OUT, "chat.png")
        d.save_screenshot(shot)
        print("screenshot:", shot, flush=True)

        # the renderer: escaped first, then only its own tags; links with safe schemes only
        html = js("return window.m40markdown(arguments[0])",
                  "# Title\n**bold** and *it* and `<code>`\n\n- one\n- two\n\n1. first\n\n"
                  "```js\n<img src=x onerror=alert(1)>\n```\n"
                  "<script>alert(1)</script> [ok](https://example.com/?a=\"b) [bad](javascript:alert(1))")
        box = js("var d = document.createElement('div'); d.id = 'md-test'; d.innerHTML = arguments[0];"
                 "document.body.appendChild(d); return d", html)
        assert box.find_elements(By.CSS_SELECTOR, "h1")[0].text == "Title"
        assert [e.text for e in box.find_elements(By.CSS_SELECTOR, "ul li")] == ["one", "two"]
        assert len(box.find_elements(By.CSS_SELECTOR, "ol li")) == 1
        assert box.find_elements(By.CSS_SELECTOR, "strong")[0].text == "bold"
        assert box.find_elements(By.CSS_SELECTOR, "em")[0].text == "it"
        assert "<code>&lt;code&gt;</code>" in html
        assert '<pre><code class="language-js">&lt;img src=x onerror=alert(1)&gt;</code></pre>' in html, html
        assert not box.find_elements(By.CSS_SELECTOR, "script, img"), html
        links = box.find_elements(By.CSS_SELECTOR, "a")
        assert [a.get_attribute("href") for a in links] == ["https://example.com/?a=%22b"], html
        assert "javascript:" not in "".join(a.get_attribute("outerHTML") for a in links)
        js("document.getElementById('md-test').remove()")

        # a reload keeps the conversation
        d.refresh()
        wait.until(lambda _: len(d.find_elements(By.CSS_SELECTOR, "#conversations li")) == 1
                   and len(d.find_elements(By.CSS_SELECTOR, ".msg")) == 2)
        assert q("#conversations li .title").text == PROMPT
        assert q(".msg.user").text == PROMPT
        assert q(".msg.assistant .stats").text == stats
        assert q("#temperature").get_attribute("value") == "0"

        # stop: a new chat on a slow connection, stopped while it streams
        q("#new-chat").click()
        q("#settings-toggle").click()     # closed again after the reload
        q("#max_tokens").clear()
        q("#max_tokens").send_keys("200")
        d.set_network_conditions(offline=False, latency=5, download_throughput=1500, upload_throughput=1 << 20)
        q("#input").send_keys(PROMPT)
        q("#send").click()
        wait.until(lambda _: q(".msg.assistant .content").text.strip() != "")
        assert js("return document.body.dataset.busy") == "1" and q("#stop").is_enabled()
        q("#stop").click()
        wait.until(lambda _: js("return document.body.dataset.busy") == "0")
        d.delete_network_conditions()
        stats = q(".msg.assistant .stats").text
        assert re.fullmatch(r"\d+ tokens?(, [\d.]+ tokens/s)?, first token after [\d.]+ s \(stopped\)", stats), stats
        text = q(".msg.assistant .content").text
        time.sleep(1.0)
        assert q(".msg.assistant .content").text == text
        assert not q("#stop").is_enabled() and q("#send").is_enabled()
        assert len(d.find_elements(By.CSS_SELECTOR, "#conversations li")) == 2

        # the stopped answer is kept; delete the first conversation
        d.refresh()
        wait.until(lambda _: len(d.find_elements(By.CSS_SELECTOR, "#conversations li")) == 2)
        assert q(".msg.assistant .stats").text.endswith("(stopped)")
        q("#conversations li:last-child .delete").click()
        assert len(d.find_elements(By.CSS_SELECTOR, "#conversations li")) == 1
        saved = js("return JSON.parse(localStorage.getItem('m40.chat.v1'))")
        assert len(saved["conversations"]) == 1
        d.save_screenshot(os.path.join(OUT, "chat-stopped.png"))
        print("screenshot:", os.path.join(OUT, "chat-stopped.png"), flush=True)
        # what another version of the page left in localStorage does not break this one
        js("localStorage.setItem('m40.chat.v1', '{\"conversations\": [1, {\"id\": \"x\"}], \"current\": \"x\"}')")
        d.refresh()
        wait.until(lambda _: js("return [...document.querySelectorAll('#model option')].map(o => o.value)") == [MODEL])
        assert not d.find_elements(By.CSS_SELECTOR, "#conversations li, .msg")
        logs = [e for e in d.get_log("browser") if e["level"] == "SEVERE"]
        assert not logs, logs
        print("ui_browser: all checks passed")
    finally:
        d.quit()


if __name__ == "__main__":
    main()
