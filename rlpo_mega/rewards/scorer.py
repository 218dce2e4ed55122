"""Batched reward scoring on worker threads, with failure isolation.

Reward calls run through rlpo_mega.calls.run_calls (`num_workers` threads, a time limit per call), so a slow
sample or reward server does not serialise the batch. A call that raises, runs past `timeout` (measured from
its start) or returns a non-number gives the configured default reward and a flag on that sample. Failures are
counted per batch and over the run, and logged once per kind.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from ..calls import run_calls
from .functions import REWARDS, RewardInput

log = logging.getLogger(__name__)


@dataclass
class RewardResult:
    rewards: list[float]
    failed: list[bool]  # reward is the configured default because the call failed
    errors: list[Optional[str]] = field(default_factory=list)  # per sample: why it failed, else None

    @property
    def num_failed(self) -> int:
        return sum(self.failed)

    def stats(self) -> dict:
        n = len(self.rewards)
        return {"reward/mean": sum(self.rewards) / n if n else 0.0, "reward/failed": self.num_failed,
                "reward/failed_frac": self.num_failed / n if n else 0.0}


class RewardScorer:
    def __init__(self, cfg, fn: Optional[Callable] = None):
        """cfg: a RewardConfig. fn: a reward function overriding cfg.function (tests, custom tasks)."""
        self.cfg = cfg
        self.fn = fn if fn is not None else REWARDS.get(cfg.function)
        self.batched = bool(getattr(self.fn, "batched", False))
        self.total_scored = 0
        self.total_failed = 0
        self._logged: set[str] = set()
        self._closed = False

    # --- one call (a sample, or a chunk for a batched function) -----------------------------------------
    def _call(self, args, n: int) -> tuple[list[float], Optional[str]]:
        try:
            out = self.fn(args, self.cfg)
            values = list(out) if self.batched else [out]
            if len(values) != n:
                raise ValueError(f"returned {len(values)} rewards for {n} samples")
            for v in values:
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                    raise ValueError(f"returned {v!r}, not a finite number")
            return [float(v) for v in values], None
        except Exception as e:  # noqa: BLE001 - any reward bug must not stop the run
            return [self.cfg.default] * n, f"{type(e).__name__}: {e}"

    def _run_all(self, units: list, sizes: list[int]) -> list[tuple[list[float], Optional[str]]]:
        """Every unit through _call on worker threads; a unit running past cfg.timeout gets the default."""
        return run_calls(lambda i: self._call(units[i], sizes[i]), range(len(units)),
                         num_workers=self.cfg.num_workers, timeout=self.cfg.timeout, name="reward",
                         on_failure=lambda i, why: ([self.cfg.default] * sizes[i], why),
                         stopped=lambda: self._closed)

    def score(self, samples: Sequence[RewardInput]) -> RewardResult:
        if self.batched:
            bs = max(1, self.cfg.remote.batch_size)
            units = [list(samples[i:i + bs]) for i in range(0, len(samples), bs)]
            sizes = [len(c) for c in units]
        else:
            units, sizes = list(samples), [1] * len(samples)
        outs = self._run_all(units, sizes) if units else []
        rewards, errors = [], []
        for (values, err), size in zip(outs, sizes):
            rewards += values
            errors += [err] * size
        result = RewardResult(rewards, [e is not None for e in errors], errors)
        self._account(result)
        return result

    def _account(self, result: RewardResult) -> None:
        self.total_scored += len(result.rewards)
        self.total_failed += result.num_failed
        for err in result.errors:
            kind = err.split(":", 1)[0] if err else None
            if kind and kind not in self._logged:  # once per kind: a dead server would flood the log
                self._logged.add(kind)
                log.warning("reward %r failed (reward set to %s, sample flagged; counted in reward/failed): %s",
                            self.cfg.function, self.cfg.default, err)
        if result.num_failed:
            log.info("reward: %d/%d samples failed this batch, %d/%d over the run", result.num_failed,
                     len(result.rewards), self.total_failed, self.total_scored)

    def close(self) -> None:
        self._closed = True  # idle workers stop taking calls; a stuck call's thread is a daemon

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
