"""Environment steps of many episodes at once, isolated from each other and from the run.

Every live episode's step of a turn runs through rlpo_mega.calls.run_calls (`num_workers` threads, a time limit
per step measured from its start). A step that raises, runs past `timeout` or answers something other than
`Feedback` ends its episode as failed (reward environment.failure_reward, the sample flagged as a failed reward
is): counted (episode/env_failures) and logged once per kind, never silent, never the run's end. What cannot
work at all (the python tool without a sandbox) is refused before the first step: `Environment.check` at start.
"""
from __future__ import annotations

import logging
import math
import threading
from typing import Callable, Optional, Sequence

from rlpo_mega.calls import run_calls

from .base import ENVIRONMENTS, Action, Environment, Feedback

log = logging.getLogger(__name__)


class EnvRunner:
    def __init__(self, cfg):
        """cfg: the run's EnvironmentConfig (cfg.name: an ENVIRONMENTS entry)."""
        self.cfg = cfg
        self.cls = ENVIRONMENTS.get(cfg.name)
        self.cls.check(cfg)  # at start, once: an environment that cannot run here stops the run in one line
        self.total_steps = 0
        self.total_failed = 0
        self._logged: set[str] = set()
        self._closed = False
        self._slots = threading.BoundedSemaphore(max(1, cfg.num_workers))  # submit(): steps running at once
        self._count = threading.Lock()

    def make(self, record) -> Environment:
        return self.cls(record, self.cfg)

    def _step(self, env: Environment, action: Action) -> Feedback:
        out = env.step(action)
        if not isinstance(out, Feedback):
            raise TypeError(f"step returned {type(out).__name__}, not Feedback")
        if isinstance(out.reward, bool) or not isinstance(out.reward, (int, float)) or not math.isfinite(out.reward):
            raise ValueError(f"step returned reward {out.reward!r}, not a finite number")
        if not out.done and not out.messages:
            raise ValueError("step returned no observation messages for an episode that goes on")
        return out

    def step(self, envs: Sequence[Environment], actions: Sequence[Action]) -> list[tuple[Optional[Feedback], str]]:
        """Each env's step on its action: (Feedback, "") or (None, why it failed)."""
        outs = run_calls(lambda i: (self._step(envs[i], actions[i]), ""), range(len(envs)),
                         num_workers=self.cfg.num_workers, timeout=self.cfg.timeout, name="environment",
                         on_failure=lambda i, why: (None, why), stopped=lambda: self._closed)
        failed = [why for fb, why in outs if fb is None]
        with self._count:  # submit()'s threads count here too
            self.total_steps += len(outs)
            self.total_failed += len(failed)
        for why in failed:
            kind = why.split(":", 1)[0]
            if kind not in self._logged:  # once per kind: a broken tool would flood the log
                self._logged.add(kind)
                log.warning("environment %r failed a step (the episode ends, reward %s, counted in "
                            "episode/env_failures): %s", self.cfg.name, self.cfg.failure_reward, why)
        return outs

    def submit(self, env: Environment, action: Action, done: Callable) -> None:
        """env's step on a thread of its own, at most num_workers at once (continuous turns); done((Feedback, "")
        or (None, why)) when it returns, failed or timed out as `step` says."""
        def run():
            with self._slots:
                out = self.step([env], [action])[0]
            done(out)

        threading.Thread(target=run, name="environment", daemon=True).start()

    def close(self) -> None:
        self._closed = True
