#!/usr/bin/env bash
# m40 tokenize: ids of known strings on shared vocabularies (GGUF and .model), stdin
# mode (raw bytes, no control-token parsing), --no-bos, --special, and failures.
source tests/cli/lib.bash

VOCAB=$SHARED/tokenizer/ggml-vocab-llama-spm.gguf
SPMFILE=$SHARED/tokenizer/llama2-tokenizer.model
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

eq() { # eq "desc" "want" cmd...
    local d=$1 want=$2; shift 2
    local got
    got=$("$@" 2>"$tmp/err")
    if [ "$got" = "$want" ]; then ok; else bad "$d: got '$got' want '$want' ($(head -c 300 "$tmp/err"))"; fi
}

if [ -f "$VOCAB" ]; then
    eq "Hello world with BOS" "[1, 15043, 3186]" "$M40" tokenize "$VOCAB" "Hello world"
    eq "--no-bos" "[15043, 3186]" "$M40" tokenize --no-bos "$VOCAB" "Hello world"
    eq "stdin" "[1, 15043, 3186]" sh -c "printf 'Hello world' | \"$M40\" tokenize \"$VOCAB\" -"
    # stdin is raw bytes: the newline is encoded (<0x0A> = 13), <s> stays text
    eq "stdin raw, no specials" "[1, 15043, 29966, 29879, 29958, 13]" \
        sh -c "printf 'Hello<s>\n' | \"$M40\" tokenize \"$VOCAB\" -"
    eq "text without --special" "[1, 529, 29879, 29958, 10994]" "$M40" tokenize "$VOCAB" "<s>Hello"
    eq "--special splits <s>" "[1, 1, 15043]" "$M40" tokenize --special "$VOCAB" "<s>Hello"
    eq "empty text" "[1]" "$M40" tokenize "$VOCAB" ""
else
    skip "$VOCAB absent"
fi

if [ -f "$SPMFILE" ]; then
    eq ".model file" "[1, 15043, 3186]" "$M40" tokenize "$SPMFILE" "Hello world"
else
    skip "$SPMFILE absent"
fi

GPT2=$SHARED/tokenizer/ggml-vocab-gpt-2.gguf
if [ -f "$GPT2" ] && "$M40" tokenize "$GPT2" "x" >/dev/null 2>&1; then
    eq "gpt-2: no BOS by default" "[15496, 995]" "$M40" tokenize "$GPT2" "Hello world"
    check "gpt-2 (has tokenizer.ggml.pre): no warning" test ! -s "$tmp/err"
else
    skip "gpt-2 vocabulary absent or BPE not available"
fi

# No tokenizer.ggml.pre: llama.cpp's "default" pre-tokenizer (its ids, see
# tests/tokenizer/bpe_default_ref.py) and one warning on stderr naming the fallback.
NEOX=$SHARED/tokenizer/ggml-vocab-gpt-neox.gguf
if [ -f "$NEOX" ]; then
    eq "gpt-neox: default pre-tokenizer" "[9903, 8, 85, 209, 10683, 1857]" "$M40" tokenize "$NEOX" "don't 12345"
    check "gpt-neox: one warning line" test "$(grep -c 'tokenizer.ggml.pre is missing.*"default"' "$tmp/err")" -eq 1
else
    skip "$NEOX absent"
fi

# failures: exit 1 with a message naming the problem; usage: exit 2
"$M40" tokenize /nonexistent/model.gguf "x" >"$tmp/out" 2>"$tmp/err"; rc=$?
check "missing file exits 1" test "$rc" -eq 1
check "missing file named" grep -q "nonexistent/model.gguf" "$tmp/err"
check "nothing on stdout" test ! -s "$tmp/out"

printf 'GGUF\003\000\000\000garbage' >"$tmp/bad.gguf"
"$M40" tokenize "$tmp/bad.gguf" "x" >/dev/null 2>"$tmp/err"; rc=$?
check "truncated GGUF exits 1" test "$rc" -eq 1
check "truncated GGUF has a message" test -s "$tmp/err"

printf 'not a model at all' >"$tmp/bad.model"
"$M40" tokenize "$tmp/bad.model" "x" >/dev/null 2>"$tmp/err"; rc=$?
check "bad .model exits 1" test "$rc" -eq 1
check "bad .model has a message" grep -q "sentencepiece" "$tmp/err"

"$M40" tokenize >/dev/null 2>&1; rc=$?
check "no arguments: usage, exit 2" test "$rc" -eq 2
"$M40" tokenize --bogus x y >/dev/null 2>&1; rc=$?
check "unknown option: exit 2" test "$rc" -eq 2

done_tests
