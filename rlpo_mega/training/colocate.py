"""rollout.colocate: the engine on the learner's own accelerators, the memory handed over in one order.

One owner (`HandOver`) for the order of every step, as SGLang 0.5.23 and slime lay it out (../shared/notes/
colocated.md): the learner holds its weights, gradients and optimizer state through the old log-probs, the update
and the sync; for generation they leave the accelerator (the gradients dropped: the update zeroes them first), the
engine takes its memory back (the weights before the KV cache), generates, and releases it; the learner's state
returns. The sync runs with the learner resident and the engine's weights resumed, so the two weight copies are
resident together only there (and at a save after it), never the learner's training state and the engine's KV cache.

Every transition is agreed by all ranks on the control group (gloo, rollout.wait_timeout) before the other side
moves in: a GPU hosts one learner rank and a server's TP rank, and the driver that asks the servers to take memory
back is one rank of eight. So: every rank offloaded -> the servers resume; the servers released -> any rank onloads;
on the error and stop paths the servers are released (best effort) before any rank onloads.

Servers the run launches size their KV pool from the memory free when they start (SGLang's
`pre_model_load_memory`, sglang/srt/distributed/bootstrap.py:193-223 and mem_cache/kv_cache_configurator.py:
2990-3007), so they start with the learner off its GPUs (`before_launch`, also on a rebuild's relaunch): every GPU
of a server then frees the same memory, and the learner returns only once they are released (`learner_in`, before
the supervised warm-up and the first sync).

A sync that a failed rollout's rebuild asks for in the middle of generation finds the learner offloaded: its state
comes back for the sync and leaves again after it, and the engine's KV cache is resumed as generation left it
(`weights_out`). An engine that fails to release or resume raises EngineError, and the engine guard handles it as
any failed engine (rebuilt, re-synced). Without rollout.colocate every method is a pass-through.
"""
from __future__ import annotations

import contextlib
import logging
import time

from rlpo_mega.residency import Residency
from rlpo_mega.rollout.base import EngineError
from rlpo_mega.rollout.engines import _FAILED, _OK, StopRequested, agree

log = logging.getLogger("rlpo_mega")


class HandOver:
    """group: the control group (gloo, long timeout) every transition is agreed on. slot and guard are the engines'
    (`attach`, once they are built: the launch they make calls `before_launch` first)."""

    def __init__(self, enabled: bool, learner: Residency, group, slot=None, guard=None):
        self.enabled, self.learner, self.group, self.slot, self.guard = enabled, learner, group, slot, guard
        # "engine" while the engine generates (the learner off its GPUs): what a re-sync in the middle restores
        self.phase = "learner"
        self.stats = {"colocate/offload_s": 0.0, "colocate/onload_s": 0.0, "colocate/learner_offloaded_bytes": 0}

    def attach(self, slot, guard) -> None:
        self.slot, self.guard = slot, guard

    # --- agreed steps ------------------------------------------------------------------------------------------
    def _together(self, fn, what: str, error=RuntimeError):
        """fn() on this rank, then agreed on the control group: once it returns on any rank, it has returned on
        every rank. A failure on one rank raises on all (its own error there, `error` elsewhere)."""
        err = None
        try:
            out = fn()
        except Exception as e:  # agreed below, then raised: no rank is left waiting in the agreement
            err, out = e, None
        worst, _ = agree(_OK if err is None else _FAILED, self.group)
        if worst == _OK:
            return out
        err = err if err is not None else error(f"rollout.colocate: {what} failed on another rank")
        err.agreed = True  # raised on every rank
        raise err

    def _offload(self) -> int:
        return self._together(lambda: self._timed("colocate/offload_s", self.learner.offload),
                              "the learner's offload")

    def _on_engine(self, fn, what: str):
        """fn(engine) on the ranks with one, agreed (not under the guard: its caller is, or handles the error)."""
        self._together(lambda: fn(self.slot.engine) if self.slot.engine is not None else None, what, EngineError)

    def _engine_call(self, fn):
        """fn(engine) on the ranks with one, under the engine guard (collective: every rank calls it): a failure to
        release or resume is a failed engine, rebuilt and re-synced, and the call retried on the new one. The
        guard agrees after fn, so when it returns the call is done on every rank."""
        self.guard.run(lambda: fn(self.slot.engine) if self.slot.engine is not None else None)

    def _timed(self, key: str, fn):
        t0 = time.perf_counter()
        out = fn()
        self.stats[key] += time.perf_counter() - t0
        return out

    def _release_quietly(self, error: BaseException) -> None:
        """The error and stop paths: the servers give their memory up (best effort: a dead or stopping server
        cannot) before any rank's state returns; agreed when the error is one every rank raises (the guard's)."""
        engine = self.slot.engine if self.slot is not None else None
        if engine is not None:
            try:
                engine.release_memory()
            except Exception as e:
                log.warning("rollout.colocate: releasing the engine's memory before the learner returns: %s", e)
        if isinstance(error, StopRequested) or getattr(error, "agreed", False):
            agree(_OK, self.group)

    # --- the transitions ---------------------------------------------------------------------------------------
    def before_launch(self) -> None:
        """Called by every rank before colocated servers are launched (EngineSlot.build: the run's start and a
        rebuild's relaunch): the learner's state off every GPU first, agreed, so each server's GPUs free the same
        memory and its KV pool is sized for the memory it will have while generating."""
        if self.enabled:
            self._offload()

    def learner_in(self) -> None:
        """The learner's state back after a launch (before the supervised warm-up and the first sync): the servers
        released first (all of them, agreed), then every rank onloads."""
        if not self.enabled or not self.learner.offloaded:
            return
        self._engine_call(lambda e: e.release_memory())
        self._timed("colocate/onload_s", self.learner.onload)

    @contextlib.contextmanager
    def generation(self):
        """Around a rollout (and an evaluation): learner out (every rank, agreed), engine in; engine out (agreed),
        learner in. When the rollout ends in an error (a stop, no restarts left) the engine is released (best
        effort) before the learner's state returns: the run saves and ends."""
        if not self.enabled:
            yield
            return
        try:
            self.stats["colocate/learner_offloaded_bytes"] = self._offload()
            self.phase = "engine"
            # the weights are normally held since the sync; the KV cache (and CUDA graphs) after them
            self._engine_call(lambda e: (e.resume_memory("weights"), e.resume_memory("kv_cache")))
            yield
            self.phase = "learner"
            self._engine_call(lambda e: e.release_memory())
        except BaseException as e:
            self._release_quietly(e)
            raise
        finally:
            self.phase = "learner"
            self._timed("colocate/onload_s", self.learner.onload)

    @contextlib.contextmanager
    def weights_out(self):
        """Around a weight sync (always under the engine guard): the engine holding its weights alone, the learner's
        weights resident (brought back for the sync alone when a rebuild's re-sync comes in the middle of
        generation, or after a relaunch): the peak is the learner's state and the engine's weights, as at every
        sync. In the middle of generation the state it found is restored after it: the learner off (agreed),
        then the engine's KV cache resumed."""
        if not self.enabled:
            yield
            return
        # release first (nothing when already released): a fresh engine (the run's first sync, a rebuild's
        # re-sync) holds its KV cache too, which must not be resident with the learner's state. Agreed: no rank
        # onloads before every server has released.
        self._on_engine(lambda e: (e.release_memory(), e.resume_memory("weights")), "releasing the servers")
        if self.learner.offloaded:
            self._timed("colocate/onload_s", self.learner.onload)
        yield
        if self.phase == "engine":  # a re-sync inside generation: back to generating (only once the sync is done)
            self._offload()
            self._on_engine(lambda e: e.resume_memory("kv_cache"), "resuming the servers")

    def metrics(self) -> dict:
        out, self.stats = dict(self.stats), {k: type(v)() for k, v in self.stats.items()}
        return out if self.enabled else {}
