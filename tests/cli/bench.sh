#!/usr/bin/env bash
# m40 bench on the CPU with a tiny model: every repetition and the median are printed,
# the machine-readable result line adds up (decode tok/s = steps/s x batch), prompts of
# several sequences share prefill calls, and bad arguments are refused (exit 2).
cd "$(dirname "$0")/../.." || exit 1
source tests/cli/lib.bash
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

model=$SHARED/models/stories260K.gguf
if [ -f "$model" ]; then
    for chunk in 7 32 512; do # 7: prompts split over calls; 32: several slots per call
        "$M40" bench "$model" --prompt-len 20 --batch 3 --gen 5 --reps 2 --chunk $chunk >"$tmp/out" 2>"$tmp/err"; rc=$?
        check "bench --chunk $chunk exits 0" [ "$rc" -eq 0 ]
        check "bench --chunk $chunk prints both runs" [ "$(grep -c '^run [12]: ' "$tmp/out")" -eq 2 ]
        check "bench --chunk $chunk counts 60 prompt tokens, 5 x 3 decoded" \
            grep -qE '^run 1: +prefill 60 tokens in .* decode 5 x 3 tokens' "$tmp/out"
        line=$(grep '^result: ' "$tmp/out")
        check "bench --chunk $chunk result line" python3 - "$line" <<'PY'
import sys
kv = dict(f.split("=", 1) for f in sys.argv[1].split()[1:])
assert float(kv["prefill_tok_s"]) > 0 and float(kv["decode_tok_s"]) > 0, kv
assert kv["batch"] == "3" and kv["device"] == "cpu", kv
assert int(kv["weight_bytes"]) > 0, kv
PY
    done
    check "bench: one warm-up run by default, before the timed ones" \
        bash -c "grep -n '' '$tmp/out' | grep -E '^[0-9]+:(warm-up 1:|run 1:)' | cut -d: -f2 | tr '\n' ' ' | grep -q '^warm-up 1 run 1 '"
    "$M40" bench "$model" --prompt-len 20 --gen 3 --reps 1 --warmup 0 >"$tmp/out" 2>"$tmp/err"; rc=$?
    check "bench --warmup 0 exits 0" [ "$rc" -eq 0 ]
    check "bench --warmup 0 runs no warm-up" [ "$(grep -c '^warm-up' "$tmp/out")" -eq 0 ]
    "$M40" bench "$model" --prompt-len 20 --gen 3 --reps 1 --warmup 2 >"$tmp/out" 2>"$tmp/err"; rc=$?
    check "bench --warmup 2 runs two warm-ups and one timed run" \
        [ "$(grep -c '^warm-up [12]: ' "$tmp/out")" -eq 2 -a "$(grep -c '^run 1: ' "$tmp/out")" -eq 1 ]
    "$M40" bench "$model" --gpu-time --gen 2 --reps 1 >/dev/null 2>"$tmp/e"; rc=$?
    check "bench --gpu-time on the CPU is refused with exit 2" [ "$rc" -eq 2 ]
    check "bench --gpu-time on the CPU says it needs a CUDA device" grep -q "needs a model on a CUDA device" "$tmp/e"
else
    skip "$model absent"
fi

# A mixture of experts: a step reads the chosen experts' share of the expert tensors
# (2 of 8: 25% at batch 1, 1 - 0.75^2 = 43.75% at batch 2), all the other tensors.
moe=$SHARED/models/next/tiny-qwen3moe-q8_0.gguf
if [ -f "$moe" ]; then
    for pair in 1:25.0 2:43.8; do
        batch=${pair%%:*} share=${pair#*:}
        "$M40" bench "$moe" --prompt-len 8 --batch "$batch" --gen 3 --reps 1 --warmup 0 >"$tmp/out" 2>"$tmp/err"; rc=$?
        check "bench MoE batch $batch exits 0" [ "$rc" -eq 0 ]
        check "bench MoE batch $batch: $share% of the expert tensors" \
            grep -qE "^experts: +2 of 8 per token, expert ffn 64: a step of $batch tokens reads .*\($share% of the expert tensors" "$tmp/out"
        file=$(stat -c %s "$moe")
        line=$(grep '^result: ' "$tmp/out")
        check "bench MoE batch $batch: weight_bytes below the file's size" python3 - "$line" "$file" <<'PY'
import sys
kv = dict(f.split("=", 1) for f in sys.argv[1].split()[1:])
assert 0 < float(kv["weight_bytes"]) < int(sys.argv[2]), (kv, sys.argv[2])
PY
    done
else
    skip "$moe absent"
fi

"$M40" bench "$model" --batch 0 >/dev/null 2>"$tmp/e"; rc=$?
check "bench --batch 0 is refused with exit 2" [ "$rc" -eq 2 ]
"$M40" bench "$model" --warmup -1 >/dev/null 2>"$tmp/e"; rc=$?
check "bench --warmup -1 is refused with exit 2" [ "$rc" -eq 2 ]
"$M40" bench "$model" --tp 0 >/dev/null 2>"$tmp/e"; rc=$?
check "bench --tp 0 is refused with exit 2" [ "$rc" -eq 2 ]
"$M40" eval --tp two "$model" "$model" >/dev/null 2>"$tmp/e"; rc=$?
check "eval --tp two is refused with exit 2, naming the option" sh -c "[ $rc -eq 2 ] && grep -q -- --tp '$tmp/e'"
"$M40" run "$model" -p hi --tp 65 >/dev/null 2>"$tmp/e"; rc=$?
check "run --tp 65 is refused with exit 2" [ "$rc" -eq 2 ]
"$M40" bench >/dev/null 2>"$tmp/e"; rc=$?
check "bench without a model is exit 2" [ "$rc" -eq 2 ]
"$M40" bench "$tmp/missing.gguf" >/dev/null 2>"$tmp/e"; rc=$?
check "bench on a missing file is exit 1" [ "$rc" -eq 1 ]
check "bench on a missing file says why" [ -s "$tmp/e" ]
done_tests
