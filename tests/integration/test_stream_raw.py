"""Streaming at the byte level: SSE framing, headers, disconnects, slow readers."""
import json
import signal
import socket
import threading
import time

import pytest
import requests

import harness
from conftest import example

MSGS = [{"role": "user", "content": "Once upon a time"}]


def metrics(base_url):
    out = {}
    for line in requests.get(base_url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def wait_idle(base_url, timeout=10):
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = metrics(base_url)
        if m["m40_running_sequences"] == 0 and m["m40_queue_depth"] == 0:
            return m
        time.sleep(0.05)
    raise AssertionError(f"still busy after {timeout}s: {m}")


def raw_request(base_url, body, path="/v1/chat/completions", rcvbuf=None):
    host, port = base_url.split("//")[1].split(":")
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect((host, int(port)))
    data = json.dumps(body).encode()
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
    return s


def read_all(s):
    out = b""
    while True:
        b = s.recv(65536)
        if not b:
            return out
        out += b


def dechunk(body):
    out, i = b"", 0
    while True:
        j = body.index(b"\r\n", i)
        n = int(body[i:j], 16)
        if n == 0:
            return out
        out += body[j + 2:j + 2 + n]
        i = j + 2 + n + 2


def split_response(raw):
    head, body = raw.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (l.split(":", 1) for l in lines[1:])}
    if headers.get("transfer-encoding") == "chunked":
        body = dechunk(body)
    return lines[0], headers, body


def check_sse(body, n_choices=1):
    text = body.decode()
    assert text.endswith("data: [DONE]\n\n")
    events = text.split("\n\n")
    assert events[-1] == ""
    events = events[:-1]
    assert events[-1] == "data: [DONE]"
    finished = {}
    for ev in events[:-1]:
        assert ev.startswith("data: ") and "\n" not in ev, repr(ev)
        obj = json.loads(ev[len("data: "):])
        for c in obj["choices"]:
            if c["finish_reason"]:
                finished[c["index"]] = c["finish_reason"]
    assert sorted(finished) == list(range(n_choices))
    return [json.loads(ev[6:]) for ev in events[:-1]]


def test_sse_framing_and_headers(base_url):
    s = raw_request(base_url, {"messages": MSGS, "max_tokens": 12, "stream": True, "temperature": 0})
    status, headers, body = split_response(read_all(s))
    s.close()
    assert status == "HTTP/1.1 200 OK"
    assert headers["content-type"] == "text/event-stream"
    assert headers["cache-control"] == "no-cache"
    assert headers["x-accel-buffering"] == "no"
    assert headers["transfer-encoding"] == "chunked"
    assert "content-length" not in headers
    objs = check_sse(body)
    assert objs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert objs[-1]["choices"][0]["delta"] == {}


def test_sse_completions_framing(base_url):
    s = raw_request(base_url, {"prompt": "Once", "max_tokens": 5, "stream": True,
                               "stream_options": {"include_usage": True}}, "/v1/completions")
    status, headers, body = split_response(read_all(s))
    s.close()
    objs = check_sse(body)
    assert all(o["object"] == "text_completion" for o in objs)
    assert objs[-1]["choices"] == [] and objs[-1]["usage"]["completion_tokens"] <= 5


def test_http10_stream(base_url):
    # no chunked encoding in HTTP/1.0: the stream ends when the connection closes
    host, port = base_url.split("//")[1].split(":")
    s = socket.create_connection((host, int(port)))
    data = json.dumps({"messages": MSGS, "max_tokens": 5, "stream": True}).encode()
    s.sendall(f"POST /v1/chat/completions HTTP/1.0\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    status, headers, body = split_response(read_all(s))
    s.close()
    assert status.endswith("200 OK")
    check_sse(body)


@pytest.fixture(scope="module")
def slow_server(instances):
    """One sequence at a time and a tiny socket send buffer: streams block on slow
    clients and choices wait in the queue, so disconnects cancel real work."""
    port = harness.free_port()
    text = example("minimal.conf").replace(
        "    m40_model /var/lib/m40/models/model.gguf;",
        "    m40_model /var/lib/m40/models/model.gguf;\n    m40_max_seqs 1;\n    m40_threads 1;")
    workdir = harness.make_workdir("slow")
    text = harness.render(text, workdir, {"127.0.0.1:8080": f"127.0.0.1:{port} sndbuf=4096"})
    inst = instances(text, "slow", port, log_level="debug")
    return f"http://127.0.0.1:{port}", inst


def test_client_disconnect_mid_stream(slow_server):
    base_url, inst = slow_server
    before = metrics(base_url)
    for _ in range(3):
        s = raw_request(base_url, {"messages": MSGS, "max_tokens": 100, "stream": True, "n": 8})
        buf = b""
        while b"data: " not in buf:
            chunk = s.recv(4096)
            assert chunk, "server closed before the first event"
            buf += chunk
        s.close()
    after = wait_idle(base_url)
    # with one sequence at a time, most of the 8 choices were still queued
    assert after["m40_requests_cancelled_total"] > before["m40_requests_cancelled_total"]
    assert after["m40_requests_total"] == before["m40_requests_total"] + 24
    assert "abandoning choice" in inst.log()
    r = requests.post(base_url + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 3})
    assert r.status_code == 200


def test_slow_reader_does_not_block_others(slow_server):
    # A client that does not read: its stream (n=8 with 20 top logprobs, about 1 MB)
    # overflows the socket buffers, so nginx must stop pulling its events while
    # other requests keep being served.
    base_url, inst = slow_server
    slow = raw_request(base_url, {"messages": MSGS, "max_tokens": 100, "stream": True, "n": 8,
                                  "logprobs": True, "top_logprobs": 20}, rcvbuf=4096)
    deadline = time.time() + 10
    while "client is slow, pausing" not in inst.log():
        assert time.time() < deadline, "the slow stream never filled the socket"
        time.sleep(0.05)
    t0 = time.time()
    for _ in range(3):
        r = requests.post(base_url + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 8}, timeout=30)
        assert r.status_code == 200
    assert time.time() - t0 < 20
    # now read the slow stream: complete and well formed
    status, headers, body = split_response(read_all(slow))
    slow.close()
    assert status == "HTTP/1.1 200 OK"
    objs = check_sse(body, n_choices=8)
    assert len(objs) > 8
    assert "client caught up, resuming" in inst.log()
    wait_idle(base_url)


def test_slow_reader_then_disconnect(slow_server):
    base_url, inst = slow_server
    before = metrics(base_url)
    slow = raw_request(base_url, {"messages": MSGS, "max_tokens": 100, "stream": True, "n": 8,
                                  "logprobs": True, "top_logprobs": 20}, rcvbuf=4096)
    time.sleep(0.5)
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST
    slow.close()
    after = wait_idle(base_url)
    assert after["m40_requests_total"] == before["m40_requests_total"] + 8
    r = requests.post(base_url + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 3})
    assert r.status_code == 200


def test_reload_keeps_running_streams(slow_server):
    # SIGHUP: a new worker loads the model; the old one finishes its streams first
    base_url, inst = slow_server
    slow = raw_request(base_url, {"messages": MSGS, "max_tokens": 100, "stream": True, "n": 8,
                                  "logprobs": True, "top_logprobs": 20}, rcvbuf=4096)
    time.sleep(0.3)
    inst.proc.send_signal(signal.SIGHUP)
    time.sleep(1.0)
    status, headers, body = split_response(read_all(slow))
    slow.close()
    assert status == "HTTP/1.1 200 OK"
    check_sse(body, n_choices=8)
    deadline = time.time() + 30
    while True:
        try:
            if requests.get(base_url + "/health", timeout=2).status_code == 200:
                break
        except requests.ConnectionError:
            pass
        assert time.time() < deadline
        time.sleep(0.1)
    r = requests.post(base_url + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 3})
    assert r.status_code == 200


def test_concurrent_streams(base_url):
    results, errors = [], []

    def one(i):
        try:
            s = raw_request(base_url, {"messages": MSGS, "max_tokens": 20, "stream": True, "seed": i})
            status, headers, body = split_response(read_all(s))
            s.close()
            check_sse(body)
            results.append(status)
        except Exception as e:  # reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert results == ["HTTP/1.1 200 OK"] * 12
