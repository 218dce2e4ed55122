"""Advantage-estimator registry (grpo, dr_grpo, rloo) over groups of responses to the same prompt.

An estimator maps (rewards [n], group index [n] in 0..g-1, config, **extra) to advantages: [n] (one per
sequence, broadcast to its tokens later) or [n, s] (per token: the hook for token-level estimators, which
receive the batch's extra tensors such as a response mask through **extra). A group whose rewards are all
equal gets exactly zero advantage (not rounding noise divided by eps) and is counted (for per-token
estimators it is only counted).
Computed in float64: group statistics are cheap and must not depend on summation order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .registry import Registry
from .shaping import overlong_filter, soft_overlong_punishment

ADVANTAGES: Registry = Registry("advantage estimator")
STD_ESTIMATORS = ("unbiased", "biased")


@dataclass
class AdvantageResult:
    advantages: torch.Tensor  # [n] or [n, s], float32
    num_groups: int
    num_zero_groups: int  # all rewards equal: zero advantage, no gradient (DAPO's dynamic sampling)


def group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Any group labels [n] -> (index in 0..g-1, g)."""
    uniq, inv = torch.unique(group_ids, return_inverse=True)
    return inv, len(uniq)


def contiguous_groups(n: int, group_size: int) -> torch.Tensor:
    if group_size < 1 or n % group_size:
        raise ValueError(f"{n} samples do not split into groups of {group_size}")
    return torch.arange(n) // group_size


def _group_stats(r, idx, g):
    count = torch.zeros(g, dtype=r.dtype).index_add_(0, idx, torch.ones_like(r))
    mean = torch.zeros(g, dtype=r.dtype).index_add_(0, idx, r) / count
    sq = torch.zeros(g, dtype=r.dtype).index_add_(0, idx, (r - mean[idx]) ** 2)
    rmax = torch.full((g,), -torch.inf, dtype=r.dtype).scatter_reduce_(0, idx, r, "amax")
    rmin = torch.full((g,), torch.inf, dtype=r.dtype).scatter_reduce_(0, idx, r, "amin")
    return count, mean, sq, rmax == rmin


@ADVANTAGES.register("grpo")
def grpo(r, idx, g, cfg, **_):
    """(R_i - mean) / (std + eps); std unbiased (torch.std, DeepSeekMath/TRL) or biased (population)."""
    count, mean, sq, _ = _group_stats(r, idx, g)
    ddof = 1 if cfg.std == "unbiased" else 0
    std = torch.where(count > ddof, (sq / (count - ddof).clamp(min=1)).sqrt(), torch.zeros_like(sq))
    return (r - mean[idx]) / (std[idx] + cfg.eps)


@ADVANTAGES.register("dr_grpo")
def dr_grpo(r, idx, g, cfg, **_):
    """Dr. GRPO: R_i - mean, no division by the std."""
    _, mean, _, _ = _group_stats(r, idx, g)
    return r - mean[idx]


@ADVANTAGES.register("rloo")
def rloo(r, idx, g, cfg, **_):
    """RLOO: R_i - mean of the other G - 1 rewards of its group."""
    count, mean, _, _ = _group_stats(r, idx, g)
    if int(count.min()) < 2:
        raise ValueError("rloo needs at least 2 responses per group (leave-one-out baseline)")
    total = mean * count
    return r - (total[idx] - r) / (count[idx] - 1)


@ADVANTAGES.register("gae")
def gae_from_critic(r, idx, g, cfg, **_):
    """GAE needs the critic's values: the step passes the (shaped) sequence rewards on and computes
    advantages after the value pass (rlpo_mega.training.critic, rlpo_mega.algorithms.gae)."""
    raise ValueError("advantage.name=gae is computed from the critic's values (training/critic.py), "
                     "not from the rewards alone")


CRITIC_ESTIMATORS = ("gae",)  # estimators that need the value model


def check_config(cfg):
    ADVANTAGES.get(cfg.name)
    if cfg.std not in STD_ESTIMATORS:
        raise ValueError(f"advantage.std={cfg.std!r}; choose one of {', '.join(STD_ESTIMATORS)}")
    if not cfg.eps >= 0:
        raise ValueError(f"advantage.eps={cfg.eps} must be >= 0")
    if not (0.0 <= cfg.gamma <= 1.0 and 0.0 <= cfg.lam <= 1.0):
        raise ValueError(f"advantage.gamma={cfg.gamma} and advantage.lam={cfg.lam} must lie in [0, 1]")


def compute_advantages(cfg, rewards: torch.Tensor, group_ids: torch.Tensor, **extra) -> AdvantageResult:
    """cfg: AdvantageConfig (name, eps, std). rewards and group_ids: [n]."""
    check_config(cfg)
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must both be [n]")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards contain NaN or inf")
    r = rewards.detach().double().cpu()
    idx, g = group_index(group_ids.cpu())
    adv = ADVANTAGES.get(cfg.name)(r, idx, g, cfg, **extra)
    if adv.shape[0] != r.shape[0] or adv.dim() not in (1, 2):
        raise ValueError(f"advantage estimator {cfg.name!r} returned shape {tuple(adv.shape)}; "
                         f"expected [{r.shape[0]}] or [{r.shape[0]}, seq]")
    zero = _group_stats(r, idx, g)[3]
    if adv.dim() == 1:  # per-token estimators own their token rewards: only sequence values are forced
        adv = torch.where(zero[idx], torch.zeros_like(adv), adv.double())
    if not torch.isfinite(adv).all():
        raise ValueError(f"advantage estimator {cfg.name!r} produced NaN or inf")
    return AdvantageResult(adv.float().to(rewards.device), g, int(zero.sum()))


def sequence_advantages(cfg, rewards: torch.Tensor, group_ids: torch.Tensor, lengths: torch.Tensor,
                        truncated: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Per-sample scalars -> (advantages [n], rows kept in the loss [n] bool, stats): DAPO's shaping (soft
    overlong punishment on the reward, overlong filtering) and the advantage estimator. Needs nothing but
    scalars, so every rank computes it for the whole batch (the samples themselves stay sharded)."""
    stats = {}
    rewards = rewards.float()
    sh = cfg.shaping
    if sh.soft_overlong:
        if sh.max_response_length is None or sh.overlong_cache is None:
            raise ValueError("shaping.soft_overlong needs shaping.max_response_length and shaping.overlong_cache")
        penalty = soft_overlong_punishment(lengths, sh.max_response_length, sh.overlong_cache)
        stats["overlong_penalty_mean"] = float(penalty.mean())
        rewards = rewards + penalty
    if cfg.advantage.name in CRITIC_ESTIMATORS:  # advantages come after the critic's value pass: the
        adv = AdvantageResult(rewards, int(group_ids.unique().numel()), 0)  # shaped rewards travel in their place
    else:
        adv = compute_advantages(cfg.advantage, rewards, group_ids)
    stats.update(groups=adv.num_groups, zero_advantage_groups=adv.num_zero_groups)
    keep = torch.ones(rewards.shape[0], dtype=torch.bool)
    if sh.overlong_filter:
        if truncated is None:
            raise ValueError("shaping.overlong_filter needs the truncated flags (finish reason 'length')")
        keep = overlong_filter(keep[:, None], truncated)[:, 0]
        stats["overlong_filtered"] = int(truncated.bool().sum())
    return adv.advantages, keep, stats
