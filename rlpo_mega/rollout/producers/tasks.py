"""A producer's task: what one group of a step is -- a prompt's n single answers, scored by the reward function, or
its n multi-turn episodes (environment.name), scored by their environment as they run. Every schedule (sync,
async) and filter (dynamic sampling) goes through the same two calls: `stream` (a group's samples from an engine,
as they complete) and `score` (a completed group's rewards)."""
from __future__ import annotations

import abc
from typing import Optional

from rlpo_mega.environments import EnvRunner, environment_tools
from rlpo_mega.rewards import RewardInput
from rlpo_mega.rollout.base import Sample, SamplingParams
from rlpo_mega.rollout.episode import EpisodeBatch, EpisodeLimits, TurnFormat, run_episodes


def sampling_params(cfg, tokenizer, seed: int, greedy: bool = False) -> SamplingParams:
    r = cfg.rollout
    stop = tuple(r.stop_token_ids) if r.stop_token_ids is not None else (tokenizer.eos_token_id,)
    return SamplingParams(temperature=r.temperature, top_p=1.0 if greedy else r.top_p,
                          top_k=1 if greedy else r.top_k, max_new_tokens=r.max_new_tokens,
                          stop_token_ids=tuple(int(t) for t in stop if t is not None), seed=seed)


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


class Task(abc.ABC):
    """n samples per prompt item: their stream from an engine and a completed group's score."""

    @abc.abstractmethod
    def stream(self, engine, items, params: SamplingParams, n: int):
        """An engine stream (rollout/base.py) of (item index, its n samples) as each item's group completes."""

    @abc.abstractmethod
    def score(self, item, group: list[Sample], version: Optional[int] = None) -> list[float]:
        """The rewards of `item`'s completed group, written into its samples (with `version`: the policy version
        that sampled them, in meta.policy_version)."""


class SingleAnswers(Task):
    """n answers per prompt, one engine call each, scored by the run's reward function."""

    def __init__(self, scorer, tokenizer):
        self.scorer, self.tokenizer = scorer, tokenizer

    def stream(self, engine, items, params: SamplingParams, n: int):
        return engine.stream([it.input_ids for it in items], params, n=n)

    def score(self, item, group: list[Sample], version: Optional[int] = None) -> list[float]:
        return score([item] * len(group), group, self.scorer, self.tokenizer, version)


class Episodes(Task):
    """Multi-turn generation on an engine rank (environment.name set): n episodes per prompt item, each
    environment's steps on the runner's threads, observations in the tokenizer's turn format."""

    def __init__(self, cfg, tokenizer):
        e = cfg.environment
        self.runner = EnvRunner(e)
        self.fmt = TurnFormat(tokenizer, sampling_params(cfg, tokenizer, 0).stop_token_ids, environment_tools(e))
        self.limits = EpisodeLimits(e.max_turns, e.max_tokens)
        self.tokenizer = tokenizer
        self.continuous = e.turns == "continuous"

    def batch(self, items, n: int) -> EpisodeBatch:
        """n episodes per item, advanced call by call (the asynchronous producer)."""
        return EpisodeBatch([(it.input_ids, it.record) for it in items], n, self.runner, self.fmt, self.limits,
                            self.tokenizer, self.continuous)

    def stream(self, engine, items, params: SamplingParams, n: int):
        return run_episodes(engine, [(it.input_ids, it.record) for it in items], n, params, self.runner, self.fmt,
                            self.limits, self.tokenizer, self.continuous)

    def score(self, item, group: list[Sample], version: Optional[int] = None) -> list[float]:
        """An episode's reward is its environment's, already in the sample."""
        if version is not None:
            for s in group:
                s.meta.policy_version = version
        return [s.reward for s in group]
