#!/usr/bin/env bash
# m40 mkmodel: usage errors exit 2 and name the bad value, the tiny shape is written,
# read back by m40 info, reproducible per seed, and nothing is left behind on failure.
cd "$(dirname "$0")/../.." || exit 1
source tests/cli/lib.bash
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

"$M40" mkmodel >/dev/null 2>"$tmp/err"; rc=$?
check "no arguments: exit 2" [ "$rc" -eq 2 ]
check "no arguments: usage" grep -q "usage: m40 mkmodel" "$tmp/err"
"$M40" mkmodel --type F16 "$tmp/a.gguf" >/dev/null 2>"$tmp/err"; rc=$?
check "missing --shape: exit 2" [ "$rc" -eq 2 ]
check "missing --shape named" grep -q -- "--shape is required" "$tmp/err"
"$M40" mkmodel --shape tiny "$tmp/a.gguf" >/dev/null 2>"$tmp/err"; rc=$?
check "missing --type: exit 2" [ "$rc" -eq 2 ]
"$M40" mkmodel --shape tiny --type F16 >/dev/null 2>"$tmp/err"; rc=$?
check "missing output: exit 2" [ "$rc" -eq 2 ]
"$M40" mkmodel --shape llama-9000 --type F16 "$tmp/a.gguf" >/dev/null 2>"$tmp/err"; rc=$?
check "unknown shape: exit 2" [ "$rc" -eq 2 ]
check "unknown shape named, shapes listed" grep -q "unknown shape 'llama-9000' (shapes: tiny, tiny-tp, tinyllama-1.1b, llama-2-7b" "$tmp/err"
"$M40" mkmodel --shape tiny --type Q3_K "$tmp/a.gguf" >/dev/null 2>"$tmp/err"; rc=$?
check "unknown type: exit 2" [ "$rc" -eq 2 ]
check "unknown type named, types listed" grep -q "unknown type 'Q3_K' (types: F32, F16" "$tmp/err"
"$M40" mkmodel --shape tiny --type F16 --seed abc "$tmp/a.gguf" >/dev/null 2>"$tmp/err"; rc=$?
check "bad --seed: exit 2" [ "$rc" -eq 2 ]
check "bad --seed named" grep -q "seed 'abc'" "$tmp/err"
"$M40" mkmodel --shape tiny --type F16 --layers 0 "$tmp/a.gguf" >/dev/null 2>"$tmp/err"; rc=$?
check "--layers 0: exit 2" [ "$rc" -eq 2 ]
"$M40" mkmodel --shape tiny --type F16 --layers >/dev/null 2>"$tmp/err"; rc=$?
check "--layers without a value: exit 2" [ "$rc" -eq 2 ]
"$M40" mkmodel --shape tiny --type F16 --frobnicate "$tmp/a.gguf" >/dev/null 2>"$tmp/err"; rc=$?
check "unknown option: exit 2" [ "$rc" -eq 2 ]
"$M40" mkmodel --shape tiny --type F16 "$tmp/a.gguf" "$tmp/b.gguf" >/dev/null 2>"$tmp/err"; rc=$?
check "two outputs: exit 2" [ "$rc" -eq 2 ]
check "no file written on usage errors" [ -z "$(ls "$tmp")" -o "$(ls "$tmp")" = err ]
"$M40" mkmodel --help >"$tmp/help" 2>&1; rc=$?
check "--help: exit 0" [ "$rc" -eq 0 ]
check "--help lists the shapes" grep -q "llama-3-8b" "$tmp/help"

"$M40" mkmodel --shape tiny --type Q4_K_M --seed 5 "$tmp/tiny.gguf" >"$tmp/out" 2>"$tmp/err"; rc=$?
check "tiny Q4_K_M: exit 0" [ "$rc" -eq 0 ]
check "summary line" grep -qE "^wrote .*tiny.gguf: tiny Q4_K_M, 2 layers, seed 5: 21 tensors" "$tmp/err"
check "no .part left" [ ! -e "$tmp/tiny.gguf.part" ]
"$M40" info "$tmp/tiny.gguf" >"$tmp/info" 2>&1; rc=$?
check "info reads it" [ "$rc" -eq 0 ]
check "info: llama" grep -qE '^architecture: +llama$' "$tmp/info"
check "info: 2 blocks" grep -qE '^  block_count +2$' "$tmp/info"
check "info: vocab 1024" grep -qE '^  vocab size +1024$' "$tmp/info"
check "info: Q6_K output" grep -qE '^output\.weight +Q6_K +256 x 1024 ' "$tmp/info"
check "info: Q6_K attn_v in the last layer" grep -qE '^blk\.1\.attn_v\.weight +Q6_K ' "$tmp/info"
check "info: Q4_K attn_v in the first layer" grep -qE '^blk\.0\.attn_v\.weight +Q4_K ' "$tmp/info"
"$M40" tokenize "$tmp/tiny.gguf" "hello world" >"$tmp/tok" 2>&1; rc=$?
check "tokenize works on it" [ "$rc" -eq 0 ]
check "tokenize starts with bos" grep -qE '^\[1, ' "$tmp/tok"

"$M40" mkmodel --shape tiny --type Q4_K_M --seed 5 --threads 1 "$tmp/again.gguf" 2>/dev/null
check "same seed, same bytes (1 thread vs all)" cmp -s "$tmp/tiny.gguf" "$tmp/again.gguf"
"$M40" mkmodel --shape llama-2-7b --layers 1 --type q8_0 --dry-run "$tmp/big.gguf" >"$tmp/dry" 2>&1; rc=$?
check "dry run: exit 0" [ "$rc" -eq 0 ]
check "dry run: size reported" grep -qE "llama-2-7b Q8_0, 1 layers: 12 tensors, 464531456 parameters" "$tmp/dry"
check "dry run: nothing written" [ ! -e "$tmp/big.gguf" ]

# The mixtures of experts: the real shapes' sizes, and the tiny ones written, read and
# run greedily on the CPU (gpt-oss with MXFP4 experts).
check "--help lists the MoE shapes" grep -qE "qwen3-30b-a3b .*128 experts \(8 used\) of ffn 768" "$tmp/help"
"$M40" mkmodel --shape qwen3-30b-a3b --type Q4_K_M --dry-run "$tmp/big.gguf" >"$tmp/dry" 2>&1
check "qwen3-30b-a3b: 30.5B parameters" grep -qE "48 layers: 579 tensors, 30532122624 parameters" "$tmp/dry"
"$M40" mkmodel --shape gpt-oss-20b --type MXFP4 --dry-run "$tmp/big.gguf" >"$tmp/dry" 2>&1
check "gpt-oss-20b: 20.9B parameters" grep -qE "24 layers: 459 tensors, 20914757184 parameters" "$tmp/dry"
for pair in tiny-qwen3moe:Q4_K_M:qwen3moe tiny-gpt-oss:MXFP4:gpt-oss; do
    IFS=: read -r shape type arch <<<"$pair"
    "$M40" mkmodel --shape "$shape" --type "$type" "$tmp/$shape.gguf" >/dev/null 2>"$tmp/err"; rc=$?
    check "$shape $type: exit 0" [ "$rc" -eq 0 ]
    "$M40" info "$tmp/$shape.gguf" >"$tmp/info" 2>&1
    check "$shape: info says $arch" grep -qE "^architecture: +$arch\$" "$tmp/info"
    check "$shape: 3-D experts in $type" grep -qE "^blk\.0\.ffn_up_exps\.weight +(Q4_K|MXFP4) +256 x 256 x 8 " "$tmp/info"
    "$M40" run "$tmp/$shape.gguf" -p "hello world" --temp 0 -n 8 --threads 2 >"$tmp/out" 2>"$tmp/err"; rc=$?
    check "$shape: greedy run exits 0" [ "$rc" -eq 0 ]
    check "$shape: 8 tokens generated" grep -q "generated: 8 tokens" "$tmp/err"
done
"$M40" mkmodel --shape tiny --type MXFP4 "$tmp/x.gguf" >/dev/null 2>"$tmp/err"; rc=$?
check "MXFP4 on a dense shape: exit 1" [ "$rc" -eq 1 ]
check "MXFP4 on a dense shape: says why" grep -q "shape tiny has none" "$tmp/err"

"$M40" mkmodel --shape tiny --type F16 "$tmp/no/such/dir/x.gguf" >/dev/null 2>"$tmp/err"; rc=$?
check "unwritable output: exit 1" [ "$rc" -eq 1 ]
check "unwritable output: message names it" grep -q "no/such/dir/x.gguf" "$tmp/err"

done_tests
