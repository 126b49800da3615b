# Helpers for CLI tests: ok/fail counters and the closing "N passed, N failed" line.
M40=${M40:-build/m40}
SHARED=${M40_SHARED:-../shared}
pass=0 fail=0 skip=0
ok()   { pass=$((pass + 1)); }
bad()  { fail=$((fail + 1)); echo "FAIL: $*" >&2; }
check() { # check "description" command...
    local d=$1; shift
    if "$@"; then ok; else bad "$d"; fi
}
skip() { skip=$((skip + 1)); echo "SKIP: $*" >&2; }
done_tests() { echo "$pass passed, $fail failed, $skip skipped"; [ "$fail" -eq 0 ]; }
