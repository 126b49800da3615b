#!/usr/bin/env python3
"""Reference rendering of chat templates with Python's jinja2, configured the way
Hugging Face transformers' apply_chat_template configures it:
ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True) with the
loopcontrols extension and a {% generation %} tag, tojson overridden by
json.dumps(x, ensure_ascii=False, indent=indent), globals raise_exception and
strftime_now (fixed here to 2024-07-26 00:00 UTC so renderings are reproducible;
the C side injects the same instant through m40_jinja_limits.now).

usage: render.py TEMPLATE CONV.json [CONV.json ...]
For each conversation writes "OK <nbytes>\\n<rendered bytes>" or
"ERR <nbytes>\\n<message bytes>" to stdout. Exit 77 when jinja2 is missing.

A conversation file is a JSON object: messages, tools (optional; None when absent,
as HF passes), add_generation_prompt, bos_token, eos_token, extra (optional object
of further template variables), openai (optional: the messages are as an OpenAI
client sends them, tool_calls[].function.arguments JSON text; rendered as vLLM
does, with the arguments as objects, and as the text when the template refuses
the objects: what m40's request path does, engine/template/chat_args.c; for a
harmony template, containing "<|channel|>", reasoning_content becomes thinking and
a null content goes first, as harmony_messages says)."""
import copy
import json
import sys
from datetime import datetime, timezone

try:
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment
except ImportError:
    sys.stderr.write("jinja2 is not installed\n")
    sys.exit(77)

FIXED_NOW = datetime(2024, 7, 26, 0, 0, 0, tzinfo=timezone.utc)


class TemplateError(Exception):
    pass


class GenerationTag(Extension):
    """{% generation %}...{% endgeneration %}: rendered as its body inside a call
    block, which is how HF's AssistantTracker emits it."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def raise_exception(message):
    raise TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(fmt):
    return FIXED_NOW.strftime(fmt)


def arguments_as_objects(messages):
    """A copy with each tool call's arguments text that holds a JSON object parsed,
    or None when there is none."""
    out, any_ = copy.deepcopy(messages), False
    for m in out:
        for c in m.get("tool_calls") or []:
            args = (c.get("function") or {}).get("arguments")
            if isinstance(args, str):
                try:
                    v = json.loads(args)
                except ValueError:
                    continue
                if isinstance(v, dict):
                    c["function"]["arguments"] = v
                    any_ = True
    return out if any_ else None


def harmony_messages(messages):
    """engine/template/chat_args.c's m40_chat_harmony_messages: for gpt-oss's template, on
    assistant turns with tool_calls a null content goes, and reasoning_content becomes
    thinking where there is none and no content. None when nothing changes."""
    out, any_ = copy.deepcopy(messages), False
    for m in out:
        if m.get("role") != "assistant" or not isinstance(m.get("tool_calls"), list) or not m["tool_calls"]:
            continue
        r, c = m.get("reasoning_content"), m.get("content", None)
        if isinstance(r, str) and r and "thinking" not in m and not (isinstance(c, str) and c):
            m["thinking"] = r
            any_ = True
        if "content" in m and m["content"] is None:
            del m["content"]
            any_ = True
    return out if any_ else None


def main():
    if len(sys.argv) < 3:
        sys.stderr.write(__doc__)
        return 2
    with open(sys.argv[1], encoding="utf-8") as f:
        source = f.read()
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    out = sys.stdout.buffer
    try:
        template = env.from_string(source)
    except Exception as e:  # a parse error applies to every conversation
        template = None
        parse_error = f"{type(e).__name__}: {e}"
    for conv_path in sys.argv[2:]:
        with open(conv_path, encoding="utf-8") as f:
            conv = json.load(f)
        try:
            if template is None:
                raise TemplateError(parse_error)
            variables = dict(conv.get("extra", {}))
            variables.update(
                messages=conv["messages"],
                tools=conv.get("tools"),
                add_generation_prompt=conv.get("add_generation_prompt", False),
                bos_token=conv.get("bos_token", ""),
                eos_token=conv.get("eos_token", ""),
            )
            if conv.get("openai") and "<|channel|>" in source:
                variables["messages"] = harmony_messages(conv["messages"]) or conv["messages"]
            objs = arguments_as_objects(variables["messages"]) if conv.get("openai") else None
            if objs is not None:
                try:
                    data = template.render(**dict(variables, messages=objs)).encode("utf-8")
                except Exception:
                    data = template.render(**variables).encode("utf-8")
            else:
                data = template.render(**variables).encode("utf-8")
            out.write(b"OK %d\n" % len(data) + data)
        except Exception as e:
            data = f"{type(e).__name__}: {e}".encode("utf-8", "backslashreplace")
            out.write(b"ERR %d\n" % len(data) + data)
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
