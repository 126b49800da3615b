#!/usr/bin/env bash
# JSON Schema -> grammar: random sentences of each schema's grammar (test_json_schema
# --sample) parse as JSON and validate with Python's jsonschema, on the hand-written
# schemas (tests/grammar/schemas.json, three seeds) and on 300 random schemas (fuzz).
source tests/cli/lib.bash
GEN=build/tests/test_json_schema
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

if ! python3 -c 'import jsonschema' 2>/dev/null; then
    skip "python3 jsonschema absent (scripts/install-deps.sh installs python3-jsonschema)"
    done_tests; exit
fi
validate() { # validate "desc" schemas.json seed n
    local d=$1 file=$2 seed=$3 n=$4
    if ! SEED=$seed "$GEN" --sample "$file" "$n" >"$tmp/samples" 2>"$tmp/err"; then
        bad "$d: sampling failed: $(head -c 500 "$tmp/err")"; return
    fi
    if python3 tests/grammar/validate.py "$file" <"$tmp/samples" >"$tmp/out" 2>&1; then
        ok
    else
        bad "$d: $(tail -c 800 "$tmp/out")"
    fi
}
for seed in 1 2 3; do
    validate "schemas.json seed $seed" tests/grammar/schemas.json $seed 40
done
for seed in 11 12; do
    python3 tests/grammar/random_schemas.py 150 $seed >"$tmp/random.json"
    validate "random schemas seed $seed" "$tmp/random.json" $seed 5
done
done_tests
