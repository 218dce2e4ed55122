"""The padded global-batch path, for tests and benchmarks only (in tools/: a benchmark imports no test module):
the whole rollout batch as one padded host batch on every rank (assemble_batch), this DP rank's share as
micro-batches with the old/reference log-probs (prepare_micro_batches). The trainer's path is packed or padded per
rank, from the exchange (rlpo_mega/training/batches.py); the layout parity tests compare both against this
single-process reference. `prepare_step`: the trainer's advantages + plan-and-exchange phases in one call, for the
parity workers.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from rlpo_mega.algorithms.advantages import sequence_advantages
from rlpo_mega.logging import PhaseTimer
from rlpo_mega.training.batches import plan_and_exchange
from rlpo_mega.training.batches import MicroBatch
from rlpo_mega.training.old_logprobs import attach_old_logprobs
from rlpo_mega.training.warmup import shard_and_split


def assemble_batch(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], rewards: torch.Tensor,
                   group_ids: torch.Tensor, cfg, *, seq_length: Optional[int] = None,
                   truncated: Optional[torch.Tensor] = None, rollout_logps: Optional[Sequence] = None,
                   pad_id: int = 0) -> tuple[dict, dict]:
    """Rollout samples -> (global batch, stats): shaping, advantages, padding, masks.

    rollout_logps: per-sample log-probs of the response tokens from the rollout engine (optional).
    seq_length: model input length (default: the longest prompt + response - 1).
    """
    n = len(prompts)
    if not (len(responses) == n == rewards.shape[0] == group_ids.shape[0]):
        raise ValueError(f"{n} prompts, {len(responses)} responses, {rewards.shape[0]} rewards and "
                         f"{group_ids.shape[0]} group ids: one of each per sample")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every sample needs a non-empty prompt (its first response token is predicted from it)")
    lengths = torch.tensor([len(r) for r in responses])
    total = max(len(p) + len(r) for p, r in zip(prompts, responses))
    seq_length = seq_length or total - 1
    if seq_length + 1 < total:
        raise ValueError(f"seq_length={seq_length} is shorter than the longest sample ({total} tokens) - 1")
    advantages, keep, stats = sequence_advantages(cfg, rewards, group_ids, lengths, truncated)
    seq = torch.full((n, seq_length + 1), pad_id, dtype=torch.long)
    resp = torch.zeros((n, seq_length + 1), dtype=torch.bool)
    roll = torch.zeros((n, seq_length)) if rollout_logps is not None else None
    for i, (p, r) in enumerate(zip(prompts, responses)):
        seq[i, :len(p) + len(r)] = torch.tensor(list(p) + list(r), dtype=torch.long)
        resp[i, len(p):len(p) + len(r)] = True
        if roll is not None:
            if len(rollout_logps[i]) != len(r):
                raise ValueError(f"sample {i}: {len(rollout_logps[i])} rollout log-probs for {len(r)} tokens")
            roll[i, len(p) - 1:len(p) - 1 + len(r)] = torch.as_tensor(rollout_logps[i], dtype=torch.float)
    mask = resp[:, 1:] & keep[:, None]
    batch = MicroBatch(tokens=seq[:, :-1].contiguous(), labels=seq[:, 1:].contiguous(), loss_mask=mask,
                       advantages=advantages)
    if roll is not None:
        batch.rollout_logp = roll
    return batch, stats


def prepare_micro_batches(model_chunks, batch: dict, cfg, num_micro_batches: int, ref_chunks=None,
                          routing=None) -> list[dict]:
    """This DP rank's share of the global `batch` (same on every rank, on the host) as micro-batches on
    platform.device(), with the old (and, for a KL term, reference) log-probs from forward-only passes:
    run once per rollout batch, before any update of the policy. routing: a moe.routing.replay.RoutingReplay
    (r2 records the old pass's routes, r3 replays the rollout's; attached routes join the batch's device)."""
    return attach_old_logprobs(model_chunks, shard_and_split(batch, num_micro_batches), cfg, ref_chunks, routing)


def prepare_step(samples, group_ids, cfg, dp: int, tp: int, recipients, spec, pad_id: int, timer=None):
    """The trainer's advantages and plan-and-exchange phases in one call (as Trainer.train_step runs them):
    (this rank's micro-batches per mini-batch, advantages [n], stats)."""
    adv, keep, stats = sequence_advantages(
        cfg.algorithm, torch.tensor([s.reward for s in samples]), group_ids,
        torch.tensor([s.response_len for s in samples]), torch.tensor([s.finish_reason == "length" for s in samples]))
    minis, plan_stats = plan_and_exchange(samples, adv, keep, cfg, dp, tp, recipients, spec, pad_id,
                                          timer if timer is not None else PhaseTimer(cuda_sync=False))
    return minis, adv, {**stats, **plan_stats}
