"""Starting and stopping real nginx instances with the m40 module.

The configuration examples in conf/ are used as they are, with the example values
(module path, model path, ports, certificate paths) replaced by this run's. Each
replacement must match, so an edited example cannot silently stop being tested.

Used by conftest.py (fixtures) and by run.sh (`harness.py render ...`).
"""
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
NGINX = os.environ.get("M40_NGINX", "/usr/sbin/nginx")
MODULE = os.environ.get("M40_MODULE", os.path.join(ROOT, "build", "ngx_http_m40_module.so"))
SHARED = os.environ.get("M40_SHARED", os.path.join(ROOT, "..", "shared"))
MODEL = os.environ.get("M40_MODEL", os.path.join(SHARED, "models", "stories260K.gguf"))

EXAMPLE_MODULE = "modules/ngx_http_m40_module.so"
EXAMPLE_MODEL = "/var/lib/m40/models/model.gguf"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


WORKDIRS = []


def make_workdir(tag):
    # Under /tmp and world-traversable: when the tests run as root, nginx's worker
    # runs as "nobody" and creates its temp folders in here. remove_workdirs()
    # deletes them all at the end of the session.
    d = tempfile.mkdtemp(prefix=f"m40-it-{tag}-")
    os.chmod(d, 0o755)
    WORKDIRS.append(d)
    return d


def remove_workdirs():
    while WORKDIRS:
        shutil.rmtree(WORKDIRS.pop(), ignore_errors=True)


def render(text, workdir, replace=None, model=MODEL):
    """The example text with this run's paths and ports. replace maps more example
    strings (ports, certificate paths) to their values. model=None: an example with
    no model (conf/multi-host.conf's front)."""
    pairs = [(EXAMPLE_MODULE, MODULE)] + ([(EXAMPLE_MODEL, model)] if model else [])
    pairs += list((replace or {}).items())
    for old, new in pairs:
        if old not in text:
            raise ValueError(f"example configuration no longer contains {old!r}")
        text = text.replace(old, new)
    temps = "".join(f"\n    {t}_temp_path {workdir}/{t};" for t in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    # M40_TEST_CPU_EXACT=1: every rendered instance serves on the CPU engine's exact F32
    # path instead of the fast one (the suite's time on each, BENCHMARKS.md)
    if os.environ.get("M40_TEST_CPU_EXACT") == "1":
        temps += "\n    m40_cpu_exact on;"
    text, n = re.subn(r"^http \{", "http {" + temps + f"\n    access_log {workdir}/access.log;", text, count=1,
                      flags=re.M)
    if n != 1:
        raise ValueError("no http block in the configuration")
    return text


class Nginx:
    """One nginx master (daemon off) with its own prefix directory."""

    def __init__(self, conf_text, tag, health_url=None, log_level="info"):
        self.log_level = log_level
        self.workdir = make_workdir(tag)
        self.conf = os.path.join(self.workdir, "nginx.conf")
        self.error_log = os.path.join(self.workdir, "error.log")
        with open(self.conf, "w") as f:
            f.write(conf_text)
        self.health_url = health_url
        self.proc = None

    def start(self, want_ready=True, timeout=60):
        args = [NGINX, "-p", self.workdir, "-c", self.conf, "-e", self.error_log,
                "-g", f"pid {self.workdir}/nginx.pid; daemon off; error_log {self.error_log} {self.log_level};"]
        test = subprocess.run(args + ["-t"], capture_output=True, text=True)
        if test.returncode != 0:
            raise RuntimeError(f"nginx -t failed:\n{test.stderr}")
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if self.health_url:
            self.wait_health(want_ready, timeout)
        return self

    def wait_health(self, want_ready=True, timeout=60):
        deadline = time.time() + timeout
        last = None
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nginx exited ({self.proc.returncode}):\n{self.log()}")
            try:
                with urllib.request.urlopen(self.health_url, timeout=2) as r:
                    if r.status == 200:
                        return
            except urllib.error.HTTPError as e:
                last = e.read().decode(errors="replace")
                if not want_ready and '"failed"' in last:
                    return
            except OSError as e:
                last = str(e)
            time.sleep(0.1)
        raise RuntimeError(f"{self.health_url} not ready after {timeout}s (last: {last})\n{self.log()}")

    def log(self):
        try:
            with open(self.error_log, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def crashes(self):
        return crash_lines(self.log())

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def cleanup(self):
        shutil.rmtree(self.workdir, ignore_errors=True)


def crash_lines(log):
    """Lines that mean a worker died or nginx hit an internal inconsistency."""
    bad = re.compile(r"exited on signal|\[alert\]|\[emerg\]|open socket #\d+ left")
    return [l for l in log.splitlines() if bad.search(l)]


def main(argv):
    # harness.py render EXAMPLE WORKDIR PORT: writes WORKDIR/nginx.conf for run.sh
    if len(argv) == 4 and argv[0] == "render":
        example, workdir, port = argv[1], argv[2], argv[3]
        with open(example) as f:
            text = render(f.read(), workdir, {"127.0.0.1:8080": f"127.0.0.1:{port}"})
        with open(os.path.join(workdir, "nginx.conf"), "w") as f:
            f.write(text)
        return 0
    if len(argv) == 2 and argv[0] == "crashes":
        with open(argv[1], errors="replace") as f:
            lines = crash_lines(f.read())
        for l in lines:
            print(l)
        return 1 if lines else 0
    if len(argv) == 1 and argv[0] == "port":
        print(free_port())
        return 0
    print("usage: harness.py render EXAMPLE WORKDIR PORT | crashes LOG | port", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
