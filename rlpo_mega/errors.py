"""Exit codes and the one-line report of a user error.

A user error (bad config, data file, checkpoint, model, layout, engine reply, routing payload, a full disk) is
one line naming the cause and the fix, printed once, exit code EXIT_USER_ERROR; no traceback unless
`--debug`. Under the `rlpo-mega` launcher, the workers write the line to a file the launcher names
(RLPO_ERROR_FILE; the first rank to fail claims it) and the launcher prints it after torchrun's workers are
gone; a worker started by plain torchrun or srun prints it on rank 0 (another rank only if it is still alive
a moment later, i.e. when the error was its own).

Exit codes (README "Exit codes"):
  0  the run finished
  1  a crash (a bug, or a failure with a traceback worth reading)
  2  a user error: the one line says what to change
  75 stopped by SIGTERM/SIGINT after saving a checkpoint: run the same command to resume (EX_TEMPFAIL)
"""
from __future__ import annotations

import os
import sys
import time
import traceback

from moe.bridge.digest import DigestMismatchError
from moe.bridge.hf_checkpoint import CheckpointFormatError
from moe.bridge.outputs import OutputExistsError
from moe.families import UnsupportedModelError
from moe.model import TransformerEngineError
from moe.routing.trace import RoutingTraceError
from rlpo_mega.checkpoint.dist import CheckpointError
from rlpo_mega.checkpoint.files import disk_full
from rlpo_mega.config import ConfigError
from rlpo_mega.data.dataset import DataError
from rlpo_mega.distributed import ParallelLayoutError
from rlpo_mega.planning.meta_build import MetaBuildError
from rlpo_mega.planning.plan import PlanError
from rlpo_mega.platform import PlatformError
from rlpo_mega.rollout.base import EngineError

EXIT_USER_ERROR = 2
EXIT_STOPPED = 75
ERROR_FILE_ENV = "RLPO_ERROR_FILE"
_OTHER_RANKS_WAIT_S = 3.0


def user_error_types() -> tuple[type, ...]:
    return (ConfigError, CheckpointError, DataError, ParallelLayoutError, UnsupportedModelError,
            CheckpointFormatError, OutputExistsError, RoutingTraceError, EngineError, PlatformError,
            DigestMismatchError, PlanError, MetaBuildError, TransformerEngineError, FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)


def is_user_error(e: BaseException) -> bool:
    return isinstance(e, user_error_types()) or disk_full(e) is not None


def message(e: BaseException) -> str:
    full = disk_full(e)
    if full is not None and not isinstance(e, user_error_types()):
        where = f" writing {full.filename}" if full.filename else ""
        return f"no space left on device{where}: free space or write elsewhere ({e.__class__.__name__})"
    text = str(e).strip().splitlines()[0] if str(e).strip() else e.__class__.__name__
    return f"config error: {text}" if isinstance(e, ConfigError) else text


def report(command: str, e: BaseException, debug: bool = False) -> int:
    """Print (or hand to the launcher) the one line for e; returns EXIT_USER_ERROR."""
    line = f"rlpo-mega {command}: {message(e)}"
    claim = os.environ.get(ERROR_FILE_ENV)
    if debug:
        traceback.print_exc()
    if claim:
        try:  # the first rank to fail claims the file; the launcher prints it once
            fd = os.open(claim, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(line + "\n")
        except FileExistsError:
            pass
    else:
        # plain torchrun / srun: rank 0 says it. Another rank waits a moment first: when every rank hit the
        # error, rank 0's exit makes the launcher stop the others before they repeat it; when only this rank
        # did (rank 0 waits in a collective), the line still appears, once.
        if int(os.environ.get("RANK", "0")) != 0:
            time.sleep(_OTHER_RANKS_WAIT_S)
        print(line, file=sys.stderr, flush=True)
    return EXIT_USER_ERROR
