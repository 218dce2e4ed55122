"""Phase 2 of an RL step, plan and exchange: where each sample trains, the samples there, this rank's micro-batches.

The micro-batches, packed (THD) or padded:

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

from dataclasses import dataclass, field, fields, replace
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from moe.context_parallel import padded_length, shard_index
from moe.routing.trace import RoutingTrace
from moe.routing.transport import LIVE, PAD, Segment, local_routes
from rlpo_mega import platform
from rlpo_mega.config import ConfigError
from rlpo_mega.data.packing import aligned, plan_step
from rlpo_mega.rollout import Sample
from rlpo_mega.training.exchange import exchange


@dataclass
class MicroBatch:
    """One micro-batch: what the model, routing replay and the losses read. Built on the host (here, and by the
    warm-up), moved to the device once (`to`); the old-log-prob pass, GAE and the critic fill their fields.
    Rows: the model's [rows, t] view (packed: one row of back-to-back samples); the loss view is [n, s]
    (n samples, s the longest one's positions; padded: the rows themselves)."""
    tokens: Optional[torch.Tensor] = None  # int64 [rows, t]: model input
    labels: Optional[torch.Tensor] = None  # int64 [rows, t]: next tokens
    loss_mask: Optional[torch.Tensor] = None  # [n, s]: the label is a response token of a kept sample
    advantages: Optional[torch.Tensor] = None  # [n] (sequence) or [n, s] (GAE)
    rollout_logp: Optional[torch.Tensor] = None  # [n, s]: the engine's log-probs of the response tokens
    old_logp: Optional[torch.Tensor] = None  # [n, s]: pi_old (training/old_logprobs.py, the last pipeline stage)
    ref_logp: Optional[torch.Tensor] = None  # [n, s]: the KL reference's
    routes: Optional[torch.Tensor] = None  # [rows, t / sp, this rank's MoE layers, topk]: routing replay's routes
    # packed (THD): where each sample sits in the row
    position_ids: Optional[torch.Tensor] = None  # [1, t]: positions restart at each sample
    cu_seqlens: Optional[torch.Tensor] = None  # int32 [samples (+ the alignment tail) + 1]
    max_seqlen: Optional[int] = None
    index: Optional[torch.Tensor] = None  # [n, s]: each sample's positions in the packed row (the loss view)
    # context parallelism: the row above is this CP rank's shard of the padded row these describe (megatron's
    # THD layout: every sample padded to 2 x cp (x tp), global); the loss view's index is into the padded row
    cu_seqlens_padded: Optional[torch.Tensor] = None  # int32 [samples + 1]
    samples: list = field(default_factory=list)  # the step's sample indices in this micro-batch
    # the critic's copy (training/critic.py): GAE's returns and the old values
    returns: Optional[torch.Tensor] = None
    old_values: Optional[torch.Tensor] = None

    def to(self, device=None) -> "MicroBatch":
        """A copy with every tensor on `device` (default platform.device()): the step's one host-to-device copy."""
        device = torch.device(platform.device() if device is None else device)
        return replace(self, **{f.name: to_device(getattr(self, f.name), device) for f in fields(self)
                                if torch.is_tensor(getattr(self, f.name))})

    def tensors(self) -> dict:
        """The tensor fields that are set, by name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if torch.is_tensor(getattr(self, f.name))}


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`. Host to CUDA through pinned memory, without waiting: a copy from pageable memory stops
    the host until the GPU has it (36 host syncs per step in tools/gpu_smoke.py's old-log-prob pass). torch's
    pinned-memory cache keeps the staging buffer alive until the copy is done."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _sample_rows(samples, received, idx):
    """(index, the sample's scalars as every rank knows them, the sample as it arrived) per index."""
    out = []
    for i in idx:
        s, r = samples[i], received[i]
        if r.prompt_len != s.prompt_len or r.response_len != s.response_len:
            raise ValueError(f"sample {i}: {r.prompt_len} + {r.response_len} tokens arrived, its scalars say "
                             f"{s.prompt_len} + {s.response_len}")
        out.append((i, s, r))
    return out


def build_micro_batch(samples, received, idx: list[int], advantages: torch.Tensor, keep: torch.Tensor, *,
                      layout: str, align: int, pad_id: int, padded_len: Optional[int] = None,
                      recipient=None, topk: int = 0, cp: tuple[int, int] = (1, 0)) -> MicroBatch:
    """One micro-batch (host tensors). idx: sample indices (may be empty: a rank with fewer samples than
    the agreed micro-batch count runs one masked pad segment, so every rank joins each forward's
    collectives). recipient: this rank's moe.routing.transport.Recipient when routes are replayed.
    cp: (context-parallel size, this rank's CP rank); above 1 the packed row is this rank's CP shard.
    Built with whole-batch tensor ops (a few per micro-batch, not per sample)."""
    rows = _sample_rows(samples, received, idx)
    n = max(1, len(rows))
    spans = torch.tensor([s.span for _, s, _ in rows] or [1])
    plens = torch.tensor([s.prompt_len for _, s, _ in rows] or [1])
    rlens = torch.tensor([s.response_len for _, s, _ in rows] or [0])
    width = int(spans.max())  # positions of the [n, s] loss view
    if layout == "padded":
        width = padded_len
    col = torch.arange(width)[None, :]
    start = (plens - 1)[:, None]  # the input position predicting the first response token
    in_response = (col >= start) & (col < start + rlens[:, None])
    kept = keep[torch.tensor(idx, dtype=torch.long)] if rows else torch.zeros(1, dtype=torch.bool)
    # rollout.partial_rollout_mask: a continued sample's tokens before its last continuation stay out of the loss
    masked = torch.tensor([s.masked_prefix for _, s, _ in rows] or [0])
    loss_mask = in_response & kept[:, None] & (col >= start + masked[:, None])
    # a multi-turn episode's observation and template tokens: conditioned on, never trained on
    for k, (_, s, _) in enumerate(rows):
        for a, c in s.obs_spans:
            loss_mask[k, int(start[k]) + a:int(start[k]) + a + c] = False
    roll = torch.zeros(n, width)
    adv = torch.zeros(n)
    if rows:
        roll[in_response] = torch.cat([r.logprobs for _, _, r in rows])  # row-major: each sample's tokens in order
        adv = advantages[torch.tensor(idx, dtype=torch.long)].to(adv.dtype)
    batch = MicroBatch(loss_mask=loss_mask, advantages=adv, rollout_logp=roll, samples=list(idx))
    ids = torch.cat([r.ids for _, _, r in rows]) if rows else torch.zeros(0, dtype=torch.long)
    if layout == "padded":
        tokens = torch.full((n, width + 1), pad_id, dtype=torch.long)
        if rows:  # each row: its sample's span + 1 tokens, then padding
            tokens[torch.arange(width + 1)[None, :] < (spans + 1)[:, None]] = ids
        batch.tokens, batch.labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        placement = [Segment(k, k, 0, s.span) for k, (_, s, _) in enumerate(rows)]
        n_rows, seq_len = n, width
    elif cp[0] > 1:
        return _context_parallel_rows(batch, rows, ids, spans, col, align, pad_id, recipient, topk, *cp)
    else:
        total = int(spans.sum()) if rows else 0
        t = -(-max(total, 1) // align) * align
        offsets = torch.cumsum(spans, 0) - spans  # each sample's first packed position
        tokens, labels, index = _packed_row(ids, spans, offsets, col, t, pad_id, torch.arange(total))
        pos = torch.arange(t)
        pos[:total] -= torch.repeat_interleave(offsets, spans)[:total] if rows else 0
        if t > total:  # the alignment tail: its own sequence, masked
            pos[total:] = torch.arange(t - total)
        cu = [0] + (torch.cumsum(spans, 0).tolist() if rows else []) + ([t] if t > total else [])
        batch = replace(batch, tokens=tokens.unsqueeze(0), labels=labels.unsqueeze(0), index=index,
                        position_ids=pos.unsqueeze(0), cu_seqlens=torch.tensor(cu, dtype=torch.int32),
                        max_seqlen=max(b - a for a, b in zip(cu[:-1], cu[1:])))
        if recipient is not None and rows:
            batch.routes = _packed_routes(rows, recipient, t, topk)
            return batch
        placement = [Segment(k, 0, int(o), s.span) for k, ((_, s, _), o) in enumerate(zip(rows, offsets.tolist()))]
        n_rows, seq_len = 1, t
    if recipient is not None:
        traces = [RoutingTrace(r.routes, 0, r.replaced) for _, _, r in rows]
        # each trace holds the rows from routes_from on (a sequence-parallel rank: its shard's)
        placement = [replace(seg, offset=seg.offset + r.routes_from, length=r.routes.shape[0])
                     for seg, (_, _, r) in zip(placement, rows)]
        local = replace(recipient, dp_rank=0, dp_size=1, layer_cols=tuple(range(len(recipient.layer_cols))))
        batch.routes = local_routes(traces, placement, local, n_rows, seq_len, topk)
    return batch


def _packed_row(ids, spans, offsets, col, t: int, pad_id: int, where: torch.Tensor):
    """A packed row's inputs and labels [t] (pad_id where no sample is) and the loss view's index [n, s]: sample
    k's positions from offsets[k]; `where`: the row positions of every sample's span positions, sample by sample.
    A sample's own next tokens as labels: a plain shift of the packed row would make its last position predict
    the next sample's first token. ids hold span + 1 tokens per sample: inputs drop each sample's last token,
    labels its first. No samples (ids empty): pads only, index 0."""
    tokens = torch.full((t,), pad_id, dtype=torch.long)
    labels = torch.full((t,), pad_id, dtype=torch.long)
    index = torch.where(col < spans[:, None], offsets[:, None] + col, torch.zeros((), dtype=torch.long))
    if ids.numel() == 0:
        return tokens, labels, index.zero_()
    ends = torch.cumsum(spans + 1, 0)
    last = torch.zeros(ids.numel(), dtype=torch.bool)
    first = torch.zeros(ids.numel(), dtype=torch.bool)
    last[ends - 1] = True
    first[ends - spans - 1] = True
    tokens[where], labels[where] = ids[~last], ids[~first]
    return tokens, labels, index


def _context_parallel_rows(batch, rows, ids, spans, col, align, pad_id, recipient, topk, cp, rank) -> MicroBatch:
    """The packed micro-batch under context parallelism: every sample padded to its own multiple of 2 x cp x
    align (megatron-core's THD divisibility; align = tp under sequence parallelism, whose scatter then cuts the
    CP-local row evenly), then this CP rank's rows (moe.context_parallel.shard_index: chunks rank and
    2cp-1-rank of each sample). cu_seqlens are the padded ones, global, as megatron passes them; each sample's
    labels are its own next tokens before the split. Routes: the padded row's (of the rows the exchange brought
    this rank: its chunks' and SP slice's), cut the same way, then the sequence-parallel rank's contiguous slice
    of the CP-local row."""
    unit = 2 * cp * align
    padded = -(-spans // unit) * unit
    offsets = torch.cumsum(padded, 0) - padded  # each sample's first position in the padded row
    cu = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(padded, 0)])
    t = int(cu[-1])
    where = (offsets[:, None] + col)[col < spans[:, None]]  # row-major: sample by sample, as ids hold them
    tokens, labels, index = _packed_row(ids, spans, offsets, col, t, pad_id, where)
    pos = torch.arange(t) - torch.repeat_interleave(offsets, padded)
    mine = shard_index(cu, cp, rank)
    batch = replace(batch, tokens=tokens[mine].unsqueeze(0), labels=labels[mine].unsqueeze(0), index=index,
                    position_ids=pos[mine].unsqueeze(0), cu_seqlens=cu.to(torch.int32),
                    cu_seqlens_padded=cu.to(torch.int32), max_seqlen=int(padded.max()))
    if recipient is not None and rows:
        first = rows[0][2].routes
        dtype = torch.int32 if first.dtype == torch.int32 else torch.int16
        full = torch.full((t, first.shape[1], topk), PAD, dtype=dtype)
        for (_, _, r), o in zip(rows, offsets.tolist()):
            k = 0  # the exchange sent the rows of this rank's chunks (routes_rows), back to back
            for lo, hi in r.routes_rows or ((r.routes_from, r.routes_from + r.routes.shape[0]),):
                full[o + lo:o + hi] = r.routes[k:k + hi - lo]
                if r.replaced is not None:
                    full[o + lo:o + hi][r.replaced[k:k + hi - lo]] = LIVE
                k += hi - lo
        a, b = recipient.shard(mine.numel())
        batch.routes = full[mine[a:b]].unsqueeze(0)
    return batch


def _packed_routes(rows, recipient, t: int, topk: int) -> torch.Tensor:
    """The packed row's routes [1, this rank's sequence shard, its MoE layers, topk]: the samples' routes back
    to back (they are the packed positions), PAD on the alignment tail, LIVE where a trace entry was replaced
    (moe.routing.transport's markers and dtype, as local_routes would cut them). Each sample arrived with the
    trace rows of this rank's shard (from `routes_from`; every row without sequence parallelism)."""
    a, b = recipient.shard(t)
    first = rows[0][2].routes
    dtype = torch.int32 if first.dtype == torch.int32 else torch.int16
    out = torch.full((b - a, first.shape[1], topk), PAD, dtype=dtype)
    off = 0
    for _, s, r in rows:
        start = off + r.routes_from  # the packed position of the first trace row it holds
        p0, p1 = max(a, start), min(b, start + r.routes.shape[0])
        if p0 < p1:
            out[p0 - a:p1 - a] = r.routes[p0 - start:p1 - start]
            if r.replaced is not None:
                out[p0 - a:p1 - a][r.replaced[p0 - start:p1 - start]] = LIVE
        off += s.span
    return out.unsqueeze(0)


def plan_and_exchange(samples: list[Sample], advantages: torch.Tensor, keep: torch.Tensor, cfg, dp: int, tp: int,
                      recipients, spec, pad_id: int, timer) -> tuple[list[list[MicroBatch]], dict]:
    """Phase 2 of an RL step: the step plan (rlpo_mega.data.packing: mini-batches, the DP split, micro-batches)
    from every sample's scalars, identical on every rank; then the exchange (training/exchange.py) carries each
    sample's payload to the ranks that train it; then this rank's micro-batches per mini-batch, as host
    tensors with routes attached. Collective. advantages [n] / keep [n]: algorithms.advantages.
    sequence_advantages of all samples."""
    with_routes = all(s.has_routes for s in samples)
    stats = {}
    if with_routes:
        stats.update({"routing/fallback_entries": sum(s.replaced_entries for s in samples),
                      "routing/fallback_tokens": sum(s.replaced_tokens for s in samples),
                      "routing/fallback_samples": sum(s.replaced_entries > 0 for s in samples)})
    elif cfg.routing.mode == "r3":
        raise ConfigError("routing.mode=r3 but the rollout engine returned no routes (turn on route capture: "
                          "rollout.embedded.capture_routes=true)")
    spans = [s.span for s in samples]
    t = cfg.trainer
    cp = (parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank())
    # under context parallelism the plan counts each sample padded to the CP layout: a micro-batch's token
    # budget is its CP group's (the whole padded row), and the DP split balances what the ranks compute
    planned = [padded_length(n, cp[0], tp) for n in spans] if cp[0] > 1 else spans
    plan = plan_step(planned, t.mini_batches, dp, cfg.parallel.num_micro_batches, t.max_tokens_per_micro_batch,
                     t.layout, align=tp)
    # under sequence and context parallelism each rank receives only the route rows of the positions it holds
    sp = recipients[0].sp_size
    shards = plan.shards(spans, tp, sp, cp[0]) if with_routes and sp * cp[0] > 1 else None
    with timer("exchange"):
        received, xstats = exchange(samples, plan.dp_of(), recipients, spec if with_routes else None,
                                    round_bytes=t.exchange_round_mb << 20, shards=shards)
    me = recipients[dist.get_rank()]
    minis = [[build_micro_batch(samples, received, idx, advantages, keep, layout=t.layout, align=tp, pad_id=pad_id,
                                padded_len=aligned(max(spans), tp), recipient=me if with_routes else None,
                                topk=spec.topk, cp=cp)
              for idx in mini] for mini in plan.mine(parallel_state.get_data_parallel_rank())]
    stats.update({"data/packing_efficiency": sum(spans) / plan.computed_tokens(planned, tp),
                  "data/micro_batches": max(len(m) for m in minis),
                  # this rank's bytes over its own rows' payload (training/exchange.py); rank 0's is logged
                  "data/bytes_over_own_share": xstats["bytes_received"] / max(xstats["own_share_bytes"], 1),
                  "data/exchange_rounds": xstats["rounds"]})
    return minis, stats
