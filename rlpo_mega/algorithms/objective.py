"""The policy objective of one micro-batch: loss registry + KL + mismatch correction + aggregation.

`policy_objective` returns what megatron's forward_step contract wants from a loss function:
(numerator, integer count, report), with the global loss = sum numerators / sum counts over all
micro-batches and DP ranks (see aggregation.py). Pure tensors, no megatron: unit-testable as is.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from . import advantages as adv_mod
from . import mismatch as mismatch_mod
from .aggregation import aggregate, check_mode
from .kl import KL_ESTIMATORS, kl_penalty
from .losses import LOSSES, LossParams, LossSpec, metric
from rlpo_mega.reductions import Stat


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
    """Shapes and presence are checked here (host facts, free); the values' faults are counted on the device
    -> (mask, advantages, {fault name: count}). Reading them here would stop the host once per check and
    micro-batch on a GPU: the trainer reads them once per step (raise_input_faults)."""
    mask = batch.loss_mask
    if mask.dim() != 2:
        raise ValueError(f"loss_mask must be [batch, seq], got {tuple(mask.shape)}")
    if logp.shape != mask.shape:
        raise ValueError(f"log-probs {tuple(logp.shape)} and loss_mask {tuple(mask.shape)} differ in shape")
    mask = mask.bool()
    for key in ("old_logp", "advantages"):
        if getattr(batch, key) is None:
            raise ValueError(f"the batch has no {key!r} (old log-probs come from compute_log_probs / "
                             "prepare_micro_batches, advantages from compute_advantages)")
    for key in ("old_logp", "ref_logp", "rollout_logp"):
        t = getattr(batch, key)
        if t is not None and t.shape != mask.shape:
            raise ValueError(f"{key} {tuple(t.shape)} and the new log-probs {tuple(logp.shape)} differ in shape")
    faults = {}
    adv = batch.advantages
    if adv.shape == mask.shape[:1]:
        adv = adv[:, None].expand_as(logp)
    elif adv.shape != mask.shape:
        raise ValueError(f"advantages {tuple(adv.shape)} must be [batch] or [batch, seq] = {tuple(mask.shape)}")
    elif spec.per_sequence_advantage:
        a = torch.where(mask, adv, torch.zeros_like(adv))
        seq = a.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)
        varying = torch.where(mask, adv - seq, torch.zeros_like(adv)).abs() > 1e-6 * (1 + seq.abs())
        faults["token_varying_advantages"] = varying.any(dim=1).sum()
    # Inputs only: non-finite NEW log-probs are a numerical failure of this forward; they make the loss
    # non-finite and the trainer skips the step.
    tensors = {"old_logp": batch.old_logp, "advantages": adv}
    for key in ("ref_logp", "rollout_logp"):
        if getattr(batch, key) is not None:
            tensors[key] = getattr(batch, key)
    for name, t in tensors.items():
        faults["nonfinite/" + name] = (mask & ~torch.isfinite(t.detach())).sum()
    return mask, adv, faults


def raise_input_faults(faults: Mapping) -> None:
    """`faults`: name -> count of bad inputs, a reduced report's (Reduced.faults: every rank holds the same
    counts, so every rank raises together and none is left waiting in a collective) or one micro-batch's (device
    scalars). Raises the first bad input's one-line error."""
    for what in sorted(faults):
        n = int(faults[what])
        if n == 0:
            continue
        if what == "token_varying_advantages":
            raise ValueError(f"gspo needs one advantage per sequence; got token-varying advantages in {n} "
                             "sequence(s) (use loss.name=gspo_token for per-token advantages)")
        if what == "labels":
            raise ValueError(f"{n} label(s) outside the model's vocabulary: token ids the model has no row for "
                             "(a rollout engine with another tokenizer or vocabulary than model.hf_config?)")
        name = what.split("/", 1)[1]
        raise ValueError(f"{name} has {n} NaN/inf values at valid (unmasked) tokens")


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
    # sequences without a valid token are left out by where(), not by indexing them away (a host sync)
    seq = torch.exp(lr.sum(1) / n.clamp(min=1))
    out = {"kl_old_k3": metric(k3, mask),
           "seq_ratio_mean": torch.stack([torch.where(has, seq, 0.0).sum(), has.sum().double()])}
    if seq.numel():  # +-inf where no sequence has a token: reduce_report reports NaN then
        out[Stat("seq_ratio_max", "max")] = torch.where(has, seq, -math.inf).max().reshape(1)
        out[Stat("seq_ratio_min", "min")] = torch.where(has, seq, math.inf).min().reshape(1)
    return out


def policy_objective(logp, batch, cfg, resolved: Optional[ResolvedLoss] = None, entropy=None,
                     defer_checks: bool = False):
    """(numerator, count, report) of one micro-batch.

    logp: [b, s] new log-probs (with grad). batch: the micro-batch's loss inputs by attribute (a
    rlpo_mega.training.batches.MicroBatch): loss_mask [b, s], old_logp [b, s], advantages [b] or [b, s],
    ref_logp (KL, when kl.coef > 0) and rollout_logp (mismatch metrics / correction) or None.
    cfg: AlgorithmConfig. report: rlpo_mega/reductions.py's schema (a name: a [sum, count] mean; Stat: max, min,
    fault counts).
    defer_checks: bad input values (non-finite log-probs or advantages, GSPO's token-varying advantages) are
    counted into the report's fault entries for raise_input_faults after the step's one reduction, instead of
    raised here (which reads them on the host, once per check and micro-batch).
    """
    resolved = resolved or validate(cfg)
    mask, adv, faults = _check_inputs(logp, batch, resolved.spec)
    if not defer_checks:
        raise_input_faults(faults)
    dt = logp.dtype
    logp, adv, old = _clean(logp, mask, dt), _clean(adv, mask, dt), _clean(batch.old_logp, mask, dt)
    ref, rollout = _clean(batch.ref_logp, mask, dt), _clean(batch.rollout_logp, mask, dt)
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
    if defer_checks:
        report.update({Stat(k, "fault"): v for k, v in faults.items()})
    return numerator, count, report
