"""Sharded distribution of a step's samples: scalars to every rank, each sample's payload only where it trains.

After the rollout each engine rank holds its own samples (tokens, rollout log-probs, routes). Two steps:
1. `gather_scalars`: every rank gets every sample's scalars (lengths, reward, flags, owner; a few dozen bytes
   each, over the host-side control group), which is all that advantages, dynamic sampling and the
   micro-batch plan (rlpo_mega.data.packing) need. The owner validates its samples' routing traces first
   (moe.routing.trace.validate_trace), so a bad trace is one error on every rank, before any exchange.
2. `exchange`: one all_to_all of bytes (device tensors: NCCL sends nothing else) puts each sample's
   tokens, log-probs and routes on the ranks of the DP replica that trains it, each rank receiving only
   its own MoE layers' route columns as uint8 (<= 256 experts; int16 beyond). No pickled tensors: both
   sides derive every offset from the scalars and the plan.

Bytes received per rank are at most its own share (its rows' tokens, log-probs and all layers' routes);
the previous all_gather_object sent the whole batch, with int32 routes, to every rank.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from moe.routing.trace import RoutingTraceError, TraceSpec, compact_dtype, validate_batch
from moe.routing.transport import wire_device
from rlpo_mega import platform
from rlpo_mega.rollout import Sample


def gather_scalars(local: list[Sample], spec: Optional[TraceSpec], on_bad_trace: str, group) -> list[Sample]:
    """Every rank: all samples in rank order (= the prompt order of collect.share), this rank's own (their
    routes validated into compact traces) and the others' scalars (Sample.from_scalars). Raises
    RoutingTraceError on every rank when an owner's trace is bad (on_bad_trace=error)."""
    me = dist.get_rank()
    rows, error = [], None
    try:
        traced = [i for i, s in enumerate(local) if s.routes is not None and spec is not None]
        # one pass over the whole share (moe.routing.trace.validate_batch): per-sample checks only on a problem
        traces, _ = validate_batch([local[i].routes for i in traced], spec,
                                   [len(local[i].prompt_ids) + len(local[i].response_ids) - 1 for i in traced],
                                   on_bad_trace, [f"{me}:{i}" for i in traced]) if traced else ([], {})
        for i, tr in zip(traced, traces):
            local[i].routes, local[i].replaced = tr.ids, tr.replaced
        replaced = {i: (tr.num_replaced, 0 if tr.replaced is None else int(tr.replaced.any(dim=1).sum()))
                    for i, tr in zip(traced, traces) if tr.replaced is not None}
        for i, s in enumerate(local):
            s.owner = me
            s.replaced_entries, s.replaced_tokens = replaced.get(i, (0, 0))
            rows.append(s.scalars())
    except RoutingTraceError as e:
        error = f"rank {me}: {e}"
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (rows, error), group=group)
    errors = [e for _, e in every if e]
    if errors:
        raise RoutingTraceError("; ".join(errors))
    return [local[i] if rank == me else Sample.from_scalars(row, rank)
            for rank, (rank_rows, _) in enumerate(every) for i, row in enumerate(rank_rows)]


def _blocks(samples: Sequence[Sample], n_cols: int, topk: int, itemsize: int, with_routes: bool) -> list[int]:
    """Byte sizes of the wire blocks of these samples (one sender -> one recipient), in wire order: all
    token ids (int32), all rollout log-probs (float32), all routes (compact dtype, the recipient's MoE layer
    columns), all replaced flags (uint8, samples with fallback entries only). Block-wise, not sample by
    sample: each block is one concatenation on the sender and one split on the recipient."""
    sizes = [4 * sum(s.prompt_len + s.response_len for s in samples), 4 * sum(s.response_len for s in samples)]
    if with_routes:
        sizes.append(sum(s.span for s in samples) * n_cols * topk * itemsize)
        sizes.append(sum(s.span for s in samples if s.replaced_entries) * n_cols)
    return sizes


def _encode(samples: Sequence[Sample], cols: list[int], with_routes: bool) -> list[torch.Tensor]:
    """The blocks of `_blocks` as byte tensors, from the owner's samples (on the host: an engine on the
    GPU returns device tensors)."""
    if not samples:
        return []
    payloads = samples
    ids = torch.tensor([t for p in payloads for t in (*p.prompt_ids, *p.response_ids)], dtype=torch.int32)
    parts = [ids.view(torch.uint8), torch.cat([p.logprobs.cpu().to(torch.float32) for p in payloads]).view(torch.uint8)]
    if with_routes:
        routes = torch.cat([p.routes.cpu() for p in payloads])
        parts.append((routes if len(cols) == routes.shape[1] else routes[:, cols]).contiguous().view(torch.uint8)
                     .reshape(-1))
        rep = [p.replaced.cpu()[:, cols].to(torch.uint8).reshape(-1) for s, p in zip(samples, payloads)
               if s.replaced_entries]
        if rep:
            parts.append(torch.cat(rep))
    return parts


def own_share_bytes(samples: Sequence[Sample], mine: Sequence[int], spec: Optional[TraceSpec]) -> int:
    """The wire size of these samples with every MoE layer's routes: the yardstick of `exchange`."""
    with_routes = spec is not None and all(s.has_routes for s in samples)
    itemsize = compact_dtype(spec.num_experts).itemsize if with_routes else 0
    return sum(_blocks([samples[i] for i in mine], spec.num_layers if with_routes else 0,
                       spec.topk if with_routes else 0, itemsize, with_routes))


def exchange(samples: Sequence[Sample], dp_of: dict[int, int], recipients: Sequence, spec: Optional[TraceSpec],
             group=None) -> tuple[dict[int, Sample], dict]:
    """Send each sample (index -> DP rank in dp_of) from its owner to every rank of that DP replica.
    recipients: moe.routing.transport.gather_recipients (each rank's dp_rank and MoE layer columns).
    Returns {sample index: the sample with its payload (ids as tensors, this rank's route columns)} of this
    rank's samples, and {"bytes_received", "own_share_bytes"}."""
    me, world = dist.get_rank(), dist.get_world_size()
    mine_r = recipients[me]
    with_routes = spec is not None and all(s.has_routes for s in samples) and bool(samples)
    dtype = compact_dtype(spec.num_experts) if with_routes else torch.uint8
    itemsize = dtype.itemsize
    topk = spec.topk if with_routes else 0
    order = sorted(dp_of)  # both sides walk samples in index order
    outgoing = []
    for r in recipients:  # r.rank == its index
        mine = [samples[i] for i in order if samples[i].owner == me and dp_of[i] == r.dp_rank]
        outgoing.append(_encode(mine, list(r.layer_cols), with_routes))
    # the world group is NCCL on GPUs: device tensors only (platform.device(); the host on CPU)
    device = platform.device() if group is None else wire_device(group)
    send_sizes = [sum(t.numel() for t in parts) for parts in outgoing]
    n_cols = len(mine_r.layer_cols)
    expected = [i for i in order if dp_of[i] == mine_r.dp_rank]
    from_src = [[samples[i] for i in expected if samples[i].owner == src] for src in range(world)]
    blocks = [_blocks(f, n_cols, topk, itemsize, with_routes) for f in from_src]
    recv_sizes = [sum(b) for b in blocks]
    send = torch.cat([t for parts in outgoing for t in parts]) if any(send_sizes) else torch.empty(0, dtype=torch.uint8)
    send = send.to(device)
    recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=device)
    dist.all_to_all_single(recv, send, output_split_sizes=recv_sizes, input_split_sizes=send_sizes, group=group)
    recv = recv.cpu()  # one copy; the micro-batches are cut on the host and moved once (MicroBatch.to)
    out, base = {}, 0
    for src in range(world):
        got = from_src[src]
        if not got:
            continue
        # clone each block: a view as a wider dtype needs an aligned start, and blocks follow each other unaligned
        pieces, pos = [], base
        for n in blocks[src]:
            pieces.append(recv[pos:pos + n].clone())
            pos += n
        base = pos
        ids = pieces[0].view(torch.int32).long().split([s.prompt_len + s.response_len for s in got])
        lps = pieces[1].view(torch.float32).split([s.response_len for s in got])
        routes = replaced = [None] * len(got)
        if with_routes:
            # explicit row counts: a pipeline stage without MoE layers (dense first layers) has n_cols == 0
            spans = [s.span for s in got]
            routes = pieces[2].view(dtype).reshape(sum(spans), n_cols, topk).split(spans)
            flagged = [s for s in got if s.replaced_entries]
            rep = iter(pieces[3].reshape(sum(s.span for s in flagged), n_cols).bool().split(
                [s.span for s in flagged]) if flagged else ())
            replaced = [next(rep) if s.replaced_entries else None for s in got]
        idx = [i for i in expected if samples[i].owner == src]
        for i, x, lp, rt, rp in zip(idx, ids, lps, routes, replaced):
            p = samples[i].prompt_len
            out[i] = replace(samples[i], prompt_ids=x[:p], response_ids=x[p:], logprobs=lp, routes=rt, replaced=rp)
    own = own_share_bytes(samples, expected, spec if with_routes else None)
    return out, {"bytes_received": int(recv.numel()), "own_share_bytes": own}
