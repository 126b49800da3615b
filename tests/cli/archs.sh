#!/usr/bin/env bash
# The newer architectures of ../shared/models/next on the CPU (qwen3, phi3, gemma2,
# llama with head_dim != dim/heads, and the mixtures of experts qwen3moe in F16, Q8_0 and
# Q4_K_M and gpt-oss with MXFP4 experts): m40 eval passes at the CPU tolerance, greedy m40
# run gives the reference's greedy text; asking for a GPU is not refused as "CPU only"
# for gemma2, qwen3moe and gpt-oss (here, without a GPU, the load fails for that reason
# instead; every row is validated on the GPU since session 16). The refusal of a row
# whose GPU path is not validated is tested on every row forced unvalidated in
# tests/unit/test_model.c (test_gpu_refusal).
cd "$(dirname "$0")/../.." || exit 1
source tests/cli/lib.bash
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

next=$SHARED/models/next
if [ ! -d "$next/ref" ]; then
    skip "$next/ref absent: no newer-architecture checks"
    done_tests
    exit
fi

# Hex of the reference's first greedy text (its prompt is "Once upon a time"), as m40 run
# prints it: bytes that are not UTF-8 (a token may hold part of a character: the MoE
# references' texts do) each become U+FFFD, as in Python's errors="replace"; a character
# cut off at the end is left out (the prefix is compared).
ref_hex() {
    local hex
    hex=$(grep -o '"text_hex": *"[0-9a-fA-F]*"' "$1" | head -n 1 | sed 's/.*: *"\([0-9a-fA-F]*\)"/\1/')
    python3 -c 'import sys
s = bytes.fromhex(sys.argv[1]).decode("utf-8", "replace")
print((s[:-1] if s.endswith("\ufffd") else s).encode().hex())' "$hex"
}

for name in tiny-qwen3-gpt2-f16 tiny-phi3-f16 tiny-gemma2-f16 tiny-llama-hd-f16 \
    tiny-qwen3moe-f16 tiny-qwen3moe-q8_0 tiny-qwen3moe-q4km tiny-gpt-oss-mxfp4; do
    model=$next/$name.gguf ref=$next/ref/$name.json
    if [ ! -f "$model" ] || [ ! -f "$ref" ]; then
        skip "$model or its reference absent"
        continue
    fi
    "$M40" eval "$model" "$ref" >"$tmp/eval" 2>&1; rc=$?
    check "$name: eval passes at 1e-3" [ "$rc" -eq 0 ]
    check "$name: eval PASS line" grep -qE '^overall: .*tokenization identical: PASS$' "$tmp/eval"
    "$M40" run "$model" --exact -p "Once upon a time" --temp 0 -n 16 >"$tmp/out" 2>/dev/null; rc=$?
    check "$name: greedy run exits 0" [ "$rc" -eq 0 ]
    want=$(ref_hex "$ref")
    got=$(od -An -v -tx1 "$tmp/out" | tr -d ' \n')
    check "$name: greedy text is the reference's ($want)" [ "${got#"$want"}" != "$got" ]
done

for pair in tiny-gemma2-f16:gemma2 tiny-qwen3moe-f16:qwen3moe tiny-gpt-oss-mxfp4:gpt-oss; do
    model=$next/${pair%%:*}.gguf arch=${pair#*:}
    [ -f "$model" ] || continue
    "$M40" run "$model" --device 0 -p hi -n 1 >/dev/null 2>"$tmp/err"; rc=$?
    check "$arch: run --device 0 runs or fails cleanly (rc $rc)" [ "$rc" -eq 0 -o "$rc" -eq 1 ]
    check "$arch: run --device 0 is not refused as CPU only" \
        bash -c '! grep -q "runs on the CPU only" "$1"' _ "$tmp/err"
done

done_tests
