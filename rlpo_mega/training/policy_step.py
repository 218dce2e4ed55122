"""The RL policy update through megatron's pipeline schedule: rollout batch in -> loss -> backward -> step.

assemble_batch (rollout samples -> shaped rewards, advantages, padded tensors) -> prepare_micro_batches
(DP share, micro-batches, old/reference log-prob passes) -> policy_step (one optimizer step; call it per
mini-batch). The global batch is built on the host; shard_and_split moves this DP rank's share to
platform.device() once, and everything after it (model, log-prob kernel, objective, routing metrics)
follows the batch's device. Metrics are reduced as device tensors (training.step.reduce_report).

Plugs into rlpo_mega.training.step (run_schedule / forward_backward) through its `forward_step`
argument. The loss function returns (numerator, integer count, report) and the model is built with
calculate_per_token_loss=True, so megatron divides the gradients by the count summed over micro-batches
and DP ranks: the aggregation modes are normalised globally (aggregation.py).

A batch is a dict of row-aligned tensors (one row per sequence, right-padded to one length for the whole
global batch, as pipeline parallelism needs equal shapes): tokens [n, s] (model input), labels [n, s]
(next tokens), loss_mask [n, s] (label is a response token), advantages [n] or [n, s], and optionally
old_logp / ref_logp / rollout_logp [n, s] aligned with labels.
"""
from __future__ import annotations

import math
from functools import partial
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from rlpo_mega.algorithms.advantages import CRITIC_ESTIMATORS, AdvantageResult, compute_advantages
from rlpo_mega.algorithms.logprobs import bad_label_count, vocab_parallel_logprobs
from rlpo_mega.algorithms.objective import FAULT, fault_entry, policy_objective, raise_input_faults, validate
from rlpo_mega.algorithms.shaping import overlong_filter, soft_overlong_punishment

ROW_KEYS = ("tokens", "labels", "loss_mask", "advantages", "old_logp", "ref_logp", "rollout_logp")


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
    batch = {"tokens": seq[:, :-1].contiguous(), "labels": seq[:, 1:].contiguous(), "loss_mask": mask,
             "advantages": advantages}
    if roll is not None:
        batch["rollout_logp"] = roll
    return batch, stats


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


def split_rows(batch: dict, parts: int) -> list[dict]:
    n = next(v.shape[0] for v in batch.values() if torch.is_tensor(v))
    if any(torch.is_tensor(v) and v.shape[0] != n for v in batch.values()):
        raise ValueError(f"batch tensors disagree in their number of rows: "
                         f"{ {k: tuple(v.shape) for k, v in batch.items() if torch.is_tensor(v)} }")
    if n % parts:
        raise ValueError(f"batch of {n} sequences is not divisible into {parts} parts")
    out = [{} for _ in range(parts)]
    for k, v in batch.items():
        for i, chunk in enumerate(v.chunk(parts) if torch.is_tensor(v) else [v] * parts):
            out[i][k] = chunk
    return out


def shard_and_split(batch: dict, num_micro_batches: int) -> list[dict]:
    """This DP rank's contiguous share of the global (host) batch, as micro-batches on platform.device():
    the one host-to-device copy of the step's data (only this rank's rows travel)."""
    from megatron.core import parallel_state

    from rlpo_mega.training.step import to_device

    share = split_rows(batch, parallel_state.get_data_parallel_world_size())
    return split_rows(to_device(share[parallel_state.get_data_parallel_rank()]), num_micro_batches)


def _model_out(model, batch):
    tokens = batch["tokens"]
    if "cu_seqlens" in batch:  # packed (training/batches.py): attention and RoPE restart at each boundary
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = batch["cu_seqlens"]
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 max_seqlen_q=batch["max_seqlen"], max_seqlen_kv=batch["max_seqlen"])
        return model(input_ids=tokens, position_ids=batch["position_ids"], attention_mask=None,
                     packed_seq_params=packed)
    position_ids = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
    return model(input_ids=tokens, position_ids=position_ids, attention_mask=None)


def unpack(values: torch.Tensor, batch: dict) -> torch.Tensor:
    """Per-token values of a packed row [1, t] -> the [samples, positions] view of the loss (a gather:
    gradients flow back to the packed positions); padded batches are already in that view."""
    if "index" not in batch:
        return values
    return values[0][batch["index"]]


def policy_forward_step(data_iterator, model, cfg, resolved, real_vocab, old_from_update=False):
    """forward_step for run_schedule/forward_backward: the policy loss of one micro-batch.
    old_from_update: the old log-probs are this forward's own, detached (see `old_pass_needed`)."""
    batch = next(data_iterator)
    output = _model_out(model, batch)

    def loss_func(logits):
        # input checks are counted on the device and raised once per step, after reduce_report (policy_step)
        logp, entropy = vocab_parallel_logprobs(logits, batch["labels"], temperature=cfg.temperature,
                                                real_vocab=real_vocab, chunk_size=cfg.logprob_chunk_size,
                                                check_labels=False)
        logp = unpack(logp, batch)
        b = {**batch, "old_logp": logp.detach()} if old_from_update else batch
        numerator, count, report = policy_objective(logp, b, cfg, resolved, entropy=unpack(entropy.detach(), batch),
                                                    defer_checks=True)
        report[FAULT + "labels"] = fault_entry(bad_label_count(batch["labels"], real_vocab))
        return numerator, count, report

    return output, loss_func


def _logprob_forward_step(data_iterator, model, cfg, real_vocab):
    batch = next(data_iterator)
    output = _model_out(model, batch)

    def loss_func(logits):
        # the labels are checked by the update's step (policy_forward_step), which every batch goes through
        logp, _ = vocab_parallel_logprobs(logits, batch["labels"], temperature=cfg.temperature,
                                          real_vocab=real_vocab, with_entropy=False,
                                          chunk_size=cfg.logprob_chunk_size, check_labels=False)
        return logp.new_zeros(()), logp.new_zeros((), dtype=torch.int), {"logp": unpack(logp.detach(), batch)}

    return output, loss_func


def _real_vocab(model_chunks):
    from rlpo_mega.model_setup import unwrap

    return unwrap(model_chunks[0]).real_vocab_size


def make_policy_forward_step(cfg, model_chunks, old_from_update=False):
    return partial(policy_forward_step, cfg=cfg, resolved=validate(cfg), real_vocab=_real_vocab(model_chunks),
                   old_from_update=old_from_update)


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
def compute_log_probs(model_chunks, micro_batches: list[dict], cfg, wrap_step=None) -> Optional[list[torch.Tensor]]:
    """Forward-only pass (old or reference policy): per micro-batch log-probs [b, s] on the last pipeline
    stage, None on the others (only the last stage computes the loss). wrap_step: routing replay's wrapper."""
    from megatron.core import parallel_state

    from rlpo_mega.training.step import forward_only

    step = partial(_logprob_forward_step, cfg=cfg, real_vocab=_real_vocab(model_chunks))
    if wrap_step is not None:
        step = wrap_step(step)
    reports = forward_only(model_chunks, micro_batches, forward_step=step)
    if not parallel_state.is_pipeline_last_stage():
        return None
    return [r["logp"] for r in reports]


def prepare_micro_batches(model_chunks, batch: dict, cfg, num_micro_batches: int, ref_chunks=None,
                          routing=None) -> list[dict]:
    """This DP rank's share of the global `batch` (same on every rank, on the host) as micro-batches on
    platform.device(), with the old (and, for a KL term, reference) log-probs from forward-only passes:
    run once per rollout batch, before any update of the policy. routing: a moe.routing.replay.RoutingReplay
    (r2 records the old pass's routes, r3 replays the rollout's; attached routes join the batch's device)."""
    return attach_old_logprobs(model_chunks, shard_and_split(batch, num_micro_batches), cfg, ref_chunks, routing)


def attach_old_logprobs(model_chunks, micro: list[dict], cfg, ref_chunks=None, routing=None,
                        old_pass: bool = True) -> list[dict]:
    """This rank's micro-batches (on the device) with their routes attached and the old (and reference)
    log-probs of the forward-only passes added. old_pass=False: no old pass (the update takes its own
    log-probs, `old_pass_needed`); the reference pass still runs."""
    validate(cfg)
    if routing is not None:
        routing.attach(micro)
    if old_pass and "old_logp" not in micro[0]:
        _attach(micro, "old_logp", compute_log_probs(model_chunks, micro, cfg,
                                                     wrap_step=routing.wrap_old if routing else None))
    if cfg.kl.coef > 0 and "ref_logp" not in micro[0]:
        if ref_chunks is None:
            raise ValueError(f"kl.coef={cfg.kl.coef} needs a reference model (ref_chunks) or ref_logp in the batch")
        _attach(micro, "ref_logp", compute_log_probs(ref_chunks, micro, cfg))
    return micro


def policy_step(model_chunks, optimizer, micro_batches: list[dict], cfg, step_optimizer: bool = True,
                routing=None, old_from_update: bool = False, lr_schedule=None) -> dict:
    """One policy update through the one update path (training.step.update): loss/backward over the
    micro-batches (megatron schedule, global normalisation) -> the finite check -> optimizer step. Returns the
    global metrics (grad_norm, skipped). routing: replays the micro-batches' routes (moe.routing.replay.
    RoutingReplay); its metrics are added. old_from_update: the micro-batches carry no old_logp; the update's
    own detached log-probs are pi_old (`old_pass_needed`). step_optimizer=False: the loss and gradients only
    (tests read the metrics of a step without taking it)."""
    from rlpo_mega.training.step import forward_backward, reduce_report, update

    step = make_policy_forward_step(cfg, model_chunks, old_from_update)
    step = routing.wrap_update(step) if routing else step
    if step_optimizer:
        out = update(model_chunks, optimizer, micro_batches, step, "policy_loss", lr_schedule)
    else:
        out = raise_input_faults(reduce_report(forward_backward(model_chunks, optimizer, micro_batches, step)))
    if routing is not None:
        out.update(routing.metrics())
    return out


def _attach(micro, key, values):
    if values is None:  # not the last pipeline stage: the loss is not computed here
        return
    for mb, v in zip(micro, values):
        mb[key] = v
