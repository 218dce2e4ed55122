"""`rlpo-mega convert` (HF -> megatron dist checkpoint) and `rlpo-mega export` (dist checkpoint -> HF).

Both run as SPMD jobs (re-exec'd under torchrun by the CLI for more than one process). The dist
checkpoint carries the HF config.json and the tokenizer files, so export needs nothing else.
"""
from __future__ import annotations

import json
import os

import torch.distributed as dist

from moe.bridge import outputs
from moe.bridge import peft
from moe.bridge.hf_checkpoint import PASSTHROUGH, HFCheckpoint, HFCheckpointWriter, write_stream
from moe.bridge.megatron_io import ExportStream
from moe.families import get_family
from moe.model import load_hf_config
from rlpo_mega import distributed
from moe.lora import is_lora_param
from rlpo_mega.checkpoint.dist import (META, CheckpointError, check_base, load_checkpoint, read_meta, read_whole,
                                       save_checkpoint)
from rlpo_mega.checkpoint.files import HF_FILES
from rlpo_mega.config import LoRAConfig, ModelConfig, ParallelConfig
from rlpo_mega.model_setup import build_policy
from rlpo_mega.checkpoint.run import latest_checkpoint

CONVERTED = "dist_checkpoint"  # the output kind of `convert` (moe/bridge/outputs.py)


def convert(hf_dir: str, out_dir: str, tp: int = 1, pp: int = 1, ep: int = 1, etp: int = 1,
            overwrite: bool = False):
    """out_dir: absent or empty, or (overwrite) an earlier `convert` output; nothing else is replaced."""
    outputs.check_target(out_dir, CONVERTED, overwrite)
    hf = load_hf_config(os.path.join(hf_dir, "config.json"))
    HFCheckpoint(hf_dir).validate(hf)  # fail before any process group or output exists
    parallel = ParallelConfig(tensor=tp, pipeline=pp, expert=ep, expert_tensor=etp)
    layout = distributed.init(parallel, hf)
    chunks, _ = build_policy(hf, layout, ModelConfig(init_from_hf=hf_dir), None, with_ddp=False)
    files = {outputs.MARKER: outputs.marker_bytes(CONVERTED)}
    for name in ("config.json",) + PASSTHROUGH:  # inside the checkpoint before its rename: never half there
        if os.path.isfile(os.path.join(hf_dir, name)):
            with open(os.path.join(hf_dir, name), "rb") as f:
                files[f"{HF_FILES}/{name}"] = f.read()
    save_checkpoint(out_dir, chunks, meta={"model_type": hf.model_type, "model": get_family(hf.model_type).identity(hf),
                                           "source": os.path.abspath(hf_dir)},
                    files=files)
    distributed.destroy()


def _finished(ckpt_dir: str) -> str:
    """A finished checkpoint directory: `ckpt_dir` itself, or a trainer save_dir's latest step."""
    if os.path.isdir(ckpt_dir) and not os.path.isfile(os.path.join(ckpt_dir, META)):
        ckpt_dir = latest_checkpoint(ckpt_dir) or ckpt_dir  # a trainer's save_dir: its latest step
    if os.path.isdir(ckpt_dir) and not os.path.isfile(os.path.join(ckpt_dir, META)):
        raise CheckpointError(f"--ckpt {ckpt_dir} is not a finished checkpoint ({META} missing): pass a step_<N> "
                              "directory, a trainer's save_dir or a `rlpo-mega convert` output")
    return ckpt_dir


def _checkpoint_hf(ckpt_dir: str):
    hf_files = os.path.join(ckpt_dir, HF_FILES)
    if not os.path.isfile(os.path.join(hf_files, "config.json")):
        raise FileNotFoundError(f"{ckpt_dir!r} has no {HF_FILES}/config.json; it was not written by "
                                "`rlpo-mega convert` or a trainer with an HF model")
    return load_hf_config(os.path.join(hf_files, "config.json")), hf_files


def export_peft(ckpt_dir: str, peft_out: str, overwrite: bool = False) -> str:
    """A LoRA run's adapters as a PEFT adapter directory (moe/bridge/peft.py), read whole from the checkpoint in this
    one process (no model, no process group: a few MB at any layout it was saved at). Returns the checkpoint used."""
    outputs.check_target(peft_out, peft.KIND, overwrite)  # before any work
    ckpt_dir = _finished(ckpt_dir)
    meta = read_meta(ckpt_dir)
    lora = (meta.get("settings") or {}).get("model.lora")
    if not lora:
        raise CheckpointError(f"--peft-out: {ckpt_dir} was saved without model.lora (no adapters to export); "
                              "export its weights with --hf-out")
    hf, _ = _checkpoint_hf(ckpt_dir)
    factors = read_whole(ckpt_dir, is_lora_param)
    config, tensors = peft.adapter(hf, lora["rank"], lora["alpha"], lora["targets"], factors,
                                   base=(meta.get("base") or {}).get("path"))
    peft.write_dir(peft_out, config, tensors, overwrite)
    return ckpt_dir


def export(ckpt_dir: str, hf_out: str, tp: int = 1, pp: int = 1, ep: int = 1, bucket_mb: int = 256,
           overwrite: bool = False, base: str | None = None):
    """hf_out: absent or empty, or (overwrite) an earlier HF export; nothing else is replaced. base: the HF base of an
    adapter-only LoRA checkpoint (None: the one its meta records), refused unless it holds the weights trained on."""
    outputs.check_target(hf_out, HFCheckpointWriter.KIND, overwrite)  # on every rank, before any collective

    ckpt_dir = _finished(ckpt_dir)
    meta = read_meta(ckpt_dir)
    lora = (meta.get("settings") or {}).get("model.lora")
    if meta.get("adapters_only"):  # a LoRA run's adapters: merged onto the base they were trained on, rebuilt first
        base = base or (meta.get("base") or {}).get("path")
        check_base(ckpt_dir, meta, base, what="--base")
    else:
        base = None
    hf, hf_files = _checkpoint_hf(ckpt_dir)
    layout = distributed.init(ParallelConfig(tensor=tp, pipeline=pp, expert=ep, expert_tensor=1), hf)
    # a LoRA run's checkpoint: its adapters rebuilt and loaded, the export merges them (the base alone otherwise)
    chunks, _ = build_policy(hf, layout, ModelConfig(lora=LoRAConfig(**lora) if lora else LoRAConfig(),
                                                     init_from_hf=base), None, with_ddp=False)
    load_checkpoint(ckpt_dir, chunks)
    stream = ExportStream(chunks, bucket_bytes=bucket_mb << 20, dst=0)
    write_stream(stream, HFCheckpointWriter(hf_out, hf, source_dir=hf_files, overwrite=overwrite)
                 if stream.receives else None)
    if stream.receives:
        with open(os.path.join(hf_out, "rlpo_digests.json"), "w") as f:
            json.dump(stream.digests, f, indent=0)
    distributed.destroy()
