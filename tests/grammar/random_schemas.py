#!/usr/bin/env python3
"""Prints a JSON array of N random schemas built from the keywords the compiler supports
(engine/grammar/json_schema.c): the fuzz half of tests/cli/json_schema.sh."""
import json
import random
import sys

n, seed = int(sys.argv[1]), int(sys.argv[2])
rnd = random.Random(seed)
WORDS = ["id", "name", "x", "y", "tags", "kind", "é", "a b", "q\"t", "n"]


def scalar(depth):
    t = rnd.choice(["string", "integer", "number", "boolean", "null", "enum", "const", "format", "pattern"])
    if t == "string":
        s = {"type": "string"}
        if rnd.random() < 0.5:
            lo = rnd.randint(0, 4)
            s["minLength"] = lo
            if rnd.random() < 0.5:
                s["maxLength"] = lo + rnd.randint(0, 6)
        return s
    if t in ("integer", "number"):
        s = {"type": t}
        if rnd.random() < 0.6:
            lo = rnd.randint(-500, 500)
            s["minimum"] = lo
            if rnd.random() < 0.7:
                s["maximum"] = lo + rnd.randint(0, 3000)
        elif rnd.random() < 0.3:
            s["exclusiveMaximum"] = rnd.randint(-50, 50)
        return s
    if t == "enum":
        return {"enum": rnd.sample([1, -2.5, "a", "b\"c", None, True, [1], {"k": "v"}], rnd.randint(1, 4))}
    if t == "const":
        return {"const": rnd.choice([0, "fixed", None, {"a": [True]}])}
    if t == "format":
        return {"type": "string", "format": rnd.choice(["date", "date-time", "time", "uuid", "email"])}
    if t == "pattern":
        return {"type": "string", "pattern": rnd.choice(["^[a-f0-9]{4,8}$", "^(ab|cd)*x?$", "^\\d{3}-\\w+$",
                                                         "^[^,]{1,5}$", "^a.b$", "^(x|y)+(z{2})?$"])}
    return {"type": t}


def schema(depth=0):
    r = rnd.random()
    if depth >= 3 or r < 0.35:
        return scalar(depth)
    if r < 0.6:
        props = {}
        for w in rnd.sample(WORDS, rnd.randint(0, 4)):
            props[w] = schema(depth + 1)
        s = {"type": "object", "properties": props}
        req = [k for k in props if rnd.random() < 0.5]
        if req:
            s["required"] = req
        s["additionalProperties"] = rnd.choice([False, True]) if rnd.random() < 0.7 else schema(depth + 1)
        if props and not isinstance(s["additionalProperties"], bool):
            s["additionalProperties"] = False
        return s
    if r < 0.8:
        s = {"type": "array", "items": schema(depth + 1)}
        if rnd.random() < 0.5:
            lo = rnd.randint(0, 3)
            s["minItems"] = lo
            if rnd.random() < 0.6:
                s["maxItems"] = lo + rnd.randint(0, 3)
        return s
    if r < 0.9:
        # branches of different types: oneOf stays exclusive
        kinds = rnd.sample(["string", "integer", "boolean", "null", "array"], rnd.randint(1, 3))
        return {rnd.choice(["anyOf", "oneOf"]): [{"type": k} for k in kinds]}
    if depth == 0:  # "#/$defs/..." resolves against the document root
        return {"$defs": {"item": scalar(depth)}, "type": "array", "items": {"$ref": "#/$defs/item"}}
    return scalar(depth)


print(json.dumps([schema() for _ in range(n)]))
