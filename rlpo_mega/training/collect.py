"""Phase 1 of an RL step: the rollout side behind one interface, yielding the step's scored groups.

A producer (PRODUCERS, chosen by rollout.producer) is called collectively on every rank once per step and
returns `ScoredGroups`: every sample's scalars on every rank (lengths, reward, flags, owner: all that
advantages and the step plan need), each sample's payload (tokens, log-probs, routes) on the rank whose engine
made it. The trainer does not know how the groups were made: synchronous collection with dynamic sampling is
the producer here; streaming, asynchronous (off-policy by a step) and multi-turn producers are other entries.

SPMD: engine ranks (training/engines.py) each generate a contiguous share of the prompts and score it; the
scalars' gather (training/exchange.py) then gives every rank every sample, in prompt order.
"""
from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from rlpo_mega.algorithms.registry import Registry
from rlpo_mega.data.sampling import collect_groups
from rlpo_mega.rewards import RewardInput
from rlpo_mega.rollout import Sample, SamplingParams
from rlpo_mega.training.exchange import gather_scalars

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

    @abc.abstractmethod
    def collect(self, step: int, timer) -> ScoredGroups:
        """The groups to train on at `step`; none (an empty list) means the step makes no update."""

    def close(self):
        pass


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
                   correct_at: float = 1.0) -> list[Sample]:
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
    for s, r, f in zip(samples, result.rewards, result.failed):
        s.reward, s.failed, s.correct = float(r), bool(f), float(r) >= correct_at
    return samples


class Rollouts:
    """Generation on the engine ranks, made collective: n scored responses per prompt item, every sample's
    scalars on every rank (payloads on their owner). Used by the producers and by evaluation."""

    def __init__(self, cfg, engines, scorer, tokenizer, spec):
        self.cfg, self.engines, self.scorer, self.tokenizer, self.spec = cfg, engines, scorer, tokenizer, spec

    def __call__(self, items, n: int, params: SamplingParams, timer) -> list[Sample]:
        mine = share(items, self.engines.ranks)
        local = self.engines.guard.run(lambda: generate_local(
            self.engines.slot.engine, mine, n, params, self.scorer, self.tokenizer, timer))
        with timer("gather"):
            return gather_scalars(local, self.spec, self.cfg.routing.on_bad_trace, self.engines.guard.group)


@PRODUCERS.register("sync")
class SyncProducer(RolloutProducer):
    """Synchronous collection: draw prompts, generate and score n responses each on the engine ranks (the
    weights of the last sync), DAPO dynamic sampling refilling groups with mixed rewards up to max_tries; a
    short batch keeps the whole groups that split evenly into `divisor` rows (mini-batches x DP x ...)."""

    def collect(self, step: int, timer) -> ScoredGroups:
        cfg, p, ds = self.cfg, self.cfg.prompts, self.cfg.algorithm.dynamic_sampling
        calls = iter(range(1 << 30))

        def rollout(items):
            seed = mix_seed(cfg.seed, step, next(calls), dist.get_rank())
            samples = self.rollouts(items, p.n_samples, sampling_params(cfg, self.rollouts.tokenizer, seed), timer)
            return torch.tensor([s.reward for s in samples]), samples

        got = collect_groups(self.sampler, rollout, p.prompts_per_step, p.n_samples, enabled=ds.enabled,
                             max_tries=ds.max_tries, oversample=p.oversample)
        r = got.report
        metrics = {**r.stats(), "dynamic_sampling/kept": r.groups_kept,
                   "dynamic_sampling/dropped": r.dropped_all_zero + r.dropped_all_one + r.dropped_other_constant}
        samples, gids, n = got.samples, got.group_ids, p.n_samples
        unit = self.divisor // math.gcd(self.divisor, n)  # groups whose rows split evenly
        keep = (len(samples) // n) // unit * unit
        if keep * n < len(samples):  # a short dynamic-sampling batch: whole groups dropped to divide evenly
            metrics["dynamic_sampling/trimmed_groups"] = len(samples) // n - keep
            samples, gids = samples[:keep * n], gids[:keep * n]
        return ScoredGroups(samples, gids, metrics)
