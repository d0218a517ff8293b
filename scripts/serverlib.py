"""What the Python scripts share: a free loopback port, waiting for a server
to answer, and posting JSON to it (scripts/bench-*.py, scripts/compare-*.py)."""
import json
import socket
import sys
import time
import urllib.request


def free_port():
    """A TCP port on 127.0.0.1 nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(port, proc, what, path="/health", timeout_s=120):
    """Wait until GET path answers 200; exit with a message when proc exits
    first or timeout_s passes."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"{what} exited while starting")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        time.sleep(0.2)
    sys.exit(f"{what} did not become ready in {timeout_s} s")


def post(port, path, body, timeout=3600):
    """POST body as JSON to path; the answer's JSON."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)
