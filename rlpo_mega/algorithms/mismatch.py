"""Rollout/train mismatch: importance corrections over w = pi_old_train / pi_rollout, and its metrics.

The rollout engine and the trainer give different log-probs for the same weights; the samples come from
pi_rollout, so the policy loss is reweighted towards pi_old_train:
- TIS: multiply the token loss by min(w, C) (a constant: no gradient flows through w).
- MIS (IcePop): drop tokens whose w is outside [C_min, C_max] from the loss and from its counts.
Levels: "token" (w_it), "sequence" (product over the sequence, exp sum_t log w_it), "geometric"
(exp mean_t log w_it); a sequence weight applies to every token of its sequence.
Metrics (token level, always): k3 estimate of KL(pi_rollout || pi_old_train) = w - 1 - log w (samples
come from the rollout policy), and max / mean |w - 1|.
"""
from __future__ import annotations

import torch

from .losses import metric
from rlpo_mega.reductions import Stat

MODES = ("none", "tis", "mis")
LEVELS = ("token", "sequence", "geometric")


def check_config(cfg):
    if cfg.mode not in MODES:
        raise ValueError(f"unknown mismatch correction {cfg.mode!r}; known: {', '.join(MODES)}")
    if cfg.level not in LEVELS:
        raise ValueError(f"unknown mismatch level {cfg.level!r}; known: {', '.join(LEVELS)}")
    if not cfg.tis_cap > 0:
        raise ValueError(f"mismatch.tis_cap={cfg.tis_cap} must be > 0")
    if not 0 <= cfg.mis_low <= cfg.mis_high:
        raise ValueError(f"mismatch bounds must satisfy 0 <= mis_low <= mis_high, got "
                         f"[{cfg.mis_low}, {cfg.mis_high}]")


def log_weights(old_logp, rollout_logp, mask, level: str):
    lw = torch.where(mask, old_logp - rollout_logp, torch.zeros_like(old_logp))
    if level == "token":
        return lw
    total = lw.sum(dim=1, keepdim=True)
    if level == "geometric":
        total = total / mask.sum(dim=1, keepdim=True).clamp(min=1)
    return total.expand_as(lw)


def mismatch_metrics(old_logp, rollout_logp, mask) -> dict:
    lw = torch.where(mask, old_logp - rollout_logp, torch.zeros_like(old_logp)).detach().double()
    w = torch.exp(lw)
    dev = (w - 1).abs()
    # 0 when no token is valid, as the masked max already gives: no host sync to ask mask.any()
    dev_max = torch.where(mask, dev, torch.zeros_like(dev)).max() if dev.numel() else dev.new_zeros(())
    return {"mismatch/k3_kl": metric(w - 1 - lw, mask), "mismatch/ratio_dev_mean": metric(dev, mask),
            Stat("mismatch/ratio_dev_max", "max"): dev_max.reshape(1)}


def apply_correction(loss, mask, old_logp, rollout_logp, cfg):
    """(loss, mask, metrics): the per-token loss reweighted (TIS) or the mask reduced (MIS)."""
    check_config(cfg)
    metrics = mismatch_metrics(old_logp, rollout_logp, mask)
    if cfg.mode == "none":
        return loss, mask, metrics
    w = torch.exp(log_weights(old_logp, rollout_logp, mask, cfg.level).detach())
    if cfg.mode == "tis":
        metrics["mismatch/tis_truncated_frac"] = metric((w > cfg.tis_cap).double(), mask)
        return loss * w.clamp(max=cfg.tis_cap), mask, metrics
    keep = (w >= cfg.mis_low) & (w <= cfg.mis_high)
    metrics["mismatch/mis_masked_frac"] = metric((~keep).double(), mask)
    return loss, mask & keep, metrics
