"""conf/multi-host.conf: a front nginx (the module loaded, no model) balancing three
m40 hosts (conf/minimal.conf on three loopback ports) with
`hash $m40_prefix_hash consistent;`.

The variable is checked through the front (a test header shows its value): it is the
FNV-1a 64 of the documented canonical bytes, the same for one system prompt whatever
the user says, different for another, and empty (the balancer then goes round robin)
for bodies it cannot use, never a crash.

Affinity against round robin: K system prompts, several requests each, interleaved.
The CPU engine has no prefix cache (m40_prefix_cache_* stay 0; only the GPU KV pool
has one), so on the CPU the hit rate is the one a prefix cache would get from the
routing: the share of requests sent to a host that had already served their system
prompt. With M40_MULTIHOST_DEVICE=N (a GPU host) the hosts run on GPU N and the
engines' own m40_prefix_cache_hit_tokens_total / m40_prefix_cache_query_tokens_total
are compared too."""
import json
import os
import random
import time

import pytest
import requests

import harness
from conftest import example

DEVICE = os.environ.get("M40_MULTIHOST_DEVICE", "")
HASH_BYTES = 2048       # conf/multi-host.conf's m40_prefix_hash_bytes


def fnv1a64(data):
    h = 0xcbf29ce484222325
    for c in data:
        h = ((h ^ c) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def expect(pieces):
    """The variable's value for these (role, text) pieces (ngx_http_m40_prefix.c)."""
    b = b"".join(role.encode() + b"\n" + text.encode() + b"\0" for role, text in pieces)
    return fnv1a64(b[:HASH_BYTES])


def backend_conf(port):
    text = example("minimal.conf")
    extra = "    m40_threads 1;\n"
    if DEVICE:
        extra += f"    m40_device {DEVICE};\n    m40_gpu_memory_fraction 0.2;\n"
    text = text.replace("    m40_model /var/lib/m40/models/model.gguf;",
                        "    m40_model /var/lib/m40/models/model.gguf;\n" + extra)
    return harness.render(text, harness.make_workdir("host"), {"127.0.0.1:8080": f"127.0.0.1:{port}"})


def front_conf(port, hosts, affinity=True, body_buffer=None):
    text = example("multi-host.conf")
    repl = {
        "127.0.0.1:8080": f"127.0.0.1:{port}",
        "worker_processes auto;": "worker_processes 1;",     # one round-robin state
        # what the front chose and the key, for the test only
        "proxy_read_timeout 600s;": "proxy_read_timeout 600s;\n"
                                    "            add_header X-Test-Upstream $upstream_addr always;\n"
                                    "            add_header X-Test-Prefix-Hash $m40_prefix_hash always;\n"
                                    # evaluated in the rewrite phase, before the body is read
                                    "            set $early_key \"[$m40_prefix_hash]\";\n"
                                    "            add_header X-Test-Early-Key $early_key always;",
    }
    for i, h in enumerate(hosts):
        repl[f"127.0.0.1:{8081 + i}"] = f"127.0.0.1:{h}"
    if not affinity:
        repl["        hash $m40_prefix_hash consistent;\n"] = ""
    if body_buffer:
        repl["client_body_buffer_size 256k;"] = f"client_body_buffer_size {body_buffer};"
    return harness.render(text, harness.make_workdir("front"), repl, model=None)


@pytest.fixture(scope="module")
def hosts(instances):
    ports = [harness.free_port() for _ in range(3)]
    for p in ports:
        instances(backend_conf(p), "host", p)
    return ports


@pytest.fixture(scope="module")
def front(instances, hosts):
    port = harness.free_port()
    # 8 KB in memory: a 20 KB body goes to a temp file, which the hash must read too
    inst = instances(front_conf(port, hosts, body_buffer="8k"), "front", port)
    return f"http://127.0.0.1:{port}", inst


def chat(system, user):
    msgs = ([{"role": "system", "content": system}] if system is not None else []) + \
        [{"role": "user", "content": user}]
    return {"messages": msgs, "max_tokens": 1, "temperature": 0}


def key_of(base, path, body, **kw):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = requests.post(base + path, data=data, headers={"Content-Type": "application/json"}, timeout=60, **kw)
    return r.headers.get("X-Test-Prefix-Hash", ""), r


SYS = "You are a storyteller. Tell short stories about a cat named Tom, in simple words."


def test_front_starts_no_engine(front):
    base, inst = front
    log = inst.log()
    assert "KV cache:" not in log and "loading" not in log.lower(), log
    # no m40 on the front: /metrics and the like are not served there
    assert requests.get(base + "/metrics").status_code == 404


def test_same_system_prompt_same_hash(front):
    base, _ = front
    k1, r1 = key_of(base, "/v1/chat/completions", chat(SYS, "Once upon a time"))
    k2, r2 = key_of(base, "/v1/chat/completions", chat(SYS, "The dog ran"))
    assert r1.status_code == 200 and r2.status_code == 200, (r1.text, r2.text)
    assert k1 == k2 == expect([("system", SYS)])
    # before the body was read the value was empty, and not kept: the balancer's
    # evaluation, after, computed it
    assert r1.headers["X-Test-Early-Key"] == "[]"
    # the same host answered both
    assert r1.headers["X-Test-Upstream"] == r2.headers["X-Test-Upstream"]
    # the same system prompt as an Anthropic "system", Responses "instructions", a
    # developer message, or content parts: the same canonical bytes
    assert key_of(base, "/v1/messages", {"system": SYS, "max_tokens": 1,
                                        "messages": [{"role": "user", "content": "hi"}]})[0] == k1
    assert key_of(base, "/v1/responses", {"instructions": SYS, "input": "hi", "max_output_tokens": 1})[0] == k1
    parts = {"messages": [{"role": "system", "content": [{"type": "text", "text": SYS}]},
                          {"role": "user", "content": "hi"}], "max_tokens": 1}
    assert key_of(base, "/v1/chat/completions", parts)[0] == k1
    dev = {"messages": [{"role": "developer", "content": SYS}, {"role": "user", "content": "hi"}], "max_tokens": 1}
    assert key_of(base, "/v1/chat/completions", dev)[0] == expect([("developer", SYS)])


def test_different_system_prompt_different_hash(front):
    base, _ = front
    keys = {key_of(base, "/v1/chat/completions", chat(f"{i}: " + SYS, "Once upon a time"))[0] for i in range(20)}
    assert len(keys) == 20 and "" not in keys
    # several system messages: all of them, in order
    two = {"messages": [{"role": "system", "content": "A"}, {"role": "system", "content": "B"},
                        {"role": "user", "content": "hi"}], "max_tokens": 1}
    assert key_of(base, "/v1/chat/completions", two)[0] == expect([("system", "A"), ("system", "B")])


def test_no_system_prompt_first_message(front):
    base, _ = front
    # no system prompt: the first message, so a conversation's turns stay together
    k, r = key_of(base, "/v1/chat/completions", chat(None, "Once upon a time"))
    assert r.status_code == 200 and k == expect([("user", "Once upon a time")])
    turns = {"messages": [{"role": "user", "content": "Once upon a time"},
                          {"role": "assistant", "content": "there was"},
                          {"role": "user", "content": "go on"}], "max_tokens": 1}
    assert key_of(base, "/v1/chat/completions", turns)[0] == k
    # /v1/completions: the prompt; Responses' text input
    assert key_of(base, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 1})[0] == \
        fnv1a64(b"prompt\nOnce upon a time")
    assert key_of(base, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 1})[0] == fnv1a64(b"prompt\n1,2,3,")
    assert key_of(base, "/v1/responses", {"input": "Once upon a time", "max_output_tokens": 1})[0] == k


def test_cut_at_hash_bytes(front):
    base, _ = front
    # prompts equal in their first m40_prefix_hash_bytes canonical bytes share a key
    long = "x" * 3000
    a = key_of(base, "/v1/chat/completions", chat(long + "A", "hi"))[0]
    b = key_of(base, "/v1/chat/completions", chat(long + "B", "hi"))[0]
    assert a == b == fnv1a64((b"system\n" + long.encode())[:HASH_BYTES])


def test_body_in_temp_file(front):
    base, _ = front
    # 20 KB (client_body_buffer_size 8k here): read back from the temp file, parsed
    pad = {"metadata": {"note": "y" * 20000}}
    k, r = key_of(base, "/v1/chat/completions", dict(chat(SYS, "Once upon a time"), **pad))
    assert k == expect([("system", SYS)]), r.text[:200]


def test_large_body_raw_prefix(front):
    base, _ = front
    # over 256 KB: not parsed; the first m40_prefix_hash_bytes raw bytes are hashed
    body = json.dumps(dict(chat(SYS, "hi"), metadata={"note": "z" * 300000})).encode()
    k, _ = key_of(base, "/v1/chat/completions", body)
    assert k == fnv1a64(body[:HASH_BYTES])


@pytest.mark.parametrize("body", [
    b"", b"{", b"not json at all", b"[1,2,3]", b"null", b'"a string"', b"{}",
    b'{"messages": 5}', b'{"messages": [1, null, {"role": 7}]}',
    b'{"messages": [{"role": "user", "content": {"x": 1}}]}',
    b"[" * 100000,                                  # nested past jansson's depth limit
    b'{"messages": [{"role": "system", "content": "\xff\xfe bad utf-8"}]}',
    b'{"messages": [{"role": "system", "content": "a\\u0000b"}]}',
])
def test_bad_bodies_empty_key(front, body):
    base, inst = front
    k, r = key_of(base, "/v1/chat/completions", body)
    assert r.status_code in (400, 413), (r.status_code, r.text[:200])
    # a JSON object of a user message whose content is an object: the role alone
    if body == b'{"messages": [{"role": "user", "content": {"x": 1}}]}':
        assert k == expect([("user", "")])
    else:
        assert k == "", body[:60]
    assert not inst.crashes()


def test_empty_key_round_robin(front):
    base, _ = front
    # GET and unusable bodies have an empty key: nginx's hash balancer goes round robin
    ups = {requests.get(base + "/v1/models").headers["X-Test-Upstream"] for _ in range(6)}
    assert len(ups) == 3, ups
    ups = {key_of(base, "/v1/chat/completions", b"{")[1].headers["X-Test-Upstream"] for _ in range(6)}
    assert len(ups) == 3, ups


def metric(base, name):
    for line in requests.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def workload(base, tag, k=12, rounds=4):
    """k system prompts, `rounds` requests each with different user text, interleaved
    (each round in a shuffled order); returns (routing hit rate, hosts per prompt).
    The hosts' ports are random, so where the consistent hash puts a prompt is too: with
    k prompts all land on one of 3 hosts with chance about 3^(1-k) (k = 5 failed CI once,
    1 in 81; k = 12 makes it about 1 in 177,000)."""
    rng = random.Random(7)
    # distinct from their first word on: different prompts share no cached block
    # (stories260K's context is 128 tokens, its tokens short: about 60 tokens each)
    systems = [f"{i} {tag}: tell a story of a little {['cat', 'dog', 'bird', 'fish', 'frog', 'bear'][i % 6]} "
               "in a big house." for i in range(k)]
    users = ["Once upon a time", "The sun was up", "One day", "Tom and Lily", "It was late"]
    seen, hits, total, where = set(), 0, 0, {}
    for rnd in range(rounds):
        order = list(range(k))
        rng.shuffle(order)
        for i in order:
            r = requests.post(base + "/v1/chat/completions", json=chat(systems[i], users[rnd % len(users)]),
                              timeout=120)
            assert r.status_code == 200, r.text
            up = r.headers["X-Test-Upstream"]
            hits += (up, i) in seen
            total += 1
            seen.add((up, i))
            where.setdefault(i, set()).add(up)
    return hits / total, where


def engine_rate(hosts, before):
    q = sum(metric(f"http://127.0.0.1:{h}", "m40_prefix_cache_query_tokens_total") for h in hosts) - before[0]
    t = sum(metric(f"http://127.0.0.1:{h}", "m40_prefix_cache_hit_tokens_total") for h in hosts) - before[1]
    return (t / q if q else None), q


def engine_totals(hosts):
    return (sum(metric(f"http://127.0.0.1:{h}", "m40_prefix_cache_query_tokens_total") for h in hosts),
            sum(metric(f"http://127.0.0.1:{h}", "m40_prefix_cache_hit_tokens_total") for h in hosts))


def test_affinity_hit_rate(instances, hosts):
    rates = {}
    for affinity in (True, False):
        port = harness.free_port()
        inst = instances(front_conf(port, hosts, affinity=affinity), "front-ab", port)
        before = engine_totals(hosts)
        t0 = time.time()
        routed, where = workload(f"http://127.0.0.1:{port}", "affinity" if affinity else "round-robin")
        eng, q = engine_rate(hosts, before)
        rates[affinity] = (routed, eng)
        name = "hash $m40_prefix_hash" if affinity else "round robin"
        print(f"{name}: routing hit rate {routed:.2f}, engine prefix-cache hit ratio "
              f"{'n/a (no prefix cache on the CPU)' if eng is None else f'{eng:.2f} of {q:.0f} tokens'}, "
              f"hosts per prompt {[len(where[i]) for i in sorted(where)]}, {time.time() - t0:.1f} s")
        inst.stop()
        if affinity:
            # every prompt on one host, and the prompts spread over more than one
            assert all(len(s) == 1 for s in where.values()), where
            assert len(set().union(*where.values())) >= 2, where
    assert rates[True][0] == pytest.approx(0.75)       # 4 requests a prompt: 3 find it cached
    assert rates[True][0] >= rates[False][0] + 0.2, rates
    if DEVICE:
        assert rates[True][1] is not None and rates[False][1] is not None, rates
        assert rates[True][1] >= rates[False][1] + 0.1, rates


def test_chunked_body(front):
    base, _ = front
    data = json.dumps(chat(SYS, "Once upon a time")).encode()

    def gen():      # chunked transfer encoding: the body arrives in many buffers
        for i in range(0, len(data), 7):
            yield data[i:i + 7]
    r = requests.post(base + "/v1/chat/completions", data=gen(), headers={"Content-Type": "application/json"},
                      timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers.get("X-Test-Prefix-Hash") == expect([("system", SYS)])


@pytest.mark.parametrize("value", ["0", "300k", "lots"])
def test_hash_bytes_out_of_range(hosts, value):
    port = harness.free_port()
    text = front_conf(port, hosts).replace("m40_prefix_hash_bytes 2048;", f"m40_prefix_hash_bytes {value};")
    inst = harness.Nginx(text, "front-bad")
    with pytest.raises(RuntimeError, match="m40_prefix_hash_bytes"):
        inst.start()
    inst.cleanup()
