"""The OpenAI API through the official Python SDK, against conf/minimal.conf."""
import math

import openai
import pytest
import requests

PROMPT = [{"role": "user", "content": "Once upon a time, there was a little dog."}]


def chat(client, model, **kw):
    kw.setdefault("messages", PROMPT)
    kw.setdefault("max_tokens", 24)
    return client.chat.completions.create(model=model, **kw)


def test_health(base_url, model):
    r = requests.get(base_url + "/health")
    assert r.status_code == 200
    h = r.json()
    assert {k: h[k] for k in ("status", "model")} == {"status": "ready", "model": model}
    # once ready, what `m40 ps` shows (README, Endpoints)
    assert set(h) == {"status", "model", "device", "memory_bytes", "ctx_size", "max_seqs", "running", "queued",
                      "kv_tokens_used", "kv_tokens_total", "workers", "workers_ready", "models"}, h
    # one model: "models" holds the same object (but its own "models")
    assert len(h["models"]) == 1 and h["models"][0] == {k: v for k, v in h.items() if k != "models"}
    assert h["workers"] == h["workers_ready"] >= 1
    assert h["device"] == "cpu" or h["device"].startswith("cuda:"), h


def test_models_list(client, model):
    models = client.models.list()
    ids = [m.id for m in models.data]
    assert ids == [model]
    assert models.data[0].object == "model"
    assert models.data[0].owned_by == "m40"


def test_models_retrieve(client, model, base_url):
    m = client.models.retrieve(model)
    assert m.id == model and m.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    r = requests.post(base_url + "/v1/models/" + model)
    assert r.status_code == 405 and r.headers["Allow"] == "GET, HEAD"


def test_chat(client, model):
    r = chat(client, model, temperature=0)
    assert r.object == "chat.completion"
    assert r.id.startswith("chatcmpl-")
    assert r.model == model
    assert len(r.choices) == 1
    c = r.choices[0]
    assert c.index == 0
    assert c.message.role == "assistant"
    assert isinstance(c.message.content, str) and c.message.content
    assert c.finish_reason in ("stop", "length")
    assert c.logprobs is None
    u = r.usage
    assert u.prompt_tokens > 0 and 0 < u.completion_tokens <= 24
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens == 0  # the CPU engine has no prefix cache
    if c.finish_reason == "length":
        assert u.completion_tokens == 24


def test_chat_greedy_is_deterministic(client, model):
    a = chat(client, model, temperature=0).choices[0].message.content
    b = chat(client, model, temperature=0).choices[0].message.content
    assert a == b


def test_content_parts_equal_string_content(client, model):
    text = PROMPT[0]["content"]
    parts = [{"role": "user", "content": [{"type": "text", "text": text}]}]
    a = chat(client, model, temperature=0).choices[0].message.content
    b = chat(client, model, temperature=0, messages=parts).choices[0].message.content
    assert a == b


def test_system_and_assistant_roles(client, model):
    # short: the model's whole context is 128 tokens
    one = chat(client, model, temperature=0, max_tokens=4, messages=[{"role": "user", "content": "Go"}])
    sys_ = chat(client, model, temperature=0, max_tokens=4,
                messages=[{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Go"}])
    conv = chat(client, model, temperature=0, max_tokens=4,
                messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hi!"},
                          {"role": "user", "content": "Go"}])
    dev = chat(client, model, temperature=0, max_tokens=4,
               messages=[{"role": "developer", "content": "Be kind."}, {"role": "user", "content": "Go"}])
    assert sys_.usage.prompt_tokens > one.usage.prompt_tokens
    assert conv.usage.prompt_tokens > one.usage.prompt_tokens
    assert dev.usage.prompt_tokens == sys_.usage.prompt_tokens


def test_chat_stream_reassembles_to_nonstream(client, model):
    full = chat(client, model, temperature=0, max_tokens=32)
    chunks = list(chat(client, model, temperature=0, max_tokens=32, stream=True))
    assert len(chunks) >= 3
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert len({ch.id for ch in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices[0].finish_reason is not None
    assert all(ch.usage is None for ch in chunks)


def test_stream_include_usage(client, model):
    full = chat(client, model, temperature=0, max_tokens=16)
    chunks = list(chat(client, model, temperature=0, max_tokens=16, stream=True,
                       stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.prompt_tokens == full.usage.prompt_tokens
    assert last.usage.completion_tokens == full.usage.completion_tokens
    assert last.usage.total_tokens == full.usage.total_tokens
    assert all(ch.usage is None for ch in chunks[:-1])


def test_completions(client, model):
    r = client.completions.create(model=model, prompt="Once upon a time", max_tokens=16, temperature=0)
    assert r.object == "text_completion"
    assert r.id.startswith("cmpl-")
    assert len(r.choices) == 1 and r.choices[0].index == 0
    assert r.choices[0].text
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    s = client.completions.create(model=model, prompt="Once upon a time", max_tokens=16, temperature=0,
                                  stream=True)
    assert "".join(ch.choices[0].text for ch in s if ch.choices) == r.choices[0].text


def test_completions_prompt_as_list_and_echo(client, model):
    a = client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, temperature=0)
    b = client.completions.create(model=model, prompt=["Once upon a time"], max_tokens=8, temperature=0)
    assert a.choices[0].text == b.choices[0].text
    e = client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, temperature=0,
                                  echo=True)
    assert e.choices[0].text == "Once upon a time" + a.choices[0].text


def test_n_choices(client, model):
    r = chat(client, model, n=2, temperature=1.0, seed=7, max_tokens=12)
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.message.content for c in r.choices)
    assert r.usage.completion_tokens <= 24
    # streaming: both indices appear, each finishes exactly once
    chunks = list(chat(client, model, n=2, temperature=1.0, seed=7, max_tokens=12, stream=True))
    texts, finishes = {0: "", 1: ""}, {0: [], 1: []}
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index].append(c.finish_reason)
    assert [len(finishes[0]), len(finishes[1])] == [1, 1]
    assert texts == {0: r.choices[0].message.content, 1: r.choices[1].message.content}


def test_seed_reproducibility(client, model):
    a = chat(client, model, temperature=1.0, seed=1234, max_tokens=20).choices[0].message.content
    b = chat(client, model, temperature=1.0, seed=1234, max_tokens=20).choices[0].message.content
    assert a == b
    others = {chat(client, model, temperature=1.0, seed=s, max_tokens=20).choices[0].message.content
              for s in (1, 2, 3)}
    assert len(others | {a}) > 1, "different seeds never change the text"


def test_stop_string(client, model):
    base = chat(client, model, temperature=0, max_tokens=40).choices[0].message.content
    assert len(base) >= 10
    stop = base[6:9]
    expected = base[:base.index(stop)]
    r = chat(client, model, temperature=0, max_tokens=40, stop=[stop, "\u0001never"])
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "stop"
    s = chat(client, model, temperature=0, max_tokens=40, stop=stop, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in s if ch.choices) == expected


def test_max_tokens_and_max_completion_tokens(client, model):
    r = chat(client, model, temperature=0, max_tokens=3)
    assert r.usage.completion_tokens <= 3
    r = chat(client, model, temperature=0, max_completion_tokens=2)
    assert r.usage.completion_tokens <= 2


def test_logprobs_shape(client, model):
    r = chat(client, model, temperature=0, max_tokens=8, logprobs=True, top_logprobs=3)
    c = r.choices[0]
    content = c.logprobs.content
    assert len(content) == r.usage.completion_tokens
    joined = b"".join(bytes(t.bytes) for t in content)
    assert joined.decode("utf-8", errors="replace") == c.message.content
    for t in content:
        assert isinstance(t.token, str)
        assert t.logprob <= 0 and math.isfinite(t.logprob)
        assert len(t.top_logprobs) == 3
        lps = [a.logprob for a in t.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        # greedy: the chosen token is the most likely one
        assert t.top_logprobs[0].token == t.token
        assert abs(t.top_logprobs[0].logprob - t.logprob) < 1e-4
    r0 = chat(client, model, temperature=0, max_tokens=4, logprobs=True)
    assert all(t.top_logprobs == [] for t in r0.choices[0].logprobs.content)


def test_logprobs_stream(client, model):
    chunks = list(chat(client, model, temperature=0, max_tokens=6, logprobs=True, top_logprobs=2, stream=True))
    entries = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert len(entries) == 6 or chunks[-1].choices[0].finish_reason == "stop"
    assert all(len(e.top_logprobs) == 2 for e in entries)


def test_completions_legacy_logprobs(client, model):
    r = client.completions.create(model=model, prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert all(len(d) <= 2 for d in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_sampling_params_accepted(client, model):
    r = chat(client, model, temperature=0.7, top_p=0.9, max_tokens=8, seed=3, presence_penalty=0.5,
             frequency_penalty=0.5, user="u1", extra_body={"top_k": 20, "min_p": 0.05})
    assert r.choices[0].message.content


def test_logit_bias_forces_token(client, model):
    # +100 on one token id makes greedy decoding pick it at every step
    r = chat(client, model, temperature=0, max_tokens=4, logprobs=True, logit_bias={"300": 100})
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    assert len({bytes(t.bytes) for t in content}) == 1
    assert r.choices[0].message.content != chat(client, model, temperature=0, max_tokens=4).choices[0].message.content


def test_ignore_eos(client, model):
    # end-of-sequence forced at every step by a logit bias: the answer ends at once, unless
    # ignore_eos, which runs it to max_tokens (the control token renders as nothing)
    eos = "2"  # </s> of the test model's SentencePiece vocabulary (the first assert shows it ends)
    stopped = chat(client, model, temperature=0, max_tokens=5, logit_bias={eos: 100})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1
    for stream in (False, True):
        kw = dict(temperature=0, max_tokens=5, logit_bias={eos: 100}, extra_body={"ignore_eos": True})
        if stream:
            chunks = list(chat(client, model, stream=True, stream_options={"include_usage": True}, **kw))
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            assert finish == ["length"] and chunks[-1].usage.completion_tokens == 5
        else:
            r = chat(client, model, **kw)
            assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
            assert r.choices[0].message.content == ""


def test_ignore_eos_must_be_boolean(base_url, model):
    r = requests.post(base_url + "/v1/chat/completions",
                      json={"model": model, "messages": PROMPT, "max_tokens": 2, "ignore_eos": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "ignore_eos", r.text


def test_unknown_fields_ignored(base_url, model):
    r = requests.post(base_url + "/v1/chat/completions",
                      json={"model": model, "messages": PROMPT, "max_tokens": 2, "tools": [], "whatever": {"x": 1},
                            "parallel_tool_calls": False})
    assert r.status_code == 200, r.text


def test_metrics_count_requests(base_url, client, model):
    def scrape():
        text = requests.get(base_url + "/metrics").text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                k, v = line.rsplit(" ", 1)
                out[k] = float(v)
        return out

    before = scrape()
    r = chat(client, model, temperature=0, max_tokens=5)
    after = scrape()
    assert after["m40_requests_total"] == before["m40_requests_total"] + 1
    assert after["m40_generation_tokens_total"] == before["m40_generation_tokens_total"] + r.usage.completion_tokens
    assert after["m40_prompt_tokens_total"] == before["m40_prompt_tokens_total"] + r.usage.prompt_tokens
    assert after["m40_prompt_tokens_computed_total"] >= before["m40_prompt_tokens_computed_total"]
    assert after["m40_running_sequences"] == 0 and after["m40_queue_depth"] == 0
    assert 0 <= after["m40_kv_usage_ratio"] <= 1
    # prefix cache counters (all 0 on the CPU engine, which has no cache)
    assert after["m40_prefix_cache_queries_total"] >= before["m40_prefix_cache_queries_total"]
    assert after["m40_prefix_cache_hit_tokens_total"] <= after["m40_prefix_cache_query_tokens_total"]
    assert 0 <= after["m40_prefix_cache_hit_ratio"] <= 1
    # every generated token came out of a model step; the steps carried the prompt too
    steps = after["m40_engine_steps_total"] - before["m40_engine_steps_total"]
    assert steps >= r.usage.completion_tokens
    assert after["m40_engine_step_tokens_total"] - before["m40_engine_step_tokens_total"] >= \
        steps + after["m40_prompt_tokens_computed_total"] - before["m40_prompt_tokens_computed_total"] - 1
    fwd = 'm40_engine_seconds_total{phase="forward"}'
    assert after[fwd] > before[fwd]
    for ph in ("sample", "schedule"):
        k = 'm40_engine_seconds_total{phase="%s"}' % ph
        assert after[k] >= before[k] >= 0
    for h in ("m40_time_to_first_token_seconds", "m40_inter_token_latency_seconds"):
        assert after[h + '_bucket{le="+Inf"}'] == after[h + "_count"]
    assert after['m40_time_to_first_token_seconds_bucket{le="+Inf"}'] == \
        before['m40_time_to_first_token_seconds_bucket{le="+Inf"}'] + 1
    resp = requests.get(base_url + "/metrics")
    assert resp.headers["Content-Type"].startswith("text/plain")
