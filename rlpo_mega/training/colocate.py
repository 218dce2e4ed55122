"""rollout.colocate: the engine on the learner's own accelerators, the memory handed over in one order.

One owner (`HandOver`) for the order of every step, as SGLang 0.5.23 and slime lay it out (../shared/notes/
colocated.md): the learner holds its weights, gradients and optimizer state through the old log-probs, the update
and the sync; for generation they leave the accelerator (the gradients dropped: the update zeroes them first), the
engine takes its memory back (the weights before the KV cache), generates, and releases it; the learner's state
returns. The sync runs with the learner resident and the engine's weights resumed, so the two weight copies are
resident together only there (and at a save after it), never the learner's training state and the engine's KV cache.

A sync that a failed rollout's rebuild asks for in the middle of generation finds the learner offloaded: its state
comes back for the sync and leaves again after it (`weights_out`). An engine that fails to release or resume raises
EngineError, and the engine guard handles it as any failed engine (rebuilt, re-synced). Without rollout.colocate
every method is a pass-through.
"""
from __future__ import annotations

import contextlib
import time

from rlpo_mega.residency import Residency


class HandOver:
    def __init__(self, enabled: bool, learner: Residency, slot, guard):
        self.enabled, self.learner, self.slot, self.guard = enabled, learner, slot, guard
        self.stats = {"colocate/offload_s": 0.0, "colocate/onload_s": 0.0, "colocate/learner_offloaded_bytes": 0}

    def _engine_call(self, fn):
        """fn(engine) on the ranks with one, under the engine guard (collective: every rank calls it): a failure to
        release or resume is a failed engine, rebuilt and re-synced, and the call retried on the new one."""
        self.guard.run(lambda: fn(self.slot.engine) if self.slot.engine is not None else None)

    def _timed(self, key: str, fn):
        t0 = time.perf_counter()
        out = fn()
        self.stats[key] += time.perf_counter() - t0
        return out

    @contextlib.contextmanager
    def generation(self):
        """Around a rollout (and an evaluation): learner out, engine in; engine out, learner in. When the rollout
        ends in an error (a stop, no restarts left) only the learner's state returns: the run saves and ends."""
        if not self.enabled:
            yield
            return
        self.stats["colocate/learner_offloaded_bytes"] = self._timed("colocate/offload_s", self.learner.offload)
        try:
            # the weights are normally held since the sync; the KV cache (and CUDA graphs) after them
            self._engine_call(lambda e: (e.resume_memory("weights"), e.resume_memory("kv_cache")))
            yield
            self._engine_call(lambda e: e.release_memory())
        finally:
            self._timed("colocate/onload_s", self.learner.onload)

    @contextlib.contextmanager
    def weights_out(self):
        """Around a weight sync (always under the engine guard): the engine holding its weights alone, the learner's
        weights resident (brought back for the sync alone when a rebuild's re-sync comes in the middle of
        generation): the peak is the learner's state and the engine's weights, as at every sync."""
        if not self.enabled:
            yield
            return
        engine = self.slot.engine
        if engine is not None:
            # release first (nothing when already released): a fresh engine (the run's first sync, a rebuild's
            # re-sync) holds its KV cache too, which must not be resident with the learner's state
            engine.release_memory()
            engine.resume_memory("weights")
        away = self.learner.offloaded
        if away:
            self.learner.onload()
        try:
            yield
        finally:
            if away:
                self.learner.offload()

    def metrics(self) -> dict:
        out, self.stats = dict(self.stats), {k: type(v)() for k, v in self.stats.items()}
        return out if self.enabled else {}
