"""tests/bench/load.py against the main server: the benchmark script's own numbers add up,
and --compare-alone: greedy outputs of requests served together equal those of the same
requests served one at a time (batching must not change an answer)."""
import json
import os
import subprocess
import sys

import harness

LOAD = os.path.join(harness.ROOT, "tests", "bench", "load.py")


def run_load(base_url, *args):
    p = subprocess.run([sys.executable, LOAD, "--url", base_url, *args], capture_output=True, text=True,
                       timeout=300)
    return p.returncode, p.stdout, p.stderr


def test_concurrent_greedy_equals_alone(base_url):
    rc, out, err = run_load(base_url, "--concurrency", "8", "--requests", "8", "--prompt-words", "8",
                            "--max-tokens", "24", "--compare-alone", "8", "--json")
    s = json.loads(out)
    assert s["ok"] == 8 and s["errors"] == 0, s
    assert s["generated_tokens"] > 0 and s["gen_tok_s"] > 0, s
    a = s["alone"]
    assert a["compared"] == 8 and a["errors"] == 0, a
    assert a["identical"] == 8 and a["differ"] == 0, a["first_diffs"]
    assert rc == 0, err


def test_compare_alone_report(base_url):
    rc, out, err = run_load(base_url, "--concurrency", "2", "--requests", "2", "--prompt-words", "4",
                            "--max-tokens", "8", "--compare-alone", "5")
    assert rc == 0, err
    assert "alone:      2 of 2 outputs identical to the same request run alone" in out, out


def test_compare_alone_needs_greedy(base_url):
    rc, out, err = run_load(base_url, "--temperature", "0.7", "--compare-alone", "2")
    assert rc == 2 and "--compare-alone needs greedy requests" in err, (rc, err)
