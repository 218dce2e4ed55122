"""Trainer state around the megatron checkpoint: step directories, keep-last-K, RNG states, SIGTERM.

Layout under checkpoint.save_dir:
  step_00000012/        a megatron dist checkpoint (rlpo_mega.checkpoint: written to .tmp, swapped in)
    trainer_state.pt    step, prompt cursor, counters and every rank's RNG states (inside the swap)
  latest                the name of the newest complete step directory (replaced atomically)

A crash mid-save leaves `step_<N>.tmp` (ignored and cleaned) and the previous `latest` untouched.
"""
from __future__ import annotations

import io
import logging
import os
import random
import re
import shutil
import signal

import numpy as np
import torch
import torch.distributed as dist

from rlpo_mega.checkpoint import CheckpointError, load_checkpoint, read_meta, save_checkpoint

log = logging.getLogger("rlpo_mega")

STATE_FILE = "trainer_state.pt"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


def step_dir(save_dir: str, step: int) -> str:
    return os.path.join(save_dir, f"step_{step:08d}")


def complete_steps(save_dir: str) -> list[int]:
    """Steps with a finished checkpoint (meta file present), oldest first."""
    if not os.path.isdir(save_dir):
        return []
    out = []
    for name in os.listdir(save_dir):
        m = _STEP_DIR.match(name)
        if m and os.path.isfile(os.path.join(save_dir, name, STATE_FILE)):
            out.append(int(m.group(1)))
    return sorted(out)


def latest_checkpoint(save_dir: str):
    """The directory `latest` names (falling back to the newest complete step directory), or None."""
    pointer = os.path.join(save_dir, LATEST)
    if os.path.isfile(pointer):
        with open(pointer) as f:
            path = os.path.join(save_dir, f.read().strip())
        if os.path.isdir(path):
            return path
    steps = complete_steps(save_dir)
    return step_dir(save_dir, steps[-1]) if steps else None


def resolve_load_dir(path: str) -> str:
    """A step directory as given, or a save_dir: its latest checkpoint."""
    if os.path.isfile(os.path.join(path, STATE_FILE)) or not os.path.isdir(path):
        return path
    found = latest_checkpoint(path)
    if found is None:
        raise CheckpointError(f"checkpoint.load_dir={path!r} holds no trainer checkpoint (no {STATE_FILE}, no "
                              "step_<N>/ directories): point it at a step_<N> directory written by the trainer")
    return found


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    from megatron.core import tensor_parallel

    state["megatron"] = tensor_parallel.get_cuda_rng_tracker().get_states()  # seeded by distributed.init
    return state


def set_rng_state(state: dict):
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    from megatron.core import tensor_parallel

    tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron"])


def save(save_dir: str, step: int, chunks, optimizer, trainer_state: dict, keep_last: int, meta: dict,
         hf_files: dict[str, bytes] | None = None, reference=None) -> str:
    """Collective. Writes step_<step>/ with the trainer state (and hf_files: config/tokenizer files under
    hf_files/, so `rlpo-mega export --ckpt` works on it), points `latest` at it, prunes old ones."""
    from rlpo_mega.convert import HF_FILES

    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, rng_state())
    files = None
    if dist.get_rank() == 0:
        buf = io.BytesIO()
        torch.save({**trainer_state, "rng": every, "world_size": dist.get_world_size()}, buf)
        files = {STATE_FILE: buf.getvalue(), **{f"{HF_FILES}/{k}": v for k, v in (hf_files or {}).items()}}
        os.makedirs(save_dir, exist_ok=True)
    path = step_dir(save_dir, step)
    save_checkpoint(path, chunks, optimizer, meta={**meta, "step": step}, files=files, reference_chunks=reference)
    if dist.get_rank() == 0:
        tmp = os.path.join(save_dir, LATEST + ".tmp")
        with open(tmp, "w") as f:
            f.write(os.path.basename(path))
        os.replace(tmp, os.path.join(save_dir, LATEST))
        for old in complete_steps(save_dir)[:-keep_last]:
            shutil.rmtree(step_dir(save_dir, old), ignore_errors=True)
        for name in os.listdir(save_dir):  # leftovers of interrupted saves
            if name.endswith(".tmp") and _STEP_DIR.match(name[:-4]) and name[:-4] != os.path.basename(path):
                shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
    dist.barrier()
    return path


def load(path: str, chunks, optimizer, with_optimizer: bool = True, reference=None) -> dict:
    """Load weights (+ optimizer, + the KL reference into `reference` if saved) at the current layout and
    return the trainer state, with "reference_loaded"; this rank's RNG states are restored when the world
    size is unchanged (another layout draws its own)."""
    read_meta(path)  # clear error for an unfinished or missing checkpoint
    file = os.path.join(path, STATE_FILE)
    if not os.path.isfile(file):
        raise CheckpointError(f"{path!r} is a model checkpoint without trainer state ({STATE_FILE}): set "
                              "checkpoint.load_optimizer=false and trainer state starts fresh, or point "
                              "checkpoint.load_dir at a step_<N> directory the trainer wrote")
    meta = load_checkpoint(path, chunks, optimizer if with_optimizer else None, reference)
    state = torch.load(file, weights_only=False)
    state["reference_loaded"] = reference is not None and bool(meta.get("has_reference"))
    if state["world_size"] == dist.get_world_size():
        set_rng_state(state["rng"][dist.get_rank()])
    else:
        log.warning("resuming %d ranks from a %d-rank checkpoint: RNG states start fresh", dist.get_world_size(),
                    state["world_size"])
    return state


class StopSignal:
    """SIGTERM/SIGINT set a flag (idempotent: SLURM and torchrun may signal twice); the trainer polls it at
    step boundaries, all ranks agree through one all_reduce, then save and exit together."""

    def __init__(self):
        self.received = None
        self._previous = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: the caller's handlers stay, say so
                log.warning("trainer not on the main thread: %s will not save a checkpoint before exiting",
                            signal.Signals(sig).name)

    def _handle(self, signum, frame):
        if self.received is None:
            log.warning("received %s: saving a checkpoint at the end of this step, then exiting",
                        signal.Signals(signum).name)
        self.received = signum

    def any_rank(self, device) -> bool:
        flag = torch.tensor([1.0 if self.received is not None else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self):
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)
