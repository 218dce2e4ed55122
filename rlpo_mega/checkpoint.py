"""Megatron distributed checkpoints: model (+ optimizer) saved at one layout, loadable at any other.

Writes go to `<dir>.tmp` and are swapped in only after every rank finished, so a crash mid-write
leaves the previous checkpoint at `<dir>` intact.
"""
from __future__ import annotations

import json
import os
import shutil

import torch.distributed as dist

from rlpo_mega.training.model_setup import unwrap

META = "rlpo_meta.json"


class CheckpointError(RuntimeError):
    pass


def _sharded_state(model_chunks, optimizer, is_loading: bool):
    if len(model_chunks) != 1:
        raise NotImplementedError("virtual pipeline stages are not supported yet")
    state = {"model": unwrap(model_chunks[0]).sharded_state_dict()}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading)
    return state


def save_checkpoint(path: str, model_chunks, optimizer=None, meta: dict | None = None):
    from megatron.core import dist_checkpointing

    path = os.path.abspath(path)
    tmp = path + ".tmp"
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    dist_checkpointing.save(_sharded_state(model_chunks, optimizer, is_loading=False), tmp)
    dist.barrier()
    if rank == 0:
        with open(os.path.join(tmp, META), "w") as f:
            json.dump({"has_optimizer": optimizer is not None, **(meta or {})}, f, indent=1)
        old = path + ".old"
        shutil.rmtree(old, ignore_errors=True)
        if os.path.exists(path):
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def read_meta(path: str) -> dict:
    file = os.path.join(path, META)
    if not os.path.isfile(file):
        raise CheckpointError(
            f"{path!r} is not a complete rlpo_mega checkpoint ({META} missing): it was never written or "
            "its save was interrupted; point checkpoint.load_dir at a finished checkpoint"
        )
    with open(file) as f:
        return json.load(f)


def load_checkpoint(path: str, model_chunks, optimizer=None) -> dict:
    """Load into already-built model (and optimizer) at the current layout; returns the saved meta."""
    from megatron.core import dist_checkpointing

    meta = read_meta(path)
    if optimizer is not None and not meta.get("has_optimizer"):
        raise CheckpointError(f"{path!r} holds no optimizer state; load it without an optimizer")
    state = dist_checkpointing.load(_sharded_state(model_chunks, optimizer, is_loading=True), path)
    unwrap(model_chunks[0]).load_state_dict(state["model"], strict=True)
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    return meta
