#!/usr/bin/env bash
# m40 run: greedy text of a real model matches the reference's greedy text, a speed
# line goes to stderr, sampling is reproducible per seed; m40 eval: passes on
# stories260K, fails when it should (tolerance 0, wrong reference, bad path).
cd "$(dirname "$0")/../.." || exit 1
source tests/cli/lib.bash
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# text_hex of the reference's first prompt, as bytes (the file has one entry per line
# or all on one line: only the first occurrence is used).
ref_text() {
    local hex
    hex=$(grep -o '"text_hex": *"[0-9a-fA-F]*"' "$1" | head -n 1 | sed 's/.*: *"\([0-9a-fA-F]*\)"/\1/')
    printf "$(printf '%s' "$hex" | sed 's/../\\x&/g')"
}
first_prompt() {
    grep -o '"prompt": *"[^"]*"' "$1" | head -n 1 | sed 's/.*: *"\(.*\)"/\1/'
}

model=$SHARED/models/aidreams260K.gguf
ref=$SHARED/models/ref/aidreams260K.json
if [ -f "$model" ] && [ -f "$ref" ]; then
    "$M40" run "$model" --exact -p "Once upon a time" --temp 0 -n 40 >"$tmp/out" 2>"$tmp/err"; rc=$?
    check "run exits 0" [ "$rc" -eq 0 ]
    check "speed line on stderr" grep -qE '^prompt: [0-9]+ tokens, [0-9.]+ tok/s \| generated: 40 tokens, [0-9.]+ tok/s' "$tmp/err"
    if [ "$(first_prompt "$ref")" = "Once upon a time" ]; then
        want=$(ref_text "$ref")
        got=$(cat "$tmp/out")
        check "greedy output begins with the reference's greedy text ('$want')" [ "${got#"$want"}" != "$got" ]
    else
        check "output is printable ASCII words" grep -qE '^[[:print:]]+$' "$tmp/out"
    fi
    check "output is readable text" grep -qE '^[][A-Za-z0-9 ,.;:!?"'"'"'-]+$' "$tmp/out"

    "$M40" run "$model" -p "Once upon a time" --temp 1 --seed 7 -n 40 >"$tmp/s1" 2>/dev/null
    "$M40" run "$model" -p "Once upon a time" --temp 1 --seed 7 -n 40 >"$tmp/s2" 2>/dev/null
    "$M40" run "$model" -p "Once upon a time" --temp 1 --seed 8 -n 40 >"$tmp/s3" 2>/dev/null
    check "same seed, same text" cmp -s "$tmp/s1" "$tmp/s2"
    differ() { ! cmp -s "$1" "$2"; }
    check "another seed, other text" differ "$tmp/s1" "$tmp/s3"
    check "sampled text is not the greedy text" differ "$tmp/s1" "$tmp/out"
    "$M40" run "$model" -p "Once upon a time" --top-k 1 --seed 3 -n 40 >"$tmp/k1" 2>/dev/null
    check "top-k 1 gives the greedy text" cmp -s "$tmp/k1" "$tmp/out"
    "$M40" run "$model" -p "Once upon a time" --temp 0 -n 5 --threads 2 >"$tmp/n5" 2>"$tmp/err5"
    check "-n 5 stops after 5 tokens" grep -q 'generated: 5 tokens' "$tmp/err5"
else
    skip "$model or its reference absent"
fi

"$M40" run >/dev/null 2>&1; rc=$?
check "run without arguments: usage, exit 2" [ "$rc" -eq 2 ]
"$M40" run "$SHARED/models/aidreams260K.gguf" -p x --temp abc >/dev/null 2>&1; rc=$?
check "run with a bad --temp: exit 2" [ "$rc" -eq 2 ]
"$M40" run "$tmp/missing.gguf" -p "hi" >/dev/null 2>"$tmp/err"; rc=$?
check "run on a missing model: exit 1" [ "$rc" -eq 1 ]
check "run on a missing model names it" grep -q "missing.gguf" "$tmp/err"

model=$SHARED/models/stories260K.gguf
ref=$SHARED/models/ref/stories260K.json
if [ -f "$model" ] && [ -f "$ref" ]; then
    "$M40" eval "$model" "$ref" >"$tmp/eval" 2>&1; rc=$?
    check "eval passes on stories260K" [ "$rc" -eq 0 ]
    check "eval prints the overall verdict" grep -qE '^overall: max \|dlogprob\| .* PASS$' "$tmp/eval"
    check "eval reports each prompt" [ "$(grep -c '^prompt [0-9]' "$tmp/eval")" -eq 5 ]
    "$M40" eval --tol 0 "$model" "$ref" >"$tmp/eval0" 2>&1; rc=$?
    check "eval with --tol 0 fails" [ "$rc" -eq 1 ]
    aidreams=$SHARED/models/aidreams260K.gguf
    if [ -f "$aidreams" ]; then
        "$M40" eval "$aidreams" "$ref" >"$tmp/evalx" 2>&1; rc=$?
        check "eval of one model against another's reference fails" [ "$rc" -eq 1 ]
    fi
    # With a GPU, tests/gpu/run.sh (make check-gpu) runs eval --device 0; without
    # one, asking for it must fail with a message naming the device.
    if ! nvidia-smi -L >/dev/null 2>&1; then
        "$M40" eval --device 0 "$model" "$ref" >/dev/null 2>"$tmp/dev"; rc=$?
        check "eval --device 0 without a GPU fails" [ "$rc" -eq 1 ]
        check "eval --device 0 without a GPU names the device" grep -q "device 0" "$tmp/dev"
        "$M40" eval --device -3 "$model" "$ref" >/dev/null 2>"$tmp/dev"; rc=$?
        check "eval --device -3 is a usage error" [ "$rc" -eq 2 ]
    else
        skip "GPU present: eval --device is covered by make check-gpu"
    fi
else
    skip "$model or its reference absent"
fi
"$M40" eval "$SHARED/models/stories260K.gguf" "$tmp/no-such-ref.json" >/dev/null 2>"$tmp/err"; rc=$?
check "eval with a bad reference path fails" [ "$rc" -ne 0 ]
check "eval names the bad path" grep -q "no-such-ref.json" "$tmp/err"
printf '[{"prompt": "x", "prompt_tokens": [1], "steps": [{"token": 1, "top": [[1]]}]}]' >"$tmp/bad.json"
"$M40" eval "$SHARED/models/stories260K.gguf" "$tmp/bad.json" >/dev/null 2>"$tmp/err"; rc=$?
check "eval with a malformed reference fails" [ "$rc" -eq 1 ]
check "malformed reference: message names the entry" grep -q "entry 0: steps\[0\].top\[0\]" "$tmp/err"

done_tests
