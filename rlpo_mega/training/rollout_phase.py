"""The rollout side of an RL step: engines per rank, generation shares, rewards, weight sync.

SPMD: every learner rank calls everything here. Engine ranks (every rank for the embedded engine, global
rank 0 for an SGLang client, whose servers batch on their own) each generate a contiguous share of the
prompts and score it; one all_gather_object gives every rank the same list of samples, so advantages,
batch assembly and the DP split are computed identically everywhere.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from rlpo_mega.rewards import RewardInput
from rlpo_mega.rollout import ENGINES, EngineError, SamplingParams

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


def mix_seed(*parts: int) -> int:
    """A 62-bit seed from integers (run seed, step, call, rank): distinct calls never share streams."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = ((h ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & ((1 << 62) - 1)


def build_engine(cfg, hf):
    """The configured engine on the ranks that run one (None elsewhere)."""
    name = cfg.rollout.engine
    cls = ENGINES.get(name)
    if name == "sglang":
        if dist.get_rank() != 0:
            return None
        return cls(cfg.rollout.sglang, hf, model_path=cfg.model.init_from_hf,
                   return_routes=cfg.routing.mode != "off")
    return cls.from_config(cfg, hf) if hasattr(cls, "from_config") else cls(hf, cfg.rollout.embedded)


def engine_ranks(cfg) -> list[int]:
    return [0] if cfg.rollout.engine == "sglang" else list(range(dist.get_world_size()))


def make_transport(cfg, engine, hf):
    from rlpo_mega.weight_sync.transports import TRANSPORTS

    name = cfg.rollout.sync_transport
    cls = TRANSPORTS.get(name)
    if name == "disk":
        directory = cfg.rollout.sync_dir or "runs/weight_sync"
        return cls(engine, directory, hf, source_dir=cfg.model.init_from_hf)
    if name == "sglang_distributed":  # the servers join a group whose rank 0 is this (learner rank 0) host
        return cls(engine, master_address=os.environ.get("MASTER_ADDR", "127.0.0.1"))
    return cls(engine)


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


def gather(scored: list[Scored], ranks: list[int]) -> list[Scored]:
    """Every rank: all engine ranks' samples in rank order (= prompt order of `share`). Tensors travel as
    numpy arrays: pickling torch tensors one by one made this the slowest phase of a demo step."""
    wire = [(s.prompt_ids, s.response_ids, s.logprobs.numpy(), s.finish_reason,
             None if s.routes is None else s.routes.numpy(), s.reward, s.failed, s.correct) for s in scored]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, wire)
    return [Scored(p, r, torch.from_numpy(lp), fr, None if rt is None else torch.from_numpy(rt), rw, f, c)
            for rank in ranks for (p, r, lp, fr, rt, rw, f, c) in every[rank]]


def all_ok(ok: bool, device) -> bool:
    flag = torch.tensor([0.0 if ok else 1.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() == 0


class EngineGuard:
    """Runs engine calls so that a failure on any rank is seen by all: the engine is rebuilt on every
    engine rank and the weights re-synced (collective), up to `restarts` times, else EngineError."""

    def __init__(self, build, sync, restarts: int, device):
        self.build, self.sync, self.restarts_left, self.device = build, sync, restarts, device
        self.restarts = 0

    def run(self, engine_holder, fn):
        while True:
            err = None
            try:
                out = fn()
            except EngineError as e:
                err, out = e, None
            if all_ok(err is None, self.device):
                return out
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, None if err is None else str(err))
            why = "; ".join(f"rank {r}: {e}" for r, e in enumerate(every) if e is not None)
            if self.restarts_left <= 0:
                raise EngineError(f"rollout engine failed and no restarts are left (trainer.engine_restarts): "
                                  f"{why}; the last checkpoint is intact")
            log.warning("rollout engine failed (%s): rebuilding it and re-syncing weights", why)
            self.restarts_left -= 1
            self.restarts += 1
            if engine_holder.engine is not None:
                try:
                    engine_holder.engine.shutdown()
                except Exception as e:  # a dead engine may fail to shut down; it is replaced anyway
                    log.warning("shutdown of the failed engine raised %s", e)
            engine_holder.engine = self.build()
            self.sync()
