#!/usr/bin/env python3
"""Writes the small, valid GGUF files of fuzz_gguf's seed corpus (corpus/gguf): an SPM
and a byte-level BPE vocabulary with a chat template and one tensor, so that the fuzzer
starts past the header checks. Run it again after changing it; its output is committed."""
import os
import struct

T_U32, T_I32, T_F32, T_BOOL, T_STR, T_ARR = 4, 5, 6, 7, 8, 9


def s(x):
    b = x.encode()
    return struct.pack("<Q", len(b)) + b


def kv(key, t, v):
    out = s(key) + struct.pack("<I", t)
    if t == T_U32:
        out += struct.pack("<I", v)
    elif t == T_I32:
        out += struct.pack("<i", v)
    elif t == T_F32:
        out += struct.pack("<f", v)
    elif t == T_BOOL:
        out += struct.pack("<B", v)
    elif t == T_STR:
        out += s(v)
    else:
        et, items = v
        out += struct.pack("<IQ", et, len(items))
        for it in items:
            out += s(it) if et == T_STR else struct.pack({T_F32: "<f", T_I32: "<i"}[et], it)
    return out


def gguf(kvs, path):
    body = b"".join(kv(*x) for x in kvs)
    tensor = s("token_embd.weight") + struct.pack("<I", 2) + struct.pack("<QQ", 4, 2) + struct.pack("<IQ", 0, 0)
    head = b"GGUF" + struct.pack("<IQQ", 3, 1, len(kvs)) + body + tensor
    head += b"\0" * ((32 - len(head) % 32) % 32)
    with open(path, "wb") as f:
        f.write(head + struct.pack("<8f", *range(8)))


TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", "gguf")
os.makedirs(here, exist_ok=True)
spm = ["<unk>", "<s>", "</s>", "<|im_end|>", "\u2581", "\u2581a", "b", "\u2581ab", "<0x0A>", "<0xFF>"]
gguf([("general.architecture", T_STR, "llama"), ("llama.context_length", T_U32, 512),
      ("tokenizer.ggml.model", T_STR, "llama"), ("tokenizer.ggml.tokens", T_ARR, (T_STR, spm)),
      ("tokenizer.ggml.scores", T_ARR, (T_F32, [0.0, 0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -1.5, 0.0, 0.0])),
      ("tokenizer.ggml.token_type", T_ARR, (T_I32, [2, 3, 3, 3, 1, 1, 1, 1, 6, 6])),
      ("tokenizer.ggml.bos_token_id", T_U32, 1), ("tokenizer.ggml.eos_token_id", T_U32, 2),
      ("tokenizer.ggml.add_bos_token", T_BOOL, 1), ("tokenizer.chat_template", T_STR, TEMPLATE)],
     os.path.join(here, "spm.gguf"))
bpe = ["a", "b", "c", "\u0120", "\u0120a", "ab", "<|endoftext|>", "<|im_end|>"]
gguf([("general.architecture", T_STR, "qwen2"), ("tokenizer.ggml.model", T_STR, "gpt2"),
      ("tokenizer.ggml.pre", T_STR, "qwen2"), ("tokenizer.ggml.tokens", T_ARR, (T_STR, bpe)),
      ("tokenizer.ggml.token_type", T_ARR, (T_I32, [1, 1, 1, 1, 1, 1, 3, 3])),
      ("tokenizer.ggml.merges", T_ARR, (T_STR, ["\u0120 a", "a b"])),
      ("tokenizer.ggml.eos_token_id", T_U32, 6), ("tokenizer.chat_template", T_STR, TEMPLATE)],
     os.path.join(here, "bpe.gguf"))
