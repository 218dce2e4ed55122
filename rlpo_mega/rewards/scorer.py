"""Async, batched reward scoring with failure isolation.

Reward calls run on a thread pool (math checks and HTTP requests release or spend little of the GIL
relative to their wait) driven by asyncio, so a slow sample or reward server does not serialise the
batch. A call that raises, times out or returns a non-number gives the configured default reward and a
flag on that sample; failures are counted per batch and over the run, and logged once per kind.
"""
from __future__ import annotations

import asyncio
import logging
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

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
        self._pool = ThreadPoolExecutor(max(1, cfg.num_workers), thread_name_prefix="reward")
        self.total_scored = 0
        self.total_failed = 0
        self._logged: set[str] = set()

    # --- one call (a sample, or a chunk for a batched function) -----------------------------------------
    async def _call(self, loop, args, n: int) -> tuple[list[float], Optional[str]]:
        try:
            fut = loop.run_in_executor(self._pool, self.fn, args, self.cfg)
            # On timeout the worker thread cannot be killed; it finishes in the background.
            out = await asyncio.wait_for(fut, self.cfg.timeout) if self.cfg.timeout else await fut
            values = list(out) if self.batched else [out]
            if len(values) != n:
                raise ValueError(f"returned {len(values)} rewards for {n} samples")
            for v in values:
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                    raise ValueError(f"returned {v!r}, not a finite number")
            return [float(v) for v in values], None
        except asyncio.TimeoutError:
            return [self.cfg.default] * n, f"timed out after {self.cfg.timeout}s"
        except Exception as e:  # noqa: BLE001 - any reward bug must not stop the run
            return [self.cfg.default] * n, f"{type(e).__name__}: {e}"

    async def ascore(self, samples: Sequence[RewardInput]) -> RewardResult:
        loop = asyncio.get_running_loop()
        if self.batched:
            bs = max(1, self.cfg.remote.batch_size)
            chunks = [list(samples[i:i + bs]) for i in range(0, len(samples), bs)]
            outs = await asyncio.gather(*(self._call(loop, c, len(c)) for c in chunks))
            sizes = [len(c) for c in chunks]
        else:
            outs = await asyncio.gather(*(self._call(loop, s, 1) for s in samples))
            sizes = [1] * len(samples)
        rewards, errors = [], []
        for (values, err), size in zip(outs, sizes):
            rewards += values
            errors += [err] * size
        result = RewardResult(rewards, [e is not None for e in errors], errors)
        self._account(result)
        return result

    def score(self, samples: Sequence[RewardInput]) -> RewardResult:
        """Synchronous entry point (from code that is not already inside an event loop)."""
        return asyncio.run(self.ascore(samples))

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
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
