"""Tool calls stream as they are written (issue 24), through the real nginx and the CPU
engine with the official SDKs, which accumulate the deltas:
  - /v1/chat/completions: the call's first chunk has its index, id, type and name with
    arguments "", then the arguments come as several delta.tool_calls[].function
    .arguments fragments, in the markup of each parser (Hermes, Llama 3 JSON, Mistral,
    the JSON fallback, harmony); joined they are exactly the non-streamed call's
    arguments (same seed) and valid for the tool's schema;
  - /v1/responses: output_item.added (function_call, arguments ""), several
    response.function_call_arguments.delta, then .done and output_item.done whose
    arguments are the deltas joined, as is the completed response's item;
  - /v1/messages: content_block_start (tool_use, input {}), several input_json_delta
    events, content_block_stop; the joined partial_json is the non-streamed input;
  - the openai SDK's chat stream helper, which parses the arguments after each fragment
    (partial JSON) and a strict pydantic tool's at the end.
The models are tiny and random; tool_choice forces a call (constrained decoding), and
each schema has enough to write that the arguments take many tokens."""
import json
from typing import Literal

import anthropic
import jsonschema
import openai
import pydantic
import pytest

import test_harmony
from test_tools import TOOL_MODEL_NAME, with_template

# Arguments of many tokens: a random model's call cannot be one token long.
ORDER = {"type": "object", "properties": {
    "item": {"type": "string", "minLength": 6, "maxLength": 10},
    "count": {"type": "integer", "minimum": 100, "maximum": 99999},
    "express": {"type": "boolean"},
    "note": {"enum": ["leave at the door", "call on arrival"]}},
    "required": ["item", "count", "express", "note"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "order", "description": "Order something", "parameters": ORDER}}]
NAMED = {"type": "function", "function": {"name": "order"}}
MSGS = [{"role": "user", "content": "Order ten lamps."}]

MARKUPS = ["Qwen-Qwen2.5-7B-Instruct.jinja", "meta-llama-Llama-3.1-8B-Instruct.jinja",
           "mistralai-Mistral-Nemo-Instruct-2407.jinja", "google-gemma-2-2b-it.jinja"]


def chat_stream(cl, **kw):
    """The tool-call chunks of a stream: [(index, id, type, name, arguments)], finish."""
    parts, finish = [], None
    for chunk in cl.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or []:
                assert len(ch.delta.tool_calls) == 1
                parts.append((tc.index, tc.id, tc.type, tc.function.name, tc.function.arguments))
            finish = ch.finish_reason or finish
    return parts, finish


def check_chat_stream(parts, full_call, schema):
    # the first chunk: who is called, no arguments yet
    assert parts[0][0] == 0 and parts[0][1].startswith("call_") and parts[0][2] == "function"
    assert parts[0][3] == full_call.function.name and parts[0][4] == ""
    # then only fragments of the arguments, several of them
    frags = [p[4] for p in parts[1:]]
    assert all(p[0] == 0 and p[1] is None and p[3] is None for p in parts[1:]), parts
    assert len(frags) >= 3 and all(frags), frags
    assert "".join(frags) == full_call.function.arguments
    jsonschema.validate(json.loads("".join(frags)), schema)


@pytest.mark.parametrize("name", MARKUPS)
def test_chat_arguments_stream(instances, name):
    _, _, cl = with_template(instances, name)
    for seed in range(2):
        kw = dict(model=TOOL_MODEL_NAME, messages=MSGS, tools=TOOLS, tool_choice=NAMED, temperature=1, seed=seed,
                  max_tokens=200, parallel_tool_calls=False)
        full = cl.chat.completions.create(**kw).choices[0]
        assert full.finish_reason == "tool_calls" and len(full.message.tool_calls) == 1
        parts, finish = chat_stream(cl, **kw)
        assert finish == "tool_calls"
        check_chat_stream(parts, full.message.tool_calls[0], ORDER)


def test_chat_arguments_stream_harmony(instances):
    cl = test_harmony.server(instances)
    tools = [t for t in test_harmony.TOOLS if t["function"]["name"] == "get_weather"]
    kw = dict(model=test_harmony.NAME, messages=test_harmony.MSGS, tools=tools, max_tokens=64, temperature=1,
              seed=4, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    full = cl.chat.completions.create(**kw).choices[0]
    assert full.finish_reason == "tool_calls"
    parts, finish = chat_stream(cl, **kw)
    assert finish == "tool_calls"
    check_chat_stream(parts, full.message.tool_calls[0], tools[0]["function"]["parameters"])


# Two calls in Hermes markup, forced by a grammar (tool_choice auto reads them).
TWO_CALLS = ('root ::= "<tool_call>\\n{\\"name\\": \\"order\\", \\"arguments\\": {\\"item\\": \\"" [a-z]{6,10} '
             '"\\", \\"count\\": " [1-9] [0-9]{2,4} "}}\\n</tool_call>\\n<tool_call>\\n{\\"name\\": \\"order\\", '
             '\\"arguments\\": {\\"note\\": \\"" [a-z]{4,9} " " [a-z]{4,9} "\\"}}\\n</tool_call>"')


def test_chat_parallel_calls_stream_in_order(instances):
    # several calls: each starts (its own index, id, name) after the previous one's
    # arguments are done, and each one's fragments add up to its non-streamed call
    _, _, cl = with_template(instances, "Qwen-Qwen2.5-7B-Instruct.jinja")
    for seed in range(2):
        kw = dict(model=TOOL_MODEL_NAME, messages=MSGS, tools=TOOLS, temperature=1, seed=seed, max_tokens=200,
                  extra_body={"grammar": TWO_CALLS})
        full = cl.chat.completions.create(**kw).choices[0]
        assert full.finish_reason == "tool_calls" and len(full.message.tool_calls) == 2, full
        parts, finish = chat_stream(cl, **kw)
        assert finish == "tool_calls"
        calls, n_frags = {}, 0
        for index, cid, _, name, args in parts:
            if cid is not None:
                assert index == len(calls) and args == "", parts   # a new call, in order
                calls[index] = [name, ""]
            else:
                assert index == len(calls) - 1 and args, parts     # the open call's fragments
                calls[index][1] += args
                n_frags += 1
        assert [calls[i] for i in range(len(calls))] == \
            [[c.function.name, c.function.arguments] for c in full.message.tool_calls]
        assert n_frags >= 6
        for c in full.message.tool_calls:
            json.loads(c.function.arguments)


def test_responses_arguments_stream(instances):
    _, _, cl = with_template(instances, "Qwen-Qwen2.5-7B-Instruct.jinja")
    tools = [{"type": "function", "name": "order", "parameters": ORDER}]
    kw = dict(model=TOOL_MODEL_NAME, input="Order ten lamps.", tools=tools, temperature=1,
              tool_choice={"type": "function", "name": "order"}, max_output_tokens=200, parallel_tool_calls=False,
              extra_body={"seed": 7})
    full = [o for o in cl.responses.create(**kw).output if o.type == "function_call"]
    types, deltas, done, item_done, final, added = [], [], None, None, None, None
    for ev in cl.responses.create(stream=True, **kw):
        types.append(ev.type)
        if ev.type == "response.output_item.added" and ev.item.type == "function_call":
            added = ev.item
        if ev.type == "response.function_call_arguments.delta":
            assert ev.item_id == added.id
            deltas.append(ev.delta)
        if ev.type == "response.function_call_arguments.done":
            done = ev
        if ev.type == "response.output_item.done" and ev.item.type == "function_call":
            item_done = ev.item
        if ev.type == "response.completed":
            final = ev.response
    assert added.name == "order" and added.arguments == "" and added.status == "in_progress"
    assert len(deltas) >= 3 and all(deltas), deltas
    args = "".join(deltas)
    assert done.arguments == args and item_done.arguments == args and item_done.status == "completed"
    assert item_done.call_id == added.call_id and item_done.id == added.id
    fc = [o for o in final.output if o.type == "function_call"]
    assert len(fc) == 1 and fc[0].arguments == args and args == full[0].arguments
    jsonschema.validate(json.loads(args), ORDER)
    first, last = types.index("response.function_call_arguments.delta"), \
        len(types) - 1 - types[::-1].index("response.function_call_arguments.delta")
    assert types.index("response.output_item.added") < first
    assert last < types.index("response.function_call_arguments.done") < types.index("response.output_item.done")
    # the SDK's stream helper checks the events' order and identities as it goes
    with cl.responses.stream(**kw) as s:
        helper = s.get_final_response()
    assert [o.arguments for o in helper.output if o.type == "function_call"] == [args]


def test_messages_input_json_streams(instances):
    _, base, _ = with_template(instances, "Qwen-Qwen2.5-7B-Instruct.jinja")
    claude = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0, timeout=60)
    tools = [{"name": "order", "description": "Order something", "input_schema": ORDER}]
    kw = dict(model=TOOL_MODEL_NAME, max_tokens=200, tools=tools, messages=[{"role": "user", "content": "Lamps."}],
              tool_choice={"type": "tool", "name": "order"}, extra_body={"seed": 5, "temperature": 1})
    full = [b for b in claude.messages.create(**kw).content if b.type == "tool_use"]
    partial = []
    with claude.messages.stream(**kw) as s:
        for ev in s:
            if ev.type == "content_block_start" and ev.content_block.type == "tool_use":
                assert ev.content_block.name == "order" and ev.content_block.input == {}
            if ev.type == "content_block_delta" and ev.delta.type == "input_json_delta":
                partial.append(ev.delta.partial_json)
        final = s.get_final_message()
    use = [b for b in final.content if b.type == "tool_use"]
    assert len(partial) >= 3 and all(partial), partial
    assert json.loads("".join(partial)) == use[0].input == full[0].input
    assert final.stop_reason == "tool_use"
    jsonschema.validate(use[0].input, ORDER)


class Order(pydantic.BaseModel):
    item: str = pydantic.Field(min_length=6, max_length=10)
    count: int = pydantic.Field(ge=100, le=99999)
    express: bool
    note: Literal["leave at the door", "call on arrival"]


def test_sdk_stream_helper_parses_each_prefix(instances):
    # The SDK's chat stream helper parses the arguments after every fragment (partial
    # JSON) and, for a strict pydantic tool, into the model at the end: each prefix
    # must be a JSON prefix and the whole an Order.
    _, _, cl = with_template(instances, "Qwen-Qwen2.5-7B-Instruct.jinja")
    tool = openai.pydantic_function_tool(Order, name="order")
    deltas, snapshots = [], []
    with cl.chat.completions.stream(model=TOOL_MODEL_NAME, messages=MSGS, tools=[tool], temperature=1, seed=3,
                                    max_tokens=200, tool_choice={"type": "function", "function": {"name": "order"}},
                                    parallel_tool_calls=False) as s:
        for ev in s:
            if ev.type == "tool_calls.function.arguments.delta":
                deltas.append(ev.arguments_delta)
                snapshots.append(ev.parsed_arguments)
            if ev.type == "tool_calls.function.arguments.done":
                done = ev
        final = s.get_final_completion()
    call = final.choices[0].message.tool_calls[0]
    assert len(deltas) >= 3 and "".join(deltas) == call.function.arguments == done.arguments
    assert isinstance(call.function.parsed_arguments, Order) and isinstance(done.parsed_arguments, Order)
    # the partial parses grow: each snapshot's keys are a prefix of the next one's
    keys = [list(p or {}) for p in snapshots]
    assert all(a == b[:len(a)] for a, b in zip(keys, keys[1:])) and keys[-1] == list(Order.model_fields)
