"""Trainer state around the megatron checkpoint: step directories, keep-last-K, RNG states, SIGTERM.

Layout under checkpoint.save_dir:
  step_00000012/        a megatron dist checkpoint (rlpo_mega.checkpoint: written to .tmp, swapped in)
    trainer_state.pt    step, prompt cursor, counters and every rank's RNG states (inside the swap)
    rank_state/rank_<r>.pt  a rank's own state when it has any: the rollout producer's (groups carried to the
                        next step, prompts drawn and not yet sent), restored when the world size is the same
  latest                the name of the newest complete step directory (replaced atomically)

A crash mid-save leaves `step_<N>.tmp` (ignored and cleaned) and the previous `latest` untouched.

Each run has an id (rlpo_meta.json "run_id", kept across resumes). A save_dir belongs to one run's timeline:
plan_checkpoints refuses a start that would mix in another run's steps (checkpoint.overwrite replaces them
after the first save), and prune deletes only the run's own older steps, never the step just written.
"""
from __future__ import annotations

import io
import logging
import os
import random
import re
import shutil
import signal
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from rlpo_mega.checkpoint.dist import CheckpointError, load_checkpoint, read_meta, save_checkpoint
from rlpo_mega.checkpoint.files import HF_FILES, identity_difference

log = logging.getLogger("rlpo_mega")

STATE_FILE = "trainer_state.pt"
LEGACY_RUN = "legacy"
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
    """The directory `latest` names, or (no `latest`) the newest complete step directory, or None. A
    `latest` naming a step that is not there is an error, not a fallback to another step or a fresh start."""
    pointer = os.path.join(save_dir, LATEST)
    if os.path.isfile(pointer):
        with open(pointer) as f:
            name = f.read().strip()
        path = os.path.join(save_dir, name)
        if not os.path.isfile(os.path.join(path, STATE_FILE)):
            have = ", ".join(f"step_{s:08d}" for s in complete_steps(save_dir)) or "none"
            raise CheckpointError(f"{pointer} names {name!r}, which is not a complete checkpoint (complete ones "
                                  f"here: {have}): set checkpoint.load_dir to the step to resume from")
        return path
    steps = complete_steps(save_dir)
    return step_dir(save_dir, steps[-1]) if steps else None


def run_id_of(path: str) -> str:
    """The run a checkpoint belongs to (checkpoints written before run ids: "legacy")."""
    return str(read_meta(path).get("run_id", LEGACY_RUN))


@dataclass
class SavePlan:
    """Where a run starts and which checkpoints in its save_dir are not its own."""
    start: str | None  # the checkpoint to resume from (None: a fresh run)
    step: int  # its step (0: fresh)
    run_id: str | None  # its run (None: fresh, a new id is drawn)
    stale: list[int] = field(default_factory=list)  # save_dir steps removed after the first save (overwrite)


def plan_checkpoints(c, identity: dict | None = None) -> SavePlan:
    """checkpoint config -> SavePlan, before anything is built (pure filesystem; every rank, and the launcher,
    get the same answer). A save_dir holding steps of another run, or steps past the one resumed from (another
    timeline), is refused unless checkpoint.overwrite: the keep_last pruning and `latest` would mix the two.
    identity: the configured model's (MoEFamily.identity); a checkpoint written for another model is refused."""
    start = None
    if c.load_dir:
        start = resolve_load_dir(c.load_dir)
    elif c.resume and c.save_dir:
        start = latest_checkpoint(c.save_dir)
    step, run_id = 0, None
    if start is not None:
        meta = read_meta(start)
        step, run_id = int(meta.get("step", 0)), str(meta.get("run_id", LEGACY_RUN))
        differs = identity and identity_difference(meta.get("model"), meta.get("model_type"), identity)
        if differs:
            raise CheckpointError(
                f"{start} was written for another model: {differs}. Point model.hf_config at the checkpoint's "
                f"model (its config.json: {os.path.join(start, 'hf', 'config.json')}), or start a new run "
                "(checkpoint.resume=false and a new checkpoint.save_dir)")
    stale = []
    if c.save_dir:
        for s in complete_steps(c.save_dir):
            if start is None or s > step or run_id_of(step_dir(c.save_dir, s)) != run_id:
                stale.append(s)
    if stale and not c.overwrite:
        names = ", ".join(f"step_{s:08d}" for s in stale[:3]) + (f" and {len(stale) - 3} more" if len(stale) > 3 else "")
        why = ("this run starts fresh" if start is None else
               f"this run continues {start} (step {step})")
        raise CheckpointError(
            f"checkpoint.save_dir={c.save_dir} holds checkpoints of another run ({names}) and {why}: resume that "
            "run (checkpoint.resume=true, no load_dir), choose a new checkpoint.save_dir, or replace them "
            "(checkpoint.overwrite=true: they are deleted after this run's first save)")
    return SavePlan(start, step, run_id, stale)


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


def prune(save_dir: str, step: int, run_id: str, keep_last: int, stale=()) -> list[int]:
    """After step `step` was saved: delete the `stale` steps and this run's older steps beyond keep_last (the
    newest keep_last of the run, `step` included, stay). Never `step`, never another run's. Returns what went."""
    older = [s for s in complete_steps(save_dir) if s < step and s not in stale
             and run_id_of(step_dir(save_dir, s)) == run_id]
    gone = [s for s in list(stale) + older[:max(len(older) - (keep_last - 1), 0)] if s != step]
    for s in gone:
        shutil.rmtree(step_dir(save_dir, s), ignore_errors=True)
    return gone


def rank_state_file(rank: int) -> str:
    return f"rank_state/rank_{rank:05d}.pt"


def save(save_dir: str, step: int, chunks, optimizer, trainer_state: dict, keep_last: int, meta: dict,
         hf_files: dict[str, bytes] | None = None, reference=None, stale: tuple = (), critic=None,
         checksums: bool = True, rank_state: dict | None = None, adapters_only: bool = False,
         critic_adapters_only: bool = False) -> str:
    """Collective. Writes step_<step>/ with the trainer state (and hf_files: config/tokenizer files under
    hf_files/, so `rlpo-mega export --ckpt` works on it), points `latest` at it, then prunes: this run's
    (meta["run_id"]) older steps beyond keep_last -- never the step just written, never another run's -- and
    the `stale` steps the run was told to replace (checkpoint.overwrite). Every file's checksum is taken as it is
    written (no read back); checksums=False records the sizes only (rlpo_mega.checkpoint.dist.save_checkpoint).
    rank_state: this rank's own state (none when empty), loaded back by `load` on the same rank."""

    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, rng_state())
    files = None
    if dist.get_rank() == 0:
        buf = io.BytesIO()
        torch.save({**trainer_state, "rng": every, "world_size": dist.get_world_size()}, buf)
        files = {STATE_FILE: buf.getvalue(), **{f"{HF_FILES}/{k}": v for k, v in (hf_files or {}).items()}}
        os.makedirs(save_dir, exist_ok=True)
    path = step_dir(save_dir, step)
    mine = None
    if rank_state:
        buf = io.BytesIO()
        torch.save(rank_state, buf)
        mine = {rank_state_file(dist.get_rank()): buf.getvalue()}
    save_checkpoint(path, chunks, optimizer, meta={**meta, "step": step}, files=files, reference_chunks=reference,
                    critic=critic, checksums=checksums, rank_files=mine, adapters_only=adapters_only,
                    critic_adapters_only=critic_adapters_only)
    problem = [None]
    if dist.get_rank() == 0:
        tmp = os.path.join(save_dir, LATEST + ".tmp")
        try:
            with open(tmp, "w") as f:
                f.write(os.path.basename(path))
            os.replace(tmp, os.path.join(save_dir, LATEST))
        except OSError as e:  # a full disk: `latest` still names the previous step, which is intact
            if os.path.exists(tmp):
                os.remove(tmp)
            # the step just written goes too, so the save_dir is as it was -- unless `latest` names it (a save of
            # the step the run resumed from replaced that very directory: it is the only copy left)
            pointer = os.path.join(save_dir, LATEST)
            named = None
            if os.path.isfile(pointer):
                with open(pointer) as f:
                    named = f.read().strip()
            if named != os.path.basename(path):
                shutil.rmtree(path, ignore_errors=True)
            problem[0] = (f"could not point {os.path.join(save_dir, LATEST)} at {path} ({e.strerror or e}); "
                          "it still names the previous checkpoint: free space, then resume or set checkpoint.load_dir")
        if problem[0] is None:
            prune(save_dir, step, str(meta.get("run_id", LEGACY_RUN)), keep_last, stale)
            for name in os.listdir(save_dir):  # leftovers of interrupted saves
                if name.endswith(".tmp") and _STEP_DIR.match(name[:-4]) and name[:-4] != os.path.basename(path):
                    shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
    dist.broadcast_object_list(problem, src=0)
    if problem[0] is not None:
        raise CheckpointError(problem[0])
    return path


def load(path: str, chunks, optimizer, with_optimizer: bool = True, reference=None, verify: bool = True,
         critic=None) -> dict:
    """Load weights (+ optimizer, + the KL reference into `reference` if saved) at the current layout and
    return the trainer state, with "reference_loaded"; this rank's RNG states are restored when the world
    size is unchanged (another layout draws its own)."""
    read_meta(path)  # clear error for an unfinished or missing checkpoint
    file = os.path.join(path, STATE_FILE)
    if not os.path.isfile(file):
        raise CheckpointError(f"{path!r} is a model checkpoint without trainer state ({STATE_FILE}): set "
                              "checkpoint.load_optimizer=false and trainer state starts fresh, or point "
                              "checkpoint.load_dir at a step_<N> directory the trainer wrote")
    meta = load_checkpoint(path, chunks, optimizer if with_optimizer else None, reference, verify=verify, critic=critic)
    try:  # covered by the checksums unless checkpoint.verify=false or a checkpoint older than them
        state = torch.load(file, weights_only=False)
    except Exception as e:
        raise CheckpointError(f"{file} is unreadable ({type(e).__name__}: {e}): the checkpoint is damaged; load an "
                              "earlier step (checkpoint.load_dir)") from None
    state["reference_loaded"] = reference is not None and bool(meta.get("has_reference"))
    state["critic_loaded"] = critic is not None and bool(meta.get("has_critic"))
    # an adapter-only critic's trunk is not in the checkpoint: the trainer rebuilds it (CriticConfig.trunk_rebuilt)
    state["critic_trunk_saved"] = state["critic_loaded"] and not meta.get("critic_adapters_only")
    state["rank_state"] = {}
    if state["world_size"] == dist.get_world_size():
        set_rng_state(state["rng"][dist.get_rank()])
        mine = os.path.join(path, rank_state_file(dist.get_rank()))
        if os.path.isfile(mine):  # covered by the checksums like every file of the checkpoint
            try:
                state["rank_state"] = torch.load(mine, weights_only=False)
            except Exception as e:
                raise CheckpointError(f"{mine} is unreadable ({type(e).__name__}: {e}): the checkpoint is damaged; "
                                      "load an earlier step (checkpoint.load_dir)") from None
    else:
        kept = os.path.isdir(os.path.join(path, os.path.dirname(rank_state_file(0))))
        log.warning("resuming %d ranks from a %d-rank checkpoint: RNG states start fresh%s", dist.get_world_size(),
                    state["world_size"], "; the ranks' rollout state (groups carried to the next step, prompts drawn "
                    "and not yet sent) is dropped, and those prompts are not trained this epoch" if kept else "")
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
