"""The synchronous schedule (rollout.producer=sync): a step's groups generated on the weights of the last sync.

With dynamic sampling each engine rank fills its own share of the step's groups at its own pace
(rollout/dynamic_sampling.GroupCollector); the ranks meet once, after, to agree on how many chunks of prompts were
drawn (the cursor stays equal on every rank).
"""
from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist

from rlpo_mega.rollout.base import Sample
from rlpo_mega.rollout.dynamic_sampling import DynamicSamplingReport, GroupCollector
from rlpo_mega.rollout.gather import gather_scalars
from rlpo_mega.rollout.producers.base import (PRODUCERS, RolloutProducer, Rollouts, ScoredGroups, mix_seed, share,
                                              trim_to_divisor)
from rlpo_mega.rollout.producers.tasks import sampling_params

log = logging.getLogger("rlpo_mega")


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

        task = self.rollouts.task

        def stream(items, k):
            return task.stream(engines.slot.engine, items,
                               sampling_params(cfg, self.rollouts.tokenizer, mix_seed(cfg.seed, step, k, me)), n)

        def score_group(item, group):
            return task.score(item, group, step)

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
