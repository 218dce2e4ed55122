"""Megatron distributed checkpoints: model (+ optimizer) saved at one layout, loadable at any other.

Writes go to `<dir>.tmp` and are swapped in only after every rank finished, so a crash mid-write
leaves the previous checkpoint at `<dir>` intact. The meta file is written last: a directory without
it is an unfinished save and is refused.

Optimizer state is stored layout-independently: megatron splits the optimizer into a chain (dense /
expert parameters) whose shape depends on the parallel layout (TP1/EP1 gives one optimizer,
EP2 two), and its own sharded state dict nests per chain entry. Here every optimizer tensor is stored
in one flat list (each identified by its key, e.g. `optimizer.state.exp_avg.<param>`, and global
offset, as megatron does) plus one shared step, and on load the tensors are put back into whatever
chain the current layout built. Param-group hyper-parameters (lr, betas, ...) come from the current
config, not from the checkpoint.
"""
from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist

from rlpo_mega.training.model_setup import unwrap

META = "rlpo_meta.json"
FORMAT = 1


class CheckpointError(RuntimeError):
    pass


def _model_state(model_chunks, prefix: str = ""):
    if len(model_chunks) != 1:
        raise NotImplementedError("virtual pipeline stages are not supported yet")
    return unwrap(model_chunks[0]).sharded_state_dict(prefix=prefix)


def _sub_optimizers(optimizer):
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    subs = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    if any(isinstance(o, DistributedOptimizer) for o in subs):
        raise NotImplementedError(
            "checkpointing the distributed optimizer (optim.use_distributed_optimizer=true) is not "
            "supported yet; use the default optimizer")
    return subs


def _optim_root(sub_sd: dict) -> dict:
    """The torch-optimizer part ({'state', 'param_groups'}) of one megatron optimizer's state dict."""
    return sub_sd["optimizer"] if "optimizer" in sub_sd else sub_sd  # Float16Optimizer nests it


def _optimizer_state(model_sd, optimizer, is_loading: bool):
    """(per sub-optimizer sharded dicts, flat list of their sharded tensors, shared step)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    subs = [o.sharded_state_dict(model_sd, is_loading=is_loading) for o in _sub_optimizers(optimizer)]
    flat, steps = [], set()
    for sd in subs:
        flat += [v for v in nested_values(sd) if isinstance(v, ShardedBase)]
        step = _optim_root(sd)["state"].get("common_step")
        if step is not None:
            steps.add(float(step))
    if len(steps) > 1:
        raise CheckpointError(f"optimizer chain has different steps {sorted(steps)}")
    return subs, flat, (steps.pop() if steps else 0.0)


_REFERENCE = "reference."  # sharded-key prefix of the KL reference model saved alongside the policy


def save_checkpoint(path: str, model_chunks, optimizer=None, meta: dict | None = None,
                    files: dict[str, bytes] | None = None, reference_chunks=None):
    """Atomic: written to `path`.tmp, then swapped in. files: extra {name: bytes} written by rank 0 inside
    the checkpoint before the swap (the trainer state), so they exist exactly when the weights do.
    reference_chunks: a frozen KL reference model of the same layout, saved in the same checkpoint."""
    from megatron.core import dist_checkpointing

    path = os.path.abspath(path)
    tmp = path + ".tmp"
    rank = dist.get_rank()
    model_sd = _model_state(model_chunks)
    state = {"model": model_sd}
    if optimizer is not None:
        _, flat, step = _optimizer_state(model_sd, optimizer, is_loading=False)
        state["optimizer"] = {"tensors": flat, "step": step}
    if reference_chunks is not None:
        state["reference"] = _model_state(reference_chunks, _REFERENCE)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of an interrupted save
        os.makedirs(tmp)
    dist.barrier()
    dist_checkpointing.save(state, tmp)
    dist.barrier()
    if rank == 0:
        for name, data in (files or {}).items():
            os.makedirs(os.path.dirname(os.path.join(tmp, name)), exist_ok=True)
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(data)
        with open(os.path.join(tmp, META), "w") as f:
            json.dump({"format": FORMAT, "has_optimizer": optimizer is not None,
                       "has_reference": reference_chunks is not None, **(meta or {})}, f, indent=1)
        old = path + ".old"
        shutil.rmtree(old, ignore_errors=True)
        if os.path.exists(path):
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def read_meta(path: str) -> dict:
    path = os.path.abspath(path)
    file = os.path.join(path, META)
    if not os.path.isfile(file):
        if not os.path.isdir(path) and os.path.isfile(os.path.join(path + ".old", META)):
            raise CheckpointError(
                f"{path!r} does not exist but {path + '.old'!r} does: a save was interrupted while "
                f"swapping directories; rename {path + '.old'!r} to {path!r} to use the previous checkpoint")
        if not os.path.isdir(path):
            raise CheckpointError(f"checkpoint directory {path!r} does not exist; "
                                  "point checkpoint.load_dir at a finished checkpoint")
        hint = ""
        if path.endswith(".tmp") and os.path.isfile(os.path.join(path[:-4], META)):
            hint = f" ({path[:-4]!r} holds the previous complete checkpoint)"
        raise CheckpointError(
            f"{path!r} is not a complete rlpo_mega checkpoint ({META} missing): it was never written or "
            f"its save was interrupted. Point checkpoint.load_dir at a finished checkpoint{hint} and "
            "delete this directory."
        )
    with open(file) as f:
        return json.load(f)


def load_checkpoint(path: str, model_chunks, optimizer=None, reference_chunks=None) -> dict:
    """Load into already-built model (and optimizer) at the current layout; returns the saved meta.
    reference_chunks: filled with the saved KL reference if the checkpoint has one (meta "has_reference")."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase

    path = os.path.abspath(path)
    meta = read_meta(path)
    if optimizer is not None and not meta.get("has_optimizer"):
        raise CheckpointError(f"{path!r} holds no optimizer state; load it without an optimizer")
    model_sd = _model_state(model_chunks)
    state = {"model": model_sd}
    if optimizer is not None:
        subs, flat, _ = _optimizer_state(model_sd, optimizer, is_loading=True)
        state["optimizer"] = {"tensors": flat}
    with_reference = reference_chunks is not None and meta.get("has_reference", False)
    if with_reference:
        state["reference"] = _model_state(reference_chunks, _REFERENCE)
    loaded = dist_checkpointing.load(state, path)
    unwrap(model_chunks[0]).load_state_dict(loaded["model"], strict=True)
    if with_reference:
        unwrap(reference_chunks[0]).load_state_dict(
            {k[len(_REFERENCE):] if k.startswith(_REFERENCE) else k: v for k, v in loaded["reference"].items()},
            strict=True)
    if optimizer is not None:
        tensors, step = loaded["optimizer"]["tensors"], loaded["optimizer"]["step"]
        position = {id(v): i for i, v in enumerate(flat)}

        def fill(v):
            if isinstance(v, ShardedBase):
                return tensors[position[id(v)]]
            if isinstance(v, LocalNonpersistentObject):
                return v.unwrap()
            return v

        for sub, sd in zip(_sub_optimizers(optimizer), subs):
            dict_list_map_inplace(fill, sd)
            root = _optim_root(sd)
            root["state"].pop("common_step", None)
            if step:
                root["state"]["common_step"] = torch.tensor(float(step))
            sub.load_state_dict(sd)
    return meta
