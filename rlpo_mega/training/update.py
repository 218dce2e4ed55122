"""Phase 5 of an RL step, and the one optimizer-step path of every model: the update through megatron's schedule.

`update` is the only place an optimizer steps: the schedule's forward/backward over a mini-batch's
micro-batches -> the global metrics (`reduce_report`, one host copy) -> bad inputs raised on every rank ->
the finite check -> megatron's optimizer step (clipping) and the LR schedule. The policy (`policy_step`), the
critic (training/critic.py) and the supervised warm-up (training/warmup.py) all go through it; `update_phase`
runs a step's epochs x mini-batches of them.

`forward_step_of(loss)` is the one forward-step builder of megatron's schedule: the model on the micro-batch
(packed THD or padded rows, `model_forward`), then `loss(batch, output) -> (summed loss, token count, report)`.
The model is built with calculate_per_token_loss=True, so megatron divides the gradients by the count summed
over micro-batches and DP ranks: the loss aggregations are normalised globally (algorithms/aggregation.py).
The losses here: the policy's (`policy_loss`), the log-probs of a forward-only pass (`logprob_loss`), next-token
cross-entropy (`lm_loss`); the critic's value loss is in training/critic.py.

Devices: micro-batches are built on the host and moved to `platform.device()` once (MicroBatch.to); the model,
the losses and the metrics take their device from the batch. Metric scalars are reduced as device tensors over
megatron's groups (NCCL on GPUs takes nothing else) and copied to the host once, at the end.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import partial
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func

from moe import context_parallel
from rlpo_mega import platform
from rlpo_mega.algorithms.logprobs import bad_label_count, vocab_parallel_logprobs
from rlpo_mega.algorithms.objective import policy_objective, raise_input_faults, validate
from rlpo_mega.distributed import all_ok
from rlpo_mega.model_setup import unwrap
from rlpo_mega.reductions import Reduced, Stat, by_reduction, stat
from rlpo_mega.training.batches import MicroBatch


@dataclass
class Policy:
    """The policy as a step uses it: its model chunks, optimizer and LR schedule, its routing replay driver,
    the frozen KL reference (None without a KL term), and whether the update's own forward gives pi_old
    (training/old_logprobs.old_pass_needed). ref_is_base: the KL reference is the policy with its LoRA adapters
    off (model.lora: the frozen base, no second model)."""
    chunks: list
    optimizer: object
    lr_schedule: object
    routing: object
    ref_chunks: Optional[list] = None
    old_from_update: bool = False
    ref_is_base: bool = False


def model_forward(model, batch: MicroBatch):
    """The model on one micro-batch: packed (cu_seqlens: attention and RoPE restart at each sample) or padded."""
    tokens = batch.tokens
    if batch.cu_seqlens is not None:
        cu, padded = batch.cu_seqlens, batch.cu_seqlens_padded
        # under context parallelism the padded boundaries are the CP layout (RoPE's positions, the attention's
        # chunks); the pads after each sample's tokens are its own causal tail, never seen by a real token
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=padded,
                                 cu_seqlens_kv_padded=padded, max_seqlen_q=batch.max_seqlen,
                                 max_seqlen_kv=batch.max_seqlen)
        return model(input_ids=tokens, position_ids=batch.position_ids, attention_mask=None,
                     packed_seq_params=packed)
    position_ids = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
    return model(input_ids=tokens, position_ids=position_ids, attention_mask=None)


def unpack(values: torch.Tensor, batch: MicroBatch) -> torch.Tensor:
    """Per-token values of a packed row [1, t] -> the [samples, positions] view of the loss (a gather:
    gradients flow back to the packed positions); padded batches are already in that view. Under context
    parallelism the row is this rank's shard: moe.context_parallel.gather puts the whole row together first
    (differentiable), so the losses, their normalisation, GSPO's sequence ratios, the mismatch weights, GAE and
    the observation masks read every position exactly as without CP."""
    if batch.index is None:
        return values
    if batch.cu_seqlens_padded is not None:  # a CP shard: the whole padded row first, on every CP rank
        values = context_parallel.gather(values, batch.cu_seqlens_padded,
                                         parallel_state.get_context_parallel_group())
    return values[0][batch.index]


def forward_step_of(loss, **kwargs):
    """The forward_step of megatron's schedule for `loss(batch, output, **kwargs)` -> (summed loss, integer
    token count, report): the one builder of every pass (routing replay wraps what it returns)."""
    def step(data_iterator, model):
        batch = next(data_iterator)
        return model_forward(model, batch), partial(loss, batch, **kwargs)

    return step


def real_vocab_of(model_chunks) -> int:
    return unwrap(model_chunks[0]).real_vocab_size


def policy_loss(batch, logits, *, cfg, resolved, real_vocab, old_from_update=False):
    """The policy loss of one micro-batch. old_from_update: the old log-probs are this forward's own, detached
    (training/old_logprobs.old_pass_needed). Input checks are counted on the device and raised once per step,
    after reduce_report (`update`)."""
    logp, entropy = vocab_parallel_logprobs(logits, batch.labels, temperature=cfg.temperature,
                                            real_vocab=real_vocab, chunk_size=cfg.logprob_chunk_size,
                                            check_labels=False)
    logp = unpack(logp, batch)
    b = replace(batch, old_logp=logp.detach()) if old_from_update else batch
    numerator, count, report = policy_objective(logp, b, cfg, resolved, entropy=unpack(entropy.detach(), batch),
                                                defer_checks=True)
    bad = bad_label_count(batch.labels, real_vocab)
    if batch.cu_seqlens_padded is not None:  # each CP rank holds its shard's labels; the report is the row's
        dist.all_reduce(bad, group=parallel_state.get_context_parallel_group())
    report[Stat("labels", "fault")] = bad
    return numerator, count, report


def logprob_loss(batch, logits, *, cfg, real_vocab):
    """A forward-only pass's log-probs (old or reference policy) in the report; the labels are checked by the
    update's step (policy_loss), which every batch goes through."""
    logp, _ = vocab_parallel_logprobs(logits, batch.labels, temperature=cfg.temperature, real_vocab=real_vocab,
                                      with_entropy=False, chunk_size=cfg.logprob_chunk_size, check_labels=False)
    return logp.new_zeros(()), logp.new_zeros((), dtype=torch.int), {"logp": unpack(logp.detach(), batch)}


def make_policy_forward_step(cfg, model_chunks, old_from_update=False):
    return forward_step_of(policy_loss, cfg=cfg, resolved=validate(cfg), real_vocab=real_vocab_of(model_chunks),
                        old_from_update=old_from_update)


def mask_padded_vocab(logits: torch.Tensor, real_vocab: int) -> torch.Tensor:
    """Megatron pads the vocabulary; padded columns must not take probability mass (HF has none)."""
    local = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * local
    n_pad = start + local - real_vocab
    if n_pad <= 0:
        return logits
    keep = torch.arange(start, start + local, device=logits.device) < real_vocab
    return logits.masked_fill(~keep, float("-inf"))


def token_cross_entropy(logits, labels, real_vocab):
    """Per-token -log p(label) from vocab-parallel logits [b, s, v/tp] (no full-vocab gather)."""
    logits = mask_padded_vocab(logits.float(), real_vocab)
    return tensor_parallel.vocab_parallel_cross_entropy(logits, labels)


def lm_loss(batch, logits, *, real_vocab):
    """Next-token cross-entropy over the loss mask (the supervised warm-up's loss), in the loss view (`unpack`:
    padded rows as they are, a packed row or its CP shard per sample)."""
    losses = unpack(token_cross_entropy(logits, batch.labels, real_vocab), batch)
    mask = batch.loss_mask.float()
    total = (losses * mask).sum()
    count = mask.sum().to(torch.int)
    return total, count, {"lm_loss": torch.stack([total.detach(), mask.sum()])}


def run_schedule(model_chunks, micro_batches, forward_only, forward_step=None):
    if forward_step is None:  # the next-token loss
        forward_step = forward_step_of(lm_loss, real_vocab=real_vocab_of(model_chunks))
    tokens = micro_batches[0].tokens
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(micro_batches),
        model=model_chunks,
        num_microbatches=len(micro_batches),
        seq_length=tokens.shape[1],
        micro_batch_size=tokens.shape[0],
        forward_only=forward_only,
    )


def reduce_report(reports: list[dict]) -> Reduced:
    """Global metrics from per-micro-batch reports, by each key's reduction (rlpo_mega/reductions.py: means from
    [sum, count] pairs, sums, fault counts, max and min over micro-batches and DP ranks). Every rank gets the
    values (sent from the last stage). The sums stay on platform.device() (the reports' device; NCCL reduces
    nothing else) and reach the host in one copy at the end. The fault counts come apart (`Reduced.faults`) for
    raise_input_faults."""
    last = parallel_state.is_pipeline_last_stage()
    keys = sorted({stat(k) for k in reports[0]}) if reports else []
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        box = [keys]
        dist.broadcast_object_list(box, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                   group=parallel_state.get_pipeline_model_parallel_group())
        keys = box[0]
    how = by_reduction(keys)
    means, counted, maxes, mins = how["mean"], how["sum"] + how["fault"], how["max"], how["min"]
    device = platform.device()
    pairs = torch.zeros(len(means), 2, dtype=torch.float64, device=device)
    totals = torch.zeros(len(counted), dtype=torch.float64, device=device)
    # max over ranks of (max, -min): a micro-batch without the key (no valid sequence) contributes -inf
    extremes = torch.full((len(maxes) + len(mins),), -math.inf, dtype=torch.float64, device=device)
    for report in reports:
        r = {stat(k): v for k, v in report.items()}
        if means:
            pairs += torch.stack([r[k].detach().double() for k in means])
        if counted:
            totals += torch.stack([r[k].detach().double().sum() for k in counted])
        for i, k in enumerate(maxes + mins):
            if k in r:
                v = r[k].detach().double()
                extremes[i] = torch.maximum(extremes[i], v.max() if i < len(maxes) else -v.min())
    if last:
        dp = parallel_state.get_data_parallel_group()
        dist.all_reduce(pairs, group=dp)
        dist.all_reduce(totals, group=dp)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=dp)
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        src = parallel_state.get_pipeline_model_parallel_last_rank()
        group = parallel_state.get_pipeline_model_parallel_group()
        for t in (pairs, totals, extremes):
            dist.broadcast(t, src=src, group=group)
    host = torch.cat([pairs.flatten(), totals, extremes]).tolist()  # the one device-to-host copy
    out = {k.name: host[2 * i] / max(host[2 * i + 1], 1.0) for i, k in enumerate(means)}
    at = 2 * len(means)
    out.update({k.name: host[at + i] for i, k in enumerate(how["sum"])})
    faults = {k.name: host[at + len(how["sum"]) + i] for i, k in enumerate(how["fault"])}
    at += len(counted)
    for i, k in enumerate(maxes + mins):
        v = host[at + i]
        out[k.name] = (v if i < len(maxes) else -v) if math.isfinite(v) else math.nan
    return Reduced(out, faults)


def forward_backward(model_chunks, optimizer, micro_batches, forward_step=None):
    """zero grads -> forward/backward over micro-batches -> finalize grads (DP/SP/PP reductions)."""
    for chunk in model_chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    return run_schedule(model_chunks, micro_batches, forward_only=False, forward_step=forward_step)


def optimizer_step(optimizer, lr_schedule=None, strict: bool = True) -> tuple[bool, float]:
    """The one optimizer step of every path (warm-up, RL update, tests): megatron's step (clipping, the
    mixed-precision found-inf check) -> (applied, grad_norm). The schedule advances only on applied updates,
    as megatron's does. strict: a skipped step (non-finite gradients) raises instead of returning False."""
    ok, grad_norm, _ = optimizer.step()
    grad_norm = float(grad_norm or 0.0)
    applied = bool(ok) and math.isfinite(grad_norm)
    if not applied and strict:
        raise FloatingPointError("optimizer step skipped: non-finite gradients")
    if applied and lr_schedule is not None:
        lr_schedule.step(1)
    return applied, grad_norm


def grads_finite(model_chunks) -> bool:
    """Every gradient finite on every rank (a non-finite one skips the optimizer step). Megatron's DDP keeps
    the gradients in a few flat buffers. A buffer's sum is finite exactly when its elements are (NaN and inf
    propagate; a finite buffer overflows fp32 only where its norm, which megatron's clipping reads, already
    has): one reduction per buffer with no buffer-sized temporary, one host read for all of them, with the
    all-reduce over ranks."""
    sums = []
    for chunk in model_chunks:
        buffers = getattr(chunk, "buffers", None)
        grads = ([b.grad_data for b in buffers + chunk.expert_parallel_buffers] if buffers is not None else
                 [p.main_grad if getattr(p, "main_grad", None) is not None else p.grad for p in chunk.parameters()])
        # in the buffer's own dtype (fp32 or bf16: fp32's exponent range), so no cast copies the buffer
        sums += [g.sum().float() for g in grads if g is not None and g.numel()]
    device = platform.device()
    finite = torch.isfinite(torch.stack(sums)).all() if sums else torch.ones((), dtype=torch.bool, device=device)
    return all_ok(finite, device)


def update(model_chunks, optimizer, micro_batches, forward_step, loss_key: str, lr_schedule=None,
           strict: bool = False) -> dict:
    """The one optimizer-step path (the policy, the critic, the warm-up): the schedule's forward/backward over
    the micro-batches -> the global metrics (reduce_report, one host copy) -> bad inputs raised on every rank
    (the objective's fault counts) -> the step when the loss and every gradient are finite -> megatron's
    optimizer step (clipping) and the LR schedule. Returns the metrics with grad_norm and skipped (1.0: not
    applied). strict: a skipped step raises FloatingPointError instead."""
    out = reduce_report(forward_backward(model_chunks, optimizer, micro_batches, forward_step))
    raise_input_faults(out.faults)
    if math.isfinite(out[loss_key]) and grads_finite(model_chunks):
        applied, out["grad_norm"] = optimizer_step(optimizer, lr_schedule, strict=False)
    else:
        applied, out["grad_norm"] = False, math.nan
    out["skipped"] = float(not applied)
    if strict and not applied:
        what = loss_key if not math.isfinite(out[loss_key]) else "gradients"
        raise FloatingPointError(f"optimizer step skipped: non-finite {what}")
    return out


@torch.no_grad()
def forward_only(model_chunks, micro_batches, forward_step=None) -> list:
    """The schedule without backward, in eval mode (no dropout), back in train mode after: the per-micro-batch
    reports of the last pipeline stage."""
    for chunk in model_chunks:
        chunk.eval()
    try:
        return run_schedule(model_chunks, micro_batches, forward_only=True, forward_step=forward_step)
    finally:
        for chunk in model_chunks:
            chunk.train()


def policy_step(model_chunks, optimizer, micro_batches: list[MicroBatch], cfg, step_optimizer: bool = True,
                routing=None, old_from_update: bool = False, lr_schedule=None) -> dict:
    """One policy update through the one update path (`update`): loss/backward over the
    micro-batches (megatron schedule, global normalisation) -> the finite check -> optimizer step. Returns the
    global metrics (grad_norm, skipped). routing: replays the micro-batches' routes (moe.routing.replay.
    RoutingReplay); its metrics are added. old_from_update: the micro-batches carry no old_logp; the update's
    own detached log-probs are pi_old (old_logprobs.old_pass_needed). step_optimizer=False: the loss and gradients only
    (tests read the metrics of a step without taking it)."""
    step = make_policy_forward_step(cfg, model_chunks, old_from_update)
    step = routing.wrap_update(step) if routing else step
    if step_optimizer:
        out = update(model_chunks, optimizer, micro_batches, step, "policy_loss", lr_schedule)
    else:
        out = reduce_report(forward_backward(model_chunks, optimizer, micro_batches, step))
        raise_input_faults(out.faults)
    if routing is not None:
        out.update(routing.metrics())
    return out


def update_phase(policy, prepared: list[list[MicroBatch]], cfg, *, policy_moves: bool = True, critic=None,
                 critic_batches=None) -> tuple[list[dict], list[dict]]:
    """A step's updates: trainer.epochs passes over the mini-batches, each a policy step (unless the critic is
    still warming up: policy_moves=False) then, with a critic, a critic step on the same mini-batch.
    policy: update.Policy. Returns the policy's and the critic's per-update metrics."""
    outs, critic_outs = [], []
    for _ in range(cfg.trainer.epochs):
        for i, micro in enumerate(prepared):
            if policy_moves:
                outs.append(policy_step(policy.chunks, policy.optimizer, micro, cfg.algorithm, routing=policy.routing,
                                        old_from_update=policy.old_from_update, lr_schedule=policy.lr_schedule))
            if critic_batches is not None:
                critic_outs.append(critic.update(critic_batches[i]))
    return outs, critic_outs
