"""The rollout engines on the learner ranks: built with their weight transport, rebuilt when one fails.

Engine ranks: every rank for the embedded engine, `rollout.sglang.drivers` evenly spaced ranks for SGLang
clients (the servers batch on their own; each client drives its own share of them). A failure on any rank is
agreed on by all over the host-side control group (EngineGuard), so no rank is left waiting in a collective; the
engine is rebuilt and the weights re-synced.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os

import torch
import torch.distributed as dist

from rlpo_mega.rollout.base import ENGINES, EngineError, RolloutInterrupted
from rlpo_mega.rollout.sglang_auth import new_key
from rlpo_mega.rollout.sglang_launch import extra_server_args, launch_node_servers
from rlpo_mega.weight_sync.transports import TRANSPORTS

log = logging.getLogger("rlpo_mega")


def build_engine(cfg, hf):
    """The configured engine on the ranks that run one (None elsewhere)."""
    if dist.get_rank() not in engine_ranks(cfg):
        return None
    return ENGINES.get(cfg.rollout.engine).from_config(cfg, hf)


def engine_ranks(cfg) -> list[int]:
    return ENGINES.get(cfg.rollout.engine).ranks(cfg, dist.get_world_size())


def make_transport(cfg, engine, hf):
    """The configured weight transport of `engine`, through the TRANSPORTS registry."""
    return TRANSPORTS.get(cfg.rollout.sync_transport).from_config(cfg, engine, hf)


class EngineSlot:
    """This rank's engine and its weight transport: built together once (a transport's group lives as long
    as its engine), closed together (transport first), rebuilt together by EngineGuard. Ranks without an
    engine hold None for both. `should_stop` (the trainer's stop flag) is handed to every engine built.

    Launched SGLang servers (rollout.sglang.launch=true) are started by one launcher per node: each node's
    local rank 0 starts that node's servers on the GPUs its learner ranks leave free; every rank learns every
    URL in node order (one all_gather_object over `group`) and each engine rank attaches to its share of them
    (SGLangEngine: rollout.sglang.drivers). Building is therefore collective when servers are launched (every
    rank calls build, as EngineGuard's rebuild does)."""

    def __init__(self, cfg, hf, should_stop=None, group=None, before_launch=None):
        self.cfg, self.hf, self.should_stop, self.group = cfg, hf, should_stop, group
        # called on every rank before servers are launched (training/colocate.HandOver: the learner off the GPUs the
        # servers size their memory on)
        self.before_launch = before_launch
        self.engine = self.transport = None
        self.node_servers: list = []  # this node's launched servers (its local rank 0 only)
        # an SGLang driver's fault counters (requests sent again, rejoins, servers lost), shared by the engines
        # this slot builds: the run's totals across rebuilds
        self.faults = {"requests_resent": 0, "server_rejoins": 0, "servers_lost": 0}
        self.out: set = set()  # external servers the closed engine had taken out: a rebuild starts without them
        self.build()

    def _launches(self) -> bool:
        return ENGINES.get(self.cfg.rollout.engine).launches_servers(self.cfg)

    def _launch_per_node(self):
        """Every node's servers started by its local rank 0 -> (the run config attached to their URLs in node
        order, {url: (node, this process's SGLangServer handle or None)})."""
        sg = self.cfg.rollout.sglang
        self._agree_key(sg.api_key_env)
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        node = int(os.environ.get("GROUP_RANK", "0"))
        nodes = max(1, dist.get_world_size() // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        err = None
        if local_rank == 0:
            try:
                self.node_servers = launch_node_servers(sg, self.cfg.model.init_from_hf, node, nodes,
                                                        colocate=self.cfg.rollout.colocate,
                                                        extra_args=extra_server_args(self.cfg, self.hf))
            except EngineError as e:
                err = str(e)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, (node, [s.url for s in self.node_servers], err), group=self.group)
        errors = sorted({e for _, _, e in every if e})
        if errors:  # every rank stops here with the same line; the nodes that did start stop their servers
            self._stop_node_servers()
            raise EngineError("; ".join(errors))
        mine = {s.url: s for s in self.node_servers}
        launched = {url: (n, mine.get(url)) for n, urls, _ in sorted(every, key=lambda x: x[0]) for url in urls}
        cfg = dataclasses.replace(self.cfg, rollout=dataclasses.replace(
            self.cfg.rollout, sglang=dataclasses.replace(sg, urls=list(launched), launch=False)))
        return cfg, launched

    def _agree_key(self, name: str) -> None:
        """The job's key for the servers launched here, the same on every rank (the drivers send it, the launchers
        start the servers with it): rank 0's $name, or one it makes now (launch/slurm/*.sbatch export one to every
        step; a run started otherwise has none), sent to the others over `group` (the job's own ranks), then put in
        $name on every rank: a rebuild's relaunch, and the engines, read it there."""
        key = os.environ.get(name) or None
        if dist.get_world_size() > 1:
            box = [(key or new_key()) if dist.get_rank() == 0 else None]
            dist.broadcast_object_list(box, src=0, group=self.group)
            key = box[0]
        os.environ[name] = key or new_key()

    def _stop_node_servers(self):
        servers, self.node_servers = self.node_servers, []
        for s in servers:
            s.stop()

    def build(self):
        launches = self._launches()
        if launches and self.before_launch is not None:
            self.before_launch()
        cfg, launched = (self._launch_per_node() if launches else (self.cfg, {}))
        try:
            self.engine = build_engine(cfg, self.hf)
        except BaseException:
            self._stop_node_servers()
            raise
        if self.engine is None:
            name = self.cfg.rollout.sync_transport
            if name in TRANSPORTS and getattr(TRANSPORTS.get(name), "all_ranks", False):
                self.transport = make_transport(self.cfg, None, self.hf)  # a sender without servers of its own
            return
        if launched:
            self.engine.adopt(launched)
        if hasattr(self.engine, "should_stop"):
            self.engine.should_stop = self.should_stop
        if hasattr(self.engine, "faults"):
            self.engine.faults = self.faults
        if self.out and not launched and hasattr(self.engine, "leave_out"):  # (launched ones start afresh)
            self.engine.leave_out(self.out)
        try:
            self.transport = make_transport(self.cfg, self.engine, self.hf)
        except BaseException:
            self.engine.shutdown()
            self.engine = None
            raise

    def close(self):
        transport, engine = self.transport, self.engine
        self.engine = self.transport = None
        self.out = {s.url for s in getattr(engine, "servers", ()) if not s.alive}
        try:
            if transport is not None and hasattr(transport, "close"):
                transport.close()
        except Exception as e:  # a failed engine may refuse; its servers are stopped next anyway
            log.warning("closing the weight transport raised %s", e)
        finally:
            try:
                if engine is not None:
                    engine.shutdown()
            finally:
                self._stop_node_servers()


class StopRequested(Exception):
    """Every rank: a stop (SIGTERM) was agreed while ranks waited for the engine (a rollout, an evaluation, a weight
    sync); the trainer saves its last completed step and exits."""


_OK, _FAILED, _STOP = 0, 1, 2


def agree(code: int, group, stop: bool = False) -> tuple[int, bool]:
    """(the worst outcome over all ranks (max), whether any rank has a stop requested), on the host-side control
    group: ranks that finished their share wait here while engine ranks generate or load weights, under that
    group's own long timeout (rollout.wait_timeout), not NCCL's."""
    flag = torch.tensor([code, int(stop)], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return int(flag[0]), bool(flag[1])


class EngineGuard:
    """Runs engine calls (a rollout, a weight sync) so that a failure on any rank is seen by all: the engine (and
    its transport) is rebuilt on every engine rank and the weights re-synced (collective; the re-sync itself
    retried under the same budget), up to `restarts` times, else EngineError. A stop requested on any rank wins
    over a failure: StopRequested everywhere and no rebuild (the servers may be stopping with the job; the
    trainer saves what it has). group: a gloo group with a long timeout (distributed.control_group)."""

    def __init__(self, slot: EngineSlot, sync, restarts: int, group, should_stop=None):
        self.slot, self.sync, self.restarts_left, self.group = slot, sync, restarts, group
        self.should_stop = should_stop
        self.restarts = 0
        # what else uses the engine (the async producer's generation thread): quiesced around a rebuild
        self.quiesce: list = []  # context-manager factories

    def _attempt(self, fn):
        """fn() on this rank -> (its result, the worst outcome over all ranks, the failures' text or None)."""
        err, code, out = None, _OK, None
        try:
            out = fn()
        except RolloutInterrupted as e:
            err, code = e, _STOP
        except EngineError as e:
            err, code = e, _FAILED
        worst, stopping = agree(code, self.group, self.should_stop is not None and self.should_stop())
        if worst == _OK:
            return out, None
        if worst == _STOP or stopping:
            raise StopRequested(f"stop requested while waiting for the engine ({err or 'on another rank'})")
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, None if err is None else str(err), group=self.group)
        return None, "; ".join(f"rank {r}: {e}" for r, e in enumerate(every) if e is not None)

    def run(self, fn):
        """fn() under the guard; after a failure the rebuild and its re-sync, then fn() again -- unless fn is the
        weight sync itself, which the re-sync has just done (not a second full transfer)."""
        while True:
            out, why = self._attempt(fn)
            if why is None:
                return out
            with contextlib.ExitStack() as quiet:
                for q in self.quiesce:
                    quiet.enter_context(q())
                while why is not None:  # rebuilt, then re-synced; a failed re-sync takes another restart
                    self._rebuild(why)
                    out, why = self._attempt(self.sync)
            if fn == self.sync:
                return out

    def _rebuild(self, why: str):
        if self.restarts_left <= 0:
            err = EngineError(f"rollout engine failed and no restarts are left (trainer.engine_restarts): "
                              f"{why}; the last checkpoint is intact")
            err.agreed = True  # raised on every rank (the failure was agreed): callers may agree again on the way out
            raise err
        log.warning("rollout engine failed (%s): rebuilding it and re-syncing weights", why)
        self.restarts_left -= 1
        self.restarts += 1
        try:
            self.slot.close()
        except Exception as e:  # a dead engine may fail to shut down; it is replaced anyway
            log.warning("shutdown of the failed engine raised %s", e)
        self.slot.build()


class Engines:
    """The rollout side's engines as the trainer holds them: the engine ranks, this rank's slot (engine +
    transport), and the guard every engine call goes through. sync: the trainer's weight sync (re-run after
    a rebuild)."""

    def __init__(self, cfg, hf, sync, should_stop, group, before_launch=None):
        self.ranks = engine_ranks(cfg)
        self.slot = EngineSlot(cfg, hf, should_stop=should_stop, group=group, before_launch=before_launch)
        self.guard = EngineGuard(self.slot, sync, cfg.trainer.engine_restarts, group, should_stop=should_stop)

    def fault_metrics(self) -> dict:
        """The run's server faults so far, summed over the driver ranks (one gloo all-reduce): servers alive now
        (of all), requests sent again to another server, servers that left the pool, rejoins after a reload."""
        e, f = self.slot.engine, self.slot.faults
        live = getattr(e, "live", None)
        mine = [len(live) if live is not None else 0, len(getattr(e, "servers", ()) or ()),
                f["requests_resent"], f["servers_lost"], f["server_rejoins"]]
        t = torch.tensor(mine, dtype=torch.int64)
        dist.all_reduce(t, group=self.guard.group)
        if not int(t[1]):  # no server-backed engine (the embedded one): nothing to report
            return {}
        return {"engine/servers_alive": int(t[0]), "engine/servers": int(t[1]), "engine/requests_resent": int(t[2]),
                "engine/servers_lost": int(t[3]), "engine/server_rejoins": int(t[4])}

    def stop_agreed(self) -> bool:
        """Whether any rank has a stop requested, agreed on the control group (gloo, rollout.wait_timeout): before
        a weight sync, so that a stop never depends on the servers (which may be stopping with the job)."""
        stop = self.guard.should_stop
        return agree(_OK, self.guard.group, stop is not None and stop())[1]

    def close(self):
        self.slot.close()
