"""The rollout engine's failure types, at the bottom of the package: the engines raise them, and so do the
weight-sync transports below the rollout side (a server that fails mid-sync is an engine failure, handled as any
other: rlpo_mega/rollout/engines.py rebuilds the engine)."""


class EngineError(RuntimeError):
    """An engine failed (dead server, bad reply, timeout); the message names the engine and the fix."""


class RolloutInterrupted(EngineError):
    """The trainer asked to stop (SIGTERM) while a rollout waited: requests aborted, nothing returned."""
