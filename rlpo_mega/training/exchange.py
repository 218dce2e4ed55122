"""Sharded distribution of a step's samples: scalars to every rank, each sample's payload only where it trains.

After the rollout every rank holds every sample's scalars and each engine rank its own samples' payloads
(rollout/gather.py). `exchange`: one all_to_all of bytes (device tensors: NCCL sends nothing else) puts each
sample's tokens, log-probs and routes on the ranks of the DP replica that trains it, each rank receiving only its
own MoE layers' route columns as uint8 (<= 256 experts; int16 beyond) and, under sequence and context
parallelism, only the route rows of the positions it holds (`shards`: where the plan puts each sample in its
micro-batch). No pickled tensors: both sides derive every offset from the scalars and the plan.

Bytes received per rank are at most its own share (its rows' tokens, log-probs and all layers' routes);
the previous all_gather_object sent the whole batch, with int32 routes, to every rank.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from moe.routing.trace import TraceSpec, compact_dtype
from moe.routing.transport import wire_device
from rlpo_mega import platform
from rlpo_mega.rollout import Sample


def _blocks(samples: Sequence[Sample], n_cols: int, topk: int, itemsize: int, with_routes: bool,
            rows: Optional[Sequence[tuple]] = None) -> list[int]:
    """Byte sizes of the wire blocks of these samples (one sender -> one recipient), in wire order: all
    token ids (int32), all rollout log-probs (float32), all routes (compact dtype, the recipient's MoE layer
    columns and trace rows: `rows`, ranges ((lo, hi), ...) per sample, default all), all replaced flags (uint8,
    samples with fallback entries only). Block-wise, not sample by sample: each block is one concatenation on the
    sender and one split on the recipient. Each block is padded to a multiple of 4 bytes, so that every block starts
    aligned and the recipient views it in its dtype in place (no copy per block)."""
    sizes = [4 * sum(s.prompt_len + s.response_len for s in samples), 4 * sum(s.response_len for s in samples)]
    if with_routes:
        n = [s.span for s in samples] if rows is None else [_count(r) for r in rows]
        sizes.append(sum(n) * n_cols * topk * itemsize)
        sizes.append(sum(k for s, k in zip(samples, n) if s.replaced_entries) * n_cols)
    return [-(-n // 4) * 4 for n in sizes]


def _rows(samples: Sequence[Sample], idx: Sequence[int], shards: Optional[dict], recipient) -> list[tuple]:
    """The trace rows the recipient receives of each sample, as ranges ((lo, hi), ...): those of the positions it
    holds under sequence and context parallelism (`shards[i][cp_rank x sp_size + sp_rank]`), else every row."""
    if shards is None or recipient.sp_size * recipient.cp_size == 1:
        return [((0, samples[i].span),) for i in idx]
    return [shards[i][recipient.cp_rank * recipient.sp_size + recipient.sp_rank] for i in idx]


def _count(ranges: tuple) -> int:
    return sum(hi - lo for lo, hi in ranges)


def _cut(t: torch.Tensor, ranges: tuple) -> torch.Tensor:
    """t's rows of the ranges, back to back (a view for one range)."""
    if len(ranges) == 1:
        return t[ranges[0][0]:ranges[0][1]]
    return torch.cat([t[lo:hi] for lo, hi in ranges]) if ranges else t[:0]


def _padded(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each byte part followed by the zeros that make it a multiple of 4 bytes (_blocks' padding)."""
    out = []
    for t in parts:
        out.append(t)
        if t.numel() % 4:
            out.append(torch.zeros(4 - t.numel() % 4, dtype=torch.uint8))
    return out


def _encode(samples: Sequence[Sample], cols: list[int], with_routes: bool,
            rows: Sequence[tuple]) -> list[torch.Tensor]:
    """The blocks of `_blocks` as byte tensors, from the owner's samples (on the host: an engine on the
    GPU returns device tensors); rows: each sample's trace-row ranges for this recipient."""
    if not samples:
        return []
    ids = torch.cat([torch.as_tensor(x, dtype=torch.int32) for p in samples for x in (p.prompt_ids, p.response_ids)])
    parts = [ids.view(torch.uint8), torch.cat([p.logprobs.cpu().to(torch.float32) for p in samples]).view(torch.uint8)]
    if with_routes:
        routes = torch.cat([_cut(p.routes.cpu(), r) for p, r in zip(samples, rows)])
        parts.append((routes if len(cols) == routes.shape[1] else routes[:, cols]).contiguous().view(torch.uint8)
                     .reshape(-1))
        rep = [_cut(p.replaced.cpu(), r)[:, cols].to(torch.uint8).reshape(-1) for p, r in zip(samples, rows)
               if p.replaced_entries]
        if rep:
            parts.append(torch.cat(rep))
    return _padded(parts)


def own_share_bytes(samples: Sequence[Sample], mine: Sequence[int], spec: Optional[TraceSpec]) -> int:
    """The wire size of these samples with every MoE layer's routes: the yardstick of `exchange`."""
    with_routes = spec is not None and all(s.has_routes for s in samples)
    itemsize = compact_dtype(spec.num_experts).itemsize if with_routes else 0
    return sum(_blocks([samples[i] for i in mine], spec.num_layers if with_routes else 0,
                       spec.topk if with_routes else 0, itemsize, with_routes))


def rounds(samples: Sequence[Sample], dp_of: dict[int, int], recipients: Sequence, spec: Optional[TraceSpec],
           round_bytes: int, shards: Optional[dict] = None) -> list[list[int]]:
    """The exchange's rounds: consecutive runs of the samples (index order) in which no rank sends or receives
    more than round_bytes (a sample larger than that alone is a round of its own; a rank's own samples that it
    trains itself are neither sent nor received). Every rank computes the same rounds from the scalars alone."""
    with_routes = spec is not None and bool(samples) and all(s.has_routes for s in samples)
    itemsize = compact_dtype(spec.num_experts).itemsize if with_routes else 0
    topk = spec.topk if with_routes else 0
    by_dp: dict[int, list] = {}
    for r in recipients:
        by_dp.setdefault(r.dp_rank, []).append(r)
    out, cur, sent, got = [], [], {}, {}
    for i in sorted(dp_of):
        s = samples[i]
        # _blocks of one sample, inline: ids and log-probs, then per recipient its columns of routes and flags
        per_row = (topk * itemsize + (1 if s.replaced_entries else 0)) if with_routes else 0
        base = 4 * (s.prompt_len + 2 * s.response_len)
        cost = []
        for r in by_dp[dp_of[i]]:
            if r.rank == s.owner:  # taken in place (_own), not sent
                continue
            rows, = _rows(samples, [i], shards, r)
            cost.append((r.rank, base + per_row * len(r.layer_cols) * _count(rows)))
        over = any(sent.get(s.owner, 0) + sum(b for _, b in cost) > round_bytes or got.get(r, 0) + b > round_bytes
                   for r, b in cost)
        if cur and over:
            out.append(cur)
            cur, sent, got = [], {}, {}
        cur.append(i)
        sent[s.owner] = sent.get(s.owner, 0) + sum(b for _, b in cost)
        for r, b in cost:
            got[r] = got.get(r, 0) + b
        if sent[s.owner] > round_bytes or any(got[r] > round_bytes for r, _ in cost):  # one sample over: alone
            out.append(cur)
            cur, sent, got = [], {}, {}
    if cur:
        out.append(cur)
    return out


def exchange(samples: Sequence[Sample], dp_of: dict[int, int], recipients: Sequence, spec: Optional[TraceSpec],
             group=None, round_bytes: int = 256 << 20, shards: Optional[dict] = None) -> tuple[dict[int, Sample], dict]:
    """Send each sample (index -> DP rank in dp_of) from its owner to every rank of that DP replica, in rounds
    (`rounds`: at most round_bytes sent and received per rank and round, so no buffer grows with the batch).
    recipients: moe.routing.transport.gather_recipients (each rank's dp_rank, sequence shard and MoE layer
    columns). shards: {sample index: [((lo, hi), ...) per context x sequence-parallel rank]}, the trace rows
    each rank of its group trains (rlpo_mega.data.packing.StepPlan.shards); None: every rank gets every row.
    Returns {sample index: the sample with its payload (ids as tensors, this rank's route columns and rows:
    `routes_rows` their ranges, `routes_from` the first row)} of this rank's samples, and {"bytes_received",
    "own_share_bytes", "rounds"}.
    The owners keep their payloads (a producer may hand the same samples to a later step)."""
    out, received = {}, 0
    plan = rounds(samples, dp_of, recipients, spec, round_bytes, shards)
    for idx in plan:
        got, n = _exchange_round(samples, {i: dp_of[i] for i in idx}, recipients, spec, group, shards)
        out.update(got)
        received += n
    me = recipients[dist.get_rank()]
    with_routes = spec is not None and all(s.has_routes for s in samples) and bool(samples)
    own = own_share_bytes(samples, [i for i in sorted(dp_of) if dp_of[i] == me.dp_rank],
                          spec if with_routes else None)
    return out, {"bytes_received": received, "own_share_bytes": own, "rounds": len(plan)}


def _exchange_round(samples: Sequence[Sample], dp_of: dict[int, int], recipients: Sequence,
                    spec: Optional[TraceSpec], group, shards: Optional[dict]) -> tuple[dict[int, Sample], int]:
    """One round of `exchange`: one all_to_all of bytes; returns the received samples and the bytes that crossed
    the wire. A rank's own samples that it trains itself are taken in place (`_own`), not sent to itself."""
    me, world = dist.get_rank(), dist.get_world_size()
    mine_r = recipients[me]
    with_routes = spec is not None and all(s.has_routes for s in samples) and bool(samples)
    dtype = compact_dtype(spec.num_experts) if with_routes else torch.uint8
    itemsize = dtype.itemsize
    topk = spec.topk if with_routes else 0
    order = sorted(dp_of)  # both sides walk samples in index order
    outgoing = []
    for r in recipients:  # r.rank == its index
        mine = [i for i in order if samples[i].owner == me and dp_of[i] == r.dp_rank and r.rank != me]
        outgoing.append(_encode([samples[i] for i in mine], list(r.layer_cols), with_routes,
                                _rows(samples, mine, shards, r)))
    # the world group is NCCL on GPUs: device tensors only (platform.device(); the host on CPU)
    device = platform.device() if group is None else wire_device(group)
    send_sizes = [sum(t.numel() for t in parts) for parts in outgoing]
    n_cols = len(mine_r.layer_cols)
    expected = [i for i in order if dp_of[i] == mine_r.dp_rank]
    out = _own(samples, [i for i in expected if samples[i].owner == me], mine_r, shards, with_routes)
    idx_src = [[i for i in expected if samples[i].owner == src and src != me] for src in range(world)]
    from_src = [[samples[i] for i in idx] for idx in idx_src]
    rows_src = [_rows(samples, idx, shards, mine_r) for idx in idx_src]
    blocks = [_blocks(f, n_cols, topk, itemsize, with_routes, r) for f, r in zip(from_src, rows_src)]
    recv_sizes = [sum(b) for b in blocks]
    send = torch.cat([t for parts in outgoing for t in parts]) if any(send_sizes) else torch.empty(0, dtype=torch.uint8)
    send = send.to(device)
    recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=device)
    dist.all_to_all_single(recv, send, output_split_sizes=recv_sizes, input_split_sizes=send_sizes, group=group)
    recv = recv.cpu()  # one copy; the micro-batches are cut on the host and moved once (MicroBatch.to)
    base = 0
    for src in range(world):
        got = from_src[src]
        if not got:
            continue
        # views of the received bytes, no copy: every block starts at a multiple of 4 (_blocks' padding)
        pieces, pos = [], base
        for n in blocks[src]:
            pieces.append(recv[pos:pos + n])
            pos += n
        base = pos
        tokens = sum(s.prompt_len + s.response_len for s in got)
        ids = pieces[0][:4 * tokens].view(torch.int32).long().split([s.prompt_len + s.response_len for s in got])
        lps = pieces[1][:4 * sum(s.response_len for s in got)].view(torch.float32).split([s.response_len for s in got])
        routes = replaced = [None] * len(got)
        if with_routes:
            # explicit row counts: a pipeline stage without MoE layers (dense first layers) has n_cols == 0
            spans = [_count(r) for r in rows_src[src]]
            routes = pieces[2][:sum(spans) * n_cols * topk * itemsize].view(dtype).reshape(
                sum(spans), n_cols, topk).split(spans)
            flagged = [k for s, k in zip(got, spans) if s.replaced_entries]
            rep = iter(pieces[3][:sum(flagged) * n_cols].reshape(sum(flagged), n_cols).bool().split(flagged)
                       if flagged else ())
            replaced = [next(rep) if s.replaced_entries else None for s in got]
        for i, x, lp, rt, rp, rows in zip(idx_src[src], ids, lps, routes, replaced, rows_src[src]):
            p = samples[i].prompt_len
            out[i] = replace(samples[i], prompt_ids=x[:p], response_ids=x[p:], logprobs=lp, routes=rt, replaced=rp,
                             routes_from=rows[0][0] if rows else 0, routes_rows=rows)
    return out, int(recv.numel())


def _own(samples: Sequence[Sample], idx: Sequence[int], recipient, shards: Optional[dict],
         with_routes: bool) -> dict[int, Sample]:
    """This rank's own samples that it trains, as the wire would deliver them (ids as int64 host tensors, its
    route columns and rows) without the round trip through the collective: views of the owner's payload where
    they can be (the owner keeps it; nothing downstream writes to it)."""
    cols = list(recipient.layer_cols)
    out = {}
    for i, rows in zip(idx, _rows(samples, idx, shards, recipient)):
        s = samples[i]
        routes = replaced = None
        if with_routes:
            routes = _cut(s.routes.cpu(), rows)
            routes = routes if len(cols) == routes.shape[1] else routes[:, cols]
            replaced = _cut(s.replaced.cpu(), rows)[:, cols] if s.replaced_entries else None
        ids = s.ids.cpu()  # on the host, as the wire delivers (an engine on the GPU returns device tensors)
        out[i] = replace(s, prompt_ids=ids[:s.prompt_len], response_ids=ids[s.prompt_len:],
                         logprobs=s.logprobs.cpu().to(torch.float32), routes=routes, replaced=replaced,
                         routes_from=rows[0][0] if rows else 0, routes_rows=rows)
    return out
