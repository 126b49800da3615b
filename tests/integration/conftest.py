"""Fixtures: the main server (started by run.sh, or here when pytest runs alone),
the OpenAI client, and the extra nginx instances some tests need."""
import os
import subprocess

import openai
import pytest

import harness

MODEL_NAME = os.path.basename(harness.MODEL)[:-len(".gguf")]


def example(name):
    with open(os.path.join(harness.ROOT, "conf", name)) as f:
        return f.read()


@pytest.fixture(scope="session", autouse=True)
def workdirs():
    yield
    harness.remove_workdirs()


@pytest.fixture(scope="session")
def main_server(workdirs):
    """(base_url, error_log) of the server running conf/minimal.conf."""
    if os.environ.get("M40_BASE_URL"):
        yield os.environ["M40_BASE_URL"], os.environ.get("M40_MAIN_ERROR_LOG")
        return
    port = harness.free_port()
    workdir = harness.make_workdir("main")
    text = harness.render(example("minimal.conf"), workdir, {"127.0.0.1:8080": f"127.0.0.1:{port}"})
    inst = harness.Nginx(text, "main", f"http://127.0.0.1:{port}/health").start()
    yield f"http://127.0.0.1:{port}", inst.error_log
    inst.stop()
    inst.cleanup()


@pytest.fixture(scope="session")
def base_url(main_server):
    return main_server[0]


@pytest.fixture(autouse=True)
def no_worker_crash(main_server):
    """Fails the test during which the main server logged a crash or an alert."""
    log = main_server[1]
    start = os.path.getsize(log) if log and os.path.exists(log) else 0
    yield
    if log and os.path.exists(log):
        with open(log, errors="replace") as f:
            f.seek(start)
            bad = harness.crash_lines(f.read())
        assert not bad, "nginx logged:\n" + "\n".join(bad)


@pytest.fixture(scope="session")
def client(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key="dummy", max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def model():
    return MODEL_NAME


def start_instance(text, tag, health_path="/health", port=None, want_ready=True, log_level="info"):
    inst = harness.Nginx(text, tag, f"http://127.0.0.1:{port}{health_path}" if port else None, log_level)
    inst.start(want_ready=want_ready)
    return inst


@pytest.fixture(scope="module")
def instances():
    """Starts extra instances on demand and checks each for crashes at the end."""
    started = []

    def start(text, tag, port, want_ready=True, log_level="info"):
        inst = start_instance(text, tag, port=port, want_ready=want_ready, log_level=log_level)
        started.append(inst)
        return inst

    yield start
    problems = []
    for inst in started:
        inst.stop()
        problems += inst.crashes()
        inst.cleanup()
    assert not problems, "nginx logged:\n" + "\n".join(problems)


@pytest.fixture(scope="session")
def tls_cert(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    crt, key = d / "server.crt", d / "server.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(crt)],
                   check=True, capture_output=True)
    return str(crt), str(key)
