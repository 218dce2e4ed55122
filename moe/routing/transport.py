"""Cut routing traces for the ranks that need them, laid out exactly like the trainer's tokens.

A sample's routes are needed by the ranks of ONE data-parallel rank (the one training it), and each of
those only needs its pipeline stage's MoE layers and, with sequence parallelism, its sequence shard. So
every token's route crosses the wire once per MoE layer: layers * topk bytes/token with uint8 ids. (slime
broadcast every DP rank's full tensor to every TP/PP rank and ran hosts out of memory: its issue 2384.)

Layout: a `placement` says where each sample's trace rows sit in the trainer's input tensor [rows, seq]:
Segment(sample, row, offset, length) puts trace row t at input position offset + t of `row`. Padded
batches have one sample per row at offset 0; packed rows hold several samples (each sample's last token
is an input position without a route). Positions without a route are PAD (-2); entries the trace marked
`replaced` are LIVE (-1): both are routed by the trainer's live router (moe.routing.replay).

The DP split is the trainer's: DP rank r trains the r-th contiguous block of rows (rlpo_mega.training.warmup.shard_and_split).
The local result is [rows of this DP rank, local sequence shard, local MoE layers, topk] int16 (int32
beyond 32768 experts): on the host from `local_routes` (the routing driver moves them with the batch),
on the wire device from `scatter_routes` (NCCL sends device tensors only).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .trace import RoutingTrace, TraceSpec, compact_dtype

PAD = -2  # no token / no route (padding, the last token of a packed sample)
LIVE = -1  # a real token whose route the live router decides (fallback)


@dataclass(frozen=True)
class Segment:
    sample: int
    row: int
    offset: int
    length: int


def padded_placement(num_tokens: Sequence[int]) -> list[Segment]:
    """One sample per row, right-padded: trace row t routes input position t."""
    return [Segment(i, i, 0, n) for i, n in enumerate(num_tokens)]


def packed_placement(spans: Sequence[int], seq_len: int) -> list[Segment]:
    """Samples packed in order into rows of seq_len input positions; sample i occupies `spans[i]` positions
    (all its tokens) and routes its first spans[i] - 1 (the last token never ran in the engine)."""
    out, row, pos = [], 0, 0
    for i, span in enumerate(spans):
        if span > seq_len:
            raise ValueError(f"sample {i} spans {span} positions, more than a row ({seq_len})")
        if pos + span > seq_len:
            row, pos = row + 1, 0
        out.append(Segment(i, row, pos, span - 1))
        pos += span
    return out


@dataclass(frozen=True)
class Recipient:
    """What one rank needs: its DP rank, its sequence shard (and context-parallel chunks) and its routers' trace
    columns (in order)."""

    rank: int
    dp_rank: int
    dp_size: int
    sp_rank: int
    sp_size: int  # 1 without sequence parallelism
    layer_cols: tuple
    cp_rank: int = 0
    cp_size: int = 1  # 1 without context parallelism

    def shard(self, seq_len: int) -> tuple[int, int]:
        if seq_len % self.sp_size:
            raise ValueError(f"sequence length {seq_len} is not divisible by the sequence-parallel size {self.sp_size}")
        n = seq_len // self.sp_size
        return self.sp_rank * n, (self.sp_rank + 1) * n

    def rows(self, n_rows: int) -> tuple[int, int]:
        if n_rows % self.dp_size:
            raise ValueError(f"{n_rows} rows are not divisible by the data-parallel size {self.dp_size}")
        n = n_rows // self.dp_size
        return self.dp_rank * n, (self.dp_rank + 1) * n


def local_routers(model_chunks):
    """(decoder layer index, TopKRouter) of this rank's MoE layers, in instantiation order."""
    from megatron.core.transformer.moe.router import TopKRouter

    out = []
    for chunk in model_chunks:
        for m in chunk.modules():
            if isinstance(m, TopKRouter):
                out.append((m.layer_number - 1, m))
    return out


def local_recipient(model_chunks, spec: TraceSpec) -> Recipient:
    from megatron.core import parallel_state as ps

    cols = []
    for layer, _ in local_routers(model_chunks):
        if layer not in spec.moe_layers:
            raise ValueError(f"decoder layer {layer} has a router but is not a MoE layer of the trace spec "
                             f"{spec.moe_layers}")
        cols.append(spec.moe_layers.index(layer))
    config = model_chunks[0].config
    sp = bool(config.sequence_parallel)
    return Recipient(dist.get_rank(), ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(),
                     ps.get_tensor_model_parallel_rank() if sp else 0,
                     ps.get_tensor_model_parallel_world_size() if sp else 1, tuple(cols),
                     ps.get_context_parallel_rank(), ps.get_context_parallel_world_size())


def gather_recipients(model_chunks, spec: TraceSpec) -> list[Recipient]:
    """Every rank's needs (one small all-gather at set-up; valid for the model's lifetime)."""
    mine = local_recipient(model_chunks, spec)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


def _pieces(placement, rcpt: Recipient, n_rows: int, seq_len: int):
    """(sample, t0, t1, local row, local position of t0) for the recipient, in a fixed order."""
    r0, r1 = rcpt.rows(n_rows)
    a, b = rcpt.shard(seq_len)
    out = []
    for seg in placement:
        if not r0 <= seg.row < r1:
            continue
        if seg.offset + seg.length > seq_len:
            raise ValueError(f"sample {seg.sample}: trace rows end at position {seg.offset + seg.length}, "
                             f"past the sequence length {seq_len}")
        lo, hi = max(a, seg.offset), min(b, seg.offset + seg.length)
        if lo < hi:
            out.append((seg.sample, lo - seg.offset, hi - seg.offset, seg.row - r0, lo - a))
    return out


def _check_rows(placement, n_rows):
    for seg in placement:
        if not 0 <= seg.row < n_rows:
            raise ValueError(f"sample {seg.sample} is placed in row {seg.row}; the batch has {n_rows} rows")


def pack(traces: Sequence[RoutingTrace], pieces, cols) -> tuple[torch.Tensor, torch.Tensor]:
    """The recipient's payload: its ids (compact dtype, flat) and the flat indices of replaced entries."""
    cols = list(cols)
    ids, rep, base = [], [], 0
    for sample, t0, t1, _, _ in pieces:
        tr = traces[sample]
        ids.append(tr.ids[t0:t1][:, cols].reshape(-1))
        if tr.replaced is not None:
            r = tr.replaced[t0:t1][:, cols].reshape(-1).nonzero().flatten()
            rep.append(r + base)
        base += (t1 - t0) * len(cols)
    dtype = traces[0].ids.dtype if traces else torch.uint8
    flat = torch.cat(ids) if ids else torch.empty(0, dtype=dtype)
    replaced = torch.cat(rep).to(torch.int32) if rep else torch.empty(0, dtype=torch.int32)
    return flat, replaced


def unpack(flat, replaced, pieces, n_local_rows, shard_len, n_cols, topk) -> torch.Tensor:
    """The recipient's routes, on the payload's device."""
    dtype = torch.int32 if flat.dtype == torch.int32 else torch.int16  # int16 holds ids < 32768 and markers
    out = torch.full((n_local_rows, shard_len, n_cols, topk), PAD, dtype=dtype, device=flat.device)
    entries = flat.to(dtype).reshape(-1, topk)  # one row per (token, layer)
    if replaced.numel():
        entries[replaced.long()] = LIVE
    base = 0
    for _, t0, t1, row, pos in pieces:
        n = (t1 - t0) * n_cols
        out[row, pos:pos + t1 - t0] = entries[base:base + n].reshape(t1 - t0, n_cols, topk)
        base += n
    return out


def local_routes(traces: Sequence[RoutingTrace], placement, rcpt: Recipient, n_rows: int, seq_len: int,
                 topk: int) -> torch.Tensor:
    """This rank's routes cut from traces it already holds (no communication)."""
    _check_rows(placement, n_rows)
    pieces = _pieces(placement, rcpt, n_rows, seq_len)
    flat, rep = pack(traces, pieces, rcpt.layer_cols)
    a, b = rcpt.shard(seq_len)
    r0, r1 = rcpt.rows(n_rows)
    return unpack(flat, rep, pieces, r1 - r0, b - a, len(rcpt.layer_cols), topk)


def wire_device(group=None) -> torch.device:
    """Where a point-to-point payload must live: the current GPU for NCCL (it sends nothing else), else the
    host (gloo)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def scatter_routes(traces: Optional[Sequence[RoutingTrace]], placement, recipients: Sequence[Recipient],
                   n_rows: int, seq_len: int, spec: TraceSpec, src: int = 0, group=None,
                   device=None) -> tuple[torch.Tensor, dict]:
    """Rank `src` holds every sample's trace and sends each rank only its cut (point-to-point); the
    placement (a few ints per sample) is known everywhere. Returns this rank's routes (on `device`, by
    default the group's wire_device) and, on `src`, the bytes sent (payload per valid token: layers *
    topk * itemsize when every route goes to one rank)."""
    _check_rows(placement, n_rows)
    device = wire_device(group) if device is None else torch.device(device)
    me = dist.get_rank()
    rcpt = next(r for r in recipients if r.rank == me)
    dtype = compact_dtype(spec.num_experts)
    stats = {}
    if me == src:
        payload = header = 0
        mine = None
        for r in recipients:
            pieces = _pieces(placement, r, n_rows, seq_len)
            flat, rep = (x.to(device) for x in pack(traces, pieces, r.layer_cols))  # cut on the host
            payload += flat.numel() * flat.element_size() + rep.numel() * rep.element_size()
            if r.rank == me:
                mine = (pieces, flat, rep)
                continue
            head = torch.tensor([flat.numel(), rep.numel()], dtype=torch.int64, device=device)
            header += head.numel() * 8
            dist.send(head, r.rank, group=group)
            if flat.numel():
                dist.send(flat, r.rank, group=group)
            if rep.numel():
                dist.send(rep, r.rank, group=group)
        pieces, flat, rep = mine
        tokens = sum(seg.length for seg in placement)
        stats = {"routing/payload_bytes": payload, "routing/header_bytes": header, "routing/tokens": tokens,
                 "routing/bytes_per_token": payload / max(tokens, 1)}
    else:
        pieces = _pieces(placement, rcpt, n_rows, seq_len)
        head = torch.empty(2, dtype=torch.int64, device=device)
        dist.recv(head, src, group=group)
        expect = sum(t1 - t0 for _, t0, t1, _, _ in pieces) * len(rcpt.layer_cols) * spec.topk
        if int(head[0]) != expect:
            raise RuntimeError(f"rank {me}: {int(head[0])} route ids arrived, the placement needs {expect}: "
                               "the ranks disagree about the batch layout")
        flat = torch.empty(expect, dtype=dtype, device=device)
        rep = torch.empty(int(head[1]), dtype=torch.int32, device=device)
        if expect:
            dist.recv(flat, src, group=group)
        if rep.numel():
            dist.recv(rep, src, group=group)
    a, b = rcpt.shard(seq_len)
    r0, r1 = rcpt.rows(n_rows)
    return unpack(flat, rep, pieces, r1 - r0, b - a, len(rcpt.layer_cols), spec.topk), stats
