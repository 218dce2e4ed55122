"""Per-token log pi(label) and entropy from vocab-parallel logits, with a hand-written backward.

Each tensor-parallel rank holds a contiguous vocabulary shard [N, V/tp] (megatron's ColumnParallelLinear
with parallel_output=True). Nothing is gathered: every rank reduces its shard to per-token statistics
(max, sum-exp, sum-exp * logit, target logit), which are all-reduced across the TP group (one MAX and one
SUM collective per call). The work is chunked over tokens, so besides the input logits the forward only
holds a few chunk-sized fp32 temporaries, and the backward writes the logits gradient (one shard, which
autograd needs anyway) chunk by chunk, recomputing softmax from the saved statistics instead of keeping a
full-size fp32 softmax. Megatron's padded vocabulary columns are skipped (they get zero probability and
zero gradient) without a masked copy of the logits.

Temperature is applied as the rollout engines do (SGLang/vLLM divide the float logits by T before the
softmax): log pi = log_softmax(logits / T).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

# Upper bound of elements per fp32 chunk temporary (16 MiB), and at least this many chunks per call, so
# the temporaries stay a small fraction of one logits shard whatever its size.
CHUNK_ELEMENTS = 1 << 22
MIN_CHUNKS = 16


def _default_tp_group():
    try:
        from megatron.core import parallel_state
    except ImportError:
        return None
    if not parallel_state.model_parallel_is_initialized():
        return None
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return None
    return parallel_state.get_tensor_model_parallel_group()


def _rows_per_chunk(n_rows: int, n_cols: int, chunk_size: Optional[int]) -> int:
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size={chunk_size} must be >= 1 (tokens per chunk)")
        return chunk_size
    by_budget = max(1, CHUNK_ELEMENTS // max(1, n_cols))
    return max(1, min(by_budget, math.ceil(n_rows / MIN_CHUNKS)))


def _scaled_chunk(logits: torch.Tensor, r0: int, r1: int, n_real: int, temperature: float):
    """fp32 logits/T of rows [r0, r1) over the real columns; (tensor, owns_memory)."""
    z = logits[r0:r1, :n_real]
    owned = z.dtype != torch.float32
    z = z.float()
    if temperature != 1.0:
        z = z.div_(temperature) if owned else z / temperature
        owned = True
    return z, owned


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, temperature, n_real, vocab_start, group, rows, with_entropy):
        n = logits.shape[0]
        dev = logits.device
        local = labels - vocab_start
        owned = (local >= 0) & (local < n_real)
        local = torch.where(owned, local, torch.zeros_like(local))
        m_loc = torch.full((n,), float("-inf"), device=dev)
        s_loc = torch.zeros(n, device=dev)
        ez_loc = torch.zeros(n, device=dev)  # sum_j e_j (z_j - m_loc)
        target = torch.zeros(n, device=dev)
        if n_real > 0:
            for r0 in range(0, n, rows):
                r1 = min(n, r0 + rows)
                z, own = _scaled_chunk(logits, r0, r1, n_real, temperature)
                target[r0:r1] = z.gather(1, local[r0:r1, None])[:, 0]
                mc = z.amax(dim=1)
                zs = z.sub_(mc[:, None]) if own else z - mc[:, None]
                if with_entropy:  # row-wise dot product without another chunk-sized temporary
                    e = torch.exp(zs)
                    ez_loc[r0:r1] = torch.bmm(e.unsqueeze(1), zs.unsqueeze(2)).view(-1)
                else:
                    e = zs.exp_()  # zs is always this chunk's own buffer
                s_loc[r0:r1] = e.sum(dim=1)
                m_loc[r0:r1] = mc
                del z, zs, e
        target = torch.where(owned, target, torch.zeros_like(target))
        m = m_loc.clone()
        if group is not None:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        # Rescale this shard's sums from its own max to the global max; a shard without real columns
        # (all padding) contributes nothing (guards exp(-inf) * -inf).
        has = s_loc > 0
        scale = torch.where(has, torch.exp(m_loc - m), torch.zeros_like(m))
        shift = torch.where(has, m_loc - m, torch.zeros_like(m))
        stats = torch.stack([s_loc * scale, (ez_loc + shift * s_loc) * scale, target])
        if group is not None:
            dist.all_reduce(stats, group=group)
        s, ezm, target = stats
        lse = m + torch.log(s)  # log sum_j exp(z_j), z = logits / T
        logp = target - lse
        entropy = torch.log(s) - ezm / s if with_entropy else torch.zeros_like(logp)
        ctx.save_for_backward(logits, local, owned, lse, entropy)
        ctx.cfg = (temperature, n_real, rows)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits, local, owned, lse, entropy = ctx.saved_tensors
        temperature, n_real, rows = ctx.cfg
        n, v = logits.shape
        grad = torch.empty_like(logits)
        if n_real < v:
            grad[:, n_real:] = 0
        g_logp = g_logp.float()
        g_ent = g_ent.float() if g_ent is not None else None
        # fp32 logits: compute straight into the gradient buffer (no chunk copy, one memory pass less)
        direct = logits.dtype == torch.float32
        for r0 in range(0, n if n_real > 0 else 0, rows):
            r1 = min(n, r0 + rows)
            out = grad[r0:r1, :n_real]
            if direct:
                z = logits[r0:r1, :n_real]
                if temperature != 1.0:
                    g = torch.div(z, temperature, out=out).sub_(lse[r0:r1, None])
                else:
                    g = torch.sub(z, lse[r0:r1, None], out=out)
            else:
                g = _scaled_chunk(logits, r0, r1, n_real, temperature)[0].sub_(lse[r0:r1, None])
            # g = log p_j
            gl = g_logp[r0:r1, None]
            if g_ent is not None:
                # dH/dz_j = -p_j (log p_j + H); dlogp/dz_j = onehot_j - p_j
                p = torch.exp(g)
                g.add_(entropy[r0:r1, None]).mul_(p).mul_(-g_ent[r0:r1, None])
                g.addcmul_(p, gl, value=-1.0)
                del p
            else:
                g.exp_().mul_(-gl)
            g.scatter_add_(1, local[r0:r1, None], (gl * owned[r0:r1, None]))
            if temperature != 1.0:
                g.div_(temperature)
            if not direct:
                out.copy_(g)
            del g
        return grad, None, None, None, None, None, None, None


def vocab_parallel_logprobs(logits: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0,
                            real_vocab: Optional[int] = None, group="default",
                            vocab_start: Optional[int] = None, with_entropy: bool = True,
                            chunk_size: Optional[int] = None, check_labels: bool = True):
    """(log pi(labels), entropy) of shape labels.shape, fp32, differentiable w.r.t. `logits`.

    logits: [..., V/tp] this rank's vocabulary shard (any float dtype); labels: [...] global token ids,
    valid everywhere (use any real id at padding positions and mask them later). real_vocab: the
    tokenizer's vocabulary (megatron pads beyond it). group: the TP process group ("default": megatron's
    TP group when initialised, else none). chunk_size: tokens per chunk (default: bounded temporaries).
    Entropy is zeros when with_entropy=False. check_labels=False: the caller checks the label range itself
    (reading it here stops the host on a GPU; the trainer's step counts bad labels on the device,
    `bad_label_count`, and checks them once per step). An out-of-range label gets log-prob -lse, no error.
    """
    if not torch.is_floating_point(logits):
        raise TypeError(f"logits must be floating point, got {logits.dtype}")
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree: "
                         "expected logits [..., vocab_shard] for labels [...]")
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature={temperature} must be a positive finite number")
    if group == "default":
        group = _default_tp_group()
    rank = dist.get_rank(group) if group is not None else 0
    tp = dist.get_world_size(group) if group is not None else 1
    v_local = logits.shape[-1]
    if vocab_start is None:
        vocab_start = rank * v_local
    total = v_local * tp
    real_vocab = total if real_vocab is None else real_vocab
    if not 0 < real_vocab <= total:
        raise ValueError(f"real_vocab={real_vocab} must be in (0, {total}] (vocab shard {v_local} x tp {tp})")
    if check_labels and labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= real_vocab):
        raise ValueError(f"labels must be token ids in [0, {real_vocab}); got range "
                         f"[{int(labels.min())}, {int(labels.max())}] (put a real id at padding positions)")
    n_real = max(0, min(v_local, real_vocab - vocab_start))
    flat = logits.reshape(-1, v_local)
    rows = _rows_per_chunk(flat.shape[0], n_real, chunk_size)
    logp, ent = _VocabParallelLogProbs.apply(flat, labels.reshape(-1).long(), float(temperature), n_real,
                                             vocab_start, group, rows, with_entropy)
    return logp.view(labels.shape), ent.view(labels.shape)


def bad_label_count(labels: torch.Tensor, real_vocab: int, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Labels outside [0, real_vocab) (at mask's positions), as a device scalar: no host sync."""
    bad = (labels < 0) | (labels >= real_vocab)
    if mask is not None:
        bad = bad & mask.bool()
    return bad.sum()
