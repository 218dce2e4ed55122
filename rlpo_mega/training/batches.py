"""This rank's micro-batches from its received samples and the step plan: packed (THD) or padded.

Packed: the samples of a micro-batch sit back to back in one row [1, t] (each contributes its prompt +
response - 1 input positions), with cu_seqlens for attention and RoPE (moe.packed_attention without TE,
TEDotProductAttention with it); t is padded to the sequence-parallel multiple by a tail segment that is
its own (masked) sequence. Padded: one sample per row, right-padded to the step's longest sample.

Either way the loss side sees the same [rows, positions] view: `index` [n, s] maps each sample's positions
to the packed row (policy_step unpacks the per-token log-probs through it), and loss_mask, advantages and
rollout_logp are [n, s] / [n] with s the micro-batch's longest sample. So the objective and the global
loss normalisation are the ones of the padded path, token for token. Routes for replay are cut to the
same positions (moe.routing.transport placements) and travel with the micro-batch.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from moe.routing.trace import RoutingTrace
from moe.routing.transport import Segment, local_routes


def _sample_rows(samples, received, idx):
    out = []
    for i in idx:
        s, r = samples[i], received[i]
        if r.ids.numel() != s.prompt_len + s.response_len:
            raise ValueError(f"sample {i}: {r.ids.numel()} tokens arrived, its scalars say "
                             f"{s.prompt_len} + {s.response_len}")
        out.append((i, s, r))
    return out


def build_micro_batch(samples, received, idx: list[int], advantages: torch.Tensor, keep: torch.Tensor, *,
                      layout: str, align: int, pad_id: int, padded_len: Optional[int] = None,
                      recipient=None, topk: int = 0) -> dict:
    """One micro-batch (host tensors). idx: sample indices (may be empty: a rank with fewer samples than
    the agreed micro-batch count runs one masked pad segment, so every rank joins each forward's
    collectives). recipient: this rank's moe.routing.transport.Recipient when routes are replayed."""
    rows = _sample_rows(samples, received, idx)
    n = max(1, len(rows))
    spans = [s.span for _, s, _ in rows]
    width = max(spans, default=1)  # positions of the [n, s] loss view
    if layout == "padded":
        width = padded_len
    loss_mask = torch.zeros(n, width, dtype=torch.bool)
    roll = torch.zeros(n, width)
    adv = torch.zeros(n)
    for k, (i, s, r) in enumerate(rows):
        start = s.prompt_len - 1  # the input position predicting the first response token
        loss_mask[k, start:start + s.response_len] = bool(keep[i])
        roll[k, start:start + s.response_len] = r.logprobs
        adv[k] = advantages[i]
    batch = {"loss_mask": loss_mask, "advantages": adv, "rollout_logp": roll, "samples": list(idx)}
    if layout == "padded":
        tokens = torch.full((n, width + 1), pad_id, dtype=torch.long)
        for k, (_, s, r) in enumerate(rows):
            tokens[k, :s.span + 1] = r.ids
        batch.update(tokens=tokens[:, :-1].contiguous(), labels=tokens[:, 1:].contiguous())
        placement = [Segment(k, k, 0, s.span) for k, (_, s, _) in enumerate(rows)]
        n_rows, seq_len = n, width
    else:
        total = sum(spans)
        t = -(-max(total, 1) // align) * align
        tokens = torch.full((t,), pad_id, dtype=torch.long)
        labels = torch.full((t,), pad_id, dtype=torch.long)
        index = torch.zeros(n, width, dtype=torch.long)
        pos = torch.zeros(t, dtype=torch.long)
        cu, off = [0], 0
        for k, (_, s, r) in enumerate(rows):
            # a sample's own next tokens as labels: a plain shift of the packed row would make its last
            # position predict the next sample's first token
            tokens[off:off + s.span], labels[off:off + s.span] = r.ids[:-1], r.ids[1:]
            index[k, :s.span] = torch.arange(off, off + s.span)
            pos[off:off + s.span] = torch.arange(s.span)
            off += s.span
            cu.append(off)
        if t > off:  # the alignment tail: its own sequence, masked
            pos[off:] = torch.arange(t - off)
            cu.append(t)
        batch.update(tokens=tokens.unsqueeze(0), labels=labels.unsqueeze(0), index=index,
                     position_ids=pos.unsqueeze(0), cu_seqlens=torch.tensor(cu, dtype=torch.int32),
                     max_seqlen=max(b - a for a, b in zip(cu[:-1], cu[1:])))
        placement, o = [], 0
        for k, (_, s, _) in enumerate(rows):
            placement.append(Segment(k, 0, o, s.span))
            o += s.span
        n_rows, seq_len = 1, t
    if recipient is not None:
        traces = [RoutingTrace(r.routes, 0, r.replaced) for _, _, r in rows]
        local = replace(recipient, dp_rank=0, dp_size=1, layer_cols=tuple(range(len(recipient.layer_cols))))
        batch["routes"] = local_routes(traces, placement, local, n_rows, seq_len, topk)
    return batch



def prepare_step(samples, group_ids, cfg, dp: int, tp: int, recipients, spec, pad_id: int, timer=None):
    """A step's samples (exchange.Sample, global) -> (this rank's micro-batches per mini-batch as host
    tensors with routes attached, advantages [n] of all samples, stats). Collective (the exchange).
    Advantages come from the scalars on every rank; the plan (rlpo_mega.data.packing) decides where each
    sample trains; only then do the samples travel."""
    import contextlib

    from megatron.core import parallel_state

    from rlpo_mega.training.policy_step import sequence_advantages
    from rlpo_mega.config import ConfigError
    from rlpo_mega.data.packing import aligned, plan_step
    from rlpo_mega.training.exchange import exchange

    adv, keep, stats = sequence_advantages(
        cfg.algorithm, torch.tensor([s.reward for s in samples]), group_ids,
        torch.tensor([s.response_len for s in samples]), torch.tensor([s.finish_reason == "length" for s in samples]))
    with_routes = all(s.has_routes for s in samples)
    if with_routes:
        stats.update({"routing/fallback_entries": sum(s.replaced_entries for s in samples),
                      "routing/fallback_tokens": sum(s.replaced_tokens for s in samples),
                      "routing/fallback_samples": sum(s.replaced_entries > 0 for s in samples)})
    elif cfg.routing.mode == "r3":
        raise ConfigError("routing.mode=r3 but the rollout engine returned no routes (turn on route capture: "
                          "rollout.embedded.capture_routes=true)")
    spans = [s.span for s in samples]
    t = cfg.trainer
    plan = plan_step(spans, t.mini_batches, dp, cfg.parallel.num_micro_batches, t.max_tokens_per_micro_batch,
                     t.layout, align=tp)
    with (timer("exchange") if timer is not None else contextlib.nullcontext()):
        received, xstats = exchange(samples, plan.dp_of(), recipients, spec if with_routes else None)
    me = recipients[torch.distributed.get_rank()]
    minis = [[build_micro_batch(samples, received, idx, adv, keep, layout=t.layout, align=tp, pad_id=pad_id,
                                padded_len=aligned(max(spans), tp), recipient=me if with_routes else None,
                                topk=spec.topk)
              for idx in mini] for mini in plan.mine(parallel_state.get_data_parallel_rank())]
    stats.update({"data/packing_efficiency": sum(spans) / plan.computed_tokens(spans, tp),
                  "data/micro_batches": max(len(m) for m in minis),
                  # this rank's bytes over its own rows' payload (training/exchange.py); rank 0's is logged
                  "data/bytes_over_own_share": xstats["bytes_received"] / max(xstats["own_share_bytes"], 1)})
    return minis, adv, stats
