#!/usr/bin/env bash
# Runs the test suite and ends with one line "N passed, N failed, N skipped".
#   tests/run.sh          all suites (unit, cli, integration, stress where present)
#   tests/run.sh unit     unit tests only (also: cli, integration, stress)
# Exit status non-zero when anything failed.
set -u
cd "$(dirname "$0")/.."
export M40_SHARED=${M40_SHARED:-$(cd .. && pwd)/shared}
what=${1:-all}
passed=0 failed=0 skipped=0 broken=""

tally() { # reads "N passed, N failed[, N skipped]" lines from a log
    local line
    line=$(grep -E '^[0-9]+ passed, [0-9]+ failed' "$1" | tail -n 1)
    if [ -z "$line" ]; then
        failed=$((failed + 1)); broken="$broken $2"; return
    fi
    set -- $line
    passed=$((passed + $1)); failed=$((failed + $3))
    [ $# -ge 6 ] && skipped=$((skipped + $5))
}

log=$(mktemp -d)
trap 'rm -rf "$log"' EXIT

if [ "$what" = all ] || [ "$what" = unit ]; then
    for t in build/tests/test_*; do
        [ -x "$t" ] || continue
        name=$(basename "$t")
        echo "== $name"
        "$t" >"$log/$name" 2>&1; rc=$?
        cat "$log/$name" | tail -n 40
        tally "$log/$name" "$name"
        if [ $rc -ne 0 ] && ! grep -qE '^[0-9]+ passed, [1-9]' "$log/$name"; then
            failed=$((failed + 1)); broken="$broken $name(rc=$rc)"
        fi
    done
fi

if [ "$what" = all ] || [ "$what" = unit ]; then
    # the AArch64 NEON kernels, cross-compiled and run under QEMU (skips without them)
    echo "== unit/neon"
    tests/unit/neon.sh >"$log/neon" 2>&1; rc=$?
    tail -n 20 "$log/neon"
    tally "$log/neon" unit/neon
    if [ $rc -ne 0 ] && ! grep -qE '^[0-9]+ passed, [1-9]' "$log/neon"; then
        failed=$((failed + 1)); broken="$broken unit/neon(rc=$rc)"
    fi
fi

if [ "$what" = all ] || [ "$what" = cli ]; then
    for t in tests/cli/*.sh; do
        [ -f "$t" ] || continue
        name=$(basename "$t" .sh)
        echo "== cli/$name"
        bash "$t" >"$log/cli_$name" 2>&1; rc=$?
        tail -n 40 "$log/cli_$name"
        tally "$log/cli_$name" "cli/$name"
        if [ $rc -ne 0 ] && ! grep -qE '^[0-9]+ passed, [1-9]' "$log/cli_$name"; then
            failed=$((failed + 1)); broken="$broken cli/$name(rc=$rc)"
        fi
    done
fi

if [ "$what" = all ] || [ "$what" = integration ]; then
    if [ -x tests/integration/run.sh ]; then
        echo "== integration"
        tests/integration/run.sh >"$log/integration" 2>&1; rc=$?
        tail -n 60 "$log/integration"
        tally "$log/integration" integration
        if [ $rc -ne 0 ] && ! grep -qE '^[0-9]+ passed, [1-9]' "$log/integration"; then
            failed=$((failed + 1)); broken="$broken integration(rc=$rc)"
        fi
    fi
fi

if [ "$what" = all ] || [ "$what" = stress ]; then
    if [ -x tests/stress/run.sh ]; then
        echo "== stress"
        tests/stress/run.sh "${M40_STRESS_SCALE:-1}" >"$log/stress" 2>&1; rc=$?
        tail -n 60 "$log/stress"
        tally "$log/stress" stress
        if [ $rc -ne 0 ] && ! grep -qE '^[0-9]+ passed, [1-9]' "$log/stress"; then
            failed=$((failed + 1)); broken="$broken stress(rc=$rc)"
        fi
    fi
fi

[ -n "$broken" ] && echo "broken:$broken"
echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
