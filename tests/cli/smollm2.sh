#!/usr/bin/env bash
# The README's first command serves a model that chats: SmolLM2-135M-Instruct
# (scripts/fetch-smollm2.sh) behind `m40 serve` on the CPU answers the README's
# question with Paris (greedy), m40 ps shows it, and m40 serve leaves no temporary
# folder after SIGTERM. As scripts/quickstart.sh does, Gemma 3 270M is served beside it
# as gemma-3-270m when its file is there (scripts/fetch-gemma3.sh): then a request
# without "model" still reaches SmolLM2 and /v1/completions with "gemma-3-270m" reaches
# Gemma. Skips when the model cache, nginx or the module is absent ($M40_SMOLLM2 and
# $M40_GEMMA3 override the model paths).
cd "$(dirname "$0")/../.." || exit 1
source tests/cli/lib.bash
tmp=$(mktemp -d)
spid=
trap '[ -n "$spid" ] && kill "$spid" 2>/dev/null; rm -rf "$tmp"' EXIT

model=${M40_SMOLLM2:-${M40_MODELS_CACHE:-models-cache}/SmolLM2-135M-Instruct.Q4_1.gguf}
if [ ! -f "$model" ]; then
    skip "$model absent (scripts/fetch-smollm2.sh fetches it)"; done_tests; exit
fi
if [ ! -x /usr/sbin/nginx ] || [ ! -f build/ngx_http_m40_module.so ] || ! command -v curl >/dev/null; then
    skip "nginx, curl or build/ngx_http_m40_module.so absent"; done_tests; exit
fi

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
mkdir -p "$tmp/t"
gemma=${M40_GEMMA3:-${M40_MODELS_CACHE:-models-cache}/gemma-3-270m-q4_k_m.gguf}
also=()
[ -f "$gemma" ] && also=(--also "gemma-3-270m=$gemma")
TMPDIR=$tmp/t "$M40" serve "$model" --port "$port" --name smollm2-135m-instruct --threads 2 "${also[@]}" >"$tmp/log" 2>&1 &
spid=$!
for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && break   # 200: every model ready
    kill -0 "$spid" 2>/dev/null || break
    sleep 0.1
done
check "serve: ready ($(tail -1 "$tmp/log"))" curl -sf "http://127.0.0.1:$port/health" -o /dev/null

curl -s "http://127.0.0.1:$port/v1/chat/completions" -o "$tmp/answer" -d \
    '{"model":"smollm2-135m-instruct","messages":[{"role":"user","content":"What is the capital of France?"}],"max_tokens":30,"temperature":0}'
content=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["choices"][0]["message"]["content"])' "$tmp/answer" 2>&1)
check "the README's question is answered with Paris: '$content'" grep -q "Paris" <<<"$content"

if [ ${#also[@]} -gt 0 ]; then
    curl -s "http://127.0.0.1:$port/v1/chat/completions" -o "$tmp/answer2" -d \
        '{"messages":[{"role":"user","content":"What is the capital of France?"}],"max_tokens":30,"temperature":0}'
    got=$(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d["model"], d["choices"][0]["message"]["content"])' "$tmp/answer2" 2>&1)
    check "no \"model\": SmolLM2 answers, the same: '$got'" [ "$got" = "smollm2-135m-instruct $content" ]
    curl -s "http://127.0.0.1:$port/v1/completions" -o "$tmp/gemma" -d \
        '{"model":"gemma-3-270m","prompt":"The capital of France is","max_tokens":8,"temperature":0}'
    got=$(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d["model"], len(d["choices"][0]["text"]) > 0)' "$tmp/gemma" 2>&1)
    check "gemma-3-270m beside it continues a prompt: '$got'" [ "$got" = "gemma-3-270m True" ]
else
    skip "$gemma absent: SmolLM2 alone (scripts/fetch-gemma3.sh fetches Gemma 3 270M)"
fi

"$M40" ps "http://127.0.0.1:$port" >"$tmp/ps" 2>&1
# (the worker's memory is given only when it holds one model: on the CPU the models'
# parts of it cannot be told apart)
check "m40 ps: the model, ready, on the cpu ($(head -2 "$tmp/ps" | tail -1))" \
    grep -qE "^smollm2-135m-instruct +ready +cpu +([0-9.]+ MiB|-) +0/[0-9]+ +0 +8192$" "$tmp/ps"

kill -TERM "$spid"
wait "$spid"; rc=$?
spid=
check "serve: exit 0 after SIGTERM" [ $rc -eq 0 ]
check "serve: no temporary folder left" [ -z "$(ls -A "$tmp/t")" ]
done_tests
