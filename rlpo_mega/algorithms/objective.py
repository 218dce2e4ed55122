"""The policy objective of one micro-batch: loss registry + KL + mismatch correction + aggregation.

`policy_objective` returns what megatron's forward_step contract wants from a loss function:
(numerator, integer count, report), with the global loss = sum numerators / sum counts over all
micro-batches and DP ranks (see aggregation.py). Pure tensors, no megatron: unit-testable as is.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from . import advantages as adv_mod
from . import mismatch as mismatch_mod
from .aggregation import aggregate, check_mode
from .kl import KL_ESTIMATORS, kl_penalty
from .losses import LOSSES, LossParams, LossSpec, metric


class AggregationPitfallWarning(UserWarning):
    pass


@dataclass(frozen=True)
class ResolvedLoss:
    name: str
    spec: LossSpec
    params: LossParams
    aggregation: str
    norm_length: Optional[int]


def resolve_loss(cfg) -> ResolvedLoss:
    """PolicyLossConfig -> the loss with its paper defaults filled in; bad values fail here, early."""
    spec = LOSSES.get(cfg.name)
    eps_low = spec.eps_low if cfg.eps_low is None else cfg.eps_low
    eps_high = spec.eps_high if cfg.eps_high is None else cfg.eps_high
    if spec.eps_low is not None:
        for side, v in (("eps_low", eps_low), ("eps_high", eps_high)):
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"loss.{side}={v} must be a finite number >= 0 (clip range "
                                 f"[1 - eps_low, 1 + eps_high])")
        if eps_low >= 1:
            raise ValueError(f"loss.eps_low={eps_low} must be < 1: the lower clip bound 1 - eps_low would be "
                             "<= 0 and the clip range inverted or empty")
        if spec.symmetric and eps_low != eps_high:
            raise ValueError(f"{cfg.name} clips symmetrically (one eps) but eps_low={eps_low} != "
                             f"eps_high={eps_high}; use loss.name=dapo for clip-higher")
    elif cfg.eps_low is not None or cfg.eps_high is not None:
        raise ValueError(f"{cfg.name} has no clip range; unset loss.eps_low/eps_high")
    if cfg.dual_clip is not None and not (cfg.name in ("ppo_clip", "grpo", "dapo") and cfg.dual_clip > 1):
        raise ValueError(f"loss.dual_clip={cfg.dual_clip}: a dual clip needs c > 1 and a token clip loss "
                         "(ppo_clip, grpo, dapo)")
    for name in ("tau_pos", "tau_neg"):
        v = getattr(cfg, name)
        if not (v > 0 and math.isfinite(v)):
            raise ValueError(f"loss.{name}={v} must be > 0 (SAPO gate sigmoid(tau (r - 1)) 4 / tau)")
    if not cfg.log_ratio_clamp > 0:
        raise ValueError(f"loss.log_ratio_clamp={cfg.log_ratio_clamp} must be > 0")
    mode = cfg.aggregation or spec.aggregation
    check_mode(mode, cfg.norm_length)
    if mode in spec.pitfalls:
        msg = f"{cfg.name} with {mode} aggregation {spec.pitfalls[mode]}"
        if cfg.strict:
            raise ValueError(msg + " (loss.strict=true)")
        warnings.warn(msg, AggregationPitfallWarning, stacklevel=2)
    params = LossParams(eps_low=eps_low if eps_low is not None else 0.0,
                        eps_high=eps_high if eps_high is not None else 0.0, dual_clip=cfg.dual_clip,
                        tau_pos=cfg.tau_pos, tau_neg=cfg.tau_neg, log_ratio_clamp=cfg.log_ratio_clamp)
    return ResolvedLoss(cfg.name, spec, params, mode, cfg.norm_length)


def validate(cfg) -> ResolvedLoss:
    """The whole AlgorithmConfig; returns the resolved loss."""
    resolved = resolve_loss(cfg.loss)
    adv_mod.check_config(cfg.advantage)
    KL_ESTIMATORS.get(cfg.kl.estimator)
    if not cfg.kl.coef >= 0:
        raise ValueError(f"kl.coef={cfg.kl.coef} must be >= 0")
    mismatch_mod.check_config(cfg.mismatch)
    if not (cfg.temperature > 0 and math.isfinite(cfg.temperature)):
        raise ValueError(f"temperature={cfg.temperature} must be > 0")
    return resolved


def _check_inputs(logp, batch, spec: LossSpec):
    mask = batch["loss_mask"]
    if mask.dim() != 2:
        raise ValueError(f"loss_mask must be [batch, seq], got {tuple(mask.shape)}")
    if logp.shape != mask.shape:
        raise ValueError(f"log-probs {tuple(logp.shape)} and loss_mask {tuple(mask.shape)} differ in shape")
    mask = mask.bool()
    for key in ("old_logp", "advantages"):
        if batch.get(key) is None:
            raise ValueError(f"the batch has no {key!r} (old log-probs come from compute_log_probs / "
                             "prepare_micro_batches, advantages from compute_advantages)")
    for key in ("old_logp", "ref_logp", "rollout_logp"):
        t = batch.get(key)
        if t is not None and t.shape != mask.shape:
            raise ValueError(f"{key} {tuple(t.shape)} and the new log-probs {tuple(logp.shape)} differ in shape")
    adv = batch["advantages"]
    if adv.shape == mask.shape[:1]:
        adv = adv[:, None].expand_as(logp)
    elif adv.shape != mask.shape:
        raise ValueError(f"advantages {tuple(adv.shape)} must be [batch] or [batch, seq] = {tuple(mask.shape)}")
    elif spec.per_sequence_advantage:
        a = torch.where(mask, adv, torch.zeros_like(adv))
        seq = a.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)
        if (torch.where(mask, adv - seq, torch.zeros_like(adv)).abs() > 1e-6 * (1 + seq.abs())).any():
            raise ValueError("gspo needs one advantage per sequence; got token-varying advantages "
                             "(use loss.name=gspo_token for per-token advantages)")
    # Inputs only: non-finite NEW log-probs are a numerical failure of this forward; they make the loss
    # non-finite and the trainer skips the step (raising here would hang the other pipeline stages).
    tensors = {"old_logp": batch["old_logp"], "advantages": adv}
    for key in ("ref_logp", "rollout_logp"):
        if batch.get(key) is not None:
            tensors[key] = batch[key]
    for name, t in tensors.items():
        bad = mask & ~torch.isfinite(t.detach())
        if bad.any():
            i, j = (int(x) for x in bad.nonzero()[0])
            raise ValueError(f"{name} has {int(bad.sum())} NaN/inf values at valid (unmasked) tokens, "
                             f"first at [{i}, {j}]")
    return mask, adv


def _clean(t, mask, dtype):
    """Zero at masked positions: padding garbage (nan/inf) would otherwise turn 0 * nan into nan in the
    backward of elementwise ops; where() routes exactly zero gradient there."""
    return None if t is None else torch.where(mask, t.to(dtype), torch.zeros((), dtype=dtype, device=t.device))


def drift_metrics(logp, old, mask) -> dict:
    """How far the policy moved from pi_old: k3 KL(pi_old || pi_new) per token (samples are pi_old's) and
    the sequence ratio exp(mean_t log r_t) of every sequence with a valid token (mean, min, max)."""
    lr = torch.where(mask, logp.double() - old.double(), torch.zeros((), dtype=torch.float64, device=logp.device))
    k3 = torch.expm1(-lr) + lr  # r^-1 - 1 + log r with r = pi_new / pi_old: E_old[.] = KL(pi_old || pi_new)
    n = mask.sum(1)
    has = n > 0
    seq = torch.exp(lr.sum(1)[has] / n[has])
    out = {"kl_old_k3": metric(k3, mask),
           "seq_ratio_mean": torch.stack([seq.sum(), torch.tensor(float(seq.numel()), dtype=torch.float64,
                                                                 device=seq.device)])}
    if seq.numel():
        out["max:seq_ratio_max"] = seq.max().reshape(1)
        out["min:seq_ratio_min"] = seq.min().reshape(1)
    return out


def policy_objective(logp, batch: dict, cfg, resolved: Optional[ResolvedLoss] = None, entropy=None):
    """(numerator, count, report) of one micro-batch.

    logp: [b, s] new log-probs (with grad). batch: loss_mask [b, s], old_logp [b, s], advantages [b] or
    [b, s], optional ref_logp (KL, when kl.coef > 0), rollout_logp (mismatch metrics / correction).
    cfg: AlgorithmConfig. report: name -> [sum, count] (means) or, for "max:" keys, [max].
    """
    resolved = resolved or validate(cfg)
    mask, adv = _check_inputs(logp, batch, resolved.spec)
    dt = logp.dtype
    logp, adv, old = _clean(logp, mask, dt), _clean(adv, mask, dt), _clean(batch["old_logp"], mask, dt)
    ref, rollout = _clean(batch.get("ref_logp"), mask, dt), _clean(batch.get("rollout_logp"), mask, dt)
    loss, report = resolved.spec.fn(logp, old, adv, mask, resolved.params)
    if entropy is not None:
        report["entropy"] = metric(entropy, mask)
    report.update(drift_metrics(logp.detach(), old, mask))
    # TIS reweights the policy-gradient term only (as verl does); an MIS-masked token leaves everything.
    if rollout is not None:
        loss, mask, extra = mismatch_mod.apply_correction(loss, mask, old, rollout, cfg.mismatch)
        report.update(extra)
    elif cfg.mismatch.mode != "none":
        raise ValueError(f"mismatch.mode={cfg.mismatch.mode} needs rollout_logp in the batch")
    if cfg.kl.coef > 0 and not cfg.kl.in_reward:  # in_reward: the penalty is in GAE's token rewards
        if ref is None:
            raise ValueError(f"kl.coef={cfg.kl.coef} needs ref_logp in the batch (the reference log-prob pass)")
        kl = kl_penalty(cfg.kl.estimator, logp, ref)
        report["kl"] = metric(kl, mask)
        loss = loss + cfg.kl.coef * kl
    numerator, count = aggregate(loss, mask, resolved.aggregation, resolved.norm_length)
    report["policy_loss"] = torch.stack([numerator.detach().double(), count.double()])
    return numerator, count, report
