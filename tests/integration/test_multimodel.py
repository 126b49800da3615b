"""Several m40_model per nginx (routing by the request's "model", 404 for an unknown
name, /v1/models and /health listing every model) and the metrics zone: /metrics is
the sum over every worker and engine whichever worker answers, and stays so over a
reload.

Runs without ../shared: the models are `m40 mkmodel` tiny shapes with different seeds
(random weights: the tests need two models that answer differently, not sense)."""
import concurrent.futures
import json
import os
import re
import signal
import subprocess
import time

import pytest
import requests

import harness

M40 = os.path.join(harness.ROOT, "build", "m40")
MSGS = [{"role": "user", "content": "Once upon a time"}]


@pytest.fixture(scope="module")
def tiny_models(workdirs):
    """Two tiny llama models that differ (seeds 1 and 2), world-readable for the
    workers (which run as nobody under root)."""
    if not os.access(M40, os.X_OK):
        pytest.skip("build/m40 is missing")
    d = harness.make_workdir("multimodels")
    paths = []
    for seed in (1, 2):
        p = os.path.join(d, f"tiny-{seed}.gguf")
        subprocess.run([M40, "mkmodel", "--shape", "tiny", "--type", "F16", "--seed", str(seed), p],
                       check=True, capture_output=True)
        os.chmod(p, 0o644)
        paths.append(p)
    return paths


def conf(port, models, workers=2, extra=""):
    """An nginx.conf with these m40_model lines (each "PATH params"), reuseport so
    that the kernel spreads connections over the workers, and each answer's worker
    pid in X-Worker."""
    lines = "".join(f"    m40_model {m};\n" for m in models)
    text = f"""load_module {harness.MODULE};
worker_processes {workers};
events {{ worker_connections 1024; }}
http {{
{lines}    m40_threads 1;
{extra}    server {{
        listen 127.0.0.1:{port} reuseport;
        add_header X-Worker $pid always;
        location / {{ m40_api; }}
    }}
}}
"""
    wd = harness.make_workdir("multi")
    temps = "".join(f"\n    {t}_temp_path {wd}/{t};" for t in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    return text.replace("http {", "http {" + temps + f"\n    access_log {wd}/access.log;", 1)


def metrics(base):
    """(values by series, the answering worker's pid)"""
    r = requests.get(base + "/metrics", headers={"Connection": "close"}, timeout=10)
    assert r.status_code == 200
    out = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out, r.headers["X-Worker"]


def chat(base, model=None, max_tokens=6, **kw):
    body = {"messages": MSGS, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if model is not None:
        body["model"] = model
    body.update(kw)
    r = requests.post(base + "/v1/chat/completions", json=body, headers={"Connection": "close"}, timeout=120)
    return r


@pytest.fixture(scope="module")
def two(instances, tiny_models):
    """Two models (alpha the default, beta with its own settings) in 2 workers."""
    port = harness.free_port()
    a, b = tiny_models
    inst = instances(conf(port, [f"{a} name=alpha", f"{b} name=beta max_seqs=2 max_queue=64 ctx_size=256"]),
                     "multi", port)
    return f"http://127.0.0.1:{port}", inst


def test_models_listed_with_state(two):
    base, _ = two
    j = requests.get(base + "/v1/models", timeout=10).json()
    assert [m["id"] for m in j["data"]] == ["alpha", "beta"]
    assert all(m["state"] == "ready" and m["object"] == "model" for m in j["data"]), j
    by = {m["id"]: m for m in j["data"]}
    assert by["beta"]["max_model_len"] == 256          # its own ctx_size
    r = requests.get(base + "/v1/models/beta", timeout=10)
    assert r.status_code == 200 and r.json()["id"] == "beta"
    r = requests.get(base + "/v1/models/gamma", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_health_reports_each_model(two):
    base, _ = two
    r = requests.get(base + "/health", timeout=10)
    assert r.status_code == 200, r.text
    j = r.json()
    assert j["status"] == "ready" and j["model"] == "alpha"    # the default's, as with one model
    assert [m["model"] for m in j["models"]] == ["alpha", "beta"]
    for m in j["models"]:
        assert m["status"] == "ready" and m["workers"] == 2 and m["workers_ready"] == 2, m
        assert m["device"] == "cpu" and m["running"] == 0 and m["queued"] == 0
    assert {m["model"]: m["max_seqs"] for m in j["models"]}["beta"] == 2
    assert {m["model"]: m["ctx_size"] for m in j["models"]}["beta"] == 256
    # m40 ps reads it
    if os.access(M40, os.X_OK):
        out = subprocess.run([M40, "ps", base], capture_output=True, text=True, timeout=30).stdout
        assert re.search(r"^alpha\s+ready\s+cpu", out, re.M) and re.search(r"^beta\s+ready\s+cpu", out, re.M), out


def test_routing_by_name(two, instances, tiny_models):
    base, _ = two
    ra, rb, rd = chat(base, "alpha"), chat(base, "beta"), chat(base)
    for r in (ra, rb, rd):
        assert r.status_code == 200, r.text
    assert ra.json()["model"] == "alpha" and rb.json()["model"] == "beta"
    assert rd.json()["model"] == "alpha"                       # no "model": the default
    ta, tb, td = (r.json()["choices"][0]["message"]["content"] for r in (ra, rb, rd))
    assert ta == td and ta != tb, (ta, tb)
    # beta's answer is the second model's: the same as a server of that model alone
    port = harness.free_port()
    alone = instances(conf(port, [f"{tiny_models[1]} name=beta ctx_size=256"], workers=1), "alone", port)
    r = chat(f"http://127.0.0.1:{port}", "beta")
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == tb
    # every endpoint routes: completions, responses, messages, count_tokens
    r = requests.post(base + "/v1/completions", timeout=60, json={
        "model": "beta", "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["model"] == "beta", r.text
    r = requests.post(base + "/v1/responses", timeout=60, json={
        "model": "beta", "input": "Once upon a time", "max_output_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["model"] == "beta", r.text
    r = requests.post(base + "/v1/messages", timeout=60, json={
        "model": "beta", "max_tokens": 4, "messages": MSGS})
    assert r.status_code == 200 and r.json()["model"] == "beta", r.text
    r = requests.post(base + "/v1/messages/count_tokens", timeout=60, json={"model": "beta", "messages": MSGS})
    assert r.status_code == 200 and r.json()["input_tokens"] > 0, r.text
    # streamed too
    r = requests.post(base + "/v1/chat/completions", timeout=60, stream=True, json={
        "model": "beta", "messages": MSGS, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True})
    text = ""
    for line in r.iter_lines():
        if line.startswith(b"data: {"):
            ev = json.loads(line[6:])
            assert ev["model"] == "beta"
            if ev["choices"] and ev["choices"][0]["delta"].get("content"):
                text += ev["choices"][0]["delta"]["content"]
    assert text == tb


def test_unknown_model_404_everywhere(two):
    base, _ = two
    for path, body in [("/v1/chat/completions", {"messages": MSGS}),
                       ("/v1/completions", {"prompt": "x"}),
                       ("/v1/responses", {"input": "x"})]:
        body["model"] = "gamma"
        r = requests.post(base + path, json=body, timeout=60)
        assert r.status_code == 404, (path, r.text)
        e = r.json()["error"]
        assert e["code"] == "model_not_found" and e["param"] == "model", e
        assert "'gamma'" in e["message"] and "'alpha', 'beta'" in e["message"], e
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = requests.post(base + path, json={"model": "gamma", "max_tokens": 4, "messages": MSGS}, timeout=60)
        assert r.status_code == 404 and r.json()["type"] == "error", (path, r.text)
        assert r.json()["error"]["type"] == "not_found_error"
    # a model that is not a string is the parameters' 400, as with one model
    r = requests.post(base + "/v1/chat/completions", json={"model": 7, "messages": MSGS}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text


def test_metrics_add_up_across_workers(two):
    base, _ = two
    before, _ = metrics(base)
    jobs = ["alpha"] * 25 + ["beta"] * 15 + [None] * 10   # None: the default, alpha
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        answers = list(ex.map(lambda m: chat(base, m, max_tokens=3), jobs))
    assert all(r.status_code == 200 for r in answers), [r.text for r in answers if r.status_code != 200]
    served_by = {r.headers["X-Worker"] for r in answers}
    assert len(served_by) == 2, served_by        # reuseport spread them: both workers counted
    tokens = {"alpha": 0, "beta": 0}
    prompt = {"alpha": 0, "beta": 0}
    for r in answers:
        j = r.json()
        tokens[j["model"]] += j["usage"]["completion_tokens"]
        prompt[j["model"]] += j["usage"]["prompt_tokens"]
    seen = set()
    for _ in range(30):           # whichever worker answers, the same sums
        m, pid = metrics(base)
        seen.add(pid)
        for name, n in (("alpha", 35), ("beta", 15)):
            lab = '{model="%s"}' % name
            assert m["m40_requests_total" + lab] - before["m40_requests_total" + lab] == n, (pid, name, m)
            assert m["m40_generation_tokens_total" + lab] - before["m40_generation_tokens_total" + lab] \
                == tokens[name]
            assert m["m40_prompt_tokens_total" + lab] - before["m40_prompt_tokens_total" + lab] == prompt[name]
            assert m["m40_engine_state" + lab] == 1
            assert m['m40_time_to_first_token_seconds_count' + lab] \
                - before['m40_time_to_first_token_seconds_count' + lab] == n
        assert m["m40_requests_total"] - before["m40_requests_total"] == 50
        assert m["m40_generation_tokens_total"] - before["m40_generation_tokens_total"] == sum(tokens.values())
        assert m["m40_running_sequences"] == 0 and m["m40_queue_depth"] == 0 and m["m40_kv_usage_ratio"] == 0
        assert m["m40_http_requests_total"] >= before["m40_http_requests_total"] + 50
    assert len(seen) == 2, seen


def test_metrics_many_requests_one_model_eight_clients(instances, tiny_models):
    # one model (the old configuration, unchanged) in 3 workers, 200 requests at
    # once: the counters are exact whichever worker is asked
    port = harness.free_port()
    base = f"http://127.0.0.1:{port}"
    instances(conf(port, [tiny_models[0]], workers=3, extra="    m40_max_seqs 4;\n"), "multi3", port)
    before, _ = metrics(base)
    with concurrent.futures.ThreadPoolExecutor(16) as ex:
        answers = list(ex.map(lambda i: chat(base, max_tokens=1 + i % 3), range(200)))
    assert all(r.status_code == 200 for r in answers)
    assert len({r.headers["X-Worker"] for r in answers}) == 3
    gen = sum(r.json()["usage"]["completion_tokens"] for r in answers)
    for _ in range(20):
        m, _ = metrics(base)
        assert m["m40_requests_total"] - before["m40_requests_total"] == 200
        assert m['m40_requests_total{model="tiny-1"}'] - before['m40_requests_total{model="tiny-1"}'] == 200
        assert m["m40_generation_tokens_total"] - before["m40_generation_tokens_total"] == gen


def wait_old_workers_gone(inst, old, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not any(os.path.exists(f"/proc/{p}") for p in old):
            return
        time.sleep(0.1)
    raise AssertionError(f"old workers {old} still running")


def test_reload_with_two_models_keeps_counting(instances, tiny_models):
    port = harness.free_port()
    base = f"http://127.0.0.1:{port}"
    a, b = tiny_models
    inst = instances(conf(port, [f"{a} name=alpha", f"{b} name=beta"]), "multireload", port)
    for m in ("alpha", "beta", "beta"):
        assert chat(base, m).status_code == 200
    before, _ = metrics(base)
    assert before['m40_requests_total{model="alpha"}'] == 1 and before['m40_requests_total{model="beta"}'] == 2
    old = {chat(base, "alpha").headers["X-Worker"] for _ in range(10)}
    # the same configuration with beta renamed gamma and the order swapped
    with open(inst.conf) as f:
        text = f.read()
    text = text.replace(f"    m40_model {a} name=alpha;\n    m40_model {b} name=beta;\n",
                        f"    m40_model {b} name=gamma;\n    m40_model {a} name=alpha;\n")
    with open(inst.conf, "w") as f:
        f.write(text)
    inst.proc.send_signal(signal.SIGHUP)
    deadline = time.time() + 60
    while time.time() < deadline:
        j = requests.get(base + "/v1/models", timeout=10).json()
        if [m["id"] for m in j["data"]] == ["gamma", "alpha"]:
            break
        time.sleep(0.1)
    inst.wait_health()
    wait_old_workers_gone(inst, old)
    m, _ = metrics(base)
    # alpha's count ran on (the old workers' counts were retired into the zone); beta is
    # no longer served but its total stays listed; gamma starts at 0
    assert m['m40_requests_total{model="alpha"}'] == 1 + 10, m
    assert m['m40_requests_total{model="beta"}'] == 2
    assert m['m40_requests_total{model="gamma"}'] == 0
    assert m["m40_requests_total"] == 13
    r = chat(base)                                  # the default is gamma now
    assert r.status_code == 200 and r.json()["model"] == "gamma"
    assert chat(base, "beta").status_code == 404
    for _ in range(10):
        m, _ = metrics(base)
        assert m['m40_requests_total{model="gamma"}'] == 1 and m["m40_requests_total"] == 14
    j = requests.get(base + "/health", timeout=10).json()
    assert [x["model"] for x in j["models"]] == ["gamma", "alpha"]
    assert all(x["workers"] == 2 for x in j["models"]), j     # the old workers' slots are free


def nginx_t(text):
    wd = harness.make_workdir("multit")
    path = os.path.join(wd, "nginx.conf")
    with open(path, "w") as f:
        f.write(text)
    return subprocess.run([harness.NGINX, "-t", "-p", wd, "-c", path, "-e", os.path.join(wd, "error.log"),
                           "-g", f"pid {wd}/nginx.pid;"], capture_output=True, text=True)


@pytest.mark.parametrize("models,message", [
    (["{a} name=x", "{b} name=x"], 'duplicate model name "x"'),
    (["{a}", "{a}"], 'duplicate model name "tiny-1"'),
    (["{a} colour=blue"], 'invalid m40_model parameter "colour=blue"'),
    (["{a} kv_share=0"], 'invalid m40_model parameter "kv_share=0"'),
    (["{a} kv_share=1.5"], 'invalid m40_model parameter "kv_share=1.5"'),
    (["{a} max_seqs=0"], 'invalid m40_model parameter "max_seqs=0"'),
    (["{a} device=gpu"], 'invalid m40_model parameter "device=gpu"'),
    (["{a} reasoning=loud"], 'invalid m40_model parameter "reasoning=loud"'),
    (["{a} name="], 'invalid m40_model parameter "name="'),
    (["{a} chat_template=/nonexistent.jinja"], '/nonexistent.jinja'),
    (["{a} name=" + "n" * 128], "longer than 127 bytes"),
    (["{a} keep_alive=500ms"], 'invalid m40_model parameter "keep_alive=500ms"'),
    (["{a} keep_alive=soon"], 'invalid m40_model parameter "keep_alive=soon"'),
    (["{a} tp=0"], 'invalid m40_model parameter "tp=0"'),
    (["{a} tp=65"], 'invalid m40_model parameter "tp=65"'),
    (["{a} tp=2 device=cpu"], "needs a GPU device"),
    (["{a} batch_invariant=maybe"], 'invalid m40_model parameter "batch_invariant=maybe": "on" or "off" expected'),
    (["{a} batch_invariant="], 'invalid m40_model parameter "batch_invariant="'),
    (["{a} device=0 tp=2 batch_invariant=on"], "batch_invariant does not work with tensor parallelism (tp=2)"),
])
def test_config_errors(tiny_models, models, message):
    a, b = tiny_models
    r = nginx_t(conf(harness.free_port(), [m.format(a=a, b=b) for m in models]))
    assert r.returncode != 0 and message in r.stderr, r.stderr


def test_config_accepts_every_parameter(tiny_models):
    a, b = tiny_models
    r = nginx_t(conf(harness.free_port(), [
        f"{a} name=one device=cpu ctx_size=128 max_seqs=2 max_queue=8 threads=1 kv_share=0.5 "
        "gpu_memory_fraction=0.8 tool_parser=hermes reasoning=none prefill_chunk=64 prefill_budget=128 "
        "itl_guard=off keep_alive=5m batch_invariant=on",
        f"{b} name=two device=0 tp=2 itl_guard=2 keep_alive=off batch_invariant=off"],
        extra="    m40_max_resident 1;\n"))
    assert r.returncode == 0, r.stderr
    # kv_share on the CPU is a warning, not an error
    assert "kv_share of \"one\" has no effect on the cpu" in r.stderr, r.stderr


def test_batch_invariant_directive(tiny_models):
    # m40_batch_invariant on | off: the default of every model; a model's
    # batch_invariant= overrides it (tp=2 refuses it, unless the model turns it off)
    a, b = tiny_models
    r = nginx_t(conf(harness.free_port(), [a], extra="    m40_batch_invariant maybe;\n"))
    assert r.returncode != 0, r.stderr
    assert 'invalid value "maybe" in "m40_batch_invariant" directive, it must be "on" or "off"' in r.stderr, r.stderr
    r = nginx_t(conf(harness.free_port(), [a, f"{b} device=0 tp=2"], extra="    m40_batch_invariant on;\n"))
    assert r.returncode != 0 and "batch_invariant does not work with tensor parallelism (tp=2)" in r.stderr, r.stderr
    for extra in ("    m40_batch_invariant on;\n", "    m40_batch_invariant off;\n", ""):
        r = nginx_t(conf(harness.free_port(), [a, f"{b} device=0 tp=2 batch_invariant=off"], extra=extra))
        assert r.returncode == 0, (extra, r.stderr)


def test_killed_worker_counts_kept(tiny_models):
    # a worker that dies without exiting (SIGKILL) leaves its slot: the next answer
    # notices the pid is gone and moves its counts to the model's retired sum, so the
    # totals stay exact and the gauges and worker counts are the live engines'. Not
    # the instances fixture: this instance logs the crash on purpose.
    port = harness.free_port()
    base = f"http://127.0.0.1:{port}"
    a, b = tiny_models
    inst = harness.Nginx(conf(port, [f"{a} name=alpha", f"{b} name=beta"]), "multikill",
                         f"{base}/health").start()
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as ex:
            answers = list(ex.map(lambda i: chat(base, ("alpha", "beta")[i % 2], max_tokens=2), range(40)))
        assert all(r.status_code == 200 for r in answers)
        pids = {r.headers["X-Worker"] for r in answers}
        assert len(pids) == 2
        victim = int(sorted(pids)[0])
        os.kill(victim, signal.SIGKILL)
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                h = requests.get(base + "/health", timeout=5)
                if h.status_code == 200 and all(m["workers"] == 2 for m in h.json()["models"]):
                    break
            except requests.RequestException:
                pass
            time.sleep(0.1)
        else:
            raise AssertionError("no respawned worker: " + inst.log()[-2000:])
        for _ in range(20):
            m, pid = metrics(base)
            assert int(pid) != victim
            assert m['m40_requests_total{model="alpha"}'] == 20 and m['m40_requests_total{model="beta"}'] == 20, m
            assert m["m40_requests_total"] == 40
        assert "exited on signal 9" in inst.log()
    finally:
        inst.stop()
        inst.cleanup()


def wait_for(pred, timeout=30, what="condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def state_of(base, name):
    return {m["id"]: m["state"] for m in requests.get(base + "/v1/models", timeout=10).json()["data"]}[name]


def test_keep_alive_unloads_and_reloads(instances, tiny_models):
    # beta (keep_alive=1s) is loaded by its first request, which waits for it, and
    # unloaded after 1 s idle; its counters run on over the unload
    port = harness.free_port()
    base = f"http://127.0.0.1:{port}"
    a, b = tiny_models
    inst = instances(conf(port, [f"{a} name=alpha", f"{b} name=beta keep_alive=1s"], workers=1), "keepalive", port)
    assert state_of(base, "beta") == "unloaded"
    h = requests.get(base + "/health", timeout=10)
    assert h.status_code == 200 and [m["status"] for m in h.json()["models"]] == ["ready", "unloaded"], h.text
    m, _ = metrics(base)
    assert m['m40_engines_loaded{model="beta"}'] == 0 and m['m40_engine_state{model="beta"}'] == 3
    assert m['m40_model_loads_total{model="beta"}'] == 0
    r1 = chat(base, "beta")
    assert r1.status_code == 200 and r1.json()["model"] == "beta", r1.text
    m, _ = metrics(base)
    assert m['m40_engines_loaded{model="beta"}'] == 1 and m['m40_model_loads_total{model="beta"}'] == 1
    assert m['m40_model_load_waits_total{model="beta"}'] == 1
    assert m['m40_model_load_wait_seconds_total{model="beta"}'] > 0
    assert state_of(base, "beta") == "ready"
    t0 = time.time()
    wait_for(lambda: state_of(base, "beta") == "unloaded", 10, "beta to unload")
    assert time.time() - t0 > 0.5                   # not before its keep_alive
    assert "unloaded \"beta\" (idle for its keep_alive)" in inst.log()
    m, _ = metrics(base)
    assert m['m40_model_unloads_total{model="beta"}'] == 1 and m['m40_engines_loaded{model="beta"}'] == 0
    assert m['m40_requests_total{model="beta"}'] == 1      # kept over the unload
    r2 = chat(base, "beta")
    assert r2.status_code == 200
    assert r2.json()["choices"][0]["message"]["content"] == r1.json()["choices"][0]["message"]["content"]
    m, _ = metrics(base)
    assert m['m40_requests_total{model="beta"}'] == 2 and m['m40_model_loads_total{model="beta"}'] == 2
    assert m['m40_model_load_waits_total{model="beta"}'] == 2
    # alpha never waited and stays loaded
    assert m['m40_model_load_waits_total{model="alpha"}'] == 0 and state_of(base, "alpha") == "ready"


def test_max_resident_unloads_the_least_recently_used(instances, tiny_models):
    port = harness.free_port()
    base = f"http://127.0.0.1:{port}"
    a, b = tiny_models
    instances(conf(port, [f"{a} name=alpha keep_alive=1h", f"{b} name=beta keep_alive=1h"], workers=1,
                   extra="    m40_max_resident 1;\n"), "resident", port)
    assert chat(base, "alpha").status_code == 200
    assert (state_of(base, "alpha"), state_of(base, "beta")) == ("ready", "unloaded")
    assert chat(base, "beta").status_code == 200
    assert (state_of(base, "alpha"), state_of(base, "beta")) == ("unloaded", "ready")
    # beta is busy with a long answer: alpha's request waits for it to end, then beta goes
    def timed(model, n):
        r = chat(base, model, n)
        return r, time.time()

    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        long = ex.submit(timed, "beta", 400)
        wait_for(lambda: metrics(base)[0]["m40_running_sequences"] == 1, 30, "beta to run")
        short = ex.submit(timed, "alpha", 2)
        (rl, tl), (rs, ts) = long.result(), short.result()
    assert rl.status_code == 200 and rs.status_code == 200, (rl.text, rs.text)
    assert rl.json()["usage"]["completion_tokens"] == 400
    assert ts > tl          # alpha could load only once beta's answer was over
    m, _ = metrics(base)
    assert m["m40_engines_loaded"] == 1
    assert m['m40_model_unloads_total{model="alpha"}'] == 1 and m['m40_model_unloads_total{model="beta"}'] == 1
    assert m['m40_model_loads_total{model="alpha"}'] == 2 and m['m40_model_loads_total{model="beta"}'] == 1
    assert (state_of(base, "alpha"), state_of(base, "beta")) == ("ready", "unloaded")


def test_conf_example_two_models(instances, tiny_models):
    # conf/two-models.conf as it is, with this run's paths and port
    port = harness.free_port()
    base = f"http://127.0.0.1:{port}"
    a, b = tiny_models
    with open(os.path.join(harness.ROOT, "conf", "two-models.conf")) as f:
        text = f.read()
    text = harness.render(text, harness.make_workdir("twoconf"), {
        "127.0.0.1:8080": f"127.0.0.1:{port}", "/var/lib/m40/models/base.gguf": b}, model=a)
    instances(text, "twoconf", port)
    assert [(m["id"], m["state"]) for m in requests.get(base + "/v1/models", timeout=10).json()["data"]] \
        == [("chat", "ready"), ("base", "unloaded")]
    assert chat(base).json()["model"] == "chat"
    r = chat(base, "base")
    assert r.status_code == 200 and r.json()["model"] == "base"
    assert state_of(base, "base") == "ready"
    assert requests.get(base + "/v1/models/base", timeout=10).json()["max_model_len"] == 2048


def test_cancellations_counted_across_workers(two):
    # a stream left mid-way: its cancellation and freed slot show in the other worker's
    # /metrics too. No event goes to anybody then, so the engine wakes its worker after
    # the step that cancelled it, and the worker copies its counters; without that the
    # other worker would report the sequence as running until the owner itself answers
    # a /metrics (which copies them too). So the round counts only when the first
    # answer after the cancellation comes from the other worker.
    import socket
    base, _ = two
    port = int(base.rsplit(":", 1)[1])
    body = json.dumps({"model": "alpha", "messages": MSGS, "max_tokens": 500, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    req = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    conclusive = 0
    for _ in range(12):
        before, _ = metrics(base)
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(req)
        s.settimeout(60)
        head = b""
        while b"data: " not in head:
            head += s.recv(4096)
        owner = re.search(rb"X-Worker: (\d+)", head).group(1).decode()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        s.close()                        # reset after the first token: the client is gone
        time.sleep(0.5)                  # the engine's next step has cancelled it
        m, who = metrics(base)
        if who != owner:
            conclusive += 1
            assert m["m40_running_sequences"] == 0 and m["m40_kv_usage_ratio"] == 0, (owner, who, m)
            assert m['m40_requests_cancelled_total{model="alpha"}'] \
                - before['m40_requests_cancelled_total{model="alpha"}'] == 1
        for _ in range(6):               # and so does everybody after
            m, _ = metrics(base)
            assert m["m40_running_sequences"] == 0 and m["m40_queue_depth"] == 0 and m["m40_kv_usage_ratio"] == 0
            assert m['m40_requests_cancelled_total{model="alpha"}'] \
                - before['m40_requests_cancelled_total{model="alpha"}'] == 1
        if conclusive >= 2:
            break
    assert conclusive >= 2, "the other worker never answered first"
