"""Phase 3 of an RL step: the old (and reference) log-probs of this rank's micro-batches, before any update.

pi_old comes from a forward-only pass of the policy as it was at the rollout (routing replay: r3 replays the
rollout's routes, r2 records this pass's), unless the update's own forward gives it exactly
(`old_pass_needed`); the reference policy's log-probs for a KL term from a pass of the frozen reference. The
rollout/train mismatch of the step is measured here (algorithms/mismatch.py).
"""
from __future__ import annotations

from typing import Optional

import torch
from megatron.core import parallel_state

from moe.lora import adapters_off
from rlpo_mega.algorithms.mismatch import mismatch_metrics
from rlpo_mega.algorithms.objective import validate
from rlpo_mega.training.batches import MicroBatch
from rlpo_mega.training.update import forward_only, forward_step_of, logprob_loss, real_vocab_of, reduce_report


def old_pass_needed(run_cfg, hf) -> Optional[str]:
    """Why this run needs the separate old-log-prob pass, or None when the update's own forward gives the
    old log-probs exactly: one optimizer step per rollout batch (the weights of the old pass are the
    update's), no dropout (the old pass runs in eval mode, the update in train mode), and the update
    routes as the old pass would (r3 replays the rollout's routes in both; off routes live in both; r2
    defines its routes by the old pass's record). Then pi_old = pi_theta.detach(): the ratio is 1 and its
    gradient is grad log pi (TRL's shortcut); skipping saves one full forward per step."""
    t = run_cfg.trainer
    if t.old_logprobs == "recompute":
        return "trainer.old_logprobs=recompute"
    if t.epochs * t.mini_batches != 1:
        return f"trainer.epochs={t.epochs} x trainer.mini_batches={t.mini_batches} optimizer steps per rollout batch"
    if run_cfg.algorithm.kl.in_reward and run_cfg.algorithm.kl.coef > 0:
        return "algorithm.kl.in_reward puts log pi_old in GAE's rewards, before the update"
    if run_cfg.routing.mode == "r2":
        return "routing.mode=r2 records its routes in the old pass"
    if float(getattr(hf, "attention_dropout", 0.0) or 0.0) > 0:
        return f"attention_dropout={hf.attention_dropout} (the update's forward is not the eval-mode one)"
    return None


@torch.no_grad()
def compute_log_probs(model_chunks, micro_batches: list[MicroBatch], cfg, wrap_step=None) -> Optional[list[torch.Tensor]]:
    """Forward-only pass (old or reference policy): per micro-batch log-probs [b, s] on the last pipeline
    stage, None on the others (only the last stage computes the loss). wrap_step: routing replay's wrapper."""
    step = forward_step_of(logprob_loss, cfg=cfg, real_vocab=real_vocab_of(model_chunks))
    if wrap_step is not None:
        step = wrap_step(step)
    reports = forward_only(model_chunks, micro_batches, forward_step=step)
    if not parallel_state.is_pipeline_last_stage():
        return None
    return [r["logp"] for r in reports]


def attach_old_logprobs(model_chunks, micro: list[MicroBatch], cfg, ref_chunks=None, routing=None,
                        old_pass: bool = True, ref_is_base: bool = False) -> list[MicroBatch]:
    """This rank's micro-batches (on the device) with their routes attached and the old (and reference)
    log-probs of the forward-only passes added. old_pass=False: no old pass (the update takes its own
    log-probs, `old_pass_needed`); the reference pass still runs. ref_is_base: the reference is the policy with
    its LoRA adapters off (moe/lora.adapters_off)."""
    validate(cfg)
    if routing is not None:
        routing.attach(micro)
    if old_pass and micro[0].old_logp is None:
        _attach(micro, "old_logp", compute_log_probs(model_chunks, micro, cfg,
                                                     wrap_step=routing.wrap_old if routing else None))
    if cfg.kl.coef > 0 and micro[0].ref_logp is None and ref_is_base:
        with adapters_off(model_chunks):
            _attach(micro, "ref_logp", compute_log_probs(model_chunks, micro, cfg))
    elif cfg.kl.coef > 0 and micro[0].ref_logp is None:
        if ref_chunks is None:
            raise ValueError(f"kl.coef={cfg.kl.coef} needs a reference model (ref_chunks) or ref_logp in the batch")
        _attach(micro, "ref_logp", compute_log_probs(ref_chunks, micro, cfg))
    return micro


def _attach(micro, key, values):
    if values is None:  # not the last pipeline stage: the loss is not computed here
        return
    for mb, v in zip(micro, values):
        setattr(mb, key, v)


def old_logprobs(policy, minis: list[list[MicroBatch]], cfg) -> tuple[list[list[MicroBatch]], dict]:
    """This rank's micro-batches per mini-batch (host) -> on the device, routes attached, old (and reference)
    log-probs added; and the step's rollout/train mismatch metrics (global). policy: update.Policy."""
    prepared, reports = [], []
    for mini in minis:
        micro = attach_old_logprobs(policy.chunks, [mb.to() for mb in mini], cfg.algorithm,
                                    ref_chunks=policy.ref_chunks, routing=policy.routing,
                                    old_pass=not policy.old_from_update, ref_is_base=policy.ref_is_base)
        for m in micro:
            if m.old_logp is not None:  # last pipeline stage
                reports.append(mismatch_metrics(m.old_logp, m.rollout_logp, m.loss_mask.bool()))
        prepared.append(micro)
    return prepared, reduce_report(reports)
