"""Loss aggregation over a batch, normalised by GLOBAL counts.

Every mode is written as (local numerator, local integer count) per micro-batch; the global loss is
sum(numerators) / sum(counts) over all micro-batches and data-parallel ranks. Megatron does exactly that
with calculate_per_token_loss=True (the schedule sums the counts over micro-batches and
finalize_model_grads all-reduces them over DP before dividing the gradients), so splitting a batch into
micro-batches or DP ranks never changes the gradient, for every mode:

- token-mean (DAPO):             sum_it m l / sum_it m                  count = valid tokens
- seq-mean-token-mean (GRPO, GSPO, SAPO): mean_i (sum_t m l / sum_t m)  count = sequences with a valid token
- seq-mean-token-sum-norm (Dr. GRPO): sum_it m l / (G * L)              count = sequences (rows), L constant

Rows are whole sequences (no packing), so a sequence's token count is its row's mask sum and never spans
two micro-batches. A fully masked row (e.g. an overlong-filtered sample) is not a sequence of the
seq-mean-token-mean denominator (no 0/0), but stays one of the G of the token-sum-norm (a constant).
"""
from __future__ import annotations

from typing import Optional

import torch

TOKEN_MEAN = "token-mean"
SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
SEQ_MEAN_TOKEN_SUM_NORM = "seq-mean-token-sum-norm"
MODES = (TOKEN_MEAN, SEQ_MEAN_TOKEN_MEAN, SEQ_MEAN_TOKEN_SUM_NORM)


def check_mode(mode: str, norm_length: Optional[int] = None):
    if mode not in MODES:
        raise ValueError(f"unknown loss aggregation {mode!r}; known: {', '.join(MODES)}")
    if mode == SEQ_MEAN_TOKEN_SUM_NORM and (norm_length is None or norm_length < 1):
        raise ValueError(f"{SEQ_MEAN_TOKEN_SUM_NORM} needs a constant length L >= 1 (the generation budget, "
                         f"algorithm.loss.norm_length), got {norm_length}")


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: str, norm_length: Optional[int] = None):
    """(numerator: scalar tensor with grad, count: int tensor) of per-token `loss` [b, s] under `mask`."""
    check_mode(mode, norm_length)
    if loss.shape != mask.shape or loss.dim() != 2:
        raise ValueError(f"loss {tuple(loss.shape)} and mask {tuple(mask.shape)} must both be [batch, seq]")
    m = mask.to(loss.dtype)
    # where(): a masked position's loss may be inf/nan (garbage log-probs of padding) and must not leak.
    masked = torch.where(mask.bool(), loss, torch.zeros_like(loss))
    if mode == TOKEN_MEAN:
        return masked.sum(), mask.bool().sum().to(torch.int)
    per_seq = masked.sum(dim=1)
    if mode == SEQ_MEAN_TOKEN_MEAN:
        n = m.sum(dim=1)
        has = n > 0
        return (per_seq / n.clamp(min=1)).sum(), has.sum().to(torch.int)
    # the count on the loss's device, like the other modes' (the report stacks it with the numerator)
    return per_seq.sum() / float(norm_length), torch.tensor(loss.shape[0], dtype=torch.int, device=loss.device)


def global_mean(parts) -> torch.Tensor:
    """The global loss from [(numerator, count), ...] of all micro-batches (single process)."""
    total = sum(p[0] for p in parts)
    count = sum(int(p[1]) for p in parts)
    return total / max(count, 1)
