"""Test-only stand-in for `python -m sglang.launch_server` (tests/test_node_launch.py): answers GET /health
(tests/workers/stub_server.py's handler; the repository root is on a launched server's PYTHONPATH) and records how
it was started (argv, pid, parent pid) in $STANDIN_OUT/server_<port>.json, and SGLang's POST /freeze_gc (the
launcher's, once the server answers) as "freeze_gc": true there. A port listed in $STANDIN_FAIL_PORTS
exits 1 at once (a server that cannot start). Keys as SGLang 0.5.23 (the shim launch/rlpo_sglang_keys.py adds
--api-key=K): every path but /health, /ready and /metrics answers 401 without `Authorization: Bearer K`, and
/server_info answers the key holder (the trainer's check at start). The launch wiring is what is tested; the real
SGLang launch is tests/test_sglang*.py's."""
import json
import os
import sys
from http.server import HTTPServer

from tests.workers.stub_server import Health


def flag(name, default=None):
    for i, a in enumerate(sys.argv):
        if a == name:
            return sys.argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return default


def record(**what):
    with open(os.path.join(os.environ["STANDIN_OUT"], f"server_{port}.json"), "w") as f:
        json.dump({"argv": sys.argv[1:], "pid": os.getpid(), "ppid": os.getppid(), **what}, f)


class Server(Health):
    def _refused(self) -> bool:
        if key is None or self.path.startswith(("/health", "/ready", "/metrics")):
            return False
        scheme, _, given = (self.headers.get("Authorization") or "").partition(" ")
        if scheme.lower() == "bearer" and given == key:
            return False
        self.send_response(401)
        self.end_headers()
        return True

    def do_GET(self):
        if self._refused():
            return
        if self.path == "/server_info":
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")
            return
        super().do_GET()

    def do_POST(self):
        if self._refused():
            return
        if self.path == "/freeze_gc":
            record(freeze_gc=True)
        self.send_response(200 if self.path == "/freeze_gc" else 404)
        self.end_headers()


if __name__ == "__main__":
    host, port, key = flag("--host"), int(flag("--port")), flag("--api-key")
    if str(port) in os.environ.get("STANDIN_FAIL_PORTS", "").split(","):
        sys.exit(1)
    record()
    HTTPServer((host, port), Server).serve_forever()
