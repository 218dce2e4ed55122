"""The environment interface of multi-turn episodes, and its registry.

An episode starts from a prompt record (the prompt is rendered as for a single-turn sample). After each of the
model's turns its environment receives the turn (the token ids exactly as sampled, and their text for parsing)
and answers with `Feedback`: the observation as chat messages (a tool's output, a user's reply), which the
episode appends in the chat template's turn format (rollout/episode.py); a reward contribution; and whether the
episode is over. An episode's reward is the sum of its contributions. One instance per episode, so an
environment may keep state across turns; its steps run on worker threads (environments/runner.py), so `step`
must not touch state shared with other episodes without a lock.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Optional

from rlpo_mega.algorithms.registry import Registry

ENVIRONMENTS = Registry("environment")


@dataclass(frozen=True)
class Action:
    """The model's turn: its tokens as sampled (the closing end-of-turn token included) and their decoded text
    (special tokens skipped), for parsing only: nothing is ever re-tokenised from it."""
    token_ids: tuple[int, ...]
    text: str
    turn: int  # 0-based


@dataclass
class Feedback:
    messages: list[dict] = field(default_factory=list)  # the observation: chat messages ({"role", "content"})
    reward: float = 0.0  # this turn's contribution to the episode's reward
    done: bool = False  # the episode is over (no observation is appended then)
    tool_calls: int = 0  # tool calls the turn made (counted: episode/tool_calls)
    tool_errors: int = 0  # of them, the ones whose tool failed (bad call, error, its time or memory limit)
    useful_tool_calls: int = 0  # tool calls whose output the episode's solution used (the environment judges)
    correct: bool = False  # the episode solved its task (on the last turn: reward/accuracy)


class Environment(abc.ABC):
    """One episode's environment: built as cls(record, cfg) with the prompt record (its reference and metadata
    hold the task) and the run's EnvironmentConfig (`options`: the environment's own settings)."""

    def __init__(self, record, cfg):
        self.record, self.cfg = record, cfg

    @classmethod
    def tools(cls, cfg) -> Optional[list[dict]]:
        """The tool schemas (function-calling JSON, as transformers' `tools=`) the chat template renders into
        every prompt of the run, the same for all episodes; None: no tools are declared."""
        return None

    @classmethod
    def check(cls, cfg) -> None:
        """Called once at start (EnvRunner): raise (a one-line user error) when this environment cannot run here
        with these options, so that the run refuses to start rather than fail every step."""

    @abc.abstractmethod
    def step(self, action: Action) -> Feedback:
        """The environment's answer to the model's turn."""

    def close(self) -> None:
        """The episode is over (called once, also after a failed or timed-out step): free what it holds."""


def environment_tools(env_cfg) -> Optional[list[dict]]:
    """The run's tool schemas (`Environment.tools`): what every prompt render of the run passes as `tools=`."""
    return ENVIRONMENTS.get(env_cfg.name).tools(env_cfg) if env_cfg.name else None
