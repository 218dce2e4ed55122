"""The trainer's garbage collection: Python's automatic collector off while a run lasts, one collection per step.

Why: the automatic collector runs a full collection (every tracked object of the process: torch's, the model's,
the data's) whenever enough containers have been made since the last. A rollout makes millions of them (the
JSON of each answer: one list per generated token for its log-prob), so on the rollout driver full
collections ran every few hundred answers and took 40% of its CPU (tools/bench_rollout_scale.py, --gc
automatic); and each rank pauses whenever its own counters say so, so a rank's pause stalls every collective
that waits for it. With `trainer.gc: per_step` every rank collects at the same point, after each step: the
young generations every step (what the step made and dropped), everything every `trainer.gc_full_every`
steps (cycles among what lived longer). torchtitan and Megatron-LM do the same for the same reasons.
"""
from __future__ import annotations

import gc
import time


class StepCollector:
    """`start()` turns the automatic collector off (after one full collection of what set-up left); `step(n)`
    collects after step n and returns its seconds; `close()` turns the automatic collector back on as it was.
    mode "automatic": Python's own collector, untouched (each call is a no-op)."""

    def __init__(self, mode: str = "per_step", full_every: int = 10):
        if mode not in ("per_step", "automatic"):
            raise ValueError(f"trainer.gc={mode!r}: expected per_step or automatic")
        if full_every < 1:
            raise ValueError(f"trainer.gc_full_every={full_every} must be >= 1")
        self.mode, self.full_every = mode, full_every
        self._was_enabled = None

    def start(self) -> None:
        if self.mode != "per_step" or self._was_enabled is not None:
            return
        self._was_enabled = gc.isenabled()
        gc.collect()
        gc.disable()

    def step(self, step: int) -> float:
        """Collect after step `step` (counted from 1): the young generations, or everything every full_every."""
        if self.mode != "per_step" or self._was_enabled is None:
            return 0.0
        t0 = time.perf_counter()
        gc.collect(2 if step % self.full_every == 0 else 1)
        return time.perf_counter() - t0

    def close(self) -> None:
        if self._was_enabled:
            gc.enable()
        self._was_enabled = None

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.close()
