"""One optimizer step through megatron's pipeline schedule, with a pluggable per-token loss.

The plain next-token cross-entropy here is the foundation's loss; the RL losses plug into the same
`forward_step` contract (return summed loss, token count, report) later.

Devices: batches are built on the host and moved to `platform.device()` once, as this rank's share,
where the micro-batches are cut (`to_device`: here and in policy_step.shard_and_split); the model, the
losses and the metrics take their device from the batch. Metric scalars are reduced as device tensors
over megatron's groups (NCCL on GPUs takes nothing else) and copied to the host once, at the end.
"""
from __future__ import annotations

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

    from .model_setup import unwrap

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


def reduce_loss(reports, key="lm_loss") -> float:
    """Global token-mean from per-micro-batch (sum, count): summed over DP, sent from the last stage."""
    from megatron.core import parallel_state

    stats = torch.zeros(2, dtype=torch.float64, device=platform.device())
    for report in reports:
        stats += report[key].double()
    if parallel_state.is_pipeline_last_stage():
        dist.all_reduce(stats, group=parallel_state.get_data_parallel_group())
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(stats, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                       group=parallel_state.get_pipeline_model_parallel_group())
    total, count = stats.tolist()  # the one device-to-host copy
    return total / max(count, 1.0)


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
    import math

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


def train_step(model_chunks, optimizer, micro_batches, forward_step=None):
    """One optimizer step over the given micro-batches (this rank's share of the global batch)."""
    reports = forward_backward(model_chunks, optimizer, micro_batches, forward_step)
    _, grad_norm = optimizer_step(optimizer)
    return {"loss": reduce_loss(reports), "grad_norm": grad_norm}


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
    return reduce_loss(forward_only(model_chunks, micro_batches, forward_step))


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
