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

The distributed optimizer (optim.use_distributed_optimizer) goes through megatron-core's own sharded
state in its 'fully_reshardable' format, chosen among 0.16.1's formats because it is the only one that
reshards across DP *and* TP/PP/EP: its tensors have the shape and sharding of the model parameter they
belong to (keys `optimizer.state.{param,exp_avg,exp_avg_sq}.<param>`), whereas 'dp_reshardable' stores
the DP-flattened gradient buckets (keys and offsets depend on TP/PP/EP and the bucket layout) and
'fully_sharded_model_space', megatron's default, builds flattened-range ShardedTensors that 0.16.1's
dist_checkpointing rejects (mapping.py:134). Its main params are renamed to the key the non-distributed
mixed-precision optimizer uses (`optimizer.state.fp32_param.<param>`) and, where the model parameter
is itself fp32 (it is then the main param), not stored twice: a checkpoint of either optimizer loads
into the other at any layout. megatron-core writes that format by gathering each DP group's state on its DP
rank 0 and reads it whole on every rank (hundreds of GB on one host at the recipes' size): the same tensors
are written and read here with each rank holding its own share (rlpo_mega.checkpoint.distopt).
"""
from __future__ import annotations

import glob
import json
import logging
import os
import shutil
from contextlib import contextmanager

import torch
import torch.distributed as dist
import xxhash

from moe.bridge.hf_checkpoint import fingerprint
from moe.bridge.outputs import swap_in
from moe.lora import is_lora_param
from rlpo_mega.checkpoint import layer_spec
from rlpo_mega.checkpoint.distopt import load_state, save_state
from rlpo_mega.checkpoint.files import checkpoint_files, disk_full, verify_files
from rlpo_mega.model_setup import unwrap
from rlpo_mega.processes import in_process_checkpoint_queue

META = "rlpo_meta.json"
FORMAT = 1


class CheckpointError(RuntimeError):
    pass


def _model_state(model_chunks, prefix: str = ""):
    if len(model_chunks) != 1:
        raise NotImplementedError("virtual pipeline stages are not supported yet")
    return unwrap(model_chunks[0]).sharded_state_dict(prefix=prefix)


def _adapters(model_sd: dict, prefix: str = "") -> dict:
    """The LoRA factors' entries of a model's sharded state dict (an adapter-only checkpoint's model); of the critic
    (prefix _CRITIC) with its scalar head, new and trained whole."""
    head = prefix + "output_layer."
    return {k: v for k, v in model_sd.items() if is_lora_param(k) or (prefix == _CRITIC and k.startswith(head))}


def _sub_optimizers(optimizer):
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _is_distributed(optimizer) -> bool:
    """Informational (meta file): either kind of checkpoint loads into either optimizer."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return any(isinstance(sub, DistributedOptimizer) for sub in _sub_optimizers(optimizer))


def _optim_root(sub_sd: dict) -> dict:
    """The torch-optimizer part ({'state', 'param_groups'}) of one megatron optimizer's state dict."""
    return sub_sd["optimizer"] if "optimizer" in sub_sd else sub_sd  # Float16Optimizer nests it


def _zero_state(sub) -> bool:
    """Give a never-stepped distributed optimizer over torch's Adam the initial state (step 0, zero
    moments), which its state_dict needs (distrib_optimizer.py:638 reads every param's 'step'); torch's
    Adam takes exactly this state for a fresh one. (Apex/TE FusedAdam keep the step in the param groups
    and need nothing.) Returns whether it did."""
    from megatron.core.optimizer import distrib_optimizer
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    inner = sub.optimizer
    if isinstance(inner, HybridDeviceOptimizer):  # torch AdamW inside, with or without Apex/TE
        return _zero_hybrid_state(inner)
    if inner.state or distrib_optimizer.HAVE_APEX_OR_TE:
        return False
    for group in inner.param_groups:
        for p in group["params"]:
            inner.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                              "exp_avg_sq": torch.zeros_like(p)}
    return True


def _zero_hybrid_state(hdo) -> bool:
    """_zero_state of optimizer CPU offload's HybridDeviceOptimizer: its host and device AdamWs take the initial
    state, and the HDO's own view of it gains each param's fp32 master (`master_param`), which megatron reads as the
    main param (distrib_optimizer.py:904). Megatron's own answer to a fresh HDO, dummy_step() (hybrid_optimizer.py:
    453), steps the weights with random gradients."""
    if hdo.state:
        return False
    for opt in hdo.sub_optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                opt.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device),
                                "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    hdo._sync_sub_optimizers_state_to_hdo()
    return True


def _clear_state(inner) -> None:
    for opt in getattr(inner, "sub_optimizers", [inner]):  # a HybridDeviceOptimizer's host and device AdamWs
        opt.state.clear()
    inner.state.clear()


def _distributed_state(sub, model_sd, is_loading: bool):
    """(sharded dict, step) of one DistributedOptimizer in the format described in the module doc: megatron's
    sharded_state_dict with its fully_reshardable param_state made without the gathers (rlpo_mega.checkpoint.distopt)."""
    fresh = _zero_state(sub)
    sd = sub.state_dict()
    if is_loading:
        sub.load_state_dict(sub.state_dict())  # allocates what a fresh Apex/TE optimizer lacks, as megatron's does
    sd["param_state"] = (load_state if is_loading else save_state)(sub, model_sd)
    sd["param_state_sharding_type"] = "fully_reshardable"
    if fresh and not is_loading:
        _clear_state(sub.optimizer)  # leave it as it was: the save copied what it needed
    if not any(g["params"] for g in sub.optimizer.param_groups):
        return sd, None  # nothing here to step (a pipeline stage without MoE layers: its expert optimizer)
    steps = {float(g.get("step") or 0) for g in sd["optimizer"]["param_groups"]}  # FusedAdam: none yet
    if len(steps) != 1:
        raise CheckpointError(f"distributed optimizer param groups have different steps {sorted(steps)}")
    return sd, steps.pop()


def _optimizer_state(model_sd, optimizer, is_loading: bool):
    """(per sub-optimizer sharded dicts, flat list of their sharded tensors, shared step)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedBase
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    subs, flat, steps = [], [], set()
    for sub in _sub_optimizers(optimizer):
        if isinstance(sub, DistributedOptimizer):
            sd, step = _distributed_state(sub, model_sd, is_loading)
        else:
            sd = sub.sharded_state_dict(model_sd, is_loading=is_loading)
            step = _optim_root(sd)["state"].get("common_step")
        subs.append(sd)
        flat += [v for v in nested_values(sd) if isinstance(v, ShardedBase)]
        if step is not None:
            steps.add(float(step))
    if len(steps) > 1:
        raise CheckpointError(f"optimizer chain has different steps {sorted(steps)}")
    return subs, flat, (steps.pop() if steps else 0.0)


def _set_step(sd: dict, step: float):
    if "param_state_sharding_type" in sd:  # DistributedOptimizer: one step per param group
        for group in sd["optimizer"]["param_groups"]:
            group["step"] = int(step)
        return
    root = _optim_root(sd)
    root["state"].pop("common_step", None)
    if step:
        root["state"]["common_step"] = torch.tensor(float(step))


def _load_distributed(sub, sd: dict):
    """DistributedOptimizer.load_state_dict in its two halves, for torch's Adam (no Apex or Transformer
    Engine), whose per-param state holds a 'step' tensor. The fully_reshardable loader leaves 'step' out
    of what it reads (distrib_optimizer.py:2101) but then copies every state key (KeyError at :940), so
    the step is kept aside during the second half. The first half gives every param the *same* step
    tensor (distrib_optimizer.py:819-823), which torch's foreach Adam would then increment once per
    param in each step: each param gets its own copy, as the plain optimizer does."""
    sub.load_state_dict({k: v for k, v in sd.items() if k != "param_state"})
    inner = sub.optimizer.state
    steps = {p: state.pop("step") for p, state in inner.items() if "step" in state}
    try:
        sub.load_parameter_state_from_fully_reshardable(sd["param_state"])
    finally:
        for p, step in steps.items():
            inner[p]["step"] = step.clone()


_REFERENCE = "reference."  # sharded-key prefix of the KL reference model saved alongside the policy
_CRITIC = "critic."  # and of PPO's value model


PARTIAL = ".rlpo_mega_partial"  # in `<path>.tmp` while a save writes it
MEGATRON_SAVE_LOGGER = "megatron.core.dist_checkpointing.serialization"


class _NotAnOldCheckpoint(logging.Filter):
    """megatron warns "Overwriting old incomplete / corrupted checkpoint..." whenever the directory it saves into
    is not empty (serialization.py:383-387). Ours is the `.tmp` this save just made, holding only its PARTIAL
    marker (an old one was cleared or refused by _clear_leftover first): the warning would be false at every
    save and tell users their checkpoints are corrupted."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Overwriting old incomplete / corrupted checkpoint")


@contextmanager
def fresh_directory_save():
    """megatron's save into the `.tmp` this save made: its false "corrupted checkpoint" warning left out."""
    quiet, log = _NotAnOldCheckpoint(), logging.getLogger(MEGATRON_SAVE_LOGGER)
    log.addFilter(quiet)
    try:
        yield
    finally:
        log.removeFilter(quiet)


def _clear_leftover(tmp: str) -> str | None:
    """Remove an interrupted save's `<path>.tmp` (it holds PARTIAL); anything else there is not ours: the
    reason to stop (None: the way is clear)."""
    if not os.path.lexists(tmp):
        return None
    if os.path.isdir(tmp) and os.path.isfile(os.path.join(tmp, PARTIAL)):
        shutil.rmtree(tmp)
        return None
    return (f"{tmp} exists and was not written by an rlpo-mega save (a checkpoint is written there before it is "
            "renamed into place): move it away and save again")


def _agree(problem: str | None) -> str | None:
    """Collective: the first rank's problem, on every rank (None: all went well)."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, problem)
    return next((p for p in every if p), None)


def _what_failed(e: BaseException, path: str) -> str:
    full = disk_full(e)
    if full is not None:
        return (f"no space left on device while saving checkpoint {path} ({full.filename or 'a shard'}); "
                "the previous checkpoint and `latest` are intact: free space or set checkpoint.save_dir elsewhere")
    return f"saving checkpoint {path} failed: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"


def save_checkpoint(path: str, model_chunks, optimizer=None, meta: dict | None = None,
                    files: dict[str, bytes] | None = None, reference_chunks=None, critic=None, checksums: bool = True,
                    rank_files: dict[str, bytes] | None = None, adapters_only: bool = False,
                    critic_adapters_only: bool = False):
    """Atomic: written to `path`.tmp, then swapped in. files: extra {name: bytes} written by rank 0 inside
    the checkpoint before the swap (the trainer state), so they exist exactly when the weights do; rank_files:
    the same, written by the rank that passes them (names distinct across ranks: a rank's own rollout state).
    reference_chunks: a frozen KL reference model of the same layout, saved in the same checkpoint.
    critic: (model_chunks, optimizer or None) of PPO's value model, saved in the same checkpoint.
    A failure on any rank (a full disk included) is agreed by all ranks, `path`.tmp is removed and one
    CheckpointError says what happened; `path` and anything before it are untouched. Every file's checksum is
    taken from its bytes as they are written (rlpo_mega.checkpoint.writes): the save reads nothing back but two
    small files of megatron's. checksums=False records the sizes only (it saves no time any more).
    adapters_only: a LoRA run's policy without its frozen base (the factors, their optimizer state; meta
    "adapters_only"): a load rebuilds the base first (model.init_from_hf) and takes the factors from here.
    critic_adapters_only: the critic's the same way, its factors and scalar head (meta "critic_adapters_only"; its
    trunk rebuilt by the trainer, CriticConfig.trunk_rebuilt)."""
    from megatron.core import dist_checkpointing

    from rlpo_mega.checkpoint.writes import HashingSaveStrategy, written

    in_process_checkpoint_queue()
    path = os.path.abspath(path)
    tmp = path + ".tmp"
    rank = dist.get_rank()
    model_sd = _model_state(model_chunks)
    state = {"model": _adapters(model_sd) if adapters_only else model_sd}
    if optimizer is not None:  # its keys from the whole model's entries: the optimizer holds the factors only
        _, flat, step = _optimizer_state(model_sd, optimizer, is_loading=False)
        # DP ranks > 0 of every distributed optimizer hold no tensor: no empty list in their common state
        state["optimizer"] = {"step": step, **({"tensors": flat} if flat else {})}
    if reference_chunks is not None:
        state["reference"] = _model_state(reference_chunks, _REFERENCE)
    if critic is not None:
        critic_sd = _model_state(critic[0], _CRITIC)
        state["critic"] = _adapters(critic_sd, _CRITIC) if critic_adapters_only else critic_sd
        if critic[1] is not None:  # keyed by the whole critic's entries, as the policy's optimizer
            _, flat, step = _optimizer_state(critic_sd, critic[1], is_loading=False)
            state["critic_optimizer"] = {"step": step, **({"tensors": flat} if flat else {})}
    problem = None
    if rank == 0:
        problem = _clear_leftover(tmp)
        if problem is None:
            try:
                os.makedirs(tmp)
                open(os.path.join(tmp, PARTIAL), "w").close()  # ours: a later save may clear it
            except OSError as e:
                problem = _what_failed(e, path)
    problem = _agree(problem)
    if problem is not None:
        raise CheckpointError(problem)

    def phase(fn, on_rank0_only: bool = False):
        err = None
        if rank == 0 or not on_rank0_only:
            try:
                fn()
            except BaseException as e:  # torch's CheckpointException is a BaseException
                if isinstance(e, (KeyboardInterrupt, SystemExit)):
                    raise
                err = _what_failed(e, path)
        err = _agree(err)
        if err is not None:
            if rank == 0 and os.path.isfile(os.path.join(tmp, PARTIAL)):
                shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written stays behind
            dist.barrier()
            raise CheckpointError(err)

    mine = {}  # this rank's files: {relative name: [size, xxh3-64]}, each hashed as it was written

    def write_files():
        for name, data in {**((files or {}) if rank == 0 else {}), **(rank_files or {})}.items():
            os.makedirs(os.path.dirname(os.path.join(tmp, name)), exist_ok=True)
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(data)
            mine[name] = [len(data), xxhash.xxh3_64_hexdigest(data)]

    digests = {}

    def digest():  # every file's size and checksum, verified at load (rlpo_mega/checkpoint/files.py)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        if rank == 0:
            digests.update(complete(tmp, {n: v for part in every for n, v in part.items()}))
            if not checksums:
                digests.update({n: [size, None] for n, (size, _) in digests.items()})

    def write_meta():
        with open(os.path.join(tmp, META), "w") as f:
            json.dump({"format": FORMAT, "layer_spec": layer_spec.model_layer_spec(unwrap(model_chunks[0])),
                       "has_optimizer": optimizer is not None,
                       "distributed_optimizer": optimizer is not None and _is_distributed(optimizer),
                       "has_reference": reference_chunks is not None, "has_critic": critic is not None,
                       "has_critic_optimizer": critic is not None and critic[1] is not None,
                       "adapters_only": adapters_only, "critic_adapters_only": critic is not None and critic_adapters_only,
                       **(meta or {}), "files": digests}, f, indent=1)
        os.remove(os.path.join(tmp, PARTIAL))
        swap_in(tmp, path)  # a previous `path` is set aside under a fresh name, removed after the rename

    def save():
        strategy = HashingSaveStrategy()  # megatron-core's default, hashing what it writes
        with fresh_directory_save():
            dist_checkpointing.save(state, tmp, sharded_strategy=strategy)
        mine.update(written(strategy, tmp, rank))

    phase(save)
    phase(write_files)
    phase(digest)  # collective inside: every rank runs it
    phase(write_meta, on_rank0_only=True)


def complete(root: str, hashed: dict[str, list]) -> dict[str, list]:
    """The digests of every file under root (but PARTIAL): those hashed as written, and any file the save wrote
    around the hooks read back and hashed (writes.checked warns). A digest of a file that is not there is a
    failed save."""
    from rlpo_mega.checkpoint.writes import checked

    names = checkpoint_files(root, skip=(PARTIAL,))
    gone = sorted(set(hashed) - set(names))
    if gone:
        raise OSError(f"{os.path.join(root, gone[0])} was written by this save and is gone")
    return {n: hashed[n] if n in hashed else checked(root, n, None) for n in names}


def read_meta(path: str) -> dict:
    path = os.path.abspath(path)
    file = os.path.join(path, META)
    if not os.path.isfile(file):
        aside = [a for a in glob.glob(glob.escape(path) + ".old-*") if os.path.isfile(os.path.join(a, META))]
        if not os.path.isdir(path) and aside:
            raise CheckpointError(
                f"{path!r} does not exist but {aside[0]!r} does: a save was interrupted while "
                f"swapping directories; rename {aside[0]!r} to {path!r} to use the previous checkpoint")
        if not os.path.isdir(path):
            raise CheckpointError(f"checkpoint directory {path!r} does not exist; "
                                  "point checkpoint.load_dir at a finished checkpoint")
        hint = ""
        if path.endswith(".tmp") and os.path.isfile(os.path.join(path[:-4], META)):
            hint = f" ({path[:-4]!r} holds the previous complete checkpoint)"
        raise CheckpointError(
            f"{path!r} is not a complete rlpo_mega checkpoint ({META} missing): it was never written or "
            f"its save was interrupted. Point checkpoint.load_dir at a finished checkpoint{hint}."
        )
    try:
        with open(file) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{file} is unreadable ({e}): the checkpoint is damaged; load an earlier step "
                              "(checkpoint.load_dir)") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{file} is not an rlpo_mega checkpoint meta file (a JSON object)")
    return meta


def read_whole(path: str, keep) -> dict[str, torch.Tensor]:
    """The policy's checkpoint tensors whose key passes `keep` (a LoRA run's factors: a few MB), each whole as the
    single process holds it, read in this process without a process group or a model: megatron's torch_dist format
    is torch.distributed.checkpoint's, whose metadata names every tensor's global shape, so the reader assembles it
    from the shards of any layout. The files are checked against their recorded checksums first."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = os.path.abspath(path)
    meta = read_meta(path)
    if "files" in meta:
        problem = verify_files(path, meta["files"])
        if problem:
            raise CheckpointError(problem)
    reader = FileSystemReader(path)
    entries = reader.read_metadata().state_dict_metadata
    want = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in entries.items()
            if isinstance(m, TensorStorageMetadata) and not k.startswith((_REFERENCE, _CRITIC, "optimizer."))
            and keep(k)}
    if want:
        load(want, storage_reader=reader, no_dist=True)
    bad = next((k for k, t in want.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())), None)
    if bad is not None:
        raise CheckpointError(f"checkpoint {path}: {bad} holds NaN/inf values (the run that saved it had diverged): "
                              "export an earlier step")
    return want


def base_record(init_from_hf: str) -> dict:
    """What an adapter-only checkpoint records of the base it was trained on (meta "base")."""
    return {"path": os.path.abspath(init_from_hf), "fingerprint": fingerprint(init_from_hf)}


def check_base(path: str, meta: dict, init_from_hf: str | None, what: str = "model.init_from_hf"):
    """An adapter-only checkpoint (meta "adapters_only") loads only onto the base it was trained on: refused in one
    line, before anything is built or loaded, where `init_from_hf` is unset or holds other weights (their
    fingerprints, moe/bridge/hf_checkpoint.py, differ)."""
    if not meta.get("adapters_only"):
        return
    base = meta.get("base") or {}
    if not init_from_hf:
        raise CheckpointError(f"{path} holds a LoRA run's adapters only, trained on the base {base.get('path')}: "
                              f"set {what} to that HF checkpoint")
    if not os.path.isdir(init_from_hf):
        raise CheckpointError(f"{path} holds adapters trained on the base {base.get('path')}, and {what}="
                              f"{init_from_hf} does not exist: point it at that base")
    if fingerprint(init_from_hf) != base.get("fingerprint"):
        raise CheckpointError(f"{path} holds adapters trained on the base {base.get('path')}, and {what}="
                              f"{init_from_hf} holds other weights (their fingerprints differ): use that base, or "
                              "start a new run from this one")


def _first_non_finite(loaded: dict, flat: list) -> str | None:
    """The key of the first loaded floating tensor holding NaN or inf (weights, KL reference, optimizer)."""
    named = [(k, v) for part in ("model", "reference", "critic") for k, v in (loaded.get(part) or {}).items()]
    for part, sharded in zip(("optimizer", "critic_optimizer"), flat):
        tensors = (loaded.get(part) or {}).get("tensors", [])
        named += [(getattr(sh, "key", f"{part} tensor {i}"), t) for i, (sh, t) in enumerate(zip(sharded, tensors))]
    for key, t in named:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return key
    return None


def load_checkpoint(path: str, model_chunks, optimizer=None, reference_chunks=None, verify: bool = True,
                    critic=None) -> dict:
    """Load into already-built model (and optimizer) at the current layout; returns the saved meta.
    reference_chunks: filled with the saved KL reference if the checkpoint has one (meta "has_reference").
    critic: (model_chunks, optimizer or None) filled with the saved critic if the checkpoint has one.
    verify: check every file against the checksums recorded at save first (checkpoints written before
    checksums are loaded unchecked). Loaded values holding NaN/inf are refused either way."""
    from megatron.core import dist_checkpointing

    path = os.path.abspath(path)
    meta = read_meta(path)
    if optimizer is not None and not meta.get("has_optimizer"):
        raise CheckpointError(f"{path!r} holds no optimizer state; load it without an optimizer")
    crossing = _SpecCrossing(path, meta, model_chunks)
    model_sd = crossing(_model_state(model_chunks), model_chunks)
    adapters_only = bool(meta.get("adapters_only"))
    if adapters_only and not any(is_lora_param(n) for n, _ in unwrap(model_chunks[0]).named_parameters()):
        raise CheckpointError(f"{path} holds a LoRA run's adapters only (its base is {(meta.get('base') or {}).get('path')}): "
                              "load it into a model built with its model.lora on that base")
    state = {"model": _adapters(model_sd) if adapters_only else model_sd}
    if optimizer is not None:
        subs, flat, _ = _optimizer_state(model_sd, optimizer, is_loading=True)  # keys from the crossed model's
        state["optimizer"] = {"tensors": flat}
    with_reference = reference_chunks is not None and meta.get("has_reference", False)
    if with_reference:
        state["reference"] = crossing(_model_state(reference_chunks, _REFERENCE), reference_chunks, _REFERENCE)
    with_critic = critic is not None and meta.get("has_critic", False)
    critic_subs = critic_flat = None
    critic_adapters_only = with_critic and bool(meta.get("critic_adapters_only"))
    if with_critic:
        critic_sd = crossing(_model_state(critic[0], _CRITIC), critic[0], _CRITIC)
        if critic_adapters_only and not any(is_lora_param(n) for n, _ in unwrap(critic[0][0]).named_parameters()):
            raise CheckpointError(f"{path} holds the critic's adapters only: load it into a critic built with its "
                                  "critic.lora")
        state["critic"] = _adapters(critic_sd, _CRITIC) if critic_adapters_only else critic_sd
        if critic[1] is not None:
            if not meta.get("has_critic_optimizer"):
                raise CheckpointError(f"{path!r} holds no critic optimizer state; load it without optimizer state "
                                      "(checkpoint.load_optimizer=false)")
            critic_subs, critic_flat, _ = _optimizer_state(critic_sd, critic[1], is_loading=True)
            state["critic_optimizer"] = {"tensors": critic_flat}
    if verify and "files" in meta:
        problem = verify_files(path, meta["files"])
        if problem:
            raise CheckpointError(problem)
    problem = _agree(crossing.problem())  # collective: a rank that stopped alone would leave the others in the load
    if problem is not None:
        raise CheckpointError(problem)
    loaded = dist_checkpointing.load(state, path)
    bad = [_first_non_finite(loaded, (flat if optimizer is not None else [], critic_flat or []))]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, bad[0])
    bad = [b for b in every if b]
    if bad:
        raise CheckpointError(f"checkpoint {path}: {bad[0]} holds NaN/inf values (the run that saved it had "
                              "diverged, or the file was damaged before checksums were recorded): load an earlier "
                              "step with checkpoint.load_dir")
    if adapters_only:  # the base is the model's own (built from model.init_from_hf); the factors come from here
        missing, unexpected = unwrap(model_chunks[0]).load_state_dict(loaded["model"], strict=False)
        if unexpected or any(is_lora_param(n) for n in missing):
            raise CheckpointError(f"{path}: its adapters do not match this model's: missing "
                                  f"{[n for n in missing if is_lora_param(n)][:3]}, unexpected {unexpected[:3]}")
    else:
        unwrap(model_chunks[0]).load_state_dict(loaded["model"], strict=True)
    if with_reference:
        unwrap(reference_chunks[0]).load_state_dict(
            {k[len(_REFERENCE):] if k.startswith(_REFERENCE) else k: v for k, v in loaded["reference"].items()},
            strict=True)
    if with_critic:  # an adapter-only critic: its trunk is the one built (and rebuilt by the trainer), not saved
        missing, unexpected = unwrap(critic[0][0]).load_state_dict(
            {k[len(_CRITIC):] if k.startswith(_CRITIC) else k: v for k, v in loaded["critic"].items()},
            strict=not critic_adapters_only)
        if unexpected or any(is_lora_param(n) or n.startswith("output_layer.") for n in missing):
            raise CheckpointError(f"{path}: its critic's adapters do not match this critic's: missing "
                                  f"{[n for n in missing if is_lora_param(n)][:3]}, unexpected {unexpected[:3]}")
        if critic[1] is not None:
            _restore_optimizer(critic[1], critic_subs, critic_flat, loaded["critic_optimizer"])
    if optimizer is not None:
        _restore_optimizer(optimizer, subs, flat, loaded["optimizer"])
    return meta


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


class _SpecCrossing:
    """A checkpoint written by the other megatron layer spec (rlpo_mega.checkpoint.layer_spec), loaded into this run's
    models: each model part's sharded state dict asks for the saved spec's keys; nothing changes when the saved spec
    (meta "layer_spec") is this run's. A checkpoint from before the spec was recorded is read as written by this run's
    spec if it holds every key this run asks for, else by the other one."""

    def __init__(self, path: str, meta: dict, model_chunks):
        self.path = path
        self.run = layer_spec.model_layer_spec(unwrap(model_chunks[0]))
        self.recorded = meta.get("layer_spec")
        if self.recorded is not None and self.recorded not in layer_spec.SPECS:
            raise CheckpointError(f"{path}: {META} names layer spec {self.recorded!r}, not one of megatron-core's "
                                  f"{list(layer_spec.SPECS)}: the meta file is damaged or from another program")
        self.saved = self.recorded
        self.stored: set[str] | None = None
        self.parts: list[dict] = []
        self.failure: str | None = None  # reported by problem(), which every rank reaches: no rank stops alone

    def __call__(self, sharded_sd: dict, chunks, prefix: str = "") -> dict:
        if self.failure is not None:
            return sharded_sd
        try:
            if self.saved is None:
                self.stored = layer_spec.stored_keys(self.path)
                same = not layer_spec.missing(sharded_sd, self.stored)
                self.saved = self.run if same else next(s for s in layer_spec.SPECS if s != self.run)
            if self.saved != self.run:
                layer_spec.cross(sharded_sd, unwrap(chunks[0]), self.saved, self.run, prefix)
                self.parts.append(sharded_sd)
        except Exception as e:
            self.failure = (f"checkpoint {self.path}: mapping its keys from the {self.saved or 'unrecorded'!r} to this "
                            f"run's {self.run!r} layer spec failed: {_first_line(e)}")
        return sharded_sd

    def problem(self) -> str | None:
        """One line naming the cause when a crossed part still asks for a key the checkpoint lacks (None: all there)."""
        if self.failure is not None or not self.parts:
            return self.failure
        if self.stored is None:
            try:
                self.stored = layer_spec.stored_keys(self.path)
            except Exception as e:
                return f"checkpoint {self.path}: its metadata is unreadable ({_first_line(e)})"
        lacking = sorted({k for sd in self.parts for k in layer_spec.missing(sd, self.stored)})
        if not lacking:
            return None
        written = (f"was written with megatron-core's {self.saved!r} layer spec" if self.recorded else
                   f"holds neither the {self.run!r} nor the {self.saved!r} layer spec's keys (it predates the recorded "
                   "spec)")
        return (f"checkpoint {self.path} {written} and this run builds the {self.run!r} spec: after mapping the norms "
                f"between the two specs, {len(lacking)} key(s) this model needs are not in it (first: {lacking[0]}); "
                "it was not written for this model")


def _restore_optimizer(optimizer, subs, flat, part: dict):
    """Put the loaded tensors (in `flat`'s order) back into the current layout's optimizer chain."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase

    tensors, step = part.get("tensors", []), part["step"]
    position = {id(v): i for i, v in enumerate(flat)}

    def fill(v):
        if isinstance(v, ShardedBase):
            return tensors[position[id(v)]]
        if isinstance(v, LocalNonpersistentObject):
            return v.unwrap()
        return v

    for sub, sd in zip(_sub_optimizers(optimizer), subs):
        dict_list_map_inplace(fill, sd)
        _set_step(sd, step)
        if "param_state_sharding_type" in sd:
            _load_distributed(sub, sd)
        else:
            sub.load_state_dict(sd)
