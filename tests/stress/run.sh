#!/usr/bin/env bash
# The load-and-faults suite (tests/stress/stress.py) against the real /usr/sbin/nginx
# with the m40 module on the CPU engine and the shared tiny model.
#   tests/stress/run.sh [SCALE] [PHASE ...]      (make stress STRESS_SCALE=N)
# SCALE 1 (CI) takes a few minutes on two cores; SCALE 35 gives the issue's counts.
# Ends with one "N passed, N failed, N skipped" line; skips without the model or nginx.
set -u
cd "$(dirname "$0")/../.." || exit 1
export M40_SHARED=${M40_SHARED:-$(cd .. && pwd)/shared}
export M40_MODEL=${M40_MODEL:-$M40_SHARED/models/stories260K.gguf}
export M40_MODULE=${M40_MODULE:-$(pwd)/build/ngx_http_m40_module.so}
export M40_NGINX=${M40_NGINX:-/usr/sbin/nginx}
export M40_STRESS_SCALE=${1:-${M40_STRESS_SCALE:-1}}
shift || true
export PYTHONDONTWRITEBYTECODE=1
if [ ! -f "$M40_MODEL" ]; then
    echo "SKIP: $M40_MODEL not found (../shared/models is absent)"
    echo "0 passed, 0 failed, 1 skipped"; exit 0
fi
if [ ! -x "$M40_NGINX" ]; then
    echo "SKIP: $M40_NGINX not found (install nginx)"
    echo "0 passed, 0 failed, 1 skipped"; exit 0
fi
if [ ! -f "$M40_MODULE" ]; then
    echo "FAIL: $M40_MODULE is missing: run 'make'"
    echo "0 passed, 1 failed, 0 skipped"; exit 1
fi
exec python3 tests/stress/stress.py "$@"
