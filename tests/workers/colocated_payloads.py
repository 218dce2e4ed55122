"""Colocated weight payloads (weight_sync/sglang_payloads.py) under torchrun, 2 gloo ranks: an EP2 learner syncs through
training/sync.sync_weights to one colocated "TP2 server" driven by rank 0 (rollout.colocate, in_process). The server
is a stub in rank 0's process that answers as SGLang 0.5.23 does for these calls: server_info, begin/end sessions, the
digest report hook, and update_weights_from_tensor with load_format=flattened_bucket. TP rank k opens entry [k]
(tp_worker.py:194-201) and rebuilds the bucket's tensors as views of its flattened tensor (weight_updater.py:383-413).
For each entry, the stub records the process whose shared-memory file holds it (torch names file_system storages
/torch_<pid>_..., read from the pickle without opening it). Four syncs with one tensor per bucket
(rollout.sync_bucket_mb=0), the clean ones verified by the digests of what TP rank 0 loaded: clean; the server's 5th
load fails (the driver drains the export, every rank leaves the sync); rank 1 fails to make its 3rd payload (the
driver's load fails naming it); clean again. The report gives every rank's pid and each attempt's outcome per rank
and, per post, the pid of each entry's producer."""
import base64
import dataclasses
import json
import os
import pickle
import pickletools
import re
import sys
import threading
import types
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
import torch.distributed as dist

from moe.bridge.digest import tensor_digest
from moe.model import load_hf_config
from rlpo_mega import distributed
from rlpo_mega.config import load_config
from rlpo_mega.rollout import EngineError
from rlpo_mega.weight_sync import sglang_payloads as sp
from rlpo_mega.model_setup import build_policy
from rlpo_mega.rollout.sglang_engine import SGLangEngine
from rlpo_mega.rollout.sglang_reports import REPORT_LOADER
from rlpo_mega.training.sync import sync_weights
from rlpo_mega.weight_sync.transports import InProcessTransport
from tests.dist import write_report
from tests.workers.bridge import make_hf_checkpoint


def producer_pids(entry: str) -> list[int]:
    """The pids in the shared-memory file names a payload's pickle refers to (torch: /torch_<pid>_<random>_<n>)."""
    data = base64.b64decode(entry)
    return sorted({int(m[1]) for _, arg, _ in pickletools.genops(data) if isinstance(arg, bytes)
                   for m in [re.match(rb"/torch_(\d+)_", arg)] if m})


class StubTP:
    """One SGLang server of `tp` ranks, as far as the weight sync sees it."""

    def __init__(self, tp: int):
        self.tp, self.session = tp, False
        self.fail_at = None  # the index of a flattened_bucket post to answer 500
        self.state = [{} for _ in range(tp)]  # per TP rank: what it loaded
        self.posts = []  # per flattened_bucket post: each entry's producer pids, the names it carried
        self.formats = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path == "/server_info":
                    return self._send(200, {"tp_size": stub.tp})
                self._send(200 if self.path in ("/health", "/ready") else 404, {})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                status, out = stub.answer(self.path, body)
                self._send(status, out)

            def _send(self, status, out):
                data = json.dumps(out).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def answer(self, path, body):
        if path == "/begin_weight_update":
            was, self.session = self.session, True
            return (400, {"success": False, "message": "already open"}) if was else (200, {"success": True})
        if path == "/end_weight_update":
            was, self.session = self.session, False
            return (200, {"success": True}) if was else (400, {"success": False, "message": "no session is open"})
        if path == "/flush_cache":
            return 200, {}
        if path != "/update_weights_from_tensor":
            return 404, {}
        entries, fmt = body["serialized_named_tensors"], body.get("load_format")
        self.formats.append(fmt)
        if len(entries) != self.tp:
            return 400, {"success": False, "message": f"{len(entries)} entries for TP{self.tp}"}
        if fmt == REPORT_LOADER:
            req = json.loads(pickle.loads(base64.b64decode(entries[0]))[0][0])
            store = dist.TCPStore(req["store"][0], int(req["store"][1]), is_master=False,
                                  timeout=timedelta(seconds=req["timeout"]))
            store.set(req["key"], json.dumps({"digests": {n: tensor_digest(t, req["algorithm"])
                                                          for n, t in self.state[0].items()}}))
            return 200, {"success": True}
        if fmt != "flattened_bucket":
            return 400, {"success": False, "message": f"test stub: load_format {fmt!r}"}
        if self.fail_at == len(self.posts):
            self.fail_at = None
            self.posts.append({"pids": [producer_pids(e) for e in entries], "names": None, "failed": True})
            return 500, {"success": False, "message": "test: load failed"}
        names = None
        for k, entry in enumerate(entries):  # TP rank k opens its own entry
            bucket = pickle.loads(base64.b64decode(entry))
            flat = bucket["flattened_tensor"]
            assert flat.dtype == torch.uint8 and flat.dim() == 1
            for meta in bucket["metadata"]:
                assert isinstance(meta, types.SimpleNamespace)  # what SGLang's SafeUnpickler admits
                view = flat[meta.start_idx:meta.end_idx].view(meta.dtype).reshape(meta.shape)
                self.state[k][meta.name] = view.clone()
            names = [m.name for m in bucket["metadata"]]
        self.posts.append({"pids": [producer_pids(e) for e in entries], "names": names})
        return 200, {"success": True}


def main():
    out_dir, model_cfg = sys.argv[1], sys.argv[2]
    hf = load_hf_config(model_cfg)
    src = os.path.join(out_dir, "hf_src")
    cfg = load_config(None, ("parallel.expert=2", f"model.init_from_hf={src}", "rollout.engine=sglang",
                             "rollout.colocate=true", "rollout.sync_transport=in_process", "rollout.sglang.launch=true",
                             "rollout.sglang.tp_size=2", "rollout.sglang.num_servers=1", "rollout.sglang.drivers=1",
                             "rollout.sync_bucket_mb=0"))  # one tensor per bucket: many relay rounds
    dist_env = distributed.init(cfg.parallel, hf, cfg.seed)
    rank = dist.get_rank()
    if rank == 0:
        make_hf_checkpoint(hf, src)
    dist.barrier()
    chunks, _ = build_policy(hf, dist_env, cfg.model, cfg.optim)
    group = distributed.control_group(120)
    stub = engine = transport = None
    if rank == 0:
        stub = StubTP(2)
        sg = dataclasses.replace(cfg.rollout.sglang, urls=[stub.url], launch=False, control_timeout=60.0)
        engine = SGLangEngine(sg, hf, colocate=True)
        transport = InProcessTransport(engine)
    slot = types.SimpleNamespace(engine=engine, transport=transport, group=group, hf=hf)
    attempts, spans = [], []

    def attempt():
        before = len(stub.posts) if stub is not None else 0
        try:
            attempts.append({"ok": sync_weights(chunks, cfg, slot)})
        except EngineError as e:
            attempts.append({"error": str(e)})
        spans.append([before, len(stub.posts) if stub is not None else 0])

    attempt()  # clean
    if rank == 0:
        stub.fail_at = len(stub.posts) + 4  # the server's 5th load of the next sync fails
    attempt()
    if rank == 1:  # this rank's 3rd payload of the next sync cannot be made
        made, calls = sp.flatten, []

        def failing(named, aliases=None):
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("test: out of memory")
            return made(named, aliases)
        sp.flatten = failing
    attempt()
    if rank == 1:
        sp.flatten = made
    attempt()  # clean again
    pids = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, attempts)
    if rank == 0:
        write_report({"pids": pids, "attempts": every, "spans": spans, "posts": stub.posts,
                      "formats": sorted(set(stub.formats)),
                      "tp_ranks_equal": sorted(stub.state[0]) == sorted(stub.state[1]) and all(
                          torch.equal(t, stub.state[1][n]) for n, t in stub.state[0].items())})
        engine.shutdown()
    distributed.destroy()


if __name__ == "__main__":
    main()
