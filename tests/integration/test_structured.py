"""Structured outputs by constrained decoding: response_format (json_object, json_schema),
the "grammar" field, the SDK's chat.completions.parse with a Pydantic model, and 400s for
malformed schemas and grammars. The small shared model writes nonsense, sampled at
temperature 1 over several seeds: every answer must still parse and validate."""
import json
from enum import Enum
from typing import Annotated, Optional

import jsonschema
import openai
import pydantic
import pytest
import requests

PROMPT = [{"role": "user", "content": "Tell me about a cat as JSON."}]

# Bounded schemas: every sentence of their grammars ends within max_tokens, whatever the
# model prefers (an unbounded string could run to the length limit).
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 30}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -50, "maximum": 50}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
                                      "none": {"type": "null"}}, "required": ["color", "ok"]},
    {"anyOf": [{"type": "string", "maxLength": 5}, {"type": "integer", "minimum": 1, "maximum": 999}]},
    {"type": "string", "format": "date"},
    {"type": "string", "format": "uuid"},
    {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
    {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer", "maximum": 9, "minimum": 0},
                                                       "y": {"type": "integer", "maximum": 9, "minimum": 0}},
                      "required": ["x", "y"], "additionalProperties": False}},
     "type": "array", "items": {"$ref": "#/$defs/pt"}, "maxItems": 3},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                               "maxItems": 3},
                                      "score": {"type": "number", "minimum": 0, "maximum": 100}},
     "required": ["tags", "score"], "additionalProperties": False},
    {"const": {"fixed": [1, 2, 3]}},
]


def constrained(client, model, seed, **kw):
    kw.setdefault("messages", PROMPT)
    kw.setdefault("max_tokens", 400)
    return client.chat.completions.create(model=model, temperature=1.0, seed=seed, **kw)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_json_object(client, model, seed):
    r = constrained(client, model, seed, response_format={"type": "json_object"}, max_tokens=600)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # an unbounded object may meet the length limit: then it is a prefix of one
        assert r.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_json_schema_validates(client, model, i, seed):
    schema = SCHEMAS[i]
    r = constrained(client, model, seed,
                    response_format={"type": "json_schema",
                                     "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}})
    ch = r.choices[0]
    assert ch.finish_reason == "stop", ch.message.content
    doc = json.loads(ch.message.content)
    v = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    v.validate(doc)


def test_json_schema_long_enum(client, model, base_url):
    # An enum whose rule runs past 512 bytes, as array items (fuzz_grammar's finding: the
    # worker crashed on it): the answer is the enum's value, and the server is still up.
    word = "w" * 700
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": [word]},
                                                        "minItems": 1, "maxItems": 1}},
              "required": ["tags"], "additionalProperties": False}
    r = constrained(client, model, 1, max_tokens=600,
                    response_format={"type": "json_schema", "json_schema": {"name": "long", "schema": schema}})
    ch = r.choices[0]
    if ch.finish_reason == "stop":
        assert json.loads(ch.message.content) == {"tags": [word]}
    else:
        assert ch.message.content.startswith("{")
    assert requests.get(base_url + "/health", timeout=10).status_code == 200


def test_json_schema_stream_reassembles(client, model):
    schema = SCHEMAS[0]
    for seed in (4, 5):
        stream = constrained(client, model, seed, stream=True,
                             response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}})
        text, finish = "", None
        for c in stream:
            if c.choices:
                text += c.choices[0].delta.content or ""
                finish = c.choices[0].finish_reason or finish
        assert finish == "stop"
        jsonschema.validate(json.loads(text), schema)


def test_grammar_field(client, model):
    seen = set()
    for seed in range(1, 7):
        r = constrained(client, model, seed, extra_body={"grammar": 'root ::= ("yes" | "no") "!"{1,3}'})
        ch = r.choices[0]
        assert ch.finish_reason == "stop"
        assert ch.message.content.rstrip("!") in ("yes", "no") and 1 <= ch.message.content.count("!") <= 3
        seen.add(ch.message.content)
    assert len(seen) > 1  # temperature 1 explores the grammar


def test_grammar_on_completions(client, model):
    r = client.completions.create(model=model, prompt="Once upon a time", max_tokens=100, temperature=1.0,
                                  seed=7, extra_body={"grammar": 'root ::= [0-9]{3} " " [a-z]{2,4}'})
    text = r.choices[0].text
    assert r.choices[0].finish_reason == "stop"
    assert len(text.split(" ")[0]) == 3 and text.split(" ")[0].isdigit(), text


class Mood(str, Enum):
    happy = "happy"
    sleepy = "sleepy"


class Pet(pydantic.BaseModel):
    # small: the shared model's context is 128 tokens, prompt included
    name: str = pydantic.Field(max_length=6)
    legs: int = pydantic.Field(ge=0, le=8)
    mood: Mood
    nickname: Optional[Annotated[str, pydantic.StringConstraints(max_length=3)]]


def test_parse_pydantic(client, model):
    for seed in (1, 2, 3):
        r = client.chat.completions.parse(model=model, messages=PROMPT, response_format=Pet, temperature=1.0,
                                          seed=seed, max_tokens=400)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "stop", msg.content
        assert isinstance(msg.parsed, Pet)
        assert 0 <= msg.parsed.legs <= 8


def error_of(base_url, body):
    r = requests.post(base_url + "/v1/chat/completions", json=body, timeout=60)
    return r.status_code, r.json()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("extra,needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string",
                                                                                            "not": {}}}}},
     "unsupported JSON Schema keyword 'not'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frog"}}}},
     "unknown JSON Schema type 'frog'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}}},
     "points to nothing"),
    ({"grammar": "root ::= \"a\" | undefined_rule"}, "'undefined_rule' is used but not defined"),
    ({"grammar": "root ::= [a-"}, "grammar"),
    ({"grammar": "root ::= root \"x\""}, "left-recursive"),
])
def test_malformed_is_400(base_url, model, extra, needle, stream):
    body = {"model": model, "messages": PROMPT, "max_tokens": 8, "stream": stream, **extra}
    status, err = error_of(base_url, body)
    assert status == 400, err
    assert err["error"]["type"] == "invalid_request_error"
    assert needle in err["error"]["message"], err


@pytest.mark.parametrize("rf,param", [
    ({"type": "xml"}, "response_format.type"),
    ("json", "response_format"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"name": 3, "schema": {}}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "response_format.json_schema.schema"),
])
def test_malformed_response_format(base_url, model, rf, param):
    status, err = error_of(base_url, {"model": model, "messages": PROMPT, "response_format": rf})
    assert status == 400 and err["error"]["param"] == param, err


def test_grammar_with_response_format_is_400(base_url, model):
    status, err = error_of(base_url, {"model": model, "messages": PROMPT, "grammar": "root ::= \"a\"",
                                      "response_format": {"type": "json_object"}})
    assert status == 400 and err["error"]["param"] == "response_format", err
    status, err = error_of(base_url, {"model": model, "messages": PROMPT, "grammar": 5})
    assert status == 400 and err["error"]["param"] == "grammar", err


def test_sdk_raises_bad_request(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=PROMPT, max_tokens=8,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "x", "schema": {"type": "object", "patternProperties": {}}}})
    assert "patternProperties" in str(e.value)


def test_text_format_is_unconstrained(client, model):
    r = client.chat.completions.create(model=model, messages=PROMPT, max_tokens=8, temperature=0,
                                       response_format={"type": "text"})
    plain = client.chat.completions.create(model=model, messages=PROMPT, max_tokens=8, temperature=0)
    assert r.choices[0].message.content == plain.choices[0].message.content
