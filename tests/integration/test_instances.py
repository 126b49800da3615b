"""Servers other than the main one: overload (429), a model that fails to load
(503), the conf/ examples for TLS + API keys and for a reverse proxy, `m40 serve`."""
import glob
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import threading
import time

import openai
import pytest
import requests

import harness
from conftest import MODEL_NAME, example

MSGS = [{"role": "user", "content": "Once upon a time"}]


def minimal_with(port, extra, workdir_tag, model=harness.MODEL):
    text = example("minimal.conf")
    text = text.replace("    m40_model /var/lib/m40/models/model.gguf;",
                        "    m40_model /var/lib/m40/models/model.gguf;\n" + extra)
    workdir = harness.make_workdir(workdir_tag)
    return harness.render(text, workdir, {"127.0.0.1:8080": f"127.0.0.1:{port}"}, model=model)


def raw_burst(port, n, body):
    """n POST /v1/chat/completions on n connections, all on the wire before any answer
    is read; returns the raw responses in order."""
    req = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
           f"Connection: close\r\n\r\n").encode() + body
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]
    for s in socks:
        s.sendall(req)
    answers = []
    for s in socks:
        s.settimeout(120)
        raw = b""
        while True:
            b = s.recv(65536)
            if not b:
                break
            raw += b
        s.close()
        answers.append(raw)
    return answers


def test_burst_waits_instead_of_429(instances):
    # 100 requests at once on 2 slots: 98 wait in the queue (default depth 1024) and
    # every one completes; nothing is refused
    port = harness.free_port()
    inst = instances(minimal_with(port, "    m40_max_seqs 2;\n    m40_threads 1;\n    m40_gpu_memory_fraction 0.5;\n",
                                  "burst"), "burst", port)
    # 48 tokens each (end of sequence does not stop them): the engine needs far longer
    # for the burst than nginx needs to read it, so most of it really waits
    body = json.dumps({"messages": MSGS, "max_tokens": 48, "temperature": 0, "ignore_eos": True}).encode()
    t0 = time.time()
    answers = raw_burst(port, 100, body)
    took = time.time() - t0
    statuses = [a.split(b"\r\n", 1)[0].decode() for a in answers]
    assert statuses.count("HTTP/1.1 200 OK") == 100, statuses
    texts = {json.loads(a.split(b"\r\n\r\n", 1)[1])["choices"][0]["message"]["content"] for a in answers}
    assert len(texts) == 1, texts  # the same greedy prompt: the same answer, waited for or not
    print(f"burst of 100 on 2 slots: {took:.2f} s")
    m = requests.get(f"http://127.0.0.1:{port}/metrics").text
    rejected = [l for l in m.splitlines() if l.startswith("m40_requests_rejected_total ")]
    assert float(rejected[0].split()[1]) == 0
    # at start the worker logged what it sized (notice level)
    kv = [l for l in inst.log().splitlines() if "KV cache:" in l]
    assert len(kv) == 1 and "[notice]" in kv[0], kv
    assert "sequences of" in kv[0] and "max_seqs 2;" in kv[0] and "max_queue 1024" in kv[0], kv[0]


def test_queue_full_429(instances):
    port = harness.free_port()
    instances(minimal_with(port, "    m40_max_seqs 1;\n    m40_max_queue 1;\n    m40_threads 1;\n", "queue"),
              "queue", port)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    body = json.dumps({"messages": MSGS, "max_tokens": 100}).encode()
    # All requests on the wire before any answer: one runs, one waits, the rest
    # find the queue full.
    socks = []
    for _ in range(12):
        s = socket.create_connection(("127.0.0.1", port))
        socks.append(s)
    req = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
           f"Connection: close\r\n\r\n").encode() + body
    for s in socks:
        s.sendall(req)
    answers = []
    for s in socks:
        raw = b""
        while True:
            b = s.recv(65536)
            if not b:
                break
            raw += b
        s.close()
        answers.append(raw)
    statuses = [a.split(b"\r\n", 1)[0].decode() for a in answers]
    assert all(st in ("HTTP/1.1 200 OK", "HTTP/1.1 429 Too Many Requests") for st in statuses), statuses
    assert statuses.count("HTTP/1.1 429 Too Many Requests") >= 1, statuses
    assert statuses.count("HTTP/1.1 200 OK") >= 1, statuses
    for a in answers:
        if b" 429 " in a.split(b"\r\n", 1)[0]:
            head, body = a.split(b"\r\n\r\n", 1)
            headers = dict(l.split(": ", 1) for l in head.decode().split("\r\n")[1:])
            assert int(headers["Retry-After"]) >= 1, headers
            assert headers["Content-Type"].startswith("application/json"), headers
            err = json.loads(body)["error"]
            assert err["code"] == "queue_full" and err["type"] == "rate_limit_error" and err["message"]
    # the SDK sees a RateLimitError
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(model=MODEL_NAME, messages=MSGS, max_tokens=4)
    assert r.choices[0].message.content is not None
    m = requests.get(f"http://127.0.0.1:{port}/metrics").text
    rejected = [l for l in m.splitlines() if l.startswith("m40_requests_rejected_total ")]
    assert float(rejected[0].split()[1]) == statuses.count("HTTP/1.1 429 Too Many Requests")


def test_n_past_capacity_400(instances):
    # the n choices of a request enter the waiting queue together: n past m40_max_queue
    # could never be admitted, so 400 naming n, not a 429 a retry could never get past;
    # n that fits still works (choices run one after another on one slot)
    port = harness.free_port()
    instances(minimal_with(port, "    m40_max_seqs 1;\n    m40_max_queue 2;\n    m40_threads 1;\n", "ncap"),
              "ncap", port)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    r = requests.post(url, json={"messages": MSGS, "max_tokens": 2, "n": 3})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "n" and err["type"] == "invalid_request_error", err
    assert "m40_max_queue" in err["message"] and "2 requests" in err["message"], err
    r = requests.post(url, json={"messages": MSGS, "max_tokens": 2, "n": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text


def test_prefill_directives(instances):
    # small prompt budgets and a strict guard: concurrent requests still get the answer
    # each gets alone, the worker logs what it was given, /metrics shows the guard
    port = harness.free_port()
    inst = instances(minimal_with(port, "    m40_max_seqs 4;\n    m40_threads 1;\n    m40_prefill_budget 6;\n"
                                        "    m40_prefill_chunk 4;\n    m40_itl_guard 1.5;\n", "prefill"),
                     "prefill", port)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    prompts = ["Once upon a time", "The little dog ran to the big tree and", "Lily and Tom went to the park. They saw",
               "One day", "She was happy because", "A bird sat on a tree and sang"]
    alone = [client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=12, temperature=0).choices[0].text
             for p in prompts]
    got = [None] * len(prompts)

    def one(i):
        got[i] = client.completions.create(model=MODEL_NAME, prompt=prompts[i], max_tokens=12,
                                           temperature=0).choices[0].text
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == alone
    kv = [l for l in inst.log().splitlines() if "KV cache:" in l]
    assert len(kv) == 1 and "; prefill 6 tokens a step, 4 a sequence; ITL guard 1.5x" in kv[0], kv
    m = requests.get(f"http://127.0.0.1:{port}/metrics").text
    for name in ("m40_prefill_guard_limited_steps_total", "m40_prefill_guard_probe_steps_total",
                 "m40_decode_step_seconds"):
        assert any(l.startswith(name + " ") for l in m.splitlines()), name


def test_model_that_fails_to_load_503(instances):
    port = harness.free_port()
    workdir = harness.make_workdir("broken")
    with open(os.path.join(workdir, "broken.gguf"), "wb") as f:
        f.write(b"GGUF\x03\x00\x00\x00" + os.urandom(256))
    text = harness.render(example("minimal.conf"), workdir, {"127.0.0.1:8080": f"127.0.0.1:{port}"},
                          model=os.path.join(workdir, "broken.gguf"))
    instances(text, "broken", port, want_ready=False)
    r = requests.get(f"http://127.0.0.1:{port}/health")
    assert r.status_code == 503
    assert r.json()["status"] == "failed" and r.json()["error"]
    assert workdir not in r.text, r.text  # no server paths to clients: they go to the error log
    r = requests.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={"messages": MSGS})
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "model_failed"
    assert workdir not in r.text, r.text
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.InternalServerError) as ei:
        client.chat.completions.create(model="broken", messages=MSGS)
    assert ei.value.status_code == 503
    assert requests.get(f"http://127.0.0.1:{port}/v1/models").status_code == 200


def test_missing_model_rejected_by_nginx_t(tmp_path):
    workdir = harness.make_workdir("missing")
    text = harness.render(example("minimal.conf"), workdir, model="/nonexistent/model.gguf")
    inst = harness.Nginx(text, "missing")
    with pytest.raises(RuntimeError, match="nonexistent"):
        inst.start()
    inst.cleanup()


def test_api_without_model_rejected_by_nginx_t():
    workdir = harness.make_workdir("nomodel")
    text = harness.render(example("minimal.conf"), workdir).replace(
        f"    m40_model {harness.MODEL};\n", "")
    inst = harness.Nginx(text, "nomodel")
    with pytest.raises(RuntimeError, match="no \"m40_model\""):
        inst.start()
    inst.cleanup()


@pytest.mark.parametrize("directive", [
    "m40_device gpu;", "m40_max_seqs 0;", "m40_ctx_size -1;", "m40_threads many;",
    "m40_max_tokens_default 9000;", "m40_chat_template /nonexistent.jinja;", "m40_max_queue 0;", "m40_load_wait soon;",
    "m40_gpu_memory_fraction 0;", "m40_gpu_memory_fraction 1.5;", "m40_gpu_memory_fraction 0.9x;",
    "m40_gpu_memory_fraction -0.5;", "m40_prefill_budget 0;", "m40_prefill_budget 65537;",
    "m40_prefill_chunk -1;", "m40_prefill_chunk many;", "m40_itl_guard 0.5;", "m40_itl_guard on;",
    "m40_itl_guard 101;", "m40_itl_guard 2x;", "m40_batch_invariant maybe;", "m40_batch_invariant;",
])
def test_bad_directives_rejected_by_nginx_t(directive):
    workdir = harness.make_workdir("baddir")
    text = harness.render(example("minimal.conf"), workdir).replace(
        f"    m40_model {harness.MODEL};\n", f"    m40_model {harness.MODEL};\n    {directive}\n")
    inst = harness.Nginx(text, "baddir")
    with pytest.raises(RuntimeError, match="nginx -t failed"):
        inst.start()
    inst.cleanup()


def test_gpu_memory_fraction_message():
    workdir = harness.make_workdir("fraction")
    text = harness.render(example("minimal.conf"), workdir).replace(
        f"    m40_model {harness.MODEL};\n", f"    m40_model {harness.MODEL};\n    m40_gpu_memory_fraction 95;\n")
    inst = harness.Nginx(text, "fraction")
    with pytest.raises(RuntimeError, match=r'invalid m40_gpu_memory_fraction "95": a number greater than 0 and at '
                                           r'most 1 expected'):
        inst.start()
    inst.cleanup()


def test_itl_guard_message():
    workdir = harness.make_workdir("guard")
    text = harness.render(example("minimal.conf"), workdir).replace(
        f"    m40_model {harness.MODEL};\n", f"    m40_model {harness.MODEL};\n    m40_itl_guard 0.9;\n")
    inst = harness.Nginx(text, "guard")
    with pytest.raises(RuntimeError, match=r'invalid m40_itl_guard "0.9": a number from 1 to 100 \(e.g. 2\) or '
                                           r'"off" expected'):
        inst.start()
    inst.cleanup()


def test_chat_template_override(instances):
    port = harness.free_port()
    workdir = harness.make_workdir("tmpl")
    with open(os.path.join(workdir, "t.jinja"), "w") as f:
        f.write("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    text = minimal_with(port, f"    m40_chat_template {workdir}/t.jinja;\n", "tmpl")
    instances(text, "tmpl", port)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    chat = client.chat.completions.create(model=MODEL_NAME, messages=MSGS, max_tokens=8, temperature=0)
    comp = client.completions.create(model=MODEL_NAME, prompt=MSGS[0]["content"], max_tokens=8, temperature=0)
    # the template renders just the content: the same prompt as /v1/completions
    assert chat.usage.prompt_tokens == comp.usage.prompt_tokens
    assert chat.choices[0].message.content == comp.choices[0].text


@pytest.fixture(scope="module")
def tls_server(instances, tls_cert):
    crt, key = tls_cert
    port = harness.free_port()
    workdir = harness.make_workdir("tls")
    text = harness.render(example("tls-apikey.conf"), workdir, {
        "127.0.0.1:8443": f"127.0.0.1:{port}",
        "/etc/m40/tls/server.crt": crt,
        "/etc/m40/tls/server.key": key,
    })
    inst = instances(text, "tls", None)
    base = f"https://127.0.0.1:{port}"
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            r = requests.get(base + "/health", verify=crt, headers={"Authorization": "Bearer sk-m40-example-key"})
            if r.status_code == 200:
                break
        except requests.ConnectionError:
            pass
        time.sleep(0.1)
    return base, crt


def test_tls_api_key_401(tls_server):
    base, crt = tls_server
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sk-m40-example-key"}):
        r = requests.post(base + "/v1/chat/completions", json={"messages": MSGS}, verify=crt, headers=headers)
        assert r.status_code == 401
        assert r.headers["Content-Type"] == "application/json"
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["WWW-Authenticate"].startswith("Bearer")
    client = openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0,
                           http_client=openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=crt)))
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_tls_api_key_200(tls_server):
    base, crt = tls_server
    client = openai.OpenAI(base_url=base + "/v1", api_key="sk-m40-example-key", max_retries=0,
                           http_client=openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=crt)))
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    full = client.chat.completions.create(model=MODEL_NAME, messages=MSGS, max_tokens=16, temperature=0)
    stream = client.chat.completions.create(model=MODEL_NAME, messages=MSGS, max_tokens=16, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == \
        full.choices[0].message.content


def test_tls_http2_stream(tls_server):
    base, crt = tls_server
    curl = shutil.which("curl")
    if not curl or "HTTP2" not in subprocess.run([curl, "-V"], capture_output=True, text=True).stdout:
        pytest.skip("curl without HTTP/2")
    body = json.dumps({"messages": MSGS, "max_tokens": 40, "stream": True, "n": 4})
    out = subprocess.run([curl, "-sS", "--http2", "--cacert", crt, "-H", "Authorization: Bearer sk-m40-example-key",
                          "-H", "Content-Type: application/json", "-d", body, "-D", "-", "-N",
                          base + "/v1/chat/completions"], capture_output=True, timeout=60)
    assert out.returncode == 0, out.stderr
    text = out.stdout.decode()
    assert text.startswith("HTTP/2 200")
    assert "content-type: text/event-stream" in text.lower()
    assert text.endswith("data: [DONE]\n\n")
    assert text.count('"finish_reason":"') == 4


@pytest.fixture(scope="module")
def proxy_server(instances):
    front, back = harness.free_port(), harness.free_port()
    workdir = harness.make_workdir("proxy")
    text = harness.render(example("behind-proxy.conf"), workdir, {
        "127.0.0.1:8080": f"127.0.0.1:{front}",
        "127.0.0.1:8081": f"127.0.0.1:{back}",
    })
    instances(text, "proxy", front)
    return f"http://127.0.0.1:{front}", f"http://127.0.0.1:{back}"


def test_behind_proxy_streaming(proxy_server):
    front, back = proxy_server
    direct = openai.OpenAI(base_url=back + "/v1", api_key="x", max_retries=0)
    proxied = openai.OpenAI(base_url=front + "/v1", api_key="x", max_retries=0)
    full = direct.chat.completions.create(model=MODEL_NAME, messages=MSGS, max_tokens=24, temperature=0)
    chunks = list(proxied.chat.completions.create(model=MODEL_NAME, messages=MSGS, max_tokens=24, temperature=0,
                                                  stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    r = requests.post(front + "/v1/chat/completions", json={"messages": MSGS, "stream": True, "max_tokens": 4})
    assert r.headers["Content-Type"] == "text/event-stream"
    assert r.text.endswith("data: [DONE]\n\n")
    assert requests.get(front + "/health").json()["status"] == "ready"
    e = requests.post(front + "/v1/chat/completions", data=b"{").json()
    assert set(e["error"]) == {"message", "type", "param", "code"}


def test_behind_proxy_client_disconnect(proxy_server):
    front, back = proxy_server
    s = socket.create_connection(("127.0.0.1", int(front.rsplit(":", 1)[1])))
    body = json.dumps({"messages": MSGS, "max_tokens": 100, "stream": True, "n": 4}).encode()
    s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    assert b"HTTP/1.1 200" in s.recv(4096)
    s.close()
    deadline = time.time() + 10
    while time.time() < deadline:
        m = requests.get(back + "/metrics").text
        if "\nm40_running_sequences 0\n" in m and "\nm40_queue_depth 0\n" in m:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("sequences still running after the client left")
    assert requests.post(front + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2}).status_code == 200


def test_m40_serve():
    m40 = os.path.join(harness.ROOT, "build", "m40")
    port = harness.free_port()
    workdir = harness.make_workdir("serve")
    # the engine's switches set for `m40 serve` must reach the nginx worker (nginx
    # clears its workers' environment): the written conf passes them with env
    proc = subprocess.Popen([m40, "serve", harness.MODEL, "--port", str(port), "--name", "served", "--threads", "1",
                             "--max-queue", "5", "--gpu-memory-fraction", "0.8", "--prefill-budget", "64",
                             "--prefill-chunk", "16", "--itl-guard", "off", "--batch-invariant",
                             "--module", harness.MODULE, "--nginx", harness.NGINX],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=dict({k: v for k, v in os.environ.items() if k != "M40_SKINNY"}, TMPDIR=workdir,
                                     M40_PDL="1"))
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 60
        while time.time() < deadline:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                if requests.get(base + "/health").status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            time.sleep(0.1)
        confs = glob.glob(os.path.join(workdir, "**", "nginx.conf"), recursive=True)
        assert len(confs) == 1, confs
        with open(confs[0]) as f:
            conf = f.read()
        assert "\nenv M40_PDL;\n" in conf and "env M40_SKINNY;" not in conf
        assert "\n    m40_max_queue 5;\n" in conf and "\n    m40_gpu_memory_fraction 0.8;\n" in conf, conf
        assert ("\n    m40_prefill_budget 64;\n" in conf and "\n    m40_prefill_chunk 16;\n" in conf
                and "\n    m40_itl_guard off;\n" in conf and "\n    m40_batch_invariant on;\n" in conf), conf
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["served"]
        r = client.chat.completions.create(model="served", messages=MSGS, max_tokens=4)
        assert r.choices[0].message.content is not None
        # what `m40 ps` reads: where the model runs, its memory, its sequences
        # (the engine frees the finished sequence's slot just after its last event: the
        # answer can arrive a moment before /health counts it gone)
        deadline = time.time() + 5
        h = requests.get(base + "/health").json()
        while (h.get("running") or h.get("queued")) and time.time() < deadline:
            time.sleep(0.05)
            h = requests.get(base + "/health").json()
        assert h["device"] == "cpu" and h["memory_bytes"] > 0 and h["ctx_size"] > 0, h
        assert h["max_seqs"] >= 1 and h["running"] == 0 and h["queued"] == 0, h
        assert 0 < h["kv_tokens_total"] and 0 <= h["kv_tokens_used"] <= h["kv_tokens_total"], h
        ps = subprocess.run([m40, "ps", base], capture_output=True, text=True, timeout=30)
        assert ps.returncode == 0, ps.stderr
        row = ps.stdout.splitlines()[1].split()
        assert row[:3] == ["served", "ready", "cpu"] and row[5] == "0/%d" % h["max_seqs"], ps.stdout
        assert row[-1] == str(h["ctx_size"]), ps.stdout
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=15) is not None
        out = proc.stdout.read().decode()
        assert "m40 serve: http://127.0.0.1:%d/v1" % port in out
        assert "exited on signal" not in out
        # its temporary directory (config, pid file, nginx's temp folders) is gone
        assert glob.glob(os.path.join(workdir, "m40-serve-*")) == [], os.listdir(workdir)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_m40_serve_also():
    # --also [NAME=]MODEL: one server, two models; "model" picks, none goes to the first
    m40 = os.path.join(harness.ROOT, "build", "m40")
    port = harness.free_port()
    workdir = harness.make_workdir("serve-also")
    proc = subprocess.Popen([m40, "serve", harness.MODEL, "--port", str(port), "--name", "first", "--threads", "1",
                             "--also", "second=" + harness.MODEL, "--no-ui",
                             "--module", harness.MODULE, "--nginx", harness.NGINX],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=dict(os.environ, TMPDIR=workdir))
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 60
        while time.time() < deadline:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                h = requests.get(base + "/health")
                if h.status_code == 200 and all(m["status"] == "ready" for m in h.json().get("models", [])):
                    break
            except requests.ConnectionError:
                pass
            time.sleep(0.1)
        confs = glob.glob(os.path.join(workdir, "**", "nginx.conf"), recursive=True)
        with open(confs[0]) as f:
            conf = f.read()
        assert conf.count("\n    m40_model ") == 2 and '"name=second"' in conf, conf
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["first", "second"]
        for name in ("first", "second"):
            r = client.completions.create(model=name, prompt="Once upon a time", max_tokens=4, temperature=0)
            assert r.model == name and r.choices[0].text
        r = requests.post(base + "/v1/completions", json={"prompt": "Once", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "first", r.text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    r = subprocess.run([m40, "serve", harness.MODEL, "--also", "x=/nonexistent.gguf"], capture_output=True)
    assert r.returncode == 1 and b"nonexistent" in r.stderr
    r = subprocess.run([m40, "serve", harness.MODEL, "--also", 'b"ad=' + harness.MODEL], capture_output=True)
    assert r.returncode == 2 and b"invalid name" in r.stderr


def test_m40_serve_usage_errors():
    m40 = os.path.join(harness.ROOT, "build", "m40")
    assert subprocess.run([m40, "serve"], capture_output=True).returncode == 2
    assert subprocess.run([m40, "serve", harness.MODEL, "--port", "0"], capture_output=True).returncode == 2
    for bad in (["--gpu-memory-fraction", "0"], ["--gpu-memory-fraction", "1.01"], ["--gpu-memory-fraction", "x"],
                ["--max-queue", "0"]):
        r = subprocess.run([m40, "serve", harness.MODEL] + bad, capture_output=True)
        assert r.returncode == 2 and bad[0].encode() in r.stderr, (bad, r.stderr)
    assert subprocess.run([m40, "serve", "/nonexistent.gguf"], capture_output=True).returncode == 1
    r = subprocess.run([m40, "serve", harness.MODEL, "--device", "0", "--tp", "2", "--batch-invariant"],
                       capture_output=True)
    assert r.returncode == 2 and b"--batch-invariant does not work with --tp 2" in r.stderr, r.stderr
    r = subprocess.run([m40, "serve", harness.MODEL, "--module", "/nonexistent.so"], capture_output=True)
    assert r.returncode == 1


def test_requests_wait_for_a_loading_model(monkeypatch):
    # A request that arrives while the model loads (a new worker after a reload) waits
    # for it, up to m40_load_wait (default 60 s), instead of a 503; with a short
    # m40_load_wait it gets the 503 model_loading after that long.
    monkeypatch.setenv("M40_TEST_LOAD_DELAY_MS", "2000")
    for wait, want in (("", 200), ("    m40_load_wait 100ms;\n", 503)):
        port = harness.free_port()
        text = minimal_with(port, "    m40_threads 1;\n" + wait, "loadwait").replace(
            "worker_processes 1;", "worker_processes 1;\nenv M40_TEST_LOAD_DELAY_MS;")
        inst = harness.Nginx(text, "loadwait", None).start()  # no wait: the model is still loading
        health = f"http://127.0.0.1:{port}/health"
        deadline = time.time() + 10
        while True:
            try:
                h = requests.get(health, timeout=2)
                break
            except requests.ConnectionError:
                assert time.time() < deadline, "nginx never listened"
                time.sleep(0.05)
        assert h.json()["status"] == "loading", h.text
        t0 = time.time()
        r = requests.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                          json={"messages": MSGS, "max_tokens": 2}, timeout=30)
        assert r.status_code == want, r.text
        try:
            if want == 200:
                assert r.json()["choices"][0]["message"] is not None
            else:
                assert r.json()["error"]["code"] == "model_loading" and time.time() - t0 < 1.5, r.text
        finally:
            inst.stop()
            assert not inst.crashes()
            inst.cleanup()
