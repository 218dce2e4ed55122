"""Time limits of the rollout path, without a real SGLang (fast): a server that accepts connections but never
answers is detected within the configured time, for a generation (hang_timeout, polled /health) and for a
control call (control_timeout); the trainer's stop flag ends a rollout wait; ranks waiting for rank 0's
rollout wait on their own gloo group, whose timeout is not the default group's.
(The same with a real, frozen SGLang server inside the trainer: tests/test_sglang.py.)"""
import contextlib
import socket
import threading
import time

import pytest

from moe.model import load_hf_config
from rlpo_mega.config import SGLangEngineConfig
from rlpo_mega.rollout import EngineError, RolloutInterrupted, SamplingParams
from rlpo_mega.rollout.sglang_engine import SGLangEngine
from tests.dist import ROOT, torchrun


@contextlib.contextmanager
def silent_server():
    """Accepts every connection on 127.0.0.1 and never sends a byte (a hung server), for the test's length."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    sock.settimeout(0.2)
    held, stop = [], threading.Event()

    def accept():
        while not stop.is_set():
            try:
                held.append(sock.accept()[0])
            except OSError:
                pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        stop.set()
        t.join(5)
        for c in held:
            c.close()
        sock.close()


def engine_for(url, **kw):
    """An engine attached to `url` (or a list of urls), with short health timings."""
    hf = load_hf_config(f"{ROOT}/configs/models/tiny_qwen3_moe.json")
    settings = dict(request_timeout=600.0, control_timeout=600.0, health_timeout=0.5, health_interval=0.25,
                    hang_timeout=600.0)
    cfg = SGLangEngineConfig(urls=[url] if isinstance(url, str) else list(url), **{**settings, **kw})
    return SGLangEngine(cfg, hf)


def test_hung_server_detected_during_generation():
    with silent_server() as url:
        engine = engine_for(url, hang_timeout=2.0)
        t0 = time.monotonic()
        with pytest.raises(EngineError, match="hang_timeout"):
            engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4), n=2)
        took = time.monotonic() - t0
        engine.shutdown()
    # hang_timeout 2 s, plus at most one /health poll (interval 0.25 s + its 0.5 s timeout); not 600 s
    assert 2.0 <= took < 4.0, took


def test_hung_server_detected_on_control_call():
    with silent_server() as url:
        engine = engine_for(url, control_timeout=1.5)
        t0 = time.monotonic()
        # the first control call: the servers' layout, read once before the first weight transfer
        with pytest.raises(EngineError, match=r"/server_info failed after at most 1\.5 s"):
            engine.begin_weight_update()
        took = time.monotonic() - t0
        engine.shutdown()
    assert took < 3.5, took  # 1.5 s, then one /health probe (0.5 s) names the cause


def test_stop_request_ends_the_wait():
    with silent_server() as url:
        engine = engine_for(url)
        t0 = time.monotonic()
        engine.should_stop = lambda: time.monotonic() - t0 > 1.0
        with pytest.raises(RolloutInterrupted, match="2 requests aborted"):
            engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4), n=2)
        took = time.monotonic() - t0
        engine.shutdown()
    assert took < 3.0, took  # 1 s, then each abort attempt gives up after health_timeout


def test_waiting_ranks_outlive_the_default_timeout():
    """2 ranks, default group timeout 3 s: rank 0 'generates' for 6 s. Waiting in rollout_phase.agree on
    the control group (60 s) succeeds; the same wait on the default group times out."""
    r = torchrun("engine_wait.py", 2)
    assert r["control_group"] == {"code": 1, "waited_s": pytest.approx(6.0, abs=2.0)}, r
    assert r["default_group"].startswith("timed out"), r


def test_stop_on_reused_keepalive_connections_ends_every_request():
    """A server that answered step 1 on keep-alive connections hangs in step 2 (as a frozen SGLang does): a stop
    ends the wait at once and no worker stays blocked (shut sockets are not retried on a new connection)."""
    import json
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import torch

    from moe.routing.decoders import encode_sglang

    hang = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: the second rollout reuses the first one's connections

        def log_message(self, *args):
            pass

        def _send(self, obj):
            body = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self._send({})

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path != "/generate":
                return self._send({})
            if hang.is_set():
                time.sleep(30)
                return
            rows = len(req["input_ids"]) + 2
            routes = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32).expand(rows, 2, 2).contiguous()
            self._send({"output_ids": [10, 11, 12], "meta_info": {
                "finish_reason": {"type": "length"}, "output_token_logprobs": [[-0.5, 1, None]] * 3,
                "routed_experts": encode_sglang(routes)}})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        engine = engine_for(f"http://127.0.0.1:{server.server_address[1]}", health_timeout=1.0)
        assert len(engine.generate([[1, 2, 3]] * 4, SamplingParams(max_new_tokens=3), n=2)) == 8
        hang.set()
        t0 = time.monotonic()
        engine.should_stop = lambda: time.monotonic() - t0 > 1.0
        with pytest.raises(RolloutInterrupted):
            engine.generate([[1, 2, 3]] * 4, SamplingParams(max_new_tokens=3), n=2)
        took = time.monotonic() - t0
        busy = [t for t in engine._io.threads if t.is_alive()]
        engine.shutdown()
        assert took < 4.0, took  # 1 s, then aborts bounded by health_timeout; not the 6 s wait for workers
        assert busy and not any(t.is_alive() for t in busy)
    finally:
        server.shutdown()
        server.server_close()
