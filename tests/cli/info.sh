#!/usr/bin/env bash
# m40 info: shows architecture, hyperparameters, tokenizer and the tensor table of a
# real model; a bad file is a clear error (exit 1); misuse is exit 2.
cd "$(dirname "$0")/../.." || exit 1
source tests/cli/lib.bash
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

model=$SHARED/models/stories260K.gguf
if [ -f "$model" ]; then
    "$M40" info "$model" >"$tmp/out" 2>"$tmp/err"; rc=$?
    check "info on stories260K exits 0" [ "$rc" -eq 0 ]
    check "architecture llama" grep -qE '^architecture: +llama$' "$tmp/out"
    check "block count 5" grep -qE '^  block_count +5$' "$tmp/out"
    check "embedding length 64" grep -qE '^  embedding_length +64$' "$tmp/out"
    check "vocab size 512" grep -qE '^  vocab size +512$' "$tmp/out"
    check "tensor count by type" grep -qE '^  F32 +48 tensors' "$tmp/out"
    check "tensor table header" grep -qE '^name +type +shape +size$' "$tmp/out"
    check "token_embd row" grep -qE '^token_embd\.weight +F32 +64 x 512 ' "$tmp/out"
    check "all 48 tensors listed" [ "$(grep -cE '^(token_embd|output|blk\.)' "$tmp/out")" -eq 48 ]
    check "nothing on stderr" [ ! -s "$tmp/err" ]
else
    skip "$model absent"
fi

qwen=$SHARED/models/tiny-qwen2-gpt2-f16.gguf
if [ -f "$qwen" ]; then
    "$M40" info "$qwen" >"$tmp/q" 2>&1
    check "qwen2 architecture" grep -qE '^architecture: +qwen2$' "$tmp/q"
    check "qwen2 gpt2 tokenizer" grep -qE '^  model +gpt2$' "$tmp/q"
    check "qwen2 rope base" grep -qE '^  rope\.freq_base +1e\+06$' "$tmp/q"
    check "qwen2 F16 count" grep -qE '^  F16 +15 tensors' "$tmp/q"
else
    skip "$qwen absent"
fi

printf 'this is not a model at all\n' >"$tmp/garbage.gguf"
"$M40" info "$tmp/garbage.gguf" >"$tmp/out" 2>"$tmp/err"; rc=$?
check "garbage file exits 1" [ "$rc" -eq 1 ]
check "garbage file message names file and problem" grep -q "^m40: $tmp/garbage.gguf: bad magic" "$tmp/err"
check "garbage file prints nothing on stdout" [ ! -s "$tmp/out" ]

if [ -f "$model" ]; then
    head -c 5000 "$model" >"$tmp/cut.gguf"
    "$M40" info "$tmp/cut.gguf" >/dev/null 2>"$tmp/err"; rc=$?
    check "truncated model exits 1" [ "$rc" -eq 1 ]
    check "truncated model says truncated" grep -q "truncated file" "$tmp/err"
fi

"$M40" info "$tmp/does-not-exist.gguf" >/dev/null 2>"$tmp/err"; rc=$?
check "missing file exits 1" [ "$rc" -eq 1 ]
check "missing file message" grep -q "cannot open" "$tmp/err"

"$M40" info >/dev/null 2>"$tmp/err"; rc=$?
check "no argument exits 2" [ "$rc" -eq 2 ]
check "no argument prints usage" grep -q "usage: m40 info" "$tmp/err"
"$M40" info a b >/dev/null 2>&1; rc=$?
check "two arguments exit 2" [ "$rc" -eq 2 ]

done_tests
