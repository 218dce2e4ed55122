"""What SGLang servers report from inside themselves: the weights they hold (digests) and their environment.

SGLang cannot return MoE weights over HTTP, so a custom weight loader (launch/rlpo_sglang_hooks.report_digests)
runs in every TP rank of a server: it gathers the server's TP shards, maps them to HF names and digests them
inside the server; only the digests come back, through a TCP store each driver hosts (the same store the
sglang_distributed group meets at). No shared filesystem, no weights on the wire. That store takes writes from
anyone who reaches its port, so every report comes sealed with the job's key (an HMAC over the report and the
request's random store key: launch/rlpo_sglang_keys.py) and one whose seal fails is a failed sync
(DigestMismatchError for digests, EngineError for the environment), never a pass.

`InServerReports` is the SGLang engine's part that asks for them (SGLangEngine inherits it); it uses the
engine's HTTP calls (_http, _post_ok, _begin, _end_quietly), its key (_api_key), its config (cfg: control_timeout,
store_port, learner_address, tp_size, api_key_env), its driver index, its live servers and its model's tied head
(tied, _head, _embed).
"""
from __future__ import annotations

import base64
import json
import os
import pickle
import socket
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from moe.bridge.digest import DigestMismatchError, verify
from rlpo_mega.engine_errors import EngineError

from . import sglang_auth

REPORT_LOADER = "rlpo_sglang_hooks.report_digests"  # launch/rlpo_sglang_hooks.py


class InServerReports:
    """Digests and environments reported from inside the servers, through this driver's TCP store."""

    def _init_reports(self):
        self._store = None  # TCP store hosted here: digest reports, the sglang_distributed rendezvous
        self._store_lock = threading.Lock()
        self.digest_peak_bytes: dict[str, Optional[int]] = {}  # per server URL: the last digest report's peak

    def learner_address(self) -> str:
        """How servers reach this rank. On node 0 (torchrun's GROUP_RANK): rollout.sglang.learner_address, else
        torchrun's MASTER_ADDR (node 0's host), else loopback. A driver on another node: its hostname (as
        launched servers on a wildcard host are addressed), since MASTER_ADDR names node 0."""
        if int(os.environ.get("GROUP_RANK", "0")) != 0:
            return socket.gethostname()
        return self.cfg.learner_address or os.environ.get("MASTER_ADDR") or "127.0.0.1"

    def store(self):
        """The TCP store this rank hosts for its servers (created once; port rollout.sglang.store_port + this
        driver's index, so drivers sharing a host never collide; 0 = any free port). Hosted directly, not through
        rendezvous(): under torchrun (TORCHELASTIC_USE_AGENT_STORE) rendezvous() turns rank 0 into a client of the
        agent's store and the servers wait for a host that never comes."""
        # under a lock: the digest reports of a driver's servers are asked for concurrently (weight_digests), and
        # two threads that both found no store each created one: the first server was told a port whose store
        # the second assignment then dropped, its report hook retried that closed port for control_timeout and
        # the sync failed (two servers per driver; one server never raced)
        with self._store_lock:
            if self._store is None:
                port = self.cfg.store_port + self.driver if self.cfg.store_port else 0
                self._store = dist.TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False,
                                            timeout=timedelta(seconds=self.cfg.control_timeout))
            return self._store

    def _hook_request(self, server: _Server, request: dict, what: str, forged=EngineError, session: bool = True,
                      every_rank: bool = False, per_rank: Optional[list] = None):
        """Run launch/rlpo_sglang_hooks.py's loader in every TP rank of `server` with `request`; its TP rank 0's
        report (a JSON object) comes back through this rank's TCP store, sealed with the job's key -- or, every_rank,
        each TP rank's report (a list in rank order: the shard-to-shard refit's requests). what: the report, for the
        errors; forged: the error a report without the job's seal raises. session=False: inside an update session
        the caller opened (begin_weight_update), which the call neither opens nor closes. per_rank: a dict per TP
        rank merged into that rank's request (the colocated refit's payload of each rank)."""
        key = f"rlpo_reports/{uuid.uuid4().hex}"
        request = {**request, "store": [self.learner_address(), self.store().port], "key": key,
                   "timeout": self.cfg.control_timeout}

        def payload(extra: dict) -> str:
            # a plain pickle (bytes inline), not shared memory: the server may be on another host
            return base64.b64encode(pickle.dumps([(json.dumps({**request, **extra}), torch.zeros(1))])).decode()

        if per_rank is not None and len(per_rank) != self.cfg.tp_size:
            raise EngineError(f"SGLang server {server.url}: {len(per_rank)} per-rank requests for TP{self.cfg.tp_size}")
        payloads = [payload(extra) for extra in per_rank] if per_rank is not None else [payload({})] * self.cfg.tp_size
        if session:
            self._begin(server)
        try:
            status, body = self._http(server, "/update_weights_from_tensor", {
                "serialized_named_tensors": payloads, "load_format": REPORT_LOADER,
                "flush_cache": False})
        except BaseException:
            if session:
                self._end_quietly([server])
            raise
        if session:
            self._post_ok(server, "/end_weight_update")
        keys = [f"{key}/{r}" for r in range(self.cfg.tp_size)] if every_rank else [key]
        if status != 200:
            # a hook that raised has still written its error: name it rather than the status alone
            errors = [self._sealed(server, k, what, forged).get("error") for k in keys if self.store().check([k])]
            detail = next((e for e in errors if e), None)
            if detail:
                raise EngineError(f"SGLang server {server.url}: its report hook failed ({what}): {detail}")
            raise EngineError(f"SGLang server {server.url} could not report its {what} ({status}: "
                              f"{body[:300]!r}): start it with --custom-weight-loader {REPORT_LOADER} and the "
                              "repository root and launch/ on its PYTHONPATH (launch/sglang_server.py does both)")
        try:
            self.store().wait(keys, timedelta(seconds=self.cfg.control_timeout))
        except Exception as e:
            raise EngineError(f"SGLang server {server.url} ran the report hook but its {what} never reached "
                              f"{self.learner_address()}:{self.store().port} within control_timeout: can the "
                              f"server reach this host (rollout.sglang.learner_address)? ({e})") from e
        reports = [self._sealed(server, k, what, forged) for k in keys]
        for report in reports:
            if "error" in report:
                raise EngineError(f"SGLang server {server.url}: its report hook failed ({what}): {report['error']}")
        return reports if every_rank else reports[0]

    def _sealed(self, server: _Server, key: str, what: str, forged) -> dict:
        """The report under `key` in this rank's store (taken out of it), its seal checked."""
        raw = self.store().get(key)
        self.store().delete_key(key)
        try:
            report = sglang_auth.unseal(self._api_key, key, raw)
        except sglang_auth.report_auth_error() as e:
            raise forged(f"SGLang server {server.url}: its {what} report fails authentication ({e}; an HMAC with the "
                         f"job's key, ${self.cfg.api_key_env}): forged by another writer to this driver's TCP store "
                         f"({self.learner_address()}:{self.store().port}), or the server holds another key; the sync "
                         "fails") from None
        if not isinstance(report, dict):
            raise forged(f"SGLang server {server.url}: its {what} report is not a JSON object: {str(report)[:200]}")
        return report

    def _digest_request(self, server: _Server, algorithm: str) -> dict[str, str]:
        self._check_layout()
        report = self._hook_request(server, {"algorithm": algorithm}, "weight digests", forged=DigestMismatchError)
        self.digest_peak_bytes[server.url] = report.get("peak_extra_bytes")  # the hook's own cost (host RSS)
        return report["digests"]

    def environments(self) -> dict[str, dict]:
        """{server URL: its environment} (torch, CUDA and NCCL versions of its TP rank 0; NCCL None without
        CUDA), as launch/rlpo_sglang_hooks.py reports it from inside the server."""
        self._check_layout()
        return {s.url: self._hook_request(s, {"what": "environment"}, "environment")["environment"]
                for s in self.live}

    def receivers(self, replay: Optional[bool] = None) -> dict[str, dict]:
        """{server URL: its in-server receiver's counts} (replayed, loaded by SGLang, learned, seconds in it; TP
        rank 0's), installing the receiver where it is not yet (launch/rlpo_sglang_receiver.py: each tensor SGLang
        loaded once replayed as its copies). replay=False: SGLang's loader for every tensor, timed (benchmarks)."""
        self._check_layout()
        request = {"what": "receiver", **({} if replay is None else {"replay": replay})}
        return {s.url: self._hook_request(s, request, "receiver")["receiver"] for s in self.live}

    def weight_digests(self, names, algorithm: str) -> dict[str, str]:
        """{HF name: digest} of what the servers hold, digested inside each server; servers must agree."""
        servers = self.live
        with ThreadPoolExecutor(max_workers=len(servers)) as pool:
            per_server = list(pool.map(lambda server: self._digest_request(server, algorithm), servers))
        if self.tied:
            for s, d in zip(servers, per_server):
                if self._head in d and d[self._head] != d.get(self._embed):
                    raise DigestMismatchError(
                        f"SGLang server {s.url} holds an lm_head that is not its (tied) embedding: its model class "
                        "ignores tie_word_embeddings (sglang 0.5.23 Mixtral); sync all weights through this engine "
                        "(it sends lm_head too) or serve an untied checkpoint")
        for s, d in zip(servers[1:], per_server[1:]):
            try:
                verify({n: per_server[0][n] for n in names if n in per_server[0]}, d,
                       where=f"SGLang server {s.url} (vs {servers[0].url})")
            except DigestMismatchError as e:
                raise DigestMismatchError(f"SGLang servers disagree: {e}") from e
        return {n: per_server[0][n] for n in names if n in per_server[0]}
