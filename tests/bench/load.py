#!/usr/bin/env python3
"""HTTP load generator for the m40 server (nginx + ngx_http_m40_module).

Runs --requests streaming chat completions, --concurrency of them at a time, each a
POST /v1/chat/completions with "stream": true over a raw HTTP/1.1 connection (asyncio
sockets, standard library only), and measures per request:

  TTFT  time from sending the request to the first SSE chunk that carries content
  ITL   every gap between two consecutive content chunks (one chunk may hold more than
        one token when the server holds bytes back, e.g. an incomplete UTF-8 sequence)

and over the run: generated tokens/s (sum of usage.completion_tokens from the final
chunk, asked for with stream_options.include_usage; the number of content chunks where
a response has no usage), TTFT and ITL p50/p99, errors.

Prompts are distinct random English-ish words per request, so nothing is shared
between requests unless --shared-prefix-words K puts the same K-word system message
in front of every one (the prefix-caching case; --metrics then reports how many
prompt tokens the server really computed, from /metrics).

OpenAI's API has no way to forbid end-of-sequence: outputs may end before
--max-tokens. The finish_reason counts in the report show it; --extra-json can pass a
server-specific field (e.g. '{"ignore_eos": true}') where a server has one.

Every run counts the requests refused with HTTP 429 (queue full: "rejected") apart
from those that failed otherwise ("failed").

--long-prompt-tokens N switches to the long-prompt-while-streaming case: --concurrency
streams run (each to --max-tokens, end of sequence ignored where the server allows it,
see --extra-json); once all of them stream, a quiet phase of --quiet-seconds, then one
request with a prompt of about N tokens (words calibrated first with one short
request's usage.prompt_tokens) and max_tokens 1 arrives. Reported: the ITL p50/p99 of
the streams in the quiet phase and while the long prompt is processed (from its
arrival until its response ends: tokenization, prefill and one token), the long
request's time and prompt tokens, and streams that ended before it did.

--compare-alone N checks that batching does not change what a request gets: after the
timed run (and outside its numbers) the first N requests run again one at a time, and
each greedy output (temperature 0) must equal the text and finish reason that the same
request got among the concurrent ones. The report says how many matched and where the
first ones differ (with --metrics also how many of their prompt tokens the server
computed: the rest came from its prefix cache); any difference makes the exit status 1.

The run is bounded (a fixed number of requests, a timeout per request) and only
talks to loopback addresses: it refuses any other target.
"""

import argparse
import asyncio
import ipaddress
import json
import random
import re
import socket
import sys
import time
import urllib.parse

SYLLABLES_ON = ["b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w",
                "br", "ch", "cl", "dr", "fl", "gr", "pl", "pr", "sh", "st", "str", "th", "tr", ""]
SYLLABLES_NU = ["a", "e", "i", "o", "u", "ea", "ee", "oo", "ou", "ai", "ie"]
SYLLABLES_CO = ["", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck", "rt", "th"]


def random_words(rng, n):
    """n pronounceable pseudo-words: tokenizers split them much like English text."""
    words = []
    for _ in range(n):
        w = "".join(rng.choice(SYLLABLES_ON) + rng.choice(SYLLABLES_NU) + rng.choice(SYLLABLES_CO)
                    for _ in range(rng.choice((1, 1, 2, 2, 3))))
        words.append(w)
    return " ".join(words)


def percentile(values, q):
    """Linear interpolation between closest ranks; None for no values."""
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def check_loopback(host):
    """Raises ValueError unless every address host resolves to is a loopback address."""
    try:
        addrs = {info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except socket.gaierror as e:
        raise ValueError(f"cannot resolve {host!r}: {e}")
    for a in addrs:
        if not ipaddress.ip_address(a.split("%")[0]).is_loopback:
            raise ValueError(f"{host!r} resolves to {a}, which is not a loopback address; "
                             "load.py only targets 127.0.0.0/8 or ::1")
    return sorted(addrs)[0]


class HTTPError(Exception):
    pass


async def read_headers(reader):
    status_line = await reader.readline()
    if not status_line:
        raise HTTPError("connection closed before the status line")
    parts = status_line.decode("latin-1").rstrip("\r\n").split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
        raise HTTPError(f"bad status line {status_line[:80]!r}")
    status = int(parts[1])
    headers = {}
    while True:
        line = await reader.readline()
        if not line:
            raise HTTPError("connection closed inside the headers")
        if line in (b"\r\n", b"\n"):
            break
        k, _, v = line.decode("latin-1").partition(":")
        headers[k.strip().lower()] = v.strip()
    return status, headers


async def body_pieces(reader, headers):
    """Yields the response body as it arrives: chunked, Content-Length or until close."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size_line = await reader.readline()
            if not size_line:
                raise HTTPError("connection closed inside a chunked body")
            size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return
            data = await reader.readexactly(size)
            await reader.readexactly(2)
            yield data
    elif "content-length" in headers:
        left = int(headers["content-length"])
        while left > 0:
            data = await reader.read(min(left, 65536))
            if not data:
                raise HTTPError("connection closed before Content-Length bytes")
            left -= len(data)
            yield data
    else:
        while True:
            data = await reader.read(65536)
            if not data:
                return
            yield data


class Result:
    __slots__ = ("ok", "error", "status", "ttft", "itl", "times", "chunks", "completion_tokens", "prompt_tokens",
                 "cached_tokens", "finish", "start", "end", "usage_seen", "text")

    def __init__(self):
        self.ok = False
        self.error = None
        self.status = None  # the HTTP status when it was not 200
        self.times = []     # arrival of every content chunk (perf_counter seconds)
        self.ttft = None
        self.itl = []
        self.chunks = 0
        self.completion_tokens = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.finish = None
        self.start = self.end = 0.0
        self.usage_seen = False
        self.text = []      # the content chunks, for --compare-alone


async def one_request(args, addr, port, path, body, res):
    data = json.dumps(body).encode()
    req = (f"POST {path} HTTP/1.1\r\nHost: {args.host_header}\r\n"
           f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
           f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode() + data
    reader, writer = await asyncio.open_connection(addr, port, limit=1 << 22)
    try:
        res.start = time.perf_counter()
        writer.write(req)
        await writer.drain()
        status, headers = await read_headers(reader)
        if status != 200:
            res.status = status
            text = b"".join([p async for p in body_pieces(reader, headers)])[:300]
            raise HTTPError(f"HTTP {status}: {text.decode('utf-8', 'replace').strip()}")
        buf = b""
        last = None
        done = False
        async for piece in body_pieces(reader, headers):
            buf += piece
            # SSE events end with a blank line; \r\n line ends are allowed too.
            buf = buf.replace(b"\r\n", b"\n")
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                now = time.perf_counter()
                payload = "\n".join(line[5:].lstrip() for line in event.decode("utf-8").split("\n")
                                    if line.startswith("data:"))
                if not payload:
                    continue
                if payload == "[DONE]":
                    done = True
                    continue
                obj = json.loads(payload)
                if "error" in obj:
                    raise HTTPError(f"error event: {json.dumps(obj['error'])[:300]}")
                for ch in obj.get("choices") or []:
                    content = (ch.get("delta") or {}).get("content")
                    if content:
                        res.text.append(content)
                        res.chunks += 1
                        res.times.append(now)
                        if last is None:
                            res.ttft = now - res.start
                        else:
                            res.itl.append(now - last)
                        last = now
                    if ch.get("finish_reason"):
                        res.finish = ch["finish_reason"]
                usage = obj.get("usage")
                if usage:
                    res.usage_seen = True
                    res.completion_tokens = int(usage.get("completion_tokens") or 0)
                    res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    res.cached_tokens = int(details.get("cached_tokens") or 0)
        res.end = time.perf_counter()
        if not done:
            raise HTTPError("stream ended without data: [DONE]")
        if not res.usage_seen:
            res.completion_tokens = res.chunks
        res.ok = True
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except (ConnectionError, OSError):
            pass


async def http_get(addr, port, host_header, path, timeout):
    reader, writer = await asyncio.wait_for(asyncio.open_connection(addr, port), timeout)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {host_header}\r\nConnection: close\r\n\r\n".encode())
        await writer.drain()
        status, headers = await asyncio.wait_for(read_headers(reader), timeout)
        body = b"".join([p async for p in body_pieces(reader, headers)])
        return status, body.decode("utf-8", "replace")
    finally:
        writer.close()


def parse_metrics(text):
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            pass
    return out


async def fetch_metrics(args, addr, port):
    try:
        status, text = await http_get(addr, port, args.host_header, "/metrics", 10)
    except (OSError, asyncio.TimeoutError, HTTPError) as e:
        return None, f"GET /metrics failed: {e}"
    if status != 200:
        return None, f"GET /metrics: HTTP {status}"
    return parse_metrics(text), None


def chat_body(args, messages, max_tokens, stream=True):
    body = {"model": args.model, "messages": messages, "stream": stream,
            "max_tokens": max_tokens, "temperature": args.temperature}
    if stream:
        body["stream_options"] = {"include_usage": True}
    body.update(args.extra)
    return body


def build_bodies(args):
    shared = random_words(random.Random(args.seed ^ 0x5EED), args.shared_prefix_words) \
        if args.shared_prefix_words > 0 else None
    bodies = []
    for i in range(args.requests):
        rng = random.Random(args.seed * 1000003 + i)
        messages = []
        if shared:
            messages.append({"role": "system", "content": shared})
        messages.append({"role": "user", "content": random_words(rng, args.prompt_words)})
        bodies.append(chat_body(args, messages, args.max_tokens))
    return bodies


async def run_one(args, addr, port, path, body, res):
    """one_request with the error handling of a worker: never raises (but for
    cancellation)."""
    try:
        await asyncio.wait_for(one_request(args, addr, port, path, body, res), args.timeout)
    except asyncio.TimeoutError:
        res.error = f"timeout after {args.timeout:g} s"
    except (OSError, HTTPError, ValueError, asyncio.IncompleteReadError) as e:
        res.error = f"{type(e).__name__}: {e}"
    except Exception as e:  # a malformed response must not stop the other streams
        res.error = f"unexpected {type(e).__name__}: {e}"
    if res.error and not res.end:
        res.end = time.perf_counter()


async def post_json(addr, port, host_header, path, body, timeout):
    """A plain (non-streaming) POST; returns (status, parsed JSON or None, text)."""
    data = json.dumps(body).encode()
    reader, writer = await asyncio.wait_for(asyncio.open_connection(addr, port, limit=1 << 22), timeout)
    try:
        writer.write((f"POST {path} HTTP/1.1\r\nHost: {host_header}\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode() + data)
        await writer.drain()
        status, headers = await asyncio.wait_for(read_headers(reader), timeout)
        text = b"".join([p async for p in body_pieces(reader, headers)]).decode("utf-8", "replace")
        try:
            return status, json.loads(text), text
        except ValueError:
            return status, None, text
    finally:
        writer.close()


async def run(args):
    u = urllib.parse.urlsplit(args.url)
    if u.scheme != "http" or not u.hostname:
        raise SystemExit("load.py: --url must be http://HOST:PORT (loopback only, no TLS)")
    try:
        addr = check_loopback(u.hostname)
    except ValueError as e:
        raise SystemExit(f"load.py: refusing the target: {e}")
    port = u.port or 80
    args.host_header = u.netloc
    base = u.path.rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    path = base + "/v1/chat/completions"

    if not args.model:
        try:
            status, text = await http_get(addr, port, args.host_header, base + "/v1/models", 10)
            args.model = json.loads(text)["data"][0]["id"] if status == 200 else None
        except (OSError, asyncio.TimeoutError, HTTPError, ValueError, KeyError, IndexError) as e:
            raise SystemExit(f"load.py: no --model and GET /v1/models failed: {e}")
        if not args.model:
            raise SystemExit("load.py: no --model and GET /v1/models did not name one")

    if args.long_prompt_tokens > 0:
        return await run_long_prompt(args, addr, port, path)

    bodies = build_bodies(args)
    m_before = m_err = None
    if args.metrics:
        m_before, m_err = await fetch_metrics(args, addr, port)

    results = [Result() for _ in bodies]
    queue = list(range(len(bodies)))
    queue.reverse()

    async def worker():
        while queue:
            i = queue.pop()
            res = results[i]
            await run_one(args, addr, port, path, bodies[i], res)
            if args.verbose:
                print(f"request {i}: " + (f"error {res.error}" if res.error else
                      f"ttft {res.ttft * 1e3 if res.ttft is not None else float('nan'):.1f} ms, "
                      f"{res.completion_tokens} tokens, finish {res.finish}"), file=sys.stderr)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(args.concurrency, len(bodies)))))
    wall = time.perf_counter() - t0

    m_after = None
    if args.metrics and m_before is not None:
        m_after, m_err = await fetch_metrics(args, addr, port)
    s = summarize(args, results, wall, m_before, m_after, m_err)
    if args.compare_alone > 0:
        s["alone"] = await compare_alone(args, addr, port, path, bodies, results)
    return s


async def compare_alone(args, addr, port, path, bodies, results):
    """The first --compare-alone requests again, one at a time: each output against the
    one the same request got among the concurrent ones."""
    n = min(args.compare_alone, len(bodies))
    same, errors, diffs = 0, 0, []
    prompt = 0
    # what the requests alone computed of their prompts (the rest came from the prefix
    # cache, which holds them from the concurrent run): /metrics, with --metrics
    m_before = (await fetch_metrics(args, addr, port))[0] if args.metrics else None
    for i in range(n):
        alone = Result()
        await run_one(args, addr, port, path, bodies[i], alone)
        busy = results[i]
        if not alone.ok or not busy.ok:
            errors += 1
            continue
        prompt += alone.prompt_tokens
        a, b = "".join(alone.text), "".join(busy.text)
        if a == b and alone.finish == busy.finish:
            same += 1
            continue
        at = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
        diffs.append({"request": i, "at_char": at, "concurrent": b[max(0, at - 20):at + 40],
                      "alone": a[max(0, at - 20):at + 40], "finish": [busy.finish, alone.finish]})
    key = "m40_prompt_tokens_computed_total"
    m_after = (await fetch_metrics(args, addr, port))[0] if m_before is not None else None
    computed = m_after[key] - m_before[key] if m_after and key in m_after and key in m_before else None
    return {"compared": n, "identical": same, "errors": errors, "differ": len(diffs), "first_diffs": diffs[:3],
            "prompt_tokens": prompt, "prompt_tokens_computed": computed}


async def run_long_prompt(args, addr, port, path):
    """--long-prompt-tokens: streams running, a quiet phase, then one long prompt."""
    # Tokens per word of this server's tokenizer (chat template included), from one
    # short request: the long prompt then gets about the number of tokens asked for.
    cal_words = 200
    rng = random.Random(args.seed ^ 0xCA11B)
    status, obj, text = await post_json(addr, port, args.host_header, path,
                                        chat_body(args, [{"role": "user", "content": random_words(rng, cal_words)}],
                                                  1, stream=False), args.timeout)
    try:
        tokens_per_word = obj["usage"]["prompt_tokens"] / cal_words
    except (TypeError, KeyError, ZeroDivisionError):
        raise SystemExit(f"load.py: the calibration request failed: HTTP {status}: {text[:300]}")
    long_words = max(1, int(args.long_prompt_tokens / tokens_per_word))

    n = args.concurrency
    results = [Result() for _ in range(n)]
    tasks = []
    for i in range(n):
        rng = random.Random(args.seed * 1000003 + i)
        body = chat_body(args, [{"role": "user", "content": random_words(rng, args.prompt_words)}], args.max_tokens)
        tasks.append(asyncio.ensure_future(run_one(args, addr, port, path, body, results[i])))
    t0 = time.perf_counter()
    # every stream has its first token (or ended)
    while any(not r.times and not r.error and not r.ok for r in results):
        if time.perf_counter() - t0 > args.timeout:
            break
        await asyncio.sleep(0.01)
    t_quiet = time.perf_counter()
    await asyncio.sleep(args.quiet_seconds)
    long_res = Result()
    long_body = chat_body(args, [{"role": "user", "content": random_words(random.Random(args.seed ^ 0x10A6),
                                                                           long_words)}], 1)
    t_long = time.perf_counter()
    await run_one(args, addr, port, path, long_body, long_res)
    t_long_end = time.perf_counter()
    # the streams' next tokens after it, then they are done with
    await asyncio.sleep(0.2)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)

    quiet, during = [], []
    for r in results:
        for a, b in zip(r.times, r.times[1:]):
            # a gap counts where it ends: one that ends after the long prompt arrived
            # is a gap the streams saw while it was processed
            if t_quiet <= b < t_long:
                quiet.append(b - a)
            elif t_long <= b <= t_long_end:
                during.append(b - a)
    # cancelled at the end (neither ok nor an error): ran through the long phase
    ended_early = sum(1 for r in results if (r.ok or r.error) and r.end < t_long_end)
    all_res = results + [long_res]
    s = {
        "mode": "long_prompt", "url": args.url, "model": args.model, "concurrency": n,
        "prompt_words": args.prompt_words, "max_tokens": args.max_tokens,
        "requests": len(all_res),
        "rejected": sum(1 for r in all_res if r.status == 429),
        "failed": sum(1 for r in all_res if r.error and r.status != 429),
        "error_kinds": {},
        "tokens_per_word": tokens_per_word, "long_prompt_words": long_words,
        "long_prompt_tokens": long_res.prompt_tokens if long_res.ok else None,
        "long_ok": long_res.ok, "long_error": long_res.error,
        "long_s": t_long_end - t_long,
        "quiet_s": t_long - t_quiet,
        "streams_ended_early": ended_early,
        "itl_quiet_n": len(quiet), "itl_long_n": len(during),
    }
    for r in all_res:
        if r.error:
            key = re.sub(r"\d+", "N", r.error)[:160]
            s["error_kinds"][key] = s["error_kinds"].get(key, 0) + 1
    for name, vals in (("itl_quiet", quiet), ("itl_long", during)):
        for q in (50, 99):
            v = percentile(vals, q)
            s[f"{name}_p{q}_ms"] = v * 1e3 if v is not None else None
    qp, lp = s["itl_quiet_p99_ms"], s["itl_long_p99_ms"]
    s["itl_p99_ratio"] = lp / qp if qp and lp is not None else None
    # load.py's exit status: the long prompt and the streams worked
    s["ok"] = int(long_res.ok and not s["failed"] and not s["rejected"])
    return s


def summarize(args, results, wall, m_before, m_after, m_err):
    ok = [r for r in results if r.ok]
    errors = {}
    for r in results:
        if not r.ok:
            # digits vary between otherwise equal errors ("prompt has 218 tokens ...")
            key = re.sub(r"\d+", "N", r.error or "unknown")[:160]
            errors[key] = errors.get(key, 0) + 1
    ttft = [r.ttft for r in ok if r.ttft is not None]
    itl = [g for r in ok for g in r.itl]
    gen = sum(r.completion_tokens for r in ok)
    finish = {}
    for r in ok:
        finish[r.finish or "none"] = finish.get(r.finish or "none", 0) + 1
    s = {
        "url": args.url, "model": args.model, "concurrency": args.concurrency, "requests": len(results),
        "prompt_words": args.prompt_words, "shared_prefix_words": args.shared_prefix_words,
        "max_tokens": args.max_tokens, "ok": len(ok), "errors": len(results) - len(ok),
        "rejected": sum(1 for r in results if not r.ok and r.status == 429),
        "failed": sum(1 for r in results if not r.ok and r.status != 429),
        "error_kinds": errors, "wall_s": wall,
        "generated_tokens": gen,
        "generated_tokens_source": "usage" if ok and all(r.usage_seen for r in ok) else
                                   ("content chunks" if not any(r.usage_seen for r in ok) else "mixed"),
        "gen_tok_s": gen / wall if wall > 0 else 0.0,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "ttft_p50_ms": None, "ttft_p99_ms": None, "itl_p50_ms": None, "itl_p99_ms": None,
        "mean_tokens_per_request": gen / len(ok) if ok else 0.0,
        "finish_reasons": finish,
    }
    for name, vals in (("ttft", ttft), ("itl", itl)):
        for q in (50, 99):
            v = percentile(vals, q)
            s[f"{name}_p{q}_ms"] = v * 1e3 if v is not None else None
    if args.metrics:
        key = "m40_prompt_tokens_computed_total"
        if m_before is not None and m_after is not None and key in m_before and key in m_after:
            s["prompt_tokens_computed"] = m_after[key] - m_before[key]
        else:
            s["prompt_tokens_computed"] = None
            s["metrics_error"] = m_err or f"{key} not in /metrics"
        # where the engine thread spent the run (one worker's engine: the server of
        # run-all.sh runs one worker)
        if m_before is not None and m_after is not None and "m40_engine_steps_total" in m_after:
            d = {k: m_after.get(k, 0.0) - m_before.get(k, 0.0) for k in m_after}
            s["engine"] = {
                "steps": d["m40_engine_steps_total"],
                "step_tokens": d.get("m40_engine_step_tokens_total", 0.0),
                **{ph: d.get('m40_engine_seconds_total{phase="%s"}' % ph, 0.0)
                   for ph in ("forward", "sample", "schedule")},
                **{pt: d.get('m40_engine_sample_seconds_total{part="%s"}' % pt, 0.0)
                   for pt in ("grammar_wait", "pick")},
            }
    return s


def fmt_ms(v):
    return "-" if v is None else f"{v:.1f} ms"


def print_long_report(s):
    def ms(v):
        return "-" if v is None else f"{v:.1f}"
    print(f"target:     {s['url']} model {s['model']}")
    print(f"load:       {s['concurrency']} streams of {s['prompt_words']}-word prompts, then after "
          f"{s['quiet_s']:.1f} s one prompt of {s['long_prompt_words']} words "
          f"({s['tokens_per_word']:.2f} tokens/word: ~{s['long_prompt_words'] * s['tokens_per_word']:.0f} tokens)")
    print(f"long:       " + (f"{s['long_prompt_tokens']} prompt tokens, answered in {s['long_s']:.2f} s"
                             if s["long_ok"] else f"failed after {s['long_s']:.2f} s: {s['long_error']}"))
    print(f"ITL quiet:  p50 {ms(s['itl_quiet_p50_ms'])} ms, p99 {ms(s['itl_quiet_p99_ms'])} ms ({s['itl_quiet_n']} gaps)")
    print(f"ITL long:   p50 {ms(s['itl_long_p50_ms'])} ms, p99 {ms(s['itl_long_p99_ms'])} ms ({s['itl_long_n']} gaps)"
          + (f"; p99 {s['itl_p99_ratio']:.2f}x the quiet one" if s["itl_p99_ratio"] is not None else ""))
    print(f"result:     {s['rejected']} rejected (429), {s['failed']} failed, "
          f"{s['streams_ended_early']} streams ended before the long prompt was answered")
    for k, n in s["error_kinds"].items():
        print(f"  error x{n}: {k}")


def print_report(s):
    if s.get("mode") == "long_prompt":
        return print_long_report(s)
    print(f"target:     {s['url']} model {s['model']}")
    print(f"load:       {s['requests']} requests, {s['concurrency']} concurrent, {s['prompt_words']} prompt words"
          + (f" + {s['shared_prefix_words']}-word shared system prompt" if s['shared_prefix_words'] else "")
          + f", max_tokens {s['max_tokens']}")
    print(f"result:     {s['ok']} ok, {s['errors']} errors ({s['rejected']} rejected with 429, "
          f"{s['failed']} failed) in {s['wall_s']:.2f} s")
    for k, n in s["error_kinds"].items():
        print(f"  error x{n}: {k}")
    print(f"throughput: {s['generated_tokens']} generated tokens ({s['generated_tokens_source']}) = "
          f"{s['gen_tok_s']:.1f} tok/s aggregate; {s['mean_tokens_per_request']:.1f} tokens/request")
    print(f"TTFT:       p50 {fmt_ms(s['ttft_p50_ms'])}, p99 {fmt_ms(s['ttft_p99_ms'])}")
    print(f"ITL:        p50 {fmt_ms(s['itl_p50_ms'])}, p99 {fmt_ms(s['itl_p99_ms'])} (gaps between content chunks)")
    print(f"finish:     " + ", ".join(f"{k} {v}" for k, v in sorted(s["finish_reasons"].items())))
    if "prompt_tokens_computed" in s:
        if s["prompt_tokens_computed"] is None:
            print(f"prefix:     /metrics unavailable: {s.get('metrics_error')}")
        else:
            pt = s["prompt_tokens"]
            pc = s["prompt_tokens_computed"]
            print(f"prefix:     {pt} prompt tokens sent, {pc:.0f} computed (m40_prompt_tokens_computed_total delta)"
                  + (f" = {100.0 * (1 - pc / pt):.1f}% reused" if pt else ""))
    if s.get("engine") and s["engine"]["steps"] > 0:
        e = s["engine"]
        st = e["steps"]
        print(f"engine:     {st:.0f} steps, {e['step_tokens'] / st:.1f} tokens/step; per step "
              f"forward {1e3 * e['forward'] / st:.2f} ms, sample+events {1e3 * e['sample'] / st:.2f} ms, "
              f"schedule {1e3 * e['schedule'] / st:.2f} ms")
    if "alone" in s:
        a = s["alone"]
        print(f"alone:      {a['identical']} of {a['compared']} outputs identical to the same request run alone"
              + (f", {a['errors']} not comparable (a request failed)" if a["errors"] else "")
              + (f"; alone, {a['prompt_tokens_computed']:.0f} of their {a['prompt_tokens']} prompt tokens computed"
                 if a["prompt_tokens_computed"] is not None else ""))
        for d in a["first_diffs"]:
            print(f"  request {d['request']} differs at char {d['at_char']} (finish {d['finish'][0]} / "
                  f"{d['finish'][1]}):\n    concurrent: {d['concurrent']!r}\n    alone:      {d['alone']!r}")
    if s["ok"] and s["max_tokens"] and s["mean_tokens_per_request"] < 0.9 * s["max_tokens"]:
        print(f"note:       outputs averaged {s['mean_tokens_per_request']:.1f} of max_tokens {s['max_tokens']} "
              "('stop': end of sequence, which OpenAI's API can not forbid -- see --extra-json; "
              "'length': max_tokens or the context size)")


def main():
    ap = argparse.ArgumentParser(description="Streaming chat load generator for a loopback m40 server.")
    ap.add_argument("--url", default="http://127.0.0.1:8080", help="server base URL (loopback only)")
    ap.add_argument("--model", default=None, help="model name (default: the first of GET /v1/models)")
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight at once")
    ap.add_argument("--requests", type=int, default=None, help="total requests (default: 2 x concurrency)")
    ap.add_argument("--prompt-words", type=int, default=100, help="random words in each user message")
    ap.add_argument("--shared-prefix-words", type=int, default=0,
                    help="words of a system message shared by every request (prefix caching)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--extra-json", default=None,
                    help='JSON object merged into every request body, e.g. \'{"ignore_eos": true}\'')
    ap.add_argument("--seed", type=int, default=1, help="seed of the random prompts")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per request")
    ap.add_argument("--metrics", action="store_true",
                    help="read /metrics before and after: prompt tokens the server computed")
    ap.add_argument("--long-prompt-tokens", type=int, default=0,
                    help="the long-prompt-while-streaming case: --concurrency streams, then one prompt of about "
                         "this many tokens")
    ap.add_argument("--quiet-seconds", type=float, default=5.0,
                    help="long-prompt case: seconds of streaming measured before the long prompt arrives")
    ap.add_argument("--compare-alone", type=int, default=0, metavar="N",
                    help="then run the first N requests one at a time: each greedy output must equal the "
                         "concurrent one (exit status 1 otherwise)")
    ap.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    ap.add_argument("-v", "--verbose", action="store_true", help="one line per request on stderr")
    args = ap.parse_args()
    if args.requests is None:
        args.requests = 2 * args.concurrency
    if not (1 <= args.concurrency <= 4096 and 1 <= args.requests <= 1_000_000):
        ap.error("--concurrency must be 1..4096 and --requests 1..1000000")
    if args.prompt_words < 1 or args.shared_prefix_words < 0 or args.max_tokens < 1 or args.timeout <= 0:
        ap.error("--prompt-words and --max-tokens must be positive, --shared-prefix-words >= 0, --timeout > 0")
    if args.long_prompt_tokens < 0 or args.quiet_seconds < 0:
        ap.error("--long-prompt-tokens and --quiet-seconds must not be negative")
    if args.compare_alone < 0 or (args.compare_alone and (args.temperature != 0 or args.long_prompt_tokens)):
        ap.error("--compare-alone needs greedy requests (--temperature 0) and no --long-prompt-tokens")
    args.extra = {}
    if args.extra_json:
        try:
            args.extra = json.loads(args.extra_json)
        except ValueError as e:
            ap.error(f"--extra-json: {e}")
        if not isinstance(args.extra, dict):
            ap.error("--extra-json must be a JSON object")
    summary = asyncio.run(run(args))
    if args.json:
        print(json.dumps(summary))
    else:
        print_report(summary)
    alone = summary.get("alone")
    return 0 if summary["ok"] and not (alone and alone["differ"]) else 1


if __name__ == "__main__":
    sys.exit(main())
