"""Reward shaping from DAPO: soft overlong punishment (added to the reward) and overlong filtering."""
from __future__ import annotations

import torch


def soft_overlong_punishment(lengths: torch.Tensor, max_length: int, cache_length: int) -> torch.Tensor:
    """R_len(y): 0 if |y| <= L_max - L_cache; ((L_max - L_cache) - |y|) / L_cache up to L_max; -1 beyond.

    lengths: [n] response lengths; returns float32 [n] to add to the task reward.
    """
    if not 0 < cache_length <= max_length:
        raise ValueError(f"soft overlong punishment needs 0 < L_cache <= L_max, got L_cache={cache_length}, "
                         f"L_max={max_length}")
    if (lengths < 0).any():
        raise ValueError("response lengths must be >= 0")
    y = lengths.double()
    free = max_length - cache_length
    ramp = (free - y) / cache_length
    out = torch.where(y <= free, torch.zeros_like(y), torch.where(y <= max_length, ramp, -torch.ones_like(y)))
    return out.float()


def overlong_filter(mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """Overlong filtering: truncated samples (finish reason "length") leave the loss entirely."""
    if truncated.shape != mask.shape[:1]:
        raise ValueError(f"truncated flags {tuple(truncated.shape)} must be [batch={mask.shape[0]}]")
    return mask & ~truncated.bool()[:, None]
