"""One optimizer step through megatron's pipeline schedule, with a pluggable per-token loss.

The plain next-token cross-entropy here is the foundation's loss; the RL losses plug into the same
`forward_step` contract (return summed loss, token count, report) later.

Devices: batches are built on the host and moved to `platform.device()` once, as this rank's share,
where the micro-batches are cut (`to_device`: here and in policy_step.shard_and_split); the model, the
losses and the metrics take their device from the batch. Metric scalars are reduced as device tensors
over megatron's groups (NCCL on GPUs takes nothing else) and copied to the host once, at the end.
"""
from __future__ import annotations

import math
from functools import partial

import torch
import torch.distributed as dist

from rlpo_mega import platform


def to_device(batch: dict, device=None) -> dict:
    """The batch's tensors on `device` (default: platform.device()); other values as they are."""
    device = platform.device() if device is None else device
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


def mask_padded_vocab(logits: torch.Tensor, real_vocab: int) -> torch.Tensor:
    """Megatron pads the vocabulary; padded columns must not take probability mass (HF has none)."""
    from megatron.core import parallel_state

    local = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * local
    n_pad = start + local - real_vocab
    if n_pad <= 0:
        return logits
    keep = torch.arange(start, start + local, device=logits.device) < real_vocab
    return logits.masked_fill(~keep, float("-inf"))


def token_cross_entropy(logits, labels, real_vocab):
    """Per-token -log p(label) from vocab-parallel logits [b, s, v/tp] (no full-vocab gather)."""
    from megatron.core import tensor_parallel

    logits = mask_padded_vocab(logits.float(), real_vocab)
    return tensor_parallel.vocab_parallel_cross_entropy(logits, labels)


def _lm_forward_step(data_iterator, model, real_vocab):
    batch = next(data_iterator)
    tokens = batch["tokens"]
    position_ids = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
    output = model(input_ids=tokens, position_ids=position_ids, attention_mask=None)

    def loss_func(logits):
        losses = token_cross_entropy(logits, batch["labels"], real_vocab)
        mask = batch["loss_mask"].float()
        total = (losses * mask).sum()
        count = mask.sum().to(torch.int)
        return total, count, {"lm_loss": torch.stack([total.detach(), mask.sum()])}

    return output, loss_func


def make_lm_batch(tokens: torch.Tensor) -> dict:
    """tokens [b, s+1] -> inputs [b, s], next-token labels and a full loss mask."""
    return {
        "tokens": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "loss_mask": torch.ones_like(tokens[:, 1:], dtype=torch.float),
    }


def run_schedule(model_chunks, micro_batches, forward_only, forward_step=None):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from rlpo_mega.model_setup import unwrap

    inner = unwrap(model_chunks[0])
    if forward_step is None:
        forward_step = partial(_lm_forward_step, real_vocab=inner.real_vocab_size)
    tokens = micro_batches[0]["tokens"]
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(micro_batches),
        model=model_chunks,
        num_microbatches=len(micro_batches),
        seq_length=tokens.shape[1],
        micro_batch_size=tokens.shape[0],
        forward_only=forward_only,
    )


def reduce_report(reports: list[dict]) -> dict:
    """Global metrics from per-micro-batch reports: [sum, count] pairs are summed over micro-batches and
    DP ranks then divided (a count of 0: the plain sum, as the objective's fault counts use); "max:"/"min:"
    keys take the max/min (NaN when no micro-batch had one). Every
    rank gets the values (sent from the last stage). The sums stay on platform.device() (the reports'
    device; NCCL reduces nothing else) and reach the host in one copy at the end."""
    from megatron.core import parallel_state

    last = parallel_state.is_pipeline_last_stage()
    keys = sorted(reports[0]) if reports else []
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        box = [keys]
        dist.broadcast_object_list(box, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                   group=parallel_state.get_pipeline_model_parallel_group())
        keys = box[0]
    mean_keys = [k for k in keys if not k.startswith(("max:", "min:"))]
    max_keys = [k for k in keys if k.startswith("max:")]
    min_keys = [k for k in keys if k.startswith("min:")]
    device = platform.device()
    sums = torch.zeros(len(mean_keys), 2, dtype=torch.float64, device=device)
    # max over ranks of (max, -min): a micro-batch without the key (no valid sequence) contributes -inf
    extremes = torch.full((len(max_keys) + len(min_keys),), -math.inf, dtype=torch.float64, device=device)
    for r in reports:
        if mean_keys:
            sums += torch.stack([r[k].detach().double() for k in mean_keys])
        for i, k in enumerate(max_keys + min_keys):
            if k in r:
                v = r[k].detach().double()
                extremes[i] = torch.maximum(extremes[i], v.max() if i < len(max_keys) else -v.min())
    if last:
        dp = parallel_state.get_data_parallel_group()
        dist.all_reduce(sums, group=dp)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=dp)
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        src = parallel_state.get_pipeline_model_parallel_last_rank()
        group = parallel_state.get_pipeline_model_parallel_group()
        dist.broadcast(sums, src=src, group=group)
        dist.broadcast(extremes, src=src, group=group)
    host = torch.cat([sums.flatten(), extremes]).tolist()  # the one device-to-host copy
    sums = [host[2 * i:2 * i + 2] for i in range(len(mean_keys))]
    extremes = host[2 * len(mean_keys):]
    out = {k: sums[i][0] / max(sums[i][1], 1.0) for i, k in enumerate(mean_keys)}
    for i, k in enumerate(max_keys + min_keys):
        v = extremes[i]
        out[k[4:]] = (v if i < len(max_keys) else -v) if math.isfinite(v) else math.nan
    return out


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
    from rlpo_mega.training.rollout_phase import all_ok

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
    from rlpo_mega.algorithms.objective import raise_input_faults

    out = raise_input_faults(reduce_report(forward_backward(model_chunks, optimizer, micro_batches, forward_step)))
    if math.isfinite(out[loss_key]) and grads_finite(model_chunks):
        applied, out["grad_norm"] = optimizer_step(optimizer, lr_schedule, strict=False)
    else:
        applied, out["grad_norm"] = False, math.nan
    out["skipped"] = float(not applied)
    if strict and not applied:
        what = loss_key if not math.isfinite(out[loss_key]) else "gradients"
        raise FloatingPointError(f"optimizer step skipped: non-finite {what}")
    return out


def train_step(model_chunks, optimizer, micro_batches, forward_step=None):
    """One next-token optimizer step over the given micro-batches (this rank's share of the global batch)."""
    if forward_step is None:
        from rlpo_mega.model_setup import unwrap

        forward_step = partial(_lm_forward_step, real_vocab=unwrap(model_chunks[0]).real_vocab_size)
    out = update(model_chunks, optimizer, micro_batches, forward_step, "lm_loss", strict=True)
    return {"loss": out["lm_loss"], "grad_norm": out["grad_norm"]}


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


def eval_loss(model_chunks, micro_batches, forward_step=None) -> float:
    return reduce_report(forward_only(model_chunks, micro_batches, forward_step))["lm_loss"]


def split_micro_batches(tokens: torch.Tensor, num_micro_batches: int) -> list[dict]:
    """This rank's tokens [b, s+1] -> micro-batches on platform.device() (one copy of the tokens)."""
    if tokens.shape[0] % num_micro_batches:
        raise ValueError(f"batch of {tokens.shape[0]} is not divisible into {num_micro_batches} micro-batches")
    tokens = tokens.to(platform.device())
    return [make_lm_batch(t) for t in tokens.chunk(num_micro_batches)]


def data_parallel_shard(tokens: torch.Tensor) -> torch.Tensor:
    """This DP rank's contiguous share of a global batch."""
    from megatron.core import parallel_state

    dp = parallel_state.get_data_parallel_world_size()
    rank = parallel_state.get_data_parallel_rank()
    if tokens.shape[0] % dp:
        raise ValueError(f"global batch {tokens.shape[0]} is not divisible by data-parallel size {dp}")
    return tokens.chunk(dp)[rank]
