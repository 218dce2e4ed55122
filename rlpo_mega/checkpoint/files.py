"""What a checkpoint promises about itself: a checksum of every file, and the model it was written for.

Integrity: at save, every file of the checkpoint (megatron's shards and metadata, the trainer state, the HF
files) gets its size and XXH3-64 digest in the meta file, taken from its bytes as they are written
(rlpo_mega.checkpoint.writes: a save reads nothing back). At load, each rank checks a disjoint share of the
files (files sorted, the i-th on rank i mod world: a shared filesystem is read in parallel, as the load
itself needs) and all ranks agree on the first problem; a truncated or changed file is one error naming the
file, before megatron reads it. checkpoint.verify=false skips it (tools/bench_checkpoint.py measures the cost).

Identity: the meta records the model (family identity: type, layers, widths, experts, vocab; no layout), so
resuming with another model is one error naming the first difference, before anything is loaded.
"""
from __future__ import annotations

import errno
import os

import torch.distributed as dist
import xxhash

HF_FILES = "hf"  # sub-directory of a dist checkpoint holding config.json + tokenizer files

_CHUNK = 8 << 20


def checkpoint_files(root: str, skip: tuple[str, ...] = ()) -> list[str]:
    """Every regular file under root, relative, sorted (the order every rank agrees on)."""
    out = []
    for d, _, names in os.walk(root):
        for n in names:
            rel = os.path.relpath(os.path.join(d, n), root)
            if rel not in skip:
                out.append(rel)
    return sorted(out)


def file_digest(path: str) -> tuple[int, str]:
    h, size = xxhash.xxh3_64(), 0
    with open(path, "rb") as f:
        while True:
            block = f.read(_CHUNK)
            if not block:
                break
            h.update(block)
            size += len(block)
    return size, h.hexdigest()


def _mine(names: list[str]) -> list[str]:
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    return names[rank::world]


def digest_files(root: str, names: list[str]) -> dict[str, list]:
    """Collective when a process group exists: {relative name: [size, xxh3-64]} of every name, read back and
    hashed, each by one rank (what a save cost before it hashed as it wrote: tools/bench_checkpoint.py)."""
    mine = {n: list(file_digest(os.path.join(root, n))) for n in _mine(names)}
    if not dist.is_initialized():
        return mine
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {n: v for part in every for n, v in part.items()}


def verify_files(root: str, recorded: dict[str, list]) -> str | None:
    """Collective when a process group exists: the first problem (a sentence naming the file), or None."""
    problems = []
    for n in _mine(sorted(recorded)):
        size, digest = recorded[n]  # digest None: a save that recorded sizes only (checksums=False)
        path = os.path.join(root, n)
        if not os.path.isfile(path):
            problems.append(f"{path} is missing")
            continue
        have = os.path.getsize(path)
        if have != size:
            problems.append(f"{path} is truncated or changed: {have} bytes, {size} at save")
        elif digest is not None and file_digest(path)[1] != digest:
            problems.append(f"{path} is corrupted: its checksum differs from the one recorded at save")
    if dist.is_initialized():
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, problems)
        problems = [p for part in every for p in part]
    if not problems:
        return None
    more = f" (and {len(problems) - 1} more file{'s' if len(problems) > 2 else ''})" if len(problems) > 1 else ""
    return (f"checkpoint {root}: {sorted(problems)[0]}{more}. Load an earlier step (checkpoint.load_dir) or "
            "restore the file; checkpoint.verify=false skips this check")


def identity_difference(recorded: dict | None, model_type: str | None, current: dict) -> str | None:
    """The first difference between the model a checkpoint was written for and the one configured, as
    "key: checkpoint vs config", or None. Checkpoints that predate identities compare model_type only."""
    if recorded is None:
        recorded = {"model_type": model_type} if model_type else {}
    for key, value in recorded.items():
        if key in current and current[key] != value:
            return f"{key} is {value!r} in the checkpoint, {current[key]!r} in model.hf_config"
    return None


_FULL = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


def disk_full(e: BaseException) -> OSError | None:
    """The ENOSPC/EDQUOT error behind e (its cause chain, or torch's CheckpointException per-rank failures)."""
    seen = set()
    stack = [e]
    while stack:
        x = stack.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno in _FULL:
            return x
        stack += [x.__cause__, x.__context__]
        failures = getattr(x, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
        if isinstance(failures, dict):
            stack += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return None
