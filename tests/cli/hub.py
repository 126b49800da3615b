#!/usr/bin/env python3
"""A loopback stand-in for the Hugging Face hub, for tests/cli/pull.sh.

Serves ROOT/ORG/REPO/PATH the way the hub does:
  GET /api/models/ORG/REPO/tree/REV?recursive=true   the file list (lfs.oid = sha256)
  GET /ORG/REPO/resolve/REV/PATH                     302 to /cdn/... with X-Linked-ETag
                                                     (the sha256) and X-Linked-Size
  GET /cdn/ORG/REPO/PATH                             the bytes; Range -> 206
Behaviours the tests need, by repository:
  ORG/private*   401 without "Authorization: Bearer secret"
  ORG/badsum*    the file list and X-Linked-ETag give a wrong sha256
  ORG/drop*      the first download of each file sends half of it and drops the connection
  ORG/slow*      files trickle out (16 KiB every 20 ms), for interrupting a pull
Every request is appended to LOG as "METHOD PATH RANGE AUTH" (one line each).
The port chosen is written to PORTFILE. Revisions other than "main" are 404."""
import hashlib
import http.server
import json
import os
import socket
import sys
import threading
import time
import urllib.parse

ROOT, PORTFILE, LOG = sys.argv[1], sys.argv[2], sys.argv[3]
dropped = set()
lock = threading.Lock()


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def claimed_sha(repo, path):
    s = sha256(path)
    if repo.split("/")[1].startswith("badsum"):
        return hashlib.sha256(b"not this file").hexdigest()
    return s


class Hub(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def send_json(self, code, obj):
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def error(self, code, msg):
        self.send_json(code, {"error": msg})

    def do_GET(self):
        u = urllib.parse.urlsplit(self.path)
        path = urllib.parse.unquote(u.path)
        with lock, open(LOG, "a") as f:
            f.write("GET %s %s %s\n" % (path, self.headers.get("Range", "-"),
                                         "auth" if self.headers.get("Authorization") else "-"))
        parts = path.strip("/").split("/")
        if parts[0] == "api" and len(parts) >= 6 and parts[1] == "models" and parts[4] == "tree":
            repo, rev = parts[2] + "/" + parts[3], parts[5]
            if not self.allowed(repo):
                return
            d = os.path.join(ROOT, repo)
            if not os.path.isdir(d) or rev != "main":
                return self.error(404, "Repository not found")
            out = []
            for dp, _, names in os.walk(d):
                for n in sorted(names):
                    full = os.path.join(dp, n)
                    rel = os.path.relpath(full, d)
                    size = os.path.getsize(full)
                    e = {"type": "file", "oid": hashlib.sha1(rel.encode()).hexdigest(), "size": size, "path": rel}
                    if n.endswith(".gguf"):
                        e["lfs"] = {"oid": claimed_sha(repo, full), "size": size, "pointerSize": 134}
                    out.append(e)
            return self.send_json(200, out)
        if len(parts) >= 5 and parts[2] == "resolve":
            repo, rev, rel = parts[0] + "/" + parts[1], parts[3], "/".join(parts[4:])
            if not self.allowed(repo):
                return
            full = os.path.join(ROOT, repo, rel)
            if rev != "main" or not os.path.isfile(full):
                return self.error(404, "Entry not found")
            self.send_response(302)
            self.send_header("Location", "/cdn/%s/%s?sig=x" % (repo, urllib.parse.quote(rel)))
            self.send_header("X-Linked-ETag", '"%s"' % claimed_sha(repo, full))
            self.send_header("X-Linked-Size", str(os.path.getsize(full)))
            self.send_header("ETag", '"%s"' % hashlib.sha1(rel.encode()).hexdigest())
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if parts[0] == "cdn" and len(parts) >= 4:
            repo, rel = parts[1] + "/" + parts[2], "/".join(parts[3:])
            full = os.path.join(ROOT, repo, rel)
            if not os.path.isfile(full):
                return self.error(404, "no such object")
            with open(full, "rb") as f:
                data = f.read()
            start, code = 0, 200
            rng = self.headers.get("Range")
            if rng:
                a = rng.split("=", 1)[1].split("-", 1)[0]
                start = int(a)
                if start >= len(data):
                    self.send_response(416)
                    self.send_header("Content-Range", "bytes */%d" % len(data))
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                code = 206
            body = data[start:]
            self.send_response(code)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Accept-Ranges", "bytes")
            if code == 206:
                self.send_header("Content-Range", "bytes %d-%d/%d" % (start, len(data) - 1, len(data)))
            self.end_headers()
            key = repo + "/" + rel
            with lock:
                drop = parts[2].startswith("drop") and key not in dropped
                dropped.add(key)
            if drop:
                self.wfile.write(body[: len(body) // 2])
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)
                self.close_connection = True
                return
            if parts[2].startswith("slow"):
                for i in range(0, len(body), 16384):
                    self.wfile.write(body[i:i + 16384])
                    self.wfile.flush()
                    time.sleep(0.02)
                return
            self.wfile.write(body)
            return
        self.error(404, "not found")

    def allowed(self, repo):
        if repo.split("/")[1].startswith("private") and self.headers.get("Authorization") != "Bearer secret":
            self.error(401, "Invalid credentials in Authorization header")
            return False
        return True


srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hub)
with open(PORTFILE + ".tmp", "w") as f:
    f.write(str(srv.server_address[1]))
os.rename(PORTFILE + ".tmp", PORTFILE)
srv.serve_forever()
