"""DAPO dynamic sampling, as a pure filter over groups (the trainer's over-sampling loop calls it).

A group whose scores are all equal (for accuracy: all wrong or all right) has zero advantage and gives
no gradient; it is dropped and counted by kind.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .advantages import group_index


@dataclass
class GroupFilter:
    keep: torch.Tensor  # [n] bool, per sample
    num_groups: int
    kept_groups: int
    dropped_all_zero: int  # accuracy 0 (every response wrong)
    dropped_all_one: int  # accuracy 1 (every response right)
    dropped_other_constant: int  # equal non-binary scores (e.g. shaped rewards)

    def stats(self) -> dict:
        return {"groups": self.num_groups, "kept_groups": self.kept_groups,
                "dropped_all_zero": self.dropped_all_zero, "dropped_all_one": self.dropped_all_one,
                "dropped_other_constant": self.dropped_other_constant}


def filter_groups(scores: torch.Tensor, group_ids: torch.Tensor) -> GroupFilter:
    """Keep the samples of groups with 0 < #correct < G (more generally: non-constant scores)."""
    if scores.dim() != 1 or group_ids.shape != scores.shape:
        raise ValueError(f"scores {tuple(scores.shape)} and group_ids {tuple(group_ids.shape)} must both be [n]")
    if torch.isnan(scores).any():
        raise ValueError("scores contain NaN")
    s = scores.detach().double().cpu()
    idx, g = group_index(group_ids.cpu())
    smax = torch.full((g,), -torch.inf, dtype=s.dtype).scatter_reduce_(0, idx, s, "amax")
    smin = torch.full((g,), torch.inf, dtype=s.dtype).scatter_reduce_(0, idx, s, "amin")
    constant = smax == smin
    zero, one = constant & (smax == 0), constant & (smax == 1)
    return GroupFilter(keep=~constant[idx].to(scores.device), num_groups=g, kept_groups=int((~constant).sum()),
                       dropped_all_zero=int(zero.sum()), dropped_all_one=int(one.sum()),
                       dropped_other_constant=int((constant & ~zero & ~one).sum()))
