"""Processes that die with their parent, and helpers that die with the rank that started them.

torchrun starts each worker in its own session and never tells a worker that the agent died (a SIGKILLed
torchrun leaves its workers training), and an SGLang server started by the trainer outlived a trainer that
crashed. Linux's PR_SET_PDEATHSIG sends a signal to a process when the thread that forked it exits; elsewhere
these are no-ops (the framework's clusters are Linux).
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send `sig` to this process when its parent exits; exit at once if the parent is
    already gone (the race between fork and this call). Call it first thing in a child."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if parent == 1 or os.getppid() != parent:
        os._exit(1)


def preexec_die_with_parent(sig: int = signal.SIGTERM):
    """A Popen preexec_fn: the child gets `sig` when the thread that started it exits (SIGTERM lets a server
    stop its own children)."""
    def fn():
        if sys.platform.startswith("linux"):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    return fn


def in_process_checkpoint_queue() -> None:
    """megatron-core's synchronous dist-checkpoint save creates a spawn-context multiprocessing Manager (a
    ~270 MB child process and a resource_tracker, never shut down) only to pass write results between
    functions that, in a synchronous save, all run in this process
    (dist_checkpointing/strategies/filesystem_async.py, _get_write_results_queue). A SIGKILLed rank left both
    behind. An in-process queue does the same job with no process; asynchronous saves (not used here) would
    need the Manager."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", None) is None:
        import queue

        filesystem_async._results_queue = queue.Queue()
