"""tests/bench/load.py against the main server: the benchmark script's own numbers add up,
and --compare-alone: greedy outputs of requests served together equal those of the same
requests served one at a time (batching must not change an answer); the same against a
server with m40_batch_invariant on."""
import json
import os
import subprocess
import sys

import pytest

import harness
from conftest import example

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


@pytest.fixture(scope="module")
def batch_invariant_server(workdirs):
    """(base_url, the Nginx) of conf/minimal.conf with m40_batch_invariant on."""
    port = harness.free_port()
    workdir = harness.make_workdir("batchinv")
    text = example("minimal.conf").replace(
        "    m40_model /var/lib/m40/models/model.gguf;\n",
        "    m40_model /var/lib/m40/models/model.gguf;\n    m40_batch_invariant on;\n    m40_threads 1;\n")
    text = harness.render(text, workdir, {"127.0.0.1:8080": f"127.0.0.1:{port}"})
    inst = harness.Nginx(text, "batchinv", f"http://127.0.0.1:{port}/health").start()
    yield f"http://127.0.0.1:{port}", inst
    inst.stop()
    crashes = inst.crashes()
    inst.cleanup()
    assert not crashes, "nginx logged:\n" + "\n".join(crashes)


def test_batch_invariant_server_greedy_equals_alone(batch_invariant_server):
    # on the CPU the option changes nothing (a row is computed the same way at any batch
    # size already): the server starts, says so when it loads the model, and answers as
    # it would without it
    base, inst = batch_invariant_server
    assert "(batch invariant: the cpu computes a row the same way at any batch size already)" in inst.log(), \
        inst.log()
    rc, out, err = run_load(base, "--concurrency", "4", "--requests", "4", "--prompt-words", "6",
                            "--max-tokens", "12", "--compare-alone", "4", "--json")
    s = json.loads(out)
    assert s["ok"] == 4 and s["errors"] == 0 and s["generated_tokens"] > 0, s
    a = s["alone"]
    assert a["compared"] == 4 and a["identical"] == 4 and a["differ"] == 0, a
    assert rc == 0, err
