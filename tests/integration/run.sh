#!/usr/bin/env bash
# Integration tests: the real /usr/sbin/nginx with the m40 module, driven by the
# official OpenAI Python SDK and raw HTTP. Ends with "N passed, N failed, N skipped".
#
# Builds nothing (make does). Starts the main instance from conf/minimal.conf on a
# free loopback port; the tests start the other instances they need (small queue,
# broken model, TLS + API key, behind a proxy, `m40 serve`).
set -u
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
export M40_SHARED=${M40_SHARED:-$(cd .. && pwd)/shared}
# The main model: the shared fixtures' stories260K, or, on a fresh clone without them,
# one made here (below: m40 mkmodel's tiny llama shape, random weights; the API tests
# need no meaning, and the tests that need the fixtures' real models skip).
made_model=""
if [ -z "${M40_MODEL:-}" ]; then
    M40_MODEL=$M40_SHARED/models/stories260K.gguf
    [ -f "$M40_MODEL" ] || { made_model=yes; M40_MODEL=""; }
fi
export M40_MODEL
export M40_MODULE=${M40_MODULE:-$ROOT/build/ngx_http_m40_module.so}
export M40_NGINX=${M40_NGINX:-/usr/sbin/nginx}
export PYTHONDONTWRITEBYTECODE=1

summary() { echo "$1 passed, $2 failed, $3 skipped"; }

if [ -z "$made_model" ] && [ ! -f "$M40_MODEL" ]; then
    echo "SKIP: M40_MODEL=$M40_MODEL not found"
    summary 0 0 1; exit 0
fi
if [ ! -x "$M40_NGINX" ]; then
    echo "SKIP: $M40_NGINX not found (install nginx)"
    summary 0 0 1; exit 0
fi
if [ ! -f "$M40_MODULE" ]; then
    echo "FAIL: $M40_MODULE is missing: run 'make' (configure must find the nginx source tree)"
    summary 0 1 0; exit 1
fi

# Project-local virtual environment, created once and reused.
VENV=$ROOT/.venv
PY=$VENV/bin/python
if ! "$PY" -c 'import openai, anthropic, pydantic, pytest, requests, jsonschema' 2>/dev/null; then
    echo "setting up $VENV (openai, anthropic, pytest, requests, jsonschema from PyPI)"
    { [ -x "$PY" ] || python3 -m venv "$VENV"; } && "$VENV/bin/pip" install -q openai anthropic pydantic pytest requests jsonschema
    if ! "$PY" -c 'import openai, anthropic, pydantic, pytest, requests, jsonschema' 2>/dev/null; then
        echo "FAIL: cannot set up the Python environment in $VENV"
        summary 0 1 0; exit 1
    fi
fi

work=$(mktemp -d /tmp/m40-it-main-XXXXXX)
chmod 755 "$work"
if [ -n "$made_model" ]; then
    M40_MODEL=$work/tiny-llama-f16.gguf
    echo "$M40_SHARED/models/stories260K.gguf absent: testing with $M40_MODEL (m40 mkmodel --shape tiny)"
    if ! "$ROOT/build/m40" mkmodel --shape tiny --type F16 --seed 1 "$M40_MODEL" >/dev/null; then
        rm -rf "$work"
        echo "FAIL: cannot make a model with build/m40 mkmodel"
        summary 0 1 0; exit 1
    fi
    chmod 644 "$M40_MODEL"
fi
nginx_pid=""
stop_nginx() {
    if [ -n "$nginx_pid" ] && kill -0 "$nginx_pid" 2>/dev/null; then
        kill -QUIT "$nginx_pid"
        for _ in $(seq 1 150); do kill -0 "$nginx_pid" 2>/dev/null || break; sleep 0.1; done
        kill -0 "$nginx_pid" 2>/dev/null && kill -KILL "$nginx_pid"
        wait "$nginx_pid" 2>/dev/null
    fi
    nginx_pid=""
}
trap 'stop_nginx; rm -rf "$work"' EXIT

port=$("$PY" tests/integration/harness.py port)
if ! "$PY" tests/integration/harness.py render conf/minimal.conf "$work" "$port"; then
    echo "FAIL: cannot render conf/minimal.conf"
    summary 0 1 0; exit 1
fi
nginx_args=(-p "$work" -c "$work/nginx.conf" -e "$work/error.log"
            -g "pid $work/nginx.pid; daemon off; error_log $work/error.log info;")
if ! "$M40_NGINX" -t "${nginx_args[@]}" >"$work/nginx-t.log" 2>&1; then
    cat "$work/nginx-t.log"
    echo "FAIL: nginx -t rejects conf/minimal.conf with the module"
    summary 0 1 0; exit 1
fi
"$M40_NGINX" "${nginx_args[@]}" >/dev/null 2>&1 &
nginx_pid=$!

base=http://127.0.0.1:$port
ready=0
for _ in $(seq 1 600); do
    if curl -sf "$base/health" >/dev/null 2>&1; then ready=1; break; fi
    kill -0 "$nginx_pid" 2>/dev/null || break
    sleep 0.1
done
if [ $ready -ne 1 ]; then
    echo "FAIL: the server did not become ready"; tail -n 30 "$work/error.log"
    summary 0 1 0; exit 1
fi

export M40_BASE_URL=$base M40_MAIN_ERROR_LOG=$work/error.log
"$PY" -m pytest tests/integration -q -p no:cacheprovider --junitxml="$work/junit.xml" 2>&1
stop_nginx

crashed=0
if ! "$PY" tests/integration/harness.py crashes "$work/error.log" >"$work/crashes"; then
    echo "FAIL: the main nginx instance logged:"; cat "$work/crashes"
    crashed=1
fi

# The plain summary line, from pytest's junit report (errors count as failures).
"$PY" - "$work/junit.xml" "$crashed" <<'EOF'
import sys, xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except Exception as e:
    print(f"FAIL: no pytest report ({e})")
    print("0 passed, 1 failed, 0 skipped")
    sys.exit(1)
suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
t = sum(int(s.get("tests", 0)) for s in suites)
f = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites) + int(sys.argv[2])
k = sum(int(s.get("skipped", 0)) for s in suites)
p = t - k - sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
print(f"{p} passed, {f} failed, {k} skipped")
sys.exit(1 if f else 0)
EOF
