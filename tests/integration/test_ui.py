"""The chat page (m40_ui): the directive in nginx -t, the page over HTTP beside the API,
`m40 serve` with and without it, and the page in a real browser (Debian's chromium,
headless, driven by selenium through ui_browser.py; skipped when those are absent)."""
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import requests

import harness
from conftest import MODEL_NAME, example

PAGE = os.path.join(harness.ROOT, "ngx_m40_module", "ui", "chat.html")
SYSTEM_PYTHON = "/usr/bin/python3"   # Debian's python3-selenium lives there, not in .venv


def conf_with_server(port, server_body, tag):
    """minimal.conf with its server block's locations replaced by server_body."""
    text = example("minimal.conf")
    old = "        location / {\n            m40_api;\n        }\n"
    assert old in text
    text = text.replace(old, server_body)
    workdir = harness.make_workdir(tag)
    return harness.render(text, workdir, {"127.0.0.1:8080": f"127.0.0.1:{port}"})


def nginx_t(text, tag):
    inst = harness.Nginx(text, tag)
    args = [harness.NGINX, "-t", "-p", inst.workdir, "-c", inst.conf, "-e", inst.error_log,
            "-g", f"pid {inst.workdir}/nginx.pid;"]
    r = subprocess.run(args, capture_output=True, text=True)
    inst.cleanup()
    return r.returncode, r.stderr


def test_ui_directive_parses():
    body = ("        location / {\n            m40_api;\n            m40_ui on;\n        }\n"
            "        location = /chat {\n            m40_ui on;\n        }\n"
            "        location /off/ {\n            m40_ui off;\n        }\n")
    rc, err = nginx_t(conf_with_server(8080, body, "ui-t"), "ui-t")
    assert rc == 0, err


@pytest.mark.parametrize("where,body,message", [
    ("http", None, '"m40_ui" directive is not allowed here'),
    ("server", "        m40_ui on;\n        location / {\n            m40_api;\n        }\n",
     '"m40_ui" directive is not allowed here'),
    ("if", "        location / {\n            if ($arg_x) {\n                m40_ui on;\n            }\n        }\n",
     '"m40_ui" directive is not allowed here'),
    ("value", "        location / {\n            m40_ui yes;\n        }\n", 'invalid value "yes"'),
    ("args", "        location / {\n            m40_ui;\n        }\n", "invalid number of arguments"),
    ("duplicate", "        location / {\n            m40_ui on;\n            m40_ui off;\n        }\n",
     '"m40_ui" directive is duplicate'),
    ("regex", "        location ~ ^/chat$ {\n            m40_ui on;\n        }\n",
     "needs a prefix or exact location"),
])
def test_ui_directive_refused(where, body, message):
    if body is None:
        text = conf_with_server(8080, "        location / {\n            m40_api;\n        }\n", "ui-bad")
        text = text.replace("http {", "http {\n    m40_ui on;", 1)
    else:
        text = conf_with_server(8080, body, "ui-bad")
    rc, err = nginx_t(text, "ui-bad")
    assert rc != 0 and message in err, err


@pytest.fixture(scope="module")
def ui_server(instances):
    port = harness.free_port()
    body = ("        location / {\n            m40_api;\n            m40_ui on;\n        }\n"
            "        location /chat/ {\n            m40_ui on;\n        }\n")
    instances(conf_with_server(port, body, "ui"), "ui", port)
    return f"http://127.0.0.1:{port}"


def test_ui_page_beside_the_api(ui_server):
    with open(PAGE, "rb") as f:
        page = f.read()
    for path in ("/", "/index.html", "/chat/", "/chat/index.html"):
        r = requests.get(ui_server + path)
        assert r.status_code == 200, path
        assert r.headers["Content-Type"] == "text/html; charset=utf-8"
        assert r.content == page, path          # the build embedded the file byte for byte
        assert "connect-src 'self'" in r.headers["Content-Security-Policy"]
        assert r.headers["X-Content-Type-Options"] == "nosniff"
    h = requests.head(ui_server + "/")
    assert h.status_code == 200 and h.content == b"" and int(h.headers["Content-Length"]) == len(page)
    r = requests.post(ui_server + "/", data=b"x")
    assert r.status_code == 405 and r.headers["Allow"] == "GET, HEAD"
    # the API keeps its paths and its JSON errors
    r = requests.get(ui_server + "/v1/models")
    assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == [MODEL_NAME]
    r = requests.get(ui_server + "/v1/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = requests.get(ui_server + "/chat.html")
    assert r.status_code == 404 and "error" in r.json()
    # a location with m40_ui alone: the page at its URI, nothing else
    assert requests.get(ui_server + "/chat/v1/models").status_code == 404


def test_ui_page_is_self_contained():
    with open(PAGE, encoding="utf-8") as f:
        html = f.read()
    assert not re.search(r"<(script|link|img|iframe)[^>]*\s(src|href)\s*=", html, re.I), "external resource"
    assert "@import" not in html and "url(" not in html
    assert "v1/models" in html and "v1/chat/completions" in html
    assert not re.search(r"fetch\(\s*[\"']/", html), "absolute API paths break a page under a prefix"


def serve(args, workdir):
    m40 = os.path.join(harness.ROOT, "build", "m40")
    port = harness.free_port()
    proc = subprocess.Popen([m40, "serve", harness.MODEL, "--port", str(port), "--threads", "1",
                             "--module", harness.MODULE, "--nginx", harness.NGINX] + args,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=dict(os.environ, TMPDIR=workdir))
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while time.time() < deadline:
        assert proc.poll() is None, proc.stdout.read().decode()
        try:
            if requests.get(base + "/health").status_code == 200:
                return proc, base
        except requests.ConnectionError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("m40 serve did not become ready")


def stop(proc):
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return proc.stdout.read().decode()


@pytest.mark.parametrize("no_ui", [False, True])
def test_m40_serve_ui(no_ui):
    workdir = harness.make_workdir("serve-ui")
    proc, base = serve(["--no-ui"] if no_ui else [], workdir)
    try:
        r = requests.get(base + "/")
        if no_ui:
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        else:
            assert r.status_code == 200 and "<title>m40 chat</title>" in r.text
        assert requests.get(base + "/v1/models").status_code == 200
    finally:
        out = stop(proc)
    assert ("chat page at " + base + "/" in out) != no_ui, out


def browser_missing():
    for tool in ("chromium", "chromedriver"):
        if not shutil.which(tool):
            return f"{tool} is not installed (Debian packages chromium, chromium-driver)"
    if not os.path.exists(SYSTEM_PYTHON) or subprocess.run(
            [SYSTEM_PYTHON, "-c", "import selenium"], capture_output=True).returncode != 0:
        return "python3-selenium is not installed"
    return None


def run_browser(request, base, model, *mode):
    why = browser_missing()
    if why:
        pytest.skip(why)
    out_dir = os.path.join(os.environ.get("M40_TEST_OUTPUT", os.path.join(harness.ROOT, "build", "test-output")),
                           "ui")
    os.makedirs(out_dir, exist_ok=True)
    r = subprocess.run([SYSTEM_PYTHON, os.path.join(os.path.dirname(__file__), "ui_browser.py"),
                        base + "/", model, out_dir] + list(mode), capture_output=True, text=True, timeout=300)
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    for line in r.stdout.splitlines():
        if line.startswith("screenshot:") and reporter:
            reporter.write_line(request.node.name + " " + line)
    assert r.returncode == 0, r.stdout + r.stderr


def test_ui_in_chromium(ui_server, request):
    run_browser(request, ui_server, MODEL_NAME)


def test_ui_reasoning_in_chromium(instances, request):
    """DeepSeek-R1's template opens <think> in the prompt: the whole short answer is
    reasoning_content, which the page shows collapsed."""
    template = os.path.join(harness.SHARED, "templates", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja")
    model = os.path.join(harness.SHARED, "models", "tiny-qwen2-gpt2-f16.gguf")
    for p in (template, model):
        if not os.path.exists(p):
            pytest.skip(f"{p} not found")
    if browser_missing():
        pytest.skip(browser_missing())
    port = harness.free_port()
    text = example("minimal.conf").replace(
        "    m40_model /var/lib/m40/models/model.gguf;",
        f"    m40_model /var/lib/m40/models/model.gguf;\n    m40_chat_template {template};").replace(
        "            m40_api;\n", "            m40_api;\n            m40_ui on;\n")
    assert "m40_ui on;" in text and "m40_chat_template" in text
    text = harness.render(text, harness.make_workdir("ui-r1"), {"127.0.0.1:8080": f"127.0.0.1:{port}"}, model=model)
    instances(text, "ui-r1", port)
    run_browser(request, f"http://127.0.0.1:{port}", "tiny-qwen2-gpt2-f16", "reasoning")
