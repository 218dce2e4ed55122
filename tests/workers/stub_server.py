"""A stand-in for `python -m sglang.launch_server ... --port N`: answers GET /health, nothing else."""
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer


class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


if __name__ == "__main__":
    port = int(sys.argv[sys.argv.index("--port") + 1])
    try:
        server = HTTPServer(("127.0.0.1", port), Health)
    except OSError as e:  # as uvicorn does under sglang: logs the error, exits STARTUP_FAILURE (3)
        print(f"ERROR:    [Errno {e.errno}] error while attempting to bind on address ('127.0.0.1', {port}): "
              f"{e.strerror.lower()}", flush=True)
        sys.exit(3)
    server.serve_forever()
