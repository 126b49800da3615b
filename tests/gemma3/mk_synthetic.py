#!/usr/bin/env python3
"""A small random-weight Gemma 3 GGUF with the real architecture's features.

Written with the `gguf` Python package's GGUFWriter only (no engine code), for the
teacher-forced GPU check against ref.py where the real model cannot travel:

  - gemma3 metadata laid out as in gemma-3-270m (no rope.freq_base_swa, no
    sliding_window_pattern: the Gemma 3 defaults apply, local base 10000, every 6th
    layer global), global rope.freq_base 1e6, head_dim (key_length) 256 with 4 query
    heads and 1 KV head, a small sliding window;
  - per-head Q/K norms, pre and post attention/FFN norms, GeGLU, tied embedding;
  - a SentencePiece vocabulary: the first --vocab pieces of a real Gemma 3 GGUF's
    vocabulary (control, user-defined and byte tokens, then the highest-ranked BPE
    pieces, which is closed under merges), with its tokenizer flags;
  - weights in the types of the Q4_K_M file (Q8_0 embedding, Q5_0, Q8_0, Q4_K, Q6_K),
    plus an F16 and an F32 matrix, built as random blocks directly in each format's
    byte layout (so no quantizer is needed); norms F32.

Usage: mk_synthetic.py VOCAB_SOURCE.gguf OUT.gguf [--layers N] [--window W] [--vocab V] [--seed S]
"""
import argparse

import numpy as np
from gguf import GGUFReader, GGUFWriter, GGMLQuantizationType as QT

rng = None


def f16(x):
    return np.asarray(x, dtype=np.float16).view(np.uint8)


def q8_0(rows, cols, std):
    nb = rows * cols // 32
    d = np.full(nb, std * np.sqrt(3.0) / 127.0)
    qs = rng.integers(-127, 128, size=(nb, 32), dtype=np.int8).view(np.uint8)
    return np.concatenate([f16(d).reshape(nb, 2), qs], axis=1).reshape(rows, -1), QT.Q8_0


def q5_0(rows, cols, std):
    nb = rows * cols // 32
    d = np.full(nb, std / 9.23)             # q - 16, q uniform on 0..31: std 9.23
    qh = rng.integers(0, 256, size=(nb, 4), dtype=np.uint8)
    qs = rng.integers(0, 256, size=(nb, 16), dtype=np.uint8)
    return np.concatenate([f16(d).reshape(nb, 2), qh, qs], axis=1).reshape(rows, -1), QT.Q5_0


def q4_k(rows, cols, std):
    nb = rows * cols // 256
    sc = rng.integers(24, 64, size=(nb, 8))
    m = np.minimum(63, np.round(sc * 7.5 / 8.0)).astype(np.int64)   # dmin = 8 d: mean near 0
    d = std / (np.mean(sc) * 4.6)          # q uniform on 0..15: std 4.6
    packed = np.zeros((nb, 12), dtype=np.uint8)
    for j in range(4):
        packed[:, j] = (sc[:, j] & 63) | ((sc[:, j + 4] >> 4) << 6)
        packed[:, j + 4] = (m[:, j] & 63) | ((m[:, j + 4] >> 4) << 6)
        packed[:, j + 8] = (sc[:, j + 4] & 0xF) | ((m[:, j + 4] & 0xF) << 4)
    qs = rng.integers(0, 256, size=(nb, 128), dtype=np.uint8)
    dd = f16(np.full(nb, d)).reshape(nb, 2)
    dm = f16(np.full(nb, 8 * d)).reshape(nb, 2)
    return np.concatenate([dd, dm, packed, qs], axis=1).reshape(rows, -1), QT.Q4_K


def q6_k(rows, cols, std):
    nb = rows * cols // 256
    ql = rng.integers(0, 256, size=(nb, 128), dtype=np.uint8)
    qh = rng.integers(0, 256, size=(nb, 64), dtype=np.uint8)
    sc = rng.integers(16, 64, size=(nb, 16)) * rng.choice([-1, 1], size=(nb, 16))
    d = std / (np.mean(np.abs(sc)) * 18.5)  # q - 32, q uniform on 0..63: std 18.5
    return np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), f16(np.full(nb, d)).reshape(nb, 2)],
                          axis=1).reshape(rows, -1), QT.Q6_K


def f16m(rows, cols, std):
    return (rng.standard_normal((rows, cols)) * std).astype(np.float16), None


def f32m(rows, cols, std):
    return (rng.standard_normal((rows, cols)) * std).astype(np.float32), None


def main():
    global rng
    ap = argparse.ArgumentParser()
    ap.add_argument("vocab_source")
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--seed", type=int, default=3)
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    dim, ffn, n_head, n_kv, hd = a.dim, a.ffn, 4, 1, 256

    src = GGUFReader(a.vocab_source)
    sf = src.fields
    toks = [bytes(sf["tokenizer.ggml.tokens"].parts[i]) for i in sf["tokenizer.ggml.tokens"].data][:a.vocab]
    scores = [float(sf["tokenizer.ggml.scores"].parts[i][0]) for i in sf["tokenizer.ggml.scores"].data][:a.vocab]
    types = [int(sf["tokenizer.ggml.token_type"].parts[i][0]) for i in sf["tokenizer.ggml.token_type"].data][:a.vocab]

    w = GGUFWriter(a.out, "gemma3")
    w.add_name("Gemma 3 synthetic (random weights)")
    A = "gemma3."
    w.add_uint32(A + "context_length", 4096)
    w.add_uint32(A + "embedding_length", dim)
    w.add_uint32(A + "block_count", a.layers)
    w.add_uint32(A + "feed_forward_length", ffn)
    w.add_uint32(A + "attention.head_count", n_head)
    w.add_float32(A + "attention.layer_norm_rms_epsilon", 1e-6)
    w.add_uint32(A + "attention.key_length", hd)
    w.add_uint32(A + "attention.value_length", hd)
    w.add_float32(A + "rope.freq_base", 1000000.0)
    w.add_uint32(A + "attention.sliding_window", a.window)
    w.add_uint32(A + "attention.head_count_kv", n_kv)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(toks)
    w.add_token_scores(scores)
    w.add_token_types(types)
    for k in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id"):
        w.add_uint32("tokenizer.ggml." + k, int(sf["tokenizer.ggml." + k].contents()))
    for k in ("add_bos_token", "add_eos_token", "add_space_prefix"):
        w.add_bool("tokenizer.ggml." + k, bool(sf["tokenizer.ggml." + k].contents()))

    def mat(name, maker, rows, cols, std):
        data, qt = maker(rows, cols, std)
        if qt is None:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=qt)

    def vec(name, n, mean, std):
        w.add_tensor(name, (mean + std * rng.standard_normal(n)).astype(np.float32))

    mat("token_embd.weight", q8_0, a.vocab, dim, 0.05)
    vec("output_norm.weight", dim, 3.0, 0.5)
    for l in range(a.layers):
        p = "blk.%d." % l
        vec(p + "attn_norm.weight", dim, 1.0, 0.2)
        vec(p + "attn_q_norm.weight", hd, 1.3, 0.2)
        vec(p + "attn_k_norm.weight", hd, 1.3, 0.2)
        vec(p + "post_attention_norm.weight", dim, 1.5, 0.3)
        vec(p + "ffn_norm.weight", dim, 1.0, 0.2)
        vec(p + "post_ffw_norm.weight", dim, 1.5, 0.3)
        mat(p + "attn_q.weight", q5_0, n_head * hd, dim, 0.06)
        mat(p + "attn_k.weight", q5_0, n_kv * hd, dim, 0.06)
        mat(p + "attn_v.weight", q8_0 if l % 2 == 0 else q5_0, n_kv * hd, dim, 0.06)
        mat(p + "attn_output.weight", f32m if l == 3 else q4_k, dim, n_head * hd, 0.03)
        mat(p + "ffn_gate.weight", q5_0, ffn, dim, 0.1)
        mat(p + "ffn_up.weight", f16m if l == 2 else q5_0, ffn, dim, 0.1)
        mat(p + "ffn_down.weight", q6_k if l % 2 == 0 else q4_k, dim, ffn, 0.05)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
