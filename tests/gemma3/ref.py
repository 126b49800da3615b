#!/usr/bin/env python3
"""Independent Gemma 3 reference: a NumPy forward pass over a GGUF file.

Shares no code with the engine: the weights are dequantized by the `gguf` Python
package, the prompts are tokenized by the `sentencepiece` Python package (with a model
proto built here from the GGUF vocabulary), and the transformer is written out below
in float64 from the Gemma 3 definition:

  x0 = embed[token] * sqrt(n_embd)
  per layer: h = x + post_attn_norm(attn(attn_norm(x)));  x = h + post_ffw_norm(ffn(ffn_norm(h)))
  attn: per-head RMSNorm of Q and K, NeoX RoPE (local layers base 10000, global layers
        <arch>.rope.freq_base), local layers see the last `sliding_window` positions,
        every 6th layer (5, 11, ...) is global; scale 1/sqrt(key_length)
  ffn:  down(gelu_tanh(gate x) * up x)
  logits = embed . output_norm(x)   (tied head)

Writes the reference in the format of ../shared/models/README.md: one entry per
prompt with the prompt tokens and, per greedy step, the top-5 natural-log
probabilities. Usage:

  ref.py MODEL.gguf OUT.json [--steps N]
"""
import argparse
import json
import math
import sys
import time

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
from sentencepiece import SentencePieceProcessor
from sentencepiece import sentencepiece_model_pb2 as spm_pb

ARCH = "gemma3"
SWA_PERIOD = 6           # Gemma 3: layers 5, 11, 17, ... use global attention
LOCAL_ROPE_BASE = 10000.0


def field(r, key, default=None):
    f = r.fields.get(key)
    if f is None:
        return default
    return f.contents()


class Gemma3:
    def __init__(self, path):
        r = GGUFReader(path)
        self.r = r
        assert field(r, "general.architecture") == ARCH
        a = ARCH + "."
        self.dim = int(field(r, a + "embedding_length"))
        self.n_layers = int(field(r, a + "block_count"))
        self.n_heads = int(field(r, a + "attention.head_count"))
        self.n_kv = int(field(r, a + "attention.head_count_kv", self.n_heads))
        self.hd = int(field(r, a + "attention.key_length", self.dim // self.n_heads))
        self.eps = float(field(r, a + "attention.layer_norm_rms_epsilon"))
        self.base_global = float(field(r, a + "rope.freq_base", 10000.0))
        self.window = int(field(r, a + "attention.sliding_window"))
        assert field(r, a + "rope.scaling.type") in (None, "none"), "RoPE scaling not handled here"
        self.softcap = field(r, a + "final_logit_softcapping")
        self.tensors = {t.name: t for t in r.tensors}
        self.embd = self.mat("token_embd.weight")           # [vocab, dim]
        self.out = self.mat("output.weight") if "output.weight" in self.tensors else self.embd
        self.out_norm = self.vec("output_norm.weight")
        self.layers = []
        for l in range(self.n_layers):
            p = "blk.%d." % l
            self.layers.append({
                "attn_norm": self.vec(p + "attn_norm.weight"),
                "q_norm": self.vec(p + "attn_q_norm.weight"),
                "k_norm": self.vec(p + "attn_k_norm.weight"),
                "post_attn_norm": self.vec(p + "post_attention_norm.weight"),
                "ffn_norm": self.vec(p + "ffn_norm.weight"),
                "post_ffw_norm": self.vec(p + "post_ffw_norm.weight"),
                "wq": self.mat(p + "attn_q.weight"),
                "wk": self.mat(p + "attn_k.weight"),
                "wv": self.mat(p + "attn_v.weight"),
                "wo": self.mat(p + "attn_output.weight"),
                "gate": self.mat(p + "ffn_gate.weight"),
                "up": self.mat(p + "ffn_up.weight"),
                "down": self.mat(p + "ffn_down.weight"),
                "local": (l + 1) % SWA_PERIOD != 0,
            })

    def _deq(self, name):
        t = self.tensors[name]
        ne = [int(x) for x in t.shape]                      # ne[0] is the row length
        w = dequantize(t.data, t.tensor_type).astype(np.float64)
        return w.reshape(list(reversed(ne)))

    def mat(self, name):
        w = self._deq(name)
        assert w.ndim == 2, name
        return w                                           # [rows (out), cols (in)]

    def vec(self, name):
        return self._deq(name).reshape(-1)

    def rmsnorm(self, x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    def rope(self, x, pos, base):
        # x [T, heads, hd]; NeoX: dims i and i + hd/2 rotate together.
        half = self.hd // 2
        inv = base ** (-2.0 * np.arange(half) / self.hd)
        ang = np.asarray(pos, dtype=np.float64)[:, None] * inv[None, :]
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        x0, x1 = x[..., :half], x[..., half:]
        return np.concatenate([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1)

    def new_cache(self):
        return [{"k": np.zeros((0, self.n_kv, self.hd)), "v": np.zeros((0, self.n_kv, self.hd))}
                for _ in range(self.n_layers)]

    def forward(self, tokens, pos0, cache):
        """Logits of every token of `tokens`, placed at positions pos0.. after the cache."""
        T = len(tokens)
        pos = np.arange(pos0, pos0 + T)
        x = self.embd[tokens] * math.sqrt(self.dim)
        group = self.n_heads // self.n_kv
        scale = 1.0 / math.sqrt(self.hd)
        for l, L in enumerate(self.layers):
            h = self.rmsnorm(x, L["attn_norm"])
            q = (h @ L["wq"].T).reshape(T, self.n_heads, self.hd)
            k = (h @ L["wk"].T).reshape(T, self.n_kv, self.hd)
            v = (h @ L["wv"].T).reshape(T, self.n_kv, self.hd)
            q = self.rmsnorm(q, L["q_norm"])
            k = self.rmsnorm(k, L["k_norm"])
            base = LOCAL_ROPE_BASE if L["local"] else self.base_global
            q = self.rope(q, pos, base)
            k = self.rope(k, pos, base)
            c = cache[l]
            c["k"] = np.concatenate([c["k"], k])
            c["v"] = np.concatenate([c["v"], v])
            S = c["k"].shape[0]
            kpos = np.arange(S)
            allowed = kpos[None, :] <= pos[:, None]
            if L["local"]:
                allowed &= (pos[:, None] - kpos[None, :]) < self.window
            out = np.empty((T, self.n_heads, self.hd))
            for hh in range(self.n_heads):
                kh = c["k"][:, hh // group, :]
                vh = c["v"][:, hh // group, :]
                sc = (q[:, hh, :] @ kh.T) * scale
                sc = np.where(allowed, sc, -np.inf)
                sc -= sc.max(axis=-1, keepdims=True)
                p = np.exp(sc)
                p /= p.sum(axis=-1, keepdims=True)
                out[:, hh, :] = p @ vh
            o = out.reshape(T, -1) @ L["wo"].T
            x = x + self.rmsnorm(o, L["post_attn_norm"])
            h = self.rmsnorm(x, L["ffn_norm"])
            g = h @ L["gate"].T
            u = h @ L["up"].T
            gelu = 0.5 * g * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g ** 3)))
            d = (gelu * u) @ L["down"].T
            x = x + self.rmsnorm(d, L["post_ffw_norm"])
        return x

    def logits(self, x_last):
        y = self.rmsnorm(x_last, self.out_norm) @ self.out.T
        if self.softcap:
            y = self.softcap * np.tanh(y / self.softcap)
        return y


def spm_from_gguf(r):
    """A SentencePiece BPE model proto from the GGUF vocabulary (scores as merge ranks)."""
    f = r.fields["tokenizer.ggml.tokens"]
    tokens = [bytes(f.parts[i]).decode("utf-8", errors="surrogateescape") for i in f.data]
    sf = r.fields["tokenizer.ggml.scores"]
    scores = [float(sf.parts[i][0]) for i in sf.data]
    tf = r.fields["tokenizer.ggml.token_type"]
    types = [int(tf.parts[i][0]) for i in tf.data]
    m = spm_pb.ModelProto()
    for tok, sc, ty in zip(tokens, scores, types):
        p = m.pieces.add()
        p.piece = tok
        p.score = sc
        # GGUF token types: 1 normal, 2 unknown, 3 control, 4 user defined, 5 unused, 6 byte
        p.type = {1: p.NORMAL, 2: p.UNKNOWN, 3: p.CONTROL, 4: p.USER_DEFINED, 5: p.UNUSED, 6: p.BYTE}[ty]
    ts = m.trainer_spec
    ts.model_type = ts.BPE
    ts.vocab_size = len(tokens)
    ts.byte_fallback = True
    ts.allow_whitespace_only_pieces = True
    ts.unk_id = int(field(r, "tokenizer.ggml.unknown_token_id", 3))
    ts.bos_id = int(field(r, "tokenizer.ggml.bos_token_id"))
    ts.eos_id = int(field(r, "tokenizer.ggml.eos_token_id"))
    ts.pad_id = int(field(r, "tokenizer.ggml.padding_token_id", -1))
    ns = m.normalizer_spec
    ns.name = "identity"
    ns.add_dummy_prefix = bool(field(r, "tokenizer.ggml.add_space_prefix", True))
    ns.remove_extra_whitespaces = False
    ns.escape_whitespaces = True
    sp = SentencePieceProcessor()
    sp.LoadFromSerializedProto(m.SerializeToString())
    return sp


LONG_TEXT = (
    "The lighthouse keeper kept a logbook of every ship that passed the point. "
    "In spring the fishing boats came first, low in the water and loud with gulls; "
    "in summer the ferries crossed twice a day, and in autumn the grain barges moved "
    "slowly south before the river froze. She wrote the name of each vessel, the hour, "
    "the wind, and a word about the sea. Over forty years the book grew into twelve "
    "volumes, and the harbour office asked to copy them, because no other record "
    "showed so clearly how the traffic of the coast had changed. "
)


def prompts():
    long = " ".join("Chapter %d. %s" % (i + 1, LONG_TEXT) for i in range(6))
    long += "In the last volume, the final entry says that"
    return [
        "The capital of France is",
        "Water boils at a temperature of",
        "Once upon a time, there was a little girl who",
        long,
    ]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    t0 = time.time()
    m = Gemma3(args.model)
    sp = spm_from_gguf(m.r)
    bos = int(field(m.r, "tokenizer.ggml.bos_token_id"))
    add_bos = bool(field(m.r, "tokenizer.ggml.add_bos_token", True))
    print("loaded in %.1fs" % (time.time() - t0), file=sys.stderr)
    entries = []
    for text in prompts():
        toks = ([bos] if add_bos else []) + sp.encode(text)
        cache = m.new_cache()
        x = m.forward(toks, 0, cache)
        pos = len(toks)
        steps, gen = [], []
        for s in range(args.steps):
            y = m.logits(x[-1])
            lp = y - y.max()
            lp = lp - math.log(np.exp(lp).sum())
            top = np.argsort(-lp, kind="stable")[:5]
            tok = int(top[0])
            steps.append({"token": tok, "top": [[int(t), round(float(lp[t]), 6)] for t in top]})
            gen.append(tok)
            if s + 1 < args.steps:
                x = m.forward([tok], pos, cache)
                pos += 1
        text_out = sp.decode(gen)
        entries.append({"prompt": text, "prompt_tokens": toks, "steps": steps,
                        "text_hex": text_out.encode("utf-8").hex()})
        print("%d prompt tokens -> %r (%.1fs)" % (len(toks), text_out, time.time() - t0), file=sys.stderr)
    with open(args.out, "w") as f:
        f.write("[\n" + ",\n".join(json.dumps(e) for e in entries) + "\n]\n")


if __name__ == "__main__":
    main()
