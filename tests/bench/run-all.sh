#!/usr/bin/env bash
# The whole benchmark table on one host, in one command:
#
#   tests/bench/run-all.sh                  synthetic mistral-7b F16, Q8_0, Q4_K_M on GPU 0
#   tests/bench/run-all.sh --device cpu --model /work/shared/models/stories260K.gguf \
#       --prompt-words 10 --max-tokens 32 --ctx-size 256 --concurrency "4 8"   (a smoke run)
#
# For each model: `m40 bench` (prefill and batch-1 decode tokens/s, fraction of the
# bandwidth roofline), then `m40 serve` (nginx + the module) with tests/bench/load.py
# at each --concurrency of streaming chats, then a shared-prefix run that reads
# m40_prompt_tokens_computed_total from /metrics; then a second server with a long
# context for the long-prompt rows: --rag-words prompts at each --rag-concurrency
# (RAG and agents: TTFT p99 is the number to watch), and the long-prompt-while-
# streaming case (--long-streams streams, then one --long-prompt-tokens prompt: the
# streams' ITL p50/p99 before it and while it is processed). Every server row counts
# the requests refused with 429 and those that failed otherwise. Prints the tables at
# the end; the raw output of every step stays in --out.
#
# Each piece that is missing (the m40 binary, `m40 mkmodel`, a GPU engine behind
# --device, the nginx module, python3) is reported in the table with the reason and
# the rest goes on. Build first: make -j build/m40 build/ngx_http_m40_module.so
#
# Options (defaults in brackets):
#   --device D            GPU index or cpu [0]
#   --shape S             m40 mkmodel shape [mistral-7b]
#   --types "T ..."       mkmodel types [F16 Q8_0 Q4_K_M]
#   --model FILE          benchmark this GGUF instead of synthetic ones (repeatable)
#   --model-dir DIR       where synthetic models are made / reused [build/bench-models]
#   --serve-types "T ..." which of the types also get the server runs [all of --types]
#   --concurrency "N ..." concurrent streams of the server runs [16 64 128 256]
#   --requests-per-stream R  requests = R x concurrency [2]
#   --prompt-words N      random words per user message [100]
#   --max-tokens N        max_tokens per request [256]
#   --shared-prefix-words K  shared system message of the prefix run; 0 skips it [1000]
#   --prefix-concurrency N   streams of the prefix run [the first --concurrency]
#   --rag-words N         words of each prompt of the long-prompt rows; 0 skips them [2000]
#                         (load.py's words are ~3.3 tokens each with the synthetic 32k
#                         vocabulary: 2000 words ~ 6,650 tokens; 600 words ~ 2,000 tokens)
#   --rag-max-tokens N    max_tokens of the long-prompt rows [128]
#   --rag-concurrency "N ..."  concurrent streams of the long-prompt rows [64]
#   --long-prompt-tokens N   the prompt that arrives while streams run; 0 skips the case [100000]
#   --long-streams N      streams running when it arrives [16]
#   --long-stream-tokens N   max_tokens of those streams (they must outlast it) [4096]
#   --quiet-seconds S     streaming measured before it arrives [5]
#   --ctx-size N          m40 serve --ctx-size of the first server [2048, or more when its
#                         prompts need it]; the long-prompt server gets what its prompts need
#   --max-seqs N          m40 serve --max-seqs [largest --concurrency]
#   --serve-args "..."    extra arguments for every m40 serve, e.g. "--itl-guard off" or
#                         "--prefill-budget 4096" (A/B runs of the prefill policy)
#   --bench-args "..."    extra arguments for m40 bench, e.g. "--reps 5 --gen 256"
#   --bandwidth GB/s      roofline bandwidth [3020: H100 80GB HBM3 copy]
#   --port N              loopback port of the server [18090]
#   --out DIR             logs and raw results [build/bench-results/<date>]
#   --extra-json JSON     passed to load.py (e.g. '{"ignore_eos": true}')
#   --compare-alone N     after each streaming run, its first N requests again one at a
#                         time: the column 'alone' counts the greedy outputs equal to the
#                         concurrent ones (load.py --compare-alone) [0: not checked]
set -u
cd "$(dirname "$0")/../.." || exit 1
ROOT=$(pwd)

M40=${M40:-$ROOT/build/m40}
DEVICE=0
SHAPE=mistral-7b
TYPES="F16 Q8_0 Q4_K_M"
MODELS=()
MODEL_DIR=$ROOT/build/bench-models
SERVE_TYPES=
CONCURRENCY="16 64 128 256"
RPS=2
RAG_WORDS=2000
RAG_MAX_TOKENS=128
RAG_CONC=64
LONG_TOKENS=100000
LONG_STREAMS=16
LONG_STREAM_TOKENS=4096
QUIET_S=5
PROMPT_WORDS=100
MAX_TOKENS=256
PREFIX_WORDS=1000
PREFIX_CONC=
CTX_SIZE=
MAX_SEQS=
BENCH_ARGS=
SERVE_ARGS=
BANDWIDTH=3020
PORT=18090
OUT=
EXTRA_JSON=
COMPARE_ALONE=0

usage() { sed -n '2,/^set -u/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
    if [ $# -lt 2 ] && [ "$1" != -h ] && [ "$1" != --help ]; then
        echo "run-all.sh: $1 needs a value" >&2; exit 2
    fi
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --device) DEVICE=$2 ;;
        --shape) SHAPE=$2 ;;
        --types) TYPES=$2 ;;
        --model) MODELS+=("$2") ;;
        --model-dir) MODEL_DIR=$2 ;;
        --serve-types) SERVE_TYPES=$2 ;;
        --concurrency) CONCURRENCY=$2 ;;
        --requests-per-stream) RPS=$2 ;;
        --prompt-words) PROMPT_WORDS=$2 ;;
        --max-tokens) MAX_TOKENS=$2 ;;
        --shared-prefix-words) PREFIX_WORDS=$2 ;;
        --prefix-concurrency) PREFIX_CONC=$2 ;;
        --rag-words) RAG_WORDS=$2 ;;
        --rag-max-tokens) RAG_MAX_TOKENS=$2 ;;
        --rag-concurrency) RAG_CONC=$2 ;;
        --long-prompt-tokens) LONG_TOKENS=$2 ;;
        --long-streams) LONG_STREAMS=$2 ;;
        --long-stream-tokens) LONG_STREAM_TOKENS=$2 ;;
        --quiet-seconds) QUIET_S=$2 ;;
        --ctx-size) CTX_SIZE=$2 ;;
        --max-seqs) MAX_SEQS=$2 ;;
        --bench-args) BENCH_ARGS=$2 ;;
        --serve-args) SERVE_ARGS=$2 ;;
        --bandwidth) BANDWIDTH=$2 ;;
        --port) PORT=$2 ;;
        --out) OUT=$2 ;;
        --extra-json) EXTRA_JSON=$2 ;;
        --compare-alone) COMPARE_ALONE=$2 ;;
        *) echo "run-all.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
    shift 2
done
for v in "$COMPARE_ALONE" "$PROMPT_WORDS" "$MAX_TOKENS" "$PREFIX_WORDS" "$RAG_WORDS" "$RAG_MAX_TOKENS" "$LONG_TOKENS" "$LONG_STREAMS" "$LONG_STREAM_TOKENS" $RAG_CONC $CONCURRENCY; do
    case $v in ''|*[!0-9]*) echo "run-all.sh: '$v' is not a number" >&2; exit 2 ;; esac
done
if [ -z "$MAX_SEQS" ]; then
    MAX_SEQS=1
    for c in $CONCURRENCY; do [ "$c" -gt "$MAX_SEQS" ] && MAX_SEQS=$c; done
fi
# Contexts from the prompts: load.py's random words take about 3.6 tokens each with
# mistral-7b's vocabulary (300 words + template = 1,072 tokens, BENCHMARKS.md); 4 a
# word leaves a margin. Whole multiples of 1024.
if [ -z "$CTX_SIZE" ]; then
    w=$PROMPT_WORDS
    [ "$PREFIX_WORDS" -gt 0 ] && [ $((PREFIX_WORDS + 20)) -gt "$w" ] && w=$((PREFIX_WORDS + 20))
    CTX_SIZE=$(( (4 * w + MAX_TOKENS + 256 + 1023) / 1024 * 1024 ))
    [ "$CTX_SIZE" -lt 2048 ] && CTX_SIZE=2048
fi
# The long-prompt server: a --rag-words prompt plus its answer, and the long prompt with
# a margin (load.py aims at its token count from a calibration).
LONG_CTX=0
[ "$RAG_WORDS" -gt 0 ] && LONG_CTX=$((4 * RAG_WORDS + RAG_MAX_TOKENS + 256))
[ "$LONG_TOKENS" -gt 0 ] && [ $((LONG_TOKENS + LONG_TOKENS / 8 + 1024)) -gt "$LONG_CTX" ] &&
    LONG_CTX=$((LONG_TOKENS + LONG_TOKENS / 8 + 1024))
LONG_CTX=$(( (LONG_CTX + 1023) / 1024 * 1024 ))
LONG_MAX_SEQS=$MAX_SEQS
for c in $RAG_CONC $((LONG_STREAMS + 1)); do [ "$c" -gt "$LONG_MAX_SEQS" ] && LONG_MAX_SEQS=$c; done
OUT=${OUT:-$ROOT/build/bench-results/$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT" || exit 1
LOAD="python3 $ROOT/tests/bench/load.py"

say() { echo "== $*" >&2; }
# Rows of the tables, tab-separated, filled as the run goes.
ENGINE_ROWS=()
SERVER_ROWS=()
LONG_ROWS=()

# ---- the machine -------------------------------------------------------------------
MACHINE_CPU=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo 2>/dev/null | head -1)
MACHINE_NCPU=$(nproc 2>/dev/null || echo "?")
if command -v nvidia-smi >/dev/null 2>&1; then
    MACHINE_GPU=$(nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader 2>/dev/null | tr '\n' ';')
else
    MACHINE_GPU="none (no nvidia-smi)"
fi
REV=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)
if [ -n "$(git -C "$ROOT" status --porcelain 2>/dev/null | head -1)" ]; then REV="$REV+local changes"; fi

# ---- prerequisites -----------------------------------------------------------------
HAVE_M40=1
if [ ! -x "$M40" ]; then
    say "no m40 binary at $M40: build it with 'make -j build/m40' (or set M40=path); nothing can be measured"
    HAVE_M40=0
fi
# The subcommands this m40 has, read once (commands still being written are absent).
M40_HELP=
[ "$HAVE_M40" = 1 ] && M40_HELP=$("$M40" --help 2>&1)
has_cmd() { grep -q "^  m40 $1\b" <<<"$M40_HELP"; }
HAVE_PY=1
command -v python3 >/dev/null 2>&1 || { say "python3 missing: the server runs (load.py) are skipped"; HAVE_PY=0; }

# ---- models --------------------------------------------------------------------------
# Each entry: LABEL<TAB>PATH, or LABEL<TAB>!reason when it could not be made.
ENTRIES=()
if [ ${#MODELS[@]} -gt 0 ]; then
    for f in "${MODELS[@]}"; do
        if [ -r "$f" ]; then ENTRIES+=("$(basename "$f" .gguf)	$f"); else ENTRIES+=("$(basename "$f" .gguf)	!cannot read $f"); fi
    done
    [ -z "$SERVE_TYPES" ] && SERVE_TYPES=all
else
    mkdir -p "$MODEL_DIR" || exit 1
    MK_OUT_OPT=
    if has_cmd mkmodel; then
        # The output option of m40 mkmodel, from its own help.
        mkhelp=$("$M40" mkmodel --help 2>&1)
        if grep -q -- "--output" <<<"$mkhelp"; then MK_OUT_OPT=--output
        elif grep -q -- "--out\b" <<<"$mkhelp"; then MK_OUT_OPT=--out
        elif grep -q -- "-o " <<<"$mkhelp"; then MK_OUT_OPT=-o
        else MK_OUT_OPT=positional; fi
    fi
    for t in $TYPES; do
        f=$MODEL_DIR/$SHAPE-$t.gguf
        if [ -s "$f" ]; then
            say "reusing $f"
            ENTRIES+=("$SHAPE $t	$f")
        elif [ -z "$MK_OUT_OPT" ]; then
            ENTRIES+=("$SHAPE $t	!m40 mkmodel is not in this build")
        else
            say "making $f (m40 mkmodel --shape $SHAPE --type $t)"
            if [ "$MK_OUT_OPT" = positional ]; then
                "$M40" mkmodel --shape "$SHAPE" --type "$t" "$f" >"$OUT/mkmodel-$t.log" 2>&1
            else
                "$M40" mkmodel --shape "$SHAPE" --type "$t" "$MK_OUT_OPT" "$f" >"$OUT/mkmodel-$t.log" 2>&1
            fi
            if [ $? -eq 0 ] && [ -s "$f" ]; then
                ENTRIES+=("$SHAPE $t	$f")
            else
                ENTRIES+=("$SHAPE $t	!m40 mkmodel failed: $(tail -1 "$OUT/mkmodel-$t.log")")
            fi
        fi
    done
    [ -z "$SERVE_TYPES" ] && SERVE_TYPES=$TYPES
fi

# ---- m40 bench -------------------------------------------------------------------------
kv() { sed -n 's/^result: .*\b'"$2"'=\([^ ]*\).*/\1/p' "$1" | tail -1; }
for e in "${ENTRIES[@]}"; do
    label=${e%%	*}; path=${e#*	}
    if [[ $path == '!'* ]]; then ENGINE_ROWS+=("$label	${path#!}"); continue; fi
    if ! has_cmd bench; then ENGINE_ROWS+=("$label	m40 bench is not in this build"); continue; fi
    log=$OUT/bench-${label// /-}.log
    say "m40 bench $path --device $DEVICE $BENCH_ARGS"
    # shellcheck disable=SC2086
    "$M40" bench "$path" --device "$DEVICE" --bandwidth "$BANDWIDTH" $BENCH_ARGS >"$log" 2>&1
    rc=$?
    if [ $rc -ne 0 ] || ! grep -q '^result:' "$log"; then
        ENGINE_ROWS+=("$label	m40 bench failed (exit $rc): $(grep -v '^ *$' "$log" | tail -1)")
        continue
    fi
    wb=$(kv "$log" weight_bytes)
    ENGINE_ROWS+=("$label	$(awk -v b="$wb" 'BEGIN{printf (b >= 1e9 ? "%.2f" : "%.3g"), b/1e9}')	$(kv "$log" prefill_tok_s)	$(kv "$log" decode_tok_s)	$(awk -v b="$wb" -v bw="$BANDWIDTH" 'BEGIN{printf "%.1f", bw*1e9/b}')	$(kv "$log" roofline_pct)	$(kv "$log" device)")
done

# ---- m40 serve + load.py ---------------------------------------------------------------
SERVE_PID=
stop_server() {
    if [ -n "$SERVE_PID" ] && kill -0 "$SERVE_PID" 2>/dev/null; then
        kill -TERM "$SERVE_PID" 2>/dev/null
        for _ in $(seq 50); do kill -0 "$SERVE_PID" 2>/dev/null || break; sleep 0.2; done
        kill -0 "$SERVE_PID" 2>/dev/null && kill -KILL "$SERVE_PID" 2>/dev/null
        wait "$SERVE_PID" 2>/dev/null
    fi
    SERVE_PID=
}
trap 'stop_server' EXIT
trap 'stop_server; exit 130' INT TERM

port_answers() {
    python3 - "$PORT" <<'EOF'
import socket, sys
s = socket.socket()
s.settimeout(1)
sys.exit(0 if s.connect_ex(("127.0.0.1", int(sys.argv[1]))) == 0 else 1)
EOF
}
# Waits until GET /health answers 200 (the model is loaded: /v1/models answers while it
# is still loading), the server exits, or 600 s.
wait_ready() {
    python3 - "$PORT" "$SERVE_PID" <<'EOF'
import os, sys, time, urllib.request
port, pid = sys.argv[1], int(sys.argv[2])
deadline = time.time() + 600
while time.time() < deadline:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit(2)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            if r.status == 200:
                sys.exit(0)
    except Exception:
        pass
    time.sleep(0.5)
sys.exit(1)
EOF
}
jget() { python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); v=d.get(sys.argv[2]); print("-" if v is None else (f"{v:.1f}" if isinstance(v,float) else v))' "$1" "$2"; }

# engine thread per step, from /metrics: tokens/step, forward / sample+events / schedule ms
# (and, when a GPU engine's helper threads worked, the sample's grammar wait + picks)
estep() { python3 -c 'import json,sys; e=json.load(open(sys.argv[1])).get("engine") or {}; st=e.get("steps") or 0
x = " (%.2f+%.2f)" % (1e3*e.get("grammar_wait", 0)/st, 1e3*e.get("pick", 0)/st) if st and (e.get("grammar_wait") or e.get("pick")) else ""
print("-" if not st else "%.1f  %.2f/%.2f/%.2f%s" % (e["step_tokens"]/st, 1e3*e["forward"]/st, 1e3*e["sample"]/st, 1e3*e["schedule"]/st, x))' "$1"; }

in_serve_types() { [ "$SERVE_TYPES" = all ] && return 0; for t in $SERVE_TYPES; do [ "$1" = "$SHAPE $t" ] && return 0; done; return 1; }

# Starts `m40 serve` on PATH with context CTX and SEQS slots (log in $slog, name $name);
# 0 when /health says ready, else 1 with the reason in START_ERR.
START_ERR=
start_server() {
    local path=$1 ctx=$2 seqs=$3
    START_ERR=
    if port_answers; then START_ERR="port $PORT is already in use: pass --port"; return 1; fi
    say "m40 serve $path --port $PORT --device $DEVICE --ctx-size $ctx --max-seqs $seqs $SERVE_ARGS (log $slog)"
    # shellcheck disable=SC2086
    "$M40" serve "$path" --port "$PORT" --device "$DEVICE" --name "$name" --ctx-size "$ctx" \
        --max-seqs "$seqs" $SERVE_ARGS >"$slog" 2>&1 &
    SERVE_PID=$!
    wait_ready
    local rc=$?
    if [ $rc -ne 0 ]; then
        START_ERR="server exited"
        [ $rc = 1 ] && START_ERR="server not ready after 600 s"
        START_ERR="$START_ERR: $(grep -v '^ *$' "$slog" | grep -iv notice | tail -1)"
        stop_server
        return 1
    fi
    # what the server sized (the KV cache line of its error log)
    grep -o 'KV cache: .*' "$slog" | head -1 | sed 's/^/   /' >&2
    return 0
}

# One load.py run of streaming chats: concurrency $1, $2-word prompts, max_tokens $3,
# seed $4, into $res; appends the row "$label<TAB>$5<TAB>..." to SERVER_ROWS.
load_row() {
    local c=$1 words=$2 maxtok=$3 seed=$4 kind=$5
    say "load.py --concurrency $c --requests $((RPS * c)) --prompt-words $words --max-tokens $maxtok --seed $seed"
    local cmp=()
    [ "$COMPARE_ALONE" -gt 0 ] && cmp=(--compare-alone "$COMPARE_ALONE")
    $LOAD --url "http://127.0.0.1:$PORT" --model "$name" --concurrency "$c" --requests $((RPS * c)) \
        --prompt-words "$words" --max-tokens "$maxtok" --seed "$seed" --metrics "${extra[@]}" "${cmp[@]}" \
        --json >"$res" 2>"$res.err"
    if ! python3 -c 'import json,sys; json.load(open(sys.argv[1]))' "$res" 2>/dev/null; then
        SERVER_ROWS+=("$label	$kind	load.py failed: $(tail -1 "$res.err")")
        return
    fi
    if [ "$(jget "$res" ok)" = 0 ]; then
        SERVER_ROWS+=("$label	$kind	$(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print("0/%d ok (%d rejected with 429, %d failed): %s" % (d["requests"], d["rejected"], d["failed"], "; ".join(d["error_kinds"])[:200]))' "$res")")
        return
    fi
    SERVER_ROWS+=("$label	$kind	$(jget "$res" ok)/$(jget "$res" requests)	$(jget "$res" rejected)	$(jget "$res" failed)	$(jget "$res" gen_tok_s)	$(jget "$res" ttft_p50_ms)	$(jget "$res" ttft_p99_ms)	$(jget "$res" itl_p50_ms)	$(jget "$res" itl_p99_ms)	$(jget "$res" mean_tokens_per_request)	$(estep "$res")$(alone_col "$res")")
}

# "<TAB>same/compared" of a run with --compare-alone, else nothing
alone_col() {
    [ "$COMPARE_ALONE" -gt 0 ] || return 0
    python3 -c 'import json,sys; a=json.load(open(sys.argv[1])).get("alone") or {}; print("\t%s/%s" % (a.get("identical", "-"), a.get("compared", "-")), end="")' "$1"
}

for e in "${ENTRIES[@]}"; do
    label=${e%%	*}; path=${e#*	}
    in_serve_types "$label" || continue
    if [[ $path == '!'* ]]; then SERVER_ROWS+=("$label	-	${path#!}"); continue; fi
    if [ "$HAVE_PY" = 0 ]; then SERVER_ROWS+=("$label	-	python3 missing"); continue; fi
    if ! has_cmd serve; then SERVER_ROWS+=("$label	-	m40 serve is not in this build"); continue; fi
    slog=$OUT/serve-${label// /-}.log
    name=bench-${label// /-}
    if ! start_server "$path" "$CTX_SIZE" "$MAX_SEQS"; then
        SERVER_ROWS+=("$label	-	$START_ERR")
        continue
    fi
    extra=()
    [ -n "$EXTRA_JSON" ] && extra=(--extra-json "$EXTRA_JSON")
    # every load.py run of one server gets prompts of its own (--seed): with the same seed
    # a later run would find the earlier run's prompts in the prefix cache
    seed=0
    for c in $CONCURRENCY; do
        res=$OUT/load-${label// /-}-c$c.json
        seed=$((seed + 1))
        load_row "$c" "$PROMPT_WORDS" "$MAX_TOKENS" "$seed" "$c streams"
    done
    if [ "$PREFIX_WORDS" -gt 0 ]; then
        c=${PREFIX_CONC:-$(set -- $CONCURRENCY; echo "$1")}
        res=$OUT/load-${label// /-}-prefix.json
        say "load.py shared prefix: $PREFIX_WORDS-word system message, --concurrency $c"
        $LOAD --url "http://127.0.0.1:$PORT" --model "$name" --concurrency "$c" --requests $((RPS * c)) \
            --prompt-words 20 --shared-prefix-words "$PREFIX_WORDS" --max-tokens 32 --seed $((seed + 1)) \
            --metrics "${extra[@]}" --json >"$res" 2>"$res.err"
        if python3 -c 'import json,sys; json.load(open(sys.argv[1]))' "$res" 2>/dev/null; then
            PREFIX_ROW=$(python3 -c '
import json, sys
d = json.load(open(sys.argv[1]))
pt, pc = d.get("prompt_tokens") or 0, d.get("prompt_tokens_computed")
if not d["ok"]:
    print("0/%d ok: %s" % (d["requests"], "; ".join(d["error_kinds"])[:200]))
elif pc is None:
    print("/metrics unavailable: %s" % d.get("metrics_error"))
else:
    print("%d/%d ok, %d prompt tokens sent, %d computed (%.1f%% reused), TTFT p50 %s ms" % (d["ok"], d["requests"],
          pt, pc, 100.0 * (1 - pc / pt) if pt else 0.0,
          "-" if d.get("ttft_p50_ms") is None else "%.1f" % d["ttft_p50_ms"]))' "$res")
            SERVER_ROWS+=("$label	prefix	$PREFIX_ROW")
        else
            SERVER_ROWS+=("$label	prefix	load.py failed: $(tail -1 "$res.err")")
        fi
    fi
    stop_server

    # ---- the long-prompt server: RAG rows, then a long prompt while streaming ----
    [ "$LONG_CTX" -gt 0 ] || continue
    slog=$OUT/serve-${label// /-}-long.log
    if ! start_server "$path" "$LONG_CTX" "$LONG_MAX_SEQS"; then
        [ "$RAG_WORDS" -gt 0 ] && SERVER_ROWS+=("$label	rag	$START_ERR")
        [ "$LONG_TOKENS" -gt 0 ] && LONG_ROWS+=("$label	-	$START_ERR")
        continue
    fi
    if [ "$RAG_WORDS" -gt 0 ]; then
        for c in $RAG_CONC; do
            res=$OUT/load-${label// /-}-rag-c$c.json
            seed=$((seed + 1))
            load_row "$c" "$RAG_WORDS" "$RAG_MAX_TOKENS" "$seed" "rag $c"
        done
    fi
    if [ "$LONG_TOKENS" -gt 0 ]; then
        res=$OUT/load-${label// /-}-long.json
        seed=$((seed + 1))
        # the streams must run through the long prompt: end of sequence does not end them
        lx=$(python3 -c 'import json,sys; d=json.loads(sys.argv[1]) if sys.argv[1] else {}; d.setdefault("ignore_eos", True); print(json.dumps(d))' "$EXTRA_JSON")
        say "load.py long prompt: $LONG_STREAMS streams, then ~$LONG_TOKENS prompt tokens after ${QUIET_S} s"
        $LOAD --url "http://127.0.0.1:$PORT" --model "$name" --concurrency "$LONG_STREAMS" \
            --prompt-words "$PROMPT_WORDS" --max-tokens "$LONG_STREAM_TOKENS" --seed "$seed" \
            --long-prompt-tokens "$LONG_TOKENS" --quiet-seconds "$QUIET_S" --extra-json "$lx" \
            --json >"$res" 2>"$res.err"
        if python3 -c 'import json,sys; json.load(open(sys.argv[1]))' "$res" 2>/dev/null; then
            LONG_ROWS+=("$(python3 - "$res" "$label" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
def f(v, fmt="%.1f"):
    return "-" if v is None else fmt % v
print("\t".join([sys.argv[2], "%d+1" % d["concurrency"], f(d["long_prompt_tokens"], "%d"),
                 "%.2f" % d["long_s"] + ("" if d["long_ok"] else " (failed)"),
                 f(d["itl_quiet_p50_ms"]), f(d["itl_quiet_p99_ms"]), f(d["itl_long_p50_ms"]),
                 f(d["itl_long_p99_ms"]), f(d["itl_p99_ratio"], "%.2fx"), str(d["rejected"]), str(d["failed"]),
                 str(d["streams_ended_early"])]))
EOF
)")
        else
            LONG_ROWS+=("$label	-	load.py failed: $(tail -1 "$res.err")")
        fi
    fi
    stop_server
done

# ---- the table ---------------------------------------------------------------------
row() { # prints tab-separated fields in fixed columns; a 2-field row is a message row
    local IFS='	'; local -a f; read -r -a f <<<"$1"; shift
    local widths=("$@") i out=""
    if [ ${#f[@]} -le 3 ] && [ ${#f[@]} -lt ${#widths[@]} ]; then
        for ((i = 0; i < ${#f[@]} - 1; i++)); do out+=$(printf "%-${widths[$i]}s " "${f[$i]}"); done
        echo "$out${f[${#f[@]}-1]}"; return
    fi
    for ((i = 0; i < ${#f[@]}; i++)); do out+=$(printf "%-${widths[$i]:-10}s " "${f[$i]}"); done
    echo "$out"
}
echo
echo "m40 benchmark table  ($(date -u '+%Y-%m-%d %H:%M UTC'), m40 $REV)"
echo "machine: $MACHINE_CPU x $MACHINE_NCPU CPUs; GPU: $MACHINE_GPU"
echo "device: $DEVICE; roofline bandwidth $BANDWIDTH GB/s; raw output in $OUT"
[ -n "$SERVE_ARGS" ] && echo "m40 serve extra arguments: $SERVE_ARGS"
echo
echo "engine (m40 bench $BENCH_ARGS: prefill of a random prompt, batch-1 greedy decode; roofline = bandwidth / weight bytes)"
row "model	weights GB	prefill tok/s	decode tok/s	roofline tok/s	% roofline	device" 18 11 14 13 15 11 7
for r in "${ENGINE_ROWS[@]}"; do row "$r" 18 11 14 13 15 11 7; done
if [ ${#SERVER_ROWS[@]} -gt 0 ]; then
    echo
    echo "server (m40 serve + load.py: streaming chats, $PROMPT_WORDS-word prompts, max_tokens $MAX_TOKENS, temperature 0;"
    echo "  'rag N': N streams of $RAG_WORDS-word prompts, max_tokens $RAG_MAX_TOKENS, on a server with --ctx-size $LONG_CTX;"
    echo "  429: requests refused with the queue full; failed: other errors)"
    row "model	load	ok/req	429	failed	gen tok/s	TTFT p50 ms	TTFT p99 ms	ITL p50 ms	ITL p99 ms	tokens/req	tok/step  ms/step fwd/sample/sched$([ "$COMPARE_ALONE" -gt 0 ] && printf '\talone')" 18 11 9 5 7 10 12 12 11 11 10 30
    for r in "${SERVER_ROWS[@]}"; do row "$r" 18 11 9 5 7 10 12 12 11 11 10 30; done
fi
if [ ${#LONG_ROWS[@]} -gt 0 ]; then
    echo
    echo "long prompt while streaming ($LONG_STREAMS streams of $PROMPT_WORDS-word prompts, then one prompt of ~$LONG_TOKENS tokens"
    echo "  and max_tokens 1 after ${QUIET_S} s; ITL ms of the streams before it ('quiet') and until it is answered ('long');"
    echo "  early: streams that ended before it was answered)"
    row "model	streams	prompt tok	answered s	quiet p50	quiet p99	long p50	long p99	p99 ratio	429	failed	early" 18 8 11 11 10 10 10 10 10 5 7 6
    for r in "${LONG_ROWS[@]}"; do row "$r" 18 8 11 11 10 10 10 10 10 5 7 6; done
fi
