"""Output directories that never cost a user their files.

A command that writes a directory (an HF export, a converted checkpoint, the disk transport's HF copy) only
ever replaces a directory it wrote itself: each such directory carries a marker file naming its kind, and
`check_target` refuses anything else that is not empty -- a directory of the user's own files, a trainer
checkpoint, a save_dir -- with one line naming the way out. Writes go to a fresh temporary sibling (a unique
name: never a user's `<out>.tmp`) renamed into place, so a failure leaves the old output as it was.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import uuid

MARKER = ".rlpo_mega_output"  # {"kind": ...} in every directory a command wrote as a whole
_STEP = re.compile(r"^step_\d{8}$")  # the trainer's checkpoint directories (rlpo_mega/checkpoint/run.py)


class OutputExistsError(FileExistsError):
    """The output directory holds something this command may not replace."""


def _kind(path: str) -> str | None:
    try:
        with open(os.path.join(path, MARKER)) as f:
            return json.load(f).get("kind")
    except (OSError, ValueError, AttributeError):
        return None


def _training_state(path: str) -> str | None:
    """Why `path` looks like a trainer checkpoint or a save_dir (None: it does not)."""
    names = set(os.listdir(path))
    if "latest" in names or any(_STEP.match(n) for n in names):
        return "a trainer save_dir (latest / step_<N>)"
    if "trainer_state.pt" in names:
        return "a trainer checkpoint (trainer_state.pt)"
    return None


def check_target(out: str, kind: str, overwrite: bool = False, flag: str = "--overwrite"):
    """Raise OutputExistsError unless `out` is absent, an empty directory, or (with `overwrite`) an earlier
    output of the same `kind` written by rlpo-mega. Call it before any work starts."""
    out = os.path.abspath(out)
    if not os.path.lexists(out):
        return
    if not os.path.isdir(out) or os.path.islink(out):
        raise OutputExistsError(f"{out} exists and is not a directory: choose a new output directory")
    if not os.listdir(out):
        return
    state = _training_state(out)
    if state is not None:
        raise OutputExistsError(f"{out} is {state}; it is never replaced: choose a new output directory")
    found = _kind(out)
    if found == kind:
        if overwrite:
            return
        raise OutputExistsError(f"{out} holds an earlier {kind} output: choose a new directory, or pass {flag} "
                                "to replace it")
    what = f"a {found} output" if found else "files rlpo-mega did not write"
    raise OutputExistsError(f"{out} is not empty ({what}): choose a new or empty output directory")


def temp_sibling(out: str) -> str:
    """A new, empty directory next to `out` (same filesystem, so the final rename is atomic)."""
    out = os.path.abspath(out)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-", dir=parent)


def marker_bytes(kind: str) -> bytes:
    """The MARKER file's content for an output of `kind` (for writers that place it with their other files)."""
    return json.dumps({"kind": kind}).encode()


def mark(path: str, kind: str):
    with open(os.path.join(path, MARKER), "wb") as f:
        f.write(marker_bytes(kind))


def swap_in(tmp: str, out: str):
    """Move the finished `tmp` to `out`; a previous `out` (checked by check_target) is set aside under a
    fresh name first and removed only after the rename."""
    out = os.path.abspath(out)
    old = None
    if os.path.isdir(out):
        if os.listdir(out):
            old = f"{out}.old-{uuid.uuid4().hex[:12]}"
            os.replace(out, old)
        else:
            os.rmdir(out)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


__all__ = ["MARKER", "OutputExistsError", "check_target", "mark", "marker_bytes", "swap_in", "temp_sibling"]
