"""The rollout side of an RL step: engines per rank, generation shares, rewards, weight sync.

SPMD: every learner rank calls everything here. Engine ranks (every rank for the embedded engine, global
rank 0 for an SGLang client, whose servers batch on their own) each generate a contiguous share of the
prompts and score it; the step's exchange (training/exchange.py) then gives every rank every sample's
scalars, so advantages and the DP split are computed identically everywhere.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from rlpo_mega.config import ConfigError
from rlpo_mega.rewards import RewardInput
from rlpo_mega.rollout import ENGINES, EngineError, RolloutInterrupted, SamplingParams

log = logging.getLogger("rlpo_mega")


@dataclass
class Scored:
    """One generated response with its reward (what every rank holds after the gather)."""
    prompt_ids: list
    response_ids: list
    logprobs: torch.Tensor
    finish_reason: str
    routes: Optional[torch.Tensor]
    reward: float
    failed: bool
    correct: bool
    replaced: Optional[torch.Tensor] = None  # bool [T, L]: trace entries the live router decides (validated)


def mix_seed(*parts: int) -> int:
    """A 62-bit seed from integers (run seed, step, call, rank): distinct calls never share streams."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = ((h ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & ((1 << 62) - 1)


def build_engine(cfg, hf):
    """The configured engine on the ranks that run one (None elsewhere)."""
    if dist.get_rank() not in engine_ranks(cfg):
        return None
    return ENGINES.get(cfg.rollout.engine).from_config(cfg, hf)


def engine_ranks(cfg) -> list[int]:
    return ENGINES.get(cfg.rollout.engine).ranks(dist.get_world_size())


def make_transport(cfg, engine, hf):
    """The configured weight transport of `engine`, through the TRANSPORTS registry."""
    from rlpo_mega.weight_sync.transports import TRANSPORTS

    cls = TRANSPORTS.get(cfg.rollout.sync_transport)
    if not hasattr(cls, "from_config"):
        raise ConfigError(f"rollout.sync_transport={cfg.rollout.sync_transport} cannot be built from a config "
                          "(it is the generic engine-rank protocol); use in_process, disk or sglang_distributed")
    return cls.from_config(cfg, engine, hf)


class EngineSlot:
    """This rank's engine and its weight transport: built together once (a transport's group lives as long
    as its engine), closed together (transport first), rebuilt together by EngineGuard. Ranks without an
    engine hold None for both. `should_stop` (the trainer's stop flag) is handed to every engine built.

    Launched SGLang servers (rollout.sglang.launch=true) are started by one launcher per node: each node's
    local rank 0 starts that node's servers on the GPUs its learner ranks leave free; every rank learns every
    URL (one all_gather_object over `group`) and the engine rank attaches to all of them. Building is
    therefore collective when servers are launched (every rank calls build, as EngineGuard's rebuild does)."""

    def __init__(self, cfg, hf, should_stop=None, group=None):
        self.cfg, self.hf, self.should_stop, self.group = cfg, hf, should_stop, group
        self.engine = self.transport = None
        self.node_servers: list = []  # this node's launched servers (its local rank 0 only)
        self.build()

    def _launches(self) -> bool:
        sg = self.cfg.rollout.sglang
        return self.cfg.rollout.engine == "sglang" and sg.launch and not sg.urls

    def _launch_per_node(self):
        """Every node's servers started by its local rank 0 -> (the run config attached to their URLs in node
        order, {url: (node, this process's SGLangServer handle or None)})."""
        import dataclasses
        import os

        from rlpo_mega.rollout.sglang_engine import launch_node_servers

        sg = self.cfg.rollout.sglang
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        node = int(os.environ.get("GROUP_RANK", "0"))
        nodes = max(1, dist.get_world_size() // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        err = None
        if local_rank == 0:
            try:
                self.node_servers = launch_node_servers(sg, self.cfg.model.init_from_hf, node, nodes)
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

    def _stop_node_servers(self):
        servers, self.node_servers = self.node_servers, []
        for s in servers:
            s.stop()

    def build(self):
        cfg, launched = (self._launch_per_node() if self._launches() else (self.cfg, {}))
        try:
            self.engine = build_engine(cfg, self.hf)
        except BaseException:
            self._stop_node_servers()
            raise
        if self.engine is None:
            return
        if launched:
            self.engine.adopt(launched)
        if hasattr(self.engine, "should_stop"):
            self.engine.should_stop = self.should_stop
        try:
            self.transport = make_transport(self.cfg, self.engine, self.hf)
        except BaseException:
            self.engine.shutdown()
            self.engine = None
            raise

    def close(self):
        transport, engine = self.transport, self.engine
        self.engine = self.transport = None
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


def share(items: list, ranks: list[int]) -> list:
    """This rank's contiguous share of `items` (empty on ranks without an engine)."""
    me = dist.get_rank()
    if me not in ranks:
        return []
    k, i = len(ranks), ranks.index(me)
    per, extra = divmod(len(items), k)
    start = i * per + min(i, extra)
    return items[start:start + per + (1 if i < extra else 0)]


def sampling_params(cfg, tokenizer, seed: int, greedy: bool = False) -> SamplingParams:
    r = cfg.rollout
    stop = tuple(r.stop_token_ids) if r.stop_token_ids is not None else (tokenizer.eos_token_id,)
    return SamplingParams(temperature=r.temperature, top_p=1.0 if greedy else r.top_p,
                          top_k=1 if greedy else r.top_k, max_new_tokens=r.max_new_tokens,
                          stop_token_ids=tuple(int(t) for t in stop if t is not None), seed=seed)


def generate_local(engine, mine, n: int, params: SamplingParams, scorer, tokenizer, timer,
                   correct_at: float = 1.0) -> list[Scored]:
    """This rank's share: generate n responses per item and score them (no collective: a failure here
    is agreed on by EngineGuard before anyone enters the gather)."""
    if not mine:
        return []
    with timer("rollout"):
        samples = engine.generate([it.input_ids for it in mine], params, n=n)
    with timer("reward"):
        inputs = [RewardInput(it.record.prompt, tokenizer.decode(s.response_ids, skip_special_tokens=True),
                              it.record.reference, it.record.metadata)
                  for it, s in zip((it for it in mine for _ in range(n)), samples)]
        result = scorer.score(inputs)
    return [Scored(s.prompt_ids, s.response_ids, s.logprobs, s.finish_reason, s.routes, float(r), bool(f),
                   float(r) >= correct_at) for s, r, f in zip(samples, result.rewards, result.failed)]


def all_ok(ok, device) -> bool:
    """`ok` (a bool, or a bool device tensor: read on the host only after the all-reduce) on every rank."""
    if torch.is_tensor(ok):
        flag = (~ok.to(device=device, dtype=torch.bool)).float().reshape(1)
    else:
        flag = torch.tensor([0.0 if ok else 1.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() == 0


class StopRequested(Exception):
    """Every rank: a stop (SIGTERM) interrupted the rollout; the trainer saves and exits."""


_OK, _FAILED, _STOP = 0, 1, 2


def agree(code: int, group) -> int:
    """The worst outcome over all ranks (max), on the host-side control group: ranks that finished their
    share wait here while engine ranks generate, under that group's own long timeout (not NCCL's)."""
    flag = torch.tensor([code], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return int(flag.item())


class EngineGuard:
    """Runs engine calls so that a failure on any rank is seen by all: the engine (and its transport) is
    rebuilt on every engine rank and the weights re-synced (collective), up to `restarts` times, else
    EngineError. A stop requested during the call (RolloutInterrupted) becomes StopRequested everywhere.
    group: a gloo group with a long timeout (distributed.control_group)."""

    def __init__(self, slot: EngineSlot, sync, restarts: int, group):
        self.slot, self.sync, self.restarts_left, self.group = slot, sync, restarts, group
        self.restarts = 0

    def run(self, fn):
        while True:
            err, code = None, _OK
            try:
                out = fn()
            except RolloutInterrupted as e:
                err, code, out = e, _STOP, None
            except EngineError as e:
                err, code, out = e, _FAILED, None
            worst = agree(code, self.group)
            if worst == _OK:
                return out
            if worst == _STOP:
                raise StopRequested("stop requested during the rollout")
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, None if err is None else str(err), group=self.group)
            why = "; ".join(f"rank {r}: {e}" for r, e in enumerate(every) if e is not None)
            if self.restarts_left <= 0:
                raise EngineError(f"rollout engine failed and no restarts are left (trainer.engine_restarts): "
                                  f"{why}; the last checkpoint is intact")
            log.warning("rollout engine failed (%s): rebuilding it and re-syncing weights", why)
            self.restarts_left -= 1
            self.restarts += 1
            try:
                self.slot.close()
            except Exception as e:  # a dead engine may fail to shut down; it is replaced anyway
                log.warning("shutdown of the failed engine raised %s", e)
            self.slot.build()
            self.sync()
