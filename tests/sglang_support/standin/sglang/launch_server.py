"""Test-only stand-in for `python -m sglang.launch_server` (tests/test_node_launch.py): answers GET /health
(tests/workers/stub_server.py's handler; the repository root is on a launched server's PYTHONPATH) and records how
it was started (argv, pid, parent pid) in $STANDIN_OUT/server_<port>.json, and SGLang's POST /freeze_gc (the
launcher's, once the server answers) as "freeze_gc": true there. A port listed in $STANDIN_FAIL_PORTS
exits 1 at once (a server that cannot start). The launch wiring is what is tested; the real SGLang launch is
tests/test_sglang*.py's."""
import json
import os
import sys
from http.server import HTTPServer

from tests.workers.stub_server import Health


def flag(name):
    return sys.argv[sys.argv.index(name) + 1]


def record(**what):
    with open(os.path.join(os.environ["STANDIN_OUT"], f"server_{port}.json"), "w") as f:
        json.dump({"argv": sys.argv[1:], "pid": os.getpid(), "ppid": os.getppid(), **what}, f)


class Server(Health):
    def do_POST(self):
        if self.path == "/freeze_gc":
            record(freeze_gc=True)
        self.send_response(200 if self.path == "/freeze_gc" else 404)
        self.end_headers()


if __name__ == "__main__":
    host, port = flag("--host"), int(flag("--port"))
    if str(port) in os.environ.get("STANDIN_FAIL_PORTS", "").split(","):
        sys.exit(1)
    record()
    HTTPServer((host, port), Server).serve_forever()
