"""Policy-loss registry: one small function per loss, exactly as its paper defines it (minimised form).

Every loss takes per-token tensors [b, s] (new log-probs with grad, old log-probs, advantages broadcast
to tokens, boolean mask) and its resolved parameters, and returns a per-token loss [b, s]; a
sequence-level loss (GSPO) puts its sequence's value on each of its valid tokens, so that
seq-mean-token-mean gives the paper's mean over sequences. Aggregation is separate (aggregation.py).

Metrics are (sum, count) pairs over valid tokens, summed over micro-batches and ranks before dividing:
clip fractions by direction (the tokens whose gradient the clip zeroes), mean ratio, SAPO gate statistics.

Numerical guard (not in the papers): token log-ratios are clamped to +-20 before exp (verl does the same);
it only acts where r > 4.8e8 or r < 2e-9, and keeps a garbage log-prob from turning into inf * 0 = nan.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from .aggregation import SEQ_MEAN_TOKEN_MEAN, SEQ_MEAN_TOKEN_SUM_NORM, TOKEN_MEAN
from .registry import Registry

LOG_RATIO_GUARD = 20.0


@dataclass(frozen=True)
class LossParams:
    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip: Optional[float] = None
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    log_ratio_clamp: float = 10.0


@dataclass(frozen=True)
class LossSpec:
    fn: Callable
    aggregation: str  # the paper's default
    eps_low: Optional[float] = None  # paper defaults for the clip range (None: no clip)
    eps_high: Optional[float] = None
    symmetric: bool = False  # one eps for both sides (ppo_clip / grpo)
    per_sequence_advantage: bool = False  # needs one advantage per sequence
    pitfalls: dict = field(default_factory=dict)  # aggregation -> why it is wrong for this loss


LOSSES: Registry[LossSpec] = Registry("policy loss")


def register_loss(*names, **spec):
    def wrap(fn):
        LOSSES.register(*names)(LossSpec(fn=fn, **spec))
        return fn

    return wrap


def metric(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[sum over valid tokens, number of valid tokens] (detached, float64 so large sums stay exact)."""
    v = torch.where(mask, values.detach(), torch.zeros_like(values)).double()
    return torch.stack([v.sum(), mask.sum().double()])


def log_ratio(logp, old_logp, mask):
    lr = torch.where(mask, logp - old_logp, torch.zeros_like(logp))
    return lr.clamp(-LOG_RATIO_GUARD, LOG_RATIO_GUARD)


def _clip_metrics(ratio, adv, mask, p: LossParams) -> dict:
    # Tokens where -min(rA, clip(r)A) takes the clipped (constant) branch: zero gradient.
    high = (adv > 0) & (ratio > 1 + p.eps_high)
    low = (adv < 0) & (ratio < 1 - p.eps_low)
    return {"clip_frac_high": metric(high.double(), mask), "clip_frac_low": metric(low.double(), mask),
            "ratio_mean": metric(ratio, mask)}


def _clipped_surrogate(ratio, adv, p: LossParams):
    """-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), plus the optional dual clip for A < 0."""
    loss = -torch.minimum(ratio * adv, ratio.clamp(1 - p.eps_low, 1 + p.eps_high) * adv)
    if p.dual_clip is not None:  # Ye et al. 2020: objective max(min(...), c A) when A < 0
        loss = torch.where(adv < 0, torch.minimum(loss, -p.dual_clip * adv), loss)
    return loss


def _token_clip_loss(logp, old_logp, adv, mask, p: LossParams):
    ratio = torch.exp(log_ratio(logp, old_logp, mask))
    metrics = _clip_metrics(ratio, adv, mask, p)
    if p.dual_clip is not None:
        metrics["dual_clip_frac"] = metric(((adv < 0) & (ratio > p.dual_clip)).double(), mask)
    return _clipped_surrogate(ratio, adv, p), metrics


_LENGTH_WEIGHTED = ("makes the sequence-level loss length-weighted: each sequence's term counts once per "
                    "token, so long responses dominate (the GSPO paper averages over sequences; use "
                    "seq-mean-token-mean)")


@register_loss("ppo_clip", aggregation=TOKEN_MEAN, eps_low=0.2, eps_high=0.2, symmetric=True)
def ppo_clip(logp, old_logp, adv, mask, p: LossParams):
    """PPO / GRPO token loss: r_it = exp(logp - old), l = -min(r A, clip(r, 1-eps, 1+eps) A)."""
    return _token_clip_loss(logp, old_logp, adv, mask, p)


@register_loss("grpo", aggregation=SEQ_MEAN_TOKEN_MEAN, eps_low=0.2, eps_high=0.2, symmetric=True)
def grpo(logp, old_logp, adv, mask, p: LossParams):
    """GRPO (DeepSeekMath): the PPO clip per token, averaged per sequence then over sequences."""
    return _token_clip_loss(logp, old_logp, adv, mask, p)


@register_loss("dapo", aggregation=TOKEN_MEAN, eps_low=0.2, eps_high=0.28)
def dapo(logp, old_logp, adv, mask, p: LossParams):
    """DAPO: the token clip with clip-higher (eps_low=0.2, eps_high=0.28), token-mean, no KL."""
    return _token_clip_loss(logp, old_logp, adv, mask, p)


def _sequence_advantage(adv, mask):
    n = mask.sum(dim=1).clamp(min=1)
    return torch.where(mask, adv, torch.zeros_like(adv)).sum(dim=1) / n


@register_loss("gspo", aggregation=SEQ_MEAN_TOKEN_MEAN, eps_low=3e-4, eps_high=4e-4,
               per_sequence_advantage=True,
               pitfalls={TOKEN_MEAN: _LENGTH_WEIGHTED, SEQ_MEAN_TOKEN_SUM_NORM: _LENGTH_WEIGHTED})
def gspo(logp, old_logp, adv, mask, p: LossParams):
    """GSPO: s_i = exp(mean_t log r_it) (clamped in log space), l_i = -min(s_i A_i, clip(s_i) A_i)."""
    n = mask.sum(dim=1).clamp(min=1)
    mean_lr = log_ratio(logp, old_logp, mask).sum(dim=1) / n
    s = torch.exp(mean_lr.clamp(-p.log_ratio_clamp, p.log_ratio_clamp))
    a = _sequence_advantage(adv, mask)
    loss_seq = _clipped_surrogate(s, a, p)
    return loss_seq[:, None].expand_as(logp), _clip_metrics(s[:, None].expand_as(logp), adv, mask, p)


@register_loss("gspo_token", aggregation=SEQ_MEAN_TOKEN_MEAN, eps_low=3e-4, eps_high=4e-4,
               pitfalls={TOKEN_MEAN: _LENGTH_WEIGHTED, SEQ_MEAN_TOKEN_SUM_NORM: _LENGTH_WEIGHTED})
def gspo_token(logp, old_logp, adv, mask, p: LossParams):
    """GSPO-token: s_it = sg[s_i] exp(logp_it - sg[logp_it]); allows per-token advantages.

    Clamped like GSPO (the clamp acts on the value sg[log s_i], so a clamped sequence has zero
    gradient in both forms).
    """
    n = mask.sum(dim=1).clamp(min=1)
    lr = log_ratio(logp, old_logp, mask)
    mean_lr = (lr.sum(dim=1) / n).detach()
    log_s = (logp - logp.detach()) + mean_lr[:, None]
    s = torch.exp(log_s.clamp(-p.log_ratio_clamp, p.log_ratio_clamp))
    return _clipped_surrogate(s, adv, p), _clip_metrics(s, adv, mask, p)


@register_loss("sapo", aggregation=SEQ_MEAN_TOKEN_MEAN)
def sapo(logp, old_logp, adv, mask, p: LossParams):
    """SAPO: l_it = -f(r_it; tau_i) A_i, f(x; tau) = sigmoid(tau (x - 1)) 4 / tau, tau by the sign of A.

    No hard clip; the gradient weight 4 p (1 - p) r (p = sigmoid(tau (r - 1))) is exactly 1 at r = 1.
    """
    ratio = torch.exp(log_ratio(logp, old_logp, mask))
    tau = torch.where(adv > 0, torch.full_like(adv, p.tau_pos), torch.full_like(adv, p.tau_neg))
    sig = torch.sigmoid(tau * (ratio - 1))
    gate = sig * 4 / tau
    weight = 4 * sig * (1 - sig) * ratio
    metrics = {"ratio_mean": metric(ratio, mask), "gate_mean": metric(gate, mask),
               "gate_weight_mean": metric(weight, mask),
               "gate_weight_below_half_frac": metric((weight < 0.5).double(), mask)}
    return -gate * adv, metrics
