"""Calls on worker threads, each with its own time limit: what reward functions and environments run through.

`num_workers` threads pull the next call from a shared counter (user code such as a math check, an HTTP request
or a tool in a subprocess mostly waits or releases the GIL), so one slow call does not serialise the others and a
cheap one costs microseconds (no task or future per call). A call that raises or runs past `timeout` (measured
from its own start) gives `on_failure(i, reason)` instead of its result; a timed-out call's thread cannot be
killed, so it is left to finish in the background (its result is dropped) and a fresh thread takes its place.
"""
from __future__ import annotations

import itertools
import threading
import time
from typing import Callable, Optional, Sequence


def run_calls(fn: Callable, units: Sequence, *, num_workers: int, timeout: Optional[float],
              on_failure: Callable[[int, str], object], name: str = "call",
              stopped: Callable[[], bool] = lambda: False) -> list:
    """[fn(unit) for unit in units], concurrently; a unit whose call raised or timed out gets
    on_failure(index, "Type: message" or "timed out after Ns"). `stopped`: idle workers take no more calls."""
    results: list = [None] * len(units)
    have = [False] * len(units)
    started: list = [None] * len(units)
    counter = itertools.count()
    done = threading.Condition()

    def call(i):
        try:
            return fn(units[i])
        except Exception as e:  # noqa: BLE001 - user code: a failure is this unit's, not the run's
            return on_failure(i, f"{type(e).__name__}: {e}")

    def worker():
        while not stopped():
            i = next(counter)  # atomic under the GIL: each unit is taken once
            if i >= len(units):
                return
            started[i] = time.monotonic()
            out = call(i)
            with done:
                if not have[i]:  # not already given up on (timed out)
                    results[i], have[i] = out, True
                done.notify()

    def spawn():
        threading.Thread(target=worker, name=name, daemon=True).start()

    for _ in range(min(max(1, num_workers), len(units))):
        spawn()
    with done:
        while not all(have):
            now = time.monotonic()
            running = [i for i in range(len(units)) if not have[i] and started[i] is not None]
            for i in running:
                if timeout and now - started[i] >= timeout:
                    results[i], have[i] = on_failure(i, f"timed out after {timeout}s"), True
                    spawn()  # its thread is stuck in the call: the rest get a fresh one
            waits = [started[i] + timeout - now for i in running if not have[i]] if timeout else []
            done.wait(timeout=max(min(waits), 0.001) if waits else (0.05 if timeout else None))
    return results
