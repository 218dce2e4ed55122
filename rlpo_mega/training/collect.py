"""Phase 1 of an RL step: the rollout side behind one interface, yielding the step's scored groups.

A producer (PRODUCERS, chosen by rollout.producer) is called collectively on every rank once per step and
returns `ScoredGroups`: every sample's scalars on every rank (lengths, reward, flags, owner: all that
advantages and the step plan need), each sample's payload (tokens, log-probs, routes) on the rank whose engine
made it. The trainer does not know how the groups were made: synchronous collection (with dynamic sampling
streamed per engine rank) is the producer here; asynchronous RL (generation overlapped with training, bounded
staleness, partial rollouts) is training/async_collect.py. Either runs single answers or multi-turn episodes
(environment.name), with or without DAPO dynamic sampling (a group: a prompt's n answers or episodes).

SPMD: engine ranks (training/engines.py) each generate a contiguous share of the prompts and score it; the
scalars' gather (training/exchange.py) then gives every rank every sample, in rank order. With dynamic sampling
each engine rank fills its own share of the step's groups at its own pace (rollout/dynamic_sampling.GroupCollector); the
ranks meet once, after, to agree on how many chunks of prompts were drawn (the cursor stays equal on every rank).
"""
from __future__ import annotations

import abc
import contextlib
import logging
import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from rlpo_mega.algorithms.registry import Registry
from rlpo_mega.environments import EnvRunner, environment_tools
from rlpo_mega.rewards import RewardInput
from rlpo_mega.rollout import Sample, SamplingParams
from rlpo_mega.rollout.base import drive, share_of
from rlpo_mega.rollout.dynamic_sampling import DynamicSamplingReport, GroupCollector
from rlpo_mega.rollout.episode import EpisodeBatch, EpisodeLimits, TurnFormat, run_episodes
from rlpo_mega.training.exchange import gather_scalars

log = logging.getLogger("rlpo_mega")

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


def sampling_params(cfg, tokenizer, seed: int, greedy: bool = False) -> SamplingParams:
    r = cfg.rollout
    stop = tuple(r.stop_token_ids) if r.stop_token_ids is not None else (tokenizer.eos_token_id,)
    return SamplingParams(temperature=r.temperature, top_p=1.0 if greedy else r.top_p,
                          top_k=1 if greedy else r.top_k, max_new_tokens=r.max_new_tokens,
                          stop_token_ids=tuple(int(t) for t in stop if t is not None), seed=seed)


def generate_local(engine, mine, n: int, params: SamplingParams, scorer, tokenizer, timer,
                   episodes: Optional["Episodes"] = None) -> list[Sample]:
    """This rank's share: generate n responses per item and score them (no collective: a failure here
    is agreed on by EngineGuard before anyone enters the gather). With `episodes`: n multi-turn episodes per
    item, scored by their environments as they run."""
    if not mine:
        return []
    groups: list = [None] * len(mine)
    stream = episodes.stream(engine, mine, params, n) if episodes else engine.stream(
        [it.input_ids for it in mine], params, n=n)

    def group(i, samples):  # each group is scored as it completes, while the others still generate
        if episodes is None:
            with timer("reward"):
                score([mine[i]] * n, samples, scorer, tokenizer)
        groups[i] = samples

    drive(stream, group, lambda: timer("rollout"))
    return [s for g in groups for s in g]


class Episodes:
    """Multi-turn generation on an engine rank (environment.name set): n episodes per prompt item, each
    environment's steps on the runner's threads, observations in the tokenizer's turn format."""

    def __init__(self, cfg, tokenizer):
        e = cfg.environment
        self.runner = EnvRunner(e)
        self.fmt = TurnFormat(tokenizer, sampling_params(cfg, tokenizer, 0).stop_token_ids, environment_tools(e))
        self.limits = EpisodeLimits(e.max_turns, e.max_tokens)
        self.tokenizer = tokenizer

    def batch(self, items, n: int) -> EpisodeBatch:
        """n episodes per item, advanced call by call (the asynchronous producer)."""
        return EpisodeBatch([(it.input_ids, it.record) for it in items], n, self.runner, self.fmt, self.limits,
                            self.tokenizer)

    def stream(self, engine, items, params: SamplingParams, n: int):
        return run_episodes(engine, [(it.input_ids, it.record) for it in items], n, params, self.runner, self.fmt,
                            self.limits, self.tokenizer)


def score(items, samples: list[Sample], scorer, tokenizer, version: Optional[int] = None,
          correct_at: float = 1.0) -> list[float]:
    """Score samples (sample i answers items[i]) into their reward, failed and correct fields; `version`: the
    policy version (step) that sampled them, kept in meta.policy_version."""
    result = scorer.score([RewardInput(it.record.prompt, tokenizer.decode(s.response_ids, skip_special_tokens=True),
                                       it.record.reference, it.record.metadata) for it, s in zip(items, samples)])
    for s, r, f in zip(samples, result.rewards, result.failed):
        s.reward, s.failed, s.correct = float(r), bool(f), float(r) >= correct_at
        if version is not None:
            s.meta.policy_version = version
    return [s.reward for s in samples]


class Rollouts:
    """Generation on the engine ranks, made collective: n scored responses per prompt item, every sample's
    scalars on every rank (payloads on their owner). Used by the producers and by evaluation."""

    def __init__(self, cfg, engines, scorer, tokenizer, spec):
        self.cfg, self.engines, self.scorer, self.tokenizer, self.spec = cfg, engines, scorer, tokenizer, spec
        self.episodes = Episodes(cfg, tokenizer) if cfg.environment.name else None

    def __call__(self, items, n: int, params: SamplingParams, timer) -> list[Sample]:
        mine = share(items, self.engines.ranks)
        local = self.engines.guard.run(lambda: generate_local(
            self.engines.slot.engine, mine, n, params, self.scorer, self.tokenizer, timer, self.episodes))
        with timer("gather"):
            return gather_scalars(local, self.spec, self.cfg.routing.on_bad_trace, self.engines.guard.group)


@PRODUCERS.register("sync")
class SyncProducer(RolloutProducer):
    """Synchronous collection on the weights of the last sync: draw prompts, generate and score n responses each
    on the engine ranks. With DAPO dynamic sampling every engine rank streams its own share (GroupCollector:
    chunks of prompts, a group scored and filtered as its last sample arrives, the rank's rollout aborted once
    its share of groups is complete, surplus groups carried to the next step). A short batch keeps the whole
    groups that split evenly into `divisor` rows (mini-batches x DP x ...)."""

    def __init__(self, cfg, sampler, rollouts: "Rollouts", divisor: int):
        super().__init__(cfg, sampler, rollouts, divisor)
        ds = cfg.algorithm.dynamic_sampling
        self.groups = GroupCollector(ds.max_tries, ds.max_carry_steps)
        self.pending: list[list] = []  # this rank's shares of chunks drawn to keep the cursors equal, not yet sent

    def state_dict(self) -> dict:
        """The prompts this rank drew and has not sent (the cursor is past them) and its carried groups: a resumed
        run trains them where the uninterrupted one would have."""
        if not self.pending and not self.groups.carry:
            return {}
        return {"pending": self.pending, "carry": self.groups.carry}

    def load_state_dict(self, state: dict) -> None:
        pending, carry = list(state.get("pending", [])), list(state.get("carry", []))
        fits = [g for g in carry if len(g.samples) == self.cfg.prompts.n_samples]
        if not self.cfg.algorithm.dynamic_sampling.enabled and (pending or carry):
            log.warning("the checkpoint holds %d carried groups and %d prompts drawn and not sent by rank %d, but "
                        "algorithm.dynamic_sampling is off now: they are dropped", len(carry),
                        sum(map(len, pending)), dist.get_rank())
            pending, fits = [], []
        elif len(fits) < len(carry):
            log.warning("rank %d drops %d carried groups of another size than prompts.n_samples=%d",
                        dist.get_rank(), len(carry) - len(fits), self.cfg.prompts.n_samples)
        self.pending, self.groups.carry = pending, fits

    def collect(self, step: int, timer) -> ScoredGroups:
        cfg, p = self.cfg, self.cfg.prompts
        if cfg.algorithm.dynamic_sampling.enabled:
            samples, metrics = self._dynamic(step, timer)
        else:
            seed = mix_seed(cfg.seed, step, 0, dist.get_rank())
            samples = self.rollouts(self.sampler.next_prompts(p.prompts_per_step), p.n_samples,
                                    sampling_params(cfg, self.rollouts.tokenizer, seed), timer)
            metrics = {}
        samples, trimmed = trim_to_divisor(samples, p.n_samples, self.divisor)
        if trimmed:  # a short dynamic-sampling batch
            metrics["dynamic_sampling/trimmed_groups"] = trimmed
        return ScoredGroups(samples, torch.arange(len(samples) // p.n_samples).repeat_interleave(p.n_samples), metrics)

    def _dynamic(self, step: int, timer) -> tuple[list[Sample], dict]:
        """Every rank: the step's kept groups (scalars; payloads on their engine rank) and the summed counts."""
        cfg, p = self.cfg, self.cfg.prompts
        engines, me = self.rollouts.engines, dist.get_rank()
        ranks, n = engines.ranks, p.n_samples
        quota = len(share(list(range(p.prompts_per_step)), ranks))
        # one chunk = every engine rank's share of ceil(largest share x oversample) prompts each, drawn on every
        # rank alike: the prompt cursor stays the same everywhere (checkpointed once) whoever drew how many
        per_rank = math.ceil(-(-p.prompts_per_step // len(ranks)) * p.oversample)
        drawn = [0]

        def draw():
            if self.pending:
                return self.pending.pop(0)
            drawn[0] += 1
            return share(self.sampler.next_prompts(per_rank * len(ranks)), ranks)

        episodes = self.rollouts.episodes

        def stream(items, k):
            params = sampling_params(cfg, self.rollouts.tokenizer, mix_seed(cfg.seed, step, k, me))
            if episodes is not None:  # a group: the prompt's n episodes
                return episodes.stream(engines.slot.engine, items, params, n)
            return engines.slot.engine.stream([it.input_ids for it in items], params, n=n)

        def score_group(item, group):
            if episodes is not None:  # an episode's reward is its environment's
                for s in group:
                    s.meta.policy_version = step
                return [s.reward for s in group]
            return score([item] * len(group), group, self.rollouts.scorer, self.rollouts.tokenizer, step)

        before, attempts = (self.sampler.state_dict(), list(self.pending), list(self.groups.carry)), [0]

        def discard():  # an attempt that does not count: as if it never ran -- the cursor rewound (equal on every
            self.sampler.load_state_dict(before[0])  # rank again), the prompts it took and its carried groups back
            self.pending, self.groups.carry, drawn[0] = list(before[1]), list(before[2]), 0

        def local():
            if me not in ranks:
                return [], DynamicSamplingReport(0)
            if attempts[0]:  # a retry: the engine guard reruns every rank's attempt after a failure on any
                discard()
            attempts[0] += 1
            return self.groups.collect(quota, step, draw, stream, score_group, timer)

        try:
            kept, report = engines.guard.run(local)
        except BaseException:  # a stop (saved at the step before: this one never happened), or the run's end
            discard()
            raise
        # the ranks that drew fewer chunks draw the rest now and keep their shares for their next step
        counts = torch.tensor([drawn[0], *report.counts()], dtype=torch.int64)
        most = counts[:1].clone()
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=engines.guard.group)
        dist.all_reduce(counts, group=engines.guard.group)
        for _ in range(int(most) - drawn[0]):
            chunk = share(self.sampler.next_prompts(per_rank * len(ranks)), ranks)
            if chunk:
                self.pending.append(chunk)
        total = DynamicSamplingReport(*counts[1:].tolist())
        local_samples = [s for g in kept for s in g.samples]
        with timer("gather"):
            samples = gather_scalars(local_samples, self.rollouts.spec, cfg.routing.on_bad_trace, engines.guard.group)
        return samples, total.stats()

