#!/usr/bin/env bash
# The newer dense architectures of ../shared/models/next on the CPU (qwen3, phi3, gemma2,
# llama with head_dim != dim/heads): m40 eval passes at the CPU tolerance, greedy m40 run
# gives the reference's greedy text, and asking for a GPU where the architecture's GPU
# path is not validated yet (gemma2) is refused with the message that it runs on the CPU
# only (before any CUDA call, so also here).
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

# Hex of the reference's first greedy text (its prompt is "Once upon a time").
ref_hex() { grep -o '"text_hex": *"[0-9a-fA-F]*"' "$1" | head -n 1 | sed 's/.*: *"\([0-9a-fA-F]*\)"/\1/'; }

for name in tiny-qwen3-gpt2-f16 tiny-phi3-f16 tiny-gemma2-f16 tiny-llama-hd-f16; do
    model=$next/$name.gguf ref=$next/ref/$name.json
    if [ ! -f "$model" ] || [ ! -f "$ref" ]; then
        skip "$model or its reference absent"
        continue
    fi
    "$M40" eval "$model" "$ref" >"$tmp/eval" 2>&1; rc=$?
    check "$name: eval passes at 1e-3" [ "$rc" -eq 0 ]
    check "$name: eval PASS line" grep -qE '^overall: .*tokenization identical: PASS$' "$tmp/eval"
    "$M40" run "$model" -p "Once upon a time" --temp 0 -n 16 >"$tmp/out" 2>/dev/null; rc=$?
    check "$name: greedy run exits 0" [ "$rc" -eq 0 ]
    want=$(ref_hex "$ref")
    got=$(od -An -v -tx1 "$tmp/out" | tr -d ' \n')
    check "$name: greedy text is the reference's ($want)" [ "${got#"$want"}" != "$got" ]
done

for pair in tiny-gemma2-f16:gemma2; do
    model=$next/${pair%%:*}.gguf arch=${pair#*:}
    [ -f "$model" ] || continue
    "$M40" run "$model" --device 0 -p hi -n 1 >/dev/null 2>"$tmp/err"; rc=$?
    check "$arch: run --device 0 fails" [ "$rc" -eq 1 ]
    check "$arch: the error says it runs on the CPU only" \
        grep -q "architecture '$arch' runs on the CPU only in this build" "$tmp/err"
done

done_tests
