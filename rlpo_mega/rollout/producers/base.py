"""A producer: the rollout side behind one interface, yielding each RL step's scored groups.

A producer (PRODUCERS, chosen by rollout.producer) is a schedule -- sync (producers/sync.py: generate the step's
groups on the weights of the last sync) or async (producers/asynchronous.py: generation overlapped with training,
bounded staleness, partial rollouts) -- over a task (producers/tasks.py: a prompt's n single answers, or its n
multi-turn episodes), through filters (DAPO dynamic sampling, rollout/dynamic_sampling.py). Each is called
collectively on every rank once per step and returns `ScoredGroups`: every sample's scalars on every rank
(lengths, reward, flags, owner: all that advantages and the step plan need), each sample's payload (tokens,
log-probs, routes) on the rank whose engine made it. The trainer does not know how the groups were made.

SPMD: engine ranks (rollout/engines.py) each generate a contiguous share of the prompts and score it; the
scalars' gather (rollout/gather.py) then gives every rank every sample, in rank order. Every engine stream is
consumed by one loop, rollout/base.drive (finish, stop sending, interrupt, abort).
"""
from __future__ import annotations

import abc
import contextlib
import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from rlpo_mega.algorithms.registry import Registry
from rlpo_mega.config import ConfigError
from rlpo_mega.rollout.base import Sample, SamplingParams, drive
from rlpo_mega.shares import share_of
from rlpo_mega.rollout.gather import gather_scalars
from rlpo_mega.rollout.producers.tasks import Episodes, SingleAnswers, Task

PRODUCERS = Registry("rollout producer")


@dataclass
class ScoredGroups:
    """A step's samples, group-major (n per prompt), and what collecting them measured."""
    samples: list[Sample]
    group_ids: torch.Tensor  # [len(samples)]
    metrics: dict = field(default_factory=dict)

    def advantage_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rewards, group ids, response lengths, truncated flags): what advantages and shaping need."""
        return (torch.tensor([s.reward for s in self.samples]), self.group_ids,
                torch.tensor([s.response_len for s in self.samples]),
                torch.tensor([s.finish_reason == "length" for s in self.samples]))


class RolloutProducer(abc.ABC):
    """Yields the scored groups of one RL step (collective: every rank calls `collect` with the same step).
    Built by the trainer as cls(cfg, sampler, rollouts, divisor): the run config, the prompt sampler (its
    cursor is checkpointed), generation on the engine ranks (`Rollouts`), and the row count a step's samples
    must be a multiple of."""

    def __init__(self, cfg, sampler, rollouts: "Rollouts", divisor: int):
        self.cfg, self.sampler, self.rollouts, self.divisor = cfg, sampler, rollouts, divisor

    @classmethod
    def check_config(cls, cfg, warns: list) -> None:
        """`rlpo-mega check` of the settings this producer reads (a ConfigError for a refusal, a line in `warns` for
        a warning). A schedule that generates each step on the weights of the last sync takes no staleness and
        continues no sample."""
        if cfg.trainer.max_staleness > 0:
            raise ConfigError(f"trainer.max_staleness={cfg.trainer.max_staleness} needs rollout.producer=async (the "
                              f"{cfg.rollout.producer} producer generates each step on the weights of the last sync)")
        if cfg.rollout.partial_rollout_mask:
            raise ConfigError(MASK_NEEDS_PARTIAL)
        if cfg.rollout.partial_rollout_kv == "keep":
            raise ConfigError(f"rollout.partial_rollout_kv=keep holds requests across a weight sync, which only "
                              f"rollout.producer=async makes (the {cfg.rollout.producer} producer generates nothing "
                              "during one): leave it recompute")

    @classmethod
    def steps_held(cls, cfg) -> int:
        """How many steps' samples an engine rank holds at once (`rlpo-mega plan`'s driver rows): the step's."""
        return 1

    @abc.abstractmethod
    def collect(self, step: int, timer) -> ScoredGroups:
        """The groups to train on at `step`; none (an empty list) means the step makes no update."""

    def paused(self, version: Optional[int] = None):
        """A context in which nothing generates (the trainer's weight syncs and evaluations); on a clean exit after
        a sync, the engine holds policy `version`. Nothing runs between steps here: a no-op."""
        return contextlib.nullcontext()

    def state_dict(self) -> dict:
        """This rank's own state between steps (saved with each checkpoint, per rank; empty: nothing to save)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()` on the same rank of a run of the same world size."""

    def close(self):
        pass


MASK_NEEDS_PARTIAL = ("rollout.partial_rollout_mask=true masks the tokens of continued samples, which only "
                      "rollout.producer=async with rollout.partial_rollout=true makes: set both or leave it false")


def mix_seed(*parts: int) -> int:
    """A 62-bit seed from integers (run seed, step, call, rank): distinct calls never share streams."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = ((h ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & ((1 << 62) - 1)


def share(items: list, ranks: list[int]) -> list:
    """This rank's contiguous share of `items` (empty on ranks without an engine)."""
    me = dist.get_rank()
    return share_of(items, ranks.index(me), len(ranks)) if me in ranks else []


def trim_to_divisor(samples: list, n: int, divisor: int) -> tuple[list, int]:
    """A step's samples (groups of n, group-major) cut to the whole groups whose rows split evenly into `divisor`
    (mini-batches x DP x ...); returns them and the number of groups dropped."""
    unit = divisor // math.gcd(divisor, n)
    keep = (len(samples) // n) // unit * unit
    return samples[:keep * n], len(samples) // n - keep


def generate_local(task: Task, engine, mine, n: int, params: SamplingParams, timer) -> list[Sample]:
    """This rank's share: n samples per item, each group scored as it completes, while the others still generate
    (no collective: a failure here is agreed on by EngineGuard before anyone enters the gather)."""
    if not mine:
        return []
    groups: list = [None] * len(mine)

    def group(i, samples):
        with timer("reward"):
            task.score(mine[i], samples)
        groups[i] = samples

    drive(task.stream(engine, mine, params, n), group, lambda: timer("rollout"))
    return [s for g in groups for s in g]


class Rollouts:
    """Generation on the engine ranks, made collective: n scored samples per prompt item (the run's task: single
    answers, or episodes with environment.name), every sample's scalars on every rank (payloads on their owner).
    Used by the producers and by evaluation."""

    def __init__(self, cfg, engines, scorer, tokenizer, spec):
        self.cfg, self.engines, self.tokenizer, self.spec = cfg, engines, tokenizer, spec
        self.task: Task = Episodes(cfg, tokenizer) if cfg.environment.name else SingleAnswers(scorer, tokenizer)

    def __call__(self, items, n: int, params: SamplingParams, timer) -> list[Sample]:
        mine = share(items, self.engines.ranks)
        local = self.engines.guard.run(lambda: generate_local(self.task, self.engines.slot.engine, mine, n, params,
                                                              timer))
        with timer("gather"):
            return gather_scalars(local, self.spec, self.cfg.routing.on_bad_trace, self.engines.guard.group)
