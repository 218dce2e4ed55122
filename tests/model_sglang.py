"""A stub SGLang server backed by a real model: SGLang 0.5.23's HTTP surface (the calls the SGLang engine makes)
over an embedded engine in this process, so that a trainer run on `rollout.engine=sglang` trains on real tokens,
log-probs and routes that the embedded engine's own record (tests/workers/train_hooks.RecordedEngine) can check.

/generate answers one request (the client sends one per sample) with SGLang's JSON: output_ids, meta_info's
finish_reason {"type"}, output_token_logprobs [[logprob, id, None]], weight_version and routed_experts (base64
of little-endian int32 [rows, num_hidden_layers, topk] from routed_experts_start_len on; the dense layers' rows
0). Requests run one at a time (the embedded engine is one batch at a time); /abort_request ends the running
one through the engine's abort (its tokens so far come back, finish "abort") or a queued one before it starts.
Weight updates: begin/end sessions (the engine's own update spans a session's loads: one record entry per sync),
update_weights_from_tensor (a ForkingPickler payload, or the digest report
hook, REPORT_LOADER, answered through the driver's TCP store as launch/rlpo_sglang_hooks.py does; the receiver's
install request is answered with no counts: the stub loads through its embedded engine),
update_weight_version, flush_cache, server_info (tp_size 1, no radix cache: the stub caches nothing).
rollout.partial_rollout_kv=keep: /pause_generation (mode in_place) holds the server: the running generation ends
first (the embedded engine generates a request at once), the next wait, the weights load under the hold (no lock
of their own), and /continue_generation lets them go on, on the new weights (their weight_version says so).
kill() is a dead server: it stops listening and every request on it, queued, held or on a kept-alive connection,
ends without an answer (the connection closed), as a SIGKILLed server's do.
Keys, as SGLang 0.5.23 with --api-key K --admin-api-key K: a stub with a key (`key`, default $RLPO_SGLANG_KEY)
answers 401 {"error": "Unauthorized"} to any request but /health*, /ready and /metrics without
`Authorization: Bearer K` (scheme case-insensitive), and seals its reports with K (launch/rlpo_sglang_keys.py):
a driver that forgets the header on any path fails there. `unauthorized` counts the refused requests."""
from __future__ import annotations

import base64
import json
import os
import pickle
import threading
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import torch

from moe.routing.trace import TraceSpec
from rlpo_mega.rollout import SamplingParams
from rlpo_mega.rollout.sglang_auth import keys_module
from rlpo_mega.rollout.sglang_reports import REPORT_LOADER

_OPEN = ("/health", "/ready", "/metrics")  # SGLang's auth middleware lets these through whatever the keys


def authorized(headers, key) -> bool:
    """SGLang's check (srt/utils/auth.py): no key configured, or `Bearer <key>` (scheme case-insensitive)."""
    if not key:
        return True
    parts = (headers.get("Authorization") or "").split(" ", 1)
    return len(parts) == 2 and parts[0].lower() == "bearer" and parts[1] == key


class ModelSGLang:
    def __init__(self, engine, hf, primary: bool = True, key: str | None = None):
        # primary: this server's engine records the syncs (RecordedEngine.syncs, one entry per sync); the others
        # receive the same weights and record their calls only
        self.engine, self.hf, self.primary = engine, hf, primary
        self.spec = TraceSpec.from_hf(hf)
        self.lock = threading.Lock()  # one generation at a time
        self.state = threading.Lock()
        self.aborted: set = set()
        self.abort_all = 0  # generation of abort_all calls: a request queued before one is aborted
        self.session, self.loading, self.version, self.names = False, False, None, set()
        self.requests = 0
        self.closed = False
        self.held, self.pauses, self.continues = False, 0, 0  # /pause_generation in_place .. /continue_generation
        self.go = threading.Event()  # cleared while held: a generation waits to start
        self.go.set()
        self.dead = False  # kill()
        self.key = key or os.environ.get(keys_module().KEY_ENV) or None
        self.unauthorized = 0
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def _refused(self):
                if self.path.startswith(_OPEN) or authorized(self.headers, stub.key):
                    return False
                stub.unauthorized += 1
                self._send(401, {"error": "Unauthorized"})
                return True

            def do_GET(self):
                if stub.dead:
                    return self._drop()
                if self._refused():
                    return
                if self.path == "/server_info":
                    return self._send(200, {"tp_size": 1, "disable_radix_cache": True})
                self._send(200 if self.path == "/health" else 404, {})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                if stub.dead:
                    return self._drop()
                if self._refused():
                    return
                status, out = stub.answer(self.path, body)
                if stub.dead:  # killed while it ran or waited: no answer comes
                    return self._drop()
                self._send(status, out)

            def _drop(self):
                self.close_connection = True

            def _send(self, status, out):
                data = json.dumps(out).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        class Server(ThreadingHTTPServer):
            request_queue_size = 1024
            daemon_threads = True

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def answer(self, path, body):
        if path == "/generate":
            return self.generate(body)
        if path == "/abort_request":
            with self.state:
                if body.get("abort_all"):
                    self.abort_all += 1
                    self.engine.abort()
                else:
                    self.aborted.add(body["rid"])
                    self.engine.abort([body["rid"]])
            return 200, {}
        if path == "/begin_weight_update":
            if self.session:
                return 400, {"success": False, "message": "a weight-update session is already open"}
            self.session = True
            return 200, {"success": True}
        if path == "/end_weight_update":
            was, self.session = self.session, False
            if self.loading:  # the session's loads end here: the engine records the weights it now holds
                locked, self.loading = self.loading == "locked", False
                try:
                    self.engine.end_weight_update()
                    if not self.primary:
                        type(self.engine).syncs.pop()
                finally:
                    if locked:
                        self.lock.release()
            return (200, {"success": True}) if was else (400, {"success": False, "message": "no session is open"})
        if path == "/flush_cache":
            return 200, {}
        if path == "/pause_generation":
            if body.get("mode") != "in_place":
                return 400, {"success": False, "message": f"test stub: pause mode {body.get('mode')!r}"}
            with self.state:
                self.pauses += 1
                self.held = True
                self.go.clear()  # none starts until /continue_generation (the queued ones before this pause)
            with self.lock:  # the running generation ends first
                return 200, {}
        if path == "/continue_generation":
            with self.state:
                self.continues += 1
                self.held = False
                self.go.set()
            return 200, {}
        if path == "/update_weight_version":
            self.version = body["new_version"]
            return 200, {"success": True}
        if path == "/update_weights_from_tensor":
            named = pickle.loads(base64.b64decode(body["serialized_named_tensors"][0]))
            if body.get("load_format") == REPORT_LOADER:
                req = json.loads(named[0][0])
                store = torch.distributed.TCPStore(req["store"][0], int(req["store"][1]), is_master=False,
                                                   timeout=timedelta(seconds=req["timeout"]))
                if req.get("what") == "receiver":  # the engine installs SGLang's in-server receiver: none here
                    store.set(req["key"], keys_module().seal(self.key, req["key"], {"receiver": {}}))
                    return 200, {"success": True}
                digests = self.engine.weight_digests(sorted(self.names), req["algorithm"])
                store.set(req["key"], keys_module().seal(self.key, req["key"], {"digests": digests}))
                return 200, {"success": True}
            if self.closed:
                return 503, {"success": False, "message": "the server is shutting down"}
            if not self.loading:  # the session's first load: no generation runs until it ends (held: the hold
                # keeps them waiting already)
                with self.state:
                    held = self.held
                if not held:
                    self.lock.acquire()
                self.engine.begin_weight_update()
                self.loading = "held" if held else "locked"
            self.engine.load_weights([(n, t) for n, t in named])
            self.names |= {n for n, _ in named}
            return 200, {"success": True}
        return 404, {}

    def generate(self, body):
        rid, sp = body["rid"], body["sampling_params"]
        start = int(body.get("routed_experts_start_len", 0))
        params = SamplingParams(temperature=sp["temperature"], top_p=sp["top_p"], top_k=sp["top_k"],
                                max_new_tokens=sp["max_new_tokens"], stop_token_ids=tuple(sp["stop_token_ids"]),
                                seed=sp.get("sampling_seed"))
        with self.state:
            epoch = self.abort_all
        while True:  # the lock, and no hold (a held server's queued requests wait: the pause comes first)
            self.go.wait()
            self.lock.acquire()
            if self.go.is_set():
                break
            self.lock.release()
        try:
            with self.state:
                self.requests += 1
                skipped = rid in self.aborted or self.abort_all != epoch
            version = self.version  # the version of the weights it runs on (they cannot change under the lock)
            if skipped or self.closed or self.dead:  # aborted while it waited (or gone): nothing generated, as
                # SGLang answers a request it dropped
                sample = None
            else:
                sample = self.engine.generate([body["input_ids"]], params, n=1, request_ids=[rid])[0]
        finally:
            self.lock.release()
        if sample is None:
            return 200, {"output_ids": [], "meta_info": {"finish_reason": {"type": "abort"}, "weight_version": version,
                                                         "output_token_logprobs": []}}
        ids = [int(t) for t in sample.response_ids]
        meta = {"finish_reason": {"type": sample.finish_reason}, "weight_version": version,
                "output_token_logprobs": [[float(lp), t, None] for lp, t in zip(sample.logprobs.tolist(), ids)]}
        if body.get("return_routed_experts") and sample.routes is not None:
            rows = sample.routes[start:].to(torch.int32)
            full = torch.zeros(rows.shape[0], self.hf.num_hidden_layers, rows.shape[2], dtype=torch.int32)
            full[:, list(self.spec.moe_layers)] = rows
            meta["routed_experts"] = base64.b64encode(np.ascontiguousarray(full.numpy(), dtype="<i4").tobytes()).decode()
        return 200, {"output_ids": ids, "meta_info": meta}

    def kill(self):
        """A dead server (SIGKILL): it stops listening, and its requests end without an answer."""
        with self.state:
            self.dead, self.held = True, False
            self.go.set()  # the requests waiting on the hold wake to find it dead
        self.httpd.shutdown()
        self.httpd.server_close()

    def close(self):
        """Stop serving, then wait for the generation or weight session still running: its engine writes to the
        class-level record, which the next run starts afresh."""
        self.httpd.shutdown()
        self.httpd.server_close()
        self.closed = True
        with self.state:  # left held (a failed run): nothing more will continue it
            self.held = False
            self.go.set()
        if self.lock.acquire(timeout=60):
            self.lock.release()
