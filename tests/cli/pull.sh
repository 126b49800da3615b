#!/usr/bin/env bash
# m40 pull, list, rm (and store names in info, run, serve) against tests/cli/hub.py, a
# loopback server with the hub's URL layout: redirects, X-Linked-ETag, Range, a dropped
# connection, a wrong checksum, a file that is not GGUF, 404 and 401. The models are
# tiny ones made here with m40 mkmodel.
cd "$(dirname "$0")/../.." || exit 1
source tests/cli/lib.bash
tmp=$(mktemp -d)
hubpid=
trap '[ -n "$hubpid" ] && kill "$hubpid" 2>/dev/null; rm -rf "$tmp"' EXIT

if ! "$M40" pull --help >/dev/null 2>&1; then
    skip "m40 pull is not in this build"; done_tests; exit
fi
if ! command -v python3 >/dev/null; then
    skip "python3 absent"; done_tests; exit
fi

hub=$tmp/hub
mkdir -p "$hub"/org/{multi/sub,split,private,badsum,drop,junk,slow,full}
mk() { "$M40" mkmodel --shape tiny --type "$1" --seed "${3:-1}" "$2" >/dev/null 2>"$tmp/mk.err" || cat "$tmp/mk.err"; }
mk Q8_0 "$hub/org/multi/tiny-Q8_0.gguf"
mk Q4_0 "$hub/org/multi/tiny-Q4_0.gguf"
mk F16 "$hub/org/multi/sub/tiny-F16.gguf"
echo "a model card" >"$hub/org/multi/README.md"
mk Q8_0 "$hub/org/split/big-00001-of-00002.gguf" 1
mk Q4_0 "$hub/org/split/big-00002-of-00002.gguf" 2
mk Q8_0 "$hub/org/private/p-Q8_0.gguf"
mk Q8_0 "$hub/org/badsum/b-Q8_0.gguf"
mk F16 "$hub/org/drop/d-F16.gguf"
mk F16 "$hub/org/slow/s-F16.gguf"
mk Q8_0 "$hub/org/full/f-Q8_0.gguf"
head -c 200000 /dev/urandom >"$hub/org/junk/notgguf-Q8_0.gguf"

python3 tests/cli/hub.py "$hub" "$tmp/port" "$tmp/log" 2>"$tmp/hub.err" &
hubpid=$!
for _ in $(seq 100); do [ -s "$tmp/port" ] && break; sleep 0.1; done
if [ ! -s "$tmp/port" ]; then
    bad "the test hub did not start: $(cat "$tmp/hub.err")"; done_tests; exit
fi
port=$(cat "$tmp/port")
export HF_ENDPOINT=http://127.0.0.1:$port/ M40_MODELS=$tmp/store HOME=$tmp/home
unset HF_TOKEN HF_HOME HF_TOKEN_PATH XDG_CACHE_HOME
store=$tmp/store
same() { cmp -s "$1" "$2"; }
sha() { python3 -c 'import hashlib,sys; print(hashlib.sha256(open(sys.argv[1],"rb").read()).hexdigest())' "$1"; }
cdn_gets() { grep -c "^GET /cdn/$1 " "$tmp/log"; }

# ---- usage ----
"$M40" pull >/dev/null 2>&1; check "no argument: exit 2" [ $? -eq 2 ]
"$M40" pull justaname >/dev/null 2>&1; check "no ORG/: exit 2" [ $? -eq 2 ]
"$M40" pull org/multi/README.md >/dev/null 2>&1; check "a FILE that is not .gguf: exit 2" [ $? -eq 2 ]
"$M40" pull org/multi/../x.gguf >/dev/null 2>&1; check "'..' in FILE: exit 2" [ $? -eq 2 ]
"$M40" pull org/multi --revision "$(printf 'r%.0s' $(seq 300))" >/dev/null 2>"$tmp/err"; rc=$?
check "a revision of 300 bytes: exit 2" [ $rc -eq 2 ]
check "... saying so" grep -q "longer than 255 bytes" "$tmp/err"

# ---- choosing the file ----
"$M40" pull org/multi >"$tmp/out" 2>"$tmp/err"; rc=$?
check "several models, no quant: exit 1" [ $rc -eq 1 ]
check "the choices are listed" grep -q "m40 pull org/multi/tiny-Q8_0.gguf" "$tmp/err"
check "... all of them" grep -q "m40 pull org/multi/sub/tiny-F16.gguf" "$tmp/err"
check "... GGUF files only" bash -c "! grep -q README '$tmp/err'"
"$M40" pull org/multi:Q5_K_M >/dev/null 2>"$tmp/err"; rc=$?
check "no file of that quant: exit 1" [ $rc -eq 1 ]
check "no file of that quant: said" grep -q "matches the quantization Q5_K_M" "$tmp/err"
"$M40" pull org/multi/nope.gguf >/dev/null 2>"$tmp/err"; rc=$?
check "a missing FILE: exit 1" [ $rc -eq 1 ]
check "a missing FILE: the files are listed" grep -q "tiny-Q4_0.gguf" "$tmp/err"

# ---- a download: redirect followed, sha256 verified, quant case-insensitive ----
"$M40" pull org/multi:q8_0 >"$tmp/out" 2>"$tmp/err"; rc=$?
check "pull ORG/REPO:quant: exit 0 ($(tail -1 "$tmp/err"))" [ $rc -eq 0 ]
check "prints the store name" [ "$(cat "$tmp/out")" = org/multi/tiny-Q8_0.gguf ]
check "the file is in the store, whole" same "$store/org/multi/tiny-Q8_0.gguf" "$hub/org/multi/tiny-Q8_0.gguf"
check "its .sha256 is sha256sum's format" [ "$(cat "$store/org/multi/tiny-Q8_0.gguf.sha256")" = "$(sha "$hub/org/multi/tiny-Q8_0.gguf")  tiny-Q8_0.gguf" ]
check "no .partial left" [ ! -e "$store/org/multi/tiny-Q8_0.gguf.partial" ]
check "the redirect was followed" grep -q "^GET /cdn/org/multi/tiny-Q8_0.gguf - " "$tmp/log"
check "the other files were not fetched" bash -c "! grep -q '^GET /cdn/org/multi/tiny-Q4_0' '$tmp/log'"
"$M40" pull org/multi:Q8_0 >/dev/null 2>"$tmp/err"; rc=$?
check "a second pull: exit 0" [ $rc -eq 0 ]
check "a second pull: up to date" grep -q "up to date" "$tmp/err"
check "a second pull: no download" [ "$(cdn_gets org/multi/tiny-Q8_0.gguf)" -eq 1 ]
"$M40" pull org/multi/sub/tiny-F16.gguf >/dev/null 2>"$tmp/err"; rc=$?
check "pull ORG/REPO/DIR/FILE.gguf: exit 0" [ $rc -eq 0 ]
check "... kept in its folder" same "$store/org/multi/sub/tiny-F16.gguf" "$hub/org/multi/sub/tiny-F16.gguf"

# ---- resume: a .partial left by an interrupted pull continues with Range ----
mkdir -p "$store/org/multi"
head -c 5000 "$hub/org/multi/tiny-Q4_0.gguf" >"$store/org/multi/tiny-Q4_0.gguf.partial"
"$M40" pull org/multi:Q4_0 >/dev/null 2>"$tmp/err"; rc=$?
check "resume: exit 0 ($(tail -1 "$tmp/err"))" [ $rc -eq 0 ]
check "resume: asked for the rest only" grep -q "^GET /cdn/org/multi/tiny-Q4_0.gguf bytes=5000- " "$tmp/log"
check "resume: said so" grep -q "resuming after" "$tmp/err"
check "resume: the file is whole" same "$store/org/multi/tiny-Q4_0.gguf" "$hub/org/multi/tiny-Q4_0.gguf"

# ---- a connection dropped mid-file: retried from where it broke ----
"$M40" pull org/drop >/dev/null 2>"$tmp/err"; rc=$?
check "dropped connection: exit 0 ($(tail -1 "$tmp/err"))" [ $rc -eq 0 ]
check "dropped connection: two requests" [ "$(cdn_gets org/drop/d-F16.gguf)" -eq 2 ]
check "dropped connection: the second with Range" grep -qE "^GET /cdn/org/drop/d-F16.gguf bytes=[1-9][0-9]*- " "$tmp/log"
check "dropped connection: the file is whole" same "$store/org/drop/d-F16.gguf" "$hub/org/drop/d-F16.gguf"

# ---- interrupted (killed), then pulled again: the .partial is resumed ----
"$M40" pull org/slow >/dev/null 2>"$tmp/err" &
ppid=$!
part=$store/org/slow/s-F16.gguf.partial
for _ in $(seq 200); do [ "$(stat -c %s "$part" 2>/dev/null || echo 0)" -ge 100000 ] && break; sleep 0.05; done
kill -TERM $ppid  # (a background job of a script ignores SIGINT)
wait $ppid; rc=$?
have=$(stat -c %s "$part" 2>/dev/null || echo 0)
check "interrupted: the pull failed" [ $rc -ne 0 ]
check "interrupted: part of the file is kept ($have bytes)" [ "$have" -gt 0 -a "$have" -lt "$(stat -c %s "$hub/org/slow/s-F16.gguf")" ]
check "interrupted: the file does not count" [ ! -e "$store/org/slow/s-F16.gguf" ]
"$M40" pull org/slow >/dev/null 2>"$tmp/err"; rc=$?
check "pulled again: exit 0 ($(tail -1 "$tmp/err"))" [ $rc -eq 0 ]
check "pulled again: from where it stopped" grep -qE "^GET /cdn/org/slow/s-F16.gguf bytes=${have}- " "$tmp/log"
check "pulled again: the file is whole" same "$store/org/slow/s-F16.gguf" "$hub/org/slow/s-F16.gguf"

# ---- what must not count as present ----
"$M40" pull org/badsum >/dev/null 2>"$tmp/err"; rc=$?
check "wrong checksum: exit 1" [ $rc -eq 1 ]
check "wrong checksum: said" grep -q "checksum mismatch" "$tmp/err"
check "wrong checksum: nothing left" [ -z "$(find "$store/org/badsum" -type f 2>/dev/null)" ]
"$M40" pull org/junk >/dev/null 2>"$tmp/err"; rc=$?
check "not a GGUF: exit 1" [ $rc -eq 1 ]
check "not a GGUF: said" grep -q "not a valid GGUF" "$tmp/err"
check "not a GGUF: nothing left" [ -z "$(find "$store/org/junk" -type f 2>/dev/null)" ]

# a full disk: the .partial is /dev/full, where every write fails with ENOSPC
if [ -w /dev/full ]; then
    mkdir -p "$store/org/full" && ln -s /dev/full "$store/org/full/f-Q8_0.gguf.partial"
    "$M40" pull org/full >/dev/null 2>"$tmp/err"; rc=$?
    check "disk full: exit 1" [ $rc -eq 1 ]
    check "disk full: said, with what to do" grep -q "No space left on device (the disk is full: free some space and run m40 pull again" "$tmp/err"
    check "disk full: the file does not count" [ ! -e "$store/org/full/f-Q8_0.gguf" ]
    rm -rf "$store/org/full"
else
    skip "/dev/full absent: no disk-full test"
fi

# ---- hub errors ----
"$M40" pull org/nothere >/dev/null 2>"$tmp/err"; rc=$?
check "404: exit 1" [ $rc -eq 1 ]
check "404: not found" grep -q "HTTP 404: org/nothere not found" "$tmp/err"
"$M40" pull org/multi:Q8_0 --revision v9 >/dev/null 2>"$tmp/err"; rc=$?
check "unknown revision: exit 1" [ $rc -eq 1 ]
"$M40" pull org/private >/dev/null 2>"$tmp/err"; rc=$?
check "401: exit 1" [ $rc -eq 1 ]
check "401: the HF_TOKEN hint" grep -q "set HF_TOKEN" "$tmp/err"
HF_TOKEN=wrong "$M40" pull org/private >/dev/null 2>"$tmp/err"; rc=$?
check "401 with a token: exit 1" [ $rc -eq 1 ]
check "401 with a token: check it" grep -q "check that HF_TOKEN is valid" "$tmp/err"
HF_TOKEN=secret "$M40" pull org/private >/dev/null 2>"$tmp/err"; rc=$?
check "HF_TOKEN: exit 0 ($(tail -1 "$tmp/err"))" [ $rc -eq 0 ]
check "HF_TOKEN: sent as a bearer token" grep -q "^GET /org/private/resolve/main/p-Q8_0.gguf - auth" "$tmp/log"
"$M40" rm org/private >/dev/null 2>&1
mkdir -p "$tmp/home/.cache/huggingface" && echo secret >"$tmp/home/.cache/huggingface/token"
"$M40" pull org/private >/dev/null 2>"$tmp/err"; rc=$?
check "the token file of huggingface-cli login: exit 0" [ $rc -eq 0 ]
rm -rf "$tmp/home/.cache/huggingface"

# ---- a split model comes whole ----
"$M40" pull org/split >/dev/null 2>"$tmp/err"; rc=$?
check "split: exit 0 ($(tail -1 "$tmp/err"))" [ $rc -eq 0 ]
check "split: shard 1" same "$store/org/split/big-00001-of-00002.gguf" "$hub/org/split/big-00001-of-00002.gguf"
check "split: shard 2" same "$store/org/split/big-00002-of-00002.gguf" "$hub/org/split/big-00002-of-00002.gguf"

# ---- m40 list ----
"$M40" list >"$tmp/list" 2>"$tmp/err"; rc=$?
check "list: exit 0" [ $rc -eq 0 ]
check "list: header" grep -qE "^NAME +SIZE +ARCH +QUANT +CONTEXT" "$tmp/list"
arch=$("$M40" info "$hub/org/multi/tiny-Q8_0.gguf" | awk '/^architecture:/ {print $2; exit}')
ctx=$(python3 - "$hub/org/multi/tiny-Q8_0.gguf" <<'PY'
import struct, sys
# the GGUF header by hand: the context length list must show
f = open(sys.argv[1], "rb").read()
o = 8
nt, nkv = struct.unpack_from("<QQ", f, o + 0); o = 24
def s(o):
    n, = struct.unpack_from("<Q", f, o); return f[o + 8:o + 8 + n].decode(), o + 8 + n
sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
def val(t, o):
    if t == 8: return s(o)
    if t == 9:
        et, n = struct.unpack_from("<IQ", f, o); o += 12
        for _ in range(n): _, o = val(et, o)
        return None, o
    fmt = {4: "<I", 5: "<i", 10: "<Q", 11: "<q"}.get(t)
    v = struct.unpack_from(fmt, f, o)[0] if fmt else None
    return v, o + sizes[t]
for _ in range(nkv):
    k, o = s(o); t, = struct.unpack_from("<I", f, o); o += 4
    v, o = val(t, o)
    if k.endswith(".context_length"): print(v)
PY
)
check "list: the Q8_0 model's line (arch $arch, context $ctx)" grep -qE "^org/multi/tiny-Q8_0.gguf +[0-9.]+ [KMG]iB +$arch +Q8_0 +$ctx\$" "$tmp/list"
check "list: the F16 one in its folder" grep -qE "^org/multi/sub/tiny-F16.gguf .* F16 " "$tmp/list"
check "list: the split model once, with its shards" [ "$(grep -c '^org/split/' "$tmp/list")" -eq 1 ]
check "list: ... named by shard 1" grep -qE "^org/split/big-00001-of-00002.gguf .*\(2 shards\)" "$tmp/list"
check "list: nothing that failed" bash -c "! grep -qE 'badsum|junk' '$tmp/list'"

# ---- store names in the other commands ----
"$M40" info org/multi:q8_0 >/dev/null 2>&1; check "info ORG/REPO:QUANT" [ $? -eq 0 ]
"$M40" info tiny-Q4_0 >/dev/null 2>&1; check "info FILE (no .gguf)" [ $? -eq 0 ]
"$M40" info org/drop >/dev/null 2>&1; check "info ORG/REPO (one model there)" [ $? -eq 0 ]
"$M40" tokenize org/multi/tiny-Q4_0 "hello" >/dev/null 2>&1; check "tokenize ORG/REPO/FILE" [ $? -eq 0 ]
"$M40" info org/multi >/dev/null 2>"$tmp/err"; rc=$?
check "info ORG/REPO (several): exit 1" [ $rc -ne 0 ]
check "info ORG/REPO (several): ambiguous" grep -q "ambiguous" "$tmp/err"
"$M40" info org/nothing:Q8_0 >/dev/null 2>"$tmp/err"; rc=$?
check "an unknown name: exit 1" [ $rc -ne 0 ]
check "an unknown name: the store is named" grep -q "no model of that name in the store $store" "$tmp/err"
"$M40" run org/multi:Q8_0 -p "Hello" -n 2 --temp 0 --threads 1 >"$tmp/out" 2>"$tmp/err"; rc=$?
check "run ORG/REPO:QUANT: exit 0 ($(tail -1 "$tmp/err"))" [ $rc -eq 0 ]

# m40 serve resolves the name too, and removes its temporary folder when nginx exits
# (a stand-in nginx copies the written conf and exits, or waits for a signal)
cat >"$tmp/fake-nginx" <<FAKE
#!/bin/sh
cp "\$4" "$tmp/served.conf"
[ -n "\$FAKE_WAIT" ] || exit 3
trap 'echo TERM >"$tmp/signal"; exit 0' TERM
while :; do sleep 0.1; done
FAKE
chmod +x "$tmp/fake-nginx"
mkdir -p "$tmp/t"
TMPDIR=$tmp/t "$M40" serve org/multi:Q4_0 --nginx "$tmp/fake-nginx" --module "$tmp/fake-nginx" >/dev/null 2>"$tmp/err"; rc=$?
check "serve: nginx's exit status passed on" [ $rc -eq 3 ]
check "serve: the store's file in m40_model" grep -q "m40_model \"$store/org/multi/tiny-Q4_0.gguf\"" "$tmp/served.conf"
check "serve: its temporary folder is removed" [ -z "$(ls -A "$tmp/t")" ]
check "serve: one worker, no reuseport by default" \
    sh -c "grep -q '^worker_processes 1;' '$tmp/served.conf' && ! grep -q reuseport '$tmp/served.conf'"
# --gpus N: N workers, worker k on GPU D+k, connections spread by reuseport
TMPDIR=$tmp/t "$M40" serve org/multi:Q4_0 --device 1 --gpus 3 --nginx "$tmp/fake-nginx" --module "$tmp/fake-nginx" \
    >/dev/null 2>"$tmp/err"
check "serve --gpus 3: three workers" grep -q '^worker_processes 3;' "$tmp/served.conf"
check "serve --gpus 3: from GPU 1" grep -q 'm40_device 1;' "$tmp/served.conf"
check "serve --gpus 3: reuseport" grep -q 'listen 127.0.0.1:8080 reuseport;' "$tmp/served.conf"
"$M40" serve org/multi:Q4_0 --gpus 2 --nginx "$tmp/fake-nginx" >/dev/null 2>"$tmp/err"; rc=$?
check "serve --gpus 2 on the cpu: exit 2" [ $rc -eq 2 ]
check "serve --gpus 2 on the cpu: says why" grep -q "needs a GPU device" "$tmp/err"
"$M40" serve org/multi:Q4_0 --device 0 --gpus 0 >/dev/null 2>"$tmp/err"; rc=$?
check "serve --gpus 0: exit 2" [ $rc -eq 2 ]
# --tp N: each worker's model over N GPUs (m40_model ... tp=N), NCCL's settings passed on
NCCL_NVLS_ENABLE=0 TMPDIR=$tmp/t "$M40" serve org/multi:Q4_0 --device 0 --gpus 2 --tp 2 --nginx "$tmp/fake-nginx" \
    --module "$tmp/fake-nginx" >/dev/null 2>"$tmp/err"
check "serve --tp 2: tp=2 on the model" grep -q 'tiny-Q4_0.gguf" tp=2' "$tmp/served.conf"
check "serve --tp 2: two workers" grep -q '^worker_processes 2;' "$tmp/served.conf"
check "serve --tp 2: NCCL_NVLS_ENABLE reaches the workers" grep -q '^env NCCL_NVLS_ENABLE;' "$tmp/served.conf"
"$M40" serve org/multi:Q4_0 --tp 2 --nginx "$tmp/fake-nginx" >/dev/null 2>"$tmp/err"; rc=$?
check "serve --tp 2 on the cpu: exit 2" [ $rc -eq 2 ]
check "serve --tp 2 on the cpu: says why" grep -q "needs a GPU device" "$tmp/err"
# --batch-invariant: m40_batch_invariant on (every model); refused with --tp N
TMPDIR=$tmp/t "$M40" serve org/multi:Q4_0 --batch-invariant --nginx "$tmp/fake-nginx" --module "$tmp/fake-nginx" \
    >/dev/null 2>"$tmp/err"
check "serve --batch-invariant: m40_batch_invariant on" grep -q '^    m40_batch_invariant on;$' "$tmp/served.conf"
TMPDIR=$tmp/t "$M40" serve org/multi:Q4_0 --nginx "$tmp/fake-nginx" --module "$tmp/fake-nginx" >/dev/null 2>"$tmp/err"
check "serve: no m40_batch_invariant by default" bash -c "! grep -q m40_batch_invariant '$tmp/served.conf'"
"$M40" serve org/multi:Q4_0 --device 0 --tp 2 --batch-invariant --nginx "$tmp/fake-nginx" >/dev/null 2>"$tmp/err"; rc=$?
check "serve --batch-invariant --tp 2: exit 2" [ $rc -eq 2 ]
check "serve --batch-invariant --tp 2: says why" grep -q "does not work with --tp 2" "$tmp/err"
FAKE_WAIT=1 TMPDIR=$tmp/t "$M40" serve org/multi:Q4_0 --nginx "$tmp/fake-nginx" --module "$tmp/fake-nginx" >/dev/null 2>"$tmp/err" &
spid=$!
for _ in $(seq 50); do [ -n "$(ls -A "$tmp/t")" ] && [ -s "$tmp/served.conf" ] && break; sleep 0.1; done
sleep 0.3
kill -TERM $spid
wait $spid; rc=$?
check "serve: SIGTERM reaches nginx" [ "$(cat "$tmp/signal" 2>/dev/null)" = TERM ]
check "serve: exit 0 after nginx's" [ $rc -eq 0 ]
check "serve: its temporary folder is removed after a signal" [ -z "$(ls -A "$tmp/t")" ]
rm -f "$tmp/signal" "$tmp/served.conf"
FAKE_WAIT=1 TMPDIR=$tmp/t "$M40" serve org/multi:Q4_0 --nginx "$tmp/fake-nginx" --module "$tmp/fake-nginx" >/dev/null 2>"$tmp/err" &
spid=$!
for _ in $(seq 50); do [ -s "$tmp/served.conf" ] && break; sleep 0.1; done
sleep 0.3
kill -KILL $spid
wait $spid 2>/dev/null
for _ in $(seq 50); do [ -s "$tmp/signal" ] && break; sleep 0.1; done
check "serve: killed outright, nginx still gets SIGTERM" [ "$(cat "$tmp/signal" 2>/dev/null)" = TERM ]
rm -rf "$tmp/t"/*

# ---- m40 rm ----
"$M40" rm org/multi:q8_0 >"$tmp/out" 2>"$tmp/err"; rc=$?
check "rm: exit 0" [ $rc -eq 0 ]
check "rm: said" grep -q "removed org/multi/tiny-Q8_0.gguf" "$tmp/out"
check "rm: the file and its .sha256 are gone" [ ! -e "$store/org/multi/tiny-Q8_0.gguf" -a ! -e "$store/org/multi/tiny-Q8_0.gguf.sha256" ]
check "rm: the others stay" [ -e "$store/org/multi/tiny-Q4_0.gguf" ]
"$M40" rm org/split >/dev/null 2>&1; rc=$?
check "rm split: exit 0" [ $rc -eq 0 ]
check "rm split: every shard and the empty folder are gone" [ ! -e "$store/org/split" ]
"$M40" list >"$tmp/list" 2>&1
check "rm: list no longer shows them" bash -c "! grep -qE 'tiny-Q8_0|org/split' '$tmp/list'"
"$M40" rm "$hub/org/multi/tiny-Q8_0.gguf" >/dev/null 2>"$tmp/err"; rc=$?
check "rm of a file outside the store: refused" [ $rc -eq 1 -a -e "$hub/org/multi/tiny-Q8_0.gguf" ]
check "rm of a file outside the store: said" grep -q "not in the model store" "$tmp/err"
"$M40" rm org/nothing >/dev/null 2>&1; check "rm of an unknown name: exit 1" [ $? -eq 1 ]
"$M40" rm >/dev/null 2>&1; check "rm without a name: exit 2" [ $? -eq 2 ]

# ---- the default store: ~/.cache/m40/models ----
M40_MODELS= "$M40" pull org/multi:Q8_0 >/dev/null 2>"$tmp/err"; rc=$?
check "default store: exit 0" [ $rc -eq 0 ]
check "default store: ~/.cache/m40/models" [ -f "$tmp/home/.cache/m40/models/org/multi/tiny-Q8_0.gguf" ]

done_tests
