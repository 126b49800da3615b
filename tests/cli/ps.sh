#!/usr/bin/env bash
# m40 ps: the table from /health, both shapes (one model's object, {"models": [...]}),
# a loading model (503 with its JSON), and a clear error when nothing answers. The
# module's side (the fields of a real server) is tests/integration's test_m40_serve.
cd "$(dirname "$0")/../.." || exit 1
source tests/cli/lib.bash
tmp=$(mktemp -d)
srvpid=
trap '[ -n "$srvpid" ] && kill "$srvpid" 2>/dev/null; rm -rf "$tmp"' EXIT

if ! "$M40" ps --help >/dev/null 2>&1; then
    skip "m40 ps is not in this build"; done_tests; exit
fi

# serves $tmp/health.json at /health with the status in $tmp/status
cat >"$tmp/srv.py" <<'PY'
import http.server, os, sys
d = sys.argv[1]
class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def do_GET(self):
        body = open(os.path.join(d, "health.json"), "rb").read() if self.path == "/health" else b"{}"
        self.send_response(int(open(os.path.join(d, "status")).read()) if self.path == "/health" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
s = http.server.HTTPServer(("127.0.0.1", 0), H)
open(os.path.join(d, "port"), "w").write(str(s.server_address[1]))
s.serve_forever()
PY
python3 "$tmp/srv.py" "$tmp" &
srvpid=$!
for _ in $(seq 100); do [ -s "$tmp/port" ] && break; sleep 0.1; done
url=http://127.0.0.1:$(cat "$tmp/port")

echo 200 >"$tmp/status"
echo '{"status":"ready","model":"tiny","device":"cuda:1","memory_bytes":3221225472,"ctx_size":4096,"max_seqs":64,"running":3,"queued":2,"kv_tokens_used":100,"kv_tokens_total":1000}' >"$tmp/health.json"
"$M40" ps "$url/" >"$tmp/out" 2>"$tmp/err"; rc=$?
check "one model: exit 0" [ $rc -eq 0 ]
check "one model: header" grep -qE "^NAME +STATE +DEVICE +MEMORY +SEQUENCES +QUEUED +CONTEXT" "$tmp/out"
check "one model: its row" grep -qE "^tiny +ready +cuda:1 +3.00 GiB +3/64 +2 +4096$" "$tmp/out"

echo '{"models":[{"model":"a","status":"ready","device":"cpu","memory_bytes":104857600,"ctx_size":512,"max_seqs":4,"running":0,"queued":0},{"model":"b","status":"loading"}]}' >"$tmp/health.json"
echo 503 >"$tmp/status"
"$M40" ps "$url" >"$tmp/out" 2>"$tmp/err"; rc=$?
check "several models: exit 0 (a 503 still has the JSON)" [ $rc -eq 0 ]
check "several models: the ready one" grep -qE "^a +ready +cpu +100.0 MiB +0/4 +0 +512$" "$tmp/out"
check "several models: the loading one, without numbers" grep -qE "^b +loading +- +- +-/- +- +-$" "$tmp/out"

echo 'not json' >"$tmp/health.json"
"$M40" ps "$url" >"$tmp/out" 2>"$tmp/err"; rc=$?
check "not m40: exit 1" [ $rc -eq 1 ]
check "not m40: said" grep -q "without the JSON of m40's /health" "$tmp/err"

kill "$srvpid"; wait "$srvpid" 2>/dev/null; srvpid=
"$M40" ps "$url" >"$tmp/out" 2>"$tmp/err"; rc=$?
check "nothing answers: exit 1" [ $rc -eq 1 ]
check "nothing answers: said" grep -q "no m40 server answers at $url" "$tmp/err"
"$M40" ps a b >/dev/null 2>&1; check "two URLs: exit 2" [ $? -eq 2 ]

done_tests
