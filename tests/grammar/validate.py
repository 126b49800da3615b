#!/usr/bin/env python3
"""Reads lines "<schema index>\t<sample as a JSON string>" (the output of test_json_schema --sample) and
checks that each sample parses as JSON and validates against its schema with the
jsonschema package (draft 2020-12, formats checked too). Ends with "N passed, N failed"."""
import json
import sys

import jsonschema

schemas = json.load(open(sys.argv[1]))
passed = failed = 0
for line in sys.stdin:
    idx, quoted = line.rstrip("\n").split("\t", 1)
    sample = json.loads(quoted)
    schema = schemas[int(idx)]
    try:
        doc = json.loads(sample)
        v = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
        v.validate(doc)
        passed += 1
    except Exception as e:  # noqa: BLE001 - any failure is a test failure
        failed += 1
        print(f"FAIL schema {idx}: {sample!r}: {str(e)[:200]}", file=sys.stderr)
print(f"{passed} passed, {failed} failed")
sys.exit(1 if failed else 0)
