"""What agent frameworks call (issue 24): forced tool calls, structured outputs through
the SDK's parse(), the OpenAI Responses API and Anthropic's Messages API, through the
real nginx and the CPU engine with the official `openai` and `anthropic` SDKs.

The models are tiny and random: nothing here can depend on what they "mean". What is
checked is what the server guarantees whatever the model:
  - tool_choice "required" / a named function: constrained decoding makes every answer
    a call (finish_reason tool_calls) of a function among the tools whose arguments
    validate against its schema (jsonschema), in the markup of each template's parser
    (Hermes, Llama 3, Mistral, the JSON fallback), at temperature 1 over many seeds;
  - client.chat.completions.parse with a Pydantic model returns a parsed object;
  - /v1/responses and /v1/messages answer the SDKs' types, streamed and not, the
    streams add up to the final objects, usage matches chat completions' count, a
    stop sequence is reported as Anthropic reports it, tool results go back in;
  - malformed requests get 400 in each API's own error shape."""
import json
import os
from typing import Literal

import anthropic
import jsonschema
import openai
import pydantic
import pytest
import requests

import harness
from conftest import example
from test_tools import TOOL_MODEL, TOOL_MODEL_NAME, with_template

# Bounded strings and enums: a random model must be able to finish a call within
# max_tokens (an unbounded string could run to the limit).
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 8},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit"]}
SEARCH = {"type": "object", "properties": {
    "query": {"type": "string", "maxLength": 6},
    "safe": {"type": "boolean"}},
    "required": ["query", "safe"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": WEATHER}},
         {"type": "function", "function": {"name": "search", "description": "Web search",
                                            "parameters": SEARCH}}]
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH}
MSGS = [{"role": "user", "content": "What's the weather in Paris?"}]


@pytest.fixture(scope="module")
def qwen(instances):
    """(base_url, OpenAI client) of tiny-qwen2 with Qwen2.5's template (Hermes calls)."""
    _, base, cl = with_template(instances, "Qwen-Qwen2.5-7B-Instruct.jinja")
    return base, cl


# The anthropic SDK of 2026 has no sampling arguments of its own any more; the API
# (and this server) still take them in the body.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def claude(qwen):
    return anthropic.Anthropic(base_url=qwen[0], api_key="x", max_retries=0, timeout=60)


def check_calls(msg, names, single):
    assert msg.tool_calls, msg
    assert not (msg.content or "").strip(), msg.content
    if single:
        assert len(msg.tool_calls) == 1
    for c in msg.tool_calls:
        assert c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


# ---- forced tool calls ----

@pytest.mark.parametrize("seed", range(6))
def test_required_is_always_a_valid_call(qwen, seed):
    r = qwen[1].chat.completions.create(model=TOOL_MODEL_NAME, messages=MSGS, tools=TOOLS, tool_choice="required",
                                        temperature=1, seed=seed, max_tokens=200, parallel_tool_calls=seed % 2 == 0)
    assert r.choices[0].finish_reason == "tool_calls"
    check_calls(r.choices[0].message, SCHEMAS, single=seed % 2 == 1)


@pytest.mark.parametrize("seed", range(3))
def test_named_function_is_called(qwen, seed):
    r = qwen[1].chat.completions.create(model=TOOL_MODEL_NAME, messages=MSGS, tools=TOOLS, temperature=1, seed=seed,
                                        tool_choice={"type": "function", "function": {"name": "search"}},
                                        max_tokens=200, parallel_tool_calls=False)
    assert r.choices[0].finish_reason == "tool_calls"
    check_calls(r.choices[0].message, ["search"], single=True)


def test_forced_call_streamed_matches(qwen):
    kw = dict(model=TOOL_MODEL_NAME, messages=MSGS, tools=TOOLS, tool_choice="required", temperature=1, seed=11,
              max_tokens=200, parallel_tool_calls=False)
    full = qwen[1].chat.completions.create(**kw).choices[0].message
    calls, finish = {}, None
    for chunk in qwen[1].chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or []:
                c = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                c["name"] += tc.function.name or ""
                c["arguments"] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    assert finish == "tool_calls"
    assert [calls[0]] == [{"name": c.function.name, "arguments": c.function.arguments} for c in full.tool_calls]


@pytest.mark.parametrize("name", ["meta-llama-Llama-3.1-8B-Instruct.jinja", "mistralai-Mistral-Nemo-Instruct-2407.jinja"])
def test_forced_calls_in_each_markup(instances, name):
    # Llama 3 ({"name", "parameters"}) and Mistral ([TOOL_CALLS][...]) markup: the
    # parser of each finds the call the grammar forced.
    _, _, cl = with_template(instances, name)
    for seed in range(3):
        r = cl.chat.completions.create(model=TOOL_MODEL_NAME, messages=MSGS, tools=TOOLS, tool_choice="required",
                                       temperature=1, seed=seed, max_tokens=200, parallel_tool_calls=False)
        assert r.choices[0].finish_reason == "tool_calls", r
        check_calls(r.choices[0].message, SCHEMAS, single=True)


@pytest.mark.parametrize("name", ["Qwen-Qwen2.5-7B-Instruct.jinja", "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja",
                                  "meta-llama-Llama-3.1-8B-Instruct.jinja",
                                  "mistralai-Mistral-Nemo-Instruct-2407.jinja"])
def test_agent_loop_round_trips(instances, name):
    # What an agent does: the call the server returned goes back as it came (the
    # SDK's message, our call_ id) with the tool's result, for the next turn. Mistral's
    # template takes only 9-character ids: longer ones are cut to their last 9, as vLLM
    # does, so the loop works there too; on every API.
    _, base, cl = with_template(instances, name)
    r = cl.chat.completions.create(model=TOOL_MODEL_NAME, messages=MSGS, tools=TOOLS, tool_choice="required",
                                   temperature=1, seed=2, max_tokens=200, parallel_tool_calls=False)
    msg = r.choices[0].message
    call = msg.tool_calls[0]
    assert call.id.startswith("call_") and len(call.id) == 29
    turn = MSGS + [msg.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": "{\"temp\": 21}"}]
    again = cl.chat.completions.create(model=TOOL_MODEL_NAME, messages=turn, tools=TOOLS, max_tokens=4)
    assert again.usage.prompt_tokens > r.usage.prompt_tokens
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    claude = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0, timeout=60)
    m = claude.messages.create(model=TOOL_MODEL_NAME, max_tokens=200, tools=tools, messages=[MSGS[0]],
                               tool_choice={"type": "any", "disable_parallel_tool_use": True})
    use = [b for b in m.content if b.type == "tool_use"][0]
    m2 = claude.messages.create(model=TOOL_MODEL_NAME, max_tokens=4, tools=tools, messages=[
        MSGS[0], {"role": "assistant", "content": m.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21"}]}])
    assert m2.usage.input_tokens > m.usage.input_tokens
    rtools = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
               "parameters": t["function"]["parameters"]} for t in TOOLS]
    resp = cl.responses.create(model=TOOL_MODEL_NAME, input=MSGS[0]["content"], tools=rtools, tool_choice="required",
                               max_output_tokens=200, parallel_tool_calls=False)
    fc = [o for o in resp.output if o.type == "function_call"][0]
    resp2 = cl.responses.create(model=TOOL_MODEL_NAME, tools=rtools, max_output_tokens=4, input=[
        {"role": "user", "content": MSGS[0]["content"]}, fc.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": fc.call_id, "output": "21"}])
    assert resp2.usage.input_tokens > resp.usage.input_tokens


def test_forced_call_json_fallback(client, model):
    # stories260K has no template: the fallback renders, the JSON parser reads; its
    # context is 128 tokens, so one tiny function.
    tiny = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}}}]
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], tools=tiny,
                                       tool_choice="required", max_tokens=40, temperature=1, seed=3)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.tool_calls[0].function.name == "f"
    assert 0 <= json.loads(msg.tool_calls[0].function.arguments)["n"] <= 9


def test_forced_call_bad_schema_400(qwen):
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}]
    r = requests.post(qwen[0] + "/v1/chat/completions", timeout=60,
                      json={"messages": MSGS, "tools": bad, "tool_choice": "required", "max_tokens": 4})
    assert r.status_code == 400, r.text
    assert "'not'" in r.json()["error"]["message"]
    both = requests.post(qwen[0] + "/v1/chat/completions", timeout=60,
                         json={"messages": MSGS, "tools": TOOLS, "tool_choice": "required", "max_tokens": 4,
                               "response_format": {"type": "json_object"}})
    assert both.status_code == 400 and both.json()["error"]["param"] == "tool_choice"


# ---- structured outputs through the SDK ----

class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=8)
    unit: Literal["celsius", "fahrenheit"]
    days: int = pydantic.Field(ge=1, le=7)
    rain: bool


def test_chat_completions_parse_pydantic(qwen):
    for seed in range(3):
        r = qwen[1].chat.completions.parse(model=TOOL_MODEL_NAME, messages=MSGS, response_format=Weather,
                                           temperature=1, seed=seed, max_tokens=200)
        w = r.choices[0].message.parsed
        assert isinstance(w, Weather) and 1 <= w.days <= 7 and len(w.city) <= 8


# ---- /v1/responses ----

def test_responses_text(qwen):
    cl = qwen[1]
    r = cl.responses.create(model=TOOL_MODEL_NAME, input="Tell me a story", instructions="Be brief.",
                            max_output_tokens=12, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status in ("completed", "incomplete")
    assert r.usage.output_tokens <= 12 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens == 0  # the CPU engine has no prefix cache
    chat = cl.chat.completions.create(model=TOOL_MODEL_NAME, max_tokens=12, temperature=0,
                                      messages=[{"role": "system", "content": "Be brief."},
                                                {"role": "user", "content": "Tell me a story"}])
    # the same request path: the same prompt, the same greedy answer
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.output_text == chat.choices[0].message.content
    assert (r.status == "incomplete") == (chat.choices[0].finish_reason == "length")


def test_responses_stream_adds_up(qwen):
    kw = dict(model=TOOL_MODEL_NAME, input=[{"role": "user", "content": "Once upon a time"}],
              max_output_tokens=10, temperature=0)
    full = qwen[1].responses.create(**kw)
    types, text, final, seqs = [], "", None, []
    for ev in qwen[1].responses.create(stream=True, **kw):
        types.append(ev.type)
        seqs.append(ev.sequence_number)
        if ev.type == "response.output_text.delta":
            text += ev.delta
        if ev.type in ("response.completed", "response.incomplete"):
            final = ev.response
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert seqs == list(range(len(seqs)))
    assert text == full.output_text == final.output_text
    if text:
        assert types.index("response.output_item.added") < types.index("response.content_part.added") \
            < types.index("response.output_text.delta") < types.index("response.output_text.done") \
            < types.index("response.output_item.done")
    assert final.usage.output_tokens == full.usage.output_tokens


def test_responses_function_call_round_trip(qwen):
    tools = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
              "parameters": t["function"]["parameters"]} for t in TOOLS]
    r = qwen[1].responses.create(model=TOOL_MODEL_NAME, input="Weather in Paris?", tools=tools,
                                 tool_choice={"type": "function", "name": "get_weather"}, temperature=1,
                                 max_output_tokens=200, parallel_tool_calls=False)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    # streamed: the arguments' events carry the same call
    args, done = "", None
    for ev in qwen[1].responses.create(model=TOOL_MODEL_NAME, input="Weather in Paris?", tools=tools,
                                       tool_choice="required", temperature=1, max_output_tokens=200,
                                       parallel_tool_calls=False, stream=True):
        if ev.type == "response.function_call_arguments.delta":
            args += ev.delta
        if ev.type == "response.completed":
            done = ev.response
    fc = [o for o in done.output if o.type == "function_call"]
    assert len(fc) == 1 and fc[0].arguments == args
    # the result goes back as items; the answer is a new response
    again = qwen[1].responses.create(model=TOOL_MODEL_NAME, tools=tools, max_output_tokens=4, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "{\"temp\": 21}"}])
    assert again.usage.input_tokens > r.usage.input_tokens


def test_responses_json_schema(qwen):
    r = qwen[1].responses.create(model=TOOL_MODEL_NAME, input="Weather?", temperature=1, max_output_tokens=200,
                                 text={"format": {"type": "json_schema", "name": "w", "schema": WEATHER}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), WEATHER)
    # the SDK's parse() and its stream helper (which checks the events' order and
    # identities as it accumulates them)
    p = qwen[1].responses.parse(model=TOOL_MODEL_NAME, input="Weather?", max_output_tokens=200, text_format=Weather)
    assert isinstance(p.output_parsed, Weather)
    with qwen[1].responses.stream(model=TOOL_MODEL_NAME, input="Weather?", max_output_tokens=200,
                                  text_format=Weather) as s:
        final = s.get_final_response()
    assert isinstance(final.output_parsed, Weather)
    # (one call asked for: with parallel calls allowed a sampled answer may hold two)
    with qwen[1].responses.stream(model=TOOL_MODEL_NAME, input="Weather?", max_output_tokens=200, tool_choice="required",
                                  parallel_tool_calls=False,
                                  tools=[{"type": "function", "name": "search", "parameters": SEARCH}]) as s:
        final = s.get_final_response()
    assert [o.type for o in final.output] == ["function_call"]
    jsonschema.validate(json.loads(final.output[0].arguments), SEARCH)


def test_reasoning_items_and_thinking_blocks(instances):
    # DeepSeek-R1's template opens <think> in the prompt: with no "</think>" in a few
    # tokens the whole output is reasoning, a "reasoning" item / a "thinking" block.
    _, base, cl = with_template(instances, "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja")
    kw = dict(model=TOOL_MODEL_NAME, input="Hi", max_output_tokens=8, temperature=0)
    r = cl.responses.create(**kw)
    assert [o.type for o in r.output] == ["reasoning"] and r.output[0].content[0].text
    streamed = "".join(ev.delta for ev in cl.responses.create(stream=True, **kw)
                       if ev.type == "response.reasoning_text.delta")
    assert streamed == r.output[0].content[0].text
    claude = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0)
    m = claude.messages.create(model=TOOL_MODEL_NAME, max_tokens=8, extra_body=GREEDY,
                               messages=[{"role": "user", "content": "Hi"}])
    assert [b.type for b in m.content] == ["thinking"] and m.content[0].thinking == streamed
    with claude.messages.stream(model=TOOL_MODEL_NAME, max_tokens=8, extra_body=GREEDY,
                                messages=[{"role": "user", "content": "Hi"}]) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["thinking"] and final.content[0].thinking == streamed
    # A forced call or a schema under an open <think>: the grammar closes the thinking
    # first, so the call is a call and the JSON the answer, not reasoning.
    r = cl.chat.completions.create(model=TOOL_MODEL_NAME, messages=MSGS, tools=TOOLS, tool_choice="required",
                                   max_tokens=200, parallel_tool_calls=False, seed=2)
    assert r.choices[0].finish_reason == "tool_calls"
    check_calls(r.choices[0].message, SCHEMAS, single=True)
    assert not getattr(r.choices[0].message, "reasoning_content", None)
    r = cl.chat.completions.create(model=TOOL_MODEL_NAME, messages=MSGS, max_tokens=200, seed=2,
                                   response_format={"type": "json_schema",
                                                    "json_schema": {"name": "w", "schema": WEATHER}})
    jsonschema.validate(json.loads(r.choices[0].message.content), WEATHER)


def test_conversations_render_as_chat(qwen, claude):
    # A tool conversation in each API's spelling renders the prompt chat completions
    # renders (which test_tools checks against jinja2): same token count.
    from test_tools import CONVERSATION, TOOLS as CHAT_TOOLS
    chat = qwen[1].chat.completions.create(model=TOOL_MODEL_NAME, messages=CONVERSATION, tools=CHAT_TOOLS,
                                           max_tokens=1).usage.prompt_tokens
    call = CONVERSATION[1]["tool_calls"][0]
    fn = call["function"]
    items = [CONVERSATION[0],
             {"type": "function_call", "call_id": call["id"], "name": fn["name"], "arguments": fn["arguments"]},
             {"type": "function_call_output", "call_id": call["id"], "output": CONVERSATION[2]["content"]},
             {"role": "assistant", "content": [{"type": "output_text", "text": CONVERSATION[3]["content"]}]},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": CONVERSATION[4]["content"]}]}]
    flat = [{"type": "function", **t["function"]} for t in CHAT_TOOLS]
    resp = qwen[1].responses.create(model=TOOL_MODEL_NAME, input=items, tools=flat, max_output_tokens=1)
    assert resp.usage.input_tokens == chat
    msgs = [CONVERSATION[0],
            {"role": "assistant", "content": [{"type": "tool_use", "id": call["id"], "name": fn["name"],
                                               "input": json.loads(fn["arguments"])}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call["id"],
                                          "content": CONVERSATION[2]["content"]}]},
            {"role": "assistant", "content": CONVERSATION[3]["content"]},
            CONVERSATION[4]]
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in CHAT_TOOLS]
    assert claude.messages.count_tokens(model=TOOL_MODEL_NAME, messages=msgs, tools=tools).input_tokens == chat
    assert claude.messages.create(model=TOOL_MODEL_NAME, max_tokens=1, messages=msgs,
                                  tools=tools).usage.input_tokens == chat


RESP_BAD = [
    ({}, "input"),
    ({"input": 3}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"type": "image_generation_call"}]}, "input"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "x", "tools": [{"type": "function", "name": "a b"}]}, "tools"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"input": "x", "instructions": 5}, "instructions"),
    ({"input": "x", "temperature": "hot"}, "temperature"),
]


@pytest.mark.parametrize("body,param", RESP_BAD)
def test_responses_malformed_400(base_url, body, param):
    r = requests.post(base_url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_responses_sdk_raises(client, model):
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=model, input=[])


# ---- /v1/messages ----

def test_messages_text_matches_chat(qwen, claude):
    m = claude.messages.create(model=TOOL_MODEL_NAME, max_tokens=12, extra_body=GREEDY, system="Be brief.",
                               messages=[{"role": "user", "content": "Tell me a story"}])
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    chat = qwen[1].chat.completions.create(model=TOOL_MODEL_NAME, max_tokens=12, temperature=0,
                                           messages=[{"role": "system", "content": "Be brief."},
                                                     {"role": "user", "content": "Tell me a story"}])
    assert m.usage.input_tokens == chat.usage.prompt_tokens
    assert m.usage.output_tokens == chat.usage.completion_tokens
    assert "".join(b.text for b in m.content if b.type == "text") == chat.choices[0].message.content
    assert m.stop_reason == ("max_tokens" if chat.choices[0].finish_reason == "length" else "end_turn")
    n = claude.messages.count_tokens(model=TOOL_MODEL_NAME, system="Be brief.",
                                     messages=[{"role": "user", "content": "Tell me a story"}])
    # Anthropic's split: the tokens computed plus those read from the cache are the
    # prompt (the CPU engine has no prefix cache: nothing read, nothing created)
    assert m.usage.cache_read_input_tokens == 0 and m.usage.cache_creation_input_tokens == 0
    assert n.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens


def test_messages_stream_adds_up(claude):
    kw = dict(model=TOOL_MODEL_NAME, max_tokens=10, extra_body=GREEDY,
              messages=[{"role": "user", "content": [{"type": "text", "text": "Once upon a time"}]}])
    full = claude.messages.create(**kw)
    types, text = [], ""
    with claude.messages.stream(**kw) as s:
        for ev in s:
            types.append(ev.type)
            if ev.type == "content_block_delta" and ev.delta.type == "text_delta":
                text += ev.delta.text
        final = s.get_final_message()
    assert types[0] == "message_start" and types[-1] == "message_stop"
    assert "message_delta" in types
    assert text == "".join(b.text for b in full.content if b.type == "text")
    assert [(b.type, b.text) for b in final.content] == [(b.type, b.text) for b in full.content]
    assert final.stop_reason == full.stop_reason
    assert final.usage.output_tokens == full.usage.output_tokens
    assert final.usage.input_tokens == full.usage.input_tokens
    assert final.usage.cache_read_input_tokens == full.usage.cache_read_input_tokens == 0


def test_messages_stop_sequence(claude):
    kw = dict(model=TOOL_MODEL_NAME, max_tokens=24, extra_body=GREEDY, messages=[{"role": "user", "content": "Go on"}])
    text = claude.messages.create(**kw).content[0].text
    if len(text) < 4:
        pytest.skip("the model's greedy answer is too short to cut")
    stop = text[len(text) // 2:len(text) // 2 + 2]
    m = claude.messages.create(stop_sequences=[stop], **kw)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert (m.content[0].text if m.content else "") == text[:text.index(stop)]


def test_messages_tool_use_round_trip(claude):
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    ask = {"role": "user", "content": "Weather in Paris?"}
    m = claude.messages.create(model=TOOL_MODEL_NAME, max_tokens=200, tools=tools,
                               tool_choice={"type": "any", "disable_parallel_tool_use": True}, messages=[ask])
    assert m.stop_reason == "tool_use"
    uses = [b for b in m.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, SCHEMAS[uses[0].name])
    # a named tool, streamed: each block's input_json_delta adds up to its input (the
    # choice allows parallel calls, and a sampled answer sometimes makes two: blocks 0, 1)
    with claude.messages.stream(model=TOOL_MODEL_NAME, max_tokens=200, tools=tools,
                                tool_choice={"type": "tool", "name": "search"}, messages=[ask]) as s:
        partial = {}
        for ev in s:
            if ev.type == "content_block_delta" and ev.delta.type == "input_json_delta":
                partial[ev.index] = partial.get(ev.index, "") + ev.delta.partial_json
        final = s.get_final_message()
    assert final.stop_reason == "tool_use"
    blocks = {i: b for i, b in enumerate(final.content) if b.type == "tool_use"}
    assert blocks and set(partial) == set(blocks), (partial, final.content)
    for i, use in blocks.items():
        assert use.name == "search" and json.loads(partial[i]) == use.input
        jsonschema.validate(use.input, SEARCH)
    # the result goes back in a user turn
    again = claude.messages.create(model=TOOL_MODEL_NAME, max_tokens=4, tools=tools, messages=[
        ask, {"role": "assistant", "content": m.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                      "content": [{"type": "text", "text": "21 degrees"}]}]}])
    assert again.stop_reason in ("end_turn", "max_tokens") and again.usage.input_tokens > m.usage.input_tokens


class Verdict(pydantic.BaseModel):
    unit: Literal["celsius", "fahrenheit"]
    rain: bool
    level: Literal[1, 2, 3]


def test_messages_parse_pydantic(claude):
    # output_config.format (what messages.parse sends) is constrained decoding. The
    # SDK moves string and number bounds into descriptions (Anthropic's structured
    # outputs take none), so a model of enums alone: a random model's free strings
    # could run to max_tokens.
    for seed in range(3):
        m = claude.messages.parse(model=TOOL_MODEL_NAME, max_tokens=200, output_format=Verdict,
                                  messages=[{"role": "user", "content": "Weather?"}], extra_body={"seed": seed})
        assert isinstance(m.parsed_output, Verdict) and m.stop_reason == "end_turn", m


MSG_BAD = [
    ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"max_tokens": 4}, "messages"),
    ({"max_tokens": 4, "messages": []}, "messages"),
    ({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, "messages"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "messages"),
    ({"max_tokens": 4, "system": 5, "messages": [{"role": "user", "content": "x"}]}, "system"),
    ({"max_tokens": 4, "temperature": 1.5, "messages": [{"role": "user", "content": "x"}]}, "temperature"),
    ({"max_tokens": 4, "stop_sequences": ["a", "b", "c", "d", "e"], "messages": [{"role": "user", "content": "x"}]},
     "stop_sequences"),
    ({"max_tokens": 4, "tools": [{"name": "f"}], "messages": [{"role": "user", "content": "x"}]}, "tools"),
    ({"max_tokens": 4, "tool_choice": {"type": "sometimes"}, "messages": [{"role": "user", "content": "x"}]},
     "tool_choice"),
    ({"max_tokens": 4, "output_config": {"format": {"type": "regex"}}, "messages": [{"role": "user", "content": "x"}]},
     "output_config"),
]


@pytest.mark.parametrize("body,param", MSG_BAD)
def test_messages_malformed_400(base_url, body, param):
    r = requests.post(base_url + "/v1/messages", json=body, timeout=60)
    assert r.status_code == 400, r.text
    j = r.json()
    assert j["type"] == "error" and j["error"]["type"] == "invalid_request_error"
    assert param in j["error"]["message"] or param.split("_")[0] in j["error"]["message"], j


def test_messages_errors_in_anthropic_shape(base_url):
    r = requests.post(base_url + "/v1/messages", data=b"{not json", timeout=60,
                      headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["type"] == "error"
    r = requests.post(base_url + "/v1/messages", json={"model": "nope", "max_tokens": 4,
                                                       "messages": [{"role": "user", "content": "x"}]}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = requests.post(base_url + "/v1/messages/count_tokens", json={"messages": "x"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    # the engine's 400 (a schema it cannot compile), streamed: before any event
    r = requests.post(base_url + "/v1/messages", timeout=60, json={
        "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": "x"}],
        "tools": [{"name": "f", "input_schema": {"type": "object", "not": {}}}], "tool_choice": {"type": "any"}})
    assert r.status_code == 400 and r.json()["type"] == "error" and "'not'" in r.json()["error"]["message"]
    r = requests.post(base_url + "/v1/responses", timeout=60, json={
        "input": "x", "stream": True, "text": {"format": {"type": "json_schema", "name": "n", "schema": {"not": {}}}}})
    assert r.status_code == 400 and "'not'" in r.json()["error"]["message"]
    # nginx's own error pages too (a body over client_max_body_size)
    r = requests.post(base_url + "/v1/messages", data=b"{" + b" " * (2 * 1024 * 1024) + b"}", timeout=60,
                      headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large", r.text
    r = requests.post(base_url + "/v1/responses", data=b"{" + b" " * (2 * 1024 * 1024) + b"}", timeout=60,
                      headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "http_413", r.text
    cl = anthropic.Anthropic(base_url=base_url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.BadRequestError):
        cl.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": [{"type": "image",
                                                                                          "source": {}}]}])
