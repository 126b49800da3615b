"""Errors: OpenAI-shaped bodies and the right HTTP statuses; the server survives."""
import json

import openai
import pytest
import requests

MSGS = [{"role": "user", "content": "Hello"}]


def check_error(r, status, param=None):
    assert r.status_code == status, r.text
    assert r.headers["Content-Type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}
    e = body["error"]
    assert set(e) == {"message", "type", "param", "code"}
    assert isinstance(e["message"], str) and e["message"]
    assert isinstance(e["type"], str)
    if param is not None:
        assert e["param"] == param
    return e


def post(base_url, body, path="/v1/chat/completions", **kw):
    if not isinstance(body, (bytes, str)):
        body = json.dumps(body)
    return requests.post(base_url + path, data=body, headers={"Content-Type": "application/json"}, **kw)


def still_alive(base_url):
    r = post(base_url, {"messages": MSGS, "max_tokens": 2})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("body", [
    b"{", b"", b"not json", b"[1,2,3]", b'{"messages": [}', b'"string"', b"null",
    b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}",
])
def test_malformed_json(base_url, body):
    check_error(post(base_url, body), 400)
    still_alive(base_url)


@pytest.mark.parametrize("field,value", [
    ("messages", "hi"), ("messages", []), ("messages", [{"role": "user"}]),
    ("messages", [{"role": "wizard", "content": "x"}]), ("messages", [{"role": "user", "content": 5}]),
    ("messages", [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
    ("messages", [{"role": "user", "content": [{"type": "text", "text": 1}]}]),
    ("messages", ["user"]),
    ("max_tokens", 0), ("max_tokens", "10"), ("max_tokens", 1.5), ("max_tokens", 10**9),
    ("max_completion_tokens", -1),
    ("temperature", "hot"), ("temperature", 2.5), ("temperature", -0.1),
    ("top_p", 1.5), ("top_p", "x"), ("top_k", "5"), ("min_p", 2),
    ("n", 0), ("n", 9), ("n", True),
    ("stop", 5), ("stop", ["a", "b", "c", "d", "e"]), ("stop", [1]),
    ("seed", "1"), ("seed", 1.5),
    ("presence_penalty", 3), ("frequency_penalty", -2.5),
    ("logit_bias", []), ("logit_bias", {"abc": 1}), ("logit_bias", {"5": 101}), ("logit_bias", {"5": "x"}),
    ("logit_bias", {"999999": 1}),
    ("logprobs", "yes"), ("top_logprobs", 21), ("top_logprobs", -1),
    ("stream", "true"), ("stream_options", 1), ("stream_options", {"include_usage": "yes"}),
    ("model", 5), ("user", 5),
])
def test_wrong_types_and_ranges(base_url, field, value):
    body = {"messages": MSGS, "max_tokens": 4, field: value}
    e = check_error(post(base_url, body), 400)
    assert e["type"] == "invalid_request_error"
    assert e["param"] in (field, "stream_options.include_usage"), e


def test_top_logprobs_needs_logprobs(base_url):
    check_error(post(base_url, {"messages": MSGS, "top_logprobs": 2}), 400, "top_logprobs")


@pytest.mark.parametrize("field,value", [
    ("prompt", 5), ("prompt", ["a", "b"]), ("prompt", [[1, 2]]), ("logprobs", True), ("logprobs", 21),
    ("echo", "yes"),
])
def test_completions_wrong_types(base_url, field, value):
    body = {"prompt": "Once", "max_tokens": 4, field: value}
    check_error(post(base_url, body, "/v1/completions"), 400, field)


def test_missing_required(base_url):
    check_error(post(base_url, {"max_tokens": 4}), 400, "messages")
    check_error(post(base_url, {"max_tokens": 4}, "/v1/completions"), 400, "prompt")


def test_unknown_model_404(client, base_url):
    with pytest.raises(openai.NotFoundError) as ei:
        client.chat.completions.create(model="no-such-model", messages=MSGS, max_tokens=2)
    assert ei.value.status_code == 404
    e = check_error(post(base_url, {"model": "gpt-4", "messages": MSGS}), 404, "model")
    assert e["code"] == "model_not_found"
    check_error(post(base_url, {"model": "gpt-4", "prompt": "x"}, "/v1/completions"), 404, "model")


@pytest.mark.parametrize("method,path,allow", [
    ("GET", "/v1/chat/completions", "POST"), ("PUT", "/v1/completions", "POST"),
    ("DELETE", "/v1/chat/completions", "POST"), ("POST", "/v1/models", "GET, HEAD"),
    ("POST", "/health", "GET, HEAD"), ("POST", "/metrics", "GET, HEAD"),
])
def test_wrong_method_405(base_url, method, path, allow):
    r = requests.request(method, base_url + path, data=b"{}")
    e = check_error(r, 405)
    assert r.headers["Allow"] == allow
    assert e["code"] == "method_not_allowed"


def test_unknown_endpoint_404(base_url):
    check_error(requests.get(base_url + "/v1/embeddings"), 404)
    check_error(requests.post(base_url + "/v2/chat", data=b"{}"), 404)


def test_prompt_too_long(client, base_url, model):
    long_text = "Once upon a time there was a little dog. " * 400
    r = post(base_url, {"messages": [{"role": "user", "content": long_text}], "max_tokens": 4})
    e = check_error(r, 400)
    assert e["type"] == "invalid_request_error"
    r = post(base_url, {"messages": [{"role": "user", "content": long_text}], "max_tokens": 4, "stream": True})
    check_error(r, 400)
    r = post(base_url, {"prompt": long_text, "max_tokens": 4}, "/v1/completions")
    check_error(r, 400)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": long_text}])
    still_alive(base_url)


def test_huge_body_413(base_url):
    body = json.dumps({"messages": MSGS, "padding": "x" * (2 * 1024 * 1024)})
    r = post(base_url, body)
    assert r.status_code == 413
    still_alive(base_url)


def test_body_in_temp_file(base_url):
    # larger than client_body_buffer_size (16k): nginx keeps it in a temp file
    body = json.dumps({"messages": MSGS, "max_tokens": 3, "padding": "x" * 300000})
    r = post(base_url, body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] is not None


@pytest.mark.parametrize("raw", [
    b'{"messages":[{"role":"user","content":"\xff\xfe bad"}]}',
    b'{"messages":[{"role":"user","content":"ok \xc3"}]}',
    b'{"messages":[{"role":"user","content":"\\ud800 lone surrogate"}]}',
    b'{"messages":[{"role":"user","content":"nul \\u0000 inside"}], "max_tokens": 2}',
    b'{"prompt":"\xed\xa0\x80"}',
])
def test_invalid_utf8_handled(base_url, raw):
    path = "/v1/completions" if b'"prompt"' in raw else "/v1/chat/completions"
    r = requests.post(base_url + path, data=raw)
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        check_error(r, 400)
    else:
        json.loads(r.text)
    still_alive(base_url)


def test_empty_and_chunked_bodies(base_url):
    check_error(requests.post(base_url + "/v1/chat/completions"), 400)

    def gen():
        yield b'{"messages":'
        yield json.dumps(MSGS).encode()
        yield b', "max_tokens": 2}'
    r = requests.post(base_url + "/v1/chat/completions", data=gen())   # chunked transfer encoding
    assert r.status_code == 200, r.text


def raw_exchange(base_url, data, timeout=10):
    """Sends raw bytes on a fresh connection; returns (status line, headers, body)."""
    import socket
    host, port = base_url.split("//", 1)[1].split(":")
    s = socket.create_connection((host, int(port)), timeout=timeout)
    s.sendall(data)
    raw = b""
    try:
        while True:
            b = s.recv(65536)
            if not b:
                break
            raw += b
            if b"\r\n\r\n" in raw:
                head, _, rest = raw.partition(b"\r\n\r\n")
                cl = [l for l in head.split(b"\r\n") if l.lower().startswith(b"content-length:")]
                if cl and len(rest) >= int(cl[0].split(b":")[1]):
                    break
    finally:
        s.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode(errors="replace").split("\r\n")
    headers = dict(l.split(": ", 1) for l in lines[1:] if ": " in l)
    return lines[0], headers, body


@pytest.mark.parametrize("name,data,status", [
    ("body over client_max_body_size",
     b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
     b"Content-Length: 2000000\r\n\r\n{", 413),
    ("invalid chunk size",
     b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
    ("Content-Length and chunked",
     b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"
     b"0\r\n\r\n", 400),
    ("negative Content-Length",
     b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n", 400),
    ("duplicate Content-Length",
     b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n{}", 400),
    ("HTTP/2 preface on an HTTP/1 port", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 400),
])
def test_nginx_errors_are_openai_json(base_url, name, data, status):
    # errors nginx raises before m40's handler runs: the same status, OpenAI's JSON
    # instead of nginx's HTML page
    line, headers, body = raw_exchange(base_url, data)
    assert line.split(" ")[1] == str(status), (name, line, body[:200])
    assert headers.get("Content-Type", "").startswith("application/json"), (name, headers, body[:200])
    e = json.loads(body)["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["code"] == f"http_{status}", (name, e)
    assert e["type"] == "invalid_request_error" and e["message"], (name, e)
    still_alive(base_url)


def test_prompt_past_the_context_is_refused_before_tokenizing(base_url):
    # 900 KB (under client_max_body_size): more tokens than the context whatever the
    # text, by bytes / the longest vocabulary piece, so refused without tokenizing it
    import time
    big = "word " * 180000
    t0 = time.time()
    for path, body in (("/v1/completions", {"prompt": big, "max_tokens": 1}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": big}], "max_tokens": 1})):
        e = check_error(post(base_url, body, path=path), 400)
        assert "at least" in e["message"] and "context size" in e["message"], e
    assert time.time() - t0 < 10
    # a prompt only a little too long is tokenized and refused with its exact count
    e = check_error(post(base_url, {"prompt": "word " * 400, "max_tokens": 1}, path="/v1/completions"), 400)
    assert "prompt has" in e["message"] and "context size" in e["message"], e
    still_alive(base_url)
