#!/usr/bin/env bash
# Gemma 3 270M (the default real model, scripts/fetch-gemma3.sh) on the CPU:
#  - m40 info names the architecture and its hyperparameters;
#  - m40 eval against the independent NumPy reference (tests/gemma3/ref.py, written to
#    the model cache by `scripts/fetch-gemma3.sh --ref`; one prompt is longer than the
#    512-token sliding window) passes at 1e-2 with identical tokenization, and fails
#    at a tolerance below the measured agreement;
#  - greedy m40 run on plain prompts gives the reference's greedy text and plain English.
# Skips when the model cache is absent ($M40_GEMMA3 overrides the model path).
cd "$(dirname "$0")/../.." || exit 1
source tests/cli/lib.bash
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

cache=${M40_MODELS_CACHE:-models-cache}
model=${M40_GEMMA3:-$cache/gemma-3-270m-q4_k_m.gguf}
ref=${model%.gguf}.ref.json

if [ ! -f "$model" ]; then
    skip "$model absent (scripts/fetch-gemma3.sh fetches it)"
    done_tests
    exit
fi

"$M40" info "$model" >"$tmp/info" 2>&1
check "info: architecture gemma3" grep -qE '^architecture: +gemma3$' "$tmp/info"
check "info: sliding window 512" grep -qE '^ +attention.sliding_window +512$' "$tmp/info"
check "info: head dim 256 (key_length)" grep -qE '^ +attention.key_length +256$' "$tmp/info"

if [ -f "$ref" ]; then
    "$M40" eval --tol 1e-2 "$model" "$ref" >"$tmp/eval" 2>&1; rc=$?
    cat "$tmp/eval"
    check "eval --tol 1e-2 passes" [ "$rc" -eq 0 ]
    check "eval: tokenization identical, PASS" grep -qE '^overall: .*tokenization identical: PASS$' "$tmp/eval"
    check "eval: a prompt longer than the sliding window" \
        grep -qE '^prompt [0-9]+ .*: ([5-9][0-9]{2}|[0-9]{4,}) tokens match' "$tmp/eval"
    "$M40" eval --tol 1e-9 "$model" "$ref" >/dev/null 2>&1; rc=$?
    check "eval --tol 1e-9 fails (the comparison can fail)" [ "$rc" -eq 1 ]
else
    skip "$ref absent (scripts/fetch-gemma3.sh --ref writes it)"
fi

words() { # plain English: letters, digits, spaces and punctuation only, at least $2 words
    grep -qE '^[][A-Za-z0-9 ,.;:!?"'"'"'()-]+$' "$1" && [ "$(wc -w <"$1")" -ge "$2" ]
}
"$M40" run "$model" --exact -p "The capital of France is" --temp 0 -n 12 >"$tmp/out" 2>"$tmp/err"; rc=$?
echo "greedy: The capital of France is$(cat "$tmp/out")"
check "run exits 0" [ "$rc" -eq 0 ]
check "greedy output is plain English words" words "$tmp/out" 6
check "greedy output is about France or Paris" grep -qE 'Paris|France' "$tmp/out"
grep -E '^prompt: ' "$tmp/err"
if [ -f "$ref" ]; then
    # The reference's first prompt is this one: its greedy text (text_hex) must begin ours.
    hex=$(grep -o '"text_hex": *"[0-9a-fA-F]*"' "$ref" | head -n 1 | sed 's/.*: *"\([0-9a-fA-F]*\)"/\1/')
    want=$(printf "$(printf '%s' "$hex" | sed 's/../\\x&/g')")
    got=$(cat "$tmp/out")
    check "greedy text begins with the reference's ('$want')" [ -n "$want" ] && [ "${got#"$want"}" != "$got" ]
fi
"$M40" run "$model" -p "Water boils at a temperature of" --temp 0 -n 8 >"$tmp/out2" 2>/dev/null
echo "greedy: Water boils at a temperature of$(cat "$tmp/out2")"
check "water boils at 100" grep -q '100' "$tmp/out2"

done_tests
