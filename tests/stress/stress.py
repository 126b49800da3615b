#!/usr/bin/env python3
"""Load and faults against a real nginx with the m40 module on the CPU engine.

    tests/stress/run.sh [SCALE] [PHASE ...]        (make stress STRESS_SCALE=N)

Phases (each prints its numbers and passes or fails on its own):
  disconnects  clients cut at random points (mid-headers, mid-body, while a large body's
               JSON is parsed, before the first event, mid-stream, with RST);
               afterwards running sequences, the queue
               and KV usage are back to 0 and the worker's RSS is flat
  overload     bursts past m40_max_seqs + m40_max_queue: a burst the queue holds gets
               no 429; a larger one gets 429s with Retry-After and OpenAI's error JSON,
               and at least m40_max_queue of it is answered
  reloads      nginx -s reload (SIGHUP) again and again under 16 streaming clients:
               every request gets 200 and a complete stream, none a 503
  fuzz         mutated valid requests (wrong types, huge numbers, invalid UTF-8, deep
               nesting, missing fields, byte flips): every answer is OpenAI JSON (a
               success or an error shape, never an HTML page, never a 5xx) and the
               worker never dies
  stall        ITL p99 of running streams while 1 MB prompts arrive (one every 0.1 s,
               M40_STRESS_PACE), against the same streams quiet: at most 2x, enforced with
               M40_STRESS_STRICT=1 (the bodies' JSON is parsed on the worker's JSON
               thread, off the event loop; on a machine busy with other work the ratio
               is noise, so without STRICT a run over 2x counts as skipped)
  memory       worker RSS after 16 MB prompts (refused), after the biggest prompts the
               context accepts and after accepted 15 MB bodies stays within 8 MB of where
               it was, and a second round of the same adds at most 1 MB

SCALE (default 1: under a minute on two cores) multiplies the counts: 1,000
disconnects, 5 reloads, 3,000 bodies; SCALE 12 gives at least the issue's numbers
(12,000 disconnects, 60 reloads, 36,000 bodies). The random seed is printed; M40_STRESS_SEED repeats a run. Bodies that got a bad answer are kept in
M40_STRESS_KEEP (default build/stress/). Standard library only.
"""
import asyncio
import json
import os
import random
import re
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "integration"))
import harness  # noqa: E402  (starts nginx with conf/ examples; stdlib only)

SCALE = float(os.environ.get("M40_STRESS_SCALE", "1"))
SEED = int(os.environ.get("M40_STRESS_SEED", str(int(time.time() * 1000) % 1000000)))
KEEP = os.environ.get("M40_STRESS_KEEP", os.path.join(harness.ROOT, "build", "stress"))
MSGS = [{"role": "user", "content": "Once upon a time"}]


def scaled(n, least=1):
    return max(least, int(n * SCALE))


# ---------------------------------------------------------------- servers

def server_conf(port, extra, tag, model=harness.MODEL):
    """conf/minimal.conf with EXTRA directives in its http block."""
    with open(os.path.join(harness.ROOT, "conf", "minimal.conf")) as f:
        text = f.read()
    anchor = "    m40_model /var/lib/m40/models/model.gguf;"
    assert anchor in text, "conf/minimal.conf changed: update tests/stress"
    text = text.replace(anchor, anchor + "\n" + extra)
    workdir = harness.make_workdir(tag)
    return harness.render(text, workdir, {"127.0.0.1:8080": f"127.0.0.1:{port}"}, model=model)


class Server:
    def __init__(self, tag, extra="", model=harness.MODEL):
        self.port = harness.free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.nginx = harness.Nginx(server_conf(self.port, extra, tag, model), tag, self.base + "/health")

    def __enter__(self):
        self.nginx.start()
        return self

    def __exit__(self, *exc):
        self.nginx.stop()
        self.nginx.cleanup()

    def workers(self):
        out = subprocess.run(["ps", "--ppid", str(self.nginx.proc.pid), "-o", "pid=,args="],
                             capture_output=True, text=True).stdout
        return [int(l.split()[0]) for l in out.splitlines() if "worker process" in l and "shutting" not in l]

    def worker(self):
        w = self.workers()
        assert len(w) == 1, f"expected one worker, found {w}"
        return w[0]

    def metrics(self):
        out = {}
        with urllib.request.urlopen(self.base + "/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line and not line.startswith("#"):
                    k, v = line.rsplit(" ", 1)
                    out[k] = float(v)
        return out

    def wait_idle(self, timeout=30):
        """Metrics once nothing runs or waits (raises after TIMEOUT)."""
        deadline = time.time() + timeout
        while True:
            m = self.metrics()
            if m["m40_running_sequences"] == 0 and m["m40_queue_depth"] == 0:
                return m
            if time.time() > deadline:
                raise AssertionError(f"still busy after {timeout} s: running "
                                     f"{m['m40_running_sequences']}, queued {m['m40_queue_depth']}")
            time.sleep(0.05)

    def crashes(self):
        return self.nginx.crashes()


def rss_kb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


# ---------------------------------------------------------------- raw HTTP

def http_head(path, n, extra=""):
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {n}\r\nConnection: close\r\n{extra}\r\n").encode()


def dechunk(body):
    out, i = b"", 0
    while True:
        j = body.index(b"\r\n", i)
        n = int(body[i:j].split(b";")[0], 16)
        if n == 0:
            return out
        out += body[j + 2:j + 2 + n]
        if body[j + 2 + n:j + 4 + n] != b"\r\n":
            raise ValueError("bad chunk framing")
        i = j + 4 + n


def parse_response(raw):
    """(status, headers, body) of one whole HTTP/1.1 response; raises on a malformed one."""
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not sep:
        raise ValueError(f"no end of headers in {raw[:200]!r}")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {}
    for l in lines[1:]:
        k, _, v = l.partition(":")
        headers[k.strip().lower()] = v.strip()
    if headers.get("transfer-encoding") == "chunked":
        body = dechunk(body)
    elif "content-length" in headers and len(body) != int(headers["content-length"]):
        raise ValueError(f"body of {len(body)} bytes, Content-Length {headers['content-length']}")
    return status, headers, body


async def exchange(port, data, timeout=120):
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        w.write(data)
        await w.drain()
        return await asyncio.wait_for(r.read(), timeout)
    finally:
        w.close()


async def post(port, path, body, timeout=120, extra=""):
    if not isinstance(body, bytes):
        body = json.dumps(body).encode()
    return parse_response(await exchange(port, http_head(path, len(body), extra) + body, timeout))


def abort(writer):
    """Close with RST instead of FIN (the client vanished)."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.close()


# ---------------------------------------------------------------- answers

def check_error_json(body, status):
    e = json.loads(body)
    assert isinstance(e, dict) and set(e) == {"error"}, f"{status}: not an error object: {body[:300]!r}"
    e = e["error"]
    assert set(e) == {"message", "type", "param", "code"}, f"{status}: error keys {sorted(e)}"
    assert isinstance(e["message"], str) and e["message"], e
    assert isinstance(e["type"], str) and e["type"], e
    assert e["param"] is None or isinstance(e["param"], str), e
    assert e["code"] is None or isinstance(e["code"], str), e
    return e


def check_choice(c, chat):
    assert isinstance(c["index"], int)
    assert c["finish_reason"] in ("stop", "length", "tool_calls"), c
    if chat:
        m = c["message"]
        assert m["role"] == "assistant" and (m["content"] is None or isinstance(m["content"], str)), m
    else:
        assert isinstance(c["text"], str), c


def check_sse(body, chat):
    """The events of a complete stream (JSON objects), [DONE] last; every choice finished."""
    text = body.decode("utf-8")  # raises on invalid UTF-8
    assert text.endswith("data: [DONE]\n\n"), f"stream does not end with [DONE]: {text[-200:]!r}"
    events = text.split("\n\n")[:-1]
    objs, finished, seen = [], set(), set()
    for ev in events[:-1]:
        assert ev.startswith("data: ") and "\n" not in ev, repr(ev[:200])
        o = json.loads(ev[6:])
        assert o["object"] == ("chat.completion.chunk" if chat else "text_completion"), o
        if "error" in o:
            raise AssertionError(f"error event in a 200 stream: {o}")
        for c in o["choices"]:
            seen.add(c["index"])
            if c.get("finish_reason"):
                finished.add(c["index"])
        objs.append(o)
    assert seen and finished == seen, f"choices {sorted(seen)} finished {sorted(finished)}"
    return objs


def check_answer(status, headers, body, chat, stream):
    """Any answer to a request: a complete success or OpenAI's error JSON."""
    ctype = headers.get("content-type", "")
    if status == 200 and stream:
        assert ctype == "text/event-stream", ctype
        check_sse(body, chat)
        return
    assert ctype.startswith("application/json"), f"{status} with Content-Type {ctype!r}: {body[:200]!r}"
    if status != 200:
        assert 400 <= status < 500, f"status {status}: {body[:300]!r}"
        check_error_json(body, status)
        return
    o = json.loads(body)
    assert o["object"] == ("chat.completion" if chat else "text_completion"), o
    assert isinstance(o["id"], str) and o["choices"], o
    for c in o["choices"]:
        check_choice(c, chat)
    u = o["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"], u


# ---------------------------------------------------------------- phases

class Failed(Exception):
    pass


class Skipped(Exception):
    pass


def expect(cond, msg):
    if not cond:
        raise Failed(msg)


async def gather_limited(n, limit, fn):
    sem = asyncio.Semaphore(limit)

    async def one(i):
        async with sem:
            return await fn(i)
    return await asyncio.gather(*(one(i) for i in range(n)))


def stream_body(rng, chat=True):
    body = {"max_tokens": rng.randint(8, 64), "stream": True, "seed": rng.randrange(1 << 30),
            "n": rng.choice((1, 1, 1, 2))}
    if chat:
        body["messages"] = MSGS
    else:
        body["prompt"] = "Once upon a time"
    return body


async def one_disconnect(port, rng, counts):
    chat = rng.random() < 0.7
    body = stream_body(rng, chat)
    mode = rng.choice(("headers", "body", "before-first", "stream", "stream-rst", "parsing"))
    if mode == "parsing":
        # a body of 1.1 to 2.5 MB, whose JSON the worker parses on its JSON thread for
        # 10 to 25 ms: the client leaves during that or just after (past 1 MB, glibc maps
        # the blocks, so the RSS check sees a leak, not the heap's fragmentation)
        body["metadata"] = {"note": "x" * rng.randrange(1100000, 2500000)}
    body = json.dumps(body).encode()
    path = "/v1/chat/completions" if chat else "/v1/completions"
    head = http_head(path, len(body))
    counts[mode] = counts.get(mode, 0) + 1
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        if mode == "headers":
            w.write(head[:rng.randrange(1, len(head))])
        elif mode == "body":
            w.write(head + body[:rng.randrange(0, len(body))])
        else:
            w.write(head + body)
        await w.drain()
        if mode in ("headers", "body"):
            await asyncio.sleep(rng.random() * 0.02)
        elif mode == "before-first":
            await asyncio.sleep(rng.random() * 0.005)
        elif mode == "parsing":
            await asyncio.sleep(rng.random() * 0.02)
        else:
            want, got = rng.randrange(1, 4000), 0
            while got < want:
                b = await asyncio.wait_for(r.read(want - got), 60)
                if not b:
                    counts["finished first"] = counts.get("finished first", 0) + 1
                    break
                got += len(b)
    finally:
        if mode.endswith("rst") or rng.random() < 0.3:
            abort(w)
        else:
            w.close()


def phase_disconnects():
    n = scaled(1000, 20)
    with Server("stress-disc", "    m40_max_seqs 8;\n    m40_threads 1;\n    client_max_body_size 4m;\n") as s:
        rng = random.Random(SEED)
        counts = {}
        warm = max(10, n // 5)

        async def run(k):
            await gather_limited(k, 24, lambda i: one_disconnect(s.port, rng, counts))
        asyncio.run(run(warm))
        s.wait_idle()
        counts.clear()
        pid = s.worker()
        rss0 = rss_kb(pid)
        before = s.metrics()
        parsed0 = s.nginx.log().count("was being parsed")
        t0 = time.time()
        asyncio.run(run(n))
        took = time.time() - t0
        m = s.wait_idle()
        rss1 = rss_kb(pid)
        # a second round of the same: the allocator's arenas and the engine's buffers reach
        # their high-water marks within the first (+3 to +6 MB seen there, now and then,
        # since the CPU engine got faster), a leak grows in every round
        asyncio.run(run(n))
        s.wait_idle()
        rss2 = rss_kb(pid)
        print(f"  {n} disconnects in {took:.1f} s ({', '.join(f'{k} {v}' for k, v in sorted(counts.items()))})")
        print(f"  requests {m['m40_requests_total'] - before['m40_requests_total']:.0f}, cancelled "
              f"{m['m40_requests_cancelled_total'] - before['m40_requests_cancelled_total']:.0f}; "
              f"after: running {m['m40_running_sequences']:.0f}, queued {m['m40_queue_depth']:.0f}, "
              f"KV usage {m['m40_kv_usage_ratio']:.4f}")
        print(f"  worker RSS {rss0} kB after the warm-up, {rss1} kB after ({rss1 - rss0:+d} kB), {rss2} kB after "
              f"a second round ({rss2 - rss1:+d} kB); "
              f"{s.nginx.log().count('was being parsed') - parsed0} requests ended while their body "
              f"was parsed")
        expect(m["m40_kv_usage_ratio"] == 0, f"KV usage {m['m40_kv_usage_ratio']} after every client left")
        expect(m["m40_requests_cancelled_total"] > before["m40_requests_cancelled_total"],
               "no request was cancelled: the disconnects hit nothing")
        # flat: the warm-up and the first round grew the pools and caches; what the second
        # round adds is noise, not a leak per request (a 1 KB leak per request would be
        # 1 MB a round at SCALE 1, in both rounds)
        expect(min(rss1 - rss0, rss2 - rss1) <= max(2048, rss0 // 50),
               f"worker RSS grew by {rss1 - rss0} kB, then by {rss2 - rss1} kB")
        expect(s.worker() == pid, "the worker changed")
        r = asyncio.run(post(s.port, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 4}))
        expect(r[0] == 200, f"after the disconnects: {r[0]} {r[2][:200]!r}")
        crashes = s.crashes()
        expect(not crashes, "nginx logged:\n" + "\n".join(crashes[:10]))


def phase_overload():
    seqs, queue = 2, 4
    rounds = scaled(3, 2)
    with Server("stress-over", f"    m40_max_seqs {seqs};\n    m40_max_queue {queue};\n    m40_threads 1;\n") as s:
        body = {"messages": MSGS, "max_tokens": 200, "ignore_eos": True}
        total429 = total200 = 0
        for rnd in range(rounds):
            # a burst the queue holds (nothing else waits): every request is answered
            s.wait_idle()
            res = asyncio.run(gather_limited(queue, queue, lambda i: post(s.port, "/v1/chat/completions", body)))
            st = [r[0] for r in res]
            expect(st.count(200) == queue, f"burst of {queue} (m40_max_queue {queue}): {st}")
            # a burst past it, all on the wire at once
            s.wait_idle()
            k = 6 * (seqs + queue)
            res = asyncio.run(gather_limited(k, k, lambda i: post(s.port, "/v1/chat/completions", body)))
            st = [r[0] for r in res]
            expect(set(st) <= {200, 429}, f"statuses {st}")
            # a 429 means m40_max_queue requests were waiting then, and they are answered
            expect(st.count(429) == 0 or st.count(200) >= queue, f"429 before the queue was full: {st}")
            for status, headers, b in res:
                if status == 429:
                    expect(headers.get("retry-after", "").isdigit() and int(headers["retry-after"]) >= 1,
                           f"429 without Retry-After: {headers}")
                    e = check_error_json(b, 429)
                    expect(e["type"] == "rate_limit_error" and e["code"] == "queue_full", e)
                else:
                    check_answer(status, headers, b, True, False)
            total429 += st.count(429)
            total200 += st.count(200)
        print(f"  {rounds} rounds (max_seqs {seqs}, max_queue {queue}): bursts of {queue} all 200; "
              f"bursts of {6 * (seqs + queue)}: {total200} answered, {total429} got 429 with Retry-After")
        expect(total429 > 0, "no burst ever filled the queue")
        m = s.wait_idle()
        expect(m["m40_requests_rejected_total"] == total429,
               f"m40_requests_rejected_total {m['m40_requests_rejected_total']} != {total429}")
        expect(m["m40_kv_usage_ratio"] == 0, f"KV usage {m['m40_kv_usage_ratio']}")
        crashes = s.crashes()
        expect(not crashes, "nginx logged:\n" + "\n".join(crashes[:10]))


def phase_reloads():
    reloads = scaled(5, 2)
    clients = 16
    with Server("stress-reload", "    m40_max_seqs 16;\n    m40_threads 1;\n") as s:
        stop = False
        results = {"ok": 0}
        bad = []

        async def client(i):
            rng = random.Random(SEED + i)
            while not stop:
                chat = rng.random() < 0.7
                body = stream_body(rng, chat)
                path = "/v1/chat/completions" if chat else "/v1/completions"
                try:
                    status, headers, b = await post(s.port, path, body, timeout=120)
                    if status != 200:
                        bad.append(f"{status} {b[:200]!r}")
                        continue
                    check_sse(b, chat)
                    results["ok"] += 1
                except Exception as e:  # a reset, a short stream, bad framing
                    bad.append(f"{type(e).__name__}: {e}")

        async def reloader():
            nonlocal stop
            master = s.nginx.proc.pid
            await asyncio.sleep(0.5)
            for _ in range(reloads):
                old = set(s.workers())
                os.kill(master, signal.SIGHUP)
                deadline = time.time() + 60
                # the new worker is up and the old one has finished its streams and gone
                while True:
                    await asyncio.sleep(0.05)
                    now = subprocess.run(["ps", "--ppid", str(master), "-o", "pid="],
                                         capture_output=True, text=True).stdout.split()
                    now = {int(p) for p in now}
                    if now and not (now & old):
                        break
                    if time.time() > deadline:
                        raise Failed(f"reload did not complete: workers {now}, old {old}")
                await asyncio.sleep(0.2)
            stop = True

        async def main():
            await asyncio.gather(reloader(), *(client(i) for i in range(clients)))
        t0 = time.time()
        asyncio.run(main())
        took = time.time() - t0
        print(f"  {reloads} reloads in {took:.1f} s under {clients} streaming clients: "
              f"{results['ok']} complete streams, {len(bad)} bad")
        expect(not bad, "bad answers during reloads:\n" + "\n".join(bad[:10]))
        expect(results["ok"] >= reloads * clients, "too few requests ran to test anything")
        crashes = s.crashes()
        expect(not crashes, "nginx logged:\n" + "\n".join(crashes[:10]))


# --- fuzzed bodies

WEIRD = [None, True, False, 0, -1, 1, 2, 7, 9, 2 ** 31, 2 ** 31 - 1, -2 ** 31, 2 ** 53 + 1, 2 ** 63 - 1,
         -2 ** 63, 0.5, -0.0, 1e308, -1e308, 1e-320, "", "x", "10", "\u0000", "\ud7ff\ue000", "é" * 3,
         "<|im_end|>", [], [1], ["a"], {}, {"a": 1}, [[[]]], {"type": "text"}]
RAW_NUMBERS = [b"1e400", b"-1e400", b"18446744073709551616", b"-9223372036854775809", b"1" * 400,
               b"0.000000000000000000000000000000000000000000001", b"-0", b"1E+2", b"NaN", b"Infinity"]
INVALID_UTF8 = [b"\xff", b"\xc3", b"\xc3\x28", b"\xe2\x82", b"\xed\xa0\x80", b"\xf4\x90\x80\x80",
                b"\xc0\xaf", b"\xf8\x88\x80\x80\x80", b"\\ud800", b"\\udfff\\ud800", b"\x00"]
FIELDS_CHAT = ["model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
               "top_k", "min_p", "n", "stop", "seed", "presence_penalty", "frequency_penalty",
               "logit_bias", "logprobs", "top_logprobs", "stream", "stream_options", "user", "ignore_eos",
               "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs", "response_format",
               "grammar"]
FIELDS_COMPL = ["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed",
                "logit_bias", "logprobs", "echo", "stream", "stream_options", "ignore_eos", "suffix",
                "response_format", "grammar"]
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "weather",
                                         "parameters": {"type": "object",
                                                        "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}


def valid_request(rng, model):
    chat = rng.random() < 0.65
    b = {"model": model, "max_tokens": rng.randint(1, 12), "temperature": rng.choice((0, 0.7, 1.0))}
    if chat:
        msgs = [{"role": "system", "content": "You are terse."}] if rng.random() < 0.3 else []
        msgs.append({"role": "user", "content": rng.choice(("Hi", "Once upon a time",
                                                            [{"type": "text", "text": "Hello"}]))})
        if rng.random() < 0.3:
            msgs += [{"role": "assistant", "content": None,
                      "tool_calls": [{"id": "c1", "type": "function",
                                      "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
        b["messages"] = msgs
        if rng.random() < 0.3:
            b["tools"] = [TOOL]
            b["tool_choice"] = rng.choice(("auto", "none", "required"))
        if rng.random() < 0.2:
            b["logprobs"], b["top_logprobs"] = True, rng.randint(0, 5)
        if rng.random() < 0.15:
            b["response_format"] = rng.choice(({"type": "json_object"},
                                               {"type": "json_schema", "json_schema": {
                                                   "name": "x", "schema": {"type": "object", "properties": {
                                                       "a": {"type": "integer"}}, "required": ["a"]}}}))
    else:
        b["prompt"] = rng.choice(("Once upon a time", ["Hi"], "é€😀"))
        if rng.random() < 0.2:
            b["logprobs"] = rng.randint(0, 3)
    for k, v in (("stream", True), ("n", rng.randint(1, 3)), ("stop", ["\n", "the"]), ("seed", 42),
                 ("top_p", 0.9), ("top_k", 20), ("logit_bias", {"5": 10, "7": -100}),
                 ("presence_penalty", 0.5), ("stream_options", {"include_usage": True}), ("ignore_eos", True)):
        if rng.random() < 0.2:
            b[k] = v
    if "stream_options" in b:
        b["stream"] = True
    return chat, b


DEEP = "\u0001deep\u0001"


def nest(rng, depth):
    """A placeholder that mutate() replaces by DEPTH nested arrays and objects (too deep
    for Python's own encoder)."""
    return DEEP + str(depth)


def deep_json(rng, depth):
    opens, closes = [], []
    for _ in range(depth):
        if rng.random() < 0.5:
            opens.append(b"[")
            closes.append(b"]")
        else:
            opens.append(b'{"a":')
            closes.append(b"}")
    return b"".join(opens) + b"1" + b"".join(reversed(closes))


def mutate(rng, chat, b):
    """A request (dict or raw bytes) derived from a valid one."""
    fields = FIELDS_CHAT if chat else FIELDS_COMPL
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        kind = rng.randrange(9)
        if kind == 0:  # a field of the wrong type or out of range
            b[rng.choice(fields)] = rng.choice(WEIRD)
        elif kind == 1 and b:  # a field missing
            b.pop(rng.choice(list(b)))
        elif kind == 2:  # deep nesting
            b[rng.choice(fields)] = nest(rng, rng.choice((10, 100, 1000, 3000, 100000)))
        elif kind == 3 and chat and isinstance(b.get("messages"), list) and b["messages"]:
            m = rng.choice(b["messages"])
            if isinstance(m, dict):
                m[rng.choice(("role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content"))] = \
                    rng.choice(WEIRD + [[{"type": "text", "text": rng.choice(WEIRD)}],
                                        [{"id": 1, "function": {"name": None, "arguments": 5}}]])
        elif kind == 4 and chat:  # tools and formats of every shape
            b[rng.choice(("tools", "tool_choice", "response_format"))] = rng.choice((
                [TOOL, TOOL], [{"type": "function"}], [{"type": "function", "function": {"name": 5}}],
                {"type": "function", "function": {"name": "nope"}}, {"type": "json_schema"},
                {"type": "json_schema", "json_schema": {"schema": {"type": "array", "minItems": 10 ** 9}}},
                {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/x"}}},
                {"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "(a|b" * 50}}},
                {"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "[" * 5}}}))
        elif kind == 5:  # a big string
            b[rng.choice(("user", "prompt", "stop", "grammar"))] = "é" * rng.choice((1000, 100000))
        elif kind == 6:  # unknown fields
            b["x" * rng.randint(1, 300)] = rng.choice(WEIRD)
        elif kind == 7:
            b["logit_bias"] = rng.choice(({str(i): 1 for i in range(1100)}, {"-1": 1}, {"1e3": 1},
                                          {"99999999999999999999": 1}, {"": 1}, {"5": 1e308}))
        else:
            b["stop"] = rng.choice((["a"] * 5, [""], ["\u0000"], "s" * 2000, [None]))
    raw = json.dumps(b, ensure_ascii=rng.random() < 0.5).encode()
    raw = re.sub(rb'"\\u0001deep\\u0001(\d+)"', lambda m: deep_json(rng, int(m.group(1))), raw)
    r = rng.random()
    if r < 0.12:  # raw number JSON cannot write
        token = rng.choice(RAW_NUMBERS)
        raw = re.sub(rb'(?<=: )-?\d+(\.\d+)?', lambda _m: token, raw, count=1)
    elif r < 0.24:  # invalid UTF-8 inside a string
        bad = rng.choice(INVALID_UTF8)
        quotes = [m.start() for m in re.finditer(rb'"', raw)]
        if quotes:
            i = rng.choice(quotes) + 1
            raw = raw[:i] + bad + raw[i:]
    elif r < 0.34:  # byte flips, truncation, duplication
        raw = bytearray(raw)
        for _ in range(rng.randint(1, 4)):
            op = rng.randrange(3)
            if op == 0 and raw:
                raw[rng.randrange(len(raw))] = rng.randrange(256)
            elif op == 1:
                raw = raw[:rng.randrange(len(raw) + 1)]
            else:
                i = rng.randrange(len(raw) + 1)
                raw[i:i] = raw[i:i + rng.randint(1, 50)]
        raw = bytes(raw)
    return raw


def phase_fuzz():
    n = scaled(3000, 50)
    os.makedirs(KEEP, exist_ok=True)
    with Server("stress-fuzz", "    m40_max_seqs 8;\n    m40_threads 1;\n    client_max_body_size 4m;\n") as s:
        pid = s.worker()
        model = os.path.basename(harness.MODEL)[:-len(".gguf")]
        rng = random.Random(SEED)
        cases = []
        for _ in range(n):
            chat, b = valid_request(rng, model)
            cases.append((chat, b.get("stream") is True, mutate(rng, chat, b)))
        stats = {}
        bad = []

        async def one(i):
            chat, stream, raw = cases[i]
            path = "/v1/chat/completions" if chat else "/v1/completions"
            try:
                status, headers, body = parse_response(await exchange(s.port, http_head(path, len(raw)) + raw))
                stats[status] = stats.get(status, 0) + 1
                # a mutated body may have lost or changed "stream": the answer says which
                streamed = headers.get("content-type") == "text/event-stream"
                check_answer(status, headers, body, chat, streamed)
            except Exception as e:
                bad.append((i, f"{type(e).__name__}: {e}"))
                with open(os.path.join(KEEP, f"fuzz-{SEED}-{i}.json"), "wb") as f:
                    f.write(raw)
        t0 = time.time()
        asyncio.run(gather_limited(n, 8, one))
        took = time.time() - t0
        print(f"  {n} fuzzed bodies in {took:.1f} s (seed {SEED}): " +
              ", ".join(f"{k}: {v}" for k, v in sorted(stats.items())))
        for i, why in bad[:10]:
            print(f"  bad answer to {KEEP}/fuzz-{SEED}-{i}.json: {why[:300]}")
        expect(not bad, f"{len(bad)} bad answers")
        expect(stats.get(200, 0) > 0 and stats.get(400, 0) > 0, f"statuses {stats}: not a useful mix")
        expect(s.workers() == [pid], f"the worker changed: {pid} -> {s.workers()}")
        m = s.wait_idle()
        expect(m["m40_kv_usage_ratio"] == 0, f"KV usage {m['m40_kv_usage_ratio']}")
        crashes = s.crashes()
        expect(not crashes, "nginx logged:\n" + "\n".join(crashes[:10]))


# --- the long-prompt stall

async def timed_streams(port, body, gaps, until):
    """Streams one request after another until the event UNTIL is set, appending
    (time, gap) for each event after a stream's first to GAPS."""
    data = json.dumps(body).encode()
    while not until.is_set():
        r, w = await asyncio.open_connection("127.0.0.1", port)
        try:
            w.write(http_head("/v1/chat/completions", len(data)) + data)
            await w.drain()
            last, tail = None, b""
            while not until.is_set():
                b = await asyncio.wait_for(r.read(65536), 60)
                if not b:
                    break
                now = time.perf_counter()
                k = (tail + b).count(b"data: ") - tail.count(b"data: ")
                tail = b[-5:]
                for _ in range(k):
                    if last is not None:
                        gaps.append((now, now - last))
                    last = now
        finally:
            w.close()


def p99(xs):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * 0.99))] if xs else float("nan")


PACE = float(os.environ.get("M40_STRESS_PACE", "0.1"))
STRICT = os.environ.get("M40_STRESS_STRICT") == "1"


def phase_stall():
    streams = 8
    rounds = scaled(3, 2)
    big = json.dumps({"messages": [{"role": "user", "content": "word " * 200000}], "max_tokens": 1}).encode()
    big_c = json.dumps({"prompt": "once upon a time " * 61000, "max_tokens": 1}).encode()
    with Server("stress-stall", f"    m40_max_seqs {streams};\n    m40_threads 1;\n    client_max_body_size 4m;\n") as s:
        async def window(seconds, loud):
            gaps = []
            body = {"messages": MSGS, "max_tokens": 400, "ignore_eos": True, "stream": True}
            until = asyncio.Event()
            tasks = [asyncio.create_task(timed_streams(s.port, body, gaps, until)) for _ in range(streams)]
            await asyncio.sleep(0.3)  # every stream past its prefill
            t0 = time.perf_counter()
            refused = 0
            if loud:
                # one 1 MB prompt at a time, every PACE seconds, the two endpoints in turn
                while time.perf_counter() - t0 < seconds:
                    path, data = (("/v1/chat/completions", big), ("/v1/completions", big_c))[refused % 2]
                    st, _, b = await post(s.port, path, data)
                    expect(st == 400 and "context size" in b.decode(), f"1 MB prompt: {st} {b[:200]!r}")
                    refused += 1
                    await asyncio.sleep(PACE)
            else:
                await asyncio.sleep(seconds)
            t1 = time.perf_counter()
            until.set()
            await asyncio.gather(*tasks)
            return [g for (t, g) in gaps if t0 <= t <= t1], refused

        quiet, loud = [], []
        n_big = 0
        for _ in range(rounds):
            q, _ = asyncio.run(window(1.0, False))
            s.wait_idle()
            l, k = asyncio.run(window(1.0, True))
            s.wait_idle()
            quiet += q
            loud += l
            n_big += k
        pq, pl = p99(quiet), p99(loud)
        print(f"  ITL p99 of {streams} streams: quiet {pq * 1000:.2f} ms ({len(quiet)} gaps), "
              f"while {n_big} prompts of 1 MB arrived {pl * 1000:.2f} ms ({len(loud)} gaps): {pl / pq:.2f}x; "
              f"longest gap {max(quiet) * 1000:.1f} ms quiet, {max(loud) * 1000:.1f} ms loud")
        expect(len(quiet) > 100 and len(loud) > 100, "too few tokens to measure")
        crashes = s.crashes()
        expect(not crashes, "nginx logged:\n" + "\n".join(crashes[:10]))
        if pl > 2 * pq:
            # The bodies' JSON (jansson: 5 to 10 ms for 1 MB here) is parsed on the JSON
            # thread, not on the event loop the streams' events go through; what is left
            # on the loop is reading the body. Over 2x on a shared two-core machine is
            # usually other work taking the cores: enforced only when asked for.
            msg = (f"ITL p99 {pl * 1000:.2f} ms while 1 MB prompts arrive, more than twice the quiet "
                   f"{pq * 1000:.2f} ms")
            if STRICT:
                raise Failed(msg)
            raise Skipped(msg + " (measured, not enforced: M40_STRESS_STRICT=1 enforces it)")


def phase_memory():
    with Server("stress-mem", "    m40_max_seqs 2;\n    m40_ctx_size 512;\n    m40_threads 1;\n    client_max_body_size 32m;\n") as s:
        pid = s.worker()
        small = {"messages": MSGS, "max_tokens": 8}
        asyncio.run(post(s.port, "/v1/chat/completions", small))
        rss0 = rss_kb(pid)
        huge = json.dumps({"prompt": "word " * (16 * 1024 * 1024 // 5), "max_tokens": 1}).encode()
        huge_chat = json.dumps({"messages": [{"role": "user", "content": "word " * (16 * 1024 * 1024 // 5)}],
                                "max_tokens": 1}).encode()
        for path, data in (("/v1/completions", huge), ("/v1/chat/completions", huge_chat)) * 2:
            st, _, b = asyncio.run(post(s.port, path, data))
            expect(st == 400, f"16 MB prompt: {st} {b[:200]!r}")
        s.wait_idle()
        rss1 = rss_kb(pid)
        # the biggest prompts the context takes: tokenized, prefilled and answered
        words = 400
        while words > 10:
            st, _, b = asyncio.run(post(s.port, "/v1/completions", {"prompt": "the cat " * words, "max_tokens": 1}))
            if st == 200:
                break
            words = words * 9 // 10
        def big_round():
            for _ in range(20):
                st, _, b = asyncio.run(post(s.port, "/v1/completions", {"prompt": "the cat " * words,
                                                                         "max_tokens": 1}))
                expect(st == 200, f"a prompt of {words * 2} words: {st} {b[:200]!r}")
            # bodies of 15 MB that are accepted: the prompt is small, an unknown field is not
            for path, body in (("/v1/completions", {"prompt": "Once", "max_tokens": 2}),
                               ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 2})) * 2:
                body = dict(body, metadata={"note": "x" * (15 * 1024 * 1024)})
                st, _, b = asyncio.run(post(s.port, path, body))
                expect(st == 200, f"a 15 MB body: {st} {b[:200]!r}")
            s.wait_idle()
        big_round()
        rss2 = rss_kb(pid)
        big_round()
        rss3 = rss_kb(pid)
        print(f"  worker RSS {rss0} kB; after 4 prompts of 16 MB (refused) {rss1} kB ({rss1 - rss0:+d}); "
              f"after 20 prompts filling the context ({words * 2} words) and 4 accepted bodies of 15 MB "
              f"{rss2} kB ({rss2 - rss0:+d}); after the same again {rss3} kB ({rss3 - rss2:+d})")
        # 16 MB bodies pass through nginx's buffers, jansson and the prompt's copies: that
        # memory goes back (glibc kept 33 MB of it before m40 fixed its mmap threshold)
        expect(rss1 - rss0 <= 8 * 1024, f"RSS stays {rss1 - rss0} kB higher after 16 MB prompts")
        expect(rss2 - rss0 <= 8 * 1024, f"RSS stays {rss2 - rss0} kB higher after big requests")
        # the second round finds everything the first one grew: nothing more stays
        expect(rss3 - rss2 <= 1024, f"RSS grew by {rss3 - rss2} kB more in the second round of big requests")
        crashes = s.crashes()
        expect(not crashes, "nginx logged:\n" + "\n".join(crashes[:10]))


PHASES = {"disconnects": phase_disconnects, "overload": phase_overload, "reloads": phase_reloads,
          "fuzz": phase_fuzz, "stall": phase_stall, "memory": phase_memory}


def main(argv):
    names = argv or list(PHASES)
    for n in names:
        if n not in PHASES:
            print(f"unknown phase {n} (phases: {' '.join(PHASES)})")
            return 2
    print(f"stress: SCALE {SCALE}, seed {SEED}, model {harness.MODEL}")
    passed = failed = skipped = 0
    for n in names:
        t0 = time.time()
        print(f"== {n}")
        sys.stdout.flush()
        try:
            PHASES[n]()
            passed += 1
            print(f"  ok ({time.time() - t0:.1f} s)")
        except Skipped as e:
            skipped += 1
            print(f"  SKIPPED ({time.time() - t0:.1f} s): {e}")
        except (Failed, AssertionError) as e:
            failed += 1
            print(f"  FAILED ({time.time() - t0:.1f} s): {e}")
        except Exception as e:  # noqa: BLE001  (any other error fails the phase too)
            failed += 1
            print(f"  FAILED ({time.time() - t0:.1f} s): {type(e).__name__}: {e}")
        finally:
            harness.remove_workdirs()
        sys.stdout.flush()
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
