"""The foundation's main job: real optimizer steps of the tiny MoE policy on synthetic tokens.

It exercises everything the RL loop stands on (platform, layout, megatron schedule, DDP, optimizer,
dist checkpoint) and is replaced by the RL trainer when that lands.
"""
from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from moe.model import load_hf_config
from rlpo_mega import distributed
from rlpo_mega.checkpoint import load_checkpoint, save_checkpoint
from rlpo_mega.training.model_setup import build_policy
from rlpo_mega.training.step import data_parallel_shard, split_micro_batches, train_step

log = logging.getLogger("rlpo_mega")


def synthetic_batch(step: int, seed: int, vocab: int, batch: int, seq: int) -> torch.Tensor:
    """A learnable toy stream: each sequence counts up from a random start (mod vocab)."""
    g = torch.Generator().manual_seed(seed * 100003 + step)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    return (start + torch.arange(seq + 1)) % vocab


def run(cfg) -> list[dict]:
    hf = load_hf_config(cfg.model.hf_config)
    layout = distributed.init(cfg.parallel, hf, cfg.seed)
    rank = dist.get_rank()
    chunks, optimizer = build_policy(hf, layout, cfg.model, cfg.optim)
    if cfg.checkpoint.load_dir:
        load_checkpoint(cfg.checkpoint.load_dir, chunks, optimizer)
    if rank == 0:
        log.info("layout TP%d PP%d EP%d ETP%d DP%d SP=%s, model %s", layout.tensor, layout.pipeline,
                 layout.expert, layout.expert_tensor, layout.data, layout.sequence_parallel, hf.model_type)
    history = []
    for step in range(cfg.train_iters):
        t0 = time.perf_counter()
        tokens = synthetic_batch(step, cfg.seed, hf.vocab_size, cfg.data.global_batch_size,
                                 cfg.data.seq_length)
        micro = split_micro_batches(data_parallel_shard(tokens), cfg.parallel.num_micro_batches)
        out = train_step(chunks, optimizer, micro)
        out["step"] = step
        out["seconds"] = time.perf_counter() - t0
        history.append(out)
        if rank == 0:
            log.info("step %d loss %.5f grad_norm %.4f (%.2fs)", step, out["loss"], out["grad_norm"],
                     out["seconds"])
    if cfg.checkpoint.save_dir:
        save_checkpoint(cfg.checkpoint.save_dir, chunks, optimizer,
                        meta={"step": cfg.train_iters, "model_type": hf.model_type})
        if rank == 0:
            log.info("saved checkpoint to %s", cfg.checkpoint.save_dir)
    distributed.destroy()
    return history
