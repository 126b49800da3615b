"""gpt-oss's harmony format through the real nginx and the CPU engine, with the tiny
gpt-oss fixture (random weights) and our harmony-style template (tests/templates; the
fixture's GGUF carries no chat template, and the published gpt-oss one is not in the
repository). The fixture's vocabulary is GPT-2's: the harmony markers are plain text
there, so a grammar can make the random model write them, and the output parser reads
them as it reads gpt-oss's own marker tokens (which decode to the same text):
  - a `grammar` forcing an analysis message and then a final one: reasoning_content and
    content are its two bodies (streamed the same), and with m40_reasoning inline the
    content is the analysis message with its markup followed by the answer;
  - tool_choice required and a named function (constrained decoding in harmony markup):
    message.tool_calls with the tool's name and arguments valid for its schema,
    finish_reason tool_calls, streamed as delta.tool_calls the same;
  - without a grammar the random output has no markup: it is all content;
  - a tool conversation sent the way the SDK sends it (content null on a tool-call turn,
    its analysis as reasoning_content) renders exactly as Python's jinja2 renders it
    (the prompt's token count from `usage` against jinja2's text tokenized by `m40
    tokenize`), the analysis reaching the template as `thinking`."""
import datetime
import json
import os
import re
import subprocess

import openai
import pytest

import harness
from conftest import example

MODEL = os.path.join(harness.SHARED, "models", "next", "tiny-gpt-oss-mxfp4.gguf")
NAME = "tiny-gpt-oss-mxfp4"
TEMPLATE = os.path.join(harness.ROOT, "tests", "templates", "harmony-style.jinja")
M40 = os.path.join(harness.ROOT, "build", "m40")

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather for a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12},
            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "now", "description": "The current time.",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}},
]

MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]

# An analysis message, then the answer, as gpt-oss writes them after "<|start|>assistant".
CHANNELS = ('root ::= "<|channel|>analysis<|message|>" [a-z]{2,8} " " [a-z]{2,8} '
            '"<|end|><|start|>assistant<|channel|>final<|message|>" [a-z]{2,8} "."')


def server(instances, extra=""):
    for p in (MODEL, TEMPLATE):
        if not os.path.exists(p):
            pytest.skip(f"{p} not found")
    port = harness.free_port()
    text = example("minimal.conf").replace(
        "    m40_model /var/lib/m40/models/model.gguf;",
        f"    m40_model /var/lib/m40/models/model.gguf;\n    m40_chat_template {TEMPLATE};\n"
        f"    m40_ctx_size 4096;\n{extra}")
    text = harness.render(text, harness.make_workdir("harmony"), {"127.0.0.1:8080": f"127.0.0.1:{port}"},
                          model=MODEL)
    instances(text, "harmony", port)
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=120)


def stream(cl, **kw):
    """content, reasoning, tool calls {index: [id, name, arguments]}, finish of a stream."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in cl.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            reasoning += getattr(ch.delta, "reasoning_content", None) or ""
            for tc in ch.delta.tool_calls or []:
                c = calls.setdefault(tc.index, [None, None, ""])
                if tc.id:
                    c[0] = tc.id
                if tc.function and tc.function.name:
                    c[1] = tc.function.name
                if tc.function and tc.function.arguments:
                    c[2] += tc.function.arguments
            finish = ch.finish_reason or finish
    return content, reasoning, calls, finish


def test_channels_split_into_reasoning_and_content(instances):
    cl = server(instances)
    kw = dict(model=NAME, messages=MSGS, max_tokens=64, temperature=0, extra_body={"grammar": CHANNELS})
    msg = cl.chat.completions.create(**kw).choices[0].message
    reasoning = getattr(msg, "reasoning_content", None)
    assert reasoning and re.fullmatch(r"[a-z]{2,8} [a-z]{2,8}", reasoning), msg
    assert msg.content and re.fullmatch(r"[a-z]{2,8}\.", msg.content), msg
    assert msg.tool_calls is None
    content, s_reasoning, calls, finish = stream(cl, **kw)
    assert (content, s_reasoning, calls, finish) == (msg.content, reasoning, {}, "stop")
    inline = server(instances, "    m40_reasoning inline;\n")
    m2 = inline.chat.completions.create(**kw).choices[0].message
    assert m2.content == "<|channel|>analysis<|message|>" + reasoning + "<|end|>" + msg.content
    assert getattr(m2, "reasoning_content", None) is None


def test_free_output_without_markup_is_content(instances):
    cl = server(instances)
    msg = cl.chat.completions.create(model=NAME, messages=MSGS, max_tokens=16, temperature=0).choices[0].message
    assert msg.content and getattr(msg, "reasoning_content", None) is None and msg.tool_calls is None


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_call(instances, choice):
    cl = server(instances)
    kw = dict(model=NAME, messages=MSGS, tools=TOOLS, tool_choice=choice, max_tokens=64, temperature=0)
    r = cl.chat.completions.create(**kw)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch
    assert ch.message.content in (None, "") and len(ch.message.tool_calls) == 1
    call = ch.message.tool_calls[0]
    names = {t["function"]["name"] for t in TOOLS} if choice == "required" else {"get_weather"}
    assert call.function.name in names and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert set(args) == {"city", "days"} and 1 <= args["days"] <= 7 and len(args["city"]) <= 12
    else:
        assert args == {}
    content, reasoning, calls, finish = stream(cl, **kw)
    assert finish == "tool_calls" and content == "" and reasoning == ""
    assert len(calls) == 1 and calls[0][1] == call.function.name and calls[0][2] == call.function.arguments


# ---- rendering through the request path, against jinja2 ----

CONVERSATION = [
    {"role": "system", "content": "Use the tools when they help."},
    {"role": "user", "content": "Weather in Paris for two days?"},
    {"role": "assistant", "content": None, "reasoning_content": "I need the forecast.", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 2}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": [21, 19], \"sky\": \"clear\"}"},
    {"role": "assistant", "content": "Clear, 21 \u00b0C then 19 \u00b0C."},
    {"role": "user", "content": "And what time is it?"},
    {"role": "assistant", "content": None, "reasoning_content": "The clock tool.", "tool_calls": [
        {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
]


def jinja2_tokens(messages, tools, today, tmp_path):
    conv = {"messages": messages, "tools": tools, "add_generation_prompt": True, "bos_token": "",
            "eos_token": "<|endoftext|>", "openai": True}
    path = tmp_path / "conv.json"
    path.write_text(json.dumps(conv))
    out = subprocess.run(["python3", os.path.join(harness.ROOT, "tests", "jinja", "render.py"), TEMPLATE, str(path)],
                         capture_output=True, check=False)
    if out.returncode == 77:
        pytest.skip("jinja2 is not installed")
    head, _, data = out.stdout.partition(b"\n")
    assert head.startswith(b"OK "), out.stdout[:300]
    text = data[:int(head.split()[1])]
    # render.py fixes strftime_now at 2024-07-26; the server renders today's date
    assert text.count(b"2024-07-26") == 1
    text = text.replace(b"2024-07-26", today.encode())
    ids = json.loads(subprocess.run([M40, "tokenize", "--no-bos", "--special", MODEL, "-"], input=text,
                                    capture_output=True, check=True).stdout)
    bos = json.loads(subprocess.run([M40, "tokenize", MODEL, ""], capture_output=True, check=True).stdout)
    return len(ids) + (0 if bos and ids and ids[0] == bos[0] else len(bos))


def test_tool_conversation_renders_as_jinja2(instances, tmp_path):
    cl = server(instances)
    day = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    r = cl.chat.completions.create(model=NAME, messages=CONVERSATION, tools=TOOLS, max_tokens=1)
    if datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d") != day:
        pytest.skip("the date changed during the request")
    assert r.usage.prompt_tokens == jinja2_tokens(CONVERSATION, TOOLS, day, tmp_path)
    # the last call's analysis is in the prompt (the template keeps it while no answer
    # follows): without it the prompt is shorter
    bare = [dict(m) for m in CONVERSATION]
    del bare[6]["reasoning_content"]
    r2 = cl.chat.completions.create(model=NAME, messages=bare, tools=TOOLS, max_tokens=1)
    assert r2.usage.prompt_tokens < r.usage.prompt_tokens
    # and without tools: the developer block has no namespace then
    plain = cl.chat.completions.create(model=NAME, messages=MSGS, max_tokens=1)
    assert plain.usage.prompt_tokens == jinja2_tokens(MSGS, None, day, tmp_path)
