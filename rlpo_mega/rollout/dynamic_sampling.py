"""DAPO dynamic sampling over an engine's stream, per engine rank: groups judged as their last sample arrives (kept
while the step's quota is open, surplus after, dropped when their scores are all equal), chunks of prompts until the
quota is kept, surplus carried to later steps. The sync producer runs it through GroupCollector; the async producer
judges its jobs' groups with the same `judge_group` and counts them in the same DynamicSamplingReport."""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from rlpo_mega.algorithms.dynamic_sampling import filter_groups
from rlpo_mega.data.sampling import PromptItem
from rlpo_mega.rollout.base import STOP, drive


@dataclass
class Group:
    """One prompt's n scored samples, and the policy version (the step) whose weights sampled them."""
    item: PromptItem
    samples: list[Any]
    scores: list[float]
    version: int


@dataclass
class DynamicSamplingReport:
    """What one engine rank's dynamic sampling did in a step (summed over ranks by the producer)."""
    target_groups: int
    groups_kept: int = 0
    tries: int = 0  # chunks submitted
    prompts_drawn: int = 0
    dropped_all_zero: int = 0
    dropped_all_one: int = 0
    dropped_other_constant: int = 0
    aborted: int = 0  # groups submitted but not complete when the rank's share was (aborted or never sent)
    carried_in: int = 0  # groups of earlier steps trained on now
    carried_out: int = 0  # surplus groups kept for later steps
    carry_stale: int = 0  # carried groups dropped: older than max_carry_steps policy versions
    surplus_dropped: int = 0  # surplus groups not carried (max_carry_steps = 0)

    FIELDS = ("target_groups", "groups_kept", "tries", "prompts_drawn", "dropped_all_zero", "dropped_all_one",
              "dropped_other_constant", "aborted", "carried_in", "carried_out", "carry_stale", "surplus_dropped")

    @property
    def complete(self) -> bool:
        return self.groups_kept >= self.target_groups

    def counts(self) -> list[int]:
        return [getattr(self, k) for k in self.FIELDS]

    def stats(self) -> dict:
        out = {f"dynamic_sampling/{k}": getattr(self, k) for k in self.FIELDS if k != "target_groups"}
        out["dynamic_sampling/complete"] = int(self.complete)
        out["dynamic_sampling/kept"] = self.groups_kept
        out["dynamic_sampling/dropped"] = self.dropped_all_zero + self.dropped_all_one + self.dropped_other_constant
        return out


def judge_group(scores: Sequence[float], report: DynamicSamplingReport) -> bool:
    """DAPO's filter on one group: kept when its scores are not all equal; a dropped group is counted by kind."""
    f = filter_groups(torch.tensor(scores), torch.zeros(len(scores), dtype=torch.long))
    report.dropped_all_zero += f.dropped_all_zero
    report.dropped_all_one += f.dropped_all_one
    report.dropped_other_constant += f.dropped_other_constant
    return bool(f.kept_groups)


# stream(items, chunk index) -> a generator of (item index, its n samples) as groups complete, that accepts
# send("finish") (rlpo_mega.rollout.RolloutEngine.stream); score(item, samples) -> their n scores
Stream = Callable[[list[PromptItem], int], Any]
Score = Callable[[PromptItem, list[Any]], Sequence[float]]


class GroupCollector:
    """One engine rank's DAPO dynamic sampling, streamed (no whole-batch tries). Per step it fills `quota`
    groups whose n scores are not all equal:

    1. groups carried from earlier steps first, unless more than `max_carry_steps` policy versions old (dropped);
    2. then chunks of prompts (`draw()`), each submitted at once; every group is scored and filtered as its last
       sample arrives; once the quota is full the stream is told to finish: nothing more is sent, running
       requests are aborted;
    3. complete groups with mixed scores beyond the quota (those that end while the rest is aborted, or the rest
       of an engine that answers a chunk at once) are carried to the next step, marked with their version.

    At most `max_chunks` chunks per step: a short step is the caller's to handle. State (carried groups)
    changes only when a step's collection succeeds, so an engine failure retried by the caller loses nothing."""

    def __init__(self, max_chunks: int = 3, max_carry_steps: int = 1):
        if max_chunks < 1 or max_carry_steps < 0:
            raise ValueError(f"need max_chunks >= 1 and max_carry_steps >= 0; got {max_chunks}, {max_carry_steps}")
        self.max_chunks, self.max_carry_steps = max_chunks, max_carry_steps
        self.carry: list[Group] = []

    def collect(self, quota: int, version: int, draw: Callable[[], list[PromptItem]], stream: Stream,
                score: Score, timer=None) -> tuple[list[Group], DynamicSamplingReport]:
        report = DynamicSamplingReport(quota)
        kept, carry = [], []
        for g in self.carry:
            if version - g.version > self.max_carry_steps:
                report.carry_stale += 1
            elif len(kept) < quota:
                kept.append(g)
                report.carried_in += 1
            else:
                carry.append(g)
        while len(kept) < quota and report.tries < self.max_chunks:
            items = draw()
            if not items:
                break
            report.tries += 1
            report.prompts_drawn += len(items)
            ended = self._chunk(items, stream(items, report.tries - 1), quota, version, score, kept, carry, report,
                                timer)
            report.aborted += len(items) - ended
        report.groups_kept = len(kept)
        self.carry = carry
        return kept, report

    def _chunk(self, items, gen, quota, version, score, kept, carry, report, timer) -> int:
        """Run one chunk's stream; returns the number of groups that ended complete."""
        ended = [0]
        timer = timer or (lambda phase: nullcontext())

        def group(i, samples):
            if any(s.finish_reason == "abort" for s in samples):  # cut short by the finish: not a group
                return None
            ended[0] += 1
            with timer("reward"):
                scores = [float(x) for x in score(items[i], samples)]
            if not judge_group(scores, report):
                return None
            g = Group(items[i], samples, scores, version)
            if len(kept) < quota:
                kept.append(g)
                if len(kept) == quota:  # no surplus wanted: everything ends now; else the running groups end
                    return STOP if not self.max_carry_steps else "finish"
            elif self.max_carry_steps > 0:
                carry.append(g)
                report.carried_out += 1
            else:
                report.surplus_dropped += 1
            return None

        drive(gen, group, lambda: timer("rollout"))
        return ended[0]
