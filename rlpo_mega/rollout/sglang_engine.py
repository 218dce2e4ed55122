"""The SGLang rollout engine: an HTTP client of one or more SGLang servers (one per engine-TP group).

Servers are attached by URL (`rollout.sglang.urls`) or started here (`launch: true`, launch/sglang_server.py).
`rollout.sglang.drivers` learner ranks run a client each (SGLangEngine.ranks), over its own contiguous share of
the servers: no server is driven by two clients, and each client receives the weights and pushes them to its own.
Requests go to /generate with input_ids, our own rids, return_logprob and return_routed_experts, at most
`max_in_flight_per_server` at once per server; every request is a task on the engine's one I/O thread, which
reads and decodes each answer as it arrives (sglang_client.py: the event loop, the in-flight limit, vectorized
log-prob and route decoding). Plain HTTP (urllib): the
learner's environment needs no sglang; only update_weights_from_tensor's payload uses torch's ForkingPickler
(what sglang's MultiprocessingSerializer is), with CPU tensors in shared-memory files (file_system strategy:
the default file-descriptor passing cannot cross HTTP and crashed the server).

Weight sync (every path wrapped in /begin_weight_update ... /end_weight_update, then a flush):
  load_weights        update_weights_from_tensor: host tensors in shared memory of this host; colocated
                      (rollout.colocate) one flattened_bucket per bucket, each TP rank's entry made on its own GPU
                      by the learner rank there (sglang_payloads.py: the relay, the UUID reduction)
  reload_from_disk    update_weights_from_disk
  "sglang_distributed" transport (rlpo_mega/weight_sync/sglang_distributed.py): init_weights_update_group +
                      update_weights_from_distributed
weight_digests asks every server what it actually holds, digested inside the server (sglang_reports.py).

Keys: every request carries the job's key (`Authorization: Bearer <key>`, rlpo_mega/rollout/sglang_auth.py says
where it comes from); at start each server must take it and refuse a request without it (_check_key), and the
reports its hooks send back must carry its seal (sglang_reports.py).

Time limits: control calls (weight updates, digests, flushes) use `control_timeout`; a generation may take
`request_timeout`, but while it runs every server with requests in flight must answer GET /health within
`hang_timeout` seconds, and the trainer's stop request (SIGTERM) aborts the wait.
"""
from __future__ import annotations

import asyncio
import base64
import http.client
import io
import itertools
import json
import logging
import os
import queue
import threading
import time
import urllib.error
import urllib.request
import uuid
import weakref
from concurrent.futures import wait
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from safetensors import safe_open

from moe.bridge.fp8 import BLOCK
from moe.families import get_family
from moe.model import load_hf_config
from moe.routing.trace import RoutingTraceError, TraceSpec, clean_trace

from .base import ENGINES, EngineError, Feed, RolloutEngine, RolloutInterrupted, Sample, SampleMeta, SamplingParams
from .sglang_client import (Connections, IOLoop, ServerSlots, SlotsClosed, decode_routes, dumps, loads, parse_logprobs,
                            receive_buffer, split_routes)
from . import sglang_auth, sglang_plan
from rlpo_mega.shares import share_of
from rlpo_mega.weight_sync.sglang_payloads import FLATTENED, flatten, placements, serialize, tied_aliases
from .sglang_checks import check_sglang
from .sglang_launch import fp8_server_args, launch_node_servers, lora_server_args, server_args_cli
from .sglang_reports import InServerReports

log = logging.getLogger("rlpo_mega")
FINISH = {"stop": "stop", "length": "length", "abort": "abort"}
_WAKE = object()  # a feed's wake-up in a stream's queue of finished requests (Feed.wake)
# control calls (urllib) ignore http_proxy & co.: a server address is never reached through a proxy
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class EngineRestarted(EngineError):
    """A dead launched server was restarted: it holds the checkpoint's weights again; re-sync, then retry."""


class _Server:
    def __init__(self, url: str, launched=None, node: Optional[int] = None):
        self.url = url.rstrip("/")
        self.launched = launched  # launch/sglang_server.SGLangServer when this process started it
        self.node = node  # launched by this run on another node (EngineSlot): that node's launcher restarts it
        self.restarts = 0
        # in the generation pool and the weight-update group: a dead server leaves both (its requests are sent to
        # the others) and rejoins at a sync, after a full, digest-verified load (SGLangEngine.refresh)
        self.alive = True
        # memory released (rollout.colocate): the tags /release_memory_occupation gave up and no resume took back;
        # SGLang raises on resuming a tag it holds (weight_updater.py: offload_tags.remove), so only these are resumed.
        # A (re)started server holds everything.
        self.released: set = set()
        self.key_checked = False  # takes the job's key and refuses requests without it (SGLangEngine._check_key)
        # rollout.lora_sync=adapter: whether it holds the learner's base (a full, digest-verified sync since it
        # started) and the run's adapter (a later load replaces it); a (re)started server holds neither
        self.base = self.adapter = False


@ENGINES.register("sglang")
class SGLangEngine(InServerReports, RolloutEngine):
    """cfg: SGLangEngineConfig. hf_config: the served model's transformers config (or a config.json path /
    HF directory), for route decoding and digest read-back. model_path: the HF directory to launch from
    (launch mode) or to restart from. driver: this client's index among the cfg.drivers clients: of
    cfg.urls it drives its contiguous share (rlpo_mega/shares.share_of); servers it launches itself it drives all."""

    # its servers join a weight-update group (rlpo_mega/weight_sync/sglang_distributed.py)
    weight_update_group = True
    pauses_in_place = True  # POST /pause_generation mode=in_place (rollout.partial_rollout_kv=keep)
    takes_more = True  # a running stream sends a Feed's prompts as they come (continuous episode turns)
    serves_adapters = True  # rollout.lora_sync=adapter: the base with a LoRA adapter loaded beside it (load_adapter)
    ADAPTER = "rlpo"  # the name of the one adapter a run's servers hold, replaced at every sync

    @classmethod
    def launches_servers(cls, run_cfg) -> bool:
        sg = run_cfg.rollout.sglang
        return bool(sg.launch and not sg.urls)

    @classmethod
    def plan_check(cls, run_cfg) -> None:
        sglang_plan.planned_servers(run_cfg)

    @classmethod
    def plan(cls, run_cfg, hf, world_size: int, n_params: int, gpu_bytes: int, prompt_tokens: int):
        return sglang_plan.plan(run_cfg, hf, n_params, gpu_bytes, prompt_tokens)

    @classmethod
    def check_config(cls, cfg, warns: list, world_size: Optional[int] = None, nodes: Optional[int] = None) -> None:
        check_sglang(cfg, warns, world_size, nodes)

    @classmethod
    def ranks(cls, run_cfg, world_size: int) -> list[int]:
        # evenly spaced: with one driver per node, each node's first rank (torchrun numbers ranks node by node)
        drivers = run_cfg.rollout.sglang.drivers
        return [i * (world_size // drivers) for i in range(drivers)]

    @classmethod
    def colocated_placements(cls, run_cfg, world_size: int, local_world_size: int) -> list:
        """rollout.colocate: each launched server's driver and, per TP rank, the learner rank on its GPU, which makes
        that rank's weight payload (sglang_payloads.placements; training/sync.py relays them)."""
        sg = run_cfg.rollout.sglang
        return placements(world_size, local_world_size, sg.num_servers, sg.tp_size, cls.ranks(run_cfg, world_size))

    @classmethod
    def from_config(cls, run_cfg, hf_config) -> "SGLangEngine":
        driver = cls.ranks(run_cfg, dist.get_world_size()).index(dist.get_rank()) if dist.is_initialized() else 0
        ro = run_cfg.rollout
        return cls(ro.sglang, hf_config, model_path=run_cfg.model.init_from_hf,
                   return_routes=run_cfg.routing.mode != "off", driver=driver, colocate=ro.colocate,
                   keep_kv=ro.holds_requests, weights=ro.weights,
                   lora=run_cfg.model.lora if ro.lora_sync == "adapter" else None)

    def __init__(self, cfg, hf_config, model_path: Optional[str] = None, return_routes: bool = True,
                 driver: int = 0, colocate: bool = False, keep_kv: bool = False, api_key: Optional[str] = None,
                 weights: str = "bf16", lora=None):
        if isinstance(hf_config, str):
            hf_config = load_hf_config(hf_config)
        self.cfg, self.hf, self.model_path, self.driver = cfg, hf_config, model_path, driver
        self.weights = weights  # rollout.weights: fp8 servers hold block-FP8 weights (moe/bridge/fp8.py)
        self.lora = lora  # rollout.lora_sync=adapter: model.lora, whose adapter the servers serve beside the base
        self.colocate = colocate  # the servers on the learner's GPUs (rollout.colocate): weights by CUDA IPC there
        # rollout.partial_rollout_kv=keep: weight updates land under held requests (pause); _held while they are
        self.keep_kv, self._held = keep_kv, False
        self._stop_ids, self._stops_seen = set(), set()  # the last call's stop ids; stop tokens already seen
        self.spec = TraceSpec.from_hf(hf_config)
        self.num_hidden_layers = int(hf_config.num_hidden_layers)
        self.vocab_size = int(hf_config.vocab_size)
        self.return_routes = return_routes
        self.tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        names = get_family(hf_config.model_type).hf_names(hf_config)  # HF names are family knowledge
        self._embed, self._head = names["embedding"], names["output"]
        self.aliases = tied_aliases(hf_config)  # a flattened bucket's tied head (sglang_payloads.flatten)
        self._rid = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self._inflight: dict[str, _Server] = {}
        self._lock = threading.Lock()
        self.weights_updated = False  # since the servers started: a restart would silently undo it
        self.adapter: Optional[str] = None  # rollout.lora_sync=adapter: the loaded adapter every request names
        self.should_stop: Optional[Callable[[], bool]] = None  # the trainer's stop flag, polled while waiting
        self._init_reports()
        self._closed = False
        self.servers: list[_Server] = []
        # the job's key (sglang_auth): given, or in $api_key_env; servers launched here without one get one made now
        name = cfg.api_key_env
        key = sglang_auth.checked(api_key, "api_key") if api_key else sglang_auth.env_key(name)
        if key is None and cfg.launch and not cfg.urls:
            key = sglang_auth.new_key()
        self._api_key = key
        self._auth = {"Authorization": f"Bearer {key}"} if key else {}
        if cfg.urls:
            mine = share_of(cfg.urls, driver, cfg.drivers)
            if not mine:
                raise EngineError(f"rollout.sglang.drivers={cfg.drivers} but only {len(cfg.urls)} server(s): driver "
                                  f"{driver} has none to drive; set rollout.sglang.drivers <= {len(cfg.urls)}")
            self.servers = [_Server(u) for u in mine]
            log.info("SGLang driver %d of %d drives %s", driver, cfg.drivers, ", ".join(mine))
        elif cfg.launch:  # this process alone (a trainer launches per node: rollout/engines.EngineSlot)
            extra = {**(fp8_server_args(hf_config) if weights == "fp8" else {}),
                     **(lora_server_args(lora, hf_config) if lora is not None else {})}
            self.servers = [_Server(srv.url, srv) for srv in launch_node_servers(cfg, model_path, api_key=key,
                                                                                 extra_args=extra)]
        else:
            raise EngineError("rollout.sglang: set urls (attach to running servers) or launch: true")
        # each server's place in the run's URL list (node order): colocated payloads are gathered per place
        # (sglang_payloads.placements)
        index = {u.rstrip("/"): i for i, u in enumerate(cfg.urls)}
        self._place = {s.url: index.get(s.url, i) for i, s in enumerate(self.servers)}
        if not 1 <= cfg.min_servers <= len(self.servers):
            raise EngineError(f"rollout.sglang.min_servers={cfg.min_servers} but driver {driver} drives "
                              f"{len(self.servers)} server(s): set it between 1 and {len(self.servers)}")
        # the driver's fault counters (EngineSlot shares one dict across rebuilds: a run's totals)
        self.faults = {"requests_resent": 0, "server_rejoins": 0, "servers_lost": 0}
        self._rr = itertools.cycle(range(len(self.servers)))
        self._layout_checked = False
        # generation: one I/O thread and keep-alive connections reused across rollouts, ended by shutdown() (or
        # at interpreter exit: the thread does not outlive the engine); bounded kernel buffers for this engine's
        # requests in flight (sglang_client.receive_buffer says why)
        self._io = IOLoop()
        self._conns = Connections(self._io, receive_buffer(cfg.max_in_flight_per_server * len(self.servers)),
                                  b"".join(b"%s: %s\r\n" % (k.encode(), v.encode()) for k, v in self._auth.items()))
        self._decoding = asyncio.Semaphore(cfg.decode_concurrency)  # bodies read and decoded at once
        self._finalizer = weakref.finalize(self, _close_client, self._conns, self._io)
        if key is None:
            log.warning("rollout.sglang: $%s is not set: requests to %s carry no key, which only a server started "
                        "without one answers -- and such a server answers anyone who reaches it (generation, loading "
                        "other weights, its weight-update group); start the servers with the job's key "
                        "(launch/sglang_server.py, launch/slurm/*.sbatch) and export it here as $%s "
                        "(launch/README.md, Keys)", name, ", ".join(s.url for s in self.servers), name)
        try:
            for s in self.servers:  # a server not reachable yet is checked before it takes part (_check_layout, refresh)
                self._check_key(s, at_start=True)
        except BaseException:
            self._finalizer()
            for s in self.servers:
                if s.launched is not None:
                    s.launched.stop()
            raise

    # ---------------------------------------------------------------- keys
    def _refused(self, server: "_Server", path: str, status: int) -> EngineError:
        """The one line for a request a server refused for its key (401/403)."""
        name = self.cfg.api_key_env
        if self._auth:
            return EngineError(f"SGLang server {server.url} refused {path} with this job's key (HTTP {status}; the key "
                               f"in ${name}): it was started with another --api-key/--admin-api-key; start it with the "
                               "job's key (launch/sglang_server.py takes it from $RLPO_SGLANG_KEY; launch/README.md, "
                               "Keys)")
        return EngineError(f"SGLang server {server.url} refused {path} without a key (HTTP {status}): it was started "
                           f"with --api-key; export its key as ${name} (rollout.sglang.api_key_env; launch/README.md, "
                           "Keys)")

    def _status(self, server: "_Server", path: str, payload=None, auth: bool = True) -> int:
        """The HTTP status of one short request (health_timeout x 6, as the other short control calls), with or
        without the key; URLError/OSError when the server does not answer. Not through _http: no restart, no
        retirement."""
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(server.url + path, data=data, method="POST" if data else "GET",
                                     headers={"Content-Type": "application/json", **(self._auth if auth else {})})
        try:
            with _OPENER.open(req, timeout=self.cfg.health_timeout * 6) as r:
                r.read()
                return r.status
        except urllib.error.HTTPError as e:
            e.read()
            return e.code

    def _check_key(self, server: "_Server", at_start: bool = False) -> None:
        """With a job key: `server` takes it, on generation's level (GET /server_info: SGLang's api key) and on its
        control endpoints' (POST /abort_request of no request: the admin key where one is set), and refuses a
        request without it -- one that answers without a key answers anyone, and is refused here (start it with
        the key). Once per server; at_start: a server that does not answer yet is checked before it takes part."""
        if not self._auth or server.key_checked:
            return
        try:
            status = self._status(server, "/server_info")
            if status in (401, 403):
                raise self._refused(server, "GET /server_info", status)
            status = self._status(server, "/abort_request", {"rid": f"rlpo-keycheck-{uuid.uuid4().hex}"})
            if status in (401, 403):
                raise EngineError(f"SGLang server {server.url} takes this job's key for generation but refuses it on its "
                                  f"control endpoints (POST /abort_request: HTTP {status}): its --admin-api-key is "
                                  "another key; start it with the job's key for both (launch/sglang_server.py does)")
            status = self._status(server, "/server_info", auth=False)
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            if at_start:
                log.debug("SGLang server %s: key check deferred (%s)", server.url, e)
                return
            raise EngineError(f"SGLang server {server.url}: its key check failed: {e}") from e
        if status not in (401, 403):
            raise EngineError(f"SGLang server {server.url} answers without a key (GET /server_info: HTTP {status}): "
                              "anyone who reaches it can generate on it, load other weights into it or break its "
                              "weight updates; start it with the job's key (--api-key and --admin-api-key from "
                              f"${self.cfg.api_key_env}: launch/sglang_server.py and launch/slurm/*.sbatch do; "
                              "launch/README.md, Keys)")
        server.key_checked = True

    def _check_layout(self):
        """Each server's own parallel layout (GET /server_info) against rollout.sglang.tp_size, which sizes the
        weight-update group (one rank per TP rank of each server) and the per-rank payloads: a server of another
        TP size would fail or hang at the first sync. Once, before the first weight transfer (generation does
        not depend on it)."""
        if self._layout_checked:
            return
        for s in self.live:
            self._check_key(s)
            status, body = self._http(s, "/server_info", method="GET")
            try:
                info = json.loads(body) if status == 200 else None
            except ValueError:
                info = None
            if not isinstance(info, dict) or "tp_size" not in info:
                raise EngineError(f"SGLang server {s.url}/server_info answered {status} without its tp_size: is it "
                                  "SGLang 0.5.23 (launch/sglang_server.py)?")
            if int(info["tp_size"]) != self.cfg.tp_size:
                raise EngineError(f"SGLang server {s.url} runs at tensor parallel size {info['tp_size']} but "
                                  f"rollout.sglang.tp_size={self.cfg.tp_size}: set rollout.sglang.tp_size="
                                  f"{info['tp_size']} (launch/slurm/train_disaggregated.sbatch passes SGLANG_TP)")
            if self.keep_kv and not info.get("disable_radix_cache"):
                raise EngineError(f"SGLang server {s.url} runs with its radix cache on, and rollout.partial_rollout_kv"
                                  "=keep updates its weights under running requests without a flush: a prefix cached "
                                  "under older weights would serve later requests; start it with "
                                  "--disable-radix-cache (server_args: disable_radix_cache: true)")
            self._check_weights(s, info)
            self._check_lora(s, info)
            for knob in ("pp_size", "dp_size"):
                if int(info.get(knob) or 1) != 1:
                    raise EngineError(f"SGLang server {s.url} runs with {knob}={info[knob]}: the weight sync knows "
                                      f"TP ranks only; start one server per replica (--{knob.replace('_', '-')} 1)")
        self._layout_checked = True

    def _check_lora(self, server: "_Server", info: dict) -> None:
        """rollout.lora_sync=adapter: the server serves LoRA with what the run's adapter needs. SGLang 0.5.23 loads
        an adapter's tensors for the modules it was started to target and drops the rest without a word (lora/
        mem_pool.py fills only its targets' buffers), wraps a MoE layer only with both gate_up_proj and down_proj
        targeted, and refuses a rank above --max-lora-rank at load; so each is checked here, before the first sync."""
        if self.lora is None:
            return
        need = lora_server_args(self.lora, self.hf)
        have = set(info.get("lora_target_modules") or ())
        missing = [m for m in need["lora_target_modules"] if m not in have]
        wrong = []
        if not info.get("enable_lora"):
            wrong.append("LoRA is off")
        if missing and "all" not in have:
            wrong.append(f"its LoRA targets {sorted(have)} lack {missing}")
        if int(info.get("max_lora_rank") or 0) < self.lora.rank:
            wrong.append(f"max_lora_rank={info.get('max_lora_rank')} < model.lora.rank={self.lora.rank}")
        if "experts" in self.lora.targets:
            if bool(info.get("experts_shared_outer_loras")) != need.get("experts_shared_outer_loras", False):
                wrong.append(f"experts_shared_outer_loras={info.get('experts_shared_outer_loras')} but "
                             f"model.lora.expert_layout={self.lora.expert_layout}")
            if info.get("lora_backend") in ("csgmv", None):
                wrong.append(f"lora_backend={info.get('lora_backend')} skips MoE layers")
        if wrong:
            raise EngineError(f"rollout.lora_sync=adapter but SGLang server {server.url} would not serve the run's "
                              f"adapter whole ({'; '.join(wrong)}): start it with "
                              f"{' '.join(server_args_cli(need))} (rollout.sglang.launch=true does)")

    def _check_weights(self, server: "_Server", info: dict) -> None:
        """The server holds what rollout.weights sends: block FP8 needs SGLang's fp8 quantization with 128 x 128
        blocks (what fp8_server_args gives a launched server); bf16 weights need a server without quantization
        (a quantised server would cast them into its FP8 parameters without scales)."""
        quant = info.get("quantization")
        override = info.get("json_model_override_args") or "{}"
        try:
            qc = json.loads(override).get("quantization_config") if isinstance(override, str) else None
        except ValueError:
            qc = None
        if self.weights == "fp8":
            if quant != "fp8" or not isinstance(qc, dict) or list(qc.get("weight_block_size") or []) != [BLOCK, BLOCK]:
                raise EngineError(
                    f"rollout.weights=fp8 but SGLang server {server.url} runs with quantization={quant} and "
                    f"quantization_config={qc}: start it with {' '.join(server_args_cli(fp8_server_args(self.hf)))} "
                    "(rollout.sglang.launch=true does; launch/README.md, FP8)")
        elif quant:
            raise EngineError(f"SGLang server {server.url} runs with quantization={quant} but rollout.weights="
                              f"{self.weights}: set rollout.weights=fp8 (block FP8) or start it without --quantization")

    # ---------------------------------------------------------------- HTTP
    def _http(self, server: _Server, path: str, payload=None, timeout: Optional[float] = None,
              method: Optional[str] = None):
        """(status, body) of one request; raises EngineError for a dead server, with the fix."""
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(server.url + path, data=data, method=method or ("POST" if data else "GET"),
                                     headers={"Content-Type": "application/json", **self._auth})
        timeout = timeout or self.cfg.control_timeout
        try:
            with _OPENER.open(req, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            body = e.read()
            if e.code in (401, 403):
                raise self._refused(server, path, e.code) from None
            return e.code, body
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
            raise self._dead(server, f"{path} failed after at most {timeout:g} s: {e}") from e

    def _post_ok(self, server: _Server, path: str, payload=None, timeout=None) -> dict:
        status, body = self._http(server, path, payload if payload is not None else {}, timeout)
        try:
            out = json.loads(body) if body else {}
        except ValueError:
            out = {"message": body.decode(errors="replace")}
        if status != 200 or (isinstance(out, dict) and out.get("success") is False):
            raise EngineError(f"SGLang server {server.url}{path} answered {status}: "
                              f"{out.get('message') or out.get('error') or out}")
        return out

    def _dead(self, server: _Server, what: str) -> EngineError:
        if self._healthy(server):
            return EngineError(f"SGLang server {server.url}: {what} (the server answers /health: a timeout? see "
                               "rollout.sglang.request_timeout for generation, control_timeout for other calls)")
        if self._closed:  # a request abandoned by a hang or a stop: never restart after shutdown
            return EngineError(f"SGLang server {server.url}: {what} (engine already shut down)")
        if self.should_stop is not None and self.should_stop():  # the job is stopping: no restart begins now
            return EngineError(f"SGLang server {server.url}: {what} (a stop is requested: not restarted)")
        if self._retire(server, what) is None:  # dead or hung, and enough stay: the retry goes on without it
            return EngineError(f"SGLang server {server.url} is out ({what}; it answers no /health): the call is "
                               "retried on this driver's other servers; it rejoins at a sync once it answers")
        if server.node is not None:
            return EngineError(f"SGLang server {server.url}, launched on node {server.node}, is dead or unreachable "
                               f"({what}): the engine is rebuilt and every node restarts its servers "
                               "(trainer.engine_restarts)")
        if server.launched is None:
            return EngineError(f"SGLang server {server.url} is dead or unreachable ({what}); it was not "
                               "started by this run: restart it (same model and flags) and resume from the last "
                               "checkpoint, or remove it from rollout.sglang.urls")
        if server.restarts >= self.cfg.max_restarts:
            return EngineError(f"SGLang server {server.url} died again ({what}) after {server.restarts} restarts "
                               f"(rollout.sglang.max_restarts); see its log {server.launched.log_path}")
        server.restarts += 1
        server.launched.stop()
        try:
            server.launched.start(self.cfg.startup_timeout)
        except Exception as e:
            return EngineError(f"SGLang server {server.url} died ({what}) and its restart failed: {e}")
        server.released = set()
        server.base = server.adapter = False
        if self.weights_updated:
            return EngineRestarted(f"SGLang server {server.url} died ({what}) and was restarted (restart "
                                   f"{server.restarts}/{self.cfg.max_restarts}): it holds the checkpoint's weights "
                                   "again; sync the weights, then retry the rollout")
        return EngineRestarted(f"SGLang server {server.url} died ({what}) and was restarted; retry the rollout")

    def _healthy(self, server: _Server) -> bool:
        if server.launched is not None and not server.launched.alive():
            return False
        try:
            req = urllib.request.Request(server.url + "/health", headers=self._auth)  # (open in SGLang: sent anyway)
            with _OPENER.open(req, timeout=self.cfg.health_timeout) as r:
                return r.status == 200
        except Exception:
            return False

    def _gone(self, server: _Server) -> bool:
        """Certainly dead: its process (launched here) has exited, or its port refuses or resets a connection. A
        server that is only slow to answer (busy, or hung: the next call's own timeout names that) is not taken out
        of the weight group for it. Asked before every weight sync, so on GET /ready, which the server answers
        at once: its /health generates a token and answers after at least a second (sglang 0.5.23's
        health_generate polls once a second), which was most of a sync's time on bench_async."""
        if server.launched is not None and not server.launched.alive():
            return True
        try:
            with _OPENER.open(urllib.request.Request(server.url + "/ready", headers=self._auth),
                              timeout=self.cfg.health_timeout) as r:
                r.read()
            return False
        except urllib.error.HTTPError:
            return False  # it answered
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            return isinstance(reason, (ConnectionRefusedError, ConnectionResetError))

    def health(self) -> bool:
        return all(self._healthy(s) for s in self.live)

    @property
    def live(self) -> list:
        """The servers in the generation pool and the weight-update group (all but the dead ones)."""
        return [s for s in self.servers if s.alive]

    def _retire(self, server: "_Server", what: str) -> Optional[EngineError]:
        """`server` failed (`what`): out of the pool and the weight group while at least rollout.sglang.min_servers
        stay; None when it is out (its requests go to the others), else the error that ends the call (fewer than
        min_servers would be left: the guard rebuilds, or the run stops naming them)."""
        with self._lock:
            if not server.alive:
                return None
            left = [s for s in self.servers if s.alive and s is not server]
            if len(left) >= self.cfg.min_servers and not self._closed:
                server.alive = False
                self.faults["servers_lost"] += 1
        if not server.alive:
            log.warning("SGLang server %s is out (%s): its requests go to %s; it rejoins at a sync once it answers "
                        "/health%s", server.url, what, ", ".join(s.url for s in left),
                        " (relaunched there)" if server.launched is not None else "")
            self._conns.close_url(server.url)  # its requests in flight fail now and are sent again
            return None
        dead = [s.url for s in self.servers if not s.alive] + [server.url]
        return EngineError(f"SGLang driver {self.driver}: {len(left)} live server(s) left, fewer than "
                           f"rollout.sglang.min_servers={self.cfg.min_servers} ({what}); out: {', '.join(dead)}")

    def leave_out(self, urls) -> None:
        """Servers the engine this one replaces had taken out (dead, or hung: a rebuild after a failed call) start
        out of the pool and the weight group, down to min_servers: they rejoin at a sync's refresh once they
        answer /health, as any server that left."""
        for s in self.servers:
            if s.url in urls and len(self.live) > self.cfg.min_servers:
                s.alive = False

    def refresh(self) -> None:
        """Before a weight sync (between steps): a server that is out rejoins if it answers /health (one this
        process launched is relaunched first, within rollout.sglang.max_restarts), and the sync gives it the full
        weights, digest-verified; a live one that no longer answers leaves (down to min_servers). Once a stop is
        requested nothing is relaunched (the job's servers are stopping with it)."""
        stopping = self.should_stop is not None and self.should_stop()
        for s in self.servers:
            if s.alive:
                what = "refuses connections before a weight sync"
                if self._gone(s) and self._retire(s, what) is not None:
                    raise self._dead(s, what)  # too few would be left: as before (a launched one restarted here)
                continue
            if stopping:
                continue
            if s.launched is not None and not s.launched.alive() and s.restarts < self.cfg.max_restarts:
                s.restarts += 1
                s.launched.stop()
                try:
                    s.launched.start(self.cfg.startup_timeout)
                except Exception as e:
                    log.warning("SGLang server %s: relaunch %d failed (%s); it stays out", s.url, s.restarts, e)
                    continue
            if self._healthy(s):
                s.key_checked = False  # started again, maybe by someone else: it takes the job's key, and only it
                try:
                    self._check_key(s)
                except EngineError as e:
                    log.warning("SGLang server %s answers again but stays out: %s", s.url, e)
                    continue
                s.alive, s.released = True, set()  # a server that comes back (restarted) holds its memory
                s.base = s.adapter = False  # and maybe another model's weights: the sync sends it the base again
                self.faults["server_rejoins"] += 1
                log.warning("SGLang server %s rejoins: it receives the full weights in this sync", s.url)

    # ---------------------------------------------------------------- generation
    def _sampling(self, params: SamplingParams, seed: Optional[int]) -> dict:
        # SGLang 0.5.23's ignore_eos also switches off stop_token_ids (Req._check_token_based_finish returns
        # before reading them): with it every response ran to max_new_tokens. So it is set only when there is no
        # stop id (a request that asks for its whole budget); with stop ids the server stops at them and also at
        # the model's own eos ids (config.json), and `_answer` names a stop at one outside them, once
        sp = {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
              "max_new_tokens": params.max_new_tokens, "stop_token_ids": list(params.stop_token_ids),
              "ignore_eos": not params.stop_token_ids}
        if seed is not None and self.cfg.server_args.get("enable_deterministic_inference"):
            sp["sampling_seed"] = seed  # sglang 0.5.23 accepts a per-request seed only in deterministic mode
        return sp

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, n: int = 1,
                 request_ids: Optional[Sequence[str]] = None) -> list[Sample]:
        out: list = [None] * (len(prompts) * n)
        for i, group in self.stream(prompts, params, n, request_ids):
            out[i * n:(i + 1) * n] = group
        return out

    def stream(self, prompts: Sequence[Sequence[int]], params: SamplingParams, n: int = 1,
               request_ids: Optional[Sequence[str]] = None, max_new_tokens: Optional[Sequence[int]] = None,
               affinity: Optional[Sequence] = None, routes_from: Optional[Sequence[int]] = None,
               more: Optional[Feed] = None):
        """Yields (prompt index, its n samples) as each group's last answer is decoded. `send("finish")`
        (RolloutEngine.stream): nothing more is sent, queued requests are dropped, running ones aborted on their
        servers; the groups that end meanwhile are still yielded (aborted samples with finish_reason "abort"),
        groups with a request never sent are not. `send("stop_sending")`: the same, except that the running
        requests are left to the caller's abort() (a weight update's pause aborts everything at once). Leaving the
        loop early (break, close(), an exception) aborts the requests still running and sends nothing more; every
        request of the call has ended when the generator is closed. max_new_tokens: one budget per prompt (a
        partial rollout's continuations). affinity: per prompt, the URL of the server whose prefix cache holds it
        (an episode's earlier turns): its requests go there (while it is one of this engine's servers); a key that
        is not a string groups prompts: those sharing it go to one server (the first one's, as a prompt's n
        samples do). routes_from: per prompt, the first position whose routing row is returned (SGLang's
        routed_experts_start_len; the answer's routes_from). more: prompts taken while the stream runs (Feed:
        continuous episode turns), numbered after these."""
        if request_ids is not None and len(request_ids) != len(prompts) * n:
            raise ValueError(f"{len(request_ids)} request_ids for {len(prompts) * n} samples (prompts x n)")
        for name, per in (("max_new_tokens", max_new_tokens), ("affinity", affinity), ("routes_from", routes_from)):
            if per is not None and len(per) != len(prompts):
                raise ValueError(f"{len(per)} {name} for {len(prompts)} prompts")
        if not prompts and more is None:
            return
        self._stop_ids = set(int(t) for t in params.stop_token_ids)
        # per-server limit (rollout.sglang.max_in_flight_per_server): a group's first request takes a slot on
        # the least-loaded server when it is sent (sglang_client.ServerSlots; ties rotate over calls), the
        # group's other samples follow it there (one prefix cache per prompt)
        slots = ServerSlots(len(self.servers), self.cfg.max_in_flight_per_server, start=next(self._rr),
                            out=lambda k: not self.servers[k].alive)
        futures, order, left, unsent = {}, [], [], []  # per request its prompt; in order; per prompt

        def send(batch, budgets=None, keys=None, starts=None, rids=None) -> list:
            """Submit the requests of `batch` (prompts numbered from len(left) on) -> their futures."""
            where = {s.url: k for k, s in enumerate(self.servers) if s.alive} if keys is not None else {}
            jobs, index = [], []
            for b, p in enumerate(batch):
                i, prompt = len(left), list(map(int, p))
                group = i  # the slots' group of a prompt: its n samples share a server
                key = keys[b] if keys is not None else None
                if isinstance(key, str) and key in where:  # an episode's next turn: the server of its prefix
                    slots.place(i, where[key])
                elif key is not None and not isinstance(key, str):  # a group key: one server for its prompts
                    group = ("affinity", key)
                start = int(starts[b]) if starts is not None and self.return_routes else 0
                if not 0 <= start < max(len(prompt), 1):
                    raise ValueError(f"routes_from={start} outside prompt {i}'s {len(prompt)} positions")
                for j in range(n):
                    k = i * n + j
                    rid = rids[b * n + j] if rids is not None else f"rlpo-{self._prefix}-{next(self._rid)}"
                    sampling = self._sampling(params, None if params.seed is None
                                              else (params.seed * 1000003 + k) % (2 ** 31))
                    if budgets is not None:
                        sampling["max_new_tokens"] = int(budgets[b])
                    jobs.append((self._one, (i, prompt, rid, sampling, slots, start, group)))
                    index.append(i)
                left.append(n)
                unsent.append(False)
            submitted = self._io.submit(jobs)
            futures.update(zip(submitted, index))
            order.extend(submitted)
            return submitted

        def fresh() -> list:
            """The feed's prompts sent now (its None: nothing more is sent, as "stop_sending")."""
            if more is None or slots.closed:
                return []
            got = more.take()
            if got is None:
                self._finish(futures, slots, abort=False)
                return []
            return send([g[0] for g in got], [g[1] for g in got], [g[2] for g in got], [g[3] for g in got]) \
                if got else []

        first = send(prompts, max_new_tokens, affinity, routes_from, request_ids)
        try:
            for f in self._completed(first, slots, more=more, fresh=fresh,
                                     coming=lambda: more is not None and not slots.closed and more.waiting()):
                i = futures[f]
                left[i] -= 1
                unsent[i] |= f.cancelled() or f.exception() is not None  # dropped by a finish: never answered
                if not left[i] and not unsent[i]:
                    msg = yield i, [g.result() for g in order[i * n:(i + 1) * n]]
                    if msg in ("finish", "stop_sending") and not slots.closed:
                        self._finish(futures, slots, abort=msg == "finish")
        finally:  # early exit (a stop, a hang, an error, the caller had enough): nothing left running
            self._end(futures, slots)

    def _finish(self, futures, slots: ServerSlots, abort: bool = True) -> None:
        """The caller has enough groups: send nothing more, drop what waits for a slot, abort what runs (each
        answers at once with what it generated, finish_reason "abort"; the stream collects those answers).
        abort=False ("stop_sending"): the caller aborts what runs itself, all at once (a weight update's pause:
        abort() with no ids, one request per server instead of one per running request)."""
        slots.close()
        for f in futures:
            f.cancel()
        if not abort:
            return
        with self._lock:
            inflight = dict(self._inflight)
        self._abort_quietly(inflight)

    def _end(self, futures, slots: ServerSlots) -> None:
        """End a stream: send nothing more, cancel what has not started, abort what runs (the servers stop
        generating) and close its sockets (its workers return now), then wait for those workers."""
        slots.close()
        for f in futures:
            f.cancel()
        running = [f for f in futures if not f.done()]
        if not running:
            return
        with self._lock:
            inflight = dict(self._inflight)
        self._abort_quietly(inflight)
        self._conns.close_active()
        wait(running, timeout=self.cfg.health_timeout * 6)

    def _completed(self, futures, slots: Optional[ServerSlots] = None, poll: float = 0.2, more: Optional[Feed] = None,
                   fresh=lambda: [], coming=lambda: False):
        """Yield the requests as they finish while watching two things a blocking HTTP read cannot: the
        trainer's stop flag (SIGTERM: abort the requests, raise RolloutInterrupted) and servers that accept
        connections but stop answering (no /health answer for hang_timeout s while requests are in flight:
        EngineError). With a feed (`more`): the requests `fresh()` sent after each answer, wake-up and poll join
        them, and the loop goes on while `coming()`."""
        # one wake-up per answer (concurrent.futures.wait re-arms every future). queue.Queue, not SimpleQueue: a
        # signal (the trainer's SIGTERM) landing in SimpleQueue.get(timeout) can turn the timeout into "forever"
        # in CPython 3.11's _queue; Queue waits on a threading.Condition, which recomputes it correctly
        finished = queue.Queue()
        if more is not None:
            more.woken, poll = lambda: finished.put(_WAKE), min(poll, Feed.POLL_S)
        for f in futures:
            f.add_done_callback(finished.put)
        left = len(futures)
        last_ok = {s.url: time.monotonic() for s in self.servers}
        next_check = time.monotonic() + self.cfg.health_interval
        try:
            while left or coming():
                for f in fresh():
                    f.add_done_callback(finished.put)
                    left += 1
                try:
                    f = finished.get(timeout=poll)
                except queue.Empty:
                    f = None
                if f is _WAKE:
                    continue
                if f is not None:
                    left -= 1
                    # after a finish (slots closed) a request cancelled before it ran, or one that was waiting for a
                    # slot (SlotsClosed), was never answered: its caller skips it
                    dropped = f.cancelled() or isinstance(f.exception(), SlotsClosed)
                    if not (dropped and slots is not None and slots.closed) and f.exception() is not None:
                        if self.should_stop is not None and self.should_stop():  # servers stopping with the job
                            raise RolloutInterrupted(f"stop requested during a rollout (and {f.exception()})")
                        raise f.exception()
                    yield f
                if self.should_stop is not None and self.should_stop():
                    with self._lock:
                        inflight = dict(self._inflight)
                    raise RolloutInterrupted(f"stop requested during a rollout: {len(inflight)} requests aborted")
                now = time.monotonic()
                if left and now >= next_check:
                    next_check = now + self.cfg.health_interval
                    if self._held:  # held on purpose for a weight update (pause): /health waits for it, not hung
                        last_ok = dict.fromkeys(last_ok, now)
                        continue
                    with self._lock:
                        busy = {s.url: s for s in self._inflight.values()}
                    for s in self.servers:
                        if s.url not in busy or not s.alive:
                            last_ok[s.url] = now  # idle servers (and those already out) are not on the clock
                    for url, s in busy.items():
                        if self._healthy(s):
                            last_ok[url] = time.monotonic()
                        elif time.monotonic() - last_ok[url] >= self.cfg.hang_timeout:
                            what = (f"no answer to /health for {self.cfg.hang_timeout:g} s while requests are in "
                                    "flight (rollout.sglang.hang_timeout): it is hung")
                            err = self._retire(s, what)  # out: its requests fail now and go to the other servers
                            if err is not None:
                                raise EngineError(f"SGLang server {url}: {what}; restart it ({err})")
        finally:
            if more is not None:
                more.woken = None

    async def _one(self, prompt_index, prompt, rid, sampling, slots: ServerSlots, start: int = 0,
                   group=None) -> Sample:
        body = {"input_ids": prompt, "sampling_params": sampling, "rid": rid, "return_logprob": True,
                "return_routed_experts": self.return_routes}
        if start:  # rows [start, seqlen - 1) only: the caller holds the rows before (an episode's earlier turns)
            body["routed_experts_start_len"] = start
        if self.adapter:  # rollout.lora_sync=adapter: generated by the base with the run's adapter
            body["lora_path"] = self.adapter
        payload = dumps(body)
        while True:  # once per server tried: a dead or failing one's request is sent again to another of this driver's
            server, (status, raw, size) = await self._send(prompt_index if group is None else group, rid, payload,
                                                           slots)
            try:
                return self._answer(server, prompt_index, prompt, rid, status, raw, size, start)
            except EngineError as e:
                # a 5xx without an answer (an OOM, a scheduler crash): the server is out, the request sent again
                if status < 500 or self._retire(server, f"/generate answered {status}") is not None:
                    raise
                log.debug("request %s sent again after %s", rid, e)
                self.faults["requests_resent"] += 1
            finally:
                self._conns.buffers.give(raw)
                self._decoding.release()

    async def _send(self, group, rid, payload, slots: ServerSlots):
        """One POST /generate on a slot -> (server, (status, body, size)), a decode permit held. A connection that
        fails because its server died (refused, reset, closed mid-body) is sent again to another server here (the
        dead one leaves the pool: _retire); a timeout, or a failure with too few servers left, ends the request."""
        while True:
            slot = await slots.acquire(group=group)  # waits while the server(s) it may use are full
            server = self.servers[slot]
            with self._lock:
                self._inflight[rid] = server
            if slots.closed:  # a finish or an end came between the slot and the registration its abort reads
                with self._lock:
                    self._inflight.pop(rid, None)
                slots.release(slot)
                raise SlotsClosed(f"request {rid} not sent: its rollout has ended")
            try:  # returns holding a decode permit: answers read and decoded at once are bounded (decode_concurrency)
                status, body, size = await self._conns.post(server.url, "/generate", payload,
                                                            self.cfg.request_timeout, self._decoding)
            except BaseException as e:
                if not isinstance(e, (OSError, http.client.HTTPException)):
                    raise
                if slots.closed:  # this rollout was ended (stop, hang, enough groups): its sockets were shut
                    raise SlotsClosed(f"request {rid} ended with its rollout") from None
                what = f"/generate failed after at most {self.cfg.request_timeout:g} s: {e}"
                stopping = self.should_stop is not None and self.should_stop()
                # a timeout is a slow server, not a dead one (request_timeout); refused, reset or closed mid-body:
                # the server is out and the request goes to another (none: the old way, _dead)
                if not isinstance(e, TimeoutError) and not stopping:
                    if self._retire(server, what) is None:
                        self.faults["requests_resent"] += 1
                        continue
                # _dead asks /health and may restart a server: off the I/O thread, which serves the other requests
                raise await asyncio.get_running_loop().run_in_executor(None, self._dead, server, what) from e
            finally:
                with self._lock:
                    self._inflight.pop(rid, None)
                slots.release(slot)  # before decoding: the server takes the next request
            return server, (status, body, size)

    def _answer(self, server: _Server, prompt_index: int, prompt: list, rid: str, status: int, body, size: int,
                start: int = 0) -> Sample:
        """One /generate answer (body[:size]) -> a Sample with compact, checked routes (decoded as it arrives,
        while the rest of the batch still generates); nothing returned refers to `body`."""
        if status in (401, 403):
            raise self._refused(server, "/generate", status)
        rest, b64 = split_routes(body, size) if self.return_routes else (body[:size], None)
        del body
        try:
            out = loads(rest)
        except ValueError:
            try:  # orjson refuses what Python's json writes for non-finite floats (NaN, Infinity)
                out = json.loads(bytes(rest))
            except ValueError:
                raise EngineError(f"SGLang server {server.url}/generate answered {status} with non-JSON: "
                                  f"{rest[:200]!r}") from None
        meta = out.get("meta_info") if isinstance(out, dict) else None
        if status != 200 and not meta:
            raise EngineError(f"SGLang server {server.url}/generate (rid {rid}) answered {status}: {out}")
        fr = (meta.get("finish_reason") or {}) if meta else {}
        reason = FINISH.get(fr.get("type") if isinstance(fr, dict) else fr, "abort")
        ids = list(map(int, out.get("output_ids") or []))
        lps = parse_logprobs(meta.get("output_token_logprobs"))
        if reason != "abort" and len(lps) != len(ids):
            raise EngineError(f"SGLang server {server.url} (rid {rid}): {len(lps)} log-probs for {len(ids)} tokens")
        ids = ids[:len(lps)]
        matched = fr.get("matched") if isinstance(fr, dict) else None
        if reason == "stop" and isinstance(matched, int) and matched not in self._stops_seen:
            self._stops_seen.add(matched)
            if matched not in self._stop_ids:
                log.warning("SGLang server %s stopped a response at token %d, the model's own end-of-sequence id "
                            "(its config.json), which the rollout's stop_token_ids %s do not hold: SGLang stops at "
                            "both (the embedded engine only at the stop ids); add %d to rollout.stop_token_ids to "
                            "make it explicit", server.url, matched, sorted(self._stop_ids), matched)
        if ids and not (0 <= min(ids) and max(ids) < self.vocab_size):
            bad = next(t for t in ids if not 0 <= t < self.vocab_size)
            # checked here, on the host: on a GPU the learner's embedding would die on a device-side assert
            raise EngineError(f"SGLang server {server.url} (rid {rid}) returned token id {bad} outside the model's "
                              f"vocabulary [0, {self.vocab_size}): does it serve another model or tokenizer than "
                              "model.hf_config?")
        routes, checked = None, False
        data = b64 if b64 is not None else meta.get("routed_experts")
        if self.return_routes and data is not None:
            span = len(prompt) + len(ids) - 1 - start  # rows [start, prompt + tokens - 1)
            try:
                routes = decode_routes(data, self.num_hidden_layers, self.spec,
                                       tokens=span if reason != "abort" else None)
            except RoutingTraceError as e:
                raise RoutingTraceError(f"sample of prompt {prompt_index} (rid {rid}, {server.url}): {e}") from None
            if reason != "abort":  # clean: compact and checked now; else the scalars' gather names the problem
                trace = clean_trace(routes, self.spec, span)
                if trace is not None:
                    routes, checked = trace.ids, True
        elif self.return_routes and reason != "abort":
            raise EngineError(f"SGLang server {server.url} returned no routed_experts: start it with "
                              "--enable-return-routed-experts (server_args: enable_return_routed_experts: true)")
        return Sample(prompt_ids=prompt, response_ids=ids, logprobs=lps, finish_reason=reason, routes=routes,
                      prompt_index=prompt_index, trace_checked=checked,
                      routes_from=start, meta=SampleMeta(request_id=rid, server=server.url,
                                                         weight_version=meta.get("weight_version"),
                                                         weight_versions=meta.get("weight_versions")))

    def _abort_quietly(self, inflight: dict):
        """Best-effort aborts, all at once on the I/O loop, bounded by health_timeout: a hung server answers none."""
        if not inflight:
            return
        try:
            self._io.run(self._aborts, inflight, timeout=self.cfg.health_timeout)
        except TimeoutError:
            pass

    async def _aborts(self, inflight: dict) -> None:
        async def one(rid, server):
            _, buf, _ = await self._conns.post(server.url, "/abort_request", dumps({"rid": rid}),
                                               self.cfg.health_timeout)
            self._conns.buffers.give(buf)

        await asyncio.gather(*(one(rid, server) for rid, server in inflight.items()), return_exceptions=True)

    def abort(self, request_ids: Optional[Sequence[str]] = None) -> None:
        if self._held:  # a held scheduler never ends what it aborts (a rebuild after a failed sync aborts it all)
            self.resume()
        if request_ids is None:
            for s in self.live:
                self._post_ok_empty(s, "/abort_request", {"abort_all": True})
            return
        with self._lock:
            owners = {rid: self._inflight.get(rid) for rid in request_ids}
        for rid, s in owners.items():
            for srv in [s] if s is not None else self.live:  # unknown owner (not yet sent): ask all
                self._post_ok_empty(srv, "/abort_request", {"rid": rid})

    def _post_ok_empty(self, server, path, payload):
        status, body = self._http(server, path, payload, timeout=self.cfg.health_timeout * 6)
        if status != 200:
            raise EngineError(f"SGLang server {server.url}{path} answered {status}: {body[:300]!r}")

    def flush_cache(self) -> None:
        # SGLang refuses while requests are queued or running, sometimes just after generate() returned
        for s in self.live:
            delay, last = 0.05, b""
            for _ in range(self.cfg.flush_retries):
                status, last = self._http(s, "/flush_cache", {}, timeout=self.cfg.health_timeout * 6)
                if status == 200:
                    break
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
            else:
                raise EngineError(f"SGLang server {s.url}/flush_cache still refused after {self.cfg.flush_retries} "
                                  f"tries ({last[:200]!r}): requests are still running; abort() them first")

    # ---------------------------------------------------------------- colocated (rollout.colocate)
    _TAGS = {"weights": ("weights",), "kv_cache": ("kv_cache", "cuda_graph")}
    _TAGS_ALL = ("weights", "kv_cache", "cuda_graph")

    def release_memory(self) -> None:
        """Every live server gives up its GPU memory (POST /release_memory_occupation, all tags: weights, KV cache,
        CUDA graphs; SGLang synchronizes before answering) for the learner to train in. SGLang asserts the server is
        idle, and that assertion kills its scheduler: a /health probe is a one-token generation, which a release
        right after it met (a shrunk recipe's resume). So first flush_cache, which SGLang refuses (retried here)
        while anything is running or queued, as slime does before its release."""
        if any(len(self._TAGS_ALL) > len(s.released) for s in self.live):
            self.flush_cache()
        for s in self.live:
            tags = [t for group in self._TAGS.values() for t in group if t not in s.released]
            if tags:  # SGLang refuses to release a tag twice
                self._post_ok(s, "/release_memory_occupation", {"tags": tags})
                s.released |= set(tags)

    def resume_memory(self, what: str) -> None:
        """Every live server takes `what` back (POST /resume_memory_occupation): "weights" before a sync (without a
        CPU backup they hold nothing until the sync fills them), "kv_cache" (and the CUDA graphs) after it."""
        if what not in self._TAGS:
            raise ValueError(f"resume_memory({what!r}): weights or kv_cache")
        for s in self.live:
            if what == "kv_cache" and "weights" in s.released:
                raise EngineError(f"SGLang server {s.url}: the KV cache resumed before the weights (rollout.colocate's "
                                  "order is weights, sync, KV cache)")
            tags = [t for t in self._TAGS[what] if t in s.released]
            if tags:
                self._post_ok(s, "/resume_memory_occupation", {"tags": tags})
                s.released -= set(tags)

    # ---------------------------------------------------------------- weights
    def begin_weight_update(self, refresh: bool = True) -> None:
        """Opens the update session on every live server; first (refresh) the servers out rejoin if they answer
        and the live ones that do not leave: the weights that follow go to exactly the servers that generate."""
        if refresh:
            self.refresh()
        self._check_layout()
        for s in self.live:
            self._begin(s)

    def _begin(self, server: _Server) -> None:
        """POST /begin_weight_update; a session left open (a sync that failed half-way, here or by a learner that
        died) is closed first: SGLang refuses every begin while one is open, so no retry could succeed."""
        try:
            self._post_ok(server, "/begin_weight_update")
        except EngineError as e:
            if "already open" not in str(e):
                raise
            log.warning("SGLang server %s held a weight-update session left open by a failed sync: closed",
                        server.url)
            self._post_ok(server, "/end_weight_update")
            self._post_ok(server, "/begin_weight_update")

    def abandon_weight_update(self) -> None:
        """After a failed sync: every reachable server's session closed (quietly; the sync is retried or the run
        stops), so that the next begin_weight_update is not refused."""
        self._end_quietly(self.live)

    def _end_quietly(self, servers) -> None:
        for s in servers:  # a raw POST: a dead server here is not restarted (_dead), the retry's guard decides
            req = urllib.request.Request(s.url + "/end_weight_update", data=b"{}", method="POST",
                                         headers={"Content-Type": "application/json", **self._auth})
            try:
                with _OPENER.open(req, timeout=self.cfg.health_timeout * 6) as r:
                    r.read()
            except Exception as e:  # no session open (HTTP 400), or the server is gone
                log.debug("closing %s's weight-update session: %s", s.url, e)

    def _post_ok_all(self, path):
        for s in self.live:
            self._post_ok(s, path)

    def set_weight_version(self, version: str) -> None:
        """Every server's weight version (POST /update_weight_version, without aborting anything): each answer's
        meta_info names the version it was generated with (weight_versions: spans, should one change mid-request)."""
        for srv in self.live:
            self._post_ok(srv, "/update_weight_version", {"new_version": str(version), "abort_all_requests": False})

    def end_weight_update(self) -> None:
        self._post_ok_all("/end_weight_update")
        self.weights_updated = True
        for s in self.live:
            s.base = True
        if not self._held:  # held requests keep their KV (pause): nothing else is cached, the radix cache is off
            self.flush_cache()

    def pause(self) -> None:
        """POST /pause_generation mode=in_place on every live server: SGLang keeps the running batch and its KV
        cache, and requests that arrive wait in its tokenizer manager, until resume(); the weight update between
        runs without its lock (SGLang's paused path) and without a flush (end_weight_update)."""
        self._held = True
        for s in self.live:
            self._post_ok(s, "/pause_generation", {"mode": "in_place"})

    def resume(self) -> None:
        """POST /continue_generation on every live server (a server that rejoined during the sync was not held:
        continuing it changes nothing)."""
        self._held = False
        for s in self.live:
            self._post_ok(s, "/continue_generation", {})

    @property
    def _ipc(self) -> bool:
        return self.colocate and torch.cuda.is_available()

    def _tensor_payloads(self, named_tensors, ipc: Optional[bool] = None, as_dict: bool = False
                         ) -> tuple[list[str], list]:
        """One payload per server TP rank in sglang's MultiprocessingSerializer format:
        base64(ForkingPickler([(name, tensor), ...])). Host tensors travel through shared memory by file name; a
        server on this rank's GPU (rollout.colocate, with a load_format of its own: the default goes as a
        flattened_bucket) gets CUDA IPC handles of a device copy instead, one pickle per TP rank (each TP rank opens
        entry [tp_rank], and each handle counts its own reference, tp_worker.py)."""
        import multiprocessing.reduction

        import torch.multiprocessing as tmp

        ipc = self._ipc if ipc is None else ipc
        tmp.set_sharing_strategy("file_system")  # fd passing cannot cross HTTP
        # a fresh copy each time: pickling moves a storage into shared memory by file name, and the stream's
        # recycled buffers (InProcessTransport) would send the next sync the name of a file the server already
        # closed and the shm manager unlinked ("unable to open shared memory object": the server crashed at the
        # second sync of a trainer run); on a GPU the copy is what the server reads while the stream moves on
        keep = [(n, t.detach().clone().contiguous() if ipc else t.detach().to("cpu", copy=True).contiguous())
                for n, t in named_tensors]

        def dump() -> str:
            buf = io.BytesIO()
            multiprocessing.reduction.ForkingPickler(buf).dump(dict(keep) if as_dict else keep)
            return base64.b64encode(buf.getvalue()).decode()

        payloads = [dump() for _ in range(self.cfg.tp_size)] if ipc else [dump()] * self.cfg.tp_size
        return payloads, keep  # keep: alive until the server has loaded

    def load_weights(self, named_tensors, load_format: Optional[str] = None) -> None:
        relayed = getattr(named_tensors, "payloads", None)  # sglang_payloads.RelayedBucket: made on each GPU
        if relayed is not None and load_format is None:
            return self._load_relayed(named_tensors)
        named_tensors = list(named_tensors)
        if not named_tensors:
            return
        if self.colocate and load_format is None:  # no relay (this process alone): it makes every entry
            payload = flatten(named_tensors, self.aliases)
            for s in self.live:  # one pickle per TP rank: each opens (and counts) its own reference
                self._post_flattened(s, [serialize(payload) for _ in range(self.cfg.tp_size)])
            del payload  # after the servers loaded
            return
        names = {n for n, _ in named_tensors}
        if self.tied and self._embed in names and self._head not in names:
            # sglang's Mixtral (0.5.23) ignores tie_word_embeddings and keeps its own lm_head: send it too
            named_tensors.append((self._head, dict(named_tensors)[self._embed]))
        # host tensors: one shared-memory copy for every server; CUDA IPC: each server its own handles
        shared = None if self._ipc else self._tensor_payloads(named_tensors)
        for s in self.live:
            payloads, keep = shared or self._tensor_payloads(named_tensors)
            self._post_ok(s, "/update_weights_from_tensor",
                          {"serialized_named_tensors": payloads, "load_format": load_format, "flush_cache": False})
            del keep

    def _load_relayed(self, bucket) -> None:
        """rollout.colocate: each live server takes its list of entries, TP rank k's made by the learner rank on
        that rank's GPU (training/sync.py, sglang_payloads.PayloadRelay); the producers keep their memory until the
        relay acknowledges, after these calls returned."""
        if bucket.errors:
            raise EngineError("colocated weight sync: a learner rank could not make its server rank's payload: "
                              + "; ".join(bucket.errors))
        for s in self.live:
            entries = bucket.payloads.get(self._place[s.url])
            if entries is None or len(entries) != self.cfg.tp_size:
                raise EngineError(f"colocated weight sync: no payload of every TP rank for SGLang server {s.url} "
                                  f"(place {self._place[s.url]}; rollout.sglang.tp_size={self.cfg.tp_size})")
            self._post_flattened(s, entries)

    def _post_flattened(self, server: _Server, entries: list) -> None:
        self._post_ok(server, "/update_weights_from_tensor", {"serialized_named_tensors": entries,
                                                             "load_format": FLATTENED, "flush_cache": False})

    def needs_base(self) -> bool:
        """rollout.lora_sync=adapter, before a sync: whether a live server does not hold the learner's base yet (it
        started, or restarted, since the last full sync; or it rejoins now: refreshed first); the sync then sends
        the base whole first."""
        self.refresh()
        return any(not s.base for s in self.live)

    def load_adapter(self, config: dict, tensors: dict, checksums: dict) -> None:
        """rollout.lora_sync=adapter: every live server's adapter replaced by this one (SGLang 0.5.23's
        /unload_lora_adapter, then /load_lora_adapter_from_tensors: a PEFT config dict and the tensors through shared
        memory of this host, one payload per TP rank), each tensor checked inside the server against `checksums`
        (sha256 of its bytes, managers/tp_worker.py load_lora_adapter_from_tensors: a mismatch, a missing or an extra
        tensor fails the load); then every request names it."""
        # on the host whatever the servers' device (SGLang keeps adapters there: lora/lora.py), as a dict
        payloads, keep = self._tensor_payloads(list(tensors.items()), ipc=False, as_dict=True)
        for s in self.live:
            self._unload_adapter(s)
            self._post_ok(s, "/load_lora_adapter_from_tensors",
                          {"lora_name": self.ADAPTER, "config_dict": config, "serialized_named_tensors": payloads,
                           "expected_checksums": checksums})
            s.adapter = True
        del keep
        self._adapter_loaded()

    def load_adapter_from_disk(self, path: str) -> None:
        """rollout.lora_sync=adapter over rollout.sync_transport=disk: every live server's adapter replaced by the
        PEFT directory at `path`, which the servers read (/load_lora_adapter: a path they share with this host)."""
        for s in self.live:
            self._unload_adapter(s)
            self._post_ok(s, "/load_lora_adapter", {"lora_name": self.ADAPTER, "lora_path": os.path.abspath(path)})
            s.adapter = True
        self._adapter_loaded()

    def _unload_adapter(self, server: _Server) -> None:
        if server.adapter:
            self._post_ok(server, "/unload_lora_adapter", {"lora_name": self.ADAPTER})
            server.adapter = False

    def _adapter_loaded(self) -> None:
        self.adapter = self.ADAPTER
        self.weights_updated = True
        if not self._held:  # a prefix cached under the previous adapter must not serve a request
            self.flush_cache()

    def reload_from_disk(self, path: str) -> None:
        self.refresh()
        for s in self.live:
            self._post_ok(s, "/update_weights_from_disk", {"model_path": os.path.abspath(path),
                                                           "flush_cache": False})
        if self.tied:  # see load_weights: a tied checkpoint has no lm_head.weight for sglang's Mixtral
            for file in sorted(f for f in os.listdir(path) if f.endswith(".safetensors")):
                with safe_open(os.path.join(path, file), "pt") as f:
                    if self._embed in f.keys():
                        self.begin_weight_update(refresh=False)  # refreshed above
                        self.load_weights([(self._embed, f.get_tensor(self._embed))])
                        self._post_ok_all("/end_weight_update")
        self.weights_updated = True
        for s in self.live:
            s.base = True
        self.flush_cache()

    def adopt(self, launched: dict) -> None:
        """Servers started by this run's node launchers (rollout/engines.EngineSlot), as {url: node}, with this
        process's own as {url: (node, SGLangServer)}; only those this engine drives are taken. It restarts the
        ones this process launched itself; a dead server launched by another process fails the rollout, and
        the rebuilt engine's launchers restart them."""
        for s in self.servers:
            if s.url in launched:
                node, handle = launched[s.url]
                s.launched, s.node = handle, (None if handle is not None else node)

    def shutdown(self) -> None:
        if self._held:  # servers this engine does not stop would stay held for the engine that replaces it
            try:
                self.resume()
            except EngineError as e:
                log.warning("resuming the servers as the engine shuts down: %s", e)
        self._closed = True
        self._finalizer()  # connections closed, workers joined
        for s in self.servers:
            if s.launched is not None:
                s.launched.stop()
        self._store = None


def _close_client(conns: Connections, io: IOLoop) -> None:
    conns.close()
    io.close()


__all__ = ["EngineRestarted", "SGLangEngine"]
