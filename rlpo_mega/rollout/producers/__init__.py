"""Rollout producers (one registry, PRODUCERS): a schedule (sync, async) over a task (single answers, episodes)
through filters (dynamic sampling); producers/base.py says how they compose."""
from .base import PRODUCERS, RolloutProducer, Rollouts, ScoredGroups, mix_seed, share, trim_to_divisor
from .tasks import Episodes, SingleAnswers, Task, sampling_params, score
from .sync import SyncProducer  # registers PRODUCERS "sync"
from .asynchronous import AsyncProducer  # registers PRODUCERS "async"

__all__ = ["PRODUCERS", "RolloutProducer", "Rollouts", "ScoredGroups", "mix_seed", "share", "trim_to_divisor",
           "SyncProducer", "AsyncProducer", "Episodes", "SingleAnswers", "Task", "sampling_params", "score"]
