#!/usr/bin/env bash
# The README's first command serves a model that chats: SmolLM2-135M-Instruct
# (scripts/fetch-smollm2.sh) behind `m40 serve` on the CPU answers the README's
# question with Paris (greedy), m40 ps shows it, and m40 serve leaves no temporary
# folder after SIGTERM. Skips when the model cache, nginx or the module is absent
# ($M40_SMOLLM2 overrides the model path).
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
TMPDIR=$tmp/t "$M40" serve "$model" --port "$port" --name smollm2-135m-instruct --threads 2 >"$tmp/log" 2>&1 &
spid=$!
for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
    kill -0 "$spid" 2>/dev/null || break
    sleep 0.1
done
check "serve: ready ($(tail -1 "$tmp/log"))" curl -sf "http://127.0.0.1:$port/health" -o /dev/null

curl -s "http://127.0.0.1:$port/v1/chat/completions" -o "$tmp/answer" -d \
    '{"model":"smollm2-135m-instruct","messages":[{"role":"user","content":"What is the capital of France?"}],"max_tokens":30,"temperature":0}'
content=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["choices"][0]["message"]["content"])' "$tmp/answer" 2>&1)
check "the README's question is answered with Paris: '$content'" grep -q "Paris" <<<"$content"

"$M40" ps "http://127.0.0.1:$port" >"$tmp/ps" 2>&1
check "m40 ps: the model, ready, on the cpu ($(tail -1 "$tmp/ps"))" grep -qE "^smollm2-135m-instruct +ready +cpu +[0-9.]+ MiB +0/[0-9]+ +0 +8192$" "$tmp/ps"

kill -TERM "$spid"
wait "$spid"; rc=$?
spid=
check "serve: exit 0 after SIGTERM" [ $rc -eq 0 ]
check "serve: no temporary folder left" [ -z "$(ls -A "$tmp/t")" ]
done_tests
