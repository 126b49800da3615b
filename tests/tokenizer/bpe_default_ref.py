#!/usr/bin/env python3
"""Expected token ids of llama.cpp's fallback ("default") BPE pre-tokenizer.

A byte-level BPE GGUF without `tokenizer.ggml.pre` (ggml-vocab-gpt-neox.gguf in
../shared/tokenizer is one) is tokenized by llama.cpp, and so by Ollama, with its
"default" pre-tokenizer. ../shared has no .inp/.out cases for such a file, so this
script derives them from the definition, sharing no code with engine/tokenizer/bpe.c:

  1. user-defined tokens (token_type 4: NeoX's whitespace runs) are cut out of the
     text first, longest token first, as llama.cpp does even when special tokens are
     not parsed; control tokens stay plain text;
  2. each remaining fragment goes through four regexes in turn; each splits every
     piece left by the previous one into its matches and the text between them
     (both kept, in order):
       [\\p{P}$+<=>^~|]+                  punctuation runs (no backtick)
       the GPT-2 regex                    's|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+|
                                          ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)
       \\p{N}+                             number runs lose their leading space
       [0-9][0-9][0-9]                    digit runs cut into threes from the left
  3. each piece is byte-mapped (GPT-2 bytes-to-unicode) and merged by the GGUF's
     tokenizer.ggml.merges, lowest rank first, leftmost first among equal ranks;
     a symbol that is no vocabulary token falls back to its byte tokens.

The regexes run on Python's `regex` module (pip install regex). The GGUF is read by
the few lines below. With --check, the ids are also compared with two other
implementations when they are installed: Hugging Face `tokenizers` (a BPE model with
the same four Split steps) and llama.cpp itself through `llama-cpp-python`
(vocab_only load, no special tokens added or parsed). --fuzz N adds N random strings
(letters, digits and punctuation of several scripts, whitespace runs, contractions) to
that comparison, and --m40 BIN compares `BIN tokenize --no-bos` too.

Usage (writes the C table that tests/unit/test_bpe.c includes):

  tests/tokenizer/bpe_default_ref.py ../shared/tokenizer/ggml-vocab-gpt-neox.gguf \\
      > tests/unit/bpe_default_cases.h
  tests/tokenizer/bpe_default_ref.py --check [--fuzz 2000 --m40 build/m40] \
      ../shared/tokenizer/ggml-vocab-gpt-neox.gguf
"""
import argparse
import json
import os
import random
import struct
import subprocess
import sys

import regex

# The cases: contractions, digit runs, punctuation and the symbols next to it, whitespace
# runs (NeoX has user-defined tokens for 2..24 spaces), CRLF, letters beyond ASCII,
# numbers beyond ASCII, emoji, curly quotes. Each is a Python str; the C table gets
# its UTF-8 bytes.
CASES = [
    "Hello world",
    "don't stop: I'm here, you're there; they'll've gone. DON'T",
    "12345 1234567 1 22 333 4444 0.5 1,000,000",
    "Price: $1,234.56 (approx.) <tag> a+b=c x^2 ~home |pipe| `code` 50%",
    "   leading spaces\n\n\ttabs  and   runs                              end   ",
    "line one\r\nline two\r\n\r\n",
    "Gr\u00fc\u00dfe aus K\u00f6ln, na\u00efve caf\u00e9 \u2014 d\u00e9j\u00e0 vu!",
    "\u041f\u0440\u0438\u0432\u0435\u0442 \u043c\u0438\u0440! \u039a\u03b1\u03bb\u03b7\u03bc\u03ad\u03c1\u03b1 "
    "\u03ba\u03cc\u03c3\u03bc\u03b5. \u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3002",
    "\u0663\u0664\u0665 and \u00bd and x\u00b2 and \u2167",
    "hello...world!!! ??? a--b __init__ {x}[y]",
    "emoji \U0001F999\U0001F999 and \u201cquotes\u201d \u00abguillemets\u00bb \u2018single\u2019",
    "x",
    "",
]

RE_STEPS = [
    r"[\p{P}\$\+<=>\^~\|]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
]


def read_gguf_kv(path):
    """The key/value section of a GGUF file (v2/v3), as a dict."""
    scalar = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
    with open(path, "rb") as f:
        data = f.read()
    pos = 0

    def take(fmt):
        nonlocal pos
        v = struct.unpack_from("<" + fmt, data, pos)[0]
        pos += struct.calcsize("<" + fmt)
        return v

    def string():
        nonlocal pos
        n = take("Q")
        s = data[pos:pos + n].decode("utf-8")
        pos += n
        return s

    def value(t):
        if t == 8:
            return string()
        if t == 9:
            et, n = take("I"), take("Q")
            return [value(et) for _ in range(n)]
        return take(scalar[t])

    if data[:4] != b"GGUF":
        sys.exit(f"{path}: not a GGUF file")
    pos = 4
    version, _n_tensors, n_kv = take("I"), take("Q"), take("Q")
    if version not in (2, 3):
        sys.exit(f"{path}: GGUF version {version}")
    kv = {}
    for _ in range(n_kv):
        k = string()
        kv[k] = value(take("I"))
    return kv


def bytes_to_unicode():
    """GPT-2's byte -> printable character table."""
    keep = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class Reference:
    def __init__(self, kv):
        if kv.get("tokenizer.ggml.model") != "gpt2":
            sys.exit("not a byte-level BPE (gpt2) vocabulary")
        if kv.get("tokenizer.ggml.pre"):
            print(f"note: the file names pre-tokenizer {kv['tokenizer.ggml.pre']!r}; "
                  "this script applies the fallback regardless", file=sys.stderr)
        self.tokens = kv["tokenizer.ggml.tokens"]
        self.vocab = {t: i for i, t in enumerate(self.tokens)}
        types = kv.get("tokenizer.ggml.token_type", [1] * len(self.tokens))
        self.user_defined = sorted((i for i, t in enumerate(types) if t == 4 and self.tokens[i]),
                                   key=lambda i: -len(self.tokens[i]))
        # Byte-mapped pieces hold no space (it maps to U+0120), so one splits each merge.
        self.merges = [tuple(m.split(" ", 1)) for m in kv["tokenizer.ggml.merges"]]
        self.ranks = {}
        for r, pair in enumerate(self.merges):
            self.ranks.setdefault(pair, r)
        self.byte_map = bytes_to_unicode()
        self.steps = [regex.compile(r) for r in RE_STEPS]

    def partition(self, text):
        """Fragments: str for text, int for a user-defined token (longest first)."""
        frags = [text] if text else []
        for tid in self.user_defined:
            piece = self.tokens[tid]
            out = []
            for fr in frags:
                if isinstance(fr, int):
                    out.append(fr)
                    continue
                parts = fr.split(piece)
                for k, p in enumerate(parts):
                    if k:
                        out.append(tid)
                    if p:
                        out.append(p)
            frags = out
        return frags

    def pre_tokenize(self, text):
        pieces = [text]
        for rx in self.steps:
            out = []
            for p in pieces:
                last = 0
                for m in rx.finditer(p):
                    if m.start() > last:
                        out.append(p[last:m.start()])
                    out.append(m.group())
                    last = m.end()
                if last < len(p):
                    out.append(p[last:])
            pieces = out
        return pieces

    def bpe(self, word):
        syms = [self.byte_map[b] for b in word.encode("utf-8")]
        while len(syms) > 1:
            best, at = None, -1
            for i in range(len(syms) - 1):
                r = self.ranks.get((syms[i], syms[i + 1]))
                if r is not None and (best is None or r < best):
                    best, at = r, i
            if best is None:
                break
            syms[at:at + 2] = [syms[at] + syms[at + 1]]
        ids = []
        for s in syms:
            if s in self.vocab:
                ids.append(self.vocab[s])
            else:
                ids.extend(self.vocab[c] for c in s)
        return ids

    def encode(self, text):
        ids = []
        for fr in self.partition(text):
            if isinstance(fr, int):
                ids.append(fr)
                continue
            for word in self.pre_tokenize(fr):
                ids.extend(self.bpe(word))
        return ids


def c_string(s):
    """A C string literal of the UTF-8 bytes of s (hex escapes split so that a
    following hex digit is not swallowed)."""
    out, prev_hex = [], False
    for b in s.encode("utf-8"):
        c = chr(b)
        if b < 0x20 or b >= 0x7F or c in '"\\?':
            out.append({"\n": "\\n", "\r": "\\r", "\t": "\\t", '"': '\\"', "\\": "\\\\", "?": "\\?"}.get(c)
                       or f"\\x{b:02X}")
            prev_hex = out[-1].startswith("\\x")
        else:
            if prev_hex and c in "0123456789abcdefABCDEF":
                out.append('" "')
            out.append(c)
            prev_hex = False
    return '"' + "".join(out) + '"'


def emit_c(ref, path):
    print(f"/* Generated by tests/tokenizer/bpe_default_ref.py from {os.path.basename(path)}: the ids")
    print(" * of llama.cpp's \"default\" (missing tokenizer.ggml.pre) pre-tokenizer, derived there")
    print(" * from its definition. Do not edit; rerun the script. */")
    print("static const struct {")
    print("    const char *text;")
    print("    int n;")
    print("    int32_t ids[64];")
    print("} bpe_default_cases[] = {")
    for text in CASES:
        ids = ref.encode(text)
        if len(ids) > 64:
            sys.exit(f"case {text!r}: {len(ids)} ids, the table holds 64")
        print(f"    {{{c_string(text)},")
        print(f"     {len(ids)},")
        body = ", ".join(str(i) for i in ids) or "0"  # C11 has no empty initializer
        print(f"     {{{body}}}}},")
    print("};")


FUZZ_POOL = list("abcXYZ019 '\"\n\r\t.,;:!?$+<=>^~|`-_(){}[]/@#%&*") + [
    "  ", "   ", "    ", "\u00e9", "\u00df", "\u0416", "\u03a9", "\u65e5", "\u672c", "\u0663", "\u00bd",
    "\u00b2", "\u2167", "\u2014", "\u201c", "\u201d", "\u00ab", "\u00bb", "\U0001F999", "\u20ac",
    "\u00a0", "\u2003", "'s", "'t", "'re", "'ll", "don't", "123", "4567"]


def fuzz_cases(n, seed=7):
    rng = random.Random(seed)
    return ["".join(rng.choice(FUZZ_POOL) for _ in range(rng.randint(0, 30))) for _ in range(n)]


def check(ref, path, fuzz=0, m40=None):
    """Compare with the other implementations that are installed."""
    ok, compared = True, 0
    cases = CASES + fuzz_cases(fuzz)
    ours = [ref.encode(t) for t in cases]
    try:
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    except ImportError:
        print("tokenizers: not installed, skipped", file=sys.stderr)
    else:
        tk = Tokenizer(models.BPE(vocab=dict(ref.vocab), merges=ref.merges, fuse_unk=False))
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), "isolated") for r in RE_STEPS]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tk.decoder = decoders.ByteLevel()
        tk.add_tokens([AddedToken(ref.tokens[i], normalized=False) for i in ref.user_defined])
        for t, want in zip(cases, ours):
            got = tk.encode(t, add_special_tokens=False).ids
            if got != want:
                ok = False
                print(f"tokenizers differs on {t!r}:\n  tokenizers {got}\n  reference  {want}", file=sys.stderr)
        compared += 1
        print("tokenizers: compared", file=sys.stderr)
    try:
        import llama_cpp
    except ImportError:
        print("llama_cpp: not installed, skipped", file=sys.stderr)
    else:
        llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
        for t, want in zip(cases, ours):
            got = llm.tokenize(t.encode("utf-8"), add_bos=False, special=False)
            if got != want:
                ok = False
                print(f"llama.cpp differs on {t!r}:\n  llama.cpp {got}\n  reference {want}", file=sys.stderr)
        compared += 1
        print(f"llama_cpp {llama_cpp.__version__}: compared", file=sys.stderr)
    if m40:
        for t, want in zip(cases, ours):
            run = subprocess.run([m40, "tokenize", "--no-bos", path, "-"], input=t.encode("utf-8"),
                                 capture_output=True, check=True)
            got = json.loads(run.stdout)
            if got != want:
                ok = False
                print(f"{m40} differs on {t!r}:\n  m40       {got}\n  reference {want}", file=sys.stderr)
        compared += 1
        print(f"{m40}: compared", file=sys.stderr)
    print(f"{len(cases)} cases, {compared} other implementations: {'agree' if ok else 'DISAGREE'}",
          file=sys.stderr)
    return ok


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("gguf")
    ap.add_argument("--check", action="store_true", help="compare with tokenizers / llama_cpp when installed")
    ap.add_argument("--fuzz", type=int, default=0, metavar="N", help="--check: N random strings more")
    ap.add_argument("--m40", metavar="BIN", help="--check: compare the ids of BIN tokenize too")
    a = ap.parse_args()
    ref = Reference(read_gguf_kv(a.gguf))
    if a.check:
        sys.exit(0 if check(ref, a.gguf, a.fuzz, a.m40) else 1)
    emit_c(ref, a.gguf)
